"""Ollama's streamed answers: the chunks of ``/api/generate`` and ``/api/chat`` (``model``,
``created_at`` in RFC 3339, ``response`` or ``message``, ``done``; the last chunk adds
``done_reason`` and the durations in nanoseconds, taken from llama-server's ``timings``),
written as NDJSON lines.

The translators turn llama-server's streamed events into those chunks:
:class:`GenerateTranslator` (native ``/completion`` events) and :class:`ChatTranslator`
(OpenAI-style ``/v1/chat/completions`` events, where llama-server applies the model's
chat template). A generate answer that is not raw goes through
:class:`ContextGenerateTranslator`, the first of them keeping the answer's token ids for
the last chunk's ``context`` (Ollama's); :class:`TemplatedChatTranslator` answers a chat
whose prompt a preset's template rendered, and :class:`ThinkingGenerateTranslator` a
generate with ``think``.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Callable

_SECOND: tuple[int, str] = (-1, "")  # the last whole second formatted, shared by every stream


def rfc3339(t: float | None = None) -> str:
    """RFC 3339 time in UTC with microseconds (``2026-01-02T03:04:05.123456+00:00``).

    Every streamed chunk carries one, so the date and time of day are formatted once per
    second and only the microseconds per call."""
    global _SECOND
    t = time.time() if t is None else t
    sec = math.floor(t)
    cached_sec, text = _SECOND
    if sec != cached_sec:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _SECOND = (sec, text)
    micros = min(int((t - sec) * 1_000_000), 999_999)
    return f"{text}.{micros:06d}+00:00"


def stats_from_timings(timings: dict | None, total_s: float, load_s: float) -> dict:
    """Ollama's counts and durations (ns) from llama-server's ``timings`` and our clocks."""
    t = timings or {}
    out = {
        "total_duration": int(total_s * 1e9),
        "load_duration": int(load_s * 1e9),
    }
    if "prompt_n" in t:
        # the whole prompt, as Ollama counts it: llama-server's prompt_n leaves out the tokens
        # it found in its prompt cache (the same request twice reported 10, then 1)
        out["prompt_eval_count"] = int(t.get("prompt_n") or 0) + int(t.get("cache_n") or 0)
        out["prompt_eval_duration"] = int(float(t.get("prompt_ms") or 0) * 1e6)
    if "predicted_n" in t:
        out["eval_count"] = int(t.get("predicted_n") or 0)
        out["eval_duration"] = int(float(t.get("predicted_ms") or 0) * 1e6)
    return out


def load_chunk(model: str, reason: str, chat: bool, total_s: float = 0.0, load_s: float = 0.0) -> dict:
    """The one chunk an empty request answers with: done_reason "load" or "unload"."""
    d: dict[str, Any] = {"model": model, "created_at": rfc3339()}
    if chat:
        d["message"] = {"role": "assistant", "content": ""}
    else:
        d["response"] = ""
    d.update(done=True, done_reason=reason, total_duration=int(total_s * 1e9), load_duration=int(load_s * 1e9))
    return d


def error_chunk(message: str) -> dict:
    return {"error": message}


def ndjson(obj) -> bytes:
    """One NDJSON line (Ollama's streaming format)."""
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


# The child's most common events, one token of text and nothing else, as it writes them; the
# JSON string of the text (group 1) is carried into our line unparsed, and for /completion the
# token ids after it (group 2, for the answers that carry ``context``). Anything else (the last
# event, tool calls, thinking, another build's key order) takes feed().
_JSON_STRING = rb'("(?:[^"\\]|\\.)*")'
_COMPLETION_TEXT = re.compile(rb'\{"index":\d+,"content":' + _JSON_STRING + rb',"tokens":\[([\d,]*)\],"stop":false,')
_CHAT_TEXT = re.compile(rb'\{"choices":\[\{"finish_reason":null,"index":0,"delta":\{"content":' + _JSON_STRING
                        + rb'\}\}\]')


def _token_logprobs(entries, top: int) -> list[dict]:
    """llama-server's probabilities of the tokens of one event (a ``/completion`` event's
    ``completion_probabilities``, a chat event's ``logprobs.content``) in Ollama's shape: each
    token's text, log probability and bytes, with the ``top`` likeliest tokens at its
    position as ``top_logprobs`` (left out for 0: the chosen token's alone)."""
    def one(e: dict) -> dict:
        d = {"token": e.get("token", ""), "logprob": e.get("logprob", 0.0)}
        if e.get("bytes") is not None:
            d["bytes"] = e["bytes"]
        return d

    out = []
    for e in entries or []:
        d = one(e)
        if top:
            d["top_logprobs"] = [one(t) for t in (e.get("top_logprobs") or [])[:top]]
        out.append(d)
    return out


class _Lines:
    """What both translators share: ``lines(data)``, the NDJSON bytes for one child event as
    the child wrote it, for streaming. A text-only event's line is written from a template
    (no parse, no dict, no re-encoding: the relay's cost per token); every other event goes
    through ``feed``, so the two can only differ in how the same JSON is spelled. Streamed
    text is not kept (``combined`` is for answers that are not streamed).

    With log probabilities asked for (``top``, see ``requests._logprobs``), every event goes
    through ``feed``: a text event then carries them after its text, which the template
    would leave out. Each chunk has its tokens' ``logprobs``; ``combined`` all of them."""

    model: str  # the model's name as the client asked for it (every chunk carries it)
    top: int | None = None  # logprobs asked: how many of the likeliest tokens come with each; None: not asked

    _text_event: re.Pattern  # a text-only event (_COMPLETION_TEXT, _CHAT_TEXT), its text's JSON string in group 1
    _text_key: bytes  # our line between the time stamp and that string
    _text_tail: bytes  # and after it
    feed: Callable[[dict], list[dict]]  # each translator's own

    def _template(self) -> None:
        self._head = b'{"model":' + json.dumps(self.model).encode() + b',"created_at":"'

    hold_final = False  # streamed, the last chunk is left out of ``lines`` (its caller completes and sends it)
    final: dict | None = None  # the last chunk, once the child's last event has been fed

    def _text(self, m: re.Match) -> None:
        """A text-only event as its line is written (for a translator that keeps something of it)."""

    def _want_logprobs(self, top: int | None) -> None:
        self.top = top
        self.logprobs: list[dict] = []  # every token's, for the answer that is not streamed

    def _with_logprobs(self, chunk: dict, entries) -> dict:
        if self.top is not None:
            chunk["logprobs"] = lp = _token_logprobs(entries, self.top)
            self.logprobs += lp
        return chunk

    def lines(self, data: bytes) -> bytes:
        m = self._text_event.match(data) if self.top is None else None
        if m is not None and m.group(1) != b'""':
            self._text(m)
            return self._head + rfc3339().encode() + self._text_key + m.group(1) + self._text_tail
        out = b"".join([ndjson(c) for c in self.feed(json.loads(data)) if not (self.hold_final and c is self.final)])
        if self.top is not None:
            self.logprobs.clear()  # (streamed, each chunk carries its own: none are kept for a whole answer)
        return out


class GenerateTranslator(_Lines):
    """llama-server ``/completion`` events -> Ollama ``/api/generate`` chunks."""

    _text_event = _COMPLETION_TEXT
    _text_key = b'","response":'
    _text_tail = b',"done":false}\n'

    def __init__(self, model: str, started: float, load_s: float, *, logprobs: int | None = None):
        self.model = model
        self.started = started
        self.load_s = load_s
        self.parts: list[str] = []
        self.final: dict | None = None
        self._want_logprobs(logprobs)
        self._template()

    def chunk(self, text: str) -> dict:
        return {"model": self.model, "created_at": rfc3339(), "response": text, "done": False}

    def feed(self, event: dict) -> list[dict]:
        """Ollama chunks for one event (none, one, or a text chunk then the final one)."""
        out = []
        text = event.get("content") or ""
        if text:
            self.parts.append(text)
            out.append(self._with_logprobs(self.chunk(text), event.get("completion_probabilities")))
        if event.get("stop"):
            reason = "length" if event.get("stop_type") == "limit" else "stop"
            self.final = {"model": self.model, "created_at": rfc3339(), "response": "", "done": True,
                          "done_reason": reason,
                          **stats_from_timings(event.get("timings"), time.monotonic() - self.started, self.load_s)}
            out.append(self.final)
        return out

    def combined(self) -> dict:
        """The single object of ``stream: false``."""
        d = dict(self.final or {"model": self.model, "created_at": rfc3339(), "done": True, "done_reason": "stop"})
        d["response"] = "".join(self.parts)
        if self.top is not None:
            d["logprobs"] = self.logprobs
        return d


class ContextGenerateTranslator(GenerateTranslator):
    """:class:`GenerateTranslator` for an answer whose last chunk carries ``context`` (the
    conversation's token ids: the prompt's, then the answer's). The child's events carry each
    generated token's ids; this keeps them as they pass (a text event's from the bytes, as
    its line is written). Streamed, the last chunk is held back (``lines`` leaves it out):
    its ``context`` needs the prompt's ids, which are counted while the answer is made, so
    the handler completes it and sends it once the relay has ended (``final``)."""

    hold_final = True

    def __init__(self, model: str, started: float, load_s: float, *, logprobs: int | None = None):
        super().__init__(model, started, load_s, logprobs=logprobs)
        self._seen: list = []  # per event, in order: a text event's match, or the event
        self.stop_type: str | None = None

    def _text(self, m: re.Match) -> None:
        self._seen.append(m)

    def feed(self, event: dict) -> list[dict]:
        self._seen.append(event)
        if event.get("stop"):
            self.stop_type = event.get("stop_type")
        return super().feed(event)

    def answer(self) -> tuple[list[int] | None, str]:
        """(the answer's token ids, or None where the events do not show them all; its text).

        The child sends no event for a token that ends mid-way through a UTF-8 character (its
        ids never show; the count falls short of ``eval_count``), and an answer cut at a stop
        word leaves out text its ids may spell: then the text is what to tokenize, as Ollama
        tokenizes it. A token the model ended on (its end-of-turn) is among the ids: the
        next turn's prompt follows it, as in the child's own cache."""
        ids_json: list[bytes] = []  # each event's ids and text as JSON, decoded in one go at the end
        text_json: list[bytes] = []
        for x in self._seen:
            if isinstance(x, dict):
                ids_json.append(json.dumps(x.get("tokens") or [])[1:-1].encode())
                text_json.append(json.dumps(x.get("content") or "").encode())
            else:
                ids_json.append(x.group(2))
                text_json.append(x.group(1))
        ids: list[int] = json.loads(b"[" + b",".join([i for i in ids_json if i]) + b"]")
        text: list[str] = json.loads(b"[" + b",".join(text_json) + b"]")
        complete = self.final is not None and self.stop_type != "word" and len(ids) == self.final.get(
            "eval_count", len(ids))
        return (ids if complete else None), "".join(text)


class TemplatedChatTranslator(GenerateTranslator):
    """llama-server ``/completion`` events -> Ollama ``/api/chat`` chunks: a chat whose prompt
    was rendered with the model's preset template (see :mod:`.requests`)."""

    _text_key = b'","message":{"role":"assistant","content":'
    _text_tail = b'},"done":false}\n'

    @staticmethod
    def _as_chat(d: dict) -> dict:
        out = {k: v for k, v in d.items() if k != "response"}
        out["message"] = {"role": "assistant", "content": d.get("response", "")}
        return out

    def chunk(self, text: str) -> dict:
        return self._as_chat(super().chunk(text))

    def feed(self, event: dict) -> list[dict]:
        return [c if "message" in c else self._as_chat(c) for c in super().feed(event)]

    def combined(self) -> dict:
        return self._as_chat(super().combined())


class ThinkingGenerateTranslator(_Lines):
    """llama-server ``/v1/chat/completions`` events -> Ollama ``/api/generate`` chunks, for a
    generate with ``think``: ``response`` and ``thinking`` apart, as Ollama answers it."""

    _text_event = _CHAT_TEXT
    _text_key = b'","response":'
    _text_tail = b',"done":false}\n'

    def __init__(self, model: str, started: float, load_s: float, *, logprobs: int | None = None):
        self.model = model
        self.chat = ChatTranslator(model, started, load_s, logprobs=logprobs)
        self.top, self.logprobs = logprobs, self.chat.logprobs  # (the chat's: it collects them)
        self._template()

    @staticmethod
    def _as_generate(d: dict) -> dict:
        msg = d.get("message") or {}
        out = {"model": d.get("model"), "created_at": d.get("created_at"), "response": msg.get("content", "")}
        if msg.get("thinking"):
            out["thinking"] = msg["thinking"]
        out.update((k, v) for k, v in d.items() if k not in ("model", "created_at", "message"))
        return out

    def feed(self, event: dict) -> list[dict]:
        out = [self._as_generate(c) for c in self.chat.feed(event)]
        self.final = self.chat.final  # (the chat's last chunk, once it has come: only feed sets it)
        return out

    def combined(self) -> dict:
        return self._as_generate(self.chat.combined())


class ChatTranslator(_Lines):
    """llama-server ``/v1/chat/completions`` stream events -> Ollama ``/api/chat`` chunks."""

    _text_event = _CHAT_TEXT
    _text_key = b'","message":{"role":"assistant","content":'
    _text_tail = b'},"done":false}\n'

    def __init__(self, model: str, started: float, load_s: float, *, logprobs: int | None = None):
        self.model = model
        self.started = started
        self.load_s = load_s
        self.parts: list[str] = []
        self.thinking: list[str] = []
        self.tool_calls: dict[int, dict] = {}
        self.calls: list[dict] = []  # the tool calls, parsed once the child's answer ended
        self.final: dict | None = None
        self._want_logprobs(logprobs)
        self._template()

    def chunk(self, text: str, thinking: str = "") -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        return {"model": self.model, "created_at": rfc3339(), "message": msg, "done": False}

    def _calls(self) -> list[dict]:
        """The tool calls in Ollama's shape (``arguments`` an object). A call whose arguments
        are not a JSON object was cut short (the length limit ended it mid-call) and is left
        out: Ollama's clients read ``arguments`` as an object."""
        out = []
        for _, c in sorted(self.tool_calls.items()):
            try:
                args = json.loads(c["arguments"]) if c["arguments"] else {}
            except ValueError:
                continue
            if not isinstance(args, dict):
                continue
            call: dict[str, Any] = {"function": {"name": c["name"], "arguments": args}}
            if c["id"]:
                call["id"] = c["id"]
            out.append(call)
        return out

    def feed(self, event: dict) -> list[dict]:
        out = []
        choices = event.get("choices") or []
        ch = choices[0] if choices else {}
        delta = ch.get("delta") or ch.get("message") or {}
        text = delta.get("content") or ""
        think = delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or []:
            idx = tc.get("index", len(self.tool_calls))
            slot = self.tool_calls.setdefault(idx, {"id": "", "name": "", "arguments": ""})
            if tc.get("id"):
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["name"] += fn["name"]
            if fn.get("arguments"):
                args = fn["arguments"]
                slot["arguments"] += args if isinstance(args, str) else json.dumps(args)
        if text or think:
            self.parts.append(text)
            self.thinking.append(think)
            out.append(self._with_logprobs(self.chunk(text, think), (ch.get("logprobs") or {}).get("content")))
        finish = ch.get("finish_reason")
        if finish:
            calls = self._calls()
            if calls:  # the parsed calls, once complete: in a chunk before the last, as Ollama sends them
                self.calls = calls
                out.append({"model": self.model, "created_at": rfc3339(),
                            "message": {"role": "assistant", "content": "", "tool_calls": calls}, "done": False})
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            self.final = {"model": self.model, "created_at": rfc3339(), "message": msg, "done": True,
                          "done_reason": "length" if finish == "length" else "stop",
                          **stats_from_timings(event.get("timings"), time.monotonic() - self.started, self.load_s)}
            # llama-server sends timings on the last chunk; if they come later, update() adds them
            out.append(self.final)
        elif event.get("timings") and self.final is not None:
            self.final.update(stats_from_timings(event["timings"], time.monotonic() - self.started, self.load_s))
        return out

    def combined(self) -> dict:
        d = dict(self.final or {"model": self.model, "created_at": rfc3339(), "done": True, "done_reason": "stop",
                               "message": {"role": "assistant", "content": ""}})
        msg = dict(d.get("message") or {"role": "assistant"})
        msg["content"] = "".join(self.parts)
        if any(self.thinking):
            msg["thinking"] = "".join(self.thinking)
        if self.calls:
            msg["tool_calls"] = self.calls
        d["message"] = msg
        if self.top is not None:
            d["logprobs"] = self.logprobs
        return d
