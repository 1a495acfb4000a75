"""A package split into seam modules that still takes a setting as the one module did.

Tests (and an embedding program) set a module's names to change how it behaves:
``store.PRUNE_GRACE = 0``, ``estimate.machine_memory = ...``. Once such a module became a
package whose functions live in seam modules, setting the name on the package alone would
reach none of them. :func:`forward_settings` makes setting a name on the package also set it
in every seam module that holds the same object under that name, and undoing it undo it
there; the seams never import the package (which would be an import cycle).
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["forward_settings"]

_MISSING = object()


def forward_settings(package: str, seams: tuple[types.ModuleType, ...]) -> None:
    """Make the module ``package`` (its ``__name__``) forward what is set on it to ``seams``."""

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            old = self.__dict__.get(name, _MISSING)
            if old is not _MISSING and not isinstance(old, types.ModuleType):
                for seam in seams:
                    if seam.__dict__.get(name, _MISSING) is old:
                        setattr(seam, name, value)
            super().__setattr__(name, value)

    sys.modules[package].__class__ = Package
