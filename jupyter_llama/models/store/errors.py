"""What a store operation raises. Each is a :class:`~jupyter_llama.errors.JupyterLlamaError`
whose ``status`` is the HTTP answer the server gives and whose message says what to do.
(:class:`~jupyter_llama.errors.StorageFull`, a disk or quota that ran out, is the package's
own; :class:`~jupyter_llama.models.store.access.PathNotAllowed` lives beside the rule it
enforces.)"""

from __future__ import annotations

from pathlib import Path

from ...errors import BadRequest, JupyterLlamaError
from ..gguf_info import GGUFError


class StoreError(JupyterLlamaError):
    """A registry operation failed; the message says what to do."""

    status = 500


class BlobCorrupt(StoreError):
    """A blob's bytes no longer match its digest (or its size, or it is missing)."""

    status = 500

    def __init__(self, message: str, digest: str = "", problem: str = ""):
        self.digest = digest
        self.problem = problem
        super().__init__(message)


class BlobMissing(StoreError):
    """A blob a manifest was about to use disappeared (removed concurrently); retry."""

    status = 409


class StoreGone(StoreError):
    """The store's folder was there and is not any more (deleted while a manager used it):
    nothing is made again behind the user's back; the message says what to do."""

    status = 503

    def __init__(self, root: Path):
        self.root = root
        super().__init__(f"the model folder {root} was deleted while this manager was using it: restart the "
                         "manager for a new one (`jupyter-llama status --stop` stops the background manager; the "
                         "next command starts it), or put the folder back")


class StoreBusy(StoreError):
    """Another operation held a lock this one needed (on a blob, or on the list of models)
    for longer than :data:`LOCK_WAIT`, or the server is stopping; nothing was changed."""

    status = 409


class InvalidGGUF(GGUFError, BadRequest):
    """A file offered to the store is not a usable GGUF (a GGUFError that is also HTTP 400)."""
