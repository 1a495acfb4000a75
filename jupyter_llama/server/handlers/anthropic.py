"""Anthropic's Messages API under ``<base_url>llama/``: ``POST v1/messages`` and
``v1/messages/count_tokens``, relayed to the child's own as OpenAI's routes are (named SSE
events when streaming), with Anthropic's error shape, ``{"type": "error", "error": {...}}``."""

from __future__ import annotations

from ...api import anthropic as anth
from .openai import OpenAIHandler


class AnthropicHandler(OpenAIHandler):
    """``POST v1/messages`` (and ``v1/messages/count_tokens``): Anthropic's Messages API, relayed
    to the child's own, with Anthropic's error shape."""

    parse_request = staticmethod(anth.parse_request)
    mend_for = staticmethod(anth.mend_for)

    def error_payload(self, status: int, message: str) -> dict:
        return anth.error_body(status, message)

    def error_line(self, message: str) -> bytes:
        return anth.stream_error(message)
