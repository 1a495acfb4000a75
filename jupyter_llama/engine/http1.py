"""Requests to a llama-server child, and its streamed answers read in the event loop's own callbacks.

Every token a user receives crosses this code, so it is built for the cost per token: an
:class:`asyncio.Protocol` parses the child's HTTP/1.1 answer (chunked or not) and its
server-sent events as bytes arrive, and hands each batch of complete lines to a callback
*synchronously*, inside the read callback: no task and no generator per token, and every
event that came in one read goes on together. A callback that returns a pending future
(its reader is slower than the child) pauses reading from the child until the future
resolves, so nothing piles up.

A successful answer's head reaches the callback at once, as a batch of no lines: llama-server
sends its head as soon as it has taken a stream's request, while it still reads the prompt,
so a relay can send its own head then, off the first token's way.

A request goes out in the step that makes it: on loopback the kernel completes a
non-blocking ``connect`` inside the call (:func:`_connect_now`), and the request is written
straight to that socket before the transport that reads the answer is made. In a burst of
streams, a connection made in a later turn of the event loop would wait behind every other
request's handler.

This module knows only the child's side: its callers give it a port, a path, a body and a
callback. On top of the same parser: :func:`post_lines` (an async iterator of lines),
:func:`sse_data` and :func:`sse_events` (events as bytes or objects). Closing or cancelling
any of them closes the connection, which makes llama-server stop generating for the request.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import json
import re
import socket
from typing import AsyncGenerator, Awaitable, Callable

from ..errors import RequestError

__all__ = ["BadResponse", "post", "post_lines", "request_json", "relay_sse", "sse_data", "sse_events", "error_text"]

CONNECT_TIMEOUT_S = 5.0

# What a line callback gets (complete lines, without line ends; no lines at all, once, when an
# answer of status below 400 has begun and none of its lines came with its head) and may return
# (a future that, while pending, pauses reading).
LineSink = Callable[[list[bytes]], "asyncio.Future | None"]


class BadResponse(ValueError):
    """The answer is not the HTTP/1.1 this reader expects."""


# The JSON library's tag on its messages (``[json.exception.type_error.302] type must be
# number, but is string``): the words after it are the message a person reads.
_JSON_TAG = re.compile(r"\[json\.exception\.[a-z_]+\.\d+\] ")


def error_text(body: str, status: int) -> str:
    """The message in a llama-server error body (its JSON ``error.message``, else the text)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500] or f"HTTP {status}"
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message") or err
    return _JSON_TAG.sub("", str(err))


# What llama-server (b11434) throws as a plain runtime error, hence a 500 "server_error", while
# checking a request body: each is the client's mistake, so it is our 400 with the child's text.
# (Its invalid_argument and JSON type errors are already 400.)
_REQUEST_MISTAKES = (
    "image input is not supported", "audio input is not supported", "video input is not supported",
    "Multimodal data provided, but model does not support", "tools param requires --jinja",
    "tool_choice param requires --jinja", "Cannot use both json_schema and grammar", "Unsupported param:",
    '"prompt" is required', "Only no echo is supported", "Failed to load image or audio file",
    "Invalid base64 value", "Failed to download image", "Failed to tokenize prompt",
    # common/chat.cpp's checks of messages and tools (each an invalid_argument, rethrown as a runtime_error)
    "Failed to parse messages:", "Failed to parse tools:", "Failed to parse tool call arguments as JSON",
    "Cannot specify both content and content_parts", "Cannot specify grammar with tools",
)


def child_error(status: int, body: str) -> RequestError:
    """The child's error answer as ours: its message, and its status, but for a 500 that is
    one of llama-server's request-checking errors (:data:`_REQUEST_MISTAKES`), which is a 400."""
    message = error_text(body, status)
    if status >= 500 and message.startswith("Context size has been exceeded"):
        # (an answer that filled the slot's context: llama-server stops it with a 500 of no cause of its own)
        return RequestError(400, "the prompt and the answer filled the context the model was loaded with, so the "
                                 "answer stopped: ask for fewer tokens (max_tokens, num_predict), send a shorter "
                                 "prompt, or load the model with a larger context (num_ctx)",
                            "exceed_context_size_error")
    if message.startswith("Failed to initialize samplers"):  # its words, with no reason given
        return RequestError(400, "llama-server could not set up sampling for this request (\"" + message + "\"): "
                                 "check its grammar and its format or response_format (a JSON schema it cannot turn "
                                 "into a grammar, or a grammar and a schema together) and its sampler options")
    if status >= 500 and any(m in message for m in _REQUEST_MISTAKES):
        return RequestError(400, f"llama-server refused the request: {message}")
    return RequestError(status, message, _error_kind(body))


def _error_kind(body: str) -> str | None:
    """llama-server's ``error.type`` in an error body (``exceed_context_size_error``, ...)."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    kind = err.get("type") if isinstance(err, dict) else None
    return kind if isinstance(kind, str) else None


def request_bytes(host: str, port: int, path: str, body: bytes | None, headers: dict[str, str] | None) -> bytes:
    """A POST of ``body`` (JSON), or a GET when ``body`` is None; the connection closes after it."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}Connection: close\r\n\r\n".encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _LineProtocol(asyncio.Protocol):
    """One request (a POST, or a GET); its answer's body, split into lines, goes to ``sink``
    as it arrives.

    ``done`` resolves when the body has ended (None), or fails: RequestError for a status of
    400 or more (with the body's message), BadResponse, ConnectionError when the connection
    ends before the body does, or whatever the sink raised.
    """

    def __init__(self, request: bytes, sink: LineSink):
        self.request = request  # what is still to be written (see send_now)
        self.sink = sink
        self.sock: socket.socket | None = None  # connected, its transport not made yet (see _connect)
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self._buf = b""  # bytes not yet parsed (head, chunk framing)
        self._pending: list[bytes] = []  # body bytes after the last line end (a long line comes in many reads)
        self._status = 0
        self._chunked = False
        self._left: int | None = None  # body bytes still to come (content length), or of this chunk
        self._chunk_crlf = False  # a chunk's data has ended; its CRLF is next
        self._in_head = True
        self._error_body: list[bytes] | None = None

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.sock = None
        if self.request:  # what the socket did not take in send_now
            transport.write(self.request)

    def send_now(self, sock: socket.socket) -> None:
        """Write the request to ``sock``, connected, now, before the transport exists; what
        it does not take, the transport writes once made."""
        self.sock = sock
        try:
            sent = sock.send(self.request)
        except OSError:  # a full buffer, or a broken connection, which the transport then reports
            sent = 0
        self.request = self.request[sent:]

    def close_unused_socket(self, _task=None) -> None:
        """Close the socket connected in :func:`_connect` that no transport took (connecting
        failed or was cancelled; once a transport has it, closing that closes the socket)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        try:
            in_head = self._in_head
            body = self._parse(data)
            if self._error_body is not None:
                self._error_body.append(body)
            else:
                if in_head and not self._in_head and b"\n" not in body:
                    self._deliver([])  # the answer has begun, and no line of it has come yet
                if body:
                    self._lines(body)
            if self._ended():
                self._finish()
        except BaseException as e:  # noqa: BLE001 - the sink's or the parser's failure ends the request
            self._fail(e)

    def connection_lost(self, exc) -> None:
        if self.done.done():
            return
        if not self._in_head and not self._chunked and self._left is None:
            self._finish()  # a body delimited by the end of the connection
        else:
            self._fail(exc or ConnectionResetError("the connection closed before the answer ended"))

    # ------------------------------------------------------------------ parsing

    def _parse(self, data: bytes) -> bytes:
        """Body bytes in ``data`` (b"" for none yet), after the head and chunk framing."""
        buf = self._buf + data if self._buf else data
        self._buf = b""
        if self._in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise BadResponse("answer head longer than 64 KiB")
                self._buf = buf
                return b""
            self._head(buf[:end])
            buf = buf[end + 4:]
        if not self._chunked:
            if self._left is not None:
                buf = buf[:self._left]
                self._left -= len(buf)
            return buf
        out = []
        while buf:
            if self._chunk_crlf:  # the CRLF after a chunk's data
                if len(buf) < 2:
                    self._buf = buf
                    break
                buf = buf[2:]
                self._chunk_crlf = False
                self._left = None
            elif self._left == 0:  # after the last chunk: trailers, ignored
                break
            elif self._left is not None:  # inside a chunk
                piece = buf[:self._left]
                out.append(piece)
                self._left -= len(piece)
                buf = buf[len(piece):]
                if self._left == 0:
                    self._chunk_crlf = True
            else:  # a chunk-size line
                eol = buf.find(b"\r\n")
                if eol < 0:
                    self._buf = buf
                    break
                try:
                    size = int(buf[:eol].split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadResponse(f"bad chunk size line {buf[:eol][:40]!r}") from None
                buf = buf[eol + 2:]
                self._left = size  # 0: the last chunk
        return b"".join(out)

    def _head(self, head: bytes) -> None:
        self._in_head = False
        status_line, *lines = head.split(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise BadResponse(f"not an HTTP response: {status_line[:80]!r}")
        self._status = int(parts[1])
        for line in lines:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif name == b"content-length" and value.strip().isdigit():
                self._left = int(value.strip())
        if self._chunked:  # chunked framing wins over a length, whichever header came first
            self._left = None
        if self._status >= 400:
            self._error_body = []

    def _ended(self) -> bool:
        """The body is complete: all of its content length has arrived, or the last (empty)
        chunk has. (The end of an ordinary chunk also leaves ``_left`` at 0, but with its
        CRLF still to read, ``_chunk_crlf``.)"""
        return not self._in_head and self._left == 0 and not self._chunk_crlf

    def _lines(self, body: bytes) -> None:
        if b"\n" not in body:
            self._pending.append(body)
            return
        if self._pending:
            self._pending.append(body)
            body = b"".join(self._pending)
        lines = body.split(b"\n")
        rest = lines.pop()
        self._pending = [rest] if rest else []
        self._deliver([ln[:-1] if ln.endswith(b"\r") else ln for ln in lines])

    def _deliver(self, lines: list[bytes]) -> None:
        waiting = self.sink(lines)
        if waiting is None:
            return
        if waiting.done():
            self._resume(waiting, reading=True)
            return
        assert self.transport is not None  # (lines come only once the connection is made)
        self.transport.pause_reading()  # the sink's reader is behind: wait for it
        waiting.add_done_callback(self._resume)

    def _resume(self, waiting, reading: bool = False) -> None:
        exc = None if waiting.cancelled() else waiting.exception()  # read, so it is never "unretrieved"
        if self.done.done():
            return
        if exc is not None:
            self._fail(exc)
            return
        if not reading:
            assert self.transport is not None  # (reading paused in _deliver, on this transport)
            self.transport.resume_reading()

    def hang_up(self) -> None:
        """Close the connection at once, which makes llama-server stop generating for it."""
        if self.transport is not None:
            self.transport.abort()

    def _finish(self) -> None:
        if self._error_body is not None:
            text = b"".join(self._error_body).decode("utf-8", "replace")
            self._fail(child_error(self._status, text))
            return
        try:
            if self._pending:
                self.sink([b"".join(self._pending)])
                self._pending = []
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            return
        self.done.set_result(None)
        assert self.transport is not None  # (the body ended on it)
        self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        self.hang_up()


def _connect_now(host: str, port: int) -> socket.socket | None:
    """A non-blocking socket connected to ``host:port`` when the kernel connects it within
    ``connect`` itself (as it does on loopback, where the handshake runs inside the call);
    None when it has not (another host, or nothing listening) or ``host`` is a name, not an
    address (no lookup here): the caller connects as usual, in the event loop, and so hears
    why."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, host)
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sock.connect_ex((host, port)) in (0, errno.EINPROGRESS):
            sock.getpeername()  # (raises ENOTCONN while the handshake is still under way)
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _connect(proto: _LineProtocol, host: str, port: int) -> asyncio.Task:
    """The task that makes ``proto``'s connection: on a socket connected now, with the
    request written now, when :func:`_connect_now` gives one; else ``create_connection`` as
    usual."""
    loop = asyncio.get_running_loop()
    sock = _connect_now(host, port)
    if sock is None:
        return loop.create_task(loop.create_connection(lambda: proto, host, port))
    proto.send_now(sock)
    task = loop.create_task(loop.create_connection(lambda: proto, sock=sock))
    task.add_done_callback(proto.close_unused_socket)
    return task


async def post(port: int, path: str, body: bytes | None, headers: dict[str, str] | None, sink: LineSink,
               host: str = "127.0.0.1") -> None:
    """POST ``body`` (JSON; None: a GET) to ``host:port`` and feed the answer's lines to
    ``sink`` (from the event loop's read callback) until the body ends. An answer of 400 or
    more is a RequestError carrying its text. Cancelling this closes the connection."""
    proto = _LineProtocol(request_bytes(host, port, path, body, headers), sink)
    connecting = _connect(proto, host, port)
    try:
        await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        await proto.done
    except BaseException:
        # failed, or cancelled (which cancels ``done`` itself): hang up at once, which is
        # what makes a llama-server stop generating for this request
        proto.hang_up()
        raise


def sse_sink(on_data: LineSink, named: bool = False) -> LineSink:
    """A line sink that passes on the data of each server-sent event (JSON bytes, untouched)
    and raises RequestError for an error event; ``[DONE]`` and other lines are dropped. The
    answer's beginning (a batch of no lines) goes on as an empty batch of data.

    ``named``: the stream names its events (``event: NAME`` before its ``data:``, as
    llama-server's Responses and Anthropic Messages streams do), and each event goes on as
    its lines, ``event: NAME\ndata: DATA`` (or ``data: DATA`` for an unnamed one), without
    the blank line that ends it; an ``error`` event raises."""
    name: bytes | None = None  # a named event's name, until its data line (which may come in a later read)

    def sink(lines: list[bytes]):
        nonlocal name
        data: list[bytes] = []
        for line in lines:
            if line.startswith(b"data: "):
                d = line[6:]
            elif line.startswith(b"data:"):
                d = line[5:].strip()
            elif line.startswith(b"error:"):
                raise _failed(data, error_text(line[6:].strip().decode("utf-8", "replace"), 500))
            elif named and line.startswith(b"event:"):
                name = line[6:].strip()
                continue
            else:
                continue
            if d == b"[DONE]":
                continue
            # llama-server's error event is the one object whose only key is "error"
            if d[:1] == b"{" and d[1:].lstrip().startswith(b'"error"'):
                event = json.loads(d)
                if isinstance(event, dict) and len(event) == 1:
                    raise _failed(data, error_text(d.decode("utf-8", "replace"), 500))
            if named:
                if name == b"error":
                    raise _failed(data, error_text(d.decode("utf-8", "replace"), 500))
                if name is not None:
                    d = b"event: " + name + b"\ndata: " + d
                    name = None
                else:
                    d = b"data: " + d
            data.append(d)
        return on_data(data) if data or not lines else None

    def _failed(data: list[bytes], message: str) -> RequestError:
        if data:  # what came before the error in the same read still goes on first
            on_data(data)
        return RequestError(500, message)

    return sink


def sse_request(payload: dict, api_key: str) -> tuple[bytes, dict[str, str]]:
    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return json.dumps(dict(payload, stream=True)).encode(), headers


async def relay_sse(port: int, path: str, payload: dict, api_key: str,
                    on_data: LineSink, named: bool = False) -> None:
    """POST ``payload`` (with ``stream: true``) to a llama-server on 127.0.0.1:``port``; each
    batch of events' data goes to ``on_data`` as it arrives (see the module's docstring);
    ``named``: events with their names (see :func:`sse_sink`)."""
    body, headers = sse_request(payload, api_key)
    await post(port, path, body, headers, sse_sink(on_data, named))


async def _iterate(start: Callable[[LineSink], Awaitable[None]], backlog: int = 256) -> AsyncGenerator[bytes, None]:
    """An async iterator over what a callback-fed request delivers. Reading from the
    connection pauses while more than ``backlog`` items wait for the consumer."""
    queue: collections.deque[bytes] = collections.deque()
    loop = asyncio.get_running_loop()
    wake: asyncio.Future | None = None  # what the consumer waits on when the queue is empty
    drained: asyncio.Future | None = None  # what the paused reader waits on

    def sink(items: list[bytes]):
        nonlocal drained
        if not items:  # (the answer's head: nothing to hand on)
            return None
        queue.extend(items)
        if wake is not None and not wake.done():
            wake.set_result(None)
        if len(queue) <= backlog:
            return None
        drained = loop.create_future()
        return drained

    def ended(_) -> None:
        if wake is not None and not wake.done():
            wake.set_result(None)

    task = asyncio.ensure_future(start(sink))
    task.add_done_callback(ended)
    try:
        while True:
            if queue:
                yield queue.popleft()
                continue
            if drained is not None and not drained.done():
                drained.set_result(None)  # caught up: read on
            if task.done():
                task.result()  # raises what ended the request, if anything did
                return
            wake = loop.create_future()
            await wake
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - we are leaving anyway
                pass
        elif not task.cancelled():
            task.exception()  # a failure the consumer left before reaching: retrieved, not logged


async def request_json(port: int, path: str, payload=None, headers: dict[str, str] | None = None,
                       timeout: float | None = None, host: str = "127.0.0.1"):
    """POST ``payload`` as JSON (None: a GET) and parse the JSON answer: a RequestError for a
    status of 400 or more, ValueError for a body that is not JSON, TimeoutError after
    ``timeout`` seconds (None: no limit). What a runner asks its child besides streams
    (``/health``, ``/tokenize``, ``/apply-template``, an answer not streamed)."""
    lines: list[bytes] = []
    body = None if payload is None else json.dumps(payload).encode()
    await asyncio.wait_for(post(port, path, body, headers, lines.extend, host), timeout)
    return json.loads(b"\n".join(lines))


def post_lines(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
               host: str = "127.0.0.1") -> AsyncGenerator[bytes, None]:
    """:func:`post` as an async iterator of the answer's lines."""
    return _iterate(lambda sink: post(port, path, body, headers, sink, host))


def sse_data(port: int, path: str, payload: dict, api_key: str = "") -> AsyncGenerator[bytes, None]:
    """:func:`relay_sse` as an async iterator of each event's data (JSON bytes, untouched)."""
    return _iterate(lambda sink: relay_sse(port, path, payload, api_key, sink))


async def sse_events(port: int, path: str, payload: dict, api_key: str = "") -> AsyncGenerator[dict, None]:
    """:func:`sse_data`, each event's JSON object parsed."""
    events = sse_data(port, path, payload, api_key)
    try:
        async for data in events:
            yield json.loads(data)
    finally:
        await events.aclose()
