"""``serve``'s HTTP server: Tornado's, with the API's requests read and answered by a lean
connection of our own.

On two slow cores Tornado's HTTP/1.1 server costs about 0.8 ms of CPU per request on a new
connection (an IOStream, two coroutines, a header timeout, a regex read, a buffered write
path; measured against 0.18 ms for a bare uvloop protocol), and for a stream all of it is
before the first token. llama-server's router, which the manager is measured against
(bench/api_overhead.py), does the same in C++ in a tenth of that. The application itself
(routing, jupyter_server's authentication, our handlers) is not what costs: only the
connection around it. So :class:`FrontServer` keeps Tornado's application and handlers
and replaces the connection, for the requests where that is safe:

* a GET, POST or DELETE under ``<base_url>llama/`` on a plain (not TLS) connection, HTTP/1.1, whose
  head has arrived, with a Content-Length of at most :data:`MAX_BODY` bytes, no
  ``Transfer-Encoding``, ``Expect`` or ``Upgrade``, and not a blob upload (which streams its
  body);
* anything else (JupyterLab's pages, kernels and websockets, an upload, a head still
  arriving, TLS, ``trust_xheaders``) goes to Tornado's own connection, untouched.

The choice is made by *peeking* at the socket (``MSG_PEEK``): nothing is read until the
request is known to be ours, and then exactly its bytes are, so a connection can go on to
Tornado at any request boundary with nothing lost. A body that comes after its head (most
clients send the two in separate writes, and a busy machine can run the server between
them) is read as it arrives, and the request is handed on once it is whole. A lean connection hands each request to
the application as Tornado's would (:meth:`~tornado.web.Application.start_request`, the
head, the body, finish) and writes its answer to the socket itself, one ``send`` per write
(the rest waits for the socket, and the writer for it). While an answer is being written it
watches the socket for the client hanging up, which the handlers take as a disconnect
(:meth:`~tornado.web.RequestHandler.on_connection_close`), as with Tornado's connection.

A POST read whole is shown to :class:`.early.SendAhead` before its handler runs: a stream of
a shape answered before has its child's request sent at once, and the handler's stream takes
it only if it is the request the handler makes (see that module).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any, Callable

from tornado import httputil, iostream
from tornado.httpserver import HTTPServer

from ..engine import http1, native
from .early import SendAhead

__all__ = ["FrontServer", "MAX_BODY", "front_for"]

MAX_BODY = 1 << 20  # bodies larger than this (images in a chat) go to Tornado's connection
_PEEK = 16384  # the first look at a request; a larger body is looked at again, whole
_NOT_OURS = (b"transfer-encoding", b"expect", b"upgrade")
_METHODS = (b"GET", b"POST", b"DELETE")  # (HEAD and OPTIONS, rare, stay with Tornado's rules for them)


class FrontServer(HTTPServer):
    """Tornado's HTTPServer, with the requests :func:`ours` accepts answered by
    :class:`_LeanConnection` (see the module's docstring). ``prefix``: the path under which
    requests are ours (``<base_url>llama/``); ``skip``: prefixes under it that stay with
    Tornado (the blob uploads)."""

    def initialize(self, *args, prefix: str = "/llama/", skip: tuple[str, ...] = (), **kwargs) -> None:
        super().initialize(*args, **kwargs)
        self.lean_prefix = prefix.encode()
        self.lean_skip = tuple(s.encode() for s in skip)
        self.lean = not self.ssl_options and not self.xheaders
        self.lean_requests = 0  # requests answered on a lean connection (what the tests look at)
        self.early: SendAhead | None = None  # stream requests sent to the child before their handler runs

    def _handle_connection(self, connection: socket.socket, address: Any) -> None:
        if not self.lean or connection.family not in (socket.AF_INET, socket.AF_INET6):
            super()._handle_connection(connection, address)
            return
        connection.setblocking(False)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _LeanConnection(self, connection, address).wait()

    def to_tornado(self, connection: socket.socket, address: Any) -> None:
        """Give a connection (nothing of its next request read) to Tornado's own."""
        super()._handle_connection(connection, address)

    def ours(self, peeked: bytes) -> tuple[int, int] | None:
        """(head length, body length) of the request at the start of ``peeked`` when it is
        one for the lean connection (its body may not all be here yet); None for Tornado's
        (and for a head not all here yet: Tornado's connection waits for the rest)."""
        end = peeked.find(b"\r\n\r\n")
        if end < 0:
            return None
        line_end = peeked.find(b"\r\n")
        parts = peeked[:line_end].split(b" ")
        if (len(parts) != 3 or parts[2] != b"HTTP/1.1" or parts[0] not in _METHODS
                or not parts[1].startswith(self.lean_prefix)):
            return None
        if self.lean_skip and parts[1].startswith(self.lean_skip):
            return None
        length: int | None = None
        for line in peeked[line_end + 2:end].split(b"\r\n"):
            name, colon, value = line.partition(b":")
            if not colon or name[:1] in (b" ", b"\t"):
                return None  # not a plain header line: Tornado's parser says what is wrong
            name = name.lower()
            if name in _NOT_OURS:
                return None
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit() or length is not None:
                    return None  # (two lengths: Tornado's connection refuses the request)
                length = int(value)
        length = length or 0
        if length > MAX_BODY:
            return None
        return end + 4, length


def front_for(app, early: bool = True) -> FrontServer:
    """A FrontServer for a jupyter_server ``ServerApp``'s application, with the settings
    its own HTTPServer is made with; ``early``: streams' requests are sent to their child
    before their handler runs where a request learned earlier shows how (server/early.py)."""
    from jupyter_server.utils import url_path_join

    prefix = url_path_join(app.base_url, "llama/")
    server = FrontServer(app.web_app, ssl_options=app.ssl_options, xheaders=app.trust_xheaders,
                         max_body_size=app.max_body_size, max_buffer_size=app.max_buffer_size,
                         prefix=prefix, skip=(prefix + "api/blobs/",))
    if early:
        def serving(port: int, waiting: int | None):
            point = app.extension_manager.extension_points.get("jupyter_llama")
            scheduler = getattr(point.app, "scheduler", None) if point is not None else None
            return scheduler.serving_on(port, waiting) if scheduler is not None else None

        server.early = SendAhead(serving)
    return server


class _Context:
    """What a request's connection tells it about the client (as Tornado's does)."""

    protocol = "http"
    trusted_downstream: set = set()

    def __init__(self, address: Any, family: int):
        self.address = address
        self.address_family = family
        self.remote_ip = address[0] if isinstance(address, tuple) and address else "0.0.0.0"

    def __str__(self) -> str:
        return self.remote_ip


class _LeanConnection(httputil.HTTPConnection):
    """One client's connection while its requests are ours (see the module's docstring)."""

    def __init__(self, server: FrontServer, sock: socket.socket, address: Any):
        self.server = server
        self.sock = sock
        self.address = address
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        self.context = _Context(address, sock.family)
        self._close_callback: Callable[[], None] | None = None
        self._out = bytearray()  # what the socket has not taken yet
        self._drained: asyncio.Future | None = None  # resolved when _out has gone
        self._reading = False
        self._writing = False
        self._closed = False
        self._idle: asyncio.TimerHandle | None = None
        self._chunked = False
        self._tail = b""  # an answer's last chunk, framed, held to go out with its end (hold)
        self._close_after = False
        self._answering = False
        self._max_body: int | None = None  # a handler's limit on its body (set_max_body_size)
        self._lent: Callable[[], None] | None = None  # the socket is the C relay's: how to stop it
        self._back: asyncio.Future | None = None  # resolved when the C relay gives it back
        self._close_when_back = False
        # lend_before_head: while the handler's flush runs, the heads write_headers makes
        # (bytes, headers), kept here unsent; then, while the C relay holds ours, its headers
        # and how to make it unsaid
        self._captured: list[tuple[bytes, httputil.HTTPHeaders]] | None = None
        self._held_head: tuple[httputil.HTTPHeaders, Callable[[], None]] | None = None
        self._ended = False  # this answer's end has gone (end_body, or the C relay): nothing more of it goes out
        self._coming: tuple[bytes, bytearray, int] | None = None  # a request whose body is still arriving
        self._early: tuple[SendAhead, http1.Early] | None = None  # this request's, for its streams (server/early.py)
        self._status = 0  # this answer's
        server._connections.add(self)

    # ------------------------------------------------------------------ waiting for a request

    def wait(self) -> None:
        """Wait for the next request (the first, or one after an answer), then decide."""
        if self._closed:
            return
        self._answering = False
        self._look()  # a request may be here already (a client writes at once after connecting)

    def _watch(self, on: bool) -> None:
        if on and not self._reading:
            self.loop.add_reader(self.fd, self._look)
            self._reading = True
        elif not on and self._reading:
            self.loop.remove_reader(self.fd)
            self._reading = False

    def _look(self) -> None:
        if self._closed:
            return
        if self._coming is not None:
            self._more_body()
            return
        if self._answering:  # readable while an answer goes out: the client left, or sent more
            self._check_gone()
            return
        try:
            peeked = self.sock.recv(_PEEK, socket.MSG_PEEK)
        except BlockingIOError:
            self._watch(True)
            if self._idle is None:
                self._idle = self.loop.call_later(self.server.conn_params.header_timeout or 3600, self.close_now)
            return
        except OSError:
            self.close_now()
            return
        if not peeked:  # the client closed between requests
            self.close_now()
            return
        sizes = self.server.ours(peeked)
        if sizes is None:
            self._hand_over()
            return
        # (the watch stays on: while the answer is made it hears the client leave, see _dispatch;
        # taking it off and on again costs uvloop a new poll handle and four epoll_ctl calls)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        head_len, body_len = sizes
        total = head_len + body_len
        if total > len(peeked):  # a larger body, or one still coming: how much of it is here?
            try:
                peeked = self.sock.recv(total, socket.MSG_PEEK)
            except OSError:
                pass
        data = self._take(min(total, len(peeked)))  # (only what was peeked: nothing of the next request)
        if data is None:
            self.close_now()
            return
        if len(data) < total:  # the rest is read as it comes (_more_body)
            self._coming = (data[:head_len - 4], bytearray(data[head_len:]), body_len)
            self._watch(True)
            self._idle = self.loop.call_later(self.server.conn_params.body_timeout or 3600, self.close_now)
            return
        self._dispatch(data[:head_len - 4], data[head_len:])

    def _more_body(self) -> None:
        """Read more of a body that came after its head; once it is whole, the request goes on."""
        head, body, length = self._coming
        try:
            part = self.sock.recv(length - len(body))  # (not a byte of the next request)
        except BlockingIOError:
            return
        except OSError:
            part = b""
        if not part:  # the client left before its body was all sent: there is no request to answer
            self.close_now()
            return
        body += part
        if len(body) < length:
            return
        self._coming = None
        self._idle.cancel()
        self._idle = None
        self._dispatch(head, bytes(body))

    def _take(self, n: int) -> bytes | None:
        """Read ``n`` bytes that a peek has seen (None when the connection broke meanwhile)."""
        parts, left = [], n
        try:
            while left:
                part = self.sock.recv(left)
                if not part:
                    return None
                parts.append(part)
                left -= len(part)
        except OSError:  # (BlockingIOError included: what was peeked is gone)
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _hand_over(self) -> None:
        """Tornado's connection takes it from here (nothing of the request is read)."""
        self._watch(False)
        if self._idle is not None:
            self._idle.cancel()
        self._closed = True
        self.server._connections.discard(self)
        self.server.to_tornado(self.sock, self.address)

    # ------------------------------------------------------------------ one request

    def _dispatch(self, raw_head: bytes, body: bytes) -> None:
        self._status = 0
        ahead = self.server.early
        if ahead is not None and raw_head.startswith(b"POST "):  # (its child may have its stream's request now)
            early = ahead.intake(raw_head, body)
            self._early = (ahead, early) if early is not None else None
        line, _, rest = raw_head.decode("latin1").partition("\r\n")
        try:
            start = httputil.parse_request_start_line(line)
            headers = httputil.HTTPHeaders.parse(rest)
        except httputil.HTTPInputError:
            self._bad_request()
            return
        self._close_after = headers.get("Connection", "").lower() == "close"
        self._chunked = False
        self._max_body = None
        self._ended = False
        self._answering = True
        self._watch(True)  # to hear of the client leaving while the answer is made
        self.server.lean_requests += 1
        # (for the handler's task, made in finish, and what it runs)
        context = http1.EARLY.set(self._early[1] if self._early is not None else None)
        try:
            delegate = self.server.start_request(self, self)
            waiting = delegate.headers_received(start, headers)
            if waiting is None and body:
                waiting = delegate.data_received(body)
                body = b""
            if waiting is None:
                delegate.finish()
            else:  # a handler that takes its body as it comes (and so may make it wait)
                self.loop.create_task(self._feed(delegate, waiting, body))
        finally:
            http1.EARLY.reset(context)

    async def _feed(self, delegate, waiting, body: bytes) -> None:
        await waiting
        if body:
            if self._max_body is not None and len(body) > self._max_body:
                self._bad_request()  # (what Tornado's connection answers to a body over the handler's limit)
                return
            waiting = delegate.data_received(body)
            if waiting is not None:
                await waiting
        delegate.finish()

    def _bad_request(self) -> None:
        self._send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        self._close_after = True
        self._finish_request()

    def _check_gone(self) -> None:
        try:
            more = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            more = b""
        if not more:
            self.close_now()
        else:  # the next request came early: read once this answer is out
            self._watch(False)

    # ------------------------------------------------------------------ httputil.HTTPConnection

    def set_close_callback(self, callback: Callable[[], None] | None) -> None:
        self._close_callback = callback

    def set_max_body_size(self, max_body_size: int) -> None:
        """A handler's own limit (a blob upload's); the body is here already, and checked against it."""
        self._max_body = max_body_size

    def set_body_timeout(self, timeout: float) -> None:
        """(The body has arrived whole: nothing to time.)"""

    def write_headers(self, start_line, headers: httputil.HTTPHeaders, chunk: bytes | None = None) -> asyncio.Future:
        code = self._status = start_line.code
        self._chunked = code not in (204, 304) and code >= 200 and "Content-Length" not in headers
        if self._chunked:
            headers["Transfer-Encoding"] = "chunked"
        if self._close_after:
            headers["Connection"] = "close"
        lines = [f"HTTP/1.1 {code} {start_line.reason}"]
        lines += [f"{name}: {value}" for name, value in headers.get_all()]
        bad = [line for line in lines if "\n" in line or "\r" in line]
        if bad:  # (as Tornado's connection refuses them)
            raise ValueError(f"a line end in a response header: {bad!r}")
        data = "\r\n".join(lines).encode("latin1") + b"\r\n\r\n"
        if chunk:
            data += self._frame(chunk)
        if self._captured is not None:  # (lend_before_head: kept, not sent)
            self._captured.append((data, headers))
            return self._send(b"")
        return self._send(data)

    def write(self, chunk: bytes) -> asyncio.Future:
        # (of an answer whose end has gone, nothing: see end_body)
        return self._send(b"" if self._ended else self._frame(chunk))

    def end_body(self, chunk: bytes) -> bool:
        """Send ``chunk``, a chunked answer's last, and the body's end now, in one send; what
        the handler writes after it (its finish, a late error line) goes nowhere. False, and
        nothing sent, for an answer that is not chunked."""
        if not self._chunked or self._ended:
            return False
        self._send(self._frame(chunk) + b"0\r\n\r\n")
        self._ended = True
        return True

    def hold(self, chunk: bytes) -> None:
        """Keep ``chunk``, an answer's last, to go out in one send with the body's end: the
        handler's finish follows at once (its empty write before that sends nothing), and
        the client is woken once, not twice."""
        self._tail = self._frame(chunk)

    def finish(self) -> None:
        data, self._tail = self._tail + (b"0\r\n\r\n" if self._chunked else b""), b""
        if data and not self._ended:
            self._send(data)
        self._finish_request()

    def _frame(self, chunk: bytes) -> bytes:
        if self._chunked and chunk:
            return b"%x\r\n%b\r\n" % (len(chunk), chunk)
        return chunk

    def _end_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early[0].end(early[1], self._status)

    def _finish_request(self) -> None:
        self._close_callback = None
        self._end_early()
        then = self.close_now if self._close_after else self.wait  # (the next request)
        if self._out:  # once the socket has taken the rest
            self._drained.add_done_callback(lambda f: then())
        else:
            then()

    # ------------------------------------------------------------------ the C relay (engine/native.py)

    def lend(self, stop: Callable[[], None]) -> int | None:
        """The socket's descriptor for the C relay to write a chunked answer's tokens on, when
        the answer's head has gone and nothing of ours waits to be written; until
        :meth:`take_back`, nothing here reads, writes or closes it (a close asked meanwhile
        calls ``stop`` and happens then)."""
        if (self._closed or self._out or not self._chunked or not self._answering or self._lent is not None
                or self._ended):
            return None
        self._lent = stop
        self._back = self.loop.create_future()
        self._watch(False)  # (the relay watches for the client hanging up)
        return self.fd

    def lend_before_head(self, stop: Callable[[], None], flush: Callable[[], Any],
                         unsaid: Callable[[], None]) -> tuple[int, bytes] | None:
        """:meth:`lend` for an answer whose head has not gone yet (engine/native.py's
        ``Target.lend_before_head``): the handler's ``flush`` makes it now, and it is kept
        here, unsent, for the C relay to send once the child's head has come; (descriptor, head), or
        None, with nothing made, when the socket cannot be lent. ``unsaid`` makes the handler
        take its head as not sent (``take_back`` calls it when the relay does not send it:
        the child's answer is not one it goes on from, perhaps an error, which the handler
        then answers with a status of its own)."""
        if self._closed or self._out or not self._answering or self._lent is not None or self._ended:
            return None
        captured = self._captured = []
        try:
            flush()
        except Exception:  # noqa: BLE001 - (a header it cannot send: the handler's next flush says so)
            captured.clear()
        finally:
            self._captured = None
        if not captured:  # (it failed, or made no head)
            self._unsay_head(None, unsaid)
            return None
        data, headers = captured[0]
        fd = self.lend(stop)
        if fd is None:
            self._unsay_head(headers, unsaid)
            return None
        self._held_head = (headers, unsaid)
        return fd, data

    def _unsay_head(self, headers: httputil.HTTPHeaders | None, unsaid: Callable[[], None]) -> None:
        """Make a head lend_before_head made (``headers``; None: it made none) unsaid: this
        answer's state, and the handler's, as before it was made (Tornado's next flush makes it
        again, or an error's)."""
        self._status, self._chunked = 0, False
        if headers is not None and "Transfer-Encoding" in headers:  # (write_headers set it; the handler never does)
            del headers["Transfer-Encoding"]
        unsaid()

    def take_back(self, unsent: bytes, gone: bool, ended: bool = False, head: int | None = None) -> None:
        """The socket is ours again: ``unsent``, what the relay wrote that the client had not
        taken yet, goes first; ``gone``: the client hung up; ``ended``: the relay wrote the
        answer's end (its last event and the body's last chunk, engine/native.py's
        FINISHED), and what the handler writes after it (the same last event, the end)
        goes nowhere. ``head``, for a socket lent before the answer's head had gone
        (:meth:`lend_before_head`), whether the relay sent ours (engine/native.py's
        HEAD_SENT: the child's answer goes on) or not (it is made unsaid: the child's head is
        still to be read)."""
        self._lent = None
        self._ended = ended
        self._back.set_result(None)
        held, self._held_head = self._held_head, None
        if held is not None and head != native.HEAD_SENT:
            self._unsay_head(*held)
        if gone or self._close_when_back:
            self.close_now()
            return
        if unsent:
            self._send(unsent)
        self._watch(True)

    # ------------------------------------------------------------------ the socket

    def _send(self, data: bytes) -> asyncio.Future:
        """Write ``data`` now or once the socket takes it; the future resolves when it has
        gone, and fails with StreamClosedError when the client has left."""
        fut = self.loop.create_future()
        if self._closed:
            fut.set_exception(iostream.StreamClosedError())
            fut.exception()
            return fut
        if not self._out:
            if not data:  # (Tornado's finish writes what is left of its buffer, mostly nothing)
                fut.set_result(None)
                return fut
            try:
                n = self.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                self.close_now()
                fut.set_exception(iostream.StreamClosedError())
                fut.exception()
                return fut
            if n == len(data):
                fut.set_result(None)
                return fut
            data = data[n:]
        self._out += data
        if self._drained is None or self._drained.done():
            self._drained = self.loop.create_future()
        if not self._writing:
            self.loop.add_writer(self.fd, self._flush)
            self._writing = True
        drained = self._drained

        def settle(f: asyncio.Future) -> None:
            if fut.done():
                return
            if f.exception() is not None:
                fut.set_exception(f.exception())
                fut.exception()
            else:
                fut.set_result(None)

        drained.add_done_callback(settle)
        return fut

    def _flush(self) -> None:
        try:
            n = self.sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:
            self.close_now()
            return
        del self._out[:n]
        if not self._out:
            self.loop.remove_writer(self.fd)
            self._writing = False
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(None)

    def close_now(self) -> None:
        """Close the connection (the client left, or it is done); the request's handler is
        told, and writes still waiting fail."""
        if self._closed:
            return
        if self._lent is not None:  # the C relay is writing on it: closed once it has stopped
            self._close_when_back = True
            self._lent()
            return
        self._closed = True
        self._status = 0  # (the answer did not all go out: nothing is learned from it)
        self._end_early()
        self._watch(False)
        if self._writing:
            self.loop.remove_writer(self.fd)
            self._writing = False
        if self._idle is not None:
            self._idle.cancel()
        try:
            self.sock.close()
        except OSError as e:  # pragma: no cover - close does not fail on a socket we own
            if e.errno != errno.EBADF:
                raise
        self.server._connections.discard(self)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(iostream.StreamClosedError())
            self._drained.exception()
        callback, self._close_callback = self._close_callback, None
        if callback is not None:
            callback()

    async def close(self) -> None:
        """What HTTPServer.close_all_connections awaits (until the connection is closed)."""
        self.close_now()
        if self._lent is not None:  # once the C relay has stopped and given the socket back
            await self._back
