"""The OpenAI-compatible wire format: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/responses`` (stateless: no ``previous_response_id``), ``/v1/models``.

Requests are scheduled like Ollama's (the ``model`` field names the model to acquire) and
then passed through to the child's own OpenAI-compatible endpoints, which speak this
format already; what is here is the little that is ours: reading ``model``/``stream``,
the error body OpenAI clients understand, Server-Sent Events framing, and the model list.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
from dataclasses import dataclass, field

from ..config import json_kind, shown
from ..load_options import LoadOptions
from ..errors import BadRequest
from .options import parse_keep_alive, split_options

__all__ = [
    "ENDPOINTS",
    "OpenAIRequest",
    "parse_request",
    "error_body",
    "sse",
    "SSE_DONE",
    "stream_error",
    "models_body",
    "model_object",
]

# our route -> the child's path
ENDPOINTS = {
    "chat/completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
    "responses/input_tokens": "/v1/responses/input_tokens",  # what a Responses request's input counts
}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "api_error",
    507: "api_error",
}


@dataclass
class OpenAIRequest:
    endpoint: str  # the child's path
    model: str
    body: dict  # what goes to the child
    stream: bool = False
    keep_alive: float | None = None
    options: LoadOptions = field(default_factory=LoadOptions)
    named: bool = False  # the child's stream names its events (Responses, Anthropic): no [DONE] at its end
    needs: list[str] = field(default_factory=list)  # capabilities asked of the model (tools)


def tool_needs(body: dict) -> list[str]:
    """``["tools"]`` for a request that offers the model tools, else nothing."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    return ["tools"] if tools else []


def without_ours(body: dict) -> tuple[dict, float | None]:
    """The body for the child (no ``stream``: the relay sets it) and our ``keep_alive``."""
    out = dict(body)
    ka = parse_keep_alive(out.pop("keep_alive", None))  # ours (as Ollama's OpenAI layer accepts it)
    out.pop("stream", None)
    return out, ka


def request_basics(body: dict) -> tuple[str, bool]:
    """``model`` and ``stream``, checked."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model is required" if not model else f"model must be a string, got {shown(model)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {shown(stream)}")
    return model.strip(), stream


def parse_request(route: str, body: dict) -> OpenAIRequest:
    """Validate the little we read; the child validates the rest (and answers 400 itself)."""
    if route not in ENDPOINTS:
        raise BadRequest(f"unknown endpoint v1/{route}")
    model, stream = request_basics(body)
    needs: list[str] = []
    if route in ("responses", "responses/input_tokens"):
        inp = body.get("input")
        if inp is None:
            raise BadRequest("input is required: a string, or a list of input items")
        if not isinstance(inp, (str, list)):
            raise BadRequest(f"input must be a string or a list of input items, got {json_kind(inp)}")
        if body.get("previous_response_id"):
            raise BadRequest("previous_response_id is not supported: responses are not stored; send the "
                             "conversation in input")
        needs = tool_needs(body)
        stream = stream and route == "responses"  # a count is one object
    elif route == "chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty list")
        needs = tool_needs(body)
    elif route == "completions":
        if "prompt" not in body:
            raise BadRequest("prompt is required")
        unanswered(body)
    else:
        if "input" not in body:
            raise BadRequest("input is required")
        encoding_format(body)  # (checked here, in our words, whichever side then pools the vectors)
        stream = False
    if route in ("chat/completions", "completions"):
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
            raise BadRequest(f"stop must be a string or a list of strings, got {shown(stop)}")
    out, ka = without_ours(body)
    options = LoadOptions(embedding=True) if route == "embeddings" else LoadOptions()
    return OpenAIRequest(endpoint=ENDPOINTS[route], model=model, body=out, stream=stream,
                         keep_alive=ka, options=options, named=route == "responses", needs=needs)


def unanswered(body: dict) -> None:
    """A 400 for what a ``/v1/completions`` request may ask that llama-server's route would
    silently leave out of its answer (the client would take the answer for what it asked)."""
    if body.get("echo"):
        raise BadRequest("echo is not supported: the answer is the completion alone; put the prompt before it "
                         "yourself")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise BadRequest(f"best_of is not supported (got {shown(best_of)}): use n for several completions and "
                         "choose among them")
    if body.get("suffix"):
        raise BadRequest("suffix (fill in the middle) is not supported on v1/completions: send it to api/generate "
                         "with prompt and suffix")


def with_preset(req: OpenAIRequest, preset) -> OpenAIRequest:
    """The model's preset (``models.preset.Preset``) under an OpenAI or Anthropic request, the
    request's own values winning, as Ollama applies a Modelfile on every route: its sampling
    parameters where the body sets none (``num_predict`` as ``max_tokens``), its load-time
    parameters as the load's defaults, and its system message (when the request has none) and
    messages before the conversation."""
    if not preset or not (preset.parameters or preset.system or preset.messages):
        return req
    split = split_options(preset.parameters or None)
    body = dict(req.body)
    anthropic = req.endpoint.startswith("/v1/messages")
    responses = req.endpoint.startswith("/v1/responses")  # and the count of a Responses request's input
    for key, value in split.sampling.items():
        if key == "n_predict":
            if not anthropic and not any(k in body for k in ("max_tokens", "max_completion_tokens",
                                                               "max_output_tokens", "n_predict")):
                body["max_output_tokens" if responses else "max_tokens"] = value
        elif key == "stop":
            if not anthropic and "stop" not in body and not responses:
                body["stop"] = value
        else:
            body.setdefault(key, value)
    prefix = [dict(m) for m in preset.messages]
    if req.endpoint == "/v1/chat/completions":
        msgs = list(body.get("messages") or [])
        has_system = any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in msgs)
        body["messages"] = ([{"role": "system", "content": preset.system}] if preset.system and not has_system
                            else []) + prefix + msgs
    elif anthropic:  # /v1/messages and its count_tokens
        if preset.system and not body.get("system"):
            body["system"] = preset.system
        body["messages"] = [m for m in prefix if m.get("role") in ("user", "assistant")] + list(body.get("messages")
                                                                                                  or [])
    elif responses and preset.system:
        body.setdefault("instructions", preset.system)
    # the preset's load options, with the one the route itself sets (embeddings: embedding)
    options = split.load_options(embedding=req.options.embedding or None)
    return dataclasses.replace(req, body=body, options=options)


def error_body(status: int, message: str) -> dict:
    """OpenAI's error object (the openai client reads ``error.message``)."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"), "param": None,
                      "code": status}}


def sse(obj) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stream_error(message: str, named: bool = False) -> bytes:
    """An error that ends a stream: ``data: {"error": ...}`` (what OpenAI's client raises on);
    in a stream of named events (Responses) an ``error`` event that carries the same, with
    the Responses API's own ``type``/``code``/``message`` fields beside it."""
    body = error_body(500, message)
    if not named:
        return sse(body)
    event = {"type": "error", "code": "api_error", "message": message, "param": None, **body}
    return b"event: error\n" + sse(event)


def model_object(name: str, created: int = 0, owned_by: str = "library") -> dict:
    return {"id": name, "object": "model", "created": int(created), "owned_by": owned_by}


def models_body(entries) -> dict:
    """``/v1/models`` from store entries."""
    import datetime as _dt

    data = []
    for e in entries:
        created = 0
        try:
            created = int(_dt.datetime.fromisoformat(e.modified_at).timestamp()) if e.modified_at else 0
        except ValueError:
            pass
        data.append(model_object(e.display, created, e.name.namespace))
    return {"object": "list", "data": data}


def embedding_inputs(body: dict) -> list[str]:
    """``input`` of a ``/v1/embeddings`` request as a list of strings (400 for anything else)."""
    inp = body.get("input")
    inputs = [inp] if isinstance(inp, str) else list(inp or []) if isinstance(inp, list) else None
    if inputs is None or not all(isinstance(s, str) for s in inputs):
        raise BadRequest("input must be a string or a list of strings")
    return inputs


def encoding_format(body: dict) -> str:
    """A ``/v1/embeddings`` request's ``encoding_format``: ``float`` (the default) or ``base64``."""
    fmt = body.get("encoding_format")
    if fmt is None:
        return "float"
    if fmt not in ("float", "base64"):
        raise BadRequest(f"encoding_format must be \"float\" or \"base64\", got {shown(fmt)}")
    return fmt


def embeddings_body(model: str, vectors: list[list[float]], tokens: int, fmt: str = "float") -> dict:
    """OpenAI's list of embeddings; with ``fmt`` base64, each vector's little-endian float32
    bytes in base64, as OpenAI sends them (and its Python client asks for by default)."""
    def spelled(v: list[float]):
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii") if fmt == "base64" else v

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": spelled(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
