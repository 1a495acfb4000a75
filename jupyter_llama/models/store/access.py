"""Which files a caller may name by their path.

A model may be named by the path of a GGUF file (where the store allows paths at all). The
server's own user may name any file; other HTTP clients only files inside the folders the
server was told (``JUPYTER_LLAMA_MODEL_PATHS``), or none. The server's handlers set
:data:`local_caller` per request; a library call outside a server leaves it None.
"""

from __future__ import annotations

import contextvars
import os

from ...errors import BadRequest
from ..names import plainly_a_path


class PathNotAllowed(BadRequest):
    """A model named by a file path, from a caller who may not name server files."""


# Whether this request comes from a caller who may name files on this machine by their path:
# True for the CLI, magics and widgets of the server's own user (they prove it by reading a
# key file only that user can read), False for every other HTTP client, None outside a server
# (a library call in the user's own process). Set per request by the server's handlers.
local_caller: contextvars.ContextVar[bool | None] = contextvars.ContextVar("jupyter_llama_local_caller",
                                                                           default=None)
# Added to a PathNotAllowed answer: where a same-user client finds the key that proves it.
LOCAL_KEY_HEADER = "X-Jupyter-Llama-Local-Key"
LOCAL_KEY_FILE_HEADER = "X-Jupyter-Llama-Local-Key-File"


class PathAccess:
    """The store's rule for names that are file paths (a part of ModelStore)."""

    allow_paths: bool  # whether names may be file paths at all (set by ModelStore.__init__)
    path_folders: tuple[str, ...] | None  # where other callers may name files; None: anywhere

    @staticmethod
    def _looks_like_path(text: str) -> bool:
        return plainly_a_path(text) or os.sep in text or "/" in text

    def may_read_path(self, path: str) -> bool:
        """Whether this caller may name ``path`` (absolute): the user's own callers anywhere,
        others only inside ``path_folders``. Decided without looking at the file."""
        if local_caller.get() is not False or self.path_folders is None:
            return True
        real = os.path.realpath(path)
        return any(real == f or real.startswith(f.rstrip(os.sep) + os.sep) for f in self.path_folders)

    def server_file(self, text: str) -> str:
        """``text`` as an absolute path this caller may read, or :class:`PathNotAllowed`
        (which says nothing of whether the file exists)."""
        path = os.path.abspath(os.path.expanduser(text))
        if not self.may_read_path(path):
            where = (f"only files under {', '.join(self.path_folders)} may be named by path"
                     if self.path_folders else "HTTP clients may not name files on the server by their path")
            raise PathNotAllowed(
                f'"{text}" is a file path, and on this server {where} (JUPYTER_LLAMA_MODEL_PATHS). Register the '
                "file as a model from this machine's own jupyter-llama CLI or %llama (`jupyter-llama create NAME "
                "--from PATH`), upload it (POST api/blobs, then api/create with files), or pull it by URL")
        return path

    def _missing_file(self, text: str) -> str | None:
        """The absolute path ``text`` names when it can only be a file, is one this caller may
        name, and is not there (its not-found speaks of the file, not of pulling)."""
        if not self.allow_paths or not plainly_a_path(text):
            return None
        path = os.path.abspath(os.path.expanduser(text))
        return path if self.may_read_path(path) and not os.path.isfile(path) else None
