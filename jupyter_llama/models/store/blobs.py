"""Blobs: the files of the store, each named by the sha256 of its bytes.

Hashing, copying a file in while hashing it (the kernel copies in one thread while this one
hashes), landing a hashed file under ``blobs/`` (a good blob already there is kept), receiving
an upload, and checking a blob: its size every time, its hash again only when its size, mtime
or inode changed since the last good hash (recorded under ``verified/``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import threading
from pathlib import Path
from typing import Callable, Iterable

from ...errors import BadRequest
from ...private import write_private
from .errors import StoreError
from .layout import (
    _now,
    _touch_ctime,
    _unlink,
    atomic_write_json,
    fmt_bytes,
    is_disk_full,
    normalize_digest,
    storage_full,
)
from .locks import StoreLocks

CHUNK = 4 << 20  # hashing and copying buffer

Progress = Callable[[dict], None]


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


class BlobStore(StoreLocks):
    """Blobs in, checked and landed (a part of ModelStore)."""

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
