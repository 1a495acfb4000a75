"""A local HTTP server that plays a Hugging Face endpoint and a plain file host.

Started in a thread by the tests (and by ``bench/pull_throughput.py``); nothing leaves
127.0.0.1. Routes:

* ``GET /api/models/{owner}/{repo}/tree/main?recursive=true``: the repo's files as a JSON
  list of ``{type, path, size, oid, lfs: {oid, size, pointerSize}}`` (the shape of the
  Hub's tree API); ``lfs.oid`` is the sha256 of the bytes unless a test overrides it.
  With ``page_size`` set, the listing is paged with a ``Link: <...>; rel="next"`` header.
* ``GET|HEAD /{owner}/{repo}/resolve/main/{path}``: 302 to ``/files/{id}`` (the Hub
  redirects to its CDN the same way).
* ``GET|HEAD /files/{id}``: the bytes, with ``Range`` (206, ``Content-Range``), ``ETag``,
  ``If-Range``; per file the test can set ``drop_after`` (close the connection after that
  many body bytes, for the next ``drop_times`` responses), ``rate`` (bytes per second)
  and ``content_type``.
* with ``require_token`` set, the Hub routes answer 401 without ``Authorization: Bearer <it>``.
* ``/html`` serves an HTML page, ``/missing`` a 404, ``/loop`` redirects to itself,
  ``/text`` serves a non-GGUF body as ``application/octet-stream``.

Counters: ``bytes_sent[id]`` (body bytes written per file) and ``requests`` (method, path,
headers) so tests can check that a resume fetched only the missing bytes, or that two
pulls of one blob served it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["HFServer", "ServedFile"]

_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class ServedFile:
    path: Path
    size: int
    sha256: str
    etag: str
    content_type: str = "application/octet-stream"
    drop_after: int | None = None  # close the connection after this many body bytes ...
    drop_times: int = 0  # ... for this many more responses
    rate: float | None = None  # bytes per second, None = as fast as possible
    lfs_oid: str | None = None  # what the tree API states (default: the real sha256)


@dataclass
class _Repo:
    files: dict[str, str] = field(default_factory=dict)  # repo path -> file id


def sha256_file(path: os.PathLike | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class HFServer:
    """``with HFServer() as srv: srv.url``; a ThreadingHTTPServer in a daemon thread."""

    handler_class: type | None = None  # a subclass of _Handler with more routes (registryserver.py)

    def __init__(self, host: str = "127.0.0.1"):
        self.files: dict[str, ServedFile] = {}
        self.repos: dict[str, _Repo] = {}
        self.bytes_sent: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.page_size: int | None = None
        self.require_token: str | None = None  # Hub routes answer 401 without this bearer token
        self._lock = threading.Lock()
        outer = self

        class Handler(self.handler_class or _Handler):
            server_ref = outer

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hfserver", daemon=True)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "HFServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> "HFServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- content ---------------------------------------------------------------------

    def add_file(self, file_id: str, path: os.PathLike | str, sha256: str | None = None, **options) -> ServedFile:
        p = Path(path)
        digest = sha256 or sha256_file(p)
        f = ServedFile(path=p, size=p.stat().st_size, sha256=digest, etag=f'"{digest[:32]}"', **options)
        with self._lock:
            self.files[file_id] = f
            self.bytes_sent.setdefault(file_id, 0)
        return f

    def add_repo(self, repo: str, files: dict[str, os.PathLike | str]) -> dict[str, ServedFile]:
        """Publish ``{repo_path: local_file}`` as Hub repo ``owner/name``; returns the served files."""
        r = _Repo()
        out = {}
        for rpath, local in files.items():
            fid = f"{repo}/{rpath}".replace("/", "__")
            out[rpath] = self.add_file(fid, local)
            r.files[rpath] = fid
        self.repos[repo] = r
        return out

    def file_url(self, file_id: str) -> str:
        return f"{self.url}/files/{urllib.parse.quote(file_id)}"

    def sent(self, file_id: str) -> int:
        with self._lock:
            return self.bytes_sent.get(file_id, 0)

    def repo_file(self, repo: str, rpath: str) -> ServedFile:
        return self.files[self.repos[repo].files[rpath]]

    def repo_sent(self, repo: str, rpath: str) -> int:
        return self.sent(self.repos[repo].files[rpath])

    def _count(self, file_id: str, n: int) -> None:
        with self._lock:
            self.bytes_sent[file_id] = self.bytes_sent.get(file_id, 0) + n


class _Handler(BaseHTTPRequestHandler):
    server_ref: HFServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet
        pass

    # -- helpers ---------------------------------------------------------------------

    def _reply(self, status: int, body: bytes = b"", content_type: str = "text/plain", headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _redirect(self, location: str):
        self._reply(302, b"", headers={"Location": location})

    # -- routes ----------------------------------------------------------------------

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        srv = self.server_ref
        parsed = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parsed.path)
        with srv._lock:
            srv.requests.append((self.command, self.path, dict(self.headers.items())))

        if path == "/html":
            return self._reply(200, b"<!doctype html><html><body>Sign in</body></html>", "text/html; charset=utf-8")
        if path == "/missing":
            return self._reply(404, b"Not Found")
        if path == "/loop":
            return self._redirect("/loop")
        if path == "/text":
            return self._reply(200, b"hello, this is not a model\n" * 64, "application/octet-stream")
        if path.startswith("/files/"):
            return self._serve_file(path[len("/files/"):])

        hub = path.startswith("/api/") or "/resolve/" in path
        if hub and srv.require_token and self.headers.get("Authorization") != f"Bearer {srv.require_token}":
            body = json.dumps({"error": "Access to this repository is restricted."}).encode()
            return self._reply(401, body, "application/json", {"X-Error-Code": "GatedRepo"})
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/main$", path)
        if m:
            return self._tree(m.group(1), urllib.parse.parse_qs(parsed.query))
        m = re.match(r"^/([^/]+/[^/]+)/resolve/main/(.+)$", path)
        if m:
            repo = srv.repos.get(m.group(1))
            fid = repo.files.get(m.group(2)) if repo else None
            if fid is None:
                return self._reply(404, b"Entry not found", headers={"X-Error-Code": "EntryNotFound"})
            return self._redirect(f"/files/{urllib.parse.quote(fid)}")
        return self._reply(404, b"Not Found")

    def _tree(self, repo_id: str, query: dict):
        srv = self.server_ref
        repo = srv.repos.get(repo_id)
        if repo is None:
            body = json.dumps({"error": "Repository not found"}).encode()
            return self._reply(404, body, "application/json", {"X-Error-Code": "RepoNotFound"})
        entries = []
        dirs = set()
        for rpath, fid in sorted(repo.files.items()):
            parts = rpath.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
            f = srv.files[fid]
            oid = f.lfs_oid or f.sha256
            entries.append({
                "type": "file", "oid": hashlib.sha1(oid.encode()).hexdigest(), "size": f.size, "path": rpath,
                "lfs": {"oid": oid, "size": f.size, "pointerSize": 134},
            })
        entries = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)] + entries
        headers = {}
        if srv.page_size:
            start = int(query.get("cursor", ["0"])[0])
            page = entries[start:start + srv.page_size]
            if start + srv.page_size < len(entries):
                nxt = f"{srv.url}/api/models/{repo_id}/tree/main?recursive=true&cursor={start + srv.page_size}"
                headers["Link"] = f'<{nxt}>; rel="next"'
            entries = page
        return self._reply(200, json.dumps(entries).encode(), "application/json", headers)

    def _serve_file(self, file_id: str):
        srv = self.server_ref
        f = srv.files.get(file_id)
        if f is None:
            return self._reply(404, b"Not Found")
        start, end = 0, f.size - 1
        status = 200
        rng = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if rng and (if_range is None or if_range == f.etag):
            m = _RANGE_RE.match(rng.strip())
            if not m:
                return self._reply(416, b"", headers={"Content-Range": f"bytes */{f.size}"})
            start = int(m.group(1))
            if m.group(2):
                end = min(int(m.group(2)), f.size - 1)
            if start >= f.size or start > end:
                return self._reply(416, b"", headers={"Content-Range": f"bytes */{f.size}"})
            status = 206
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", f.content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f.etag)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        drop = None
        with srv._lock:
            if f.drop_after is not None and f.drop_times > 0:
                f.drop_times -= 1
                drop = f.drop_after
        if drop is not None:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD":
            return
        self.wfile.flush()
        if drop is None and f.rate is None:
            self._sendfile(f, file_id, start, length)
            return
        limit = length if drop is None else min(length, drop)
        sent = 0
        t0 = time.monotonic()
        with open(f.path, "rb") as fh:
            fh.seek(start)
            while sent < limit:
                chunk = fh.read(min(64 * 1024, limit - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except OSError:
                    break
                sent += len(chunk)
                srv._count(file_id, len(chunk))
                if f.rate:
                    ahead = sent / f.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        if drop is not None:
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.close_connection = True

    def _sendfile(self, f: ServedFile, file_id: str, start: int, length: int):
        sock = self.connection
        with open(f.path, "rb") as fh:
            offset, left = start, length
            while left > 0:
                try:
                    n = os.sendfile(sock.fileno(), fh.fileno(), offset, min(left, 1 << 30))
                except (BrokenPipeError, ConnectionResetError):
                    return
                except BlockingIOError:  # pragma: no cover
                    continue
                if n == 0:
                    break
                offset += n
                left -= n
                self.server_ref._count(file_id, n)
