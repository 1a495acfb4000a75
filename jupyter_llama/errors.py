"""The errors every layer raises, each with the HTTP status the server answers it with.

They live below everything that raises them (models, memory, engine, api, scheduler), so no
module of the core imports upward for an error type; the server maps ``status`` once.
"""

from __future__ import annotations


class JupyterLlamaError(RuntimeError):
    """The root of the errors the manager answers with an HTTP status (``status``): the
    server maps it once; anything else that escapes a handler is a bug (a 500 that says so)."""

    status = 500


class SchedulerError(JupyterLlamaError):
    """What the scheduler refuses or fails at: loads, fits, leases, its own shutdown."""


class ModelNotFound(JupyterLlamaError):
    status = 404

    def __init__(self, name: str, hint: str = "", *, missing_file: str | None = None):
        self.name = name
        self.missing_file = missing_file
        if missing_file is not None:  # (a path: pulling is no answer; "not found" stays, for Ollama's clients)
            super().__init__(f'model "{name}" not found: no such file {missing_file}')
            return
        super().__init__(f'model "{name}" not found, try pulling it first' + (f" ({hint})" if hint else ""))


class NotLoaded(SchedulerError):
    status = 404

    def __init__(self, name: str):
        self.name = name
        super().__init__(f'model "{name}" is not loaded; load it (or send it a request) first, '
                         "and `ps` lists what is loaded")


class ServerBusy(SchedulerError):
    status = 503


class DoesNotFit(SchedulerError):
    status = 507


class PinnedInTheWay(DoesNotFit):
    pass


class StorageFull(JupyterLlamaError):
    """The disk (or the user's quota) holding the model store filled up during a write: an
    import, an upload, a copy, a manifest, a download. The message says what filled up, how
    much was needed when that is known, and what to do; whoever raises it has removed what it
    had half-written. ``needed`` and ``free`` are in bytes (None when not known)."""

    status = 507

    def __init__(self, message: str, *, path: str | None = None, needed: int | None = None,
                 free: int | None = None):
        self.path = path
        self.needed = needed
        self.free = free
        super().__init__(message)


class LoadFailed(SchedulerError):
    status = 500


class LoadCancelled(SchedulerError):
    """A load the manager stopped before it was ready, for a reason of its own (the model's
    name now means another file, an unload): the requests that waited for it are answered
    with this, which says why, and sending the request again loads what the name means now."""

    status = 409


class NoSuchRoute(JupyterLlamaError):
    status = 404


class NotSupported(JupyterLlamaError):
    status = 501


class BadRequest(JupyterLlamaError):
    status = 400


# On a manager shared by many people (scheduler.fairness): a person's quotas and rights.
class PayloadTooLarge(JupyterLlamaError):
    """An upload (a blob) larger than the server takes."""

    status = 413


class QuotaExceeded(SchedulerError):
    """A person's requests at once, or in the last minute, are at their quota: try again later."""

    status = 429


class OverMemoryQuota(DoesNotFit):
    """A load would take this person past their memory or loaded-model quota."""

    status = 507


class Forbidden(JupyterLlamaError):
    """The person may not do this (change the shared library, stop another person's model)."""

    status = 403


class EngineError(RuntimeError):
    """Something went wrong with a llama-server child; the message is for the user."""


class RequestError(EngineError):
    """The child answered a request with an HTTP error; ``status`` is its status code and
    ``kind`` the type it gave the error (llama-server's ``error.type``), when it gave one."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        self.status = status
        self.kind = kind
        super().__init__(message)

    @property
    def context_exceeded(self) -> bool:
        """The request's prompt is longer than the context the child has for it."""
        return self.kind == "exceed_context_size_error"
