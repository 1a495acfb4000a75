"""A user's Jupyter server that defers to a shared manager: its ``llama/`` routes relay there.

In a JupyterHub user's server whose environment names a shared manager
(``JUPYTER_LLAMA_URL``, set by :mod:`.spawner`; or ``c.LlamaExtension.shared_url``), the
extension starts no manager of its own (no store, no scheduler, no model runner) and
every request to ``<base_url>llama/...`` (the JupyterLab panel's, the widgets') is sent on
to the same path of the shared manager with the user's token (``JUPYTER_LLAMA_TOKEN``,
else the server's ``JUPYTERHUB_API_TOKEN``), and its answer comes back as it is sent,
streams included. Who may use these routes is this server's decision (its owner, as for
any of its routes); who they are at the shared manager is the token's owner, this
server's user. The token is added here, never shown to the browser.

A client that goes away stops the relayed request (the shared manager sees its connection
close and stops generating); a body (an upload) streams through as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any, cast

import httpx
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web
from tornado.iostream import StreamClosedError

__all__ = ["RelayHandler", "relay_handlers", "relay_token"]

# Headers that go on either way; the rest (hop-by-hop, cookies, our own auth) stay here.
_ASK = ("content-type", "accept", "content-length", "x-accel-buffering")
_ANSWER = ("content-type", "cache-control", "x-accel-buffering", "allow", "www-authenticate")


def relay_token(environ=None) -> str:
    """The token this server sends the shared manager: its user's (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    return environ.get("JUPYTER_LLAMA_TOKEN") or environ.get("JUPYTERHUB_API_TOKEN") or ""


@web.stream_request_body
class RelayHandler(ExtensionHandlerMixin, APIHandler):
    """Any method of ``llama/<path>``: sent on to the shared manager (see the module's docstring)."""

    @property
    def shared_url(self) -> str:
        return cast(Any, self.extensionapp).shared_url  # (LlamaExtension's: the server imports this package)

    def initialize(self, name: str, *args, **kwargs) -> None:
        super().initialize(name, *args, **kwargs)
        self._body: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._gone = False
        self._sent = False  # some of the answer has gone out: an error now can only end it
        self._prepared = False  # (see check_xsrf_cookie)

    async def prepare(self):
        self._prepared = True
        await super().prepare()
        if self.current_user is None:
            raise web.HTTPError(403)
        if not self.authorizer.is_authorized(self, self.current_user, "write", "llama"):
            raise web.HTTPError(403, "not allowed to use jupyter-llama here")
        self._body = asyncio.Queue(maxsize=64)
        # (the request starts now: an upload's body goes on as it arrives, not once it is all here)
        self._task = asyncio.ensure_future(self._relay(self.path_kwargs.get("path") or ""))

    async def data_received(self, chunk: bytes) -> None:
        if self._body is not None:
            await self._body.put(chunk)

    async def _body_chunks(self):
        while True:
            chunk = await self._body.get()
            if chunk is None:
                return
            yield chunk

    async def _relay(self, path: str) -> None:
        base = self.shared_url
        url = base.rstrip("/") + "/" + path
        if self.request.query:
            url += "?" + self.request.query
        headers = {k: v for k, v in self.request.headers.items() if k.lower() in _ASK}
        token = relay_token()
        if token:
            headers["Authorization"] = f"token {token}"
        has_body = self.request.method in ("POST", "PUT", "PATCH", "DELETE")
        timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            req = client.build_request(self.request.method, url, headers=headers,
                                       content=self._body_chunks() if has_body else None)
            r = await client.send(req, stream=True)
            try:
                self.set_status(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() in _ANSWER:
                        self.set_header(k, v)
                async for chunk in r.aiter_raw():
                    self.write(chunk)
                    self._sent = True
                    await self.flush()
            finally:
                await r.aclose()
        self.finish()

    async def _answer(self) -> None:
        if self._task is None:
            return
        if self._body is not None:
            await self._body.put(None)
        try:
            await self._task
        except httpx.HTTPError as e:
            if self._sent:  # (cut off mid-answer: the client sees its end, as the manager's own would)
                self.finish()
            else:
                self.clear()
                self.set_status(502)
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps({"error": f"the shared jupyter-llama manager at {self.shared_url} "
                                                 f"did not answer ({type(e).__name__}: {e}); ask the Hub's admin"}))
        except (asyncio.CancelledError, StreamClosedError):
            if not self._gone:
                raise

    def on_connection_close(self) -> None:
        self._gone = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._body is not None:
            with contextlib.suppress(asyncio.QueueFull):
                self._body.put_nowait(None)
        super().on_connection_close()

    async def get(self, path: str | None = None):
        await self._answer()

    async def head(self, path: str | None = None):
        await self._answer()

    async def post(self, path: str | None = None):
        await self._answer()

    async def put(self, path: str | None = None):
        await self._answer()

    async def delete(self, path: str | None = None):
        await self._answer()

    def check_xsrf_cookie(self) -> None:
        """jupyter_server's check, from ``prepare`` on (see handlers.LlamaHandler)."""
        if not self._prepared:
            return None
        return super().check_xsrf_cookie()


def relay_handlers() -> list[tuple]:
    return [(r"/llama(?:/(?P<path>.*))?", RelayHandler)]
