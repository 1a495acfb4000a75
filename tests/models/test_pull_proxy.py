"""Pulls through the proxy the environment names (``http_proxy``, ``https_proxy``, ``all_proxy``,
``no_proxy``), against a local proxy that plays every host name as this machine: a request for
``http://models.example:PORT/...`` reaches the test's file server on 127.0.0.1:PORT, through
the proxy only (the name resolves nowhere else). Nothing leaves 127.0.0.1."""

from __future__ import annotations

import base64
import http.client
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jupyter_llama.engine.runner import free_port
from jupyter_llama.models import pull as pull_mod
from jupyter_llama.models.pull.http_client import _Router
from jupyter_llama.models.store import ModelStore

HOST = "models.example"


class LocalProxy:
    """A forwarding proxy (absolute-form GET for http, CONNECT for https) that sends every
    host to 127.0.0.1, and asks for ``Proxy-Authorization: Basic`` of ``credentials`` when
    they are set. ``requests`` records (method, target, headers) of what clients sent it."""

    def __init__(self, credentials: tuple[str, str] | None = None):
        self.credentials = credentials
        self.requests: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # quiet
                pass

            def _allowed(self) -> bool:
                outer.requests.append((self.command, self.path, dict(self.headers.items())))
                if outer.credentials is None:
                    return True
                want = "Basic " + base64.b64encode(":".join(outer.credentials).encode()).decode()
                if self.headers.get("Proxy-Authorization") == want:
                    return True
                self.send_response(407)
                self.send_header("Proxy-Authenticate", 'Basic realm="test"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return False

            def do_GET(self):
                if not self._allowed():
                    return
                u = urllib.parse.urlsplit(self.path)
                conn = http.client.HTTPConnection("127.0.0.1", u.port or 80, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-authorization",
                                                                                      "proxy-connection")}
                conn.request("GET", urllib.parse.urlunsplit(("", "", u.path or "/", u.query, "")), headers=headers)
                resp = conn.getresponse()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := resp.read(65536):
                    self.wfile.write(chunk)
                conn.close()
                self.close_connection = True

            do_HEAD = do_GET

            def do_CONNECT(self):
                if not self._allowed():
                    return
                port = int(self.path.rsplit(":", 1)[1])
                upstream = socket.create_connection(("127.0.0.1", port), timeout=30)
                self.send_response(200, "Connection established")
                self.end_headers()
                self.wfile.flush()

                def pipe(a: socket.socket, b: socket.socket) -> None:
                    try:
                        while data := a.recv(65536):
                            b.sendall(data)
                    except OSError:
                        pass
                    finally:
                        for s in (a, b):
                            try:
                                s.shutdown(socket.SHUT_RDWR)
                            except OSError:
                                pass

                t = threading.Thread(target=pipe, args=(upstream, self.connection), daemon=True)
                t.start()
                pipe(self.connection, upstream)
                t.join(5)
                upstream.close()
                self.close_connection = True

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def url(self, user: str | None = None, password: str | None = None) -> str:
        auth = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password or '', safe='')}@" if user else ""
        return f"http://{auth}127.0.0.1:{self.port}"

    def __enter__(self) -> LocalProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def proxy_env(monkeypatch, **values: str) -> None:
    for var in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        for name in (var, var.upper()):
            monkeypatch.delenv(name, raising=False)
    for var, value in values.items():
        monkeypatch.setenv(var, value)


def test_a_pull_goes_through_the_http_proxy_with_its_credentials(hf, ggufs, tmp_path, monkeypatch):
    f = hf.add_file("tiny.gguf", ggufs["b"])
    with LocalProxy(credentials=("me", "p@ss:word")) as proxy:
        proxy_env(monkeypatch, http_proxy=proxy.url("me", "p@ss:word"))
        url = f"http://{HOST}:{hf.port}/files/tiny.gguf"
        e = pull_mod.pull(url, store=ModelStore(tmp_path / "store"), retries=0)
    assert e.model_digest == f.sha256 and e.display == "tiny:latest"
    (method, target, headers), = proxy.requests
    assert (method, target) == ("GET", url)  # the absolute URL: a forwarding proxy's request
    assert headers["Proxy-Authorization"] == "Basic " + base64.b64encode(b"me:p@ss:word").decode()
    (served,) = [r for r in hf.requests if r[1] == "/files/tiny.gguf"]
    assert "Proxy-Authorization" not in served[2]


def test_a_proxy_that_refuses_the_credentials_is_an_error_in_words(hf, ggufs, tmp_path, monkeypatch):
    hf.add_file("tiny.gguf", ggufs["b"])
    with LocalProxy(credentials=("me", "right")) as proxy:
        proxy_env(monkeypatch, http_proxy=proxy.url("me", "wrong"))
        with pytest.raises(pull_mod.PullError, match=r"HTTP 407"):
            pull_mod.pull(f"http://{HOST}:{hf.port}/files/tiny.gguf", store=ModelStore(tmp_path / "store"),
                          retries=0)


def test_https_goes_through_a_connect_tunnel_with_the_credentials(tmp_path, monkeypatch):
    """The tunnel is asked for with CONNECT, credentials along; a proxy that refuses them
    (407) fails the download, saying so."""
    with LocalProxy(credentials=("me", "right")) as proxy:
        proxy_env(monkeypatch, https_proxy=proxy.url("me", "wrong"))
        with pytest.raises(pull_mod.PullError, match=r"Tunnel connection failed: 407.*Nothing was kept"):
            pull_mod.pull(f"https://{HOST}/m.gguf", store=ModelStore(tmp_path / "store"), retries=0)
    (method, target, headers), = proxy.requests
    assert (method, target) == ("CONNECT", f"{HOST}:443")
    assert headers["Proxy-Authorization"] == "Basic " + base64.b64encode(b"me:wrong").decode()


def test_all_proxy_serves_a_scheme_without_its_own(hf, ggufs, tmp_path, monkeypatch):
    f = hf.add_file("tiny.gguf", ggufs["b"])
    with LocalProxy() as proxy:
        proxy_env(monkeypatch, ALL_PROXY=f"127.0.0.1:{proxy.port}")  # no scheme: http
        e = pull_mod.pull(f"http://{HOST}:{hf.port}/files/tiny.gguf", store=ModelStore(tmp_path / "store"),
                          retries=0)
    assert e.model_digest == f.sha256 and [r[0] for r in proxy.requests] == ["GET"]


def test_loopback_is_never_proxied(hf, ggufs, tmp_path, monkeypatch):
    f = hf.add_file("tiny.gguf", ggufs["b"])
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    proxy_env(monkeypatch, http_proxy=dead, https_proxy=dead, all_proxy=dead)
    e = pull_mod.pull(hf.file_url("tiny.gguf"), store=ModelStore(tmp_path / "store"), retries=0)
    assert e.model_digest == f.sha256


def test_which_hosts_are_proxied(monkeypatch):
    proxy_env(monkeypatch, http_proxy="proxy.internal", HTTPS_PROXY="https://u:p@proxy.internal:3128",
              no_proxy=".corp.example,10.1.2.3")
    router = _Router()
    assert router.proxy_for("http", "models.example") == "http://proxy.internal:8080"  # the port it had before
    # (spoken to in plain HTTP, as before; the credentials stay in the URL for httpx to send)
    assert router.proxy_for("https", "models.example") == "http://u:p@proxy.internal:3128"
    for host in ("corp.example", "hub.corp.example", "10.1.2.3", "localhost", "127.0.0.1", "127.1.2.3", "::1"):
        assert router.proxy_for("https", host) is None, host
    proxy_env(monkeypatch, https_proxy="http://proxy.internal:3128", no_proxy="*")
    assert _Router().proxy_for("https", "models.example") is None
