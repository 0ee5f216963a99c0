"""``python -m kvstore`` runs the ``tlkv`` command line."""

from .cli.main import main

raise SystemExit(main())
