"""The asynchronous client: the same routes over ``httpx.AsyncClient``."""

from __future__ import annotations

from typing import AsyncIterator, Mapping

import httpx

from .address import _is_loopback
from .discovery import _found_again, find_server
from .errors import _check_line, _error, _message_of, _unreachable
from .local_key import _prove_local
from .routes import TIMEOUT, _answer, _Call, _Routes


class AsyncLlamaClient(_Routes):
    """The same routes over ``httpx.AsyncClient``: ``await`` an answer, ``async for`` a stream."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: httpx.Timeout = TIMEOUT,
                 environ: Mapping[str, str] | None = None, start: bool = True):
        self.server = find_server(url, token, environ, start=start)
        self._timeout = timeout
        self._http = self._connect()

    def _connect(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, headers=self.server.headers(), timeout=self._timeout,
                                 trust_env=not _is_loopback(self.server.url))

    async def _found_again(self) -> bool:
        """:meth:`LlamaClient._found_again`, without blocking the event loop."""
        import asyncio

        info = await asyncio.to_thread(_found_again, self.server)
        if info is None:
            return False
        await self._http.aclose()
        self.server = info
        self._http = self._connect()
        return True

    @property
    def url(self) -> str:
        return self.server.url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncLlamaClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _do(self, call: _Call):
        return self._stream(call) if call.stream else self._json(call)

    async def _json(self, call: _Call, again: bool = True):
        try:
            r = await self._http.request(call.method, call.path, json=call.body, params=call.params)
        except httpx.ConnectError as e:
            if again and await self._found_again():
                return await self._json(call, again=False)
            raise _unreachable(self.url, e) from None
        if r.status_code == 400 and _prove_local(self._http.headers, r):
            return await self._json(call, again)
        if r.status_code >= 400:
            raise _error(r.status_code, _message_of(r.content, r.status_code))
        return _answer(r, call)

    async def _stream(self, call: _Call, again: bool = True) -> AsyncIterator[dict]:
        try:
            async with self._http.stream(call.method, call.path, json=call.body, params=call.params) as r:
                proven = r.status_code == 400 and _prove_local(self._http.headers, r)
                if not proven and r.status_code >= 400:
                    raise _error(r.status_code, _message_of(await r.aread(), r.status_code))
                if not proven:
                    async for line in r.aiter_lines():
                        data = _check_line(line)
                        if data is not None:
                            yield data
            if proven:  # nothing was yielded: ask again, with the key
                async for data in self._stream(call, again):
                    yield data
        except httpx.ConnectError as e:  # raised before anything was yielded: safe to retry
            if again and await self._found_again():
                async for data in self._stream(call, again=False):
                    yield data
                return
            raise _unreachable(self.url, e) from None
