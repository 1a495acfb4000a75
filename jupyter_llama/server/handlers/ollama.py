"""Ollama's routes under ``<base_url>llama/``: ``api/*`` as Ollama answers them.

    POST   api/generate  api/chat        NDJSON stream (``stream: false``: one object)
    POST   api/embed  api/embeddings
    GET    api/ps  api/tags  api/version
    POST   api/show  api/pull  api/copy  api/create
    DELETE api/delete
    POST   api/push                      501: not supported
    GET    (the root)                    "jupyter-llama is running", to anyone

Model files uploaded by digest (``api/blobs``) are in :mod:`.blobs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..._version import __version__
from ...api import ollama as oa
from ...api.ollama import ndjson
from ...engine.runner import EngineError, RequestError, reserve_for
from ...errors import Forbidden, NotSupported
from ...models.gguf_info import read_arrays, read_gguf_info
from ...models.names import plainly_a_path
from ...models.pull import PullError, derive_name, pull_stream
from ...scheduler import BadRequest
from .base import NDJSON, LlamaHandler, allow_unauthenticated, api_method, closing, dumps


class GenerationHandler(LlamaHandler):
    """The base of ``api/generate`` and ``api/chat``: a child's stream, told as Ollama's chunks."""

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


class GenerateHandler(GenerationHandler):
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


class ChatHandler(GenerationHandler):
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
            tr: oa.TemplatedChatTranslator | oa.ChatTranslator
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
        entries = await asyncio.to_thread(self.store.list)
        self.finish(dumps(oa.tags_body([e for e in entries if self.visible(e.display)])))

    async def head(self):  # (as Ollama answers it: some clients probe the server so)
        await self.get()


class ShowHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        name, verbose = oa.parse_show(self.json_body())
        data = await asyncio.to_thread(self.store.show, name)
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
        gen = pull_stream(req.source, req.name, store=self.store, insecure=req.insecure)
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
        await asyncio.to_thread(self.store.copy, src, dst)
        await self.ext.name_changed(dst)
        self.finish_json({"status": "success"})


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
            if sched is not None and not await asyncio.to_thread(self.store.weights_stay, name):
                await sched.unload_file(ref.path, reason=f"model {name} deleted")

        with self.ext.work():
            try:
                removed = await self.store.remove(name, before_remove=unload_first)
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
        store = self.store
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


class PushHandler(LlamaHandler):
    """``POST api/push``: Ollama's registry upload, which a local manager does not do."""

    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        raise NotSupported("pushing a model to a registry is not supported by jupyter-llama; its models are GGUF "
                           "files in the store (`jupyter-llama show NAME` says where), to copy or upload as you like")


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
