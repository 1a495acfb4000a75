"""The errors a pull raises. Each says why in words and what to do; a server answers with its
``status``."""

from __future__ import annotations

from ...errors import StorageFull
from ..store import StoreError

__all__ = ["PullError", "PullCancelled", "DiskFull", "HashMismatch", "NotAModel", "NotInRegistry",
           "RegistryUnreachable", "BadManifest"]


class PullError(StoreError):
    """A pull failed; the message says why and what to do. Nothing half-written is left
    behind except a ``.partial`` download kept for resume."""

    status = 400


class PullCancelled(PullError):
    status = 499


class DiskFull(PullError, StorageFull):
    """A download that did not fit: the store's one disk-full error (``errors.StorageFull``,
    HTTP 507), raised by a pull."""

    status = 507


class HashMismatch(PullError):
    status = 502


class NotAModel(PullError):
    """The URL serves something other than a GGUF file (an HTML page, JSON, text...)."""


class NotInRegistry(PullError):
    """The registry has no such model or tag (it answered 404)."""

    status = 404


class RegistryUnreachable(PullError):
    """The registry did not answer (no connection, DNS, TLS, or it kept failing with 5xx)."""

    status = 502


class BadManifest(PullError):
    """The registry answered the manifest request with something that is not a v2 manifest,
    or a preset layer that does not hold what its media type says."""

    status = 502
