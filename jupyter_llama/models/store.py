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
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime as _dt
import difflib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping

from filelock import Timeout

from .. import config
from ..errors import BadRequest, JupyterLlamaError, ModelNotFound, StorageFull
from ..private import write_private
from .gguf_info import GGUFError, GGUFInfo, read_gguf_info
from .names import (
    InvalidName,
    ModelName,
    also_registry,
    parse_name,
    plainly_a_path,
    refuse_control_characters,
    without_registry,
)
from .preset import MAX_LAYER_BYTES, PRESET_MEDIA_TYPES, Preset, PresetError
from .ref import ModelRef, model_details, parameter_size

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

MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
MANIFEST_MEDIA_TYPE = "application/vnd.jupyter-llama.manifest.v1+json"

CHUNK = 4 << 20  # hashing and copying buffer
_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")

LOCK_WAIT = 30.0
"""Seconds an operation waits for a lock another one holds (a blob's, the manifests'). Locks
are held only while a file lands or a manifest is written, so a longer wait means the holder
is stuck: the waiter gives up with :class:`StoreBusy` rather than polling forever (a thread
polling forever also kept the server from stopping)."""

PRUNE_GRACE = 3600.0
"""Seconds a blob no model uses is kept after it was last written, landed (the later of its
mtime and its inode's change time, which landing sets) or uploaded (``uploads/``): Ollama's
clients upload a model's blobs first and name them with a create afterwards, and a pull names
its blobs when the last one is in; a prune meanwhile must not take them, nor a delete of a
model that used the same bytes (a delete takes its blobs at once, but one uploaded within
the grace). Temporary files of ended processes are kept as long."""

Progress = Callable[[dict], None]
BeforeRemove = Callable[[ModelRef], Awaitable[Any]]


# ----------------------------------------------------------------------------- errors


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


class InvalidGGUF(GGUFError, BadRequest):
    """A file offered to the store is not a usable GGUF (a GGUFError that is also HTTP 400)."""


# ----------------------------------------------------------------------------- helpers


def default_root() -> Path:
    """``JUPYTER_LLAMA_MODELS`` if set, else ``<jupyter data dir>/llama/models``."""
    env = config.env("MODELS")
    if env:
        return Path(os.path.expanduser(env))
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "llama" / "models"


def normalize_digest(digest: str) -> str:
    """The 64 hex characters of ``sha256:<hex>``, ``sha256-<hex>`` or ``<hex>``; ValueError else."""
    d = str(digest).strip().lower()
    m = _DIGEST_RE.match(d)
    if m:
        return m.group(1)
    if _HEX_RE.match(d):
        return d
    raise BadRequest(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data: Any, fsync: bool = True) -> None:
    """``data`` as JSON at ``path``, whole or not at all (a temporary file beside it, renamed
    over it), readable by this user only, its folder made 0700 when missing; ``fsync``: on
    disk before this returns (manifests), else as the system gets to it (records remade at will)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # readable by this user only, whatever the umask: manifests carry the URLs models came from
    write_private(path, json.dumps(data, indent=1, sort_keys=False) + "\n", fsync=fsync)
    if fsync:
        _fsync_dir(path.parent)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _listing(path: os.PathLike | str, *, dirs: bool) -> list[os.DirEntry]:
    """The folders (``dirs``) or files in ``path``, by name, hidden ones left out; none when
    ``path`` is gone (a concurrent delete removed it) or is no folder. ``DirEntry.is_dir`` and
    ``is_file`` answer False for an entry removed since it was listed."""
    try:
        with os.scandir(path) as it:
            found = [e for e in it if not e.name.startswith(".") and (e.is_dir() if dirs else e.is_file())]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=lambda e: e.name)


def _touch_ctime(path: Path, st: os.stat_result) -> None:
    """Set ``path``'s inode change time to now without changing its bytes, mode or mtime."""
    import stat as _stat

    with contextlib.suppress(OSError):
        os.chmod(path, _stat.S_IMODE(st.st_mode))


def _age(st: os.stat_result, now: float) -> float:
    """Seconds since a file was last written, landed or moved (see :data:`PRUNE_GRACE`)."""
    return now - max(st.st_mtime, st.st_ctime)


def _process_runs(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a write that ran out of disk space or quota (ENOSPC, EDQUOT)."""
    return isinstance(e, OSError) and e.errno in _FULL_ERRNOS


def fmt_bytes(n: float | None) -> str:
    """``6.2 MB``, ``512 B`` (decimal units, as ``df -H`` and Ollama's progress show them)."""
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def free_bytes(path: os.PathLike | str) -> int | None:
    """Free bytes (for this user) on the filesystem holding ``path`` (or its nearest existing parent)."""
    p = Path(path)
    while True:
        try:
            return shutil.disk_usage(p).free
        except FileNotFoundError:
            if p.parent == p:
                return None
            p = p.parent
        except OSError:
            return None


def storage_full(root: os.PathLike | str, what: str, needed: int | None = None,
                 e: BaseException | None = None, *, before: bool = False) -> StorageFull:
    """The sentence for a person when ``what`` (``"copying model.gguf into the store"``) filled
    the disk (or the quota) under ``root``: what filled up, how much was needed if known, what to
    do. ``before``: refused before writing anything (``needed`` is more than is free)."""
    free = free_bytes(root)
    quota = isinstance(e, OSError) and e.errno == errno.EDQUOT
    where = (f"your disk quota on the filesystem holding the model store {root}" if quota
             else f"the disk holding the model store {root}")
    have = f"{fmt_bytes(free)} free" if free is not None else ""
    if before:
        text = f"{where} has too little free space: {what} needs {fmt_bytes(needed)}" + (
            f" and it has {have}" if have else "") + ". Nothing was written."
    else:
        need = f" (it needed {fmt_bytes(needed)}" + (f", {have} now" if have else "") + ")" if needed else (
            f" ({have} now)" if have else "")
        text = f"{where} is full: {what} ran out of space{need}. What it had written was removed again."
    return StorageFull(
        f"{text} Free some space (`jupyter-llama rm NAME` removes a model you no longer need, "
        "`jupyter-llama prune` drops unfinished downloads and files no model uses) or point JUPYTER_LLAMA_MODELS "
        "at a larger disk, then try again", path=str(root), needed=needed, free=free)


def _stamp(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def hash_file(path: os.PathLike | str, progress: Callable[[int], None] | None = None,
              cancel: threading.Event | None = None) -> str:
    """sha256 hex of a file, read in large chunks; ``progress(bytes_done)`` after each chunk."""
    h = hashlib.sha256()
    done = 0
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            done += n
            if progress:
                progress(done)
            if cancel is not None and cancel.is_set():
                raise StoreError("cancelled")
    return h.hexdigest()


def _kernel_copy(src: str, dst: os.PathLike | str, stop: threading.Event, step: int = 64 << 20) -> None:
    """Copy a file in the kernel, ``step`` bytes at a time, until done or ``stop`` is set."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fi, fo = fin.fileno(), fout.fileno()
        total = os.fstat(fi).st_size
        off = 0
        mode = "copy_file_range" if hasattr(os, "copy_file_range") else "sendfile"
        while off < total:
            if stop.is_set():
                raise StoreError("cancelled")
            count = min(step, total - off)
            try:
                if mode == "copy_file_range":
                    n = os.copy_file_range(fi, fo, count, off, off)
                elif mode == "sendfile":
                    os.lseek(fo, off, os.SEEK_SET)
                    n = os.sendfile(fo, fi, off, count)
                else:
                    os.lseek(fi, off, os.SEEK_SET)
                    data = os.read(fi, min(count, CHUNK))
                    os.lseek(fo, off, os.SEEK_SET)
                    n = os.write(fo, data)
            except OSError as e:
                if mode != "readwrite" and e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                                      errno.ENOTSUP, errno.EBADF, errno.EPERM):
                    mode = "sendfile" if mode == "copy_file_range" else "readwrite"
                    continue
                raise
            if n == 0:
                break  # the source shrank: the caller's stat check reports it
            off += n


class _Throttle:
    """Calls ``emit`` with progress at most every ``interval`` seconds (and always at the end)."""

    def __init__(self, emit: Progress | None, base: dict, total: int | None, interval: float = 0.1):
        import time

        self._time = time.monotonic
        self.emit = emit
        self.base = base
        self.total = total
        self.interval = interval
        self._last = -1.0
        self._last_value = -1

    def __call__(self, completed: int, force: bool = False) -> None:
        if self.emit is None:
            return
        t = self._time()
        if force or completed == self.total or t - self._last >= self.interval:
            if completed == self._last_value:
                return
            self._last = t
            self._last_value = completed
            d = dict(self.base)
            if self.total is not None:
                d["total"] = self.total
            d["completed"] = completed
            self.emit(d)


def _projector_summary(path: str) -> dict:
    """Validate a projector GGUF (architecture ``clip`` and friends) and summarise it.

    ``read_gguf_info`` wants an LLM's hyperparameters, which a projector does not have, so
    this parses only the header and the tensor table, with the same bounds checks.
    """
    from .gguf_info import _check_magic, _field_value, _HeaderReader, _Truncated

    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise InvalidGGUF(path, e.strerror or str(e)) from None
    try:
        version = _check_magic(path, size)
        reader = _HeaderReader(path, size)
    except GGUFError as e:
        raise InvalidGGUF(e.path, e.reason) from None
    except _Truncated as e:
        raise InvalidGGUF(path, f"truncated: needs at least {e.needed} bytes, file has {e.size}") from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise InvalidGGUF(path, f"malformed GGUF: {e}") from None
    values = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            shown, _full = _field_value(f)
        except (ValueError, IndexError):
            continue
        if isinstance(shown, (int, float, str, bool)) or shown is None:
            values[key] = shown
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    n_tensors = len(reader.tensors)
    del reader
    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidGGUF(path, "missing required metadata general.architecture")
    if n_tensors == 0:
        raise InvalidGGUF(path, "no tensors: not a projector")
    keep = {k: v for k, v in values.items()
            if k.startswith(("general.", "clip.")) and not (isinstance(v, str) and len(v) > 512)}
    return {
        "file_size": size,
        "version": version,
        "architecture": arch,
        "projector_type": values.get("clip.projector_type"),
        "parameter_count": n_params,
        "tensor_count": n_tensors,
        "metadata": keep,
    }


def _role(media_type: str) -> str:
    """What a layer is, in a word: model, projector, or a preset part (system, template ...)."""
    if media_type == MODEL_MEDIA_TYPE:
        return "model"
    if media_type == PROJECTOR_MEDIA_TYPE:
        return "projector"
    return PRESET_MEDIA_TYPES.get(media_type, media_type)


def _info_from_dict(d: dict, path: str) -> GGUFInfo:
    """A GGUFInfo rebuilt from a manifest's cached summary (no tensor table)."""
    return GGUFInfo(
        path=path,
        file_size=d.get("file_size", 0),
        version=d.get("version", 3),
        architecture=d.get("architecture", "unknown"),
        name=d.get("name"),
        block_count=d.get("block_count", 0),
        embedding_length=d.get("embedding_length", 0),
        feed_forward_length=d.get("feed_forward_length"),
        head_count=d.get("head_count", 0),
        head_count_kv=d.get("head_count_kv", 0),
        key_length=d.get("key_length"),
        value_length=d.get("value_length"),
        context_length=d.get("context_length", 0),
        sliding_window=d.get("sliding_window"),
        swa_layers=d.get("swa_layers"),
        file_type=d.get("file_type"),
        parameter_count=d.get("parameter_count", 0),
        vocab_size=d.get("vocab_size", 0),
        tensors=[],
        metadata=dict(d.get("metadata") or {}),
    )


# ----------------------------------------------------------------------------- entries


@dataclass
class ModelEntry:
    """One named model as its manifest describes it (no blob is opened)."""

    name: ModelName
    manifest: dict
    manifest_path: Path
    shown: str | None = None  # the name it is shown by, when not its own short form (see Store._entry)

    @property
    def display(self) -> str:
        return self.shown or self.name.display

    @property
    def layers(self) -> list[dict]:
        return list(self.manifest.get("layers") or [])

    def _layer(self, media_type: str) -> dict | None:
        return next((ly for ly in self.layers if ly.get("mediaType") == media_type), None)

    @property
    def model_layer(self) -> dict:
        ly = self._layer(MODEL_MEDIA_TYPE)
        if ly is None:
            raise StoreError(f"manifest {self.manifest_path} has no model layer")
        return ly

    @property
    def projector_layer(self) -> dict | None:
        return self._layer(PROJECTOR_MEDIA_TYPE)

    @property
    def model_digest(self) -> str:
        return normalize_digest(self.model_layer["digest"])

    @property
    def projector_digest(self) -> str | None:
        ly = self.projector_layer
        return normalize_digest(ly["digest"]) if ly else None

    @property
    def digest(self) -> str:
        """The model's identity (hex): sha256 of its layer list, as stable as Ollama's manifest digest."""
        canon = json.dumps([{"mediaType": ly["mediaType"], "digest": ly["digest"], "size": ly["size"]}
                            for ly in self.layers], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    @property
    def size(self) -> int:
        return sum(int(ly.get("size", 0)) for ly in self.layers)

    @property
    def info(self) -> dict:
        return dict(self.manifest.get("info") or {})

    @property
    def source(self) -> dict:
        return dict(self.manifest.get("source") or {})

    @property
    def created_at(self) -> str:
        return self.manifest.get("created_at", "")

    @property
    def modified_at(self) -> str:
        return self.manifest.get("modified_at", "")

    @property
    def details(self) -> dict:
        """Ollama's ``details`` object."""
        return model_details(self.info, self.source.get("from_model", ""), self.projector_family)

    @property
    def projector_family(self) -> str | None:
        """The projector's architecture (``clip`` when its manifest does not say), None without one."""
        if not self.projector_layer:
            return None
        return (self.manifest.get("projector_info") or {}).get("architecture") or "clip"

    def repair_hint(self) -> str:
        """The command that puts this model's bytes back."""
        src = self.source
        kind = src.get("type")
        if kind == "hf":
            tag = src.get("quant")
            text = f"hf.co/{src.get('repo')}" + (f":{tag}" if tag else "")
            return f"pull it again: `jupyter-llama pull {text}` (or `%llama pull {text}`)"
        if kind == "url":
            return f"pull it again: `jupyter-llama pull {src.get('url')}`"
        if kind == "registry":
            return f"pull it again: `jupyter-llama pull {src.get('name')}` (or `%llama pull {src.get('name')}`)"
        if kind == "synth":
            return "make it again with the store's synth (same shape and seed give the same bytes)"
        path = src.get("path")
        if path:
            return f"create it again from its file: `jupyter-llama create {self.display} {path}`"
        return "pull or create it again"

    def to_api(self) -> dict:
        """One element of Ollama's ``GET /api/tags`` ``models`` list."""
        return {
            "name": self.display,
            "model": self.display,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
        }


# ----------------------------------------------------------------------------- store


_CONTENDED = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


class RemovableLock:
    """An exclusive lock on a file (``flock``), by default deleted on release, so a finished
    job leaves nothing behind.

    Deleting a lock file is safe only if a waiter checks, once it holds the lock, that the file
    it locked is still the one at the path (the holder may have removed it meanwhile, and a
    third process made a new one); if not, it locks the new file instead. Only the holder
    deletes the file, and only while it is still the file it holds.

    A wait is bounded (``timeout`` seconds, :data:`LOCK_WAIT` unless told; negative: no bound)
    and ends early when ``stop`` is set. :meth:`release` never raises and frees everything it
    took, whatever happened meanwhile: a lock left held would keep every later waiter polling.
    ``what`` names the locked thing in the :class:`StoreBusy` sentence of ``with``.
    """

    def __init__(self, path: Path, *, remove: bool = True, timeout: float | None = None, what: str = "",
                 stop: threading.Event | None = None):
        self.path = path
        self.remove = remove
        self.timeout = LOCK_WAIT if timeout is None else timeout
        self.what = what or f"the lock {path.name}"
        self._stop = stop
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None  # (device, inode) of the file held

    def acquire(self, timeout: float | None = None, poll: float = 0.05) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (the lock's own unless given;
        negative: no bound); filelock's ``Timeout`` when it stays taken (or ``stop`` is set)."""
        import fcntl

        wait = self.timeout if timeout is None else timeout
        deadline = None if wait < 0 else time.monotonic() + wait
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            fd = os.open(self.path, flags, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as e:
                        if e.errno not in _CONTENDED:
                            raise
                    if (self._stop is not None and self._stop.is_set()) or (
                            deadline is not None and time.monotonic() >= deadline):
                        raise Timeout(str(self.path)) from None
                    if self._stop is not None:
                        self._stop.wait(poll)
                    else:
                        time.sleep(poll)
                held = os.fstat(fd)
                try:
                    now = os.stat(self.path)
                    same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                self._fd, self._ident = fd, (held.st_dev, held.st_ino)
                return
            os.close(fd)  # we locked a file its holder had removed: lock the one there now

    def release(self) -> None:
        """Give the lock up (deleting its file first, when ``remove``); a second call does
        nothing. A descriptor that no longer names the locked file (closed, or its number
        reused by someone else) is left alone: closing it would close another's file."""
        import fcntl

        fd, ident = self._fd, self._ident
        if fd is None:
            return
        self._fd = self._ident = None
        try:
            st = os.fstat(fd)
        except OSError:
            return
        if (st.st_dev, st.st_ino) != ident:
            return
        try:
            if self.remove:  # while still holding it: waiters on this file will look again
                with contextlib.suppress(OSError):
                    now = os.stat(self.path)
                    if (now.st_dev, now.st_ino) == ident:
                        os.unlink(self.path)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.close(fd)

    def take(self) -> "RemovableLock":
        """:meth:`acquire`, with a wait that runs out said as :class:`StoreBusy` (409)."""
        try:
            self.acquire()
        except Timeout:
            if self._stop is not None and self._stop.is_set():
                raise StoreBusy(f"the model store is closing (the server is stopping): {self.what} was not "
                                "changed; try again once it is back") from None
            raise StoreBusy(f"another operation on the model store (a create, copy, delete or pull) has held "
                            f"{self.what} for over {self.timeout:g} s; nothing was changed, try again in a "
                            "moment") from None
        return self

    def __enter__(self) -> "RemovableLock":
        return self.take()

    def __exit__(self, *exc) -> None:
        self.release()


class ModelStore:
    """The registry. Sync methods do file I/O; ``resolve``, ``remove`` and the pulls are async.

    An instance is itself a scheduler resolver: ``Scheduler(settings, resolver=store)``.
    """

    def __init__(self, root: os.PathLike | str | None = None, *, allow_paths: bool = True,
                 path_folders: Iterable[str] | None = None):
        """``path_folders``: where callers other than the user's own (see :data:`local_caller`)
        may name GGUF files by path; None is anywhere, an empty list nowhere."""
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.allow_paths = allow_paths
        self.path_folders = None if path_folders is None else tuple(os.path.realpath(os.path.expanduser(f))
                                                                     for f in path_folders)
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.verified_dir = self.root / "verified"
        self.partial_dir = self.root / "partial"
        self.urls_dir = self.root / "urls"
        self.locks_dir = self.root / "locks"
        self.tmp_dir = self.root / "tmp"
        self.uploads_dir = self.root / "uploads"
        self._info_cache: dict[str, tuple[tuple, GGUFInfo]] = {}
        self._preset_cache: dict[str, bytes] = {}
        self._cache_lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop_waiting: lock waits end at once
        self._root_seen = False  # the folder existed once in this object's life (see check_root)

    def stop_waiting(self) -> None:
        """End every wait for a store lock in this process now, and refuse later ones
        (:class:`StoreBusy`): for a server that is stopping, whose worker threads must not
        wait out :data:`LOCK_WAIT` first. What holds a lock finishes its step and releases it."""
        self._stopping.set()

    def __repr__(self) -> str:
        return f"ModelStore({str(self.root)!r})"

    def check_root(self) -> None:
        """StoreGone when the folder, seen before, is gone; else note that it is there. A
        manager whose folder was deleted says so rather than list nothing, or make a new
        empty one the next time it writes."""
        if self.root.is_dir():
            self._root_seen = True
        elif self._root_seen:
            raise StoreGone(self.root)

    def usable_root(self) -> str | None:
        """Why this store's folder cannot hold models (None when it can): it is a file, or it
        cannot be made, or this user cannot write in it. Made here when it is missing."""
        root = self.root
        if root.exists() and not root.is_dir():
            return f"{root} is a file, not a folder"
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            return f"{root} cannot be made: {e.strerror or e}"
        if not os.access(root, os.W_OK | os.X_OK):
            return f"{root} is not writable by this user"
        self._root_seen = True
        return None

    def ensure_dirs(self) -> None:
        """The store's folders; those made here are this user's only (0700), whatever the umask."""
        self.check_root()
        with self._space("making the store's folders"):
            try:
                self.root.mkdir(parents=True, mode=0o700)
            except FileExistsError:  # an admin's folder, or another process (a concurrent pull) made it
                pass
            else:
                os.chmod(self.root, 0o700)  # mkdir's mode is masked by the umask; this is not
            for d in (self.blobs_dir, self.manifests_dir, self.verified_dir, self.partial_dir,
                      self.urls_dir, self.locks_dir, self.tmp_dir):
                d.mkdir(parents=True, exist_ok=True, mode=0o700)

    @contextlib.contextmanager
    def _space(self, what: str, needed: int | None = None, short_writes: bool = False) -> Iterator[None]:
        """Turn a write that found the disk (or quota) full into :class:`StorageFull`, saying
        ``what`` was being done; whoever writes under it removes what it half-wrote.
        ``short_writes``: also an OSError without an errno while the disk has less than a MiB
        free (numpy's ``tofile``, which the GGUF writer uses, says only "N requested and M written")."""
        try:
            yield
        except OSError as e:
            if is_disk_full(e) or (short_writes and e.errno is None and (free_bytes(self.root) or 0) < (1 << 20)):
                raise storage_full(self.root, what, needed, e) from None
            raise

    # -- paths and locks ------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / f"sha256-{normalize_digest(digest)}"

    def _sidecar(self, hexd: str) -> Path:
        return self.verified_dir / f"sha256-{hexd}.json"

    def lock(self, key: str, timeout: float | None = None) -> RemovableLock:
        """A file lock named ``key`` whose file stays (``manifests``: the one every manifest
        write and delete takes); its ``with`` waits at most ``timeout`` seconds (:data:`LOCK_WAIT`),
        then says StoreBusy."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        what = "the list of models" if key == "manifests" else f"the lock {key}"
        return RemovableLock(self.locks_dir / f"{key}.lock", remove=False, timeout=timeout, what=what,
                             stop=self._stopping)

    def removable_lock(self, key: str, what: str = "", stop: threading.Event | None = None) -> "RemovableLock":
        """A lock whose file is gone once it is released (for one-off work such as a download,
        whose waiter polls it with its own cancel checks)."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        return RemovableLock(self.locks_dir / f"{key}.lock", what=what or f"the lock {key}", stop=stop)

    def prune_partials(self) -> list[dict]:
        """What ``prune`` reclaims (``POST api/prune``), each removed thing as ``{"kind", "file",
        "bytes"}`` (``bytes``: what removing it freed): ``partial`` downloads no pull is working
        on (their resume is lost; with the ``url``), each ``blob`` no model uses (with ``digest``
        and ``size``; see :meth:`prune_unused`), and ``tmp`` files that ended processes left.
        Nothing a lock holds, and nothing written in the last :data:`PRUNE_GRACE` seconds but
        partial downloads (one in progress holds its lock), is removed."""
        return self._prune_downloads() + self.prune_unused() + self._prune_tmp()

    def _prune_downloads(self) -> list[dict]:
        removed = []
        for part in sorted(self.partial_dir.glob("*.partial")) if self.partial_dir.is_dir() else []:
            key = part.name[: -len(".partial")]
            lock = self.removable_lock(f"dl-{key}")
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                meta = self.partial_dir / f"{key}.json"
                try:
                    url = json.loads(meta.read_text(encoding="utf-8")).get("url")
                except (OSError, ValueError):
                    url = None
                try:
                    size = part.stat().st_size
                except OSError:
                    continue
                _unlink(part)
                _unlink(meta)
                removed.append({"kind": "partial", "file": str(part), "bytes": size, "url": url})
            finally:
                lock.release()
        return removed

    _TMP_NAME = re.compile(r"^(?:import|upload|synth|preset)-(\d+)-")

    def _prune_tmp(self, grace: float | None = None) -> list[dict]:
        """Remove what a process that has ended left in ``tmp/`` (an import, an upload, a
        synthetic model cut short by a crash) once it is ``grace`` seconds old; a file whose
        process runs, or that is younger, may still be landing."""
        grace = PRUNE_GRACE if grace is None else grace
        removed = []
        try:
            with os.scandir(self.tmp_dir) as it:
                found = list(it)
        except (FileNotFoundError, NotADirectoryError):
            return removed
        now = time.time()
        for entry in sorted(found, key=lambda e: e.name):
            m = self._TMP_NAME.match(entry.name)
            if m is None or _process_runs(int(m.group(1))):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if _age(st, now) < grace:
                continue
            if _unlink(Path(entry.path)):
                removed.append({"kind": "tmp", "file": entry.path, "bytes": st.st_size if st.st_nlink <= 1 else 0})
        return removed

    def _blob_lock(self, hexd: str) -> "RemovableLock":
        """A blob's lock: its file goes when it is released, so a deleted blob leaves no lock
        file behind (waiters re-check that they hold the file at the path)."""
        return self.removable_lock(f"sha256-{hexd}", what=f"blob sha256:{hexd[:12]}", stop=self._stopping)

    class _Locks:
        """Several locks, taken in order (each wait bounded: StoreBusy) and all released on
        exit, whatever happens."""

        def __init__(self, locks: list["RemovableLock"]):
            self.locks = locks

        def __enter__(self):
            try:
                for lk in self.locks:
                    lk.take()
            except BaseException:
                self.__exit__()
                raise
            return self

        def __exit__(self, *exc):
            for lk in reversed(self.locks):
                lk.release()  # (never raises; one not taken is a no-op)

    def _blob_locks(self, digests: Iterable[str]) -> "ModelStore._Locks":
        return ModelStore._Locks([self._blob_lock(h) for h in sorted(set(digests))])

    def _manifest_path(self, name: ModelName) -> Path:
        return self.manifests_dir.joinpath(*name.parts)

    # -- blobs ----------------------------------------------------------------------

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        """True when the blob is present and (lazily) verified; a bad one is not counted."""
        hexd = normalize_digest(digest)
        try:
            st = os.stat(self.blob_path(hexd))
        except FileNotFoundError:
            return False
        if size is not None and st.st_size != size:
            return False
        return self.check_blob(hexd, st.st_size, full=False) is None

    def _sidecar_matches(self, hexd: str, st: os.stat_result) -> bool:
        try:
            with open(self._sidecar(hexd), encoding="utf-8") as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            return False
        s = _stamp(st)
        return all(rec.get(k) == s[k] for k in ("size", "mtime_ns", "ino", "dev"))

    def _write_sidecar(self, hexd: str, st: os.stat_result) -> None:
        rec = dict(_stamp(st), digest=f"sha256:{hexd}", verified_at=_now())
        try:
            atomic_write_json(self._sidecar(hexd), rec, fsync=False)
        except OSError:
            pass  # only a cache: the next check rehashes

    def check_blob(self, digest: str, size: int | None = None, *, full: bool = False,
                   progress: Callable[[int], None] | None = None) -> str | None:
        """None if the blob is good, else what is wrong (one line).

        Size is always compared; the hash is recomputed when ``full`` is set or when the
        blob's (size, mtime, inode) differ from the last good hash's record.
        """
        hexd = normalize_digest(digest)
        path = self.blob_path(hexd)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return "the blob file is missing"
        if size is not None and st.st_size != size:
            return f"the blob is {st.st_size:,} bytes, the manifest says {size:,}"
        if not full and self._sidecar_matches(hexd, st):
            return None
        try:
            got = hash_file(path, progress)
        except OSError as e:
            return f"cannot read the blob: {e.strerror or e}"
        if got != hexd:
            _unlink(self._sidecar(hexd))
            return f"its bytes hash to sha256:{got[:12]}…, not to its name"
        try:
            st2 = os.stat(path)
        except FileNotFoundError:
            return "the blob file is missing"
        if _stamp(st2) == _stamp(st):
            self._write_sidecar(hexd, st2)
        return None

    def land_blob(self, src: os.PathLike | str, digest: str) -> Path:
        """Move ``src`` (already hashed to ``digest``, on the store's filesystem) into ``blobs/``.

        The caller holds the blob's lock. A good blob already there is kept (the same bytes
        are never stored twice) and ``src`` is removed; a bad one is replaced. Either way the
        blob's inode change time is now, which keeps it from a prune for :data:`PRUNE_GRACE`
        (a rename or a link sets it; a kept blob gets it from a chmod to its own mode, which
        leaves its mtime, and so its verified record, as they were).
        """
        hexd = normalize_digest(digest)
        dst = self.blob_path(hexd)
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        src = Path(src)
        st_src = os.stat(src)
        try:
            st_dst = os.stat(dst)
        except FileNotFoundError:
            st_dst = None
        if st_dst is not None:
            if st_dst.st_ino == st_src.st_ino and st_dst.st_dev == st_src.st_dev:
                _unlink(src)
                _touch_ctime(dst, st_dst)
                self._write_sidecar(hexd, os.stat(dst))
                return dst
            if st_dst.st_size == st_src.st_size and self._sidecar_matches(hexd, st_dst):
                _unlink(src)
                _touch_ctime(dst, st_dst)
                return dst
        os.replace(src, dst)
        self._write_sidecar(hexd, os.stat(dst))
        return dst

    def _import_file(self, src: str, link: str, progress: Progress | None, label: str,
                     cancel: threading.Event | None = None) -> tuple[str, int, str, Path]:
        """Hash ``src`` into a temporary file in the store (hard link or copy).

        Returns (hex digest, size, "hardlink" or "copy", temporary path).

        The caller lands it with the blob lock held (see :meth:`_commit`).
        """
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        st = os.stat(src)
        total = st.st_size
        tmp = self.tmp_dir / f"import-{os.getpid()}-{secrets.token_hex(6)}"
        how = "copy"
        if link in ("auto", "hardlink"):
            try:
                os.link(src, tmp)
                how = "hardlink"
            except OSError as e:
                if link == "hardlink":
                    reason = ("the file is on another filesystem" if e.errno == errno.EXDEV
                              else (e.strerror or str(e)))
                    raise StoreError(f"cannot hard-link {src} into {self.blobs_dir}: {reason}; "
                                     f"use link='copy' (or 'auto')") from None
        elif link != "copy":
            raise BadRequest(f"link must be 'auto', 'hardlink' or 'copy', not {link!r}")
        tick = _Throttle(progress, {"status": f"{'hashing' if how == 'hardlink' else 'copying'} {label}"}, total)
        tick(0, force=True)
        try:
            if how == "hardlink":
                hexd = hash_file(tmp, tick, cancel)
                st2 = os.stat(tmp)
                if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    raise StoreError(f"{src} changed while it was being imported; try again")
            else:
                hexd = self._copy_hashing(src, tmp, tick, cancel)
                st2 = os.stat(src)
                if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    raise StoreError(f"{src} changed while it was being imported; try again")
            tick(total, force=True)
            size = os.stat(tmp).st_size
        except BaseException as e:
            _unlink(tmp)
            if is_disk_full(e):
                raise storage_full(self.root, f"copying the {label} file {src} into the store",
                                   total, e) from None
            raise
        return hexd, size, how, tmp

    @staticmethod
    def _copy_hashing(src: str, dst: Path, tick: Callable[[int], None], cancel: threading.Event | None) -> str:
        """Copy ``src`` to ``dst`` while hashing it: the kernel copies (copy_file_range, else
        sendfile, else read/write) in a worker thread while this thread hashes the source, so
        the import takes about as long as the slower of the two. The caller's size/mtime
        check afterwards catches a source that changed meanwhile."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def copy() -> None:
            try:
                _kernel_copy(src, dst, stop)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                stop.set()

        worker = threading.Thread(target=copy, name="jupyter-llama-copy", daemon=True)
        worker.start()
        try:
            hexd = hash_file(src, tick, cancel)
        except BaseException:
            stop.set()
            raise
        finally:
            if stop.is_set():
                worker.join()
        worker.join()
        if errors:
            e = errors[0]
            if is_disk_full(e):
                raise e  # the caller says so in a sentence (StorageFull), having removed the copy
            if isinstance(e, OSError):
                raise StoreError(f"cannot copy {src} into the store: {e.strerror or e}") from None
            raise e
        return hexd

    # -- manifests ------------------------------------------------------------------

    def _iter_manifest_paths(self) -> Iterator[tuple[Path, tuple[str, str, str, str]]]:
        """Every manifest file, in sorted order. A delete running meanwhile removes files and
        the folders it empties (under the manifests lock, which readers do not take): a folder
        or file gone before it is read was a manifest deleted, and is passed over."""
        for host in _listing(self.manifests_dir, dirs=True):
            for ns in _listing(host.path, dirs=True):
                for model in _listing(ns.path, dirs=True):
                    for tag in _listing(model.path, dirs=False):
                        yield Path(tag.path), (host.name, ns.name, model.name, tag.name)

    def _load_entry(self, path: Path, parts: tuple[str, str, str, str]) -> ModelEntry | None:
        try:
            with open(path, encoding="utf-8") as fh:
                manifest = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
            return None
        try:
            for ly in manifest["layers"]:
                normalize_digest(ly["digest"])
                int(ly["size"])
        except (KeyError, TypeError, ValueError, BadRequest):
            return None
        return self._entry(ModelName(*parts), manifest, path)

    def _entry(self, name: ModelName, manifest: dict, path: Path) -> ModelEntry:
        """The entry of ``name``'s manifest. A model pulled from the registry shows the name
        without a host that finds it (``tiny:latest`` for ``registry.ollama.ai/library/tiny:latest``),
        as Ollama shows it, unless a model made here has that name (see ``names.without_registry``)."""
        bare = without_registry(name)
        shown = bare.display if bare is not None and self._find(bare) is None else None  # as _lookup finds it
        return ModelEntry(name, manifest, path, shown)

    def _manifest_file(self, name: ModelName) -> Path | None:
        """The manifest file of ``name`` in any case (``Tiny`` was created, ``tiny`` is asked
        for): the path as asked when it is there (on a file system that ignores case, always),
        else the first, in sorted order, whose folders and file name match it case-folded;
        None when there is none."""
        path = self._manifest_path(name)
        if path.is_file():
            return path
        return self._casefolded(self.manifests_dir, [part.casefold() for part in name.parts])

    def _casefolded(self, d: Path, parts: list[str]) -> Path | None:
        """Under ``d``, the first path (folders sorted by name, and each tried in turn) whose
        remaining parts are ``parts`` case-folded, the last one a file."""
        last = len(parts) == 1
        try:
            found = sorted((e for e in os.scandir(d) if not e.name.startswith(".") and e.name.casefold() == parts[0]
                            and (e.is_file() if last else e.is_dir())), key=lambda e: e.name)
        except OSError:
            return None
        for e in found:
            hit = Path(e.path) if last else self._casefolded(Path(e.path), parts[1:])
            if hit is not None:
                return hit
        return None

    def _lookup(self, name: ModelName) -> ModelEntry | None:
        """The model a request for ``name`` means: :meth:`_find`, and for a name without a host
        (``llama3.2:1b``) that no model made here has, the one pulled under it from the
        registry (``registry.ollama.ai/library/llama3.2:1b``; see ``names.also_registry``)."""
        self.check_root()
        e = self._find(name)
        if e is None:
            alias = also_registry(name)
            if alias is not None:
                e = self._find(alias)
        return e

    def _find(self, name: ModelName) -> ModelEntry | None:
        path = self._manifest_file(name)
        if path is None:
            return None
        return self._load_entry(path, tuple(path.relative_to(self.manifests_dir).parts))

    def _referenced(self, skip: Path | None = None) -> set[str]:
        """The blobs some manifest uses (but ``skip``, a manifest's path)."""
        refs: set[str] = set()
        for p, parts in self._iter_manifest_paths():
            if skip is not None and p == skip:
                continue
            e = self._load_entry(p, parts)
            if e is None:
                # an unreadable manifest may still reference blobs: be conservative
                try:
                    text = p.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                refs.update(re.findall(r"sha256[:-]([0-9a-f]{64})", text))
                continue
            for ly in e.layers:
                refs.add(normalize_digest(ly["digest"]))
        return refs

    def _write_manifest(self, name: ModelName, manifest: dict) -> tuple[ModelEntry, set[str]]:
        """Write (replace) a manifest; return the entry and the digests the old one used."""
        path = self._manifest_path(name)
        old_digests: set[str] = set()
        with self.lock("manifests"):
            old = self._find(name)
            now = _now()
            manifest["created_at"] = now
            if old is not None:
                old_digests = {normalize_digest(ly["digest"]) for ly in old.layers}
                manifest["created_at"] = old.created_at or now  # when the name first appeared
            manifest["modified_at"] = now
            try:
                atomic_write_json(path, manifest)
            except BaseException:
                # a folder made for this manifest (a copy to a new name on a full disk) goes again
                d = path.parent
                while d != self.manifests_dir and self.manifests_dir in d.parents and not d.exists():
                    d = d.parent
                self._prune_empty_dirs(d)
                raise
            if old is not None and old.manifest_path != path:
                _unlink(old.manifest_path)  # same name, other case
                self._prune_empty_dirs(old.manifest_path.parent)
        return self._entry(name, manifest, path), old_digests

    def _prune_empty_dirs(self, d: Path) -> None:
        base = self.manifests_dir.resolve()
        d = d.resolve()
        while d != base and base in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def _commit(self, name: ModelName, layers: list[dict], info: dict, source: dict,
                projector_info: dict | None = None, land: dict[str, Path] | None = None,
                progress: Progress | None = None, preset: Preset | None = None) -> ModelEntry:
        """Land temporary files (``land``: hex -> tmp path) and write the manifest, blob locks held.
        With a ``preset``, it is merged onto the preset ``layers`` already carry (see models.preset)."""
        if preset:
            with self._space(f"writing the preset layers of {name.display}"):
                layers, extra = self._with_preset(layers, preset)
            try:
                return self._commit(name, layers, info, source, projector_info, {**(land or {}), **extra}, progress)
            finally:
                for t in extra.values():
                    _unlink(t)
        hexes = [normalize_digest(ly["digest"]) for ly in layers]
        land = land or {}
        # before the locks: a check that must hash does it here, not under them
        for ly, hexd in zip(layers, hexes, strict=True):
            if hexd not in land:
                self._check_layer(name, ly, hexd)
        new_blobs: set[str] = set()  # landed here and not there before: removed again if this fails
        try:
            with self._space(f"saving model {name.display} (its files and manifest)"):
                entry, old = self._commit_locked(name, layers, hexes, info, source, projector_info, land,
                                                 progress, new_blobs)
        except BaseException:
            if new_blobs:
                with contextlib.suppress(OSError, StoreError):
                    self.prune(new_blobs)  # no manifest names them now (prune checks that again)
            raise
        stale = old - set(hexes)
        if stale:  # the manifest is written: this is done, and what is left here a later prune takes
            with contextlib.suppress(OSError, StoreError):
                self.prune(stale)
        return entry

    def _check_layer(self, name: ModelName, ly: dict, hexd: str) -> None:
        problem = self.check_blob(hexd, int(ly["size"]))
        if problem:
            raise BlobMissing(f"blob sha256:{hexd[:12]} for {name.display}: {problem}; it may have been removed "
                              "meanwhile (a delete of the model it came from): try again")

    def _commit_locked(self, name: ModelName, layers: list[dict], hexes: list[str], info: dict, source: dict,
                       projector_info: dict | None, land: dict[str, Path], progress: Progress | None,
                       new_blobs: set[str]) -> tuple[ModelEntry, set[str]]:
        """:meth:`_commit`'s work under the blob locks; adds to ``new_blobs`` each blob it lands
        that was not in the store before."""
        with self._blob_locks(hexes):
            landed: set[str] = set()
            for ly, hexd in zip(layers, hexes, strict=True):
                if hexd in landed:  # the same bytes twice (a template that is also the system text)
                    continue
                if hexd in land:
                    landed.add(hexd)
                    existed = self.blob_path(hexd).exists()
                    self.land_blob(land[hexd], hexd)
                    if not existed:
                        new_blobs.add(hexd)
                    if progress:
                        word = "using existing layer" if existed else "creating new layer"
                        progress({"status": f"{word} sha256:{hexd}"})
                else:
                    self._check_layer(name, ly, hexd)
            if progress:
                progress({"status": "writing manifest"})
            manifest = {
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA_TYPE,
                "name": name.full,
                "layers": [dict(ly) for ly in layers],
                "info": info,
                "source": source,
            }
            if projector_info is not None:
                manifest["projector_info"] = projector_info
            return self._write_manifest(name, manifest)

    # -- presets ------------------------------------------------------------------------

    def _layer_bytes(self, ly: dict) -> bytes:
        """A small (preset) layer's blob, read whole; BlobCorrupt when missing or not its size."""
        hexd = normalize_digest(ly["digest"])
        size = int(ly.get("size", 0))
        with self._cache_lock:
            hit = self._preset_cache.get(hexd)
        if hit is not None:
            return hit
        if size > MAX_LAYER_BYTES:
            raise BlobCorrupt(f"the {PRESET_MEDIA_TYPES.get(ly.get('mediaType'), 'preset')} layer sha256:{hexd[:12]} "
                              f"is {size:,} bytes, more than a preset layer may be", digest=hexd, problem="too large")
        try:
            data = self.blob_path(hexd).read_bytes()
        except OSError as e:
            raise BlobCorrupt(f"the preset layer sha256:{hexd[:12]} cannot be read: {e.strerror or e}",
                              digest=hexd, problem="missing") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != hexd:
            raise BlobCorrupt(f"the preset layer sha256:{hexd[:12]} does not hold what its name says",
                              digest=hexd, problem="damaged")
        with self._cache_lock:
            if len(self._preset_cache) > 256:
                self._preset_cache.clear()
            self._preset_cache[hexd] = data  # content-addressed: it can never change
        return data

    def _read_preset(self, layers: Iterable[dict], display: str = "") -> Preset:
        try:
            return Preset.from_layers(layers, self._layer_bytes)
        except PresetError as e:
            raise StoreError(f'model "{display}": {e}; create it again') from None

    def preset(self, name: str | ModelName) -> Preset:
        """The preset (system, template, parameters, messages, licenses) of model ``name``."""
        e = self.entry(name)
        return self._read_preset(e.layers, e.display)

    def preset_for(self, name: str) -> Preset:
        """The preset a request for ``name`` gets: the model's, or an empty one for a name that
        is no model in the store (a GGUF path, a typo: resolving it says what is wrong)."""
        try:
            mname = parse_name(str(name).strip())
        except InvalidName:
            return Preset()
        for _attempt in range(3):
            e = self._lookup(mname)
            if e is None:
                return Preset()
            try:
                return self._read_preset(e.layers, e.display)
            except StoreError:
                # a delete or a create that re-pointed the name meanwhile took a layer: look again
                now = self._lookup(mname)
                if now is not None and (now.manifest_path, now.digest) == (e.manifest_path, e.digest):
                    raise
        raise StoreBusy(f'model "{name}" was changed by other operations (a create, copy or delete) while its '
                        "preset was being read, again and again; try again")

    def _with_preset(self, layers: list[dict], preset: Preset) -> tuple[list[dict], dict[str, Path]]:
        """``layers`` with their preset merged with ``preset``: the weights' layers as they were,
        then one new layer per preset part, written to temporary files (hex -> path) to land."""
        merged = self._read_preset(layers).merged(preset)
        out = [dict(ly) for ly in layers if ly.get("mediaType") not in PRESET_MEDIA_TYPES]
        land: dict[str, Path] = {}
        self.ensure_dirs()
        try:
            for media_type, data in merged.payloads():
                hexd = hashlib.sha256(data).hexdigest()
                out.append({"mediaType": media_type, "digest": f"sha256:{hexd}", "size": len(data)})
                if hexd not in land:
                    tmp = self.tmp_dir / f"preset-{os.getpid()}-{secrets.token_hex(6)}"
                    land[hexd] = tmp  # before writing: a write cut short is removed with the rest
                    tmp.write_bytes(data)
        except BaseException:
            for t in land.values():
                _unlink(t)
            raise
        return out, land

    # -- public: create, synth, copy ----------------------------------------------------

    @staticmethod
    def _name(name: str | ModelName) -> ModelName:
        return name if isinstance(name, ModelName) else parse_name(name)

    def create(self, name: str | ModelName, from_file: os.PathLike | str, projector: os.PathLike | str | None = None,
               progress: Progress | None = None, *, link: str = "auto", source: dict | None = None,
               preset: Preset | None = None) -> ModelEntry:
        """Import a GGUF (and an optional projector GGUF) under ``name`` (with a ``preset``, if given).

        The file is validated first (``InvalidGGUF``, a GGUFError, for anything else). It is
        hard-linked into the store when it is on the same filesystem (``link="auto"``),
        else copied while hashing; ``link="copy"`` or ``"hardlink"`` forces one way.
        ``progress`` receives Ollama-style status dicts.
        """
        mname = self._name(name)
        emit = progress or (lambda d: None)
        emit({"status": "parsing GGUF"})
        src = os.path.abspath(os.path.expanduser(str(from_file)))
        try:
            info = read_gguf_info(src)
        except GGUFError as e:
            raise InvalidGGUF(e.path, e.reason) from None
        proj_src = None
        proj_info = None
        if projector is not None:
            proj_src = os.path.abspath(os.path.expanduser(str(projector)))
            proj_info = _projector_summary(proj_src)
        self.ensure_dirs()
        land: dict[str, Path] = {}
        try:
            hexd, size, how, tmp = self._import_file(src, link, progress, "model")
            land[hexd] = tmp
            layers = [{"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{hexd}", "size": size}]
            hows = {"model": how}
            if proj_src is not None:
                phex, psize, phow, ptmp = self._import_file(proj_src, link, progress, "projector")
                if phex in land:  # the same file twice
                    _unlink(ptmp)
                else:
                    land[phex] = ptmp
                layers.append({"mediaType": PROJECTOR_MEDIA_TYPE, "digest": f"sha256:{phex}", "size": psize})
                hows["projector"] = phow
            src_rec = dict(source) if source else {"type": "file", "path": src}
            if proj_src is not None and not source:
                src_rec["projector_path"] = proj_src
            src_rec.setdefault("import", hows)
            entry = self._commit(mname, layers, self._summary(info), src_rec, proj_info, land, progress, preset)
        finally:
            for t in land.values():
                _unlink(t)
        emit({"status": "success"})
        return entry

    def create_from_files(self, name: str | ModelName, files: Mapping[str, str],
                          preset: Preset | None = None) -> ModelEntry:
        """Name uploaded blobs by Ollama's ``files`` map (file name -> digest): one GGUF is the
        model; with two, the other must be the multimodal projector (told by its name, or by
        not being a language model). ``preset``: what the model carries besides its weights."""
        digests = {}
        for fname, digest in files.items():
            hexd = normalize_digest(digest)
            if not self.has_blob(hexd):
                raise BadRequest(f"files: {fname} (sha256:{hexd}) has not been uploaded; POST it to api/blobs first")
            digests[fname] = hexd
        if len(digests) == 1:
            return self.create_from_blobs(name, next(iter(digests.values())), preset=preset)

        def is_projector(fname: str, hexd: str) -> bool:
            if "mmproj" in fname.lower() or "projector" in fname.lower():
                return True
            try:
                info = read_gguf_info(self.blob_path(hexd))
            except GGUFError:
                return True  # not a language model: the projector, if anything
            return info.architecture in ("clip", "mllama_vision")

        proj = [f for f, d in digests.items() if is_projector(f, d)]
        if len(digests) != 2 or len(proj) != 1:
            raise BadRequest("files: give one GGUF (the model), or two: the model and its multimodal projector "
                             "(mmproj); could not tell which is which")
        model = next(d for f, d in digests.items() if f != proj[0])
        return self.create_from_blobs(name, model, digests[proj[0]], preset=preset)

    def create_from_blobs(self, name: str | ModelName, model_digest: str, projector_digest: str | None = None,
                          source: dict | None = None, preset: Preset | None = None) -> ModelEntry:
        """Name blobs already in the store (``POST /api/create`` after ``POST /api/blobs``)."""
        mname = self._name(name)
        hexd = normalize_digest(model_digest)
        path = self.blob_path(hexd)
        if not path.exists():
            raise BadRequest(f"blob sha256:{hexd} is not in the store; upload it first")
        try:
            info = read_gguf_info(path)
        except GGUFError as e:
            raise InvalidGGUF(e.path, e.reason) from None
        layers = [{"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{hexd}", "size": path.stat().st_size}]
        proj_info = None
        if projector_digest:
            phex = normalize_digest(projector_digest)
            ppath = self.blob_path(phex)
            if not ppath.exists():
                raise BadRequest(f"blob sha256:{phex} is not in the store; upload it first")
            proj_info = _projector_summary(str(ppath))
            layers.append({"mediaType": PROJECTOR_MEDIA_TYPE, "digest": f"sha256:{phex}", "size": ppath.stat().st_size})
        return self._commit(mname, layers, self._summary(info), source or {"type": "blobs"}, proj_info,
                            preset=preset)

    def receive_blob(self, digest: str, chunks: Iterable[bytes], size: int | None = None) -> Path:
        """Store uploaded bytes as blob ``digest`` (``POST /api/blobs/sha256:...``); BadRequest on mismatch.
        ``size``: the upload's length when the client said it (for the message if the disk fills up)."""
        hexd = normalize_digest(digest)
        self.ensure_dirs()
        tmp = self.tmp_dir / f"upload-{os.getpid()}-{secrets.token_hex(6)}"
        h = hashlib.sha256()
        what = f"receiving the upload of blob sha256:{hexd[:12]}" + (f" ({fmt_bytes(size)})" if size else "")
        try:
            with self._space(what, size):
                with open(tmp, "wb") as fh:
                    for c in chunks:
                        h.update(c)
                        fh.write(c)
                if h.hexdigest() != hexd:
                    raise BadRequest(f"digest mismatch: the upload hashes to sha256:{h.hexdigest()}, not sha256:{hexd}")
                with self._blob_locks([hexd]):
                    blob = self.land_blob(tmp, hexd)
                    with contextlib.suppress(OSError):  # (only a guard for the grace: the blob is in)
                        self.uploads_dir.mkdir(exist_ok=True, mode=0o700)
                        write_private(self._uploaded(hexd), "")
                    return blob
        finally:
            _unlink(tmp)

    def synth(self, name: str | ModelName, shape=None, progress: Progress | None = None, *, projector: bool = False,
              **overrides) -> ModelEntry:
        """Register a synthetic model (``models.synth``) of ``shape`` under ``name``; with
        ``projector``, a synthetic multimodal projector for it too (a vision model)."""
        from .synth import SynthShape, write_projector, write_synthetic

        mname = self._name(name)
        s = shape if shape is not None else SynthShape()
        if overrides:
            s = dataclasses.replace(s, **overrides)
        self.ensure_dirs()
        stem = self.tmp_dir / f"synth-{os.getpid()}-{secrets.token_hex(6)}"
        tmp, proj = stem.with_suffix(".gguf"), stem.with_name(stem.name + "-mmproj.gguf")
        try:
            with self._space(f"writing the synthetic model {mname.display}", short_writes=True):
                write_synthetic(tmp, s)
                if projector:
                    write_projector(proj, s.embd, seed=s.seed)
            return self.create(mname, tmp, projector=proj if projector else None, progress=progress, link="auto",
                               source={"type": "synth", "shape": dataclasses.asdict(s), "projector": projector})
        finally:
            _unlink(tmp)
            _unlink(proj)

    def copy(self, src: str | ModelName, dst: str | ModelName, preset: Preset | None = None) -> ModelEntry:
        """Give model ``src`` a second name (no bytes copied); an existing ``dst`` is replaced.
        With a ``preset``, the new name carries ``src``'s preset merged with it (Ollama's create
        ``from`` a model): the weights are shared, only the small preset layers are new."""
        sname, dname = self._name(src), self._name(dst)
        for attempt in range(3):
            entry = self._lookup(sname)
            if entry is None:
                raise self._not_found(str(src), sname)
            if preset is None and sname == dname:  # (a create FROM itself, with a preset, changes it: that is fine)
                raise BadRequest(f'"{src}" and "{dst}" are the same model, {entry.display} (names ignore case): '
                                 "give the copy a name of its own")
            source = dict(entry.source)
            source.setdefault("from_model", entry.name.full if entry.shown else entry.display)  # (a name that lasts)
            try:
                return self._commit(dname, entry.layers, entry.info, source, entry.manifest.get("projector_info"),
                                    preset=preset)
            except BlobMissing:
                # ``src`` was deleted or re-pointed meanwhile, taking its files: copy what it names now
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- public: list, show, entry ---------------------------------------------------

    def list(self) -> list[ModelEntry]:
        """Every model, by name; reads manifests only."""
        self.check_root()
        out = []
        for p, parts in self._iter_manifest_paths():
            e = self._load_entry(p, parts)
            if e is not None:
                out.append(e)
        return sorted(out, key=lambda e: e.display.casefold())

    def names(self) -> list[str]:
        return [e.display for e in self.list()]

    def weights_stay(self, name: str | ModelName) -> bool:
        """Whether removing ``name`` leaves its weights file (another model uses it: a copy, a
        model made FROM it), by the rule :meth:`prune` deletes blobs by."""
        e = self.entry(name)
        return normalize_digest(e.model_digest) in self._referenced(skip=e.manifest_path)

    def entry(self, name: str | ModelName) -> ModelEntry:
        """The manifest behind ``name``; ModelNotFound (with suggestions) if there is none."""
        mname = self._name(name)
        e = self._lookup(mname)
        if e is None:
            raise self._not_found(str(name), mname)
        return e

    def exists(self, name: str | ModelName) -> bool:
        try:
            return self._lookup(self._name(name)) is not None
        except InvalidName:
            return False

    def show(self, name: str | ModelName, verify: bool = False) -> dict:
        """Everything about a model: metadata, parameters, quantisation, files, sizes, digests.

        With ``verify`` every blob is rehashed and ``verify`` reports ``{"ok", "problems"}``.
        A path to a GGUF file (where paths are allowed) shows that file, as ``run`` loads it.
        """
        try:
            e = self.entry(name)
        except (InvalidName, ModelNotFound):
            if not self.allow_paths or not self._looks_like_path(str(name)):
                raise
            return self._show_file(self.resolve_sync(str(name)), verify)  # (a path: resolved as a load resolves it)
        info = e.info
        files = []
        problems = []
        for ly in e.layers:
            hexd = normalize_digest(ly["digest"])
            role = _role(ly["mediaType"])
            path = self.blob_path(hexd)
            rec = {"role": role, "media_type": ly["mediaType"], "digest": f"sha256:{hexd}",
                   "size": int(ly["size"]), "path": str(path), "present": path.exists()}
            if verify:
                problem = self.check_blob(hexd, int(ly["size"]), full=True)
                rec["ok"] = problem is None
                if problem:
                    rec["problem"] = problem
                    problems.append(f"{role} blob sha256:{hexd[:12]}: {problem}")
            files.append(rec)
        try:
            preset = self._read_preset(e.layers, e.display).to_dict()
        except StoreError as err:  # BlobCorrupt too: show what can be shown, and say what is wrong
            preset = Preset().to_dict()
            problems.append(str(err))
        out = {
            "name": e.display,
            "model": e.name.full,
            "digest": e.digest,
            "size": e.size,
            "created_at": e.created_at,
            "modified_at": e.modified_at,
            "details": e.details,
            "architecture": info.get("architecture"),
            "parameters": info.get("parameter_count"),
            "parameter_size": e.details["parameter_size"],
            "quantization": info.get("quantization"),
            "context_length": info.get("context_length"),
            "files": files,
            "source": e.source,
            "info": info,
            "model_info": dict(info.get("metadata") or {}),
            "template": (info.get("metadata") or {}).get("tokenizer.chat_template", ""),
            "projector_info": e.manifest.get("projector_info"),
            "preset": preset,  # system, template (Ollama's), parameters, messages, license
        }
        if verify:
            out["verify"] = {"ok": not problems, "problems": problems,
                             "repair": e.repair_hint() if problems else None}
        return out

    def _show_file(self, ref: ModelRef, verify: bool) -> dict:
        """:meth:`show` of a GGUF file named by its path: what the file says of itself. It has
        no digest, preset or source in the store, so ``verify`` has nothing to hash it
        against: reading its header and tensor table (done to name it) is its check."""
        st = os.stat(ref.path)
        when = _dt.datetime.fromtimestamp(st.st_mtime, _dt.timezone.utc).isoformat()
        info = self._summary(ref.info)
        out = {
            "name": ref.name, "model": ref.path, "digest": "", "size": st.st_size,
            "created_at": when, "modified_at": when, "details": model_details(info),
            "architecture": info.get("architecture"), "parameters": info.get("parameter_count"),
            "parameter_size": parameter_size(int(info.get("parameter_count") or 0)),
            "quantization": info.get("quantization"), "context_length": info.get("context_length"),
            "files": [{"role": "model", "media_type": MODEL_MEDIA_TYPE, "digest": "", "size": st.st_size,
                       "path": ref.path, "present": True}],
            "source": {"type": "file", "path": ref.path}, "info": info,
            "model_info": dict(info.get("metadata") or {}),
            "template": (info.get("metadata") or {}).get("tokenizer.chat_template", ""),
            "projector_info": None, "preset": Preset().to_dict(),
        }
        if verify:
            out["verify"] = {"ok": True, "problems": [], "repair": None,
                             "note": "a file named by its path has no digest to check its bytes against"}
        return out

    # -- public: remove, prune ----------------------------------------------------------

    def prune(self, candidates: Iterable[str] | None = None, *, grace: float | None = None) -> list[str]:
        """Delete blobs no manifest uses; return their hex digests. ``candidates``: these
        blobs, which a manifest has just stopped using (a delete, a name given other files):
        whatever their age, unless one was uploaded within the grace (its create is to come);
        a lock another operation holds on one is waited for (boundedly; one still held is left
        for a later prune). Without candidates: every blob in the store written, landed or
        uploaded more than ``grace`` seconds (:data:`PRUNE_GRACE`) ago that no operation holds
        (:meth:`prune_unused`)."""
        if candidates is None:
            return [normalize_digest(r["digest"]) for r in self.prune_unused(grace)]
        removed = []
        for hexd in sorted(set(normalize_digest(c) for c in candidates)):
            if self._drop_blob(hexd, wait=LOCK_WAIT, grace=PRUNE_GRACE if grace is None else grace,
                               uploads_only=True) is not None:
                removed.append(hexd)
        return removed

    def prune_unused(self, grace: float | None = None) -> list[dict]:
        """Delete every blob no manifest uses that was written, landed or uploaded more than
        ``grace`` seconds ago (:data:`PRUNE_GRACE`) and whose lock nobody holds (one is landing,
        or being named by a manifest); each as ``{"kind": "blob", "file", "digest", "size",
        "bytes"}``, ``bytes`` being what its removal freed (0 for a blob hard-linked to a file
        outside). Upload records older than the grace go too."""
        grace = PRUNE_GRACE if grace is None else grace
        try:
            with os.scandir(self.blobs_dir) as it:
                names = sorted(e.name for e in it)
        except (FileNotFoundError, NotADirectoryError):
            names = []
        hexes = [n[len("sha256-"):] for n in names if n.startswith("sha256-") and _HEX_RE.match(n[len("sha256-"):])]
        try:
            used = self._referenced()
        except OSError:
            return []
        removed = []
        for hexd in hexes:
            if hexd in used:
                continue
            rec = self._drop_blob(hexd, wait=0, grace=grace)  # (re-reads the manifests under the blob's lock)
            if rec is not None:
                removed.append(rec)
        now = time.time()
        for entry in _listing(self.uploads_dir, dirs=False):  # records of uploads named long ago, or dropped
            m = _DIGEST_RE.match(entry.name)
            with contextlib.suppress(OSError):
                if m is None or now - entry.stat().st_mtime >= grace or not self.blob_path(m.group(1)).exists():
                    os.unlink(entry.path)
        return removed

    def _uploaded(self, hexd: str) -> Path:
        """The record that blob ``hexd`` was uploaded (``POST /api/blobs``), its mtime when."""
        return self.uploads_dir / f"sha256-{hexd}"

    def _drop_blob(self, hexd: str, *, wait: float, grace: float, uploads_only: bool = False) -> dict | None:
        """Delete blob ``hexd`` if no manifest uses it, its lock is had within ``wait`` seconds
        and it was written, landed or uploaded (``uploads_only``: uploaded) more than ``grace``
        seconds ago; its record, or None."""
        path = self.blob_path(hexd)
        lock = self._blob_lock(hexd)
        try:
            lock.acquire(timeout=wait)
        except Timeout:
            return None  # another operation is landing it or naming it: not garbage now
        try:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                _unlink(self._sidecar(hexd))
                return None
            if grace > 0:
                try:
                    when = os.stat(self._uploaded(hexd)).st_mtime
                except OSError:
                    when = None
                if not uploads_only:
                    when = max(when or 0.0, st.st_mtime, st.st_ctime)
                if when is not None and time.time() - when < grace:
                    return None
            try:
                if hexd in self._referenced():
                    return None
            except OSError:
                return None  # manifests that cannot be read may name it: keep it
            try:
                if not _unlink(path):
                    return None
            except OSError:
                return None  # (a folder this user cannot change: nothing removed, nothing to report)
            _unlink(self._sidecar(hexd))
            with contextlib.suppress(OSError):
                _unlink(self._uploaded(hexd))
            return {"kind": "blob", "file": str(path), "digest": f"sha256:{hexd}", "size": st.st_size,
                    "bytes": st.st_size if st.st_nlink <= 1 else 0}
        finally:
            lock.release()

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

    # -- public: resolve -----------------------------------------------------------------

    def _missing_file(self, text: str) -> str | None:
        """The absolute path ``text`` names when it can only be a file, is one this caller may
        name, and is not there (its not-found speaks of the file, not of pulling)."""
        if not self.allow_paths or not plainly_a_path(text):
            return None
        path = os.path.abspath(os.path.expanduser(text))
        return path if self.may_read_path(path) and not os.path.isfile(path) else None

    def _not_found(self, text: str, mname: ModelName | None = None) -> ModelNotFound:
        missing = self._missing_file(text)
        if missing is not None:
            return ModelNotFound(text, missing_file=missing)
        try:
            entries = self.list()
        except OSError:
            entries = []
        shown = [e.display for e in entries]

        def bare(name: str) -> str:
            # compared without the default tag: every NAME:latest shares ":latest", which alone
            # passes difflib's cutoff (any unknown name would "mean" every model)
            name = name.casefold()
            return name[:-len(":latest")] if name.endswith(":latest") else name

        pool: dict[str, str] = {}
        for e in entries:
            pool[bare(e.display)] = e.display
            pool.setdefault(e.name.model.casefold(), e.display)
            pool.setdefault(f"{e.name.namespace}/{e.name.model}".casefold(), e.display)
        probes = [bare(text)]
        if mname is not None:
            probes += [bare(mname.display), mname.model.casefold()]
        close: list[str] = []
        for probe in probes:
            for m in difflib.get_close_matches(probe, list(pool), n=5, cutoff=0.6):
                if pool[m] not in close:
                    close.append(pool[m])
        hint = ""
        if close:
            hint = "did you mean " + ", ".join(f'"{c}"' for c in close[:3]) + "?"
        elif not shown:
            hint = "the store is empty"
        return ModelNotFound(text, hint)

    def _ref_from_entry(self, e: ModelEntry, cheap: bool = False) -> ModelRef:
        mpath = str(self.blob_path(e.model_digest))
        info = None
        if not cheap:
            info = self._read_info(mpath)
        if info is None:
            info = _info_from_dict(e.info, mpath)
        pdig = e.projector_digest
        return ModelRef(name=e.display, path=mpath, info=info,
                        mmproj=str(self.blob_path(pdig)) if pdig else None, digest=e.digest,
                        projector_family=e.projector_family)

    def _read_info(self, path: str) -> GGUFInfo:
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._cache_lock:
            hit = self._info_cache.get(path)
        if hit and hit[0] == stamp:
            return hit[1]
        info = read_gguf_info(path)
        with self._cache_lock:
            if len(self._info_cache) > 64:
                self._info_cache.clear()
            self._info_cache[path] = (stamp, info)
        return info

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

    def _resolve_path(self, text: str) -> ModelRef | None:
        if not self.allow_paths or not self._looks_like_path(text):
            return None
        if not self.may_read_path(os.path.abspath(os.path.expanduser(text))):
            if plainly_a_path(text):
                self.server_file(text)  # raises, saying why
            return None  # a name such as "owner/model" that is not in the store: not found
        path = os.path.abspath(os.path.expanduser(text))
        if not os.path.isfile(path):
            return None
        try:
            info = self._read_info(path)
        except GGUFError as e:
            raise InvalidGGUF(e.path, e.reason) from None
        return ModelRef(name=text, path=path, info=info)

    def resolve_sync(self, name: str) -> ModelRef:
        """Name (or, with ``allow_paths``, a path to a .gguf file) -> ModelRef, blobs checked."""
        refuse_control_characters(str(name))  # (a 400, before strip() could drop one or a path holds it)
        text = str(name).strip()
        try:
            mname = parse_name(text)
        except InvalidName:
            ref = self._resolve_path(text)
            if ref is not None:
                return ref
            missing = self._missing_file(text)
            if missing is not None:
                raise ModelNotFound(text, missing_file=missing) from None
            raise
        for _attempt in range(3):
            e = self._lookup(mname)
            if e is None:
                ref = self._resolve_path(text)
                if ref is not None:
                    return ref
                raise self._not_found(text, mname)
            try:
                return self._checked_ref(e)
            except BlobCorrupt:
                # a delete or a create that re-pointed the name meanwhile took the blob: look again
                now = self._lookup(mname)
                if now is not None and (now.manifest_path, now.digest) == (e.manifest_path, e.digest):
                    raise
        raise StoreBusy(f'model "{text}" was changed by other operations (a create, copy or delete) while it was '
                        "being looked up, again and again; try again")

    def _checked_ref(self, e: ModelEntry) -> ModelRef:
        """``e``'s ModelRef, its blobs checked (BlobCorrupt, with the repair, for one that is
        damaged or missing)."""
        for ly in e.layers:
            hexd = normalize_digest(ly["digest"])
            problem = self.check_blob(hexd, int(ly["size"]))
            if problem:
                role = _role(ly["mediaType"])
                raise BlobCorrupt(
                    f'model "{e.display}": the {role} file (blob sha256:{hexd[:12]}) is damaged: {problem}. '
                    f"To repair it, {e.repair_hint()}.",
                    digest=hexd, problem=problem)
        try:
            return self._ref_from_entry(e)
        except GGUFError as err:
            raise BlobCorrupt(f'model "{e.display}": {err.reason}. To repair it, {e.repair_hint()}.',
                              digest=e.model_digest, problem=err.reason) from None
        except FileNotFoundError:
            raise BlobCorrupt(f'model "{e.display}": the model file (blob sha256:{e.model_digest[:12]}) is '
                              f"missing. To repair it, {e.repair_hint()}.",
                              digest=e.model_digest, problem="the blob file is missing") from None

    async def resolve(self, name: str) -> ModelRef:
        """The scheduler's resolver: file I/O and any rehash run in a worker thread."""
        return await asyncio.to_thread(self.resolve_sync, name)

    __call__ = resolve

    # -- internals ------------------------------------------------------------------------

    @staticmethod
    def _summary(info: GGUFInfo) -> dict:
        d = info.to_dict(tensors=False)
        d.pop("path", None)
        return d
