"""Where the store keeps things, and how it writes them: its root and folders, digests as
file names, whole-or-nothing JSON writes, and what to say when the disk is full.

:class:`StoreLayout` is the base of :class:`~jupyter_llama.models.store.ModelStore`: the
root, the folders under it (see the package's docstring for the layout), the paths of a
blob, its verified record, a manifest and an upload record, and the checks that the root is
still there and writable. The functions beside it touch no store object and are used by the
pulls and the server too.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

from ... import config
from ...errors import BadRequest, StorageFull
from ...private import write_private
from ..names import ModelName
from .errors import StoreGone

_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")


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


def _listing(path: os.PathLike[str] | str, *, dirs: bool) -> list[os.DirEntry]:
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


class StoreLayout:
    """The store's root and the folders and files under it; no lock, blob or manifest logic."""

    def __init__(self, root: os.PathLike | str | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.verified_dir = self.root / "verified"
        self.partial_dir = self.root / "partial"
        self.urls_dir = self.root / "urls"
        self.locks_dir = self.root / "locks"
        self.tmp_dir = self.root / "tmp"
        self.uploads_dir = self.root / "uploads"
        self._root_seen = False  # the folder existed once in this object's life (see check_root)

    def check_root(self) -> None:
        """StoreGone when the folder, seen before, is gone; else note that it is there. A
        manager whose folder was deleted says so rather than list nothing, or make a new
        empty one the next time it writes."""
        seen = self._root_seen  # (read before the look: a first create may make the folder meanwhile)
        if self.root.is_dir():
            self._root_seen = True
        elif seen:
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

    # -- paths ------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / f"sha256-{normalize_digest(digest)}"

    def _sidecar(self, hexd: str) -> Path:
        return self.verified_dir / f"sha256-{hexd}.json"

    def _manifest_path(self, name: ModelName) -> Path:
        return self.manifests_dir.joinpath(*name.parts)

    def _uploaded(self, hexd: str) -> Path:
        """The record that blob ``hexd`` was uploaded (``POST /api/blobs``), its mtime when."""
        return self.uploads_dir / f"sha256-{hexd}"
