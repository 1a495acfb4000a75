"""The errors a client raises: :class:`LlamaError`, a subclass per status the manager answers
with, and :class:`ServerNotFound` when there is no server to ask.

The status of each class is taken from the error the manager raises for it
(:mod:`jupyter_llama.errors`), so that the two cannot disagree; :func:`_error` picks the
class for an answer's status, :func:`_message_of` the sentence of its body.
"""

from __future__ import annotations

import json

from .. import errors

# How to start a server: how the messages end when none was found or none answers.
HOW_TO_START = ("start one with `jupyter-llama serve` (then set JUPYTER_LLAMA_URL and JUPYTER_LLAMA_TOKEN, "
                "or give them as --url and --token, url= and token= in Python), or run inside JupyterLab / "
                "Jupyter Server with the jupyter_llama extension enabled, which exports JUPYTER_LLAMA_URL to its "
                "kernels")


class LlamaError(Exception):
    """An error answer from the server: ``status`` (HTTP, or None) and ``message``."""

    status: int | None = None

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.message} (HTTP {self.status})"


# One class per status the manager answers with, its status taken from the error the manager
# raises for it (jupyter_llama.errors), so that the two cannot disagree.


class BadRequestError(LlamaError):
    status = errors.BadRequest.status


class ForbiddenError(LlamaError):
    """The server knows who asked and does not allow it (on a Hub: another user's model)."""

    status = errors.Forbidden.status


class ModelNotFoundError(LlamaError):
    status = errors.ModelNotFound.status


class ConflictError(LlamaError):
    """The name changed or was deleted while the request waited; asking again may work."""

    status = errors.LoadCancelled.status


class TooLargeError(LlamaError):
    """A body or an upload larger than the server takes; the message says its limit."""

    status = errors.PayloadTooLarge.status


class QuotaExceededError(LlamaError):
    """Over one of the Hub admin's quotas (requests at once or a minute); the message names it."""

    status = errors.QuotaExceeded.status


class ServerBusyError(LlamaError):
    status = errors.ServerBusy.status


class DoesNotFitError(LlamaError):
    status = errors.DoesNotFit.status


class ServerNotFound(LlamaError):
    """No jupyter-llama server could be found; the message says how to start one."""


_BY_STATUS: dict[int, type[LlamaError]] = {
    c.status: c for c in (BadRequestError, ForbiddenError, ModelNotFoundError, ConflictError, TooLargeError,
                          QuotaExceededError, ServerBusyError, DoesNotFitError) if c.status is not None}


def _error(status: int | None, message: str) -> LlamaError:
    return _BY_STATUS.get(status or 0, LlamaError)(message, status)


def _message_of(body: bytes | str, status: int) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:500] or f"HTTP {status}"
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)
    return str(data)


class SettingsDiffer(ServerNotFound):
    """The background manager runs with other settings than this process's and is in use,
    so it is neither used (the command would act on its store, with its budgets) nor
    restarted (its models would go); the message says how to proceed."""


def _unreachable(url: str, e: Exception) -> ServerNotFound:
    """No connection to the server at ``url``: what happened, and how to start one."""
    return ServerNotFound(f"cannot reach the jupyter-llama server at {url}: {e}; {HOW_TO_START}")


def _check_line(line: str) -> dict | None:
    """One line of a streamed answer: None for a blank line; an ``{"error": ...}`` line (the
    server failed after the answer began) raises."""
    if not line.strip():
        return None
    data = json.loads(line)
    if isinstance(data, dict) and "error" in data and len(data) == 1:
        err = data["error"]
        raise _error(500, err.get("message", str(err)) if isinstance(err, dict) else str(err))
    return data
