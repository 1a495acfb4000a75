"""A local HTTP server that plays an Ollama registry and the content server it redirects to.

Like ``hfserver.py`` (whose routes it keeps, and whose file serving it uses for the content
server); nothing leaves 127.0.0.1. Routes:

* ``GET|HEAD /v2/{namespace}/{model}/manifests/{tag}``: the manifest, to a client whose
  ``Accept`` names ``application/vnd.docker.distribution.manifest.v2+json``; any other client
  gets a schema-1 document (what a Docker registry gives a client that does not ask for v2).
  An unknown name or tag is a 404 with the registry's error JSON (``MANIFEST_UNKNOWN``).
  ``manifest_override[(repo, tag)] = (status, content_type, body)`` replaces an answer.
* ``GET|HEAD /v2/{namespace}/{model}/blobs/sha256:{hex}``: 307 to ``/cdn/sha256-{hex}`` with a
  query string (the real registry redirects to its CDN the same way); 404 for an unknown
  digest.
* ``GET|HEAD /cdn/sha256-{hex}``: the bytes, with ``Range``, ``ETag``, ``If-Range``, and per
  blob ``drop_after``/``drop_times``/``rate`` (``blob_file(hex)``), as ``/files/`` serves them.

* ``GET /token?service=...&scope=...``: with ``pull_tokens`` set, Docker's token protocol: the
  ``/v2/`` routes answer 401 with a ``WWW-Authenticate: Bearer`` challenge naming this realm
  until a request carries a token it handed out (``{"token": ...}``); ``token_status`` makes it
  refuse, ``token_uses`` makes each token expire after that many uses, ``guard_manifests``
  False leaves the manifests open, and ``token_value`` is the token handed out.

Counters: ``blob_sent(hex)`` (body bytes sent of a blob) and ``requests`` (method, path,
headers), from ``HFServer``; ``token_requests`` (the query of each token request).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.parse
from pathlib import Path

from hfserver import HFServer, ServedFile, _Handler

__all__ = ["RegistryServer", "MANIFEST_V2"]

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"


class _RegistryHandler(_Handler):
    def do_GET(self):
        srv = self.server_ref
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        if path == "/token":
            return self._token(urllib.parse.parse_qs(parsed.query))
        m = re.match(r"^/v2/([^/]+/[^/]+)/manifests/([^/]+)$", path)
        if m:
            self._record()
            if srv.guard_manifests and not self._authorized(m.group(1)):
                return None
            return self._manifest(m.group(1), m.group(2))
        m = re.match(r"^/v2/([^/]+/[^/]+)/blobs/sha256:([0-9a-f]{64})$", path)
        if m:
            self._record()
            if not self._authorized(m.group(1)):
                return None
            if f"sha256-{m.group(2)}" not in srv.files:
                return self._json(404, {"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown to registry"}]})
            self.send_response(307)
            self.send_header("Location", f"{srv.url}/cdn/sha256-{m.group(2)}?X-Signature=abc123")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        m = re.match(r"^/cdn/(sha256-[0-9a-f]{64})$", path)
        if m:
            self._record()
            return self._serve_file(m.group(1))
        return super().do_GET()

    def _authorized(self, repo: str) -> bool:
        """With ``pull_tokens``: whether the request carries a live token; if not, the 401 is sent."""
        srv = self.server_ref
        if not srv.pull_tokens:
            return True
        auth = self.headers.get("Authorization") or ""
        with srv._lock:
            uses = srv.tokens.get(auth[7:]) if auth.startswith("Bearer ") else None
            if uses is not None and (srv.token_uses is None or uses < srv.token_uses):
                srv.tokens[auth[7:]] = uses + 1
                return True
        challenge = f'Bearer realm="{srv.url}/token",service="test-registry",scope="repository:{repo}:pull"'
        self._reply(401, json.dumps({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})
                    .encode(), "application/json", headers={"WWW-Authenticate": challenge})
        return False

    def _token(self, query: dict):
        srv = self.server_ref
        with srv._lock:
            srv.token_requests.append({k: v[0] for k, v in query.items()})
            srv.requests.append(("GET", self.path, dict(self.headers.items())))
            if srv.token_status != 200 or query.get("service") != ["test-registry"]:
                status = srv.token_status if srv.token_status != 200 else 400
                return self._reply(status, b'{"errors": [{"code": "DENIED"}]}', "application/json")
            token = srv.token_value or f"tok-{len(srv.tokens) + 1}"
            srv.tokens[token] = 0
        return self._json(200, {"token": token, "expires_in": 300})

    def _record(self):
        srv = self.server_ref
        with srv._lock:
            srv.requests.append((self.command, self.path, dict(self.headers.items())))

    def _json(self, status: int, doc, content_type: str = "application/json"):
        return self._reply(status, json.dumps(doc).encode(), content_type)

    def _manifest(self, repo: str, tag: str):
        srv = self.server_ref
        override = srv.manifest_override.get((repo, tag))
        if override is not None:
            status, ctype, body = override
            return self._reply(status, body, ctype)
        manifest = srv.manifests.get((repo, tag))
        if manifest is None:
            return self._json(404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown",
                                                "detail": {"Tag": tag}}]})
        if MANIFEST_V2 not in (self.headers.get("Accept") or ""):
            return self._json(200, {"schemaVersion": 1, "name": repo, "tag": tag, "architecture": "amd64",
                                    "fsLayers": [{"blobSum": ly["digest"]} for ly in manifest["layers"]]},
                              "application/vnd.docker.distribution.manifest.v1+prettyjws")
        return self._reply(200, json.dumps(manifest).encode(), MANIFEST_V2)


class RegistryServer(HFServer):
    """``with RegistryServer(tmp_path) as reg: reg.url``; blobs are written under ``blob_dir``."""

    handler_class = _RegistryHandler

    def __init__(self, blob_dir: os.PathLike | str, host: str = "127.0.0.1"):
        super().__init__(host)
        self.blob_dir = Path(blob_dir)
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.manifests: dict[tuple[str, str], dict] = {}
        self.manifest_override: dict[tuple[str, str], tuple[int, str, bytes]] = {}
        self.pull_tokens = False  # the /v2/ routes need a token from /token
        self.token_status = 200  # what /token answers
        self.token_uses: int | None = None  # how many requests a token serves before it expires
        self.tokens: dict[str, int] = {}  # handed out -> requests served
        self.token_requests: list[dict] = []
        self.guard_manifests = True  # False: only the blobs need a token
        self.token_value: str | None = None  # the token handed out (default tok-N)
        self._good: dict[str, Path] = {}

    @property
    def host(self) -> str:
        """The registry's host as a model name spells it (``127.0.0.1:PORT``)."""
        return urllib.parse.urlsplit(self.url).netloc

    def add_blob(self, data: bytes | os.PathLike | str) -> str:
        """Serve ``data`` (bytes, or a file's path) as a blob; its sha256 hex."""
        if isinstance(data, (bytes, bytearray)):
            hexd = hashlib.sha256(data).hexdigest()
            path = self.blob_dir / f"sha256-{hexd}"
            path.write_bytes(data)
        else:
            path = Path(data)
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            hexd = h.hexdigest()
        self.add_file(f"sha256-{hexd}", path, sha256=hexd)
        return hexd

    def add_model(self, name: str, tag: str, layers: list[tuple[str, bytes | os.PathLike | str]]) -> dict:
        """Publish ``namespace/model`` (or ``model``: namespace ``library``) at ``tag`` with
        ``[(media type, bytes or file)]`` as its layers; returns the manifest."""
        repo = name if "/" in name else f"library/{name}"
        out = []
        for media_type, data in layers:
            hexd = self.add_blob(data)
            out.append({"mediaType": media_type, "digest": f"sha256:{hexd}", "size": self.files[f"sha256-{hexd}"].size})
        config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "F32",
                             "rootfs": {"type": "layers", "diff_ids": [ly["digest"] for ly in out]}}).encode()
        chex = self.add_blob(config)
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_V2,
                    "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": f"sha256:{chex}", "size": len(config)},
                    "layers": out}
        self.manifests[(repo, tag)] = manifest
        return manifest

    def blob_file(self, hexd: str) -> ServedFile:
        return self.files[f"sha256-{hexd}"]

    def blob_sent(self, hexd: str) -> int:
        return self.sent(f"sha256-{hexd}")

    def total_blob_bytes_sent(self) -> int:
        with self._lock:
            return sum(n for fid, n in self.bytes_sent.items() if fid.startswith("sha256-"))

    def corrupt(self, hexd: str) -> None:
        """Serve other bytes (same size, the last one flipped) under digest ``hexd``."""
        f = self.blob_file(hexd)
        self._good.setdefault(hexd, f.path)
        data = bytearray(f.path.read_bytes())
        data[-1] ^= 0xFF
        bad = self.blob_dir / f"corrupt-{hexd}"
        bad.write_bytes(bytes(data))
        f.path = bad

    def restore(self, hexd: str) -> None:
        """Serve the right bytes under ``hexd`` again (after :meth:`corrupt`)."""
        self.blob_file(hexd).path = self._good.pop(hexd)
