"""A cap on the client connections ``serve`` holds, so that no number of clients can take
the process's file descriptors.

Without one, connections that never send a request (or never finish its head) pile up until
``accept`` fails for lack of descriptors; from then on Tornado's accept loop fails on every
wake-up, which spins a core and writes a log line each time, while legitimate clients time
out. The cap sits below the descriptor limit, so ``accept`` keeps working, and at the cap a
new connection is made room for by closing the connection that has been idle longest (one
waiting for a request head: a silent client, a slowloris, a kept-alive connection no request
is using; HTTP clients retry a request on an idle connection that closed). Connections in the
middle of a request are never closed for room: when every connection is busy, the new one is
answered 503 and closed. Reaching the cap is logged once, and again only after the count has
fallen to half of it.

Closed connections are noticed when the count passes the cap (Tornado tells its server, not
the application, when one closes), so the bookkeeping holds at most ``limit + 1`` entries.

It is an ``HTTPServerConnectionDelegate`` (Tornado's public interface between its HTTP
server and an application) that wraps the web application: Tornado calls ``start_request``
when a connection is accepted and again before each later request on it, and the message
delegate it returns sees the head arrive.
"""

from __future__ import annotations

import logging
import resource
from collections import OrderedDict

from tornado import httputil

from ..config import ConfigError, env

MAX_CONNECTIONS_DEFAULT = 2048

# Descriptors kept for everything that is not a client connection: the listening sockets,
# logs, the event loop, each child's pipes and pidfd. A client connection may also hold one
# to a child while its request is served, so each counts twice against what is left.
RESERVED_DESCRIPTORS = 128

REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
           b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s")
REFUSAL_TEXT = (b"the manager is serving as many connections as it allows (JUPYTER_LLAMA_MAX_CONNECTIONS), "
                b"all of them busy with requests; try again in a moment\n")


def max_connections() -> int:
    """How many client connections ``serve`` holds at once: ``JUPYTER_LLAMA_MAX_CONNECTIONS``
    (default 2048), lowered to what the descriptor limit leaves room for. Raises the soft
    descriptor limit to the hard one first (a server's usual start-up step; the soft limit
    is often 1024). ConfigError for a value that is not a whole number of at least 1."""
    text = env("MAX_CONNECTIONS")
    wanted = MAX_CONNECTIONS_DEFAULT
    if text:
        try:
            wanted = int(text)
        except ValueError:
            wanted = 0
        if wanted < 1:
            raise ConfigError(f"JUPYTER_LLAMA_MAX_CONNECTIONS must be a whole number of at least 1 "
                              f"(such as {MAX_CONNECTIONS_DEFAULT}), got {text!r}")
    return min(wanted, room_for_connections(raise_descriptor_limit()))


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit; returns the
    soft limit now in force (unchanged where the system refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def room_for_connections(descriptors: int) -> int:
    """How many client connections a process with this many descriptors can hold, leaving
    the reserve and one descriptor per connection for its request to a child (at least 8)."""
    return max(8, (descriptors - RESERVED_DESCRIPTORS) // 2)


class ConnectionCap(httputil.HTTPServerConnectionDelegate):
    """Wraps an application (``inner``, an ``HTTPServerConnectionDelegate`` such as a Tornado
    ``Application``) so that at most ``limit`` client connections are open; see the module's
    docstring for which connection goes at the cap."""

    def __init__(self, inner: httputil.HTTPServerConnectionDelegate, limit: int, log: logging.Logger):
        self.inner = inner
        self.limit = limit
        self.log = log
        # each connection Tornado has started, oldest idle first, with whether a request is
        # under way on it (its head arrived and the next request has not begun).
        self.connections: OrderedDict[object, bool] = OrderedDict()
        self.at_cap_logged = False

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection) -> httputil.HTTPMessageDelegate:
        if server_conn in self.connections:  # the connection's previous request is over: idle again
            self.connections[server_conn] = False
            self.connections.move_to_end(server_conn)
        else:
            self.connections[server_conn] = False
            if len(self.connections) > self.limit:
                self.make_room(server_conn)
        return _MarksBusy(self, server_conn, self.inner.start_request(server_conn, request_conn))

    def make_room(self, newcomer: object) -> None:
        """Over the cap: forget connections that have closed, then close the longest idle
        one; when every other connection is busy, refuse the newcomer."""
        for conn in [c for c in self.connections if _stream(c) is None or _stream(c).closed()]:
            del self.connections[conn]
        if len(self.connections) <= self.limit // 2:
            self.at_cap_logged = False  # (the last time at the cap is over)
        if len(self.connections) <= self.limit:
            return
        self.note_cap()
        for conn, busy in self.connections.items():
            if not busy and conn is not newcomer:
                del self.connections[conn]
                _stream(conn).close()
                return
        del self.connections[newcomer]
        stream = _stream(newcomer)
        if stream is not None and not stream.closed():
            stream.write(REFUSAL % (len(REFUSAL_TEXT), REFUSAL_TEXT)).add_done_callback(lambda _: stream.close())

    def note_cap(self) -> None:
        if not self.at_cap_logged:
            self.at_cap_logged = True
            self.log.warning("jupyter-llama: %d client connections, the most this manager holds "
                             "(JUPYTER_LLAMA_MAX_CONNECTIONS and the descriptor limit): closing the longest "
                             "idle ones for new clients, refusing new ones while all are busy", self.limit)

    def mark_busy(self, server_conn: object) -> None:
        if server_conn in self.connections:
            self.connections[server_conn] = True


def _stream(server_conn: object):
    """The connection's IOStream (``HTTP1ServerConnection.stream``), or None."""
    return getattr(server_conn, "stream", None)


class _MarksBusy(httputil.HTTPMessageDelegate):
    """The application's delegate for one request, which first tells the cap that the
    request's head has arrived (from then until the next request the connection is busy)."""

    def __init__(self, cap: ConnectionCap, server_conn: object, inner: httputil.HTTPMessageDelegate):
        self.cap = cap
        self.server_conn = server_conn
        self.inner = inner

    def headers_received(self, start_line, headers):
        self.cap.mark_busy(self.server_conn)
        return self.inner.headers_received(start_line, headers)

    def data_received(self, chunk: bytes):
        return self.inner.data_received(chunk)

    def finish(self) -> None:
        self.inner.finish()

    def on_connection_close(self) -> None:
        self.inner.on_connection_close()
