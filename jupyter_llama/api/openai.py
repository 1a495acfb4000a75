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
from ..errors import BadRequest
from ..load_options import LoadOptions
from .options import OLLAMA_SAMPLING_DEFAULTS, format_to_schema, parse_keep_alive, split_options

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
    dimensions: int | None = None  # embeddings: the length to cut each vector to (then made unit length again)
    suffix: str | None = None  # completions: fill in the middle (the prompt is the text before the gap)

    @property
    def choices(self) -> int:
        """How many answers the request asks for (OpenAI's ``n``; 1 when not given)."""
        n = self.body.get("n")
        return n if type(n) is int and n > 1 else 1


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


MAX_CHOICES = 128  # the most answers one request may ask for (``n``), as OpenAI allows


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
        n = body.get("n")
        if n is not None and (type(n) is not int or not 1 <= n <= MAX_CHOICES):
            raise BadRequest(f"n must be a whole number from 1 to {MAX_CHOICES} (how many answers to make), got "
                             f"{shown(n)}")
    out, ka = without_ours(body)
    structured(route, out)
    dims = suffix = None
    if route == "embeddings":
        dims = out.pop("dimensions", None)
        if dims is not None and (type(dims) is not int or dims < 1):
            raise BadRequest(f"dimensions must be a positive whole number (how many numbers each embedding keeps), "
                             f"got {shown(dims)}")
    elif route == "completions":
        suffix = fill_in_the_middle(out)
        if suffix is not None:
            needs = ["insert"]
    options = LoadOptions(embedding=True) if route == "embeddings" else LoadOptions()
    return OpenAIRequest(endpoint=ENDPOINTS[route], model=model, body=out, stream=stream,
                         keep_alive=ka, options=options, named=route == "responses", needs=needs, dimensions=dims,
                         suffix=suffix)


def format_schema(fmt, where: str) -> dict | None:
    """The JSON schema an OpenAI structured-output format asks the answer to follow, or None
    for plain text: chat's and completions' ``response_format`` (``{"type": "json_schema",
    "json_schema": {"name", "schema"}}``) and the Responses API's ``text.format`` (the same,
    its ``name`` and ``schema`` one level up), or ``{"type": "json_object"}`` (any JSON
    object). The schema is then what Ollama's ``format`` gives (``options.format_to_schema``,
    the one computation every route shares), and the child turns it into its grammar."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadRequest(f'{where} must be an object such as {{"type": "json_schema", ...}} or '
                         f'{{"type": "json_object"}}, got {json_kind(fmt)}')
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return format_to_schema("json")
    if kind != "json_schema":
        raise BadRequest(f'{where}.type must be "text", "json_object" or "json_schema", got {shown(kind)}')
    holder = fmt if where.endswith("text.format") else fmt.get("json_schema")
    inner = "" if where.endswith("text.format") else ".json_schema"
    if not isinstance(holder, dict) or not isinstance(holder.get("schema", {}), dict):
        raise BadRequest(f"{where}{inner}.schema must be a JSON schema (an object)")
    schema = holder.get("schema")
    return format_to_schema(schema if schema else "json")


def structured(route: str, body: dict) -> None:
    """Replace a request's structured-output format (see :func:`format_schema`) by the
    ``json_schema`` the child reads on every route (its own ``response_format`` reading
    covers only chat, and nothing reads a Responses ``text.format``)."""
    if route in ("chat/completions", "completions"):
        schema = format_schema(body.pop("response_format", None), "response_format")
    elif route == "responses":
        text = body.get("text")
        if text is not None and not isinstance(text, dict):
            raise BadRequest(f'text must be an object such as {{"format": {{"type": "json_schema", ...}}}}, got '
                             f"{json_kind(text)}")
        schema = format_schema((text or {}).get("format"), "text.format")
    else:
        return
    if schema is not None:
        body["json_schema"] = schema


def fill_in_the_middle(body: dict) -> str | None:
    """A ``/v1/completions`` request's ``suffix`` (the text after the gap to fill; None when
    there is none), with what it cannot go with refused in words. The prompt must be one
    text; the answer is made by the child's ``/infill``, with the model's FIM tokens."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        body.pop("suffix", None)
        return None
    if not isinstance(suffix, str):
        raise BadRequest(f"suffix must be a string (the text after the gap to fill), got {json_kind(suffix)}")
    if not isinstance(body.get("prompt"), str):
        raise BadRequest("with suffix, prompt must be one string: the text before the gap to fill")
    if body.get("n") not in (None, 1):
        raise BadRequest("n greater than 1 is not supported with suffix: ask once per answer")
    if body.get("logprobs") not in (None, False, 0):
        raise BadRequest("logprobs is not supported with suffix (fill in the middle); leave it out")
    return suffix


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


# What Ollama's OpenAI layer sends for a sampling field a request leaves out: temperature and
# top_p 1.0 (OpenAI's own defaults), and Ollama's defaults for the fields OpenAI does not have.
# llama-server's OpenAI routes read them all by these names. Not on the Responses route, whose
# body llama-server turns into a chat request of its own (temperature and top_p only there),
# nor on Anthropic's.
OPENAI_SAMPLING_DEFAULTS = {**OLLAMA_SAMPLING_DEFAULTS, "temperature": 1.0, "top_p": 1.0}
RESPONSES_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def with_sampling_defaults(req: OpenAIRequest) -> OpenAIRequest:
    """``req`` with Ollama's OpenAI-layer sampling defaults where neither the request nor the
    model's preset (:func:`with_preset`, applied first) sets a value, so an OpenAI client
    samples here as it does against Ollama, not with llama-server's own defaults."""
    if req.endpoint in ("/v1/chat/completions", "/v1/completions"):
        defaults = OPENAI_SAMPLING_DEFAULTS
    elif req.endpoint == "/v1/responses":
        defaults = RESPONSES_SAMPLING_DEFAULTS
    else:
        return req
    # (a field sent as null is one left out)
    body = {**defaults, **{k: v for k, v in req.body.items() if not (v is None and k in defaults)}}
    return dataclasses.replace(req, body=body)


def error_body(status: int, message: str) -> dict:
    """OpenAI's error object (the openai client reads ``error.message``). Its ``code`` is a
    string in OpenAI's API or null; it is null here, as Ollama's OpenAI layer sends it (the
    HTTP status says what kind of error it is)."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"), "param": None,
                      "code": None}}


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


def cut_dimensions(vectors: list[list[float]], dims: int | None, model: str) -> list[list[float]]:
    """Each vector cut to its first ``dims`` numbers and made unit length again, as OpenAI's
    text-embedding-3 models shorten theirs (None: as they are). A ``dims`` larger than the
    model's vectors is a 400, as OpenAI answers it (Ollama's /api/embed gives the whole
    vector then; that route keeps Ollama's way)."""
    if not dims or not vectors:
        return vectors
    have = len(vectors[0])
    if dims > have:
        raise BadRequest(f"dimensions is {dims}, more than the {have} numbers of each embedding {model} makes: ask "
                         f"for {have} or fewer, or leave dimensions out")
    out = []
    for v in vectors:
        cut = v[:dims]
        norm = sum(x * x for x in cut) ** 0.5
        out.append([x / norm for x in cut] if norm > 0 else cut)
    return out


# ----------------------------------------------------------------------------- what is mended on the way
#
# The child speaks these wire formats itself, and its answers go on as it wrote them, but
# for a few things it gets wrong: a Mend changes those (a whole answer in place; in a stream,
# the events it concerns, parsed; every other event passes as bytes, untouched).


class Mend:
    """What a relayed answer needs changed; the base changes nothing."""

    def answer(self, res: dict) -> None:
        """Change an answer that is not streamed (a dict), in place."""

    def event(self, data: bytes) -> bytes | None:
        """One event of a stream as the relay has it (its JSON; a named event with its
        ``event:`` line before); what goes on instead, or None to hold it back."""
        return data

    def end(self) -> list[bytes]:
        """Events to send once the child's stream has ended (what was held back)."""
        return []


class ResponsesMend(Mend):
    """A Responses answer cut by ``max_output_tokens``: status ``incomplete`` with
    ``incomplete_details: {"reason": "max_output_tokens"}`` (OpenAI's shape; its stream
    ends with ``response.incomplete`` in place of ``response.completed``), where the child
    says ``completed``. The child does not say why it stopped; an answer of as many tokens
    as the limit was cut by it (one that ended on its end-of-turn token at exactly the limit
    is counted as cut too)."""

    _LAST = b"event: response.completed\ndata: "

    def __init__(self, limit: int | None):
        self.limit = limit if type(limit) is int and limit > 0 else None

    def answer(self, res: dict) -> None:
        if not isinstance(res, dict) or res.get("object") != "response":
            return
        out = (res.get("usage") or {}).get("output_tokens")
        if self.limit is None or type(out) is not int or out < self.limit:
            res.setdefault("incomplete_details", None)
            return
        res["status"] = "incomplete"
        res["incomplete_details"] = {"reason": "max_output_tokens"}
        for item in res.get("output") or []:
            if isinstance(item, dict) and item.get("type") == "message":
                item["status"] = "incomplete"

    def event(self, data: bytes) -> bytes | None:
        if self.limit is None or not data.startswith(self._LAST):
            return data
        event = json.loads(data[len(self._LAST):])
        res = event.get("response")
        self.answer(res)
        if not isinstance(res, dict) or res.get("status") != "incomplete":
            return data
        event["type"] = "response.incomplete"
        data = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
        return b"event: response.incomplete\ndata: " + data


def usage_of_all(answers: list[dict]) -> dict:
    """One usage for several answers to the same prompt (OpenAI's ``n``): the prompt counted
    once, the completions of all of them."""
    usages = [a.get("usage") or {} for a in answers]
    first = dict(usages[0])
    prompt = int(first.get("prompt_tokens") or 0)
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    first.update(completion_tokens=completion, total_tokens=prompt + completion)
    return first


def merged_answers(answers: list[dict]) -> dict:
    """Several answers of one choice each (asked for one at a time: see the handler) as one
    answer with ``n`` choices, numbered in order, and the usage of all of them."""
    merged = dict(answers[0])
    merged["choices"] = [dict((a.get("choices") or [{}])[0], index=i) for i, a in enumerate(answers)]
    merged["usage"] = usage_of_all(answers)
    return merged


class UsageMend(Mend):
    """A stream of ``n`` > 1 answers: the child gives each answer a usage of its own (a chat
    with ``stream_options.include_usage`` in a chunk of its own, a completion on its last
    chunk), and a client keeps the last, one answer's count. They are taken out, and one
    chunk with the usage of all goes at the end."""

    _USAGE = b'"usage":'  # (only a chunk with a usage has it: in a text, the quotes are escaped)

    def __init__(self) -> None:
        self.usages: list[dict] = []
        self.last: dict = {}

    def event(self, data: bytes) -> bytes | None:
        if self._USAGE not in data:
            return data
        chunk = json.loads(data)
        usage = chunk.pop("usage", None) if isinstance(chunk, dict) else None
        if not isinstance(usage, dict):
            return data
        self.usages.append({"usage": usage})
        self.last = chunk
        if not chunk.get("choices"):
            return None
        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()

    def end(self) -> list[bytes]:
        if not self.usages:
            return []
        last = {**self.last, "choices": [], "usage": usage_of_all(self.usages)}
        return [json.dumps(last, separators=(",", ":"), ensure_ascii=False).encode()]


def mend_for(req: OpenAIRequest) -> Mend | None:
    """What the child's answer to ``req`` needs mended (None: nothing)."""
    if req.endpoint == "/v1/responses":
        return ResponsesMend(req.body.get("max_output_tokens"))
    if req.stream and req.choices > 1 and req.endpoint in ("/v1/chat/completions", "/v1/completions"):
        return UsageMend()
    return None


# ----------------------------------------------------------------------------- fill in the middle


def infill_body(req: OpenAIRequest) -> dict:
    """What goes to the child's ``/infill`` for a ``/v1/completions`` request with ``suffix``:
    its sampling fields as they are (llama-server reads OpenAI's names there too, such as
    ``max_tokens``), the prompt and the suffix as the text before and after the gap."""
    body = {k: v for k, v in req.body.items() if k not in ("prompt", "suffix", "model", "stream_options", "n",
                                                            "logprobs", "echo", "best_of", "user")}
    body["input_prefix"] = req.body.get("prompt") or ""
    body["input_suffix"] = req.suffix or ""
    return body


class InfillTranslator:
    """The child's native ``/infill`` events (``content``; the last with ``stop``,
    ``stop_type`` and ``timings``) as OpenAI's ``/v1/completions`` answer: ``text_completion``
    chunks, streamed, or one object."""

    def __init__(self, model: str, include_usage: bool = False):
        import time
        import uuid

        self.model = model
        self.id = "cmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.include_usage = include_usage
        self.parts: list[str] = []
        self.finish: str | None = None
        self.usage: dict | None = None

    def _chunk(self, text: str, finish: str | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    def feed(self, event: dict) -> list[dict]:
        out = []
        text = event.get("content") or ""
        if text:
            self.parts.append(text)
            out.append(self._chunk(text, None))
        if event.get("stop"):
            self.finish = "length" if event.get("stop_type") == "limit" else "stop"
            t = event.get("timings") or {}
            prompt = int(t.get("prompt_n") or 0) + int(t.get("cache_n") or 0)
            completion = int(t.get("predicted_n") or event.get("tokens_predicted") or 0)
            self.usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}
            out.append(self._chunk("", self.finish))
            if self.include_usage:
                out.append({"id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage})
        return out

    def combined(self) -> dict:
        d = self._chunk("".join(self.parts), self.finish or "stop")
        d["usage"] = self.usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return d
