"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Scheduled like every other request (``model`` names the model to acquire) and passed to
the child's own ``/v1/messages``, which llama-server (b11434) serves: it turns the request
into a chat (system, content blocks, ``tool_use``/``tool_result``, ``tools``,
``tool_choice``, ``thinking``) and answers in Anthropic's shape, streamed as named events
(``message_start``, ``content_block_delta``, ...). What is ours: the checks that keep a
client's mistake a 400 (llama-server answers a missing ``messages`` with a 500), and
Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, before a
stream and as its last event; ``max_tokens`` required, as Anthropic and Ollama require it
(llama-server would make up a limit); thinking off unless ``thinking`` asks for it (the
child's templates think by default); and ``stop_reason: "stop_sequence"`` for an answer
that ended at one of ``stop_sequences`` (the child says ``end_turn``).
"""

from __future__ import annotations

import json

from ..errors import BadRequest
from .openai import Mend, OpenAIRequest, request_basics, sse, without_ours

__all__ = ["ENDPOINTS", "parse_request", "error_body", "stream_error", "mend_for"]

# our route -> the child's path
ENDPOINTS = {
    "messages": "/v1/messages",
    "messages/count_tokens": "/v1/messages/count_tokens",
}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

_ROLES = ("user", "assistant")


def parse_request(route: str, body: dict) -> OpenAIRequest:
    """Check what the child would fail on (or answer with a 500), and read ``model``,
    ``stream`` and our ``keep_alive``; the child checks the rest."""
    if route not in ENDPOINTS:
        raise BadRequest(f"unknown endpoint v1/{route}")
    model, stream = request_basics(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: a non-empty list of {\"role\": \"user\" or \"assistant\", \"content\": ...} "
                         "is required")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages.{i}: must be an object with role and content")
        if m.get("role") not in _ROLES:
            raise BadRequest(f"messages.{i}.role: must be \"user\" or \"assistant\", got {json.dumps(m.get('role'))}")
        if not isinstance(m.get("content"), (str, list)):
            raise BadRequest(f"messages.{i}.content: must be a string or a list of content blocks")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise BadRequest("system: must be a string or a list of text blocks")
    counting = route == "messages/count_tokens"
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise BadRequest("max_tokens: Field required (the most tokens the answer may have, a positive whole number)")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise BadRequest(f"max_tokens: must be a positive whole number, got {json.dumps(max_tokens)}")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) for x in stops)):
        raise BadRequest("stop_sequences: must be a list of strings")
    thinks = _thinking(body.get("thinking"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  and t["name"] for t in tools):
            raise BadRequest('tools: must be a list of {"name": ..., "description": ..., "input_schema": {...}}')
    out, ka = without_ours(body)
    kwargs = out.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs: must be an object")
    if not (kwargs and "enable_thinking" in kwargs):  # (a client's own template switch wins)
        out["chat_template_kwargs"] = {**(kwargs or {}), "enable_thinking": thinks}
    needs = (["tools"] if tools else []) + (["thinking"] if thinks else [])
    return OpenAIRequest(endpoint=ENDPOINTS[route], model=model, body=out, stream=stream and not counting,
                         keep_alive=ka, named=True, needs=needs)


def _thinking(thinking) -> bool:
    """Anthropic's ``thinking``: on for ``{"type": "enabled", "budget_tokens": N}``; off when
    it is left out or ``{"type": "disabled"}``, as Anthropic's models answer."""
    if thinking is None:
        return False
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise BadRequest('thinking: must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}, got '
                         f"{json.dumps(thinking)}")
    return kind == "enabled"


class StopSequenceMend(Mend):
    """An answer that ended at one of its ``stop_sequences``: the child sets ``stop_sequence``
    but says ``stop_reason: "end_turn"``; Anthropic says ``"stop_sequence"``. Streamed, it is
    in the ``message_delta`` event, the last but one."""

    _DELTA = b"event: message_delta\ndata: "

    def answer(self, res: dict) -> None:
        if isinstance(res, dict) and res.get("stop_sequence") and res.get("stop_reason") == "end_turn":
            res["stop_reason"] = "stop_sequence"

    def event(self, data: bytes) -> bytes | None:
        if not data.startswith(self._DELTA):
            return data
        event = json.loads(data[len(self._DELTA):])
        delta = event.get("delta")
        if not isinstance(delta, dict) or not delta.get("stop_sequence") or delta.get("stop_reason") != "end_turn":
            return data
        delta["stop_reason"] = "stop_sequence"
        return self._DELTA + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


def mend_for(req: OpenAIRequest) -> Mend | None:
    """What the child's answer needs mended: the stop reason, when it may stop at a sequence."""
    return StopSequenceMend() if req.endpoint == "/v1/messages" and req.body.get("stop_sequences") else None


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object (its client reads ``error.type`` and ``error.message``)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def stream_error(message: str) -> bytes:
    """The ``error`` event that ends a stream that failed after it began."""
    return b"event: error\n" + sse(error_body(500, message))
