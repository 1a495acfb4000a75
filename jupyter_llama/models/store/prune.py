"""Reclaiming space: blobs no manifest uses, partial downloads no pull is working on, and
what ended processes left in ``tmp/``.

A blob is deleted only under its lock, after every manifest was read again, so a blob is
never deleted under a model being created, copied or pulled. A blob written, landed or
uploaded in the last :data:`PRUNE_GRACE` seconds is kept: an upload (``POST /api/blobs``) or
a pull names its blobs only when it finishes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Iterable

from filelock import Timeout

from .layout import _DIGEST_RE, _HEX_RE, _age, _listing, _process_runs, _unlink, normalize_digest
from .locks import LOCK_WAIT
from .manifests import Manifests

PRUNE_GRACE = 3600.0
"""Seconds a blob no model uses is kept after it was last written, landed (the later of its
mtime and its inode's change time, which landing sets) or uploaded (``uploads/``): Ollama's
clients upload a model's blobs first and name them with a create afterwards, and a pull names
its blobs when the last one is in; a prune meanwhile must not take them, nor a delete of a
model that used the same bytes (a delete takes its blobs at once, but one uploaded within
the grace). Temporary files of ended processes are kept as long."""


class Pruning(Manifests):
    """What ``prune`` and a delete reclaim (a part of ModelStore)."""

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
        removed: list[dict] = []
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
