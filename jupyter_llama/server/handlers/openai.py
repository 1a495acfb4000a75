"""OpenAI's routes under ``<base_url>llama/``: scheduled, then relayed to the child's own.

    POST   v1/chat/completions  v1/completions  v1/embeddings     (SSE when streaming)
    POST   v1/responses                                           (OpenAI Responses; named SSE events)
    POST   v1/responses/input_tokens                              (what a Responses input counts)
    GET    v1/models  v1/models/<name>

Errors are in OpenAI's shape, ``{"error": {"message": ...}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from jupyter_server.auth.decorator import authorized
from tornado import web

from ...api import ollama as oa
from ...api import openai as oai
from ...engine.runner import RequestError
from ...models.names import same_model
from ...scheduler import ModelNotFound
from .base import SSE, LlamaHandler, api_method


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
            sink = frame
            if self.ext.scheduler is not None and self.ext.scheduler.users is not None:
                # A shared manager's /metrics count the tokens of streamed answers too: the
                # child's last event carries its timings, found on its way (a bytes search an
                # event, a parse of that one).
                def sink(batch):
                    for d in batch:
                        if b'"timings"' in d:
                            with contextlib.suppress(ValueError):
                                self.count_tokens(json.loads(d))
                    return frame(batch)

            if req.endpoint == "/v1/chat/completions":
                await lease.runner.send_chat(req.body, sink)
            else:
                await lease.runner.relay_sse(req.endpoint, req.body, sink, named=req.named)
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


class OpenAIModelsHandler(OpenAIHandler):
    counts_as_activity = False
    post = web.RequestHandler.post  # GET only: a POST is a 405 (in OpenAI's error shape), not OpenAIHandler's

    @web.authenticated
    @authorized
    @api_method
    async def get(self, model: str | None = None):
        entries = await asyncio.to_thread(self.store.list)
        body = oai.models_body([e for e in entries if self.visible(e.display)])
        if model is None:
            self.finish_json(body)
            return
        for m in body["data"]:
            if same_model(m["id"], model):
                self.finish_json(m)
                return
        raise ModelNotFound(model)
