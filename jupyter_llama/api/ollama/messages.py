"""Ollama's chat messages as llama-server's chat route (OpenAI's shape) takes them: the
role and text, images as content parts with their media type (read by the model's
projector), tool calls with their arguments as JSON text, and a message's reasoning."""

from __future__ import annotations

import json
from typing import Any

from ...config import shown
from ...errors import BadRequest


def _images(images, where: str) -> list[str]:
    """A request's ``images``: base64-encoded images (none: an empty list)."""
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(x, str) and x for x in images):
        raise BadRequest(f"{where} must be a list of base64-encoded images")
    return images


_ROLES = ("system", "user", "assistant", "tool")


def _chat_message(i: int, m, where: str = "") -> dict:
    """One Ollama message as an OpenAI message for llama-server (``where``: how an error
    names its images; ``messages[i].images`` by default)."""
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object with role and content")
    role = m.get("role")
    if role not in _ROLES:
        raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {shown(role)}")
    content = m.get("content", "")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string")
    where = where or f"messages[{i}].images"
    images = _images(m.get("images") or [], where)
    out: dict[str, Any] = {"role": role, "content": content}
    if images:  # OpenAI content parts, which llama-server's chat route reads with the model's projector
        out["content"] = [{"type": "text", "text": content}] + [
            {"type": "image_url", "image_url": {"url": f"data:{_image_type(x, where)};base64,{x}"}} for x in images]
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise BadRequest(f"messages[{i}].tool_calls must be a list")
        conv = []
        for j, c in enumerate(calls):
            fn = (c or {}).get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise BadRequest(f"messages[{i}].tool_calls[{j}] needs function.name")
            args = fn.get("arguments", {})
            conv.append({"id": c.get("id") or f"call_{i}_{j}", "type": "function",
                         "function": {"name": fn["name"],
                                      "arguments": args if isinstance(args, str) else json.dumps(args)}})
        out["tool_calls"] = conv
    if role == "tool":
        name = m.get("tool_name") or m.get("name")
        if name:
            out["name"] = name
        if m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
    if m.get("thinking"):
        out["reasoning_content"] = m["thinking"]
    return out


_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def _image_type(b64: str, where: str) -> str:
    """The media type of a base64 image, from its first bytes (400 for text that is not base64)."""
    import base64
    import binascii

    try:
        head = base64.b64decode(b64[:64] + "=" * (-len(b64[:64]) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: not base64 (give the image's bytes base64-encoded, "
                         "without a data: prefix)") from None
    return next((t for magic, t in _IMAGE_MAGIC if head.startswith(magic)), "image/jpeg")
