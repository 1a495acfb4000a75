"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Scheduled like every other request (``model`` names the model to acquire) and passed to
the child's own ``/v1/messages``, which llama-server (b11434) serves: it turns the request
into a chat (system, content blocks, ``tool_use``/``tool_result``, ``tools``,
``tool_choice``, ``thinking``) and answers in Anthropic's shape, streamed as named events
(``message_start``, ``content_block_delta``, ...). What is ours: the checks that keep a
client's mistake a 400 (llama-server answers a missing ``messages`` with a 500), and
Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, before a
stream and as its last event.
"""

from __future__ import annotations

import json

from ..errors import BadRequest
from .openai import OpenAIRequest, request_basics, sse, without_ours

__all__ = ["ENDPOINTS", "parse_request", "error_body", "stream_error"]

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
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise BadRequest(f"max_tokens: must be a positive whole number, got {json.dumps(max_tokens)}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  and t["name"] for t in tools):
            raise BadRequest('tools: must be a list of {"name": ..., "description": ..., "input_schema": {...}}')
    out, ka = without_ours(body)
    counting = route == "messages/count_tokens"
    return OpenAIRequest(endpoint=ENDPOINTS[route], model=model, body=out, stream=stream and not counting,
                         keep_alive=ka, named=True, needs=["tools"] if tools else [])


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object (its client reads ``error.type`` and ``error.message``)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def stream_error(message: str) -> bytes:
    """The ``error`` event that ends a stream that failed after it began."""
    return b"event: error\n" + sse(error_body(500, message))
