"""``python -m kvstore`` runs the ``tlkv`` command line."""

from .cli import main

raise SystemExit(main())
