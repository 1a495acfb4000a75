"""Streamed answers from a llama-server child, read in the event loop's own callbacks.

Every token a user receives crosses this code, so it is built for the cost per token: an
:class:`asyncio.Protocol` parses the child's HTTP/1.1 answer (chunked or not) and its
server-sent events as bytes arrive, and hands each batch of complete lines to a callback
*synchronously*, inside the read callback. A relay that writes them on from there (the
server's handlers do) costs one read and one write per token and no task switch, no
generator chain, no httpx; under load, every event that came in one read goes out in one
write. A callback that returns a pending future (the client is slower than the child)
pauses reading from the child until it resolves, so nothing piles up.

A successful answer's head reaches the callback at once, as a batch of no lines: llama-server
sends its head (200, or an error status) as soon as a stream's first result is in, and its
first token can be milliseconds behind (the prompt is still being read). A relay sends its
own head then, while the child works, and not on the first token's way out.

A connection can be opened ahead of its request (:class:`Ahead`): a runner opens one to its
child as soon as a request has that runner, and the stream's request goes out on
it once its body is ready (a prompt templated, a payload written), so the connection (0.4
ms on 2 slow cores, and the child's accept) is not on the way to the first token.

A request goes out the moment it is given, not in a later turn of the event loop: a
connection to the child (on loopback) is made with a non-blocking ``connect`` that the kernel
completes before returning (:func:`_connect_now`), and the request is written straight to
its socket; the transport that reads the answer is made after. In a burst of streams (eight
requests read in one turn of the loop) a connection's callback would otherwise wait behind
every other request's handler, and the first request reached the child 5-6 ms after it
was ready, all eight together, where asked directly they arrive ~0.5 ms apart.

A stream's request can reach the child before its handler has even run (:class:`Early`,
made by the server as the client's request is read; see server/early.py): the request the
handler will make is sent ahead, and :func:`post` takes that connection, with whatever of the
answer has come meanwhile, when the request it is given is byte for byte the one sent;
otherwise the one sent ahead is closed, which makes the child drop it.

On top of the same parser: :func:`post_lines` (an async iterator of lines, what the bench
uses as its client), :func:`sse_data` and :func:`sse_events` (events as bytes or objects,
for callers that want an iterator). Closing or cancelling any of them closes the
connection, which makes llama-server stop generating for the request.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import errno
import json
import re
import socket
from typing import AsyncIterator, Awaitable, Callable

from ..errors import RequestError
from . import native

__all__ = ["Ahead", "BadResponse", "EARLY", "Early", "post", "post_lines", "request_json", "relay_sse", "sse_data",
           "sse_events", "error_text"]

CONNECT_TIMEOUT_S = 5.0

# what a line callback gets (complete lines, without line ends; no lines at all, once, when an
# answer of status below 400 has begun and none of its lines has come with its head) and may return.
# A sink with a ``native`` attribute (a :class:`.native.Target`) lets the relay below Python
# write the tokens it can to the client itself (see _LineProtocol._go_native).
LineSink = Callable[[list[bytes]], "Awaitable | None"]


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

    def __init__(self, request: bytes | None, sink: LineSink | None):
        self.request = request  # None: connected ahead of its request (see :meth:`begin`)
        self.sink = sink
        self.early: socket.socket | None = None  # connected, its transport not made yet: begin writes to it
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.lost = False  # the connection closed before its request was given
        self._buf = b""  # bytes not yet parsed (head, chunk framing)
        self._pending: list[bytes] = []  # body bytes after the last line end (a long line comes in many reads)
        self._status = 0
        self._chunked = False
        self._left: int | None = None  # body bytes still to come (content length), or of this chunk
        self._chunk_crlf = False  # a chunk's data has ended; its CRLF is next
        self._in_head = True
        self._error_body: list[bytes] | None = None
        self._run: native.Run | None = None  # the relay below Python, while it has the stream
        self._abort_after = False  # hung up while it had it: the connection closes when it returns
        # batches to deliver here before the C relay is tried (again): where it could not have
        # the stream before the child's head (_go_native_first), the head goes out from here
        self._native_after = 1
        # a request sent ahead of its caller (Ahead.send_ahead): its answer, held until claimed
        self._held: list[bytes] = []
        self._held_end: tuple[BaseException | None] | None = None  # (the connection closed meanwhile: why)

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.early = None
        if self.request:  # (what the socket did not take before, see send_early)
            transport.write(self.request)
        if self.sink is not None and self.request is not None:
            self._go_native_first()

    def begin(self, request: bytes, sink: LineSink) -> None:
        """Give a connection opened ahead its request: written now (to its transport, or to
        its socket when that is connected and the transport not made yet), or once it is
        connected."""
        self.request, self.sink = request, sink
        if self.transport is not None:
            self.transport.write(request)
            self._go_native_first()
        elif self.early is not None:
            self.send_early()

    def answered(self) -> bool:
        """Whether a request sent ahead can still be claimed: its connection is open, or the
        child has answered something before closing it (a child that closed it without a
        word never took the request: the caller asks afresh)."""
        return self._held_end is None or bool(self._held)

    def claim(self, sink: LineSink) -> None:
        """Give a request sent ahead its sink: what of its answer has come is parsed now, as if
        just read, and reading goes on."""
        self.sink = sink
        held, self._held = self._held, []
        end, self._held_end = self._held_end, None
        if end is None:
            self.transport.resume_reading()  # (first: a stream goes below Python only while reading)
        for data in held:
            self.data_received(data)
        if end is not None:
            self.connection_lost(end[0])
        else:
            self._go_native_first()

    def send_early(self) -> None:
        """Write the request to the connected socket now, before the transport exists;
        what it does not take, the transport writes once made."""
        try:
            sent = self.early.send(self.request)
        except OSError:  # (a full buffer, or a broken connection, which the transport then reports)
            sent = 0
        self.request = self.request[sent:]

    def drop_early(self, _task=None) -> None:
        """Close the socket connected now that no transport took (its connecting failed or
        was cancelled; once a transport has it, closing that closes the socket)."""
        if self.early is not None:
            self.early.close()
            self.early = None

    def data_received(self, data: bytes) -> None:
        if self.sink is None:  # the answer to a request sent ahead: held, unread after this, until claimed
            self._held.append(data)
            self.transport.pause_reading()
            return
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
            elif self._between_chunks():
                self._go_native()
        except BaseException as e:  # noqa: BLE001 - the sink's or the parser's failure ends the request
            self._fail(e)

    def connection_lost(self, exc) -> None:
        if self.request is None:  # never used: the caller connects afresh
            self.lost = True
            return
        if self.sink is None:  # a request sent ahead, not claimed yet: told when it is
            self._held_end = (exc,)
            return
        if self.done.done():
            return
        if not self._in_head and not self._chunked and self._left is None:
            self._finish()  # a body delimited by the end of the connection
        else:
            self._fail(exc or ConnectionResetError("the connection closed before the answer ended"))

    def pause_writing(self) -> None:  # the request is written once, whole, and the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

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
        self._native_after -= 1
        waiting = self.sink(lines)
        if waiting is None:
            return
        if waiting.done():
            self._resume(waiting, reading=True)
            return
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
            self.transport.resume_reading()

    # ------------------------------------------------------------------ the relay below Python

    def _between_chunks(self) -> bool:
        """A chunked answer whose every byte so far has been parsed and delivered: the next
        bytes are a chunk's size line, and nothing waits for the sink."""
        return (self._chunked and not self._in_head and not self._buf and not self._pending and self._left is None
                and not self._chunk_crlf and self._error_body is None and self._run is None
                and not self.done.done() and self.transport is not None and self.transport.is_reading())

    def _go_native(self) -> None:
        """Hand the stream to the C relay (native.py) when its sink offers a target and the
        client's socket can be lent; it returns the stream at the first chunk it does not
        relay, which is then parsed here as if just read. It is first tried after the head
        (see ``_native_after``), so the first token is its own; after a return, a few batches go
        through Python before it is tried again (the stream's last event and its end come
        in quick succession; a stream of events it does not relay, a thinking model's, is
        tried again now and then). Where the client's connection can hold our head for it,
        the C relay has the stream before the child's head instead (:meth:`_go_native_first`)."""
        target = getattr(self.sink, "native", None)
        if target is None or self._native_after > 0:
            return
        self._relay_below(target, before_head=False)

    def _go_native_first(self) -> None:
        """Hand the stream to the C relay as soon as its request is on its way, before the
        child's head, when the sink's target can lend its socket so (``lend_before_head``):
        llama-server sends its head as it takes the request, and read here that cost ~0.17 ms
        of Python (parse it, send our head, lend the socket, start the relay) beside the
        child's prompt, which on two cores slowed it by more (bench/PERFORMANCE.md). The
        relay reads the child's head itself and sends ours; a head it does not go on from (an
        error's) comes back unread, ours unsent and unsaid, and is read here as ever (see
        :meth:`_native_done`)."""
        target = getattr(self.sink, "native", None)
        if (getattr(target, "lend_before_head", None) is None or not self._in_head or self._buf
                or self._run is not None or self.done.done()
                or self.transport is None or not self.transport.is_reading()):
            return
        self._relay_below(target, before_head=True)

    def _relay_below(self, target: "native.Target", before_head: bool) -> None:
        """Start the C relay on this stream with the client's socket that ``target`` lends
        (``before_head``: with our head, for a child whose head is still to come); nothing
        when no run is free or the socket cannot be lent now."""
        run = native.Run.make()
        if run is None:
            return
        if before_head:
            lent = target.lend_before_head(run.stop)
        else:
            fd = target.lend(run.stop)
            lent = None if fd is None else (fd, b"")
        if lent is None:
            run.close()
            return
        dst, head = lent
        self.transport.pause_reading()
        self._run = run
        run.start(self.transport.get_extra_info("socket").fileno(), dst, target.spec,
                  lambda why: self._native_done(target, why), head)

    def _native_done(self, target: "native.Target", why: int) -> None:
        run, self._run = self._run, None
        left = run.leftover()
        head = run.state.head if run.before_head else None
        self._native_after = 2 if run.state.events else 16
        target.take_back(run.unsent(), why == native.CLIENT_GONE, why == native.FINISHED, head)
        run.close()
        if head:  # the relay read the child's head: a 200, chunked (what follows it is in ``left``)
            self._in_head, self._status, self._chunked, self._left = False, 200, True, None
        if self._abort_after:  # the request ended meanwhile (see hang_up)
            self.transport.abort()
            return
        if why == native.CLIENT_GONE:  # its connection closed now, which ends the request and so this
            return
        self.transport.resume_reading()
        if head:
            try:
                self._deliver([])  # (the answer has begun, as a head read here says)
            except BaseException as e:  # noqa: BLE001 - the sink's failure ends the request
                self._fail(e)
                return
        if left:
            self.data_received(left)

    def hang_up(self) -> None:
        """Close the connection at once (which makes llama-server stop generating for it);
        while the C relay has it, as soon as that returns (it is told to, now)."""
        if self._run is not None:
            self._abort_after = True
            self._run.stop()
        elif self.transport is not None:
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
    """The task that makes ``proto``'s connection: on a socket connected now, with its
    request (when ``proto`` has one) written now, when :func:`_connect_now` gives one; else
    ``create_connection`` as usual."""
    loop = asyncio.get_running_loop()
    sock = _connect_now(host, port)
    if sock is None:
        return loop.create_task(loop.create_connection(lambda: proto, host, port))
    proto.early = sock
    if proto.request:
        proto.send_early()
    task = loop.create_task(loop.create_connection(lambda: proto, sock=sock))
    task.add_done_callback(proto.drop_early)
    return task


class Ahead:
    """A connection to ``host:port`` opened now, for a request whose body is not ready yet
    (:func:`post` takes it). One that is not taken is closed after ``ttl`` seconds, well
    inside llama-server's keep-alive (5 s, after which it closes a connection that has
    carried no request), and one the server has closed meanwhile is not used: the request
    connects afresh."""

    def __init__(self, port: int, host: str = "127.0.0.1", ttl: float = 1.0):
        loop = asyncio.get_running_loop()
        self.port, self.host = port, host
        self.proto = _LineProtocol(None, None)
        self._connecting = _connect(self.proto, host, port)
        self._connecting.add_done_callback(_retrieved)
        self._expiry = loop.call_later(ttl, self.close)
        self.taken = False
        self.sent: bytes | None = None  # the request sent on it ahead of its caller (send_ahead)
        self.dropped = False

    @property
    def usable(self) -> bool:
        """Whether :meth:`take` would give it (not taken, expired, closed, or failed to connect)."""
        return not (self.taken or self.proto.lost or (self._connecting.done() and self.proto.transport is None))

    def take(self) -> "Ahead | None":
        """This connection for one request, or None when it has expired or closed already."""
        if not self.usable:
            return None
        self.taken = True
        self._expiry.cancel()
        return self

    def send_ahead(self, request: bytes, ttl: float = 10.0) -> None:
        """Send ``request`` on it now, before anyone has asked for its answer: what comes of
        the answer is held here, unread (the child writes on into the socket's buffers),
        until :class:`Early` gives it to :func:`post`; one not taken (:meth:`keep`) within
        ``ttl`` seconds is closed, as is one its request drops."""
        self.taken = True
        self.sent = request
        self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(ttl, self.drop)
        self.proto.begin(request, None)

    def keep(self) -> None:
        """A request sent ahead is its stream's now: no longer closed after its time."""
        self._expiry.cancel()

    def close(self) -> None:
        """Close it unless a request has it."""
        if not self.taken:
            self.drop()

    def drop(self) -> None:
        """Close it (or stop connecting), whoever has it: at once, which makes a child stop
        the stream it had begun on it (and what it had of an answer is no answer)."""
        self.taken = True
        self.dropped = True
        self._expiry.cancel()
        if not self._connecting.done():
            self._connecting.cancel()
        elif self.proto.transport is not None:
            self.proto.hang_up()

    async def connected(self) -> asyncio.Transport | None:
        """Its transport once connected; None when connecting failed (the caller connects
        afresh, and so hears why)."""
        if not self._connecting.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._connecting), CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                self._connecting.cancel()
                return None
        return self.proto.transport


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a failed connection ahead is heard of by the request that takes it


class Early:
    """A client's request, as a server hands it to its handler, for the streams the handler
    makes to a child: ``ahead``, the child's request sent before the handler ran (see
    server/early.py), which :func:`post` takes when it is the request the handler makes, and
    ``streams``, what :func:`post` was asked to send (from which the server learns what to
    send ahead next time). Set in :data:`EARLY` while the handler runs."""

    def __init__(self):
        self.ahead: Ahead | None = None
        self.streams: list[tuple[str, int, str, dict[str, str] | None, bytes]] = []  # host, port, path, headers, body
        self.claimed = False  # ``ahead`` was the request: the handler's stream took its connection
        self.missed = False  # ``ahead`` was not: it was closed, and the request sent afresh
        self.trusted = False  # the request was authenticated by what its head carries (its handler says)
        self.ended = False  # its handler is done: what runs on in its context finds nothing here

    def take(self, host: str, port: int, request: bytes) -> "Ahead | None":
        """The request sent ahead, when it is ``request`` (to the same place) and its answer
        can still be had; a different stream request to the same child closes it."""
        ahead = self.ahead
        if ahead is None or (ahead.host, ahead.port) != (host, port):
            return None
        self.ahead = None
        if ahead.sent == request and not ahead.dropped and ahead.proto.answered():
            ahead.keep()
            return ahead
        self.missed = ahead.sent != request
        ahead.drop()  # (the child stops the stream it had begun)
        return None

    def drop(self) -> None:
        """Close the request sent ahead, unless it was taken (the handler is done)."""
        if self.ahead is not None:
            self.ahead.drop()
            self.ahead = None


async def _connected(conn: Ahead) -> asyncio.Transport | None:
    """``conn``'s transport once connected; None, and ``conn`` closed, when connecting failed
    (the request then connects afresh, and hears why); closed too when this is cancelled."""
    try:
        transport = await conn.connected()
    except BaseException:
        conn.drop()
        raise
    if transport is None:
        conn.drop()
    return transport


# the request its server is answering, in the context its handler runs in (None: not a server's)
EARLY: contextvars.ContextVar[Early | None] = contextvars.ContextVar("jupyter_llama_early", default=None)


async def post(port: int, path: str, body: bytes | None, headers: dict[str, str] | None, sink: LineSink,
               host: str = "127.0.0.1", ahead: Callable[[], "Ahead | None"] | None = None) -> None:
    """POST ``body`` (JSON; None: a GET) to ``host:port`` and feed the answer's lines to
    ``sink`` (from the event loop's read callback) until the body ends. An answer of 400 or
    more is a RequestError carrying its text. Cancelling this closes the connection.

    ``ahead``, for a stream: gives a connection to the same place opened earlier
    (:meth:`Ahead.take`), used unless it has closed. A stream whose request was sent before
    its handler ran (:class:`Early`) takes that connection instead, and the answer begun on it."""
    request = request_bytes(host, port, path, body, headers)
    transport = proto = None
    early = EARLY.get() if ahead is not None else None
    if early is not None and not early.ended:
        early.streams.append((host, port, path, headers, body))
        sent = early.take(host, port, request)
        if sent is not None and (transport := await _connected(sent)) is not None:
            early.claimed = True
            proto = sent.proto
            proto.claim(sink)
    if transport is None:
        opened = ahead() if ahead is not None else None
        if opened is not None:
            proto = opened.proto
            proto.begin(request, sink)  # (written at once when it is connected)
            transport = await _connected(opened)
    if transport is None:
        proto = _LineProtocol(request, sink)
        transport, _ = await asyncio.wait_for(_connect(proto, host, port), CONNECT_TIMEOUT_S)
    try:
        await proto.done
    except BaseException:
        # failed, or cancelled (which cancels ``done`` itself): hang up at once, which is
        # what makes a llama-server stop generating for this request
        proto.hang_up()
        raise


def sse_sink(on_data: Callable[[list[bytes]], "Awaitable | None"], named: bool = False) -> LineSink:
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
        data = []
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

    if not named:  # (the C relay passes on unnamed events only)
        sink.native = getattr(on_data, "native", None)
    return sink


def sse_request(payload: dict, api_key: str) -> tuple[bytes, dict[str, str]]:
    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return json.dumps(dict(payload, stream=True)).encode(), headers


async def relay_sse(port: int, path: str, payload: dict, api_key: str,
                    on_data: Callable[[list[bytes]], "Awaitable | None"], named: bool = False,
                    ahead: Callable[[], Ahead | None] | None = None) -> None:
    """POST ``payload`` (with ``stream: true``) to a llama-server on 127.0.0.1:``port``; each
    batch of events' data goes to ``on_data`` as it arrives (see the module's docstring);
    ``named``: events with their names (see :func:`sse_sink`); ``ahead``: see :func:`post`."""
    body, headers = sse_request(payload, api_key)
    await post(port, path, body, headers, sse_sink(on_data, named), ahead=ahead)


async def _iterate(start: Callable[[LineSink], Awaitable[None]], backlog: int = 256) -> AsyncIterator[bytes]:
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
               host: str = "127.0.0.1") -> AsyncIterator[bytes]:
    """:func:`post` as an async iterator of the answer's lines."""
    return _iterate(lambda sink: post(port, path, body, headers, sink, host))


def sse_data(port: int, path: str, payload: dict, api_key: str = "") -> AsyncIterator[bytes]:
    """:func:`relay_sse` as an async iterator of each event's data (JSON bytes, untouched)."""
    return _iterate(lambda sink: relay_sse(port, path, payload, api_key, sink))


async def sse_events(port: int, path: str, payload: dict, api_key: str = "") -> AsyncIterator[dict]:
    """:func:`sse_data`, each event's JSON object parsed."""
    events = sse_data(port, path, payload, api_key)
    try:
        async for data in events:
            yield json.loads(data)
    finally:
        await events.aclose()
