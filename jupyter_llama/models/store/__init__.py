"""The model registry: content-addressed blobs and named manifests, as in Ollama.

Layout under the root (``JUPYTER_LLAMA_MODELS``, else ``<jupyter data dir>/llama/models``)::

    blobs/sha256-<hex>                       the files, named by their sha256
    manifests/<host>/<namespace>/<model>/<tag>   one JSON document per name
    verified/sha256-<hex>.json               when a blob's hash was last checked (size, mtime, inode)
    partial/<key>.partial, <key>.json        downloads in progress (kept for resume)
    urls/<key>.json                          which blob a plain URL gave last time
    locks/<key>.lock                         a lock per blob digest or download while in use, plus ``manifests.lock``
    uploads/sha256-<hex>                     when a blob was last uploaded (POST /api/blobs), until a prune
    tmp/                                     imports and synthetic models before they land

A manifest lists its layers (the model GGUF, and an optional multimodal projector GGUF with
Ollama's media type ``application/vnd.ollama.image.projector``, and the preset layers Ollama
keeps beside the weights: system, template, params, license, messages; see ``models.preset``),
the model's GGUF summary
(``GGUFInfo.to_dict(tensors=False)``, so ``list`` and ``show`` never reopen a blob), its
created/modified times and where it came from (a file, a URL, a Hugging Face repo and
file, a synthetic shape, or a copy).

Writes are atomic (a temporary file beside the target, then ``os.replace``). Whoever makes
a manifest point at a blob holds that blob's file lock from landing (or finding) the blob
until the manifest is written, and the garbage collector deletes a blob only under its lock
after re-reading every manifest; so a blob is never deleted under a model that is being
created, copied or pulled, in this process or another. Locks are held for short steps only
(landing a file, writing a manifest), are always released (on errors too), and are waited
for at most :data:`LOCK_WAIT` seconds: an operation that cannot get one answers
:class:`StoreBusy` (409) instead of waiting forever. Operations racing on one name end as
one of them or the other, a 404 (the name went away) or a 409 (try again).

Reclaiming space: deleting a model (or pointing its name at other files) deletes the blobs
no other manifest uses. ``prune`` (:meth:`ModelStore.prune_partials`) also drops partial
downloads no pull is working on, blobs no model uses, and what ended processes left in
``tmp/``; a blob written in the last :data:`PRUNE_GRACE` seconds is kept, since an upload
(``POST /api/blobs``) or a pull names its blobs only when it finishes.

Integrity: ``resolve`` compares every blob's size with the manifest each time (cheap) and
rehashes a blob only when its size, mtime or inode differ from what ``verified/`` recorded
at the last good hash (so once per change: a hard-linked file edited in place is caught).
A mismatch raises :class:`BlobCorrupt`, whose message names the command that repairs it.
``show(name, verify=True)`` always rehashes.

Blobs are not fsynced (Ollama does not either): after a power cut a torn blob shows a
wrong size, which the size check catches. Manifests and the small state files are fsynced.

The store is a package, one seam a module: ``layout`` (the root, its folders, atomic writes,
a full disk said in words), ``errors``, ``access`` (which files a caller may name by path),
``locks``, ``blobs``, ``summary`` (what a manifest keeps of a GGUF), ``manifests`` (names to
entries), ``prune``, ``presets``, ``create`` and ``resolve``. :class:`ModelStore`, here, is
those parts put together; each name below is importable from this package as it was from
the one module.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Awaitable, Callable, Iterable

from ...errors import ModelNotFound as ModelNotFound
from ...errors import StorageFull
from ...seams import forward_settings
from ..gguf_info import GGUFInfo
from ..gguf_info import read_gguf_info as read_gguf_info
from ..names import ModelName
from ..ref import ModelRef, parameter_size
from . import access, blobs, create, errors, layout, locks, manifests, presets, prune, resolve, summary
from .access import LOCAL_KEY_FILE_HEADER as LOCAL_KEY_FILE_HEADER
from .access import LOCAL_KEY_HEADER as LOCAL_KEY_HEADER
from .access import PathNotAllowed as PathNotAllowed
from .access import local_caller as local_caller
from .blobs import CHUNK as CHUNK
from .blobs import Progress as Progress
from .blobs import _Throttle as _Throttle
from .blobs import hash_file as hash_file
from .create import Creating
from .errors import BlobCorrupt, BlobMissing, InvalidGGUF, StoreBusy, StoreError, StoreGone
from .layout import _unlink as _unlink
from .layout import atomic_write_json, default_root, normalize_digest
from .layout import fmt_bytes as fmt_bytes
from .layout import free_bytes as free_bytes
from .layout import is_disk_full as is_disk_full
from .layout import storage_full as storage_full
from .locks import LOCK_WAIT
from .locks import RemovableLock as RemovableLock
from .manifests import MANIFEST_MEDIA_TYPE, MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, ModelEntry
from .prune import PRUNE_GRACE
from .resolve import Resolving
from .summary import _projector_summary as _projector_summary
from .summary import info_summary

# Besides __all__, the names imported ``as`` themselves above are imported from here by the
# pulls, the server, the client and the tests.
__all__ = [
    "atomic_write_json",
    "MODEL_MEDIA_TYPE",
    "PROJECTOR_MEDIA_TYPE",
    "MANIFEST_MEDIA_TYPE",
    "StoreError",
    "StorageFull",
    "BlobCorrupt",
    "BlobMissing",
    "StoreBusy",
    "StoreGone",
    "LOCK_WAIT",
    "PRUNE_GRACE",
    "InvalidGGUF",
    "ModelEntry",
    "ModelStore",
    "default_root",
    "normalize_digest",
    "parameter_size",
]

BeforeRemove = Callable[[ModelRef], Awaitable[Any]]


class ModelStore(Creating, Resolving):
    """The registry. Sync methods do file I/O; ``resolve``, ``remove`` and the pulls are async.

    An instance is itself a scheduler resolver: ``Scheduler(settings, resolver=store)``.

    Its methods come from the seams' parts: :class:`~.create.Creating` and
    :class:`~.resolve.Resolving`, and what they build on (``blobs``, ``presets``, ``prune``,
    ``manifests``, ``locks``, ``layout``, ``access``). This class adds what they share (the
    settings, the caches, the stop of lock waits) and the removal of a model, which spans them.
    """

    def __init__(self, root: os.PathLike | str | None = None, *, allow_paths: bool = True,
                 path_folders: Iterable[str] | None = None):
        """``path_folders``: where callers other than the user's own (see :data:`local_caller`)
        may name GGUF files by path; None is anywhere, an empty list nowhere."""
        super().__init__(root)
        self.allow_paths = allow_paths
        self.path_folders = None if path_folders is None else tuple(os.path.realpath(os.path.expanduser(f))
                                                                     for f in path_folders)
        self._info_cache: dict[str, tuple[tuple, GGUFInfo]] = {}
        self._preset_cache: dict[str, bytes] = {}
        self._cache_lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop_waiting: lock waits end at once

    def stop_waiting(self) -> None:
        """End every wait for a store lock in this process now, and refuse later ones
        (:class:`StoreBusy`): for a server that is stopping, whose worker threads must not
        wait out :data:`LOCK_WAIT` first. What holds a lock finishes its step and releases it."""
        self._stopping.set()

    def __repr__(self) -> str:
        return f"ModelStore({str(self.root)!r})"

    _summary = staticmethod(info_summary)  # (the pulls write manifests' summaries with it)

    # -- public: remove ------------------------------------------------------------------

    def weights_stay(self, name: str | ModelName) -> bool:
        """Whether removing ``name`` leaves its weights file (another model uses it: a copy, a
        model made FROM it), by the rule :meth:`prune` deletes blobs by."""
        e = self.entry(name)
        return normalize_digest(e.model_digest) in self._referenced(skip=e.manifest_path)

    def remove_sync(self, name: str | ModelName) -> list[str]:
        """Delete a name; delete the blobs no other manifest uses. Returns the removed digests."""
        mname = self._name(name)
        with self.lock("manifests"):
            e = self._lookup(mname)
            if e is None:
                raise self._not_found(str(name), mname)
            _unlink(e.manifest_path)
            self._prune_empty_dirs(e.manifest_path.parent)
        return self.prune({normalize_digest(ly["digest"]) for ly in e.layers})

    async def remove(self, name: str | ModelName, before_remove: BeforeRemove | None = None) -> list[str]:
        """Remove a model. ``before_remove(ref)`` is awaited first (the scheduler unloads it there);
        if it raises, nothing is removed. Returns the digests of the blobs deleted."""
        mname = self._name(name)
        e = await asyncio.to_thread(self.entry, mname)
        if before_remove is not None:
            ref = self._ref_from_entry(e, cheap=True)
            await before_remove(ref)
        return await asyncio.to_thread(self.remove_sync, mname)


# (a test that sets one of this package's names sets it where the seams use it: see seams.py)
forward_settings(__name__, (access, blobs, create, errors, layout, locks, manifests, presets, prune, resolve, summary))
