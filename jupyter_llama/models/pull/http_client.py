"""The HTTP client of a pull: httpx, with what a pull needs of it.

:class:`Http` follows redirects (``Authorization`` is dropped when one leaves the origin;
httpx keeps it only for a move from http to https on the same host), asks for
``Accept-Encoding: identity`` (the bytes hashed are the file's), trusts the system's CA
certificates, and sends each request straight to its host or through the proxy the
environment names for it (:class:`_Router`). Its errors are the standard library's: a
transport failure is raised as the ``OSError`` under it (a refused connection, a timeout, a
TLS failure), a body cut short as :class:`Dropped`; a redirect loop or a URL it cannot fetch
is a :class:`~.errors.PullError`.
"""

from __future__ import annotations

import socket
import ssl
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from .errors import PullError

__all__ = ["Dropped", "Http", "Response", "origin", "retryable", "MAX_REDIRECTS", "USER_AGENT"]

MAX_REDIRECTS = 10
USER_AGENT = "jupyter-llama/0.1 (+python httpx)"
DEFAULT_PROXY_PORT = 8080  # a proxy named without a port


class Dropped(ConnectionError):
    """The body ended early, the connection broke or the server failed (5xx): retry with Range."""


def origin(url: str) -> tuple[str, str, int]:
    u = urllib.parse.urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return (u.scheme, (u.hostname or "").lower(), port)


# ----------------------------------------------------------------------------- http


def _root_oserror(e: BaseException) -> OSError | None:
    """The ``OSError`` under an httpx error: httpx raises its errors ``from`` httpcore's, and
    httpcore's hold the one below as their argument (a re-raise ``from None`` in its pool
    drops their cause)."""
    cur: BaseException | None = e
    for _ in range(8):
        if cur is None or isinstance(cur, OSError):
            return cur
        first = cur.args[0] if cur.args else None
        cur = first if isinstance(first, BaseException) else cur.__cause__
    return None


@contextmanager
def _plain_errors(url: str) -> Iterator[None]:
    """httpx's errors as the standard library's, whose words the messages of a pull quote."""
    try:
        yield
    except httpx.UnsupportedProtocol:
        raise PullError(f"unsupported URL scheme in {url!r}: use http or https") from None
    except httpx.InvalidURL as e:
        raise PullError(f"bad URL {url!r}: {e}") from None
    except httpx.ProxyError as e:  # the proxy refused the tunnel (407, 403, 502...)
        root = _root_oserror(e)
        raise (root if root is not None else OSError(f"Tunnel connection failed: {e}")) from None
    except httpx.RemoteProtocolError as e:  # the server closed early, or sent nonsense
        root = _root_oserror(e)
        raise (root if root is not None else Dropped(str(e) or "the connection closed early")) from None
    except httpx.TimeoutException as e:
        root = _root_oserror(e)
        raise (root if root is not None else TimeoutError(str(e) or "timed out")) from None
    except httpx.TransportError as e:
        root = _root_oserror(e)
        raise (root if root is not None else ConnectionError(str(e) or type(e).__name__)) from None


class _Router(httpx.BaseTransport):
    """Sends each request straight to its host, or through the proxy the environment names for
    its scheme (``https_proxy``, ``http_proxy``, else ``all_proxy``; lower case first, as
    ``urllib.request.getproxies`` reads them), except for hosts ``no_proxy`` lists (as
    ``urllib.request.proxy_bypass`` matches them) and this machine's loopback, which is never
    proxied. The proxying itself is httpx's: a CONNECT tunnel for https, the absolute URL for
    http, and ``Proxy-Authorization`` from credentials in the proxy's URL.

    A proxy named without a scheme or as ``https://`` is spoken to in plain HTTP (what most
    proxies set as ``https_proxy`` are), one without a port on 8080; ``socks5://`` needs the
    ``socksio`` package."""

    def __init__(self, limits: httpx.Limits | None = None):
        self._proxies = urllib.request.getproxies()
        self._limits = limits or httpx.Limits()
        self._ssl: ssl.SSLContext | None = None
        self._transports: dict[str | None, httpx.HTTPTransport] = {}

    def proxy_for(self, scheme: str, host: str) -> str | None:
        host = host.lower()
        if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
            return None
        proxy = self._proxies.get(scheme) or self._proxies.get("all")
        if not proxy:
            return None
        try:
            if urllib.request.proxy_bypass(host):
                return None
        except Exception:  # pragma: no cover - platform quirks
            pass
        if "://" not in proxy:
            proxy = "http://" + proxy
        u = urllib.parse.urlsplit(proxy)
        try:
            port = u.port
        except ValueError:
            raise PullError(f"the proxy setting {u.hostname or proxy!r} has a bad port") from None
        if not u.hostname:
            raise PullError(f"the proxy setting {proxy!r} names no host")
        netloc = u.netloc if port is not None else f"{u.netloc}:{DEFAULT_PROXY_PORT}"
        return urllib.parse.urlunsplit(("http" if u.scheme == "https" else u.scheme, netloc, "", "", ""))

    def _transport(self, proxy: str | None) -> httpx.HTTPTransport:
        t = self._transports.get(proxy)
        if t is None:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()  # the system's CA certificates
            try:
                t = httpx.HTTPTransport(verify=self._ssl, proxy=proxy, limits=self._limits, trust_env=False)
            except ImportError as e:  # a SOCKS proxy without socksio
                raise PullError(f"cannot use the proxy {urllib.parse.urlsplit(proxy or '').hostname}: {e}") from None
            except ValueError as e:
                raise PullError(f"cannot use the proxy {urllib.parse.urlsplit(proxy or '').hostname}: {e}") from None
            self._transports[proxy] = t
        return t

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._transport(self.proxy_for(request.url.scheme, request.url.host)).handle_request(request)

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()


class Response:
    """A response whose body is read as it arrives: :meth:`read` (a prefix), :meth:`chunk`."""

    def __init__(self, resp: httpx.Response):
        self._resp = resp
        self.url = str(resp.url)  # after the redirects
        self.status = resp.status_code
        self.reason = resp.reason_phrase
        self._raw: Iterator[bytes] | None = None
        self._left = b""

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    @property
    def content_type(self) -> str:
        return (self.header("Content-Type") or "").split(";")[0].strip().lower()

    def chunk(self) -> bytes | None:
        """The next piece of the body as it came off the wire; None at its end."""
        if self._left:
            out, self._left = self._left, b""
            return out
        if self._raw is None:
            self._raw = self._resp.iter_raw()
        with _plain_errors(self.url):
            for piece in self._raw:
                if piece:
                    return piece
        return None

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the body (fewer only at its end)."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            piece = self.chunk()
            if piece is None:
                break
            parts.append(piece)
            got += len(piece)
        data = b"".join(parts)
        self._left = data[n:]
        return data[:n]

    def abort(self) -> None:
        """Break the connection from another thread (a blocked read returns)."""
        stream: Any = self._resp.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self._resp.close()
        except (httpx.HTTPError, OSError):  # closing a connection that broke
            pass


class Http:
    """httpx for a pull (see the module's docstring). One thread uses it at a time; only
    :meth:`Response.abort` comes from another."""

    def __init__(self, timeout: float = 60.0, max_redirects: int = MAX_REDIRECTS):
        self.timeout = timeout
        self.max_redirects = max_redirects
        self._router = _Router()
        self._client = httpx.Client(transport=self._router, follow_redirects=True, max_redirects=max_redirects,
                                    timeout=httpx.Timeout(timeout), trust_env=False,
                                    headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})

    def open(self, url: str, headers: dict[str, str] | None = None, method: str = "GET") -> Response:
        """Send a request, following redirects (at most ``max_redirects``); the final response,
        its body not read yet."""
        with _plain_errors(url):
            try:
                request = self._client.build_request(method, url, headers=headers)
                return Response(self._client.send(request, stream=True))
            except httpx.TooManyRedirects:
                raise PullError(f"too many redirects (more than {self.max_redirects}) fetching {url}: "
                                f"the server is redirecting in a loop") from None

    def close(self) -> None:
        self._client.close()


def retryable(e: BaseException) -> bool:
    """Whether trying again may mend ``e``: a transport failure (this client raises them as
    ``OSError``, :class:`Dropped` among them), but not a missing or forbidden local file."""
    return isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError))
