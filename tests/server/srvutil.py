"""Helpers shared by the server tests (imported by name: the tests tree has no packages)."""

from __future__ import annotations

import asyncio
import json
import os
import time

from jupyter_llama.procs import child_pids, process_alive

is_alive = process_alive  # the tests' name for it

# Small shapes keep loads and generation fast on a 2-core CPU.
TINY = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=3)
OTHER = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=4)
# One thread: on a busy 2-core machine two spinning threads per child run ~50x slower.
OPTS = {"num_ctx": 1024, "num_parallel": 1, "num_thread": 1}
LONG = {"num_ctx": 4096, "num_parallel": 1, "num_thread": 1}


async def wait_until(cond, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``cond()`` (sync or async) until truthy; return its value or fail."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def png(width: int = 28, height: int = 28) -> str:
    """A small solid-colour PNG, base64-encoded (as Ollama clients send images)."""
    import base64
    import struct
    import zlib

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes([120, 80, 200]) * width for _ in range(height))
    image = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
             + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return base64.b64encode(image).decode()


def lines(body: bytes) -> list[dict]:
    return [json.loads(ln) for ln in body.decode().splitlines() if ln.strip()]


def llama_children(parent: int | None = None) -> list[int]:
    """PIDs of live llama-server processes that are children of ``parent`` (default: this one)."""
    return child_pids(os.getpid() if parent is None else parent, "llama-server")


def our_children() -> list[int]:
    return llama_children()


# ----------------------------------------------------------------------------- a file host


class FileHost:
    """A threaded local HTTP server that serves files with ``Range`` support (206, Content-Range,
    ETag), for pulls. ``FileHost({"/m.gguf": path})``; use as a context manager."""

    def __init__(self, files: dict):
        import hashlib
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.files = {k: str(v) for k, v in files.items()}
        self.requests: list[tuple[str, str, str | None]] = []
        self.sent = 0  # body bytes served (bench/soak.py reports it)
        host = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self, body: bool):
                host.requests.append((self.command, self.path, self.headers.get("Range")))
                path = host.files.get(self.path.split("?")[0])
                if path is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with open(path, "rb") as fh:
                    data = fh.read()
                etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
                start, end, status = 0, len(data) - 1, 200
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start = int(a) if a else 0
                    end = int(b) if b else len(data) - 1
                    status = 206
                chunk = data[start:end + 1]
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(chunk)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", etag)
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(chunk)
                    host.sent += len(chunk)

            def do_GET(self):
                self._serve(True)

            def do_HEAD(self):
                self._serve(False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FileHost":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
