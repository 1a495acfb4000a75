"""One pull, from the plan to the model's manifest: :class:`Puller`, and the entry points
:func:`pull` (synchronous), :func:`pull_stream` (an async generator of statuses) and
:func:`apull`.

A pull plans what to fetch (:mod:`.from_registry`, :mod:`.from_hub`, or the one file of a
URL), then fetches each file as a blob of the store, once:

* a blob the store has is not fetched again; one the Hugging Face cache has (with the sha256
  the Hub states) is hard-linked, else copied, from there (see :mod:`..hfcache`); a plain URL
  fetched before is reused while the server's validators still match;
* two pulls of the same blob at once download it once: in one process through a registry of
  downloads in flight (the second one follows the first's progress), across processes through
  a file lock per blob (the waiter reports the partial file's growth);
* the download (:mod:`.download`) lands in ``partial/``; its sha256 is compared with the one
  the source states (a mismatch discards it), and the GGUF header (or a preset layer's text or
  JSON) is checked before the blob lands (atomically, by rename) and the manifest is written;
* a pull that fails after some of its blobs landed puts them back in ``partial/``, whole:
  nothing but resumable partial files is left behind, and the next pull finishes them
  without downloading them again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from filelock import Timeout as LockTimeout

from .. import hfcache
from ..gguf_info import GGUFError, read_gguf_info
from ..preset import Preset, PresetError
from ..store import (
    MODEL_MEDIA_TYPE,
    PROJECTOR_MEDIA_TYPE,
    BlobMissing,
    ModelEntry,
    ModelStore,
    StoreError,
    _projector_summary,
    _Throttle,
    _unlink,
    atomic_write_json,
    fmt_bytes,
    free_bytes,
)
from .download import Credentials, Transfer
from .errors import BadManifest, DiskFull, HashMismatch, NotAModel, PullCancelled, PullError
from .from_hub import HubToken, hub_plan
from .from_registry import RegistryAuth, registry_plan
from .http_client import MAX_REDIRECTS
from .sources import RemoteFile, derive_name, parse_source

__all__ = ["Puller", "pull", "apull", "pull_stream", "DISK_MARGIN"]

DISK_MARGIN = 1 << 20  # beyond the download itself: its manifest and sidecars (landing it is a rename)
_GGUF_ROLES = {"model": MODEL_MEDIA_TYPE, "projector": PROJECTOR_MEDIA_TYPE}

Fetched = tuple[str, int, dict | None]  # (hex digest, size, parsed summary or None)


# ----------------------------------------------------------------------------- in-flight registry


class _Inflight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.completed = 0
        self.total: int | None = None
        self.error: BaseException | None = None
        self.result: Fetched | None = None


_registry: dict[tuple[str, str], _Inflight] = {}
_registry_lock = threading.Lock()


class _Report:
    """A download's progress, to the pull's statuses (throttled) and to the pulls following
    it (through the in-flight registry)."""

    def __init__(self, inf: _Inflight, tick: _Throttle):
        self.inf = inf
        self.tick = tick

    def sized(self, total: int | None) -> None:
        self.tick.total = total
        self.inf.total = total

    def reached(self, completed: int, force: bool = False) -> None:
        self.inf.completed = completed
        self.tick(completed, force=force)

    def restarted(self) -> None:
        self.inf.completed = 0


# ----------------------------------------------------------------------------- the puller


class Puller:
    """One pull, run synchronously by :meth:`run` (in a worker thread for :func:`pull_stream`)."""

    def __init__(self, store: ModelStore, source: str, name: str | None = None,
                 emit: Callable[[dict], None] | None = None, *, retries: int = 3, backoff: float = 0.5,
                 timeout: float = 60.0, token: str | None = None, endpoint: str | None = None,
                 max_redirects: int = MAX_REDIRECTS, insecure: bool = False):
        self.store = store
        self.src = parse_source(source, endpoint, insecure)
        self.name = derive_name(self.src, name)  # refuses a bad name before any network
        if name is None and self.src.kind == "url":
            # A name made from the file name must not replace a model that came from elsewhere.
            existing = store._find(self.name)
            came_from = (existing.source or {}).get("url") if existing is not None else None
            if existing is not None and came_from != self.src.url:
                raise PullError(f"a model named {self.name.display} already exists (from "
                                f"{came_from or (existing.source or {}).get('type') or 'elsewhere'}); pull this URL "
                                f"under another name (`pull URL --name NAME`), or delete {self.name.display} first")
        self.emit: Callable[[dict], None] = emit or (lambda d: None)
        self.transfer = Transfer(self.emit, retries=retries, backoff=backoff, timeout=timeout,
                                 max_redirects=max_redirects)
        # the source's credentials: a pull token the registry hands out, or the Hub's token
        self._hub_token = HubToken(token if token is not None else hfcache.hf_token())
        self._registry_auth = (RegistryAuth(self.transfer, self.src.registry_ref) if self.src.kind == "registry"
                               else None)
        self.credentials: Credentials = self._registry_auth or self._hub_token
        self._landed: list[tuple[str, str]] = []  # (hex, url) of the blobs this pull put into blobs/

    def cancel(self) -> None:
        """Stop soon (from any thread); the partial download is kept for resume."""
        self.transfer.cancel()

    def _check_cancel(self) -> None:
        self.transfer.check_cancel()

    # -- plan -------------------------------------------------------------------------

    def _plan(self) -> tuple[list[RemoteFile], dict[str, Any]]:
        src = self.src
        if self._registry_auth is not None:
            return registry_plan(self.transfer, self._registry_auth)
        if src.kind == "url":
            url = src.address
            base = urllib.parse.unquote(urllib.parse.urlsplit(url).path).rstrip("/").rsplit("/", 1)[-1]
            return [RemoteFile(url=url, path=base or url, role="model")], {"type": "url", "url": url}
        return hub_plan(self.transfer.http, src, self._hub_token)

    # -- run --------------------------------------------------------------------------

    def run(self) -> ModelEntry:
        self.store.ensure_dirs()
        try:
            return self._run()
        except BaseException:
            self._keep_for_resume()
            raise
        finally:
            self.transfer.close()

    def _keep_for_resume(self) -> None:
        """After a failed pull, the blobs it landed that no manifest uses (the model, when a
        later layer failed) go back to ``partial/``, complete: nothing is left in ``blobs/``,
        ``prune`` can drop them, and the next pull finishes them without a byte downloaded."""
        for hexd, url in self._landed:
            key = f"sha256-{hexd}"
            try:
                with self.store._blob_locks([hexd]):
                    if hexd in self.store._referenced():
                        continue
                    blob = self.store.blob_path(hexd)
                    size = blob.stat().st_size
                    atomic_write_json(self.store.partial_dir / f"{key}.json",
                                      {"url": url, "etag": None, "last_modified": None, "total": size,
                                       "sha256": hexd}, fsync=False)
                    os.replace(blob, self.store.partial_dir / f"{key}.partial")
                    _unlink(self.store._sidecar(hexd))
            except (OSError, StoreError):  # (keeping is a kindness: the pull's own error is the one to say)
                pass

    def _run(self) -> ModelEntry:
        # the manifest (or listing) first: a name the source does not have, or a source that
        # cannot be reached, fails before the first status, so a server answers it with its
        # HTTP status (404 for a model the registry lacks) rather than in a stream begun as 200
        files, record = self._plan()
        self.emit({"status": "pulling manifest"})
        for mt in record.get("skipped_layers") or ():
            self.emit({"status": f"skipping a layer of type {mt} (not used here)"})
        for attempt in range(3):
            results = [self._fetch(rf) for rf in files]
            layers: list[dict] = []
            land_info: dict | None = None
            proj_info: dict | None = None
            for rf, (hexd, size, parsed) in zip(files, results, strict=True):
                media = rf.media_type or _GGUF_ROLES[rf.role]
                layers.append({"mediaType": media, "digest": f"sha256:{hexd}", "size": size})
                if rf.role == "model":
                    land_info = parsed if parsed is not None else self._model_info(hexd)
                elif rf.role == "projector":
                    proj_info = parsed if parsed is not None else _projector_summary(str(self.store.blob_path(hexd)))
            if land_info is None:  # (every plan has a model: the registry's refuses a manifest without one)
                raise PullError(f"{self.src.text}: nothing to pull (no model file)")
            try:
                entry = self.store._commit(self.name, layers, land_info, record, proj_info, progress=self.emit)
                break
            except BlobMissing:
                if attempt == 2:
                    raise
        self.emit({"status": "success"})
        return entry

    def _model_info(self, hexd: str) -> dict:
        path = self.store.blob_path(hexd)
        try:
            return self.store._summary(read_gguf_info(path))
        except GGUFError as e:
            raise NotAModel(f"the downloaded file is not a usable GGUF model: {e.reason}") from None

    # -- one blob ---------------------------------------------------------------------

    def _status_base(self, rf: RemoteFile) -> dict:
        if rf.sha256:
            return {"status": f"pulling {rf.sha256[:12]}", "digest": f"sha256:{rf.sha256}"}
        return {"status": f"pulling {rf.path}"}

    def _fetch(self, rf: RemoteFile) -> Fetched:
        """(hex digest, size, parsed summary or None) of the blob behind ``rf``, downloading it once."""
        if rf.sha256:
            key = f"sha256-{rf.sha256}"
        else:
            key = "url-" + hashlib.sha256(rf.url.encode()).hexdigest()[:40]
        while True:
            self._check_cancel()
            if rf.sha256 and self.store.has_blob(rf.sha256, rf.size):
                size = rf.size if rf.size is not None else self.store.blob_path(rf.sha256).stat().st_size
                _Throttle(self.emit, self._status_base(rf), size)(size, force=True)
                return rf.sha256, size, None
            rkey = (str(self.store.root.resolve()), key)
            with _registry_lock:
                found = _registry.get(rkey)
                leader = found is None
                inf = found if found is not None else _Inflight()
                if leader:
                    _registry[rkey] = inf
                    inf.total = rf.size
            if not leader:
                self._follow(rf, inf)
                if inf.error is None and inf.result is not None:
                    return inf.result
                if isinstance(inf.error, PullCancelled) or inf.error is None:
                    continue  # the other pull stopped: take over
                err = inf.error
                raise type(err)(str(err)) if isinstance(err, PullError) else PullError(str(err))
            try:
                inf.result = self._lead(rf, key, inf)
                return inf.result
            except BaseException as e:
                inf.error = e
                raise
            finally:
                with _registry_lock:
                    _registry.pop(rkey, None)
                inf.done.set()

    def _follow(self, rf: RemoteFile, inf: _Inflight) -> None:
        tick = _Throttle(self.emit, self._status_base(rf), inf.total)
        while not inf.done.wait(0.1):
            self._check_cancel()
            tick.total = inf.total
            tick(inf.completed)
        tick.total = inf.total
        if inf.error is None and inf.result is not None:
            tick(inf.result[1], force=True)

    def _lead(self, rf: RemoteFile, key: str, inf: _Inflight) -> Fetched:
        partial = self.store.partial_dir / f"{key}.partial"
        lock = self.store.removable_lock(f"dl-{key}")  # gone when this pull ends, however it ends
        tick = _Throttle(self.emit, self._status_base(rf), rf.size)
        # another process may be fetching the same blob: wait for it, showing its progress
        while True:
            self._check_cancel()
            try:
                lock.acquire(timeout=0.1)
                break
            except LockTimeout:
                try:
                    done = partial.stat().st_size
                except OSError:
                    done = 0
                inf.completed = done
                tick(done)
        try:
            if rf.sha256 and self.store.has_blob(rf.sha256, rf.size):
                size = self.store.blob_path(rf.sha256).stat().st_size
                tick.total = size
                tick(size, force=True)
                return rf.sha256, size, None
            if not rf.sha256:
                reused = self._reuse_url(rf, key, tick)
                if reused is not None:
                    return reused
            if rf.sha256 and rf.hf_repo:
                linked = self._from_hf_cache(rf, rf.hf_repo, rf.sha256, tick)
                if linked is not None:
                    _unlink(partial)  # a resume of it is no longer needed
                    _unlink(self.store.partial_dir / f"{key}.json")
                    return linked
            return self._download(rf, key, partial, inf, tick)
        finally:
            lock.release()

    def _from_hf_cache(self, rf: RemoteFile, repo: str, sha256: str, tick: _Throttle) -> Fetched | None:
        """The Hub file ``rf`` from the Hugging Face cache, if a cached file has its sha256:
        hard-linked (else copied) into the store, hashed on the way, checked as a download
        would be. None when the cache has no such file (or none that hashes right)."""
        for cached in hfcache.cached_copies(repo, rf.path, sha256, rf.size):
            self._check_cancel()
            label = f"{rf.path} from the Hugging Face cache ({cached})"
            try:
                hexd, size, _how, tmp = self.store._import_file(str(cached), "auto", self.emit, label,
                                                                cancel=self.transfer.cancelled)
            except (OSError, StoreError):
                self._check_cancel()
                continue
            try:
                if hexd != sha256:
                    self.emit({"status": f"{cached} is not {rf.path} (its sha256 differs): downloading it"})
                    continue
                try:
                    parsed = (_projector_summary(str(tmp)) if rf.role == "projector"
                              else self.store._summary(read_gguf_info(tmp)))
                except GGUFError:
                    continue
                with self.store._blob_locks([hexd]):
                    self.store.land_blob(tmp, hexd)
                self._landed.append((hexd, rf.url))
            finally:
                _unlink(tmp)
            tick.total = size
            tick(size, force=True)
            return hexd, size, parsed
        return None

    def _reuse_url(self, rf: RemoteFile, key: str, tick: _Throttle) -> Fetched | None:
        """A plain URL fetched before: reuse its blob when the server's validators still match."""
        rec_path = self.store.urls_dir / f"{key}.json"
        try:
            rec = json.loads(rec_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        hexd, size = rec.get("digest", "")[7:], rec.get("size")
        if rec.get("url") != rf.url or not self.store.has_blob(hexd, size):
            return None
        try:
            r = self.transfer.http.open(rf.url, method="HEAD")
            r.close()
        except (OSError, PullError):
            return None
        etag, modified = r.header("ETag"), r.header("Last-Modified")
        length = r.header("Content-Length")
        same = r.status == 200 and (
            (etag and etag == rec.get("etag"))
            or (not etag and modified and modified == rec.get("last_modified") and str(size) == length))
        if not same:
            return None
        tick.total = size
        tick(size, force=True)
        return hexd, size, None

    def _check_disk(self, need: int) -> None:
        if need <= 0:
            return
        free = free_bytes(self.store.root)
        if free is not None and free < need + DISK_MARGIN:
            raise DiskFull(f"not enough disk space for the download: it needs {fmt_bytes(need)} "
                           f"(plus {fmt_bytes(DISK_MARGIN)} to spare), {self.store.root} has {fmt_bytes(free)} free")

    def _download(self, rf: RemoteFile, key: str, partial: Path, inf: _Inflight, tick: _Throttle) -> Fetched:
        """Download ``rf`` (resuming its partial file), check it and land it as a blob."""
        meta_path = self.store.partial_dir / f"{key}.json"
        got = self.transfer.download(rf, partial, _Report(inf, tick), self.credentials, self._check_disk)
        self.emit({"status": "verifying sha256 digest", **({"digest": f"sha256:{rf.sha256}"} if rf.sha256 else {})})
        hexd = got.hexd
        if rf.sha256 and hexd != rf.sha256:
            _unlink(partial)
            _unlink(meta_path)
            raise HashMismatch(f"{rf.path}: sha256 mismatch: the source states {rf.sha256}, the bytes hash to "
                               f"{hexd}; the download was discarded (try again; if it persists, the file changed "
                               f"upstream)")
        parsed: dict | None
        try:
            if not rf.gguf:
                parsed = None
                self._check_preset_layer(rf, partial)
            elif rf.role == "projector":
                parsed = _projector_summary(str(partial))
            else:
                parsed = self.store._summary(read_gguf_info(partial))
        except PullError:
            _unlink(partial)
            _unlink(meta_path)
            raise
        except GGUFError as e:
            _unlink(partial)
            _unlink(meta_path)
            raise NotAModel(f"{rf.url} is not a usable GGUF {'projector' if rf.role == 'projector' else 'model'}: "
                            f"{e.reason}") from None
        with self.store._blob_locks([hexd]):
            self.store.land_blob(partial, hexd)
        self._landed.append((hexd, rf.url))
        _unlink(meta_path)
        if not rf.sha256:
            atomic_write_json(self.store.urls_dir / f"{key}.json",
                              {"url": rf.url, "digest": f"sha256:{hexd}", "size": got.size, **got.validators},
                              fsync=False)
        return hexd, got.size, parsed

    @staticmethod
    def _check_preset_layer(rf: RemoteFile, path: Path) -> None:
        """A downloaded preset layer holds what its media type says (text; params a JSON object;
        messages a JSON list), or PullError."""
        data = path.read_bytes()
        layer = {"mediaType": rf.media_type, "digest": f"sha256:{rf.sha256}", "size": len(data)}
        try:
            Preset.from_layers([layer], lambda _ly: data)
        except PresetError as e:
            raise BadManifest(f"{rf.path}: {e}; the registry's model is not usable") from None


# ----------------------------------------------------------------------------- entry points


def pull(source: str, name: str | None = None, progress: Callable[[dict], None] | None = None, *,
         store: ModelStore | None = None, **kw: Any) -> ModelEntry:
    """Pull synchronously in the calling thread; ``progress(status_dict)`` as it goes."""
    store = store if store is not None else ModelStore()
    return Puller(store, source, name, progress, **kw).run()


async def pull_stream(source: str, name: str | None = None, *, store: ModelStore | None = None,
                      **kw: Any) -> AsyncIterator[dict]:
    """Async generator of Ollama status dicts; the work runs in a thread.

    Closing the generator early (a client that went away) cancels the download and keeps
    the partial file for resume. Errors are raised after the last status.
    """
    store = store if store is not None else ModelStore()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone
            pass

    # (its set-up reads the store's manifests and the Hub token: off the event loop too)
    puller = await asyncio.to_thread(Puller, store, source, name, lambda d: put(("status", d)), **kw)

    def work() -> None:
        try:
            put(("done", puller.run()))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(("error", e))

    thread = threading.Thread(target=work, name=f"jupyter-llama-pull {source}", daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            kind, value = await queue.get()
            if kind == "status":
                yield value
            elif kind == "error":
                finished = True
                raise value
            else:
                finished = True
                return
    finally:
        if not finished:
            puller.cancel()
            await asyncio.to_thread(thread.join, 30)


async def apull(source: str, name: str | None = None, progress: Callable[[dict], None] | None = None, *,
                store: ModelStore | None = None, **kw: Any) -> ModelEntry:
    """Async pull; returns the entry. ``progress`` gets each status dict."""
    store = store if store is not None else ModelStore()
    mname = derive_name(parse_source(source, kw.get("endpoint")), name)
    async for status in pull_stream(source, name, store=store, **kw):
        if progress is not None:
            progress(status)
    return await asyncio.to_thread(store.entry, mname)
