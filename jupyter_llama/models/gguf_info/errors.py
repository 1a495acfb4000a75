"""The errors of reading a GGUF file: :class:`GGUFError` for callers, and :class:`_Truncated`,
which the readers raise inside and turn into a GGUFError that says how short the file is."""

from __future__ import annotations

import os


class GGUFError(ValueError):
    """A file that cannot be read as a GGUF model. ``str()`` is ``"<path>: <reason>"``, one line."""

    def __init__(self, path: os.PathLike | str, reason: str):
        self.path = str(path)
        self.reason = " ".join(str(reason).split())  # one line
        super().__init__(f"{self.path}: {self.reason}")


class _Truncated(Exception):
    def __init__(self, needed: int, size: int, phase: str = "header"):
        super().__init__(needed, size, phase)
        self.needed = needed
        self.size = size
        self.phase = phase
