"""The base of every handler under ``<base_url>llama/``: who is asking, errors, streaming.

Every method requires Jupyter authentication (token in ``Authorization: token|Bearer``,
or the login cookie plus XSRF, exactly as jupyter_server's own API) and authorization on
the resource ``llama``, but ``GET``/``HEAD`` of the root itself, which says only that the
server runs (as Ollama's root answers anyone).

Errors: the HTTP status is the core error's ``status`` (404 unknown model, 400 bad
request, 503 queue full, 507 does not fit in memory or the store's disk is full (create,
upload, copy, pull: ``errors.StorageFull``), 500 load failure or a crashed runner) and the
body is ``{"error": "..."}`` (OpenAI routes: ``{"error": {"message": ...}}``; Anthropic's:
``{"type": "error", "error": {"type", "message"}}``). Once a stream has started, an error
becomes its last line (``{"error": ...}``; in a stream of named events, an ``error`` event).

A client that goes away mid-request (``on_connection_close``, or a write that fails)
cancels the work: the stream from the child is closed (llama-server stops generating for
it) and the runner is released, so its refcount drops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
from http.client import responses
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from ...api import ollama as oa
from ...api.ollama import ndjson
from ...config import ConfigError
from ...engine.runner import EngineError, RequestError, RunnerCrashed
from ...errors import Forbidden, JupyterLlamaError, PayloadTooLarge
from ...hub import refusal
from ...load_options import LoadOptionsError
from ...models.gguf_info import GGUFError
from ...models.store import LOCAL_KEY_FILE_HEADER, LOCAL_KEY_HEADER, ModelStore, PathNotAllowed, local_caller
from ...scheduler import BadRequest, ModelNotFound

if TYPE_CHECKING:
    from ...hub.settings import LlamaHub
    from ...scheduler.fairness import Who
    from ..app import LlamaExtension

FuncT = TypeVar("FuncT", bound=Callable[..., Any])

try:
    from jupyter_server.auth.decorator import allow_unauthenticated
except ImportError:  # jupyter_server before 2.13, which let a handler's own checks decide (there are none here)
    def allow_unauthenticated(method: FuncT) -> FuncT:
        return method

__all__ = ["AUTH_RESOURCE", "NDJSON", "SSE", "ClientGone", "LlamaHandler", "PayloadTooLarge", "allow_unauthenticated",
           "api_method", "closing", "dumps", "error_status", "finite"]

AUTH_RESOURCE = "llama"
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


class ClientGone(Exception):
    """The client closed the connection; stop quietly."""


def error_status(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, message) for an exception from the core."""
    if isinstance(exc, web.HTTPError):
        return exc.status_code, exc.log_message or exc.reason or responses.get(exc.status_code, "error")
    if isinstance(exc, JupyterLlamaError):
        return int(getattr(exc, "status", 500) or 500), str(exc)
    if isinstance(exc, RequestError):
        return (exc.status if 400 <= exc.status < 500 else 500), str(exc)
    if isinstance(exc, (LoadOptionsError, ConfigError, GGUFError)):
        return 400, str(exc)
    if isinstance(exc, (RunnerCrashed, EngineError)):
        return 500, str(exc)
    return 500, (f"internal error in jupyter-llama ({type(exc).__name__}: {exc}); this is a bug: the server's log "
                 "has its traceback, and a report of it with what you sent is welcome")


def finite(obj):
    """JSON-safe copy: non-finite floats (a pinned keep_alive is inf) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj) -> str:
    return json.dumps(finite(obj), default=str)


@contextlib.asynccontextmanager
async def closing(agen):
    """Like ``contextlib.aclosing``, but the close survives a cancellation: closing the stream
    from a child is what makes llama-server stop, so it must run to its end."""
    try:
        yield agen
    finally:
        closer = asyncio.ensure_future(agen.aclose())
        try:
            await asyncio.shield(closer)
        except asyncio.CancelledError:
            closer.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise


def api_method(method):
    """Turn core errors into statuses and JSON bodies; a client that left ends quietly."""

    @functools.wraps(method)
    async def inner(self: "LlamaHandler", *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except ClientGone:
            return None
        except asyncio.CancelledError:
            if self._gone:
                return None
            raise
        except Exception as e:  # noqa: BLE001 - every error reaches the client in its format
            await self.fail(e)

    return inner


class LlamaHandler(ExtensionHandlerMixin, APIHandler):
    """Base: auth resource, JSON bodies with a size limit, errors, cancellable streaming."""

    auth_resource = AUTH_RESOURCE
    # False for a request that only watches (a panel polling ps, an event feed): it does not
    # count as activity, so it does not keep an idle server from being culled
    counts_as_activity = True

    def initialize(self, name: str, *args, **kwargs) -> None:
        super().initialize(name, *args, **kwargs)
        self._gone = False
        self._acquiring = False
        self._task: asyncio.Future | None = None
        self._head_sent = False  # a stream's head has gone out (see stream_writer): an error is its last line
        self._answered = False  # finish() has been called
        self._leased_name: str | None = None  # the loaded model a lease was given for (see acquire)
        self._who: Who | None = None  # (see who)
        self._prepared = False  # prepare has begun (see check_xsrf_cookie)

    @property
    def ext(self) -> LlamaExtension:
        # (jupyter_server types it as any extension: these handlers are LlamaExtension's alone)
        return cast("LlamaExtension", self.extensionapp)

    @property
    def store(self) -> ModelStore:
        """The extension's model store, which it makes before the server takes any request."""
        store = self.ext.store
        if store is None:
            raise RuntimeError("jupyter-llama's model store is not made yet (the extension has not started)")
        return store

    @property
    def hub(self) -> LlamaHub | None:
        """The JupyterHub service's settings on a manager shared through a JupyterHub; None on
        a single user's manager."""
        return self.ext.hub

    @property
    def who(self) -> Who | None:
        """The person behind this request on a manager shared through a JupyterHub (a
        :class:`~jupyter_llama.scheduler.fairness.Who`: name, groups, admin); None on a
        single user's manager, where every request is that user's."""
        hub = self.hub
        if hub is None:
            return None
        if self._who is None:
            user = self.current_user
            if user is None:
                raise web.HTTPError(403)
            self._who = hub.who(user.username, getattr(user, "groups", ()), getattr(user, "hub_admin", False))
        return self._who

    def check_xsrf_cookie(self) -> None:
        """jupyter_server's XSRF check, made from ``prepare`` on (where jupyter_server makes
        it once the user is known), never before: Tornado asks for it before ``prepare`` too,
        when jupyter_server's own check waits, but a JupyterHub service's check (which
        JupyterHub's HubOAuth puts in jupyter_server's place) would refuse a
        token-authenticated POST there, before the token was read."""
        if not self._prepared:
            return None
        return super().check_xsrf_cookie()

    async def prepare(self):
        self._prepared = True
        # Anthropic's clients send their key as x-api-key: it is the Jupyter token, as a Bearer would be.
        key = self.request.headers.get("x-api-key")
        if key and "Authorization" not in self.request.headers:
            self.request.headers["Authorization"] = f"Bearer {key}"
        if not self.counts_as_activity:  # (what a client asks of jupyter_server with ?no_track_activity=1)
            self.request.arguments.setdefault("no_track_activity", [b"1"])
        await super().prepare()
        self.ext.ensure_started()
        # Who may name server files by path, for everything this request does (see store.local_caller).
        local_caller.set(self.ext.is_local_caller(self.request.headers.get(LOCAL_KEY_HEADER)))

    # ------------------------------------------------------------------ bodies

    def json_body(self, names: tuple[str, ...] = ("model", "name", "source", "from")) -> dict:
        body = self.request.body or b""
        limit = self.ext.max_request_size
        if len(body) > limit:
            raise PayloadTooLarge(f"request body of {len(body):,} bytes is larger than the limit of {limit:,} bytes "
                                  "(LlamaExtension.max_request_size)")
        parsed = oa.parse_body(body)
        for key in names:  # (on a shared manager: another person's own model is not there for this one)
            value = parsed.get(key) if isinstance(parsed, dict) else None
            if isinstance(value, str):
                self.check_visible(value.strip())
        return parsed

    # ------------------------------------------------------------------ a shared manager's people

    def check_visible(self, name: str) -> None:
        """On a shared manager: a 404 for a model that is another person's own (as if it were
        not there: its name says nothing to anyone else)."""
        who, hub = self.who, self.hub
        if who is not None and hub is not None and name and not hub.may_see(who, name):
            raise ModelNotFound(name)

    def check_write(self, name: str, what: str) -> None:
        """On a shared manager: a 403 unless this person may change ``name`` (their own model,
        or anything for an admin)."""
        who, hub = self.who, self.hub
        if who is None or hub is None:
            return
        refusal = hub.write_refusal(who, name, what)
        if refusal is not None:
            raise Forbidden(refusal)

    def check_admin(self, what: str) -> None:
        who = self.who
        if who is not None and not who.admin:
            raise Forbidden(f"only this service's admins may {what}")

    def visible(self, name: str) -> bool:
        who, hub = self.who, self.hub
        return who is None or hub is None or hub.may_see(who, name)

    def people(self, lo) -> dict:
        """Who loaded, holds and has used the loaded model ``lo``, as this person may see it:
        everyone to an admin; to anyone else, themselves and how many others."""
        who = self.who
        if who is None:
            return {}
        sched = self.ext.scheduler
        gate = sched.users.gates.get(lo.ref.key) if sched is not None and sched.users is not None else None
        waiting = dict(gate.waiting) if gate is not None else {}
        if who.admin:
            return {"loaded_by": lo.loaded_by, "users": dict(lo.users), "used_by": sorted(lo.used_by),
                    "waiting": {u: len(q) for u, q in waiting.items()}}
        others = (set(lo.used_by) | set(lo.users) | set(waiting)) - {who.name}
        return {"loaded_by": lo.loaded_by if lo.loaded_by == who.name else None,
                "users": {who.name: lo.users[who.name]} if lo.users.get(who.name) else {},
                "used_by": [who.name] if who.name in lo.used_by else [],
                "waiting": {who.name: len(waiting[who.name])} if waiting.get(who.name) else {},
                "other_users": len(others)}

    def event_for(self, e) -> dict | None:
        """An event as this person may see it: None for one about another person's own model;
        another person's name in it is left out (an admin sees everything)."""
        d = e.to_dict()
        who, hub = self.who, self.hub
        if who is None or hub is None or who.admin:
            return d
        if e.model and not hub.may_see(who, e.model):
            return None
        user = d.get("data", {}).get("user")
        if user is not None and user != who.name:
            d["data"] = {**d["data"], "user": None}
        return d

    def finish_json(self, obj, status: int = 200):
        self.set_status(status)
        return self.finish(json.dumps(obj))

    # ------------------------------------------------------------------ errors

    def error_payload(self, status: int, message: str) -> dict:
        return {"error": message}

    def error_line(self, message: str) -> bytes:
        return ndjson({"error": message})

    async def fail(self, exc: BaseException) -> None:
        status, message = error_status(exc)
        if status >= 500 and not isinstance(exc, (JupyterLlamaError, EngineError)):
            self.log.error("jupyter-llama: %s %s failed", self.request.method, self.request.path, exc_info=exc)
        else:
            self.log.info("jupyter-llama: %s %s -> %s %s", self.request.method, self.request.path, status, message)
        if self._answered or self._gone:
            return
        if self._head_sent:  # mid-stream: the error is the last line
            with contextlib.suppress(ClientGone):
                await self.send(self.error_line(message))
            self.finish()
            return
        self.clear()
        if isinstance(exc, PathNotAllowed) and self.ext.local_key_file:
            self.set_header(LOCAL_KEY_FILE_HEADER, self.ext.local_key_file)  # for this user's own clients
        self.set_status(status)
        self.finish(json.dumps(self.error_payload(status, message)))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Errors raised before our code runs (authentication, XSRF, 404 origin) in our format.

        A request that carries no credentials Jupyter accepts (no valid token, no login
        cookie) is answered 401 with a sentence saying how to authenticate, as API clients
        (Ollama's, OpenAI's) expect; Jupyter answers it 403, and for a POST without a token
        it speaks of a missing '_xsrf' argument. 403 stays for a logged-in browser that
        failed the XSRF check or a user who is not authorised, and for a request whose Host
        header jupyter_server refused (``allow_remote_access``), which says so: its token may
        be right, and a 401 would send its user after the token."""
        message = responses.get(status_code, "error")
        exc_info = kwargs.get("exc_info")
        if exc_info and exc_info[1] is not None:
            message = error_status(exc_info[1])[1] if isinstance(exc_info[1], web.HTTPError) else message
        if status_code == 405:
            allowed = self._allowed_methods()
            self.set_header("Allow", ", ".join(allowed))
            message = (f"{self.request.method} is not a method of {self.request.path}: "
                       f"use {' or '.join(allowed)}" if allowed else message)
        refused = refusal(self)  # (the Hub knows the user, who may not use this service)
        if status_code == 403 and refused:
            message = refused
        elif status_code == 403 and not self._authenticated() and not self.check_host():
            host = "".join(ch for ch in self.request.host[:200] if ch.isprintable())
            message = (f'forbidden: the Host header named "{host}", a host this Jupyter server does not allow (it '
                       "answers only to local names, against DNS rebinding). To reach it by that name (behind a "
                       "reverse proxy that keeps the Host, say), start it with "
                       "--ServerApp.allow_remote_access=True (ServerApp.allow_remote_access = True in its config), "
                       "or add the name to ServerApp.local_hostnames")
        elif status_code == 403 and not self._authenticated():
            status_code = 401
            self.set_status(401)
            self.set_header("WWW-Authenticate", 'Bearer realm="jupyter-llama"')
            message = ("not authenticated: send the Jupyter server's token as 'Authorization: Bearer TOKEN' "
                       "(or 'token TOKEN'); kernels started by the server have it in JUPYTER_LLAMA_TOKEN, "
                       "OLLAMA_API_KEY, OPENAI_API_KEY and ANTHROPIC_API_KEY (sent as x-api-key)")
            if self.hub is not None:
                message = ("not authenticated: this is a JupyterHub service; send your JupyterHub API token as "
                           "'Authorization: Bearer TOKEN' (your server's kernels have it in JUPYTER_LLAMA_TOKEN, "
                           "OLLAMA_API_KEY and OPENAI_API_KEY; the Hub's token page makes one), or open "
                           f"{self.base_url}login in a browser")
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(self.error_payload(status_code, message)))

    def _allowed_methods(self) -> list[str]:
        """The methods this route answers: those its handler defines (Tornado's 405 is for the rest)."""
        return [m for m in ("GET", "HEAD", "POST", "PUT", "DELETE")
                if getattr(type(self), m.lower()) is not getattr(web.RequestHandler, m.lower())]

    def _authenticated(self) -> bool:
        try:
            return self.current_user is not None
        except Exception:  # noqa: BLE001 - no user could be made for this request
            return False

    # ------------------------------------------------------------------ streaming

    def on_connection_close(self) -> None:
        # Cancel only on the first sign that the client left: when a failed write noticed it
        # first, the request is already unwinding (closing its stream to the child), and a
        # cancellation now would interrupt that close and leave the child generating.
        first = not self._gone
        self._gone = True
        if first and not self._acquiring and self._task is not None and not self._task.done():
            self._task.cancel()
        super().on_connection_close()

    async def cancellable(self, coro):
        """Await ``coro`` in this request's own task, which the client's disconnect cancels
        (not in a task of its own: that would cost a turn of the event loop at each end of
        every request)."""
        if self._gone:
            coro.close()
            raise ClientGone()
        task = self._task = asyncio.current_task()
        try:
            return await coro
        except asyncio.CancelledError:
            if self._gone:
                task.uncancel()  # the disconnect's cancellation, told as what it was
                raise ClientGone() from None
            raise
        finally:
            self._task = None

    # A streamed answer, on Tornado's public API: start_stream (its headers), then its bytes by
    # stream_writer's function (from a callback) or send (from a coroutine), then end_stream.
    # Its head goes out with the first bytes; until then an error still gets a status of its own.

    def start_stream(self, content_type: str) -> None:
        """Make this answer a stream of ``content_type``; nothing is sent yet."""
        self.set_header("Content-Type", content_type)
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")  # reverse proxies: do not buffer the stream
        # Tornado leaves Nagle's algorithm on until finish(): each small chunk would wait for
        # the ACK of the one before (up to the client's 40 ms delayed ACK). Tornado turns it
        # back off when the response finishes.
        stream = getattr(self.request.connection, "stream", None)
        if stream is not None and not stream.closed():
            stream.set_nodelay(True)

    async def send(self, data: bytes) -> None:
        """Send one piece of the stream (b"": only its head, when not sent yet) and wait until
        the socket has taken it; ClientGone when the client has left."""
        waiting = self.stream_writer()(data)
        if waiting is not None:
            await waiting

    def stream_writer(self) -> Callable[[bytes], "asyncio.Future | None"]:
        """A function that sends bytes on the stream at once and may be called from any
        callback (a child's relay calls it from the read of each batch of tokens). It returns
        None when the socket took the bytes, or a future while the client's socket is full
        (the caller waits for it before reading on); it raises ClientGone, or fails the
        future with it, once the client has left. b"" sends the head alone."""

        def failed(flushed: asyncio.Future) -> bool:
            if flushed.cancelled() or flushed.exception() is not None:
                self._gone = True
                return True
            return False

        def write(data: bytes):
            if self._gone:
                raise ClientGone()
            self.write(data)
            self._head_sent = True
            flushed = self.flush()
            if flushed.done():
                if failed(flushed):
                    raise ClientGone()
                return None
            stream = getattr(self.request.connection, "stream", None)
            if stream is None or not stream.writing():  # the socket took it all
                flushed.add_done_callback(failed)
                return None
            waiting = asyncio.get_running_loop().create_future()

            def settle(f: asyncio.Future) -> None:
                if not waiting.done():
                    if failed(f):
                        waiting.set_exception(ClientGone())
                    else:
                        waiting.set_result(None)

            flushed.add_done_callback(settle)
            return waiting

        return write

    def end_stream(self, content_type: str, last: bytes = b""):
        """Finish the stream, ``last`` its last bytes."""
        if last:
            if self._gone:
                raise ClientGone()
            self.write(last)
        return self.finish(set_content_type=content_type)

    def finish(self, *args, **kwargs):
        self._answered = True
        return super().finish(*args, **kwargs)

    async def preset_of(self, body: dict):
        """The preset of the model a request names (empty for a GGUF path or an unknown name:
        resolving it later says what is wrong)."""
        resolver = self.ext.resolver
        if resolver is None:
            raise RuntimeError("jupyter-llama's model resolver is not made yet (the extension has not started)")
        return await resolver.preset(oa.model_name(body))

    async def acquire(self, name: str, options, keep_alive, needs=()):
        """``scheduler.acquire``, never cancelled half-way (a load is not abandoned because one
        client left): a disconnect meanwhile is acted on once the lease is in hand. ``needs``:
        the capabilities the request asks of the model (tools, thinking, insert); one it lacks
        is a 400 before anything loads, as in Ollama."""
        sched = await self.ext.get_scheduler()
        if needs:
            ref = await sched.resolver(name)
            if "vision" in needs and not ref.mmproj:
                raise BadRequest(f"{name} has no multimodal projector, so it cannot read images; use a vision model "
                                 "(one pulled with its mmproj file, or created with a projector)")
            oa.check_capabilities(name, ref, [n for n in needs if n != "vision"])
        self._acquiring = True
        try:
            lease = await sched.acquire(name, options, keep_alive, user=self.who)
        finally:
            self._acquiring = False
        if self._gone:
            lease.release()
            raise ClientGone()
        self._leased_name = lease.loaded.name
        return lease

    def count_tokens(self, final: dict | None) -> None:
        """A shared manager counts each answer's generated tokens and their time (its /metrics),
        from the last chunk's ``eval_count`` and ``eval_duration`` (nanoseconds), or an OpenAI
        answer's ``timings``."""
        sched = self.ext.scheduler
        if sched is None or sched.users is None or not isinstance(final, dict):
            return
        timings = final.get("timings") if isinstance(final.get("timings"), dict) else None
        if timings is not None:
            n, seconds = int(timings.get("predicted_n") or 0), float(timings.get("predicted_ms") or 0) / 1000
        else:
            n, seconds = int(final.get("eval_count") or 0), float(final.get("eval_duration") or 0) / 1e9
        sched.users.record_tokens(self._leased_name or str(final.get("model")), self.who, n, seconds)

