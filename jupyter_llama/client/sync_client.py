"""The synchronous client, over ``httpx.Client``."""

from __future__ import annotations

import os
from typing import Iterator, Mapping

import httpx

from .address import _is_loopback
from .discovery import _found_again, find_server
from .errors import _check_line, _error, _message_of, _unreachable
from .local_key import _prove_local
from .routes import TIMEOUT, _answer, _Call, _Routes


class LlamaClient(_Routes):
    """Synchronous client. ``LlamaClient()`` finds the server as the package's docstring says."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: httpx.Timeout = TIMEOUT,
                 environ: Mapping[str, str] | None = None, start: bool = True):
        self.server = find_server(url, token, environ, start=start)
        self._timeout = timeout
        self._http = self._connect()

    def _connect(self) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, headers=self.server.headers(), timeout=self._timeout,
                            trust_env=not _is_loopback(self.server.url))

    def _found_again(self) -> bool:
        """The background manager this client used has exited (it does when idle): find or
        start it again. True when there is a new address to retry at."""
        info = _found_again(self.server)
        if info is None:
            return False
        self._http.close()
        self.server = info
        self._http = self._connect()
        return True

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "LlamaClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _do(self, call: _Call):
        return self._stream(call) if call.stream else self._json(call)

    def _json(self, call: _Call, again: bool = True):
        try:
            r = self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.ConnectError as e:
            if again and self._found_again():
                return self._json(call, again=False)
            raise _unreachable(self.url, e) from None
        if r.status_code == 400 and _prove_local(self._http.headers, r):
            return self._json(call, again)
        if r.status_code >= 400:
            raise _error(r.status_code, _message_of(r.content, r.status_code))
        return _answer(r, call)

    def _stream(self, call: _Call, again: bool = True) -> Iterator[dict]:
        try:
            with self._http.stream(call.method, call.path, json=call.body, params=call.params) as r:
                proven = r.status_code == 400 and _prove_local(self._http.headers, r)
                if not proven and r.status_code >= 400:
                    raise _error(r.status_code, _message_of(r.read(), r.status_code))
                if not proven:
                    for line in r.iter_lines():
                        data = _check_line(line)
                        if data is not None:
                            yield data
            if proven:  # nothing was yielded: ask again, with the key
                yield from self._stream(call, again)
        except httpx.ConnectError as e:  # raised before anything was yielded: safe to retry
            if again and self._found_again():
                yield from self._stream(call, again=False)
                return
            raise _unreachable(self.url, e) from None

    list = _Routes.tags

    def create_blob(self, path: str | os.PathLike) -> str:
        """Upload a file as a blob (unless the server has it); returns its ``sha256:<hex>`` digest."""
        import hashlib

        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        digest = f"sha256:{h.hexdigest()}"
        try:
            if self._http.head(f"api/blobs/{digest}").status_code == 200:
                return digest
            with open(path, "rb") as fh:
                r = self._http.post(f"api/blobs/{digest}", content=fh)
        except httpx.ConnectError as e:
            raise _unreachable(self.url, e) from None
        if r.status_code >= 400:
            raise _error(r.status_code, _message_of(r.content, r.status_code))
        return digest
