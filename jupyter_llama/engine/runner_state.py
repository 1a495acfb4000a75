"""A runner's states, and the errors a runner's child ends in: a failed start, a crash
while serving, a start its manager stopped. Shared by the parts of :class:`~.runner.Runner`
and importable from :mod:`.runner`, as they were when the runner was one module."""

from __future__ import annotations

import enum

from ..errors import EngineError

CRASH_MESSAGE = ("model runner has unexpectedly stopped, this may be due to resource limitations "
                 "or an internal error")


class LoadError(EngineError):
    """The child failed to start. Carries its exit code and its last error lines."""

    def __init__(self, message: str, *, exit_code: int | None = None, log_lines: list[str] | None = None,
                 oom: bool = False):
        self.exit_code = exit_code
        self.log_lines = list(log_lines or [])
        self.oom = oom
        detail = "\n".join(f"  | {ln}" for ln in self.log_lines[-10:])
        super().__init__(message + (f"\nlast lines of the llama-server log:\n{detail}" if detail else ""))


class RunnerCrashed(EngineError):
    """The child died while serving a request. ``retryable``: it was dead before any of the
    request's answer went to the caller (the request found it dead, or its connection broke
    before the first event), so sending the request again, to a fresh child, repeats nothing
    the caller has seen; False when some of the answer had gone, or when the child was
    killed for not answering (a request that wedges a child may well wedge the next)."""

    def __init__(self, message: str, *, retryable: bool = False):
        self.retryable = retryable
        super().__init__(message)


class LoadStopped(EngineError):
    """The child's start was stopped by its manager (:meth:`~.runner.Runner.stop` while it loaded): no
    crash of the engine, and no fault of the model. Whoever stopped it says why."""


class RunnerState(enum.StrEnum):
    """A runner's life: new -> starting -> ready -> stopping -> stopped, or failed."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
