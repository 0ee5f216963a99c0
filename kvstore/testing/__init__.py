"""Conformance test classes that a backend of tlkv runs against itself (zarr ships
``zarr.testing.store.StoreTests`` the same way): subclass one in a pytest module, give it
the fixtures it names, and every case runs on the backend.

- ``TargetTests``: what every engine bridge relies on from a ``kvstore.engines.Target``
  (a store directory, HTTP, tl.kv.v1, or an outside target): give a ``target`` fixture
  (an empty namespace per test) and, optionally, ``corrupt``.
- ``TierBackendTests``: what the store, the uploader and the archive rely on from the
  object-store tier (``ObjectClient`` and ``Tier``): give a ``backend`` fixture (a
  ``TierBackend``, a fresh tier root per test).
- ``ArraySlots``: plain ``BlockSlots`` over one numpy array, that ``TargetTests`` loads into.

Needs pytest (the ``test`` extra); ``import kvstore`` never imports this package.
"""

from __future__ import annotations

from .slots import ArraySlots
from .targets import TargetTests
from .tier import TierBackend, TierBackendTests

__all__ = ["ArraySlots", "TargetTests", "TierBackend", "TierBackendTests"]
