"""A resumable, hashed download of one file.

:class:`Transfer` is a pull's network side: its HTTP client (:class:`~.http_client.Http`, on
httpx), its retries and its cancellation. :meth:`Transfer.download` fetches one file into a
``.partial`` file beside a ``.json`` of what identifies it:

* a partial file already there is resumed with ``Range``, and ``If-Range`` (its ETag or
  Last-Modified) guards against a file that changed upstream (the server answers 200 and the
  download starts again);
* the sha256 is computed while the bytes arrive, in a pipeline of threads (receive, hash,
  write: :class:`_Sink`);
* a dropped connection, a timeout or a 5xx is retried with ``Range`` a few times before it
  becomes an error; the partial file is kept for the next pull.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ..gguf_info import GGUF_MAGIC
from ..store import _unlink, atomic_write_json, fmt_bytes
from .errors import DiskFull, NotAModel, PullCancelled, PullError
from .http_client import MAX_REDIRECTS, Dropped, Http, Response, retryable
from .sources import RemoteFile

__all__ = ["Credentials", "Downloaded", "Progress", "Transfer", "BUFFER"]

BUFFER = 1 << 20  # reading a partial file back to hash it
MAX_RENEWALS = 3  # new credentials in a row for one file (see Credentials.renew)


class _Renewed(Exception):
    """The credentials were refused and new ones were given: ask again at once (not a failed
    try; at most MAX_RENEWALS times a file)."""


# ----------------------------------------------------------------------------- hashing and writing


class _Sink:
    """Hashes and writes received chunks in a pipeline of two threads (receive -> hash -> write),
    so that on a machine with cores to spare a download runs at the speed of its slowest
    step rather than the sum of all three. Chunks are gathered into buffers of ``size`` bytes,
    each hashed and written whole (a step per buffer, not per network read, which is where
    the time of small steps goes); a pool of ``buffers`` of them bounds the memory. The hash
    object belongs to the hashing thread until :meth:`close`; a write error is raised,
    converted by ``make_error``, at the next :meth:`put` that needs a buffer or at
    :meth:`close`."""

    def __init__(self, fh: BinaryIO, hasher: Any, make_error: Callable[[OSError], BaseException], buffers: int = 8,
                 size: int = BUFFER):
        self.fh = fh
        self.hasher = hasher
        self.make_error = make_error
        self.free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self.to_hash: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self.to_write: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self.error: OSError | None = None
        self._converted: BaseException | None = None
        self._buf: bytearray | None = None  # the buffer being filled, and how full it is
        self._filled = 0
        for _ in range(buffers):
            self.free.put(bytearray(size))
        self.threads = [threading.Thread(target=self._hash, name="jupyter-llama-pull-hash", daemon=True),
                        threading.Thread(target=self._write, name="jupyter-llama-pull-write", daemon=True)]
        for t in self.threads:
            t.start()

    def _hash(self) -> None:
        while True:
            item = self.to_hash.get()
            if item is not None:
                buf, n = item
                self.hasher.update(memoryview(buf)[:n])
            self.to_write.put(item)
            if item is None:
                return

    def _write(self) -> None:
        while True:
            item = self.to_write.get()
            if item is None:
                return
            buf, n = item
            if self.error is None:
                try:
                    view = memoryview(buf)[:n]
                    while view:
                        w = self.fh.write(view)
                        view = view[w:]
                except OSError as e:
                    self.error = e
            self.free.put(buf)

    def _raise(self, error: OSError) -> None:
        if self._converted is None:  # converted once: the conversion may clean up after the failure
            self._converted = self.make_error(error)
        raise self._converted

    def put(self, data: bytes) -> None:
        """Hash, then write, ``data`` (while the next chunks arrive)."""
        view = memoryview(data)
        while view:
            if self._buf is None:
                if self.error is not None:
                    self._raise(self.error)
                self._buf, self._filled = self.free.get(), 0
            k = min(len(view), len(self._buf) - self._filled)
            self._buf[self._filled:self._filled + k] = view[:k]
            self._filled += k
            view = view[k:]
            if self._filled == len(self._buf):
                self._flush()

    def _flush(self) -> None:
        if self._buf is not None:
            self.to_hash.put((self._buf, self._filled))
            self._buf = None

    def close(self) -> None:
        """Hash and write what was put, and wait until that is done."""
        self._flush()
        self.to_hash.put(None)
        for t in self.threads:
            t.join()
        if self.error is not None:
            self._raise(self.error)


def _write_error(partial: Path, e: OSError) -> PullError:
    import errno

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        # a partial download that filled the disk is not worth keeping for a resume
        try:
            size = partial.stat().st_size
        except OSError:
            size = 0
        _unlink(partial)
        _unlink(partial.with_suffix(".json"))
        return DiskFull(f"the disk filled up while downloading into {partial}; the {fmt_bytes(size)} written "
                        "were removed again: free some space and pull again")
    return PullError(f"cannot write {partial}: {e.strerror or e}")


# ----------------------------------------------------------------------------- one download


class Credentials:
    """What a request for a source's file carries: none here. A source with a token (the Hub,
    a registry) says what it sends, and may renew it when it is refused."""

    refused_hint = ""  # said after "access denied"

    def headers(self) -> dict[str, str]:
        return {}

    def renew(self, refusal: Response) -> bool:
        """After a 401 from ``refusal``: True when new credentials were obtained (ask again)."""
        return False


class Progress(Protocol):
    """Where a download says how far it got."""

    def sized(self, total: int | None) -> None:
        """The file's size, as the response states it (None: not known)."""

    def reached(self, completed: int, force: bool = False) -> None:
        """``completed`` bytes are in the partial file (``force``: say so now, not throttled)."""

    def restarted(self) -> None:
        """The partial file was dropped: the download starts from its first byte again."""


@dataclass
class Downloaded:
    hexd: str  # the sha256 of the bytes
    size: int
    validators: dict[str, str | None]  # the server's ETag and Last-Modified


class _Got:
    """What the partial file holds so far: its length, the sha256 of those bytes, its first
    four bytes (a GGUF's magic)."""

    def __init__(self) -> None:
        self.offset = 0
        self.hasher = hashlib.sha256()
        self.head = b""

    def reset(self) -> None:
        self.offset, self.hasher, self.head = 0, hashlib.sha256(), b""

    def hash_file(self, path: Path) -> None:
        """Hash the first ``offset`` bytes of ``path`` (a partial file being resumed)."""
        with open(path, "rb", buffering=0) as raw:
            buf = bytearray(BUFFER)
            mv = memoryview(buf)
            left = self.offset
            while left:
                n = raw.readinto(mv[: min(BUFFER, left)])
                if not n:
                    break
                self.hasher.update(mv[:n])
                left -= n


class Transfer:
    """A pull's network side: the HTTP client, the retries of what failed, cancellation."""

    def __init__(self, emit: Callable[[dict], None], *, retries: int = 3, backoff: float = 0.5,
                 timeout: float = 60.0, max_redirects: int = MAX_REDIRECTS):
        self.emit = emit
        self.retries = max(0, int(retries))
        self.backoff = backoff
        self.timeout = timeout
        self.max_redirects = max_redirects
        self._http: Http | None = None
        self._cancel = threading.Event()
        self._active: Response | None = None

    @property
    def http(self) -> Http:
        if self._http is None:
            self._http = Http(timeout=self.timeout, max_redirects=self.max_redirects)
        return self._http

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- control ----------------------------------------------------------------------

    @property
    def cancelled(self) -> threading.Event:
        return self._cancel

    def cancel(self) -> None:
        """Stop soon (from any thread); the partial download is kept for resume."""
        self._cancel.set()
        r = self._active
        if r is not None:
            r.abort()

    def check_cancel(self) -> None:
        if self._cancel.is_set():
            raise PullCancelled("pull cancelled; the partial download is kept: pull again to resume")

    def try_again(self, e: BaseException, tries: int, give_up: Callable[[int], BaseException],
                  say: str | None = None) -> int:
        """After try number ``tries`` failed with ``e`` (called in its ``except``): raise it if
        the pull was cancelled or no retry can mend it, raise ``give_up(tries)`` once the
        retries are spent, else wait the backoff; returns the tries so far. ``say``: what
        failed, for a status that tells the client of the retry (where the stream has begun:
        a timeout is a minute of silence otherwise)."""
        self.check_cancel()
        if not retryable(e):
            raise e
        if tries > self.retries:
            raise give_up(tries) from None
        if say is not None:
            why = getattr(e, "strerror", None) or str(e) or type(e).__name__
            self.emit({"status": f"{say}: {why}; trying again (try {tries + 1} of {self.retries + 1})"})
        self.sleep(self.backoff * (2 ** (tries - 1)))
        return tries

    def sleep(self, seconds: float) -> None:
        if self._cancel.wait(seconds):
            self.check_cancel()

    # -- one file ---------------------------------------------------------------------

    def download(self, rf: RemoteFile, partial: Path, progress: Progress, credentials: Credentials,
                 check_disk: Callable[[int], None]) -> Downloaded:
        """Fetch ``rf`` into ``partial`` (resuming what is there), hashing it on the way; the
        file's first bytes are checked to be a GGUF's when it is one. ``partial``'s ``.json``
        sibling records the URL, validators, size and expected sha256 (for the resume and for
        ``prune``). ``credentials`` go along when ``rf.auth`` says so; ``check_disk(n)``
        raises when ``n`` more bytes do not fit."""
        meta_path = partial.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = {}
        got = _Got()
        got.offset = partial.stat().st_size if partial.exists() else 0
        if got.offset and meta.get("total") and got.offset > meta["total"]:
            got.offset = 0
        magic = rf.gguf  # check the first bytes are a GGUF's (a preset layer is text or JSON)
        if got.offset and magic:
            with open(partial, "rb") as rh:
                got.head = rh.read(4)
            if got.head[:4] != GGUF_MAGIC[: len(got.head[:4])]:
                got.reset()
        if got.offset:
            progress.reached(got.offset, force=True)
            try:
                got.hash_file(partial)
            except OSError:
                got.reset()
        if not got.offset:
            _unlink(partial)
        total = rf.size if rf.size is not None else meta.get("total")
        if rf.size is not None:
            check_disk(rf.size - got.offset)
        attempts = renewals = 0
        # what identifies the bytes already in the partial file: sent back as If-Range, so a
        # server whose file changed answers 200 (start again) instead of 206 (append)
        same_source = meta.get("url") == rf.url or (rf.sha256 is not None and meta.get("sha256") == rf.sha256)
        validators: dict[str, str | None] = (
            {"etag": meta.get("etag"), "last_modified": meta.get("last_modified")} if same_source
            else {"etag": None, "last_modified": None})
        while True:
            self.check_cancel()
            r = None
            try:
                headers = credentials.headers() if rf.auth else {}
                if got.offset:
                    headers["Range"] = f"bytes={got.offset}-"
                    etag, modified = validators.get("etag"), validators.get("last_modified")
                    if etag and not etag.startswith("W/"):
                        headers["If-Range"] = etag
                    elif modified:
                        headers["If-Range"] = modified
                r = self.http.open(rf.url, headers)
                self._active = r
                if self._cancel.is_set():
                    r.abort()
                if r.status == 416 and got.offset and total is not None and got.offset >= total:
                    r.close()
                    break  # we already had every byte
                if r.status == 416:
                    r.close()
                    got.reset()
                    _unlink(partial)
                    raise Dropped("the server refused the resume range; starting again")
                self._check_response(rf, r, credentials)
                if r.status == 206:
                    cr = r.header("Content-Range") or ""
                    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", cr.strip())
                    if not m or int(m.group(1)) != got.offset:
                        r.close()
                        got.reset()
                        _unlink(partial)
                        raise Dropped(f"the server answered the resume with a wrong range ({cr!r}); starting again")
                    if m.group(3) != "*":
                        total = int(m.group(3))
                else:  # 200: the whole file (the server ignored Range or the file changed)
                    if got.offset:
                        got.reset()
                        _unlink(partial)
                        progress.restarted()
                    length = r.header("Content-Length")
                    if length is not None and length.isdigit():
                        total = int(length)
                if rf.size is not None and total is not None and total != rf.size:
                    r.close()
                    listing = "manifest" if rf.media_type else "repository listing"
                    raise PullError(f"{rf.url}: the server sends {total:,} bytes, the {listing} says {rf.size:,}")
                if total is not None:
                    check_disk(total - got.offset)
                progress.sized(total)
                validators = {"etag": r.header("ETag"), "last_modified": r.header("Last-Modified")}
                atomic_write_json(meta_path, {"url": rf.url, **validators, "total": total, "sha256": rf.sha256},
                                  fsync=False)
                self._receive(rf, r, partial, got, total, magic, progress)
                r.close()
                break
            except PullError:
                if r is not None:
                    r.close()
                raise
            except _Renewed:
                renewals += 1
                if renewals > MAX_RENEWALS:
                    raise PullError(f"{rf.url}: the registry refused {renewals} pull tokens in a row") from None
            except BaseException as e:
                if r is not None:
                    r.close()

                def give_up(n: int, e: BaseException = e, offset: int = got.offset,
                            total: int | None = total) -> PullError:
                    kept = partial.exists() and partial.stat().st_size > 0
                    what = f"after {offset:,} of {total:,} bytes" if total else f"after {offset:,} bytes"
                    return PullError(
                        f"download of {rf.path} failed {what}: {e or type(e).__name__} "
                        f"(tried {n} time{'s' if n > 1 else ''}). "
                        + (f"The partial download is kept in {partial}: run the same pull again to resume."
                           if kept else "Nothing was kept."))

                attempts = self.try_again(e, attempts + 1, give_up, say=f"download of {rf.path}")
            finally:
                self._active = None
        progress.reached(got.offset, force=True)
        if magic and (got.offset == 0 or len(got.head) < 4):
            _unlink(partial)
            _unlink(meta_path)
            raise NotAModel(f"{rf.url} sent {got.offset} bytes: not a GGUF file")
        return Downloaded(got.hasher.hexdigest(), got.offset, validators)

    def _receive(self, rf: RemoteFile, r: Response, partial: Path, got: _Got, total: int | None, magic: bool,
                 progress: Progress) -> None:
        """The body of ``r`` appended to ``partial`` and to ``got``. A body cut short raises
        :class:`Dropped`; what arrived is in the file, and in ``got``, for the retry."""
        try:
            fh = open(partial, "ab" if got.offset else "wb", buffering=0)
        except OSError as e:
            raise _write_error(partial, e) from None
        bad_start = None
        writer = _Sink(fh, got.hasher, lambda e: _write_error(partial, e))
        try:
            while True:
                if self._cancel.is_set():
                    r.close()
                    self.check_cancel()
                try:
                    chunk = r.chunk()
                except Dropped:
                    if total is None:
                        raise
                    raise Dropped(f"the connection closed after {got.offset:,} of {total:,} bytes") from None
                if chunk is None:
                    break
                if magic and len(got.head) < 4:
                    got.head += chunk[: 4 - len(got.head)]
                    if got.head != GGUF_MAGIC[: len(got.head)]:
                        bad_start = chunk[:16]
                        break
                writer.put(chunk)  # hashed, then written, while the next chunk arrives
                got.offset += len(chunk)
                progress.reached(got.offset)
        finally:
            try:
                writer.close()
            finally:
                fh.close()
        if bad_start is not None:
            r.close()
            _unlink(partial)
            _unlink(partial.with_suffix(".json"))
            raise NotAModel(f"{rf.url} is not a GGUF file (it starts with {bad_start!r})")
        if total is not None and got.offset < total:
            raise Dropped(f"the connection closed after {got.offset:,} of {total:,} bytes")

    def _check_response(self, rf: RemoteFile, r: Response, credentials: Credentials) -> None:
        if r.status in (200, 206):
            ct = r.content_type
            if rf.gguf and (ct in ("text/html", "application/xhtml+xml") or ct == "application/json"):
                try:
                    snippet = r.read(300).decode("utf-8", "replace")
                except OSError:
                    snippet = ""
                snippet = " ".join(snippet.split())[:160]
                r.close()
                kind = "a JSON document" if ct == "application/json" else "an HTML page"
                hint = (" (for Hugging Face use a /resolve/ URL or hf.co/OWNER/REPO, not the /blob/ page)"
                        if "huggingface" in rf.url or "/blob/" in rf.url else " (is it a download link?)")
                raise NotAModel(f"{rf.url} returned {kind} (Content-Type {ct}), not a GGUF file{hint}: {snippet!r}")
            return
        status, reason = r.status, r.reason
        try:
            snippet = r.read(300).decode("utf-8", "replace")
        except OSError:
            snippet = ""
        r.close()
        snippet = " ".join(snippet.split())[:160]
        if status == 401 and rf.auth and credentials.renew(r):
            raise _Renewed()  # asked again at once, with the new credentials
        if status in (401, 403):
            hint = credentials.refused_hint if rf.auth else ""
            raise PullError(f"{rf.url}: access denied (HTTP {status} {reason}){hint}")
        if status in (404, 410):
            raise PullError(f"{rf.url}: not found (HTTP {status} {reason})")
        if status >= 500 or status == 429:
            raise Dropped(f"HTTP {status} {reason}")
        raise PullError(f"{rf.url}: HTTP {status} {reason}" + (f": {snippet}" if snippet else ""))
