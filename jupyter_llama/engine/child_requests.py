"""Requests to a llama-server child: answered whole (JSON), streamed as server-sent events
(each event's JSON object, or relayed as the child wrote it), and what a broken connection
means (the child died: :class:`~.runner_state.RunnerCrashed`, retryable when nothing of the
answer had gone to the caller; else a failed request).

:class:`ChildRequests` is a part of :class:`~.runner.Runner`: the process it talks to, and the
watch for a child that stops answering (``_watched``), are the runner's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, overload

from ..errors import EngineError
from ..load_options import LoadOptions
from ..procs import exit_words
from . import http1
from .http1 import BadResponse, sse_events
from .logparse import LogParser
from .process import ChildProcess
from .runner_state import CRASH_MESSAGE, RunnerCrashed, RunnerState

# how a child's connection fails when the child does (it crashed, was killed, hung up)
_TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, BadResponse)


class ChildRequests:
    """The requests of a runner to its child (a part of :class:`~.runner.Runner`, which sets
    the attributes below and keeps the process they go to)."""

    name: str
    options: LoadOptions
    parser: LogParser
    proc: ChildProcess | None
    api_key: str
    state: RunnerState
    returncode: int | None
    _exited: asyncio.Event  # set once the child's exit was read
    _lost_workers: list[str] | None

    if TYPE_CHECKING:  # the runner's side of the process (see Runner)
        @property
        def alive(self) -> bool: ...

        @property
        def _child_port(self) -> int: ...

        async def _watched(self, coro: Any, last: list[float] | None = None) -> Any: ...

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def lost_workers(self) -> list[str]:
        """The RPC workers of this child that no longer accept connections (asked once, after
        the child died: llama.cpp's abort says only that *a* remote RPC server failed)."""
        if self._lost_workers is None:
            from ..memory.rpc import listening

            eps = list(self.options.rpc or ())
            alive = await asyncio.gather(*(asyncio.to_thread(listening, ep, 1.0) for ep in eps))
            self._lost_workers = [ep for ep, up in zip(eps, alive, strict=True) if not up]
        return self._lost_workers

    def _crash_error(self, retryable: bool = False) -> RunnerCrashed:
        code = self.returncode if self.returncode is not None else (self.proc.returncode if self.proc else None)
        tail = self.parser.last_error_lines(5)
        detail = f" ({exit_words(code)})" if code is not None else ""
        if self._lost_workers:
            detail += f"; RPC worker {', '.join(self._lost_workers)} went away (connection refused)"
        if tail:
            detail += "; last log lines: " + " | ".join(tail)
        return RunnerCrashed(f"{CRASH_MESSAGE}{detail}", retryable=retryable)

    async def _after_transport_error(self, exc: Exception, answered: bool = True) -> EngineError:
        """The error for a request whose connection to the child failed: RunnerCrashed when
        the child is dead (``retryable`` when nothing of the answer had gone to the caller,
        ``answered`` False), else an EngineError that says how the request failed."""
        # Give the reader a moment to notice the exit, so the message carries the exit code.
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._exited.wait()), 0.5)
            except asyncio.TimeoutError:
                pass
        if not self.alive:
            self.state = RunnerState.FAILED if self.state != RunnerState.STOPPING else self.state
            if self.options.rpc:
                await self.lost_workers()
            return self._crash_error(retryable=not answered)
        return EngineError(f"request to llama-server for {self.name} failed: {str(exc) or type(exc).__name__}")

    def _check_ready(self) -> None:
        if self.state != RunnerState.READY or not self.alive:
            if self.proc is not None and not self.alive and self.state != RunnerState.STOPPED:
                raise self._crash_error(retryable=True)  # dead before this request sent anything
            raise EngineError(f"runner for {self.name} is not ready ({self.state})")

    async def post(self, path: str, payload: dict) -> Any:
        """A request that is answered whole (an embedding, a template applied, a chat not
        streamed); returns its decoded JSON body. Watched as a stream is (see :meth:`_watched`),
        with no progress to see: /health decides after STALL_CHECK_S."""
        return await self._json(path, payload)

    async def get(self, path: str) -> Any:
        return await self._json(path, None)

    async def _json(self, path: str, payload) -> Any:
        """POST ``payload`` (None: a GET) on a fresh connection of our own HTTP/1.1 (see
        :mod:`.http1`): no client library between, whose layers cost about as much CPU again as
        the request itself, and a request before the first token (the template applied to a
        generate's prompt) waits for all of it. A status of 400 or more is the child's
        RequestError; a broken connection says whether the child is gone."""
        self._check_ready()
        try:
            return await self._watched(http1.request_json(self._child_port, path, self._windows(payload),
                                                          self._headers()))
        except _TRANSPORT_ERRORS as e:  # (answered whole or not at all: nothing went to the caller)
            raise await self._after_transport_error(e, answered=False) from None
        except ValueError as e:  # not the JSON llama-server answers with
            raise EngineError(f"llama-server for {self.name} answered {path} with something that is not JSON "
                              f"({e})") from None

    def stream_sse(self, path: str, payload: dict) -> AsyncGenerator[dict, None]:
        """POST with ``stream: true``; yield each server-sent event's JSON object.

        Closing the iterator (or cancelling its consumer) closes the connection, which
        makes llama-server stop generating for it. This path carries every token a user
        receives, so it talks HTTP/1.1 to the child over a plain asyncio protocol (see
        :mod:`.http1`) rather than through a client library: the child is ours, on loopback,
        and answers a streamed request with chunked SSE, and per token httpx's layers cost
        more CPU than the rest of the relay together (bench/api_overhead.py; the CPU it takes
        is taken from the child, which uses every core).
        """
        return self._guarded(path, self._windows(payload))

    @overload
    def _windows(self, payload: dict) -> dict: ...

    @overload
    def _windows(self, payload: None) -> None: ...

    def _windows(self, payload: dict | None) -> dict | None:
        """``payload`` with a penalty window of -1 (Ollama's "the whole context", for
        ``repeat_last_n``; llama.cpp's, for ``dry_penalty_last_n``) made this child's context
        per request, which llama-server takes where it refuses -1 (while that is not known,
        left to llama-server's default: 0 would turn the penalty off)."""
        if payload is None or (payload.get("repeat_last_n") != -1 and payload.get("dry_penalty_last_n") != -1):
            return payload
        n_ctx = self._request_ctx()
        windows = ("repeat_last_n", "dry_penalty_last_n")
        if not n_ctx:
            return {k: v for k, v in payload.items() if not (k in windows and v == -1)}
        return {**payload, **{k: n_ctx for k in windows if payload.get(k) == -1}}

    async def _guarded(self, path: str, payload: dict) -> AsyncGenerator[dict, None]:
        """:func:`.http1.sse_events`, once the child is known to be ready; a broken connection
        says whether the child is gone."""
        self._check_ready()
        events = sse_events(self._child_port, path, payload, self.api_key)
        answered = False
        try:  # closing this iterator closes the child's connection at once, not at garbage collection
            async with contextlib.aclosing(events) as evs:
                async for event in evs:
                    answered = True
                    yield event
        except _TRANSPORT_ERRORS as e:
            raise await self._after_transport_error(e, answered) from None

    async def relay_sse(self, path: str, payload: dict, on_data, named: bool = False) -> None:
        """POST with ``stream: true``; each batch of events' data (JSON bytes, as the child
        wrote them) goes to ``on_data`` from the event loop's read callback, with no task
        switch per token (see :mod:`.http1`; a pending future it returns pauses reading).
        ``named``: a stream of named events (Responses, Anthropic Messages), each passed on
        with its ``event:`` line (see :func:`.http1.sse_sink`). Returns when the stream
        ends; cancelling it closes the child's connection."""
        self._check_ready()
        loop = asyncio.get_running_loop()
        last = [loop.time()]
        answered = [False]  # on_data was given something (even the head, an empty batch)

        def progressing(batch):
            last[0] = loop.time()
            answered[0] = True
            return on_data(batch)

        try:
            await self._watched(http1.relay_sse(self._child_port, path, self._windows(payload), self.api_key,
                                                progressing, named), last)
        except _TRANSPORT_ERRORS as e:
            raise await self._after_transport_error(e, answered[0]) from None

    def _request_ctx(self) -> int | None:
        """The context one request may use (from the log once the child has said it)."""
        return self.parser.n_ctx_seq or self.parser.n_ctx or self.options.num_ctx

    def completion(self, prompt: str | list, **params) -> AsyncGenerator[dict, None]:
        """Stream llama-server's native ``/completion`` chunks (``content``, ``stop``, ``timings``); the
        prompt is text, or token ids (a prompt cut to the context), or ids then a text (see
        :meth:`fit_to_context`)."""
        return self.stream_sse("/completion", {"prompt": prompt, **params})

    def chat(self, messages: list[dict], **params) -> AsyncGenerator[dict, None]:
        """Stream OpenAI-style ``/v1/chat/completions`` chunks."""
        return self.stream_sse("/v1/chat/completions", {"messages": messages, **params})

    def relay_completion(self, prompt: str | list, on_data, **params) -> Awaitable[None]:
        """:meth:`completion` through :meth:`relay_sse`: its events' JSON to ``on_data``."""
        return self.relay_sse("/completion", {"prompt": prompt, **params}, on_data)

    def relay_infill(self, prefix: str, suffix: str, on_data, **params) -> Awaitable[None]:
        """Fill in the middle (llama-server's ``/infill``, with the model's FIM tokens): native
        ``/completion`` events, as :meth:`relay_completion`."""
        return self.relay_sse("/infill", {"input_prefix": prefix, "input_suffix": suffix, **params}, on_data)

    async def complete_text(self, prompt: str, **params) -> tuple[str, dict]:
        """Convenience: the whole completion text and the final chunk's timings."""
        parts, timings = [], {}
        async for chunk in self.completion(prompt, **params):
            parts.append(chunk.get("content", ""))
            if chunk.get("stop"):
                timings = chunk.get("timings", {})
        return "".join(parts), timings
