"""Downloads into the store: Ollama's registry, Hugging Face repos and plain http(s) URLs.

Sources (see :func:`parse_source`):

* a registry name, ``[host/][namespace/]model[:tag]`` (``llama3.2:1b``): Ollama's registry
  protocol (see :mod:`.registry`): the manifest, then its layers as blobs: the GGUF, a
  projector, and the template, system, params, license and messages layers, which become the
  model's preset. The registry is ``JUPYTER_LLAMA_REGISTRY`` (default
  https://registry.ollama.ai); the model is filed under the registry's name
  (``registry.ollama.ai/library/llama3.2:1b``), which the bare name also finds and is shown
  by (``llama3.2:1b``, unless a model made here has that name). Pulling it again fetches the
  manifest again and downloads only the blobs the store lacks.
* ``hf.co/OWNER/REPO[:QUANT]``, ``huggingface.co/OWNER/REPO[:QUANT]``, ``hf://OWNER/REPO[:QUANT]``,
  ``https://huggingface.co/OWNER/REPO`` (a repo: the GGUF is chosen by quantisation tag and
  the multimodal projector, ``mmproj*.gguf``, comes along when the repo has one), and
  ``https://huggingface.co/OWNER/REPO/resolve/REV/FILE.gguf`` (that one file).
  The Hub is ``HF_ENDPOINT`` (default https://huggingface.co); the token (``HF_TOKEN``, else
  the one ``huggingface-cli login`` saved) is sent as a bearer token to it, and to nothing
  else. A file already in the Hugging Face cache (``HF_HOME``; what ``huggingface_hub``
  downloaded) with the sha256 the Hub states is hard-linked (else copied) into the store
  instead of downloaded again (see :mod:`.hfcache`).
* any other ``http://`` or ``https://`` URL of a GGUF file.

How a blob is fetched:

* into ``partial/<key>.partial`` in the store; a pull that is interrupted (dropped
  connection, Ctrl-C, a closed stream) keeps the partial file, and the next pull of the same
  blob resumes it with ``Range`` (``If-Range`` guards against a changed file);
* a dropped connection is retried with ``Range`` a few times before it becomes an error;
* the sha256 is computed while the bytes arrive, and compared with the one the source
  states (the Hub's LFS oid, the registry's digest); a mismatch discards the download; the
  GGUF header (or a preset layer's text or JSON) is checked before the blob lands
  (atomically, by rename) and the manifest is written;
* a pull that fails after some of its blobs landed puts them back in ``partial/``, whole:
  nothing but resumable partial files is left behind, and the next pull finishes them
  without downloading them again;
* two pulls of the same blob at once download it once: in one process through a registry
  of downloads in flight (the second one follows the first's progress), across processes
  through a file lock per blob (the waiter reports the partial file's growth).

Progress is a stream of Ollama's status dicts: ``pulling manifest``, ``pulling <12 hex>``
with ``digest``, ``total``, ``completed``, ``verifying sha256 digest``, ``writing manifest``,
``success``. :func:`pull_stream` is an async generator of them (the download itself runs in a
worker thread, so nothing blocks the event loop); :func:`pull` is the same, synchronous,
calling ``progress(dict)``. Errors are raised (:class:`PullError` and subclasses); a server
turns them into a final ``{"error": ...}`` line.

Transfers use the standard library's ``http.client`` rather than httpx: on a local server
it moves a large body at about the speed of ``curl``, where httpx's streaming is several
times slower (see ``bench/pull_throughput.py``). Proxies from the environment
(``http_proxy``, ``https_proxy``, ``no_proxy``) are honoured.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import os
import queue
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

from filelock import Timeout as LockTimeout

from ..errors import StorageFull
from . import hfcache, registry
from .gguf_info import GGUF_MAGIC, GGUFError, read_gguf_info
from .names import DEFAULT_REGISTRY, DEFAULT_TAG, InvalidName, ModelName, parse_name, plainly_a_path
from .preset import Preset, PresetError
from .store import (
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

__all__ = [
    "PullError",
    "PullCancelled",
    "DiskFull",
    "HashMismatch",
    "NotAModel",
    "NotInRegistry",
    "RegistryUnreachable",
    "BadManifest",
    "Source",
    "parse_source",
    "derive_name",
    "choose_files",
    "pull",
    "apull",
    "pull_stream",
    "render_progress",
    "ProgressPrinter",
]

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_QUANT_ORDER = ("Q4_K_M", "Q4_0", "Q8_0")
PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")
MAX_REDIRECTS = 10
DISK_MARGIN = 1 << 20  # beyond the download itself: its manifest and sidecars (landing it is a rename)
BUFFER = 1 << 20
_USER_AGENT = "jupyter-llama/0.1 (+python http.client)"


# ----------------------------------------------------------------------------- errors


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


class _Renewed(Exception):
    """The registry's pull token expired mid-pull and a new one was given: ask again at once
    (not a failed try; at most MAX_RENEWALS times a file)."""


MAX_RENEWALS = 3

_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")  # RFC 6750's token characters
MAX_TOKEN_CHARS = 8192


class _Dropped(Exception):
    """The body ended early or the connection broke: retry with Range."""


# ----------------------------------------------------------------------------- sources


_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Source:
    kind: str  # "hf" | "url" | "registry"
    text: str
    url: str | None = None  # kind == "url"
    repo: str | None = None  # kind == "hf": OWNER/REPO
    quant: str | None = None  # the tag asked for, if any
    file: str | None = None  # an explicit file in the repo
    revision: str = "main"
    endpoint: str = DEFAULT_ENDPOINT
    ref: registry.RegistryRef | None = None  # kind == "registry"


def _endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _hf_source(text: str, rest: str, endpoint: str) -> Source:
    rest = rest.strip("/")
    segs = rest.split("/")
    quant = None
    file = None
    revision = "main"
    if len(segs) >= 5 and segs[2] in ("resolve", "blob"):
        revision = urllib.parse.unquote(segs[3])
        file = urllib.parse.unquote("/".join(segs[4:]))
        segs = segs[:2]
    if len(segs) != 2:
        raise PullError(f"not a Hugging Face model source: {text!r}; the form is hf.co/OWNER/REPO[:QUANT]")
    owner, repo = segs
    if ":" in repo:
        repo, quant = repo.split(":", 1)
        if not quant:
            raise PullError(f"empty quantisation tag after ':' in {text!r}")
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", quant):
            raise PullError(f"bad quantisation tag {quant!r} in {text!r}")
    for part in (owner, repo):
        if not _HF_PART.match(part) or ".." in part:
            raise PullError(f"bad Hugging Face repo id {owner}/{repo!r} in {text!r}: "
                            f"use letters, digits, '-', '_' and '.'")
    return Source("hf", text, repo=f"{owner}/{repo}", quant=quant, file=file, revision=revision, endpoint=endpoint)


def parse_source(text: str, endpoint: str | None = None, insecure: bool = False) -> Source:
    """Classify a pull source. Raises PullError for anything that is neither a URL nor a repo."""
    if not isinstance(text, str) or not text.strip():
        raise PullError("nothing to pull: give an http(s) URL or hf.co/OWNER/REPO[:QUANT]")
    t = text.strip()
    ep = _endpoint(endpoint)
    low = t.lower()
    if low.startswith("hf://"):
        return _hf_source(t, t[5:], ep)
    for prefix in ("hf.co/", "huggingface.co/"):
        if low.startswith(prefix):
            return _hf_source(t, t[len(prefix):], ep)
    if low.startswith(("http://", "https://")):
        u = urllib.parse.urlsplit(t)
        if not u.hostname:
            raise PullError(f"bad URL {t!r}: no host")
        host = u.hostname.lower()
        if host in ("huggingface.co", "www.huggingface.co", "hf.co"):
            return _hf_source(t, u.path, ep)
        if t.startswith(ep + "/") and ep != DEFAULT_ENDPOINT:
            # a file URL on a custom Hub endpoint: OWNER/REPO/resolve/REV/FILE
            segs = urllib.parse.urlsplit(t[len(ep):]).path.strip("/").split("/")
            if len(segs) >= 5 and segs[2] in ("resolve", "blob"):
                return _hf_source(t, "/".join(segs), ep)
        return Source("url", t, url=t, endpoint=ep)
    if "://" in t:
        raise PullError(f"cannot pull {t!r}: only http(s) URLs are fetched; give an http(s) URL of a GGUF file, "
                        f"a Hugging Face repo (hf.co/OWNER/REPO[:QUANT]) or a registry name such as llama3.2:1b")
    if plainly_a_path(t):
        raise PullError(f"{t!r} looks like a file on this machine, which is not pulled: register it with "
                        f"`create NAME --from {t}`")
    try:
        ref = registry.parse_registry_name(t, insecure=insecure)
    except InvalidName as e:
        raise PullError(f"cannot pull {t!r}: {e.reason}; give a registry name ([host/][namespace/]model[:tag], "
                        f"such as llama3.2:1b), a Hugging Face repo (hf.co/OWNER/REPO[:QUANT]) or an http(s) URL "
                        f"of a GGUF file") from None
    return Source("registry", t, url=ref.manifest_url, endpoint=ref.base, ref=ref)


_QUANT_TOKEN = re.compile(
    r"(?i)(?:^|[^A-Za-z0-9])((?:I?Q[1-8](?:_[A-Z0-9]+)*)|(?:B?F16)|F32|FP16|MXFP4(?:_MOE)?|TQ[12]_0)(?=$|[-.])")


def _quant_of(path: str) -> str | None:
    stem = re.sub(r"(?i)(-\d{5}-of-\d{5})?\.gguf$", "", path.rsplit("/", 1)[-1])
    found = _QUANT_TOKEN.findall(stem)
    return found[-1].upper() if found else None


def _sanitize_model(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
    s = re.sub(r"\.{2,}", ".", s)
    s = s.lstrip(".-")
    return s[:96].rstrip(".-")


def derive_name(src: Source | str, name: str | None = None) -> ModelName:
    """The name a pull files its model under (``name`` if given). No network."""
    if isinstance(src, str):
        src = parse_source(src)
    if name:
        return parse_name(name)
    if src.kind == "registry":
        return src.ref.name
    if src.kind == "hf":
        owner, repo = src.repo.split("/")
        tag = src.quant
        if tag is None and src.file:
            tag = _quant_of(src.file) or _sanitize_model(re.sub(r"(?i)\.gguf$", "", src.file.rsplit("/", 1)[-1]))
        text = f"hf.co/{owner}/{repo}:{tag or DEFAULT_TAG}"
        try:
            return parse_name(text)
        except InvalidName as e:
            raise PullError(f"cannot file {src.text!r} as {text!r} ({e.reason}); give a name to pull it as") from None
    path = urllib.parse.unquote(urllib.parse.urlsplit(src.url).path)
    base = path.rstrip("/").rsplit("/", 1)[-1]
    base = re.sub(r"(?i)\.gguf$", "", base)
    model = _sanitize_model(base)
    try:
        return parse_name(f"{model}:{DEFAULT_TAG}")
    except InvalidName:
        raise PullError(f"cannot make a model name from the URL {src.url!r}; give a name to pull it as") from None


# ----------------------------------------------------------------------------- choosing files


@dataclass
class RemoteFile:
    url: str
    path: str  # name in the repo (or the URL's file name, or the registry layer's description)
    role: str  # "model" | "projector" | a preset part: "template", "system", "params", "license", "messages"
    size: int | None = None
    sha256: str | None = None
    auth: bool = False  # send the source's credentials: the HF token to the Hub, a registry's pull token to it
    media_type: str | None = None  # the manifest layer's (default: by role, model or projector)
    hf_repo: str | None = None  # a Hub file: OWNER/REPO, whose Hugging Face cache may already hold it

    @property
    def gguf(self) -> bool:
        return self.role in ("model", "projector")


_GGUF_ROLES = {"model": MODEL_MEDIA_TYPE, "projector": PROJECTOR_MEDIA_TYPE}


def _is_projector(path: str) -> bool:
    return "mmproj" in path.rsplit("/", 1)[-1].lower()


def _split_part(path: str) -> tuple[int, int] | None:
    m = re.search(r"(?i)-(\d{5})-of-(\d{5})\.gguf$", path)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _matches_tag(path: str, tag: str) -> bool:
    stem = re.sub(r"(?i)\.gguf$", "", path)
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    return re.search(rf"(?i)(?:^|[^A-Za-z0-9]){re.escape(tag)}(?=$|[-./])", stem) is not None


def _describe_files(files: list[dict]) -> str:
    out = []
    for f in sorted(files, key=lambda f: f["path"]):
        q = _quant_of(f["path"])
        out.append(f"{f['path']}" + (f" ({q})" if q else ""))
    return ", ".join(out)


def choose_files(entries: list[dict], quant: str | None, repo: str = "", file: str | None = None
                 ) -> tuple[dict, dict | None]:
    """Pick (model file, projector file or None) from a Hub tree listing.

    ``quant`` matches a tag in the file name, case-insensitively (``Q4_K_M`` matches
    ``model-Q4_K_M.gguf`` but not ``model-Q4_K_M_L.gguf``), or a whole file name. Without
    one: Q4_K_M, then Q4_0, then Q8_0, then the smallest GGUF. The projector is the f16
    ``mmproj*.gguf`` (or the only one).
    """
    files = [e for e in entries if e.get("type", "file") == "file" and str(e.get("path", "")).lower().endswith(".gguf")]
    models = [e for e in files if not _is_projector(e["path"])]
    projectors = [e for e in files if _is_projector(e["path"])]
    where = f" in {repo}" if repo else ""
    if file is not None:
        hit = next((e for e in files if e["path"] == file), None)
        if hit is None:
            raise PullError(f"no file {file!r}{where}; GGUF files there: {_describe_files(files) or 'none'}")
        chosen = hit
    else:
        if not models:
            raise PullError(f"no GGUF model file{where}" + (f" (only projectors: {_describe_files(projectors)})"
                                                            if projectors else ""))
        firsts = [e for e in models if (_split_part(e["path"]) or (1, 1))[0] == 1]
        if quant:
            exact = [e for e in models if e["path"].lower() == quant.lower()
                     or e["path"].rsplit("/", 1)[-1].lower() in (quant.lower(), quant.lower() + ".gguf")]
            hits = exact or [e for e in firsts if _matches_tag(e["path"], quant)]
            if not hits:
                raise PullError(f"no GGUF matching {quant!r}{where}; it has: {_describe_files(models)}")
            if len(hits) > 1:
                raise PullError(f"{quant!r} is ambiguous{where}: {_describe_files(hits)}; "
                                f"give the whole file name as the tag")
            chosen = hits[0]
        else:
            chosen = None
            for q in DEFAULT_QUANT_ORDER:
                hits = [e for e in firsts if _matches_tag(e["path"], q)]
                if hits:
                    chosen = min(hits, key=lambda e: (_size_of(e), e["path"]))
                    break
            if chosen is None:
                chosen = min(firsts or models, key=lambda e: (_size_of(e), e["path"]))
    part = _split_part(chosen["path"])
    if part is not None:
        raise PullError(f"{chosen['path']} is one of {part[1]} parts of a split GGUF, which the store cannot hold "
                        f"yet; merge the parts with `llama-gguf-split --merge` and create the model from the result")
    projector = None
    if file is None and projectors:
        if len(projectors) == 1:
            projector = projectors[0]
        else:
            def rank(e):
                stem = e["path"].rsplit("/", 1)[-1].lower()
                for i, p in enumerate(PROJECTOR_PREFERENCE):
                    if re.search(rf"(?:^|[^a-z0-9]){p}(?=$|[-._])", stem):
                        return (i, e["path"])
                return (len(PROJECTOR_PREFERENCE), e["path"])
            projector = min(projectors, key=rank)
    return chosen, projector


def _size_of(e: dict) -> int:
    lfs = e.get("lfs") or {}
    return int(lfs.get("size") or e.get("size") or 0)


# ----------------------------------------------------------------------------- http


class _Response:
    def __init__(self, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self.url = url
        self.conn = conn
        self.resp = resp
        self.status = resp.status
        self.reason = resp.reason

    def header(self, name: str) -> str | None:
        return self.resp.getheader(name)

    @property
    def content_type(self) -> str:
        return (self.header("Content-Type") or "").split(";")[0].strip().lower()

    def readinto(self, buf) -> int:
        return self.resp.readinto(buf)

    def read(self, n: int = -1) -> bytes:
        return self.resp.read() if n < 0 else self.resp.read(n)

    def abort(self) -> None:
        """Break the connection from another thread (a blocked read returns)."""
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.resp.close()
        finally:
            self.conn.close()


def _origin(url: str) -> tuple[str, str, int]:
    u = urllib.parse.urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return (u.scheme, (u.hostname or "").lower(), port)


class _Http:
    def __init__(self, timeout: float = 60.0, max_redirects: int = MAX_REDIRECTS):
        self.timeout = timeout
        self.max_redirects = max_redirects
        self._proxies = urllib.request.getproxies()

    def _proxy(self, scheme: str, host: str) -> urllib.parse.SplitResult | None:
        if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
            return None
        proxy = self._proxies.get(scheme)
        if not proxy:
            return None
        try:
            if urllib.request.proxy_bypass(host):
                return None
        except Exception:  # pragma: no cover - platform quirks
            pass
        if "://" not in proxy:
            proxy = "http://" + proxy
        return urllib.parse.urlsplit(proxy)

    def _connect(self, url: str) -> tuple[http.client.HTTPConnection, str, dict]:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise PullError(f"unsupported URL scheme in {url!r}: use http or https")
        host = u.hostname
        if not host:
            raise PullError(f"bad URL {url!r}: no host")
        port = u.port or (443 if u.scheme == "https" else 80)
        target = urllib.parse.urlunsplit(("", "", u.path or "/", u.query, ""))
        proxy = self._proxy(u.scheme, host.lower())
        extra: dict = {}
        proxy_auth = None
        if proxy is not None and proxy.username:
            cred = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
            proxy_auth = {"Proxy-Authorization": "Basic " + base64.b64encode(cred.encode()).decode()}
        if u.scheme == "https":
            ctx = ssl.create_default_context()
            if proxy is not None:
                conn = http.client.HTTPSConnection(proxy.hostname, proxy.port or 8080, timeout=self.timeout,
                                                   context=ctx)
                conn.set_tunnel(host, port, headers=proxy_auth)
            else:
                conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=ctx)
        else:
            if proxy is not None:
                conn = http.client.HTTPConnection(proxy.hostname, proxy.port or 8080, timeout=self.timeout)
                target = url
                extra = proxy_auth or {}
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
        return conn, target, extra

    def open(self, url: str, headers: dict | None = None, method: str = "GET") -> _Response:
        """Send a request, following redirects (at most ``max_redirects``); the final response.

        ``Authorization`` is dropped when a redirect leaves the original origin.
        """
        hdrs = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}
        hdrs.update(headers or {})
        origin = _origin(url)
        seen = 0
        while True:
            conn, target, extra = self._connect(url)
            try:
                conn.request(method, target, headers={**hdrs, **extra})
                resp = conn.getresponse()
            except BaseException:
                conn.close()
                raise
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                location = resp.getheader("Location")
                try:
                    resp.read(65536)
                except (OSError, http.client.HTTPException):
                    pass
                resp.close()
                conn.close()
                seen += 1
                if seen > self.max_redirects:
                    raise PullError(f"too many redirects (more than {self.max_redirects}) fetching {url}: "
                                    f"the server is redirecting in a loop")
                url = urllib.parse.urljoin(url, location)
                if _origin(url) != origin:
                    hdrs.pop("Authorization", None)
                if resp.status == 303:
                    method = "GET"
                continue
            return _Response(url, conn, resp)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, (_Dropped, http.client.HTTPException, ConnectionError, TimeoutError, socket.timeout)) or (
        isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError)))


class _Sink:
    """Hashes and writes received chunks in a pipeline of two threads (receive -> hash -> write),
    so that on a machine with cores to spare a download runs at the speed of its slowest
    step rather than the sum of all three. A pool of buffers bounds the memory. The hash
    object belongs to the hashing thread until :meth:`close`; a write error is raised,
    converted by ``make_error``, at the next :meth:`buffer` or at :meth:`close`."""

    def __init__(self, fh, hasher, make_error: Callable[[OSError], BaseException], buffers: int = 8,
                 size: int = BUFFER):
        self.fh = fh
        self.hasher = hasher
        self.make_error = make_error
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.to_hash: queue.SimpleQueue = queue.SimpleQueue()
        self.to_write: queue.SimpleQueue = queue.SimpleQueue()
        self.error: OSError | None = None
        self._converted: BaseException | None = None
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

    def _raise(self):
        if self._converted is None:  # converted once: the conversion may clean up after the failure
            self._converted = self.make_error(self.error)
        raise self._converted

    def buffer(self) -> bytearray:
        if self.error is not None:
            self._raise()
        return self.free.get()

    def give_back(self, buf: bytearray) -> None:
        self.free.put(buf)

    def put(self, buf: bytearray, n: int) -> None:
        self.to_hash.put((buf, n))

    def close(self) -> None:
        """Wait until every queued chunk is hashed and written."""
        self.to_hash.put(None)
        for t in self.threads:
            t.join()
        if self.error is not None:
            self._raise()


# ----------------------------------------------------------------------------- in-flight registry


class _Inflight:
    def __init__(self):
        self.done = threading.Event()
        self.completed = 0
        self.total: int | None = None
        self.error: BaseException | None = None
        self.result: tuple[str, int, dict | None] | None = None


_registry: dict[tuple[str, str], _Inflight] = {}
_registry_lock = threading.Lock()


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
        self.emit = emit or (lambda d: None)
        self.retries = max(0, int(retries))
        self.backoff = backoff
        self.token = token if token is not None else hfcache.hf_token()
        self._registry_token: str | None = None  # a pull token the registry handed out (registry.token_url)
        self.http = _Http(timeout=timeout, max_redirects=max_redirects)
        self._landed: list[tuple[str, str]] = []  # (hex, url) of the blobs this pull put into blobs/
        self._cancel = threading.Event()
        self._active: _Response | None = None

    # -- control ----------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop soon (from any thread); the partial download is kept for resume."""
        self._cancel.set()
        r = self._active
        if r is not None:
            r.abort()

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise PullCancelled("pull cancelled; the partial download is kept: pull again to resume")

    def _try_again(self, e: BaseException, tries: int, give_up, say: str | None = None) -> int:
        """After try number ``tries`` failed with ``e`` (called in its ``except``): raise it if
        the pull was cancelled or no retry can mend it, raise ``give_up(tries)`` once the
        retries are spent, else wait the backoff; returns the tries so far. ``say``: what
        failed, for a status that tells the client of the retry (where the stream has begun:
        a timeout is a minute of silence otherwise)."""
        self._check_cancel()
        if not _retryable(e):
            raise e
        if tries > self.retries:
            raise give_up(tries) from None
        if say is not None:
            why = getattr(e, "strerror", None) or str(e) or type(e).__name__
            self.emit({"status": f"{say}: {why}; trying again (try {tries + 1} of {self.retries + 1})"})
        self._sleep(self.backoff * (2 ** (tries - 1)))
        return tries

    def _sleep(self, seconds: float) -> None:
        if self._cancel.wait(seconds):
            self._check_cancel()

    # -- plan -------------------------------------------------------------------------

    def _auth_headers(self) -> dict:
        """The source's credentials (the opener drops them on a redirect to another origin)."""
        token = self._registry_token if self.src.kind == "registry" else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _registry_login(self, challenge: str | None) -> bool:
        """Ask the token service a registry's 401 names (Docker's token protocol, see
        :mod:`.registry`) for a pull token, without credentials; True when it gave one. A
        realm a registry over TLS names over plain http is refused in words."""
        ref = self.src.ref
        ch = registry.bearer_challenge(challenge)
        if ch is None:
            return False
        url = registry.token_url(ch)
        if not registry.tls_kept(url, ref.base):
            raise PullError(f"the registry {ref.base} sends clients for a token to {ch['realm']}, which is not "
                            f"https: refused (a token service must use TLS when the registry does)")
        try:
            r = self.http.open(url, {"Accept": "application/json"})
            try:
                body = r.read(1 << 16)
            finally:
                r.close()
        except PullError:
            raise
        except (OSError, http.client.HTTPException) as e:
            raise RegistryUnreachable(f"cannot reach {ch['realm']} for a pull token of {ref.text}: "
                                      f"{getattr(e, 'strerror', None) or e}; try the pull again") from None
        if not registry.tls_kept(r.url, ref.base):
            raise PullError(f"the token service {ch['realm']} redirected to {_origin(r.url)[0]}://: refused (a "
                            f"token service must use TLS when the registry does)")
        if r.status >= 500 or r.status == 429:
            raise RegistryUnreachable(f"the token service {ch['realm']} of {ref.base} answered HTTP {r.status} "
                                      f"{r.reason}; try the pull again")
        if r.status != 200:
            return False  # refused: the registry's own refusal says the rest
        try:
            doc = json.loads(body)
        except ValueError:
            return False
        token = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or not _TOKEN.match(token):
            return False  # none, or not a token a header can carry
        self._registry_token = token
        return True

    def _json(self, url: str, what: str) -> tuple[object, str | None]:
        try:
            r = self.http.open(url, {**self._auth_headers(), "Accept": "application/json"})
        except PullError:
            raise
        except (OSError, http.client.HTTPException) as e:
            raise RegistryUnreachable(f"cannot reach {self.src.endpoint} for {what}: {e}; check the network, or "
                                      "set HF_ENDPOINT to a Hugging Face mirror") from None
        try:
            body = r.read(64 << 20)
        except (OSError, http.client.HTTPException) as e:
            raise PullError(f"connection to {self.src.endpoint} broke while listing {what}: {e}") from None
        finally:
            r.close()
        if r.status in (401, 403):
            raise PullError(f"access to {what} denied (HTTP {r.status}); the repository may be gated or private: "
                            f"set HF_TOKEN to a token that can read it")
        if r.status == 404:
            raise PullError(f"{what} not found on {self.src.endpoint} (HTTP 404)")
        if r.status >= 400:
            raise PullError(f"listing {what} failed: HTTP {r.status} {r.reason}")
        try:
            data = json.loads(body)
        except ValueError:
            raise PullError(f"listing {what}: {self.src.endpoint} did not answer with JSON "
                            f"(Content-Type {r.content_type or 'none'})") from None
        link = r.header("Link") or ""
        m = re.search(r'<([^>]+)>\s*;\s*rel="?next"?', link)
        return data, (urllib.parse.urljoin(url, m.group(1)) if m else None)

    def _hf_tree(self) -> list[dict]:
        src = self.src
        repo = "/".join(urllib.parse.quote(p, safe="") for p in src.repo.split("/"))
        url = f"{src.endpoint}/api/models/{repo}/tree/{urllib.parse.quote(src.revision, safe='')}?recursive=true"
        entries: list[dict] = []
        pages = 0
        while url:
            data, url = self._json(url, f"repository {src.repo}")
            if not isinstance(data, list):
                raise PullError(f"unexpected answer listing {src.repo}: expected a list of files")
            entries += [e for e in data if isinstance(e, dict) and isinstance(e.get("path"), str)]
            pages += 1
            if pages > 1000:
                raise PullError(f"listing {src.repo}: too many pages")
        return entries

    def _registry_manifest(self) -> registry.Manifest:
        """Fetch and check the manifest (retrying a dropped connection or a 5xx as downloads do)."""
        ref = self.src.ref
        what = f"the manifest of {ref.text} from {ref.base}"
        attempts = 0
        while True:
            self._check_cancel()
            try:
                r = self.http.open(ref.manifest_url, {"Accept": registry.MANIFEST_V2, **self._auth_headers()})
                try:
                    body = r.read(registry.MAX_MANIFEST_BYTES + 1) if r.status == 200 else r.read(4096)
                finally:
                    r.close()
                if r.status >= 500 or r.status == 429:
                    raise _Dropped(f"HTTP {r.status} {r.reason}")
                break
            except PullError:
                raise
            except BaseException as e:
                why = getattr(e, "strerror", None) or str(e) or type(e).__name__
                attempts = self._try_again(e, attempts + 1, lambda n, why=why: RegistryUnreachable(
                    f"cannot reach the registry {ref.base} for {ref.text}: {why} (tried {n} "
                    f"time{'s' if n > 1 else ''}); check the network, or set JUPYTER_LLAMA_REGISTRY "
                    f"to a registry this machine can reach"))
        if r.status in (404, 410):
            hint = " (the models and their tags are listed at https://ollama.com/library)" \
                if ref.base == DEFAULT_REGISTRY else ""
            raise NotInRegistry(f'model "{ref.text}" not found in registry {ref.base}: no such model or tag{hint}')
        if r.status == 401 and self._registry_token is None and self._registry_login(r.header("WWW-Authenticate")):
            return self._registry_manifest()  # again, with the token it handed out
        if r.status in (401, 403):
            raise PullError(f'the registry {ref.base} refused {ref.text} (HTTP {r.status} {r.reason}): it may be '
                            f"private; jupyter-llama pulls models that need no login (or an anonymous pull token)")
        if r.status != 200:
            snippet = " ".join(body[:200].decode("utf-8", "replace").split())
            raise BadManifest(f"{what}: HTTP {r.status} {r.reason}" + (f": {snippet}" if snippet else ""))
        if len(body) > registry.MAX_MANIFEST_BYTES:
            raise BadManifest(f"{what} is larger than {registry.MAX_MANIFEST_BYTES:,} bytes: not a model's manifest")
        try:
            return registry.parse_manifest(body, r.content_type, what)
        except registry.ManifestError as e:
            raise BadManifest(str(e)) from None
        except registry.UnsupportedModel as e:
            raise PullError(str(e)) from None

    def _registry_plan(self) -> tuple[list[RemoteFile], dict]:
        ref = self.src.ref
        manifest = self._registry_manifest()
        files = [RemoteFile(url=ref.blob_url(ly.hexd), path=f"{ref.text} ({ly.role} layer sha256:{ly.hexd[:12]})",
                            role=ly.role, size=ly.size, sha256=ly.hexd, media_type=ly.media_type, auth=True)
                 for ly in manifest.layers]
        record = {"type": "registry", "registry": ref.base, "name": ref.text,
                  "manifest_digest": f"sha256:{manifest.digest}", "url": ref.manifest_url}
        if manifest.config:
            record["config"] = manifest.config
        if manifest.skipped:
            record["skipped_layers"] = manifest.skipped
        return files, record

    def _plan(self) -> tuple[list[RemoteFile], dict]:
        src = self.src
        if src.kind == "registry":
            return self._registry_plan()
        if src.kind == "url":
            base = urllib.parse.unquote(urllib.parse.urlsplit(src.url).path).rstrip("/").rsplit("/", 1)[-1]
            return [RemoteFile(url=src.url, path=base or src.url, role="model")], {"type": "url", "url": src.url}
        entries = self._hf_tree()
        model, projector = choose_files(entries, src.quant, src.repo, src.file)
        repo_q = "/".join(urllib.parse.quote(p, safe="") for p in src.repo.split("/"))
        rev_q = urllib.parse.quote(src.revision, safe="")

        def remote(e: dict, role: str) -> RemoteFile:
            lfs = e.get("lfs") or {}
            sha = lfs.get("oid") if isinstance(lfs.get("oid"), str) else None
            if sha and sha.startswith("sha256:"):
                sha = sha[7:]
            if sha and not re.fullmatch(r"[0-9a-f]{64}", sha):
                sha = None
            size = lfs.get("size", e.get("size"))
            url = f"{src.endpoint}/{repo_q}/resolve/{rev_q}/{urllib.parse.quote(e['path'])}"
            return RemoteFile(url=url, path=e["path"], role=role, size=int(size) if size is not None else None,
                              sha256=sha, auth=True, hf_repo=src.repo)

        files = [remote(model, "model")]
        record = {"type": "hf", "repo": src.repo, "revision": src.revision, "file": model["path"],
                  "quant": src.quant or _quant_of(model["path"]), "endpoint": src.endpoint, "url": files[0].url}
        if src.file:
            record["quant"] = _quant_of(src.file)
        if projector is not None:
            files.append(remote(projector, "projector"))
            record["projector_file"] = projector["path"]
        return files, record

    # -- run --------------------------------------------------------------------------

    def run(self) -> ModelEntry:
        self.store.ensure_dirs()
        try:
            return self._run()
        except BaseException:
            self._keep_for_resume()
            raise

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
            layers, land_info, proj_info = [], None, None
            for rf, (hexd, size, parsed) in zip(files, results, strict=True):
                media = rf.media_type or _GGUF_ROLES[rf.role]
                layers.append({"mediaType": media, "digest": f"sha256:{hexd}", "size": size})
                if rf.role == "model":
                    land_info = parsed if parsed is not None else self._model_info(hexd)
                elif rf.role == "projector":
                    proj_info = parsed if parsed is not None else _projector_summary(str(self.store.blob_path(hexd)))
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

    def _fetch(self, rf: RemoteFile) -> tuple[str, int, dict | None]:
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
                inf = _registry.get(rkey)
                leader = inf is None
                if leader:
                    inf = _registry[rkey] = _Inflight()
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

    def _lead(self, rf: RemoteFile, key: str, inf: _Inflight) -> tuple[str, int, dict | None]:
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
                linked = self._from_hf_cache(rf, tick)
                if linked is not None:
                    _unlink(partial)  # a resume of it is no longer needed
                    _unlink(self.store.partial_dir / f"{key}.json")
                    return linked
            return self._download(rf, key, partial, inf, tick)
        finally:
            lock.release()

    def _from_hf_cache(self, rf: RemoteFile, tick: _Throttle) -> tuple[str, int, dict | None] | None:
        """The Hub file ``rf`` from the Hugging Face cache, if a cached file has its sha256:
        hard-linked (else copied) into the store, hashed on the way, checked as a download
        would be. None when the cache has no such file (or none that hashes right)."""
        for cached in hfcache.cached_copies(rf.hf_repo, rf.path, rf.sha256, rf.size):
            self._check_cancel()
            label = f"{rf.path} from the Hugging Face cache ({cached})"
            try:
                hexd, size, _how, tmp = self.store._import_file(str(cached), "auto", self.emit, label,
                                                                cancel=self._cancel)
            except (OSError, StoreError):
                self._check_cancel()
                continue
            try:
                if hexd != rf.sha256:
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

    def _reuse_url(self, rf: RemoteFile, key: str, tick: _Throttle) -> tuple[str, int, dict | None] | None:
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
            r = self.http.open(rf.url, method="HEAD")
            r.close()
        except (OSError, http.client.HTTPException, PullError):
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

    def _download(self, rf: RemoteFile, key: str, partial: Path, inf: _Inflight, tick: _Throttle
                  ) -> tuple[str, int, dict | None]:
        meta_path = self.store.partial_dir / f"{key}.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = {}
        offset = partial.stat().st_size if partial.exists() else 0
        if offset and meta.get("total") and offset > meta["total"]:
            offset = 0
        hasher = hashlib.sha256()
        head = b""
        magic = rf.gguf  # check the first bytes are a GGUF's (a preset layer is text or JSON)
        if offset and magic:
            with open(partial, "rb") as fh:
                head = fh.read(4)
            if head[:4] != GGUF_MAGIC[: len(head[:4])]:
                offset, head = 0, b""
        if offset:
            inf.completed = offset
            tick(offset, force=True)
            try:
                with open(partial, "rb", buffering=0) as fh:
                    buf = bytearray(BUFFER)
                    mv = memoryview(buf)
                    left = offset
                    while left:
                        n = fh.readinto(mv[: min(BUFFER, left)])
                        if not n:
                            break
                        hasher.update(mv[:n])
                        left -= n
            except OSError:
                offset, hasher, head = 0, hashlib.sha256(), b""
        if not offset:
            _unlink(partial)
        total = rf.size if rf.size is not None else meta.get("total")
        if rf.size is not None:
            self._check_disk(rf.size - offset)
        attempts = renewals = 0
        # what identifies the bytes already in the partial file: sent back as If-Range, so a
        # server whose file changed answers 200 (start again) instead of 206 (append)
        same_source = meta.get("url") == rf.url or (rf.sha256 is not None and meta.get("sha256") == rf.sha256)
        validators = ({"etag": meta.get("etag"), "last_modified": meta.get("last_modified")} if same_source
                      else {"etag": None, "last_modified": None})
        while True:
            self._check_cancel()
            r = None
            try:
                headers = self._auth_headers() if rf.auth else {}
                if offset:
                    headers["Range"] = f"bytes={offset}-"
                    etag, modified = validators.get("etag"), validators.get("last_modified")
                    if etag and not etag.startswith("W/"):
                        headers["If-Range"] = etag
                    elif modified:
                        headers["If-Range"] = modified
                r = self.http.open(rf.url, headers)
                self._active = r
                if self._cancel.is_set():
                    r.abort()
                if r.status == 416 and offset and total is not None and offset >= total:
                    r.close()
                    break  # we already had every byte
                if r.status == 416:
                    r.close()
                    offset, hasher, head = 0, hashlib.sha256(), b""
                    _unlink(partial)
                    raise _Dropped("the server refused the resume range; starting again")
                self._check_response(rf, r)
                if r.status == 206:
                    cr = r.header("Content-Range") or ""
                    m = re.match(r"^bytes (\d+)-(\d+)/(\d+|\*)$", cr.strip())
                    if not m or int(m.group(1)) != offset:
                        r.close()
                        offset, hasher, head = 0, hashlib.sha256(), b""
                        _unlink(partial)
                        raise _Dropped(f"the server answered the resume with a wrong range ({cr!r}); starting again")
                    if m.group(3) != "*":
                        total = int(m.group(3))
                else:  # 200: the whole file (the server ignored Range or the file changed)
                    if offset:
                        offset, hasher, head = 0, hashlib.sha256(), b""
                        _unlink(partial)
                        inf.completed = 0
                    length = r.header("Content-Length")
                    if length is not None and length.isdigit():
                        total = int(length)
                if rf.size is not None and total is not None and total != rf.size:
                    r.close()
                    listing = "manifest" if rf.media_type else "repository listing"
                    raise PullError(f"{rf.url}: the server sends {total:,} bytes, the {listing} says {rf.size:,}")
                if total is not None:
                    self._check_disk(total - offset)
                tick.total = total
                inf.total = total
                validators = {"etag": r.header("ETag"), "last_modified": r.header("Last-Modified")}
                atomic_write_json(meta_path, {"url": rf.url, **validators, "total": total, "sha256": rf.sha256},
                                   fsync=False)
                try:
                    fh = open(partial, "ab" if offset else "wb", buffering=0)
                except OSError as e:
                    raise self._write_error(partial, e) from None
                bad_start = None
                writer = _Sink(fh, hasher, lambda e: self._write_error(partial, e))
                try:
                    while True:
                        if self._cancel.is_set():
                            r.close()
                            self._check_cancel()
                        wbuf = writer.buffer()
                        n = r.readinto(wbuf)
                        if not n:
                            writer.give_back(wbuf)
                            break
                        chunk = memoryview(wbuf)[:n]
                        if magic and len(head) < 4:
                            head += bytes(chunk[: 4 - len(head)])
                            if head != GGUF_MAGIC[: len(head)]:
                                bad_start = bytes(chunk[:16])
                                writer.give_back(wbuf)
                                break
                        writer.put(wbuf, n)  # hashed, then written, while the next chunk arrives
                        offset += n
                        inf.completed = offset
                        tick(offset)
                finally:
                    try:
                        writer.close()
                    finally:
                        fh.close()
                if bad_start is not None:
                    r.close()
                    _unlink(partial)
                    _unlink(meta_path)
                    raise NotAModel(f"{rf.url} is not a GGUF file (it starts with {bad_start!r})")
                r.close()
                if total is not None and offset < total:
                    raise _Dropped(f"the connection closed after {offset:,} of {total:,} bytes")
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

                def give_up(n: int, e: BaseException = e, offset: int = offset,
                            total: int | None = total) -> PullError:
                    kept = partial.exists() and partial.stat().st_size > 0
                    what = f"after {offset:,} of {total:,} bytes" if total else f"after {offset:,} bytes"
                    return PullError(
                        f"download of {rf.path} failed {what}: {e or type(e).__name__} "
                        f"(tried {n} time{'s' if n > 1 else ''}). "
                        + (f"The partial download is kept in {partial}: run the same pull again to resume."
                           if kept else "Nothing was kept."))

                attempts = self._try_again(e, attempts + 1, give_up, say=f"download of {rf.path}")
            finally:
                self._active = None
        tick(offset, force=True)
        if magic and (offset == 0 or len(head) < 4):
            _unlink(partial)
            _unlink(meta_path)
            raise NotAModel(f"{rf.url} sent {offset} bytes: not a GGUF file")
        self.emit({"status": "verifying sha256 digest", **({"digest": f"sha256:{rf.sha256}"} if rf.sha256 else {})})
        hexd = hasher.hexdigest()
        if rf.sha256 and hexd != rf.sha256:
            _unlink(partial)
            _unlink(meta_path)
            raise HashMismatch(f"{rf.path}: sha256 mismatch: the source states {rf.sha256}, the bytes hash to "
                               f"{hexd}; the download was discarded (try again; if it persists, the file changed "
                               f"upstream)")
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
                               {"url": rf.url, "digest": f"sha256:{hexd}", "size": offset, **validators}, fsync=False)
        return hexd, offset, parsed

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

    @staticmethod
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

    def _check_response(self, rf: RemoteFile, r: _Response) -> None:
        if r.status in (200, 206):
            ct = r.content_type
            if rf.gguf and (ct in ("text/html", "application/xhtml+xml") or ct == "application/json"):
                try:
                    snippet = r.read(300).decode("utf-8", "replace")
                except (OSError, http.client.HTTPException):
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
        except (OSError, http.client.HTTPException):
            snippet = ""
        r.close()
        snippet = " ".join(snippet.split())[:160]
        if (status == 401 and rf.auth and self.src.kind == "registry" and _origin(r.url) == _origin(self.src.ref.base)
                and self._registry_login(r.header("WWW-Authenticate"))):
            raise _Renewed()  # asked again at once, with the new token
        if status in (401, 403):
            hint = ""
            if rf.auth:
                hint = ("; the registry refused its own pull token" if self.src.kind == "registry" else
                        "; the repository may be gated or private: set HF_TOKEN to a token that can read it")
            raise PullError(f"{rf.url}: access denied (HTTP {status} {reason}){hint}")
        if status in (404, 410):
            raise PullError(f"{rf.url}: not found (HTTP {status} {reason})")
        if status >= 500 or status == 429:
            raise _Dropped(f"HTTP {status} {reason}")
        raise PullError(f"{rf.url}: HTTP {status} {reason}" + (f": {snippet}" if snippet else ""))


# ----------------------------------------------------------------------------- entry points


def pull(source: str, name: str | None = None, progress: Callable[[dict], None] | None = None, *,
         store: ModelStore | None = None, **kw) -> ModelEntry:
    """Pull synchronously in the calling thread; ``progress(status_dict)`` as it goes."""
    store = store if store is not None else ModelStore()
    return Puller(store, source, name, progress, **kw).run()


async def pull_stream(source: str, name: str | None = None, *, store: ModelStore | None = None,
                      **kw) -> AsyncIterator[dict]:
    """Async generator of Ollama status dicts; the work runs in a thread.

    Closing the generator early (a client that went away) cancels the download and keeps
    the partial file for resume. Errors are raised after the last status.
    """
    store = store if store is not None else ModelStore()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:
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
                store: ModelStore | None = None, **kw) -> ModelEntry:
    """Async pull; returns the entry. ``progress`` gets each status dict."""
    store = store if store is not None else ModelStore()
    mname = derive_name(parse_source(source, kw.get("endpoint")), name)
    async for status in pull_stream(source, name, store=store, **kw):
        if progress is not None:
            progress(status)
    return await asyncio.to_thread(store.entry, mname)


# ----------------------------------------------------------------------------- progress text


def render_progress(status: dict, width: int = 25, rate: float | None = None) -> str:
    """One line of text for a status dict: ``pulling 3f2a1b9c8d7e  42% ▕██████    ▏ 210 MB/500 MB``."""
    if "error" in status:
        return f"error: {status['error']}"
    text = str(status.get("status", ""))
    total = status.get("total")
    completed = status.get("completed")
    if total and completed is not None:
        frac = max(0.0, min(1.0, completed / total))
        filled = int(frac * width)
        bar = "█" * filled + " " * (width - filled)
        line = f"{text} {frac * 100:3.0f}% ▕{bar}▏ {fmt_bytes(completed)}/{fmt_bytes(total)}"
        if rate:
            line += f"  {fmt_bytes(rate)}/s"
            if completed < total:
                left = (total - completed) / rate
                line += f"  {int(left // 60)}m{int(left % 60):02d}s" if left >= 60 else f"  {left:.0f}s"
        return line
    if completed is not None:
        return f"{text} {fmt_bytes(completed)}"
    return text


@dataclass
class ProgressPrinter:
    """Feeds status dicts to a terminal: one rewritten line per status, a rate for downloads."""

    write: Callable[[str], None] = field(default=lambda s: print(s, end="", flush=True))
    width: int = 25
    _last: str | None = None
    _t0: dict = field(default_factory=dict)

    def __call__(self, status: dict) -> None:
        text = str(status.get("status", ""))
        rate = None
        if status.get("total") and status.get("completed") is not None:
            now = time.monotonic()
            t0, c0 = self._t0.setdefault(text, (now, status["completed"]))
            if now - t0 > 0.2:
                rate = (status["completed"] - c0) / (now - t0)
        line = render_progress(status, self.width, rate)
        if text == self._last:
            self.write("\r\x1b[K" + line)
        else:
            self.write(("\n" if self._last is not None else "") + line)
        self._last = text
        if text == "success":
            self.write("\n")
