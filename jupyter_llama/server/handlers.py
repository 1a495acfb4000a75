"""HTTP handlers under ``<base_url>llama/``: thin shells that parse, call the core, stream.

Routes (Ollama-compatible unless noted):

    POST   api/generate  api/chat        NDJSON stream (``stream: false``: one object)
    POST   api/embed  api/embeddings
    GET    api/ps  api/tags  api/version
    POST   api/show  api/pull  api/copy  api/create
    DELETE api/delete
    HEAD   api/blobs/sha256:<hex>        200 present / 404 absent
    POST   api/blobs/sha256:<hex>        streamed upload, 201
    POST   v1/chat/completions  v1/completions  v1/embeddings     (OpenAI; SSE when streaming)
    POST   v1/responses                                           (OpenAI Responses; named SSE events)
    POST   v1/responses/input_tokens                              (OpenAI: what a Responses input counts)
    POST   v1/messages  v1/messages/count_tokens                  (Anthropic; named SSE events)
    GET    v1/models  v1/models/<name>                            (OpenAI)
    POST   api/push                      501: not supported
    GET    api/devices  api/events  api/log    POST api/estimate  api/prune (ours)
    GET    api/openapi.json              this API's OpenAPI 3.1 description (server/openapi.json)

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
import os
import queue
import time
from http.client import responses
from typing import TYPE_CHECKING, Any, Callable

from jupyter_server.auth.decorator import authorized

try:
    from jupyter_server.auth.decorator import allow_unauthenticated
except ImportError:  # jupyter_server before 2.13, which let a handler's own checks decide (there are none here)
    def allow_unauthenticated(method):
        return method
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from .._version import __version__
from ..api import anthropic as anth
from ..api import ollama as oa
from ..api import openai as oai
from ..api.ollama import ndjson
from ..api.options import split_options
from ..config import ConfigError
from ..engine.runner import EngineError, RequestError, RunnerCrashed, reserve_for
from ..errors import Forbidden, JupyterLlamaError, NoSuchRoute, NotLoaded, NotSupported
from ..load_options import LoadOptionsError
from ..models.gguf_info import GGUFError, read_arrays, read_gguf_info
from ..models.names import plainly_a_path, same_model
from ..models.pull import PullError, derive_name, pull_stream
from ..models.store import LOCAL_KEY_FILE_HEADER, LOCAL_KEY_HEADER, PathNotAllowed, local_caller
from ..scheduler import BadRequest, ModelNotFound

if TYPE_CHECKING:
    from .app import LlamaExtension

AUTH_RESOURCE = "llama"
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


class ClientGone(Exception):
    """The client closed the connection; stop quietly."""


class PayloadTooLarge(JupyterLlamaError):
    status = 413


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


def _finite(obj):
    """JSON-safe copy: non-finite floats (a pinned keep_alive is inf) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj) -> str:
    return json.dumps(_finite(obj), default=str)


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

    @property
    def ext(self) -> "LlamaExtension":
        return self.extensionapp  # type: ignore[return-value]

    @property
    def who(self):
        """The person behind this request on a manager shared through a JupyterHub (a
        :class:`~jupyter_llama.scheduler.fairness.Who`: name, groups, admin); None on a
        single user's manager, where every request is that user's."""
        hub = self.ext.hub
        if hub is None:
            return None
        cached = getattr(self, "_who", None)
        if cached is None:
            user = self.current_user
            if user is None:
                raise web.HTTPError(403)
            cached = self._who = hub.who(user.username, getattr(user, "groups", ()), getattr(user, "hub_admin", False))
        return cached

    def check_xsrf_cookie(self) -> None:
        """jupyter_server's XSRF check, made once the user is known (in ``prepare``), never
        before: Tornado asks for it before ``prepare`` too, when jupyter_server's own check
        waits, but a JupyterHub service's check (which JupyterHub's HubOAuth puts in
        jupyter_server's place) would refuse a token-authenticated POST there, before the
        token was read."""
        if not hasattr(self, "_jupyter_current_user"):
            return None
        return super().check_xsrf_cookie()

    async def prepare(self):
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
        who = self.who
        if who is not None and name and not self.ext.hub.may_see(who, name):
            raise ModelNotFound(name)

    def check_write(self, name: str, what: str) -> None:
        """On a shared manager: a 403 unless this person may change ``name`` (their own model,
        or anything for an admin)."""
        who = self.who
        if who is None:
            return
        refusal = self.ext.hub.write_refusal(who, name, what)
        if refusal is not None:
            raise Forbidden(refusal)

    def check_admin(self, what: str) -> None:
        who = self.who
        if who is not None and not who.admin:
            raise Forbidden(f"only this service's admins may {what}")

    def visible(self, name: str) -> bool:
        who = self.who
        return who is None or self.ext.hub.may_see(who, name)

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
        who = self.who
        if who is None or who.admin:
            return d
        if e.model and not self.ext.hub.may_see(who, e.model):
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
        refused = getattr(self, "_llama_refused", None)  # (the Hub knows the user, who may not use this service)
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
            if self.ext.hub is not None:
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
        return await self.ext.resolver.preset(oa.model_name(body))

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
        sched.users.record_tokens(getattr(self, "_leased_name", None) or str(final.get("model")), self.who, n, seconds)

    async def relay(self, start, translator, stream: bool, complete=None) -> None:
        """Run ``start(on_data)`` (a runner's relay of a child's stream) with each event through
        ``translator``: sent on as its NDJSON lines, or fed to it and answered as one object.

        ``complete``: an async function that adds to the last chunk (a dict) once the child's
        stream has ended, before it goes out; streamed, the translator holds that chunk back
        (its ``final``), and it is sent here."""
        if not stream:
            def gather(batch: list[bytes]) -> None:
                for data in batch:
                    translator.feed(json.loads(data))

            await start(gather)
            answer = translator.combined()
            if complete is not None and translator.final is not None:
                await complete(answer)
            self.count_tokens(answer)
            self.finish_json(answer)
            return
        self.start_stream(NDJSON)
        write = self.stream_writer()
        last: list[bytes] = []  # the lines from the last chunk on: they go with the body's end

        def send_on(batch: list[bytes]):
            if not batch:  # the child's answer has begun: our head goes now, while it makes the first token
                return write(b"")
            out = b"".join([translator.lines(data) for data in batch])
            if translator.final is not None:  # the child's stream ends here: its last line goes with the end
                last.append(out)
                return None
            return write(out) if out else None

        try:
            await start(send_on)
        except Exception:
            if last:  # what came before the failure goes before its error line
                waiting = write(b"".join(last))
                if waiting is not None:
                    await waiting
            raise
        if complete is not None and translator.final is not None:
            await complete(translator.final)
            last.append(ndjson(translator.final))
        self.count_tokens(translator.final)
        self.end_stream(NDJSON, b"".join(last))


# ============================================================================ Ollama


class GenerateHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        body = self.json_body()
        req = oa.parse_generate(body, await self.preset_of(body))
        with self.ext.work():
            await self.cancellable(self._generate(req))

    async def _generate(self, req: oa.GenerateRequest) -> None:
        started = time.monotonic()
        if req.unloads:
            await _unload(self, req.model)
            self.finish_json(oa.load_chunk(req.model, "unload", chat=False, total_s=time.monotonic() - started))
            return
        lease = await self.acquire(req.model, req.options, req.keep_alive, req.needs)
        try:
            if req.is_load_only:
                self.finish_json(oa.load_chunk(req.model, "load", chat=False, total_s=time.monotonic() - started,
                                               load_s=lease.load_duration))
                return
            runner = lease.runner
            # the child's chat route separates the reasoning, and reads images with the projector
            chats = req.images or (req.thinks and lease.loaded.ref.has_chat_template)
            tr = (oa.ThinkingGenerateTranslator if chats else oa.GenerateTranslator)(
                req.model, started, lease.load_duration, logprobs=req.logprobs)
            if chats:
                start = functools.partial(runner.relay_chat, req.prompt_messages(), truncate=req.truncate,
                                          **req.chat_params)
            elif req.suffix:  # fill in the middle: the child's /infill puts the model's FIM tokens around both
                start = functools.partial(runner.relay_infill, req.prompt, req.suffix, **req.sampling)
            else:
                if req.template is not None:  # the model's preset template, or the request's
                    prompt = req.template.render(req.prompt_messages())
                else:
                    prompt = await runner.prompt(req.prompt, req.system or req.default_system, raw=req.raw,
                                                 templated=lease.loaded.ref.has_chat_template, history=req.history)
                if req.answers_context:
                    await self._with_context(req, lease, prompt, started)
                    return
                prompt = await runner.fit_to_context(prompt, reserve=reserve_for(req.sampling), truncate=req.truncate)
                start = functools.partial(runner.relay_completion, prompt, **req.sampling)
            await self.relay(start, tr, req.stream)
        finally:
            lease.release()

    async def _with_context(self, req: oa.GenerateRequest, lease, text: str, started: float) -> None:
        """The ``/completion`` path of a request that is not raw: the request's ``context`` (a
        previous answer's token ids) goes before the new prompt as ids, and the last chunk
        carries the conversation's ids, ``context``: the prompt's (as the child tokenized it)
        and the answer's (from the child's events). The prompt's are counted beside the
        answer, never before its first token: ids a cut to the context already gave are used
        as they are, and a text is tokenized while the child generates."""
        runner = lease.runner
        if req.context:
            oa.check_context(req.model, req.context, lease.loaded.ref.info)
        prompt = await runner.fit_to_context(text, reserve=reserve_for(req.sampling), truncate=req.truncate,
                                             context=req.context)
        tr = oa.ContextGenerateTranslator(req.model, started, lease.load_duration, logprobs=req.logprobs)
        counted = asyncio.ensure_future(runner.prompt_tokens(prompt))

        async def complete(final: dict) -> None:
            ids, answer = tr.answer()
            try:
                if ids is None:  # not every id showed: the text, tokenized with the prompt (as Ollama does)
                    final["context"] = await runner.conversation_tokens(prompt, answer)
                else:
                    final["context"] = await counted + ids
            except (RequestError, EngineError) as e:
                # the answer is whole: it goes out, without the context it could not be given
                self.log.warning("jupyter-llama: %s answered, but its context could not be counted: %s",
                                 req.model, e)

        try:
            await self.relay(functools.partial(runner.relay_completion, prompt, **req.sampling), tr, req.stream,
                             complete)
        finally:
            if not counted.done():
                counted.cancel()
            counted.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody waited for


async def _unload(handler: LlamaHandler, name: str) -> None:
    sched = await handler.ext.get_scheduler()
    await sched.resolver(name)  # 404 for a model that does not exist
    who = handler.who
    if who is not None and not who.admin:  # (a shared manager: a person stops only what is theirs alone)
        lo = await sched.find_loaded(name)
        if lo is not None:
            others = set(lo.users) - {who.name}
            if lo.loaded_by not in (None, who.name) or others:
                raise Forbidden(f"{who.name} may not unload {name}: " + (
                    "other users are using it now" if others else "another user's request loaded it") +
                    "; it unloads by itself once idle for its keep_alive")
    await sched.unload(name, reason="unloaded on request (keep_alive 0)")


class ChatHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        body = self.json_body()
        req = oa.parse_chat(body, await self.preset_of(body))
        with self.ext.work():
            await self.cancellable(self._chat(req))

    async def _chat(self, req: oa.ChatRequest) -> None:
        started = time.monotonic()
        if req.unloads:
            await _unload(self, req.model)
            self.finish_json(oa.load_chunk(req.model, "unload", chat=True, total_s=time.monotonic() - started))
            return
        lease = await self.acquire(req.model, req.options, req.keep_alive, req.needs)
        try:
            if req.is_load_only:
                self.finish_json(oa.load_chunk(req.model, "load", chat=True, total_s=time.monotonic() - started,
                                               load_s=lease.load_duration))
                return
            runner = lease.runner
            if req.templated is not None:  # the model's preset template makes the prompt
                text = req.templated.render(req.all_messages, think=bool(req.think))
                prompt = await runner.fit_to_context(text, reserve=reserve_for(req.sampling), truncate=req.truncate)
                tr = oa.TemplatedChatTranslator(req.model, started, lease.load_duration, logprobs=req.logprobs)
                start = functools.partial(runner.relay_completion, prompt, **req.sampling)
            else:
                tr = oa.ChatTranslator(req.model, started, lease.load_duration, logprobs=req.logprobs)
                start = functools.partial(runner.relay_chat, req.all_messages, truncate=req.truncate, **req.chat_params)
            await self.relay(start, tr, req.stream)
        finally:
            lease.release()


class EmbedHandler(LlamaHandler):
    legacy = False

    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        body = self.json_body()
        preset = await self.preset_of(body)
        req = oa.parse_embeddings(body, preset) if self.legacy else oa.parse_embed(body, preset)
        with self.ext.work():
            await self.cancellable(self._embed(req))

    async def _embed(self, req: oa.EmbedRequest) -> None:
        started = time.monotonic()
        lease = await self.acquire(req.model, req.options, req.keep_alive)
        try:
            raw, tokens = await lease.runner.embed(req.inputs, truncate=req.truncate)
        finally:
            lease.release()
        vectors = await asyncio.to_thread(oa.unit_vectors, raw)
        if req.legacy:
            self.finish_json({"embedding": vectors[0] if vectors else []})
            return
        self.finish_json(oa.embed_body(req.model, vectors, time.monotonic() - started, lease.load_duration, tokens,
                                       req.dimensions))


class EmbeddingsHandler(EmbedHandler):
    legacy = True


class PsHandler(LlamaHandler):
    counts_as_activity = False  # a panel polling ps must not keep an idle server alive

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        sched = self.ext.scheduler
        models = []
        if sched is not None:
            now = time.time()
            for lo in sched.live():
                if not self.visible(lo.name):
                    continue
                model = oa.ps_model(lo.info(), lo.ref.info, now, projector=lo.ref.projector_family) | self.people(lo)
                if isinstance(model.get("also_as"), list):  # (its other names: another person's own is not there)
                    model["also_as"] = [n for n in model["also_as"] if self.visible(n)]
                models.append(model)
        self.finish(dumps(oa.ps_body(models)))


class TagsHandler(LlamaHandler):
    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        entries = await asyncio.to_thread(self.ext.store.list)
        self.finish(dumps(oa.tags_body([e for e in entries if self.visible(e.display)])))

    async def head(self):  # (as Ollama answers it: some clients probe the server so)
        await self.get()


class ShowHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        name, verbose = oa.parse_show(self.json_body())
        data = await asyncio.to_thread(self.ext.store.show, name)
        arrays = tensors = None
        path = next((f.get("path") for f in data.get("files") or [] if f.get("role") == "model"), None)
        if verbose and path:  # (the store keeps a summary; the arrays and the tensor table are in the file)
            arrays = await asyncio.to_thread(read_arrays, path)
            tensors = (await asyncio.to_thread(read_gguf_info, path)).tensors
        self.finish(await asyncio.to_thread(dumps, oa.show_body(data, verbose, arrays, tensors)))


class PullHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        req = oa.parse_pull(self.json_body(names=()))  # (its model is a source, not a name here)
        if self.who is not None:
            try:
                dest = derive_name(req.source, req.name).display
            except PullError as e:
                raise BadRequest(str(e)) from None
            self.check_write(dest, "pull")
        with self.ext.work():
            await self.cancellable(self._pull(req))

    async def _pull(self, req: oa.PullRequest) -> None:
        try:
            await self._pull_stream(req)
        finally:
            self.ext.store_changed()

    async def _pulled(self, req: oa.PullRequest) -> None:
        """Before the answer goes out: a pull that updated a loaded model retires its runner
        for the old file (the name now means the new one)."""
        with contextlib.suppress(PullError):
            await self.ext.name_changed(derive_name(req.source, req.name).display)

    async def _pull_stream(self, req: oa.PullRequest) -> None:
        gen = pull_stream(req.source, req.name, store=self.ext.store, insecure=req.insecure)
        async with closing(gen) as statuses:
            if not req.stream:
                last = {"status": "success"}
                async for st in statuses:
                    last = st
                await self._pulled(req)
                self.finish_json(last if last.get("status") == "success" else {"status": "success"})
                return
            first = await anext(statuses, None)  # an error before any progress is an HTTP status
            self.start_stream(NDJSON)
            if first is not None:
                await self.send(ndjson(first))
                async for st in statuses:
                    if st.get("status") == "success":
                        await self._pulled(req)
                    await self.send(ndjson(st))
        self.end_stream(NDJSON)


class CopyHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        src, dst = oa.parse_copy(self.json_body())
        self.check_write(dst, "copy to")
        await asyncio.to_thread(self.ext.store.copy, src, dst)
        await self.ext.name_changed(dst)
        self.finish_json({"status": "success"})


class PruneHandler(LlamaHandler):
    """``POST api/prune``: drop partial downloads no pull is working on (ours; Ollama prunes at start)."""

    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        self.check_admin("prune the store")
        removed = await asyncio.to_thread(self.ext.store.prune_partials)
        self.finish_json({"removed": removed, "freed": sum(r["bytes"] for r in removed)})


class DeleteHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def delete(self):
        name = oa.parse_delete(self.json_body())
        self.check_write(name, "delete")
        sched = self.ext.scheduler

        async def unload_first(ref) -> None:
            # Its file goes with it: what is loaded from that file goes first. A file another
            # model also names stays, and so does that model's runner; one loaded under this
            # name alone is retired by name_changed, below.
            if sched is not None and not await asyncio.to_thread(self.ext.store.weights_stay, name):
                await sched.unload_file(ref.path, reason=f"model {name} deleted")

        with self.ext.work():
            try:
                removed = await self.ext.store.remove(name, before_remove=unload_first)
            finally:
                await self.ext.name_changed(name)
        self.finish_json({"status": "success", "removed_blobs": [f"sha256:{d}" for d in removed]})


class CreateHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        req = oa.parse_create(self.json_body())
        self.check_write(req.model, "create")
        with self.ext.work():
            await self.cancellable(self._create(req))

    async def _create(self, req: oa.CreateRequest) -> None:
        store = self.ext.store
        statuses: list[dict] = [{"status": "parsing GGUF"}]
        if req.files:
            entry = await asyncio.to_thread(store.create_from_files, req.model, req.files, req.preset)
            statuses += [{"status": f"using existing layer {ly['digest']}"} for ly in entry.layers]
        else:
            src = req.from_ or ""
            if await asyncio.to_thread(store.exists, src):
                statuses.append({"status": f"using existing model {src}"})
                entry = await asyncio.to_thread(store.copy, src, req.model, req.preset)
                statuses += [{"status": f"using layer {ly['digest']}"} for ly in entry.layers]
            else:
                # a path only where this caller may name server files (else a 400 saying so)
                path = store.server_file(src) if plainly_a_path(src) else ""
                if not path or not os.path.isfile(path):
                    raise BadRequest(f'from: "{src}" is neither a model in the store nor a GGUF file on the server')
                entry = await asyncio.to_thread(functools.partial(store.create, req.model, path, preset=req.preset))
        await self.ext.name_changed(req.model)
        statuses += [{"status": note} for note in req.notes]
        statuses += [{"status": "writing manifest"}, {"status": "success", "model": entry.display}]
        if not req.stream:
            self.finish_json(statuses[-1])
            return
        self.start_stream(NDJSON)
        for st in statuses:
            await self.send(ndjson(st))
        self.end_stream(NDJSON)


_ABORT = object()


@web.stream_request_body
class BlobHandler(LlamaHandler):
    """``HEAD|POST api/blobs/sha256:<hex>``: the digest is checked before anything touches disk,
    the body streams to the store (hashed on the way, bounded by ``max_upload_size``)."""

    def initialize(self, name: str, *args, **kwargs) -> None:
        super().initialize(name, *args, **kwargs)
        self._queue: queue.Queue | None = None
        self._receiver: asyncio.Future | None = None
        self._received = 0
        self._work = None
        self._refused: Exception | None = None  # answered once the body is in (see prepare)

    def _digest(self) -> str:
        from ..models.store import normalize_digest

        digest = self.path_kwargs.get("digest", "")
        if not digest.startswith(("sha256:", "sha256-")):
            raise BadRequest(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
        return normalize_digest(digest)

    async def prepare(self):
        await super().prepare()
        if self.request.method != "POST":
            return
        # The body streams in before post() (and its @web.authenticated) would run, so who is
        # sending is checked here, before a byte is accepted: nothing from strangers touches
        # the disk (a made-up _xsrf cookie and header pass the XSRF check, not this).
        if not self._authenticated():
            raise web.HTTPError(403)  # answered as a 401 with a sentence (write_error)
        if not self.authorizer.is_authorized(self, self.current_user, "write", AUTH_RESOURCE):
            raise web.HTTPError(403, "not allowed to upload blobs")
        try:
            who = self.who
            if who is not None and not who.admin and not self.ext.hub.user_models:
                raise Forbidden(f"{who.name} may not upload model files: this service keeps no models of users' own")
            hexd = self._digest()
            limit = self.ext.max_upload_size
            length = self.request.headers.get("Content-Length")
            size = int(length) if length is not None and length.isdigit() else None
            if size is not None and size > limit:
                raise PayloadTooLarge(f"blob of {size:,} bytes is larger than the upload limit of {limit:,} "
                                      "bytes (LlamaExtension.max_upload_size)")
        except Exception as e:  # noqa: BLE001
            await self.fail(e)
            return
        self.request.connection.set_max_body_size(limit)
        if size is not None:
            # One that cannot fit is refused before a byte is written (a 507). The answer waits
            # for the body: answering first and closing the connection (as the 413 above does)
            # resets it under a client still sending, and the client never reads the answer.
            from ..models.store import free_bytes, storage_full

            root = self.ext.store.root
            free = await asyncio.to_thread(free_bytes, root)
            if free is not None and size > free:
                self._refused = storage_full(root, f"the upload of blob sha256:{hexd[:12]}", size, before=True)
                return
        self._work = self.ext.work()
        self._work.__enter__()
        self._queue = queue.Queue(maxsize=64)
        store = self.ext.store
        # the queue is bound now: the receiver first reads it later, in the thread
        self._receiver = asyncio.ensure_future(asyncio.to_thread(self._receive, store, hexd, self._queue, size))
        # an aborted upload's error is nobody's to await: mark it seen
        self._receiver.add_done_callback(lambda f: f.cancelled() or f.exception())

    @staticmethod
    def _receive(store, hexd: str, q: "queue.Queue", size: int | None):
        """``store.receive_blob`` over the queued chunks. When it stops early (the disk filled
        up), the rest of the body is still taken from the queue, and dropped: else the request
        would wait forever to hand over its next chunk, and never be answered (the 507)."""
        ended = False

        def chunks():
            nonlocal ended
            while True:
                item = q.get()
                if item is None or item is _ABORT:
                    ended = True
                    if item is _ABORT:
                        raise ClientGone("upload aborted")
                    return
                yield item

        try:
            return store.receive_blob(hexd, chunks(), size)
        except BaseException:
            while not ended:
                item = q.get()
                ended = item is None or item is _ABORT
            raise

    async def data_received(self, chunk: bytes):
        if self._queue is None:
            return
        self._received += len(chunk)
        try:
            self._queue.put_nowait(chunk)
        except queue.Full:  # back-pressure: the writer thread is behind
            await asyncio.to_thread(self._queue.put, chunk)

    def _end_upload(self, item) -> None:
        if self._queue is not None:
            q, self._queue = self._queue, None
            try:
                q.put_nowait(item)
            except queue.Full:
                # the thread drains the queue; hand over the marker without blocking the loop
                asyncio.get_running_loop().run_in_executor(None, q.put, item)

    def on_connection_close(self) -> None:
        self._end_upload(_ABORT)
        super().on_connection_close()

    def on_finish(self) -> None:
        self._end_upload(_ABORT)
        if self._work is not None:
            self._work.__exit__(None, None, None)
            self._work = None

    @web.authenticated
    @authorized
    @api_method
    async def head(self, digest: str):
        hexd = self._digest()
        present = await asyncio.to_thread(self.ext.store.has_blob, hexd)
        self.set_status(200 if present else 404)
        self.finish()

    @web.authenticated
    @authorized
    @api_method
    async def post(self, digest: str):
        if self._refused is not None:
            raise self._refused
        if self._receiver is None:  # prepare refused it (and answered)
            return
        self._end_upload(None)
        try:
            await self._receiver
        finally:
            self._receiver = None
        self.set_status(201)
        self.finish()


# ============================================================================ OpenAI


class OpenAIHandler(LlamaHandler):
    """OpenAI's routes (and, below, Anthropic's): scheduled, then relayed to the child's own."""

    parse_request = staticmethod(oai.parse_request)
    mend_for = staticmethod(oai.mend_for)  # what the child's answer needs changed on its way (see api.openai.Mend)
    _named = False  # this request's stream is of named events (set once it is parsed)

    def error_payload(self, status: int, message: str) -> dict:
        return oai.error_body(status, message)

    def error_line(self, message: str) -> bytes:
        return oai.stream_error(message, self._named)

    @web.authenticated
    @authorized
    @api_method
    async def post(self, route: str):
        body = self.json_body()
        req = oai.with_sampling_defaults(oai.with_preset(self.parse_request(route, body), await self.preset_of(body)))
        self._named = req.named
        with self.ext.work():
            await self.cancellable(self._run(req))

    async def _run(self, req: oai.OpenAIRequest) -> None:
        lease = await self.acquire(req.model, req.options, req.keep_alive, req.needs)
        try:
            if req.suffix is not None:
                await self._infill(lease, req)
                return
            mend = self.mend_for(req)
            if not req.stream:
                if req.choices > 1:
                    res = await self._several(lease, req)
                else:
                    res = await self._answer(lease, req, req.body)
                if isinstance(res, dict) and "model" in res:
                    res["model"] = req.model  # the name asked for, as OpenAI and Ollama answer
                if mend is not None:
                    mend.answer(res)
                self.count_tokens(res)
                self.finish_json(res)
                return
            self.start_stream(SSE)
            # The child speaks this wire format already: its events go on as it wrote them,
            # framed, never parsed. It names the model by its alias, the name it was loaded
            # under; a request by another name (``tiny`` for ``tiny:latest``, or a copy of the
            # same file) gets its own name back, by a replace of that one JSON string.
            # A stream of named events (Responses, Anthropic) comes with its ``event:`` lines
            # (the relay passes them on) and ends without [DONE]. The child's head (a batch of
            # no events) sends ours, while the child makes its first token. A mend (see
            # api.openai.Mend) sees each event first, and may hold some back to its end.
            write = self.stream_writer()
            head = b"" if req.named else b"data: "
            # spelled as llama-server spells it (UTF-8 as it is, not \u escapes)
            alias = b'"model":' + json.dumps(lease.runner.name, ensure_ascii=False).encode()
            asked = b'"model":' + json.dumps(req.model, ensure_ascii=False).encode()

            def named(d: bytes) -> bytes:
                return d if alias == asked else d.replace(alias, asked, 1)

            if mend is not None:
                def frame(batch):
                    mended = [m for m in map(mend.event, batch) if m is not None]
                    return write(b"".join([head + named(d) + b"\n\n" for d in mended])) if mended or not batch \
                        else None
            elif alias == asked:
                def frame(batch):
                    return write(b"".join([head + d + b"\n\n" for d in batch]))
            else:
                def frame(batch):
                    return write(b"".join([head + d.replace(alias, asked, 1) + b"\n\n" for d in batch]))
            if req.endpoint == "/v1/chat/completions":
                await lease.runner.send_chat(req.body, frame)
            else:
                await lease.runner.relay_sse(req.endpoint, req.body, frame, named=req.named)
            held = b"".join([head + named(d) + b"\n\n" for d in mend.end()]) if mend is not None else b""
            self.end_stream(SSE, held + (b"" if req.named else oai.SSE_DONE))
        finally:
            lease.release()

    async def _answer(self, lease, req: oai.OpenAIRequest, body: dict):
        """The child's answer to ``body`` (not streamed), embeddings cut to ``dimensions``."""
        if req.dimensions:  # the child's vectors as numbers, to cut here and then spell as asked
            body = {k: v for k, v in body.items() if k != "encoding_format"}
        try:  # (a chat longer than the context loses its oldest turns, as on /api/chat)
            res = await (lease.runner.send_chat(body) if req.endpoint == "/v1/chat/completions"
                         else lease.runner.post(req.endpoint, body))
        except RequestError as e:
            if req.endpoint != "/v1/embeddings" or "pooling" not in str(e).lower():
                raise
            return await _openai_embeddings(lease, req)  # the model does not pool: we do
        if req.dimensions and isinstance(res, dict):
            data = sorted(res.get("data") or [], key=lambda d: d.get("index", 0))
            vectors = oai.cut_dimensions([d.get("embedding") or [] for d in data], req.dimensions, req.model)
            res = oai.embeddings_body(req.model, vectors, int((res.get("usage") or {}).get("prompt_tokens") or 0),
                                      oai.encoding_format(req.body))
        return res

    async def _several(self, lease, req: oai.OpenAIRequest) -> dict:
        """An answer of ``n`` > 1 choices, not streamed: asked one at a time, side by side
        (the child's slots share the prompt's cache), and merged. The child's own ``n`` would
        merge them with the usage of one answer alone; OpenAI counts all of them."""
        one = {**req.body, "n": 1}
        try:  # (one that fails stops the others: none goes on once the lease is given back)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._answer(lease, req, one)) for _ in range(req.choices)]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return oai.merged_answers([t.result() for t in tasks])

    async def _infill(self, lease, req: oai.OpenAIRequest) -> None:
        """``/v1/completions`` with ``suffix``: fill in the middle with the child's ``/infill``
        (the model's FIM tokens around the prompt and the suffix), its native events told as
        OpenAI's completion chunks."""
        include_usage = bool((req.body.get("stream_options") or {}).get("include_usage")) \
            if isinstance(req.body.get("stream_options"), dict) else False
        tr = oai.InfillTranslator(req.model, include_usage=include_usage and req.stream)
        body = oai.infill_body(req)
        if not req.stream:
            def gather(batch: list[bytes]) -> None:
                for data in batch:
                    tr.feed(json.loads(data))

            await lease.runner.relay_sse("/infill", body, gather)
            self.finish_json(tr.combined())
            return
        self.start_stream(SSE)
        write = self.stream_writer()

        def send_on(batch: list[bytes]):
            if not batch:
                return write(b"")
            out = b"".join([oai.sse(c) for data in batch for c in tr.feed(json.loads(data))])
            return write(out) if out else None

        await lease.runner.relay_sse("/infill", body, send_on)
        self.end_stream(SSE, oai.SSE_DONE)


async def _openai_embeddings(lease, req: oai.OpenAIRequest) -> dict:
    """OpenAI embeddings for a model that does not pool: the child's per-token vectors, pooled here."""
    inputs, fmt = oai.embedding_inputs(req.body), oai.encoding_format(req.body)
    raw, tokens = await lease.runner.embed(inputs)
    vectors = oai.cut_dimensions(await asyncio.to_thread(oa.unit_vectors, raw), req.dimensions, req.model)
    return oai.embeddings_body(req.model, vectors, tokens, fmt)


class AnthropicHandler(OpenAIHandler):
    """``POST v1/messages`` (and ``v1/messages/count_tokens``): Anthropic's Messages API, relayed
    to the child's own, with Anthropic's error shape."""

    parse_request = staticmethod(anth.parse_request)
    mend_for = staticmethod(anth.mend_for)

    def error_payload(self, status: int, message: str) -> dict:
        return anth.error_body(status, message)

    def error_line(self, message: str) -> bytes:
        return anth.stream_error(message)


class OpenAIModelsHandler(OpenAIHandler):
    counts_as_activity = False
    post = web.RequestHandler.post  # GET only: a POST is a 405 (in OpenAI's error shape), not OpenAIHandler's

    @web.authenticated
    @authorized
    @api_method
    async def get(self, model: str | None = None):
        entries = await asyncio.to_thread(self.ext.store.list)
        body = oai.models_body([e for e in entries if self.visible(e.display)])
        if model is None:
            self.finish_json(body)
            return
        for m in body["data"]:
            if same_model(m["id"], model):
                self.finish_json(m)
                return
        raise ModelNotFound(model)


# ============================================================================ ours


class VersionHandler(LlamaHandler):
    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        eng = self.ext.engine
        self.finish_json({"version": oa.OLLAMA_VERSION, "jupyter_llama": __version__,
                          "engine": eng.version if eng else None,
                          "engine_error": None if eng else self.ext.engine_error})

    async def head(self):  # (as Ollama answers it: some clients probe the server so)
        await self.get()


@functools.lru_cache(maxsize=8)
def openapi_body(base_url: str) -> str:
    """The OpenAPI description shipped beside this module, its server URL set to ``base_url``
    (made once per base URL: the file is 90 KB)."""
    from importlib.resources import files

    spec = json.loads(files(__package__).joinpath("openapi.json").read_text(encoding="utf-8"))
    for server in spec.get("servers", []):
        server.get("variables", {}).get("base_url", {})["default"] = base_url
    return json.dumps(spec)


class OpenAPIHandler(LlamaHandler):
    """``GET api/openapi.json``: the description, its server URL set to this server's base URL."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        self.finish(await asyncio.to_thread(openapi_body, self.base_url))


class RootHandler(LlamaHandler):
    """``GET /llama/`` (and HEAD): a plain sentence that the server runs, to anyone, as
    Ollama's root answers ("Ollama is running"): clients probe it before they send their
    key. It is the one route open without the token, and says nothing else."""

    counts_as_activity = False

    @allow_unauthenticated
    @api_method
    async def get(self):
        self.finish("jupyter-llama is running", set_content_type="text/plain; charset=utf-8")

    @allow_unauthenticated
    @api_method
    async def head(self):
        self.finish(set_content_type="text/plain; charset=utf-8")


class PushHandler(LlamaHandler):
    """``POST api/push``: Ollama's registry upload, which a local manager does not do."""

    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        raise NotSupported("pushing a model to a registry is not supported by jupyter-llama; its models are GGUF "
                           "files in the store (`jupyter-llama show NAME` says where), to copy or upload as you like")


class UnknownRouteHandler(LlamaHandler):
    """Any other path under ``/llama/``: a JSON 404 that names the path, not Jupyter's HTML page."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def prepare_route(self, path: str):
        raise NoSuchRoute(f"no route {self.request.method} /llama/{path} in jupyter-llama; GET /llama/api/version "
                          "answers, and the README lists the routes (Ollama's /api/..., OpenAI's /v1/...)")

    async def get(self, path: str):
        await self.prepare_route(path)

    async def post(self, path: str):
        await self.prepare_route(path)

    async def delete(self, path: str):
        await self.prepare_route(path)

    async def put(self, path: str):
        await self.prepare_route(path)


class MetricsHandler(LlamaHandler):
    """``GET metrics`` (ours): Prometheus's text format (jupyter_llama.hub.metrics). On a manager
    shared through a JupyterHub, for its admins only (the numbers are everyone's): a Prometheus
    scrapes it with an admin's token."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        from ..hub.metrics import CONTENT_TYPE, render, snapshot

        self.check_admin("read the metrics of every user (a Prometheus scrapes them with an admin's token)")
        sched = self.ext.scheduler
        snap = snapshot(sched) if sched is not None else {"models": [], "pending": 0, "evictions": {}, "users": None}
        self.finish(render(snap), set_content_type=CONTENT_TYPE)


class MeHandler(LlamaHandler):
    """``GET api/me`` (ours): who this request is, as this manager sees them. On a manager
    shared through a JupyterHub: their groups, whether they administer it, the namespace of
    their own models, their quota, their requests now and in the last minute, and the models
    their requests loaded. On a single user's manager: ``shared`` false."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        who = self.who
        if who is None:
            self.finish_json({"name": self.current_user.username, "shared": False})
            return
        sched = self.ext.scheduler
        book = sched.users if sched is not None else None
        body = {"name": who.name, "groups": list(who.groups), "admin": who.admin, "shared": True,
                "namespace": self.ext.hub.namespace(who), "user_models": self.ext.hub.user_models,
                "quota": self.ext.hub.who_quota(who).to_dict(),
                "in_flight": book.in_flight.get(who.name, 0) if book else 0,
                "waiting": book.waiting_by_user().get(who.name, 0) if book else 0,
                "requests_last_minute": book.requests_last_minute(who.name) if book else 0,
                "models": sorted(lo.name for lo in sched.live() if lo.loaded_by == who.name) if sched else []}
        self.finish(dumps(body))


class DevicesHandler(LlamaHandler):
    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        from ..memory import devices as devmod

        sched = self.ext.scheduler
        usage: dict[str, int] = {}
        loaded = []
        if sched is None:
            inv = await asyncio.to_thread(devmod.inventory)
        else:
            inv = await sched.inventory()  # under the scheduler's budgets
            usage = sched.usage()
            loaded = [{"name": lo.name, "state": lo.state, "source": lo.charge.source,
                       "by_device": lo.charge.by_device()} | self.people(lo) for lo in sched.live()
                      if self.visible(lo.name)]
        body = inv.to_dict()
        if sched is not None:  # what a new model may still use on each device: the scheduler's own figure
            room = sched.available(inv, usage)
            for d in body.get("devices", []):
                d["available"] = room.get(d["id"], (None, None))[0]
        body["usage"] = usage
        body["loaded"] = loaded
        body["text"] = devmod.format_inventory(inv)
        self.finish(dumps(body))


class LogHandler(LlamaHandler):
    """A loaded model's llama-server log: what llama.cpp said about devices, layers and memory."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        model = self.get_argument("model", "").strip()
        if not model:
            raise BadRequest("say which model's log to show: ?model=NAME (ps lists the loaded ones)")
        self.check_visible(model)
        try:
            lines = int(self.get_argument("lines", "200") or 200)
        except ValueError:
            raise BadRequest("lines must be a whole number") from None
        sched = self.ext.scheduler
        lo = await sched.find_loaded(model) if sched is not None else None
        # (else a load that failed: what its child said is what the user needs now)
        failed = await sched.find_failed(model) if lo is None and sched is not None else None
        if lo is None and failed is None:
            raise NotLoaded(model)
        out = (lo or failed).log(lines, self.get_argument("match", None) or None)
        if failed is not None:
            out["state"] = "its load failed"
        self.finish(dumps(out))


class EstimateHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        body = self.json_body()
        name = oa.model_name(body)
        opts = split_options(body.get("options")).load_options()
        from ..memory import estimate as est
        from ..memory.sources import estimate_all_async

        sched = self.ext.scheduler
        if sched is not None:
            res = await sched.estimate(name, opts, engine=self.ext.engine)
        else:  # no engine yet: predictions still answer "would it fit here?"
            from ..memory import devices as devmod

            ref = await self.ext.store.resolve(name)
            inv = await asyncio.to_thread(devmod.inventory)
            estimates = await estimate_all_async(ref.info, opts, [d.id for d in inv.accelerators()])
            res = {"options": opts, "estimates": estimates, "actual": None, "loaded": None, "same_options": False,
                   "fit": None}
        lo, actual = res["loaded"], res["actual"]
        out: dict[str, Any] = {
            "model": name, "options": res["options"].to_dict(),
            "estimates": {k: v.to_dict() for k, v in res["estimates"].items()},
            "loaded": None if lo is None else {
                "name": lo.name, "options": lo.options.to_dict(), "fit_source": lo.fit_source,
                "same_options": res["same_options"],
                "predictions": {k: v.to_dict() for k, v in lo.predictions.items()}},
            "actual": actual.to_dict() if actual else None,
            "fit": res["fit"].to_dict() if res["fit"] is not None else None,
            "table": est.format_estimates(res["estimates"], actual),
        }
        self.finish(dumps(out))


class EventsHandler(LlamaHandler):
    counts_as_activity = False  # a live event feed is watching, not working

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        model = self.get_argument("model", None) or None
        try:
            since = int(self.get_argument("since", "0") or 0)
            limit = int(self.get_argument("limit", "1000") or 1000)
        except ValueError:
            raise BadRequest("since and limit must be whole numbers") from None
        stream = self.get_argument("stream", "0").lower() in ("1", "true", "yes")
        if model:
            self.check_visible(model)
        sched = self.ext.scheduler
        if not stream:
            events = sched.events.recent(model, limit, since) if sched is not None else []
            shown = [d for d in map(self.event_for, events) if d is not None]
            self.finish(dumps({"events": shown}))
            return
        sched = await self.ext.get_scheduler()
        await self.cancellable(self._follow(sched, model, since, limit))

    async def _follow(self, sched, model, since, limit) -> None:
        with sched.events.listen() as sub:  # listening before reading history: nothing falls between
            self.start_stream(NDJSON)
            last = since
            for e in sched.events.recent(model, limit, since):
                d = self.event_for(e)
                if d is not None:
                    await self.send(ndjson(_finite(d)))
                last = e.seq
            await self.send(b"")  # headers out now, even with no history
            while True:
                e = await sub.get()
                if e.seq <= last or not e.concerns(model):
                    continue
                last = e.seq
                d = self.event_for(e)
                if d is not None:
                    await self.send(ndjson(_finite(d)))


# ============================================================================ routes


def default_handlers() -> list[tuple]:
    p = "/llama"
    return [
        (p + r"/?", RootHandler),
        (p + r"/api/generate", GenerateHandler),
        (p + r"/api/chat", ChatHandler),
        (p + r"/api/embed", EmbedHandler),
        (p + r"/api/embeddings", EmbeddingsHandler),
        (p + r"/api/ps", PsHandler),
        (p + r"/api/tags", TagsHandler),
        (p + r"/api/show", ShowHandler),
        (p + r"/api/pull", PullHandler),
        (p + r"/api/copy", CopyHandler),
        (p + r"/api/delete", DeleteHandler),
        (p + r"/api/prune", PruneHandler),
        (p + r"/api/create", CreateHandler),
        (p + r"/api/blobs/(?P<digest>[^/]+)", BlobHandler),
        (p + r"/api/version", VersionHandler),
        (p + r"/api/me", MeHandler),
        (p + r"/metrics", MetricsHandler),
        (p + r"/api/devices", DevicesHandler),
        (p + r"/api/estimate", EstimateHandler),
        (p + r"/api/log", LogHandler),
        (p + r"/api/events", EventsHandler),
        (p + r"/api/openapi\.json", OpenAPIHandler),
        (p + r"/v1/models", OpenAIModelsHandler),
        (p + r"/v1/models/(?P<model>.+)", OpenAIModelsHandler),
        (p + r"/v1/(?P<route>chat/completions|completions|embeddings|responses|responses/input_tokens)",
         OpenAIHandler),
        (p + r"/v1/(?P<route>messages|messages/count_tokens)", AnthropicHandler),
        (p + r"/api/push", PushHandler),
        (p + r"/(?P<path>.+)", UnknownRouteHandler),  # last: anything else is a JSON 404
    ]
