"""Ollama's REST wire format (REFERENCE section 6) as pure functions.

Requests: ``parse_*`` take a decoded JSON body and return a small dataclass, or raise
:class:`~jupyter_llama.scheduler.BadRequest` with a message that says what is wrong.

Responses: chunk builders for ``/api/generate`` and ``/api/chat`` (``model``,
``created_at`` in RFC 3339, ``response`` or ``message``, ``done``; the last chunk adds
``done_reason`` and the durations in nanoseconds, taken from llama-server's ``timings``),
and the bodies of ``/api/ps``, ``/api/tags``, ``/api/show`` and ``/api/version``.

Two translators turn llama-server's streamed events into Ollama chunks:
:class:`GenerateTranslator` (native ``/completion`` events) and :class:`ChatTranslator`
(OpenAI-style ``/v1/chat/completions`` events, where llama-server applies the model's
chat template). A generate answer that is not raw goes through
:class:`ContextGenerateTranslator`, the first of them keeping the answer's token ids for
the last chunk's ``context`` (Ollama's).

A model's preset (``models.preset``: what ``/api/create`` and a Modelfile add to the weights)
is applied while a request is parsed, as Ollama applies it: its parameters are the request's
default options (the request's own values win; load options among them are the model's
default load options), its system message is the default one, its messages come before the
request's, and its template (a Go template, ``api.gotemplate``) formats the prompt.

Templates, decided: llama-server runs only the GGUF's Jinja chat template, so a preset (or
per-request) TEMPLATE is rendered here and the text goes to ``/completion``, as Ollama
renders its Go templates. When a template uses Go-template features our interpreter does
not run, or a chat request carries tools or images (which llama-server's chat route
handles), the model's own chat template is used instead; the template is still stored and
shown as written. ``create`` says so in its status lines.

No I/O and no HTTP here: the handlers call these.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..config import json_kind, shown
from ..errors import BadRequest
from ..load_options import LoadOptions
from ..models.preset import Preset
from ..models.ref import model_details
from .gotemplate import GoTemplate, TemplateUnsupported
from .modelfile import write_modelfile
from .options import (
    format_to_schema,
    parameters_text,
    parse_keep_alive,
    parse_parameters,
    split_options,
    with_sampling_defaults,
)

__all__ = [
    "OLLAMA_VERSION",
    "parse_body",
    "GenerateRequest",
    "ChatRequest",
    "EmbedRequest",
    "PullRequest",
    "CreateRequest",
    "parse_generate",
    "parse_chat",
    "parse_embed",
    "parse_embeddings",
    "parse_show",
    "parse_pull",
    "parse_copy",
    "parse_delete",
    "parse_create",
    "check_context",
    "rfc3339",
    "GenerateTranslator",
    "ContextGenerateTranslator",
    "ChatTranslator",
    "load_chunk",
    "error_chunk",
    "stats_from_timings",
    "ps_body",
    "ps_model",
    "tags_body",
    "show_body",
    "embed_body",
    "mean_pool_normalize",
    "unit_vectors",
]

# The Ollama release whose API this server follows (REFERENCE.md is measured against it).
OLLAMA_VERSION = "0.31.1"

# How far "forever" lies (Ollama shows pinned models expiring ~292 years out).
_FOREVER = _dt.timedelta(days=365 * 292)


# ----------------------------------------------------------------------------- requests


def parse_body(raw: bytes | str | None) -> dict:
    """A request body as a JSON object; BadRequest for anything else."""
    if raw is None or (isinstance(raw, (bytes, str)) and not raw.strip()):
        raise BadRequest("missing request body: expected a JSON object")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON in request body: {e}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_kind(data)}")
    _check_depth(data)
    if _SURROGATE_ESCAPE.search(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")):
        _check_surrogates(data)
    return data


# Half of a UTF-16 pair without its other half: a high escape (\uD800-\uDBFF) not followed
# by a low one, a low one (\uDC00-\uDFFF) not after a high one, or such a half written as
# UTF-8 bytes (ED A0-BF ..), which json.loads also lets through. It leaves a lone half in a
# string, which no UTF-8 encoder (ours, the child's) takes. Only a body with one is looked
# through (a whole pair, an emoji from a client that escapes non-ASCII, is not).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                               rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_surrogates(data: Any) -> None:
    """BadRequest naming where a string of ``data`` holds an unpaired UTF-16 surrogate."""
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        value, where = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            at = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
            for text, what in ((key, f"a name in {where or 'the body'}"), (item, f"the text of {at}")):
                found = _SURROGATE.search(text) if isinstance(text, str) else None
                if found is not None:
                    raise BadRequest(f"{what} holds \\u{ord(found.group()):04x}, half of a UTF-16 surrogate pair "
                                     "without its other half, which is not a character: send valid Unicode (a "
                                     "\\ud800-\\udbff escape must be followed by a \\udc00-\\udfff one)")
            if isinstance(item, (dict, list)):
                todo.append((item, at))


MAX_JSON_DEPTH = 64  # far more than any request needs; deeper would recurse in every later step


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _check_depth(data: Any) -> None:
    todo = [(data, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        if isinstance(value, dict):
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)


def model_name(body: dict, key: str = "model") -> str:
    name = body.get(key)
    if name is None and key == "model":
        name = body.get("name")  # Ollama's older field name
    if not isinstance(name, str) or not name.strip():
        raise BadRequest(f"{key} is required" if name is None or name == "" else
                         f"{key} must be a string, got {shown(name)}")
    return name.strip()


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {shown(v)}")
    return v


def _str(body: dict, key: str, default: str = "") -> str:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise BadRequest(f"{key} must be a string, got {json_kind(v)}")
    return v


@dataclass
class GenerateRequest:
    model: str
    prompt: str
    system: str = ""
    raw: bool = False
    stream: bool = True
    keep_alive: float | None = None
    options: LoadOptions = field(default_factory=LoadOptions)
    sampling: dict = field(default_factory=dict)  # llama-server /completion fields
    truncate: bool = True  # a prompt longer than the context keeps its end (Ollama's default)
    default_system: str = ""  # the preset's system message, used when the request gives none
    history: list[dict] = field(default_factory=list)  # the preset's messages, before the prompt
    template: GoTemplate | None = None  # renders the prompt (the request's template, else the preset's)
    suffix: str = ""  # fill in the middle: the text after the gap (the prompt is the text before it)
    think: bool | str | None = None  # as chat's: the answer's reasoning comes apart, as "thinking"
    # Ollama's (deprecated) context: a previous answer's token ids, which come before this prompt
    # (the preset's messages are left out then); None when not given, and for a raw request
    context: list[int] | None = None
    logprobs: int | None = None  # logprobs asked: how many of the likeliest tokens each carries (see _logprobs)
    # base64 images that go with the prompt (a vision model's): the request then goes to the child's
    # chat route, which reads them with the projector and the model's own chat template
    images: list[str] = field(default_factory=list)

    @property
    def is_load_only(self) -> bool:
        """Ollama: an empty prompt loads (or, with keep_alive 0, unloads) the model."""
        return not self.prompt and not self.system and not self.suffix

    @property
    def needs(self) -> list[str]:
        """The capabilities this request asks of the model (see :func:`check_capabilities`)."""
        return (["insert"] if self.suffix else []) + (["thinking"] if self.think else []) + (
            ["vision"] if self.images else [])

    @property
    def thinks(self) -> bool:
        """``think`` given, and the model's own chat template to apply it: the request goes to
        llama-server's chat route, which separates the reasoning (``/completion`` does not)."""
        return self.think is not None and not self.raw and self.template is None and not self.suffix

    @property
    def chat_params(self) -> dict:
        return {**self.sampling, **_think_params(self.think)}

    def prompt_messages(self) -> list[dict]:
        """The conversation a template (or the model's chat template) turns into the prompt."""
        system = self.system or self.default_system
        user: dict[str, Any] = {"role": "user", "content": self.prompt}
        if self.images:
            user = _chat_message(0, {"role": "user", "content": self.prompt, "images": self.images}, "images")
        return ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in self.history] + [user]

    @property
    def unloads(self) -> bool:
        return self.is_load_only and self.keep_alive == 0

    @property
    def answers_context(self) -> bool:
        """Its last chunk carries ``context`` (the conversation's token ids): a request that is
        not raw, on the ``/completion`` path (not fill in the middle; the handler also leaves
        out a ``think`` that goes to the child's chat route)."""
        return not self.raw and not self.suffix


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    stream: bool = True
    keep_alive: float | None = None
    options: LoadOptions = field(default_factory=LoadOptions)
    sampling: dict = field(default_factory=dict)  # llama-server fields (OpenAI endpoint reads them)
    tools: list | None = None
    prefix: list[dict] = field(default_factory=list)  # the preset's system message and messages
    template: GoTemplate | None = None  # the preset's template, when it is to render the prompt
    think: bool | str | None = None  # Ollama's think: true, false, or a level (low, medium, high); None: unset
    truncate: bool = True  # a chat longer than the context drops its oldest messages (Ollama's default)
    logprobs: int | None = None  # as GenerateRequest's

    @property
    def is_load_only(self) -> bool:
        return not self.messages

    @property
    def needs(self) -> list[str]:
        """The capabilities this request asks of the model (see :func:`check_capabilities`)."""
        return (["tools"] if self.tools else []) + (["thinking"] if self.think else []) + self.needs_vision

    @property
    def chat_params(self) -> dict:
        """What goes to llama-server's chat route besides the messages: the sampling fields,
        the tools, and ``think`` as the template's ``enable_thinking`` (and
        ``reasoning_effort`` for a level), which is how llama-server's Jinja templates take it."""
        params = dict(self.sampling)
        if self.tools:
            params["tools"] = self.tools
        return {**params, **_think_params(self.think)}

    @property
    def all_messages(self) -> list[dict]:
        """What the model sees: the preset's part, then the request's messages."""
        return self.prefix + self.messages

    @property
    def templated(self) -> GoTemplate | None:
        """The template to render this chat with ourselves; None: llama-server's chat route (the
        model's own chat template), which also handles tools and images."""
        return None if self.template is None or self.tools or self.has_images else self.template

    @property
    def has_images(self) -> bool:
        return any(isinstance(m.get("content"), list) for m in self.messages)

    @property
    def needs_vision(self) -> list[str]:
        return ["vision"] if self.has_images else []

    @property
    def unloads(self) -> bool:
        return self.is_load_only and self.keep_alive == 0


@dataclass
class EmbedRequest:
    model: str
    inputs: list[str]
    truncate: bool = True
    keep_alive: float | None = None
    options: LoadOptions = field(default_factory=lambda: LoadOptions(embedding=True))
    dimensions: int | None = None
    legacy: bool = False  # /api/embeddings: one prompt, one "embedding"


@dataclass
class PullRequest:
    source: str
    name: str | None = None
    stream: bool = True
    insecure: bool = False


@dataclass
class CreateRequest:
    model: str
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256:<hex>
    from_: str | None = None
    stream: bool = True
    preset: Preset = field(default_factory=Preset)
    notes: list[str] = field(default_factory=list)  # status lines to add (a template we cannot run ...)


MAX_TOP_LOGPROBS = 20  # (Ollama's and OpenAI's limit)


def _logprobs(body: dict) -> int | None:
    """Ollama's ``logprobs`` (each generated token's log probability) and ``top_logprobs``
    (how many of the likeliest tokens at each position come with it, 0 to 20): None when
    ``logprobs`` is not asked for (then ``top_logprobs`` alone returns nothing, as in Ollama)."""
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequest(f"top_logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}, got {shown(top)}")
    return (top or 0) if _bool(body, "logprobs", False) else None


def _sampling_from(body: dict, split, logprobs: int | None = None) -> dict:
    sampling = with_sampling_defaults(split.sampling)  # (Ollama's defaults where nothing is set)
    schema = format_to_schema(body.get("format"))
    if schema is not None:
        sampling["json_schema"] = schema
    if logprobs is not None:  # (llama-server gives the chosen token's with at least one of the likeliest)
        sampling["n_probs"] = max(1, logprobs)
    return sampling


_THINK_LEVELS = ("low", "medium", "high")


def _think_params(think: bool | str | None) -> dict:
    """``think`` as llama-server's Jinja chat templates take it: ``enable_thinking`` (and
    ``reasoning_effort`` for a level)."""
    if think is None:
        return {}
    kwargs: dict[str, Any] = {"enable_thinking": bool(think)}
    if isinstance(think, str):
        kwargs["reasoning_effort"] = think
    return {"chat_template_kwargs": kwargs}


def _think(body: dict) -> bool | str | None:
    """Ollama's ``think``: true, false or a level (``max`` is its word for ``high``)."""
    v = body.get("think")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in (*_THINK_LEVELS, "max", "true", "false"):
        v = v.strip().lower()
        return {"max": "high", "true": True, "false": False}.get(v, v)
    raise BadRequest(f'think must be true, false, "low", "medium" or "high", got {json.dumps(v)}')


def _tools(body: dict) -> list | None:
    """``tools``: function schemas as Ollama (and OpenAI) write them, passed on as they are."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]
                or t.get("type", "function") != "function"
                or not isinstance(fn.get("parameters", {}), dict)):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "description": '
                             '..., "parameters": {a JSON schema}}}}')
    return tools or None


@functools.lru_cache(maxsize=64)
def _preset_template(text: str) -> GoTemplate | None:
    """A preset's template, parsed once; None when it uses what our interpreter does not run
    (the model's own chat template is used then) or is no template at all."""
    if not text:
        return None
    try:
        return GoTemplate.parse(text)
    except (TemplateUnsupported, BadRequest):
        return None


def _options_with(preset: Preset | None, options, defaults=None) -> dict | None:
    """The request's ``options`` over the preset's parameters (the request's values win), over
    ``defaults`` (ours, ``default_options``: what a client wants only where nothing else is set)."""
    if defaults is not None and not isinstance(defaults, dict):
        raise BadRequest(f"default_options must be a JSON object, got {json_kind(defaults)}")
    if not (preset and preset.parameters) and not defaults:
        return options
    if options is not None and not isinstance(options, dict):
        return options  # split_options says what is wrong with it
    return {**(defaults or {}), **(preset.parameters if preset else {}), **(options or {})}


def _context(body: dict) -> list[int] | None:
    """Ollama's ``context``: the token ids a previous answer gave (None when not given)."""
    ids = body.get("context")
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise BadRequest(f"context must be a list of token ids (whole numbers of 0 or more), as the last chunk of "
                         f"an earlier /api/generate answer gives it; got {json_kind(ids)}")
    if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0):  # (C loops: a context may be long)
        i, t = next((i, t) for i, t in enumerate(ids) if type(t) is not int or t < 0)
        raise BadRequest(f"context[{i}] must be a token id (a whole number of 0 or more), got {shown(t)}; send "
                         "back the context an earlier /api/generate answer gave")
    return ids


def check_context(model: str, ids: list[int], info) -> None:
    """A 400 for a ``context`` id the model's vocabulary (``info``, its GGUF's) does not have,
    when its size is known; else the child's own refusal, a 400 too, says so."""
    size = int(getattr(info, "vocab_size", 0) or 0)
    if size <= 0 or max(ids) < size:
        return
    i, t = next((i, t) for i, t in enumerate(ids) if t >= size)
    raise BadRequest(f"context[{i}] is {t}, which is not a token of {model}: its vocabulary has {size:,} tokens "
                     f"(0 to {size - 1:,}); send back the context an answer of this model gave")


def parse_generate(body: dict, preset: Preset | None = None) -> GenerateRequest:
    """``POST /api/generate``; ``preset``: the model's (see the module docstring). ``context``
    (Ollama's, deprecated there): a previous answer's token ids, which come before the newly
    templated prompt; the preset's messages are then left out, as Ollama leaves them out (its
    system message stays). A raw request ignores it."""
    model = model_name(body)
    raw = _bool(body, "raw", False)
    images = _images(body.get("images"), "images")
    if images and raw:
        raise BadRequest("images cannot go with raw: a raw prompt has no place for them; leave raw out, and the "
                         "model's chat template puts the images before your prompt")
    if images and body.get("suffix"):
        raise BadRequest("images cannot go with suffix (fill in the middle); send one or the other")
    for x in images:
        _image_type(x, "images")
    context = _context(body)
    if raw:
        context = None
    template = None
    asked = _str(body, "template")
    if asked and not raw:
        try:
            template = GoTemplate.parse(asked)
        except TemplateUnsupported as e:
            raise BadRequest(f"template: it uses {e}, which jupyter-llama cannot run; leave template out to use "
                             "the model's own chat template") from None
    preset = preset or Preset()
    if template is None and not raw:
        template = _preset_template(preset.template)
    split = split_options(_options_with(preset, body.get("options"), body.get("default_options")))
    logprobs = _logprobs(body)
    return GenerateRequest(
        model=model,
        prompt=_str(body, "prompt"),
        system=_str(body, "system"),
        raw=raw,
        stream=_bool(body, "stream", True),
        keep_alive=parse_keep_alive(body.get("keep_alive")),
        options=split.load_options(),
        sampling=_sampling_from(body, split, logprobs),
        truncate=_bool(body, "truncate", True),
        default_system="" if raw else preset.system,
        history=[] if raw or context is not None else [dict(m) for m in preset.messages],
        template=template,
        suffix=_str(body, "suffix"),
        think=None if raw else _think(body),
        context=context,
        logprobs=logprobs,
        images=images,
    )


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


def parse_chat(body: dict, preset: Preset | None = None) -> ChatRequest:
    """``POST /api/chat``; ``preset``: the model's (see the module docstring)."""
    model = model_name(body)
    messages = body.get("messages", [])
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list")
    tools = _tools(body)
    preset = preset or Preset()
    split = split_options(_options_with(preset, body.get("options"), body.get("default_options")))
    msgs = [_chat_message(i, m) for i, m in enumerate(messages)]
    logprobs = _logprobs(body)
    # Ollama: the preset's messages go first; its system message before them, unless the
    # request opens with a system message of its own
    prefix = [{"role": m["role"], "content": m["content"]} for m in preset.messages]
    if preset.system and msgs and msgs[0]["role"] != "system":
        prefix.insert(0, {"role": "system", "content": preset.system})
    return ChatRequest(
        model=model,
        messages=msgs,
        stream=_bool(body, "stream", True),
        keep_alive=parse_keep_alive(body.get("keep_alive")),
        options=split.load_options(),
        sampling=_sampling_from(body, split, logprobs),
        tools=tools,
        prefix=prefix if msgs else [],
        template=_preset_template(preset.template),
        think=_think(body),
        truncate=_bool(body, "truncate", True),
        logprobs=logprobs,
    )


def _embed_common(body: dict, preset: Preset | None = None) -> tuple[str, LoadOptions, float | None]:
    model = model_name(body)
    split = split_options(_options_with(preset, body.get("options"), body.get("default_options")))
    return model, split.load_options(embedding=True), parse_keep_alive(body.get("keep_alive"))


def parse_embed(body: dict, preset: Preset | None = None) -> EmbedRequest:
    """``POST /api/embed``: ``input`` is a string or a list of strings (a preset's load options apply)."""
    model, opts, ka = _embed_common(body, preset)
    inp = body.get("input", "")
    if isinstance(inp, str):
        inputs = [inp] if inp else []
    elif isinstance(inp, list) and all(isinstance(s, str) for s in inp):
        inputs = list(inp)
    else:
        raise BadRequest("input must be a string or a list of strings")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise BadRequest(f"dimensions must be a positive whole number, got {shown(dims)}")
    return EmbedRequest(model=model, inputs=inputs, truncate=_bool(body, "truncate", True), keep_alive=ka,
                        options=opts, dimensions=dims)


def parse_embeddings(body: dict, preset: Preset | None = None) -> EmbedRequest:
    """``POST /api/embeddings`` (Ollama's older endpoint): one ``prompt``."""
    model, opts, ka = _embed_common(body, preset)
    prompt = _str(body, "prompt")
    return EmbedRequest(model=model, inputs=[prompt] if prompt else [], keep_alive=ka, options=opts, legacy=True)


def parse_show(body: dict) -> tuple[str, bool]:
    """``POST /api/show``: (model, verbose)."""
    return model_name(body), _bool(body, "verbose", False)


def parse_pull(body: dict) -> PullRequest:
    """``POST /api/pull``: ``model`` is what to pull (a URL, ``hf.co/owner/repo[:quant]``);
    our optional ``destination`` names it in the store (default: derived from the source)."""
    dest = body.get("destination")
    if dest is not None and (not isinstance(dest, str) or not dest.strip()):
        raise BadRequest("destination must be a model name")
    return PullRequest(source=model_name(body), name=dest.strip() if dest else None,
                       stream=_bool(body, "stream", True), insecure=_bool(body, "insecure", False))


def parse_copy(body: dict) -> tuple[str, str]:
    """``POST /api/copy``: (source, destination)."""
    return model_name(body, "source"), model_name(body, "destination")


def parse_delete(body: dict) -> str:
    """``DELETE /api/delete``."""
    return model_name(body)


_UNSUPPORTED_CREATE = {
    "quantize": "create: quantize is not supported; quantise the GGUF with llama.cpp's llama-quantize first",
    "adapters": "create: adapters (LoRA) are not supported; merge the adapter into the GGUF "
                "(llama.cpp's llama-export-lora) and create from that file",
}


def _create_messages(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest('messages must be a list of {"role": ..., "content": ...} objects')
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content", "")
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be system, user or assistant, not "
                             f"{json.dumps(role) if role is not None else 'missing'}")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        if m.get("images"):
            raise BadRequest(f"messages[{i}]: a model's messages cannot carry images")
        out.append({"role": role, "content": content})
    return out


def _create_license(raw) -> list[str]:
    if raw is None or raw == "":
        return []
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return [x for x in raw if x]
    raise BadRequest("license must be a string or a list of strings")


def parse_create(body: dict) -> CreateRequest:
    """``POST /api/create`` from uploaded blobs (``files``) or an existing model or GGUF file
    (``from``), with Ollama's preset fields: ``system``, ``template``, ``parameters`` (an
    object; ``stop`` may be a list), ``messages``, ``license`` (a string or a list)."""
    model = model_name(body)
    for key, why in _UNSUPPORTED_CREATE.items():
        if body.get(key):
            raise BadRequest(why)
    notes: list[str] = []
    template = _str(body, "template")
    if template:
        try:
            GoTemplate.parse(template)  # TemplateSyntaxError (a 400) for text that is no template
        except TemplateUnsupported as e:
            notes.append(f"the template uses {e}, which jupyter-llama cannot run: it is kept as written, and "
                         "requests use the model's own chat template")
    preset = Preset(system=_str(body, "system"), template=template,
                    parameters=parse_parameters(body.get("parameters")),
                    messages=_create_messages(body.get("messages")), license=_create_license(body.get("license")))
    files = body.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise BadRequest('files must be an object like {"model.gguf": "sha256:<hex>"}')
    if len(files) > 2:
        raise BadRequest("files: at most two GGUF files (a model and a multimodal projector)")
    from_ = body.get("from")
    if from_ is not None and (not isinstance(from_, str) or not from_.strip()):
        raise BadRequest("from must be a model name")
    if not files and not from_:
        raise BadRequest("create needs files (uploaded GGUF blobs) or from (an existing model)")
    return CreateRequest(model=model, files=dict(files), from_=from_.strip() if from_ else None,
                         stream=_bool(body, "stream", True), preset=preset, notes=notes)


# ----------------------------------------------------------------------------- chunks


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

    With log probabilities asked for (``top``, see :func:`_logprobs`), every event goes
    through ``feed``: a text event then carries them after its text, which the template
    would leave out. Each chunk has its tokens' ``logprobs``; ``combined`` all of them."""

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
    was rendered with the model's preset template (see the module docstring)."""

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

    @property
    def final(self) -> dict | None:
        return self.chat.final

    def feed(self, event: dict) -> list[dict]:
        return [self._as_generate(c) for c in self.chat.feed(event)]

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


# ----------------------------------------------------------------------------- bodies


def _get(info, key: str, default=None):
    if isinstance(info, dict):
        return info.get(key, default)
    return getattr(info, key, default)


def _expires(info: dict, now: float) -> str:
    exp = info.get("expires_at")
    if exp is not None:
        return rfc3339(exp)
    ka = info.get("keep_alive")
    if info.get("pinned") or ka is None or (isinstance(ka, float) and math.isinf(ka)):
        return (_dt.datetime.fromtimestamp(now, _dt.timezone.utc) + _FOREVER).isoformat()
    return rfc3339(now + float(ka))  # busy: it expires keep_alive after its last request ends


def ps_model(info: dict, gguf, now: float | None = None, projector: str | None = None) -> dict:
    """One ``/api/ps`` entry from ``Scheduler.ps()``'s dict and the model's GGUFInfo."""
    now = time.time() if now is None else now
    d = {
        "name": info["name"],
        "model": info["name"],
        "size": int(info.get("size") or 0),
        "size_vram": int(info.get("size_vram") or 0),
        "digest": info.get("digest") or "",
        "details": model_details(gguf, projector=projector),
        "expires_at": _expires(info, now),
        "context_length": int(info.get("context_length") or 0) or int(_get(gguf, "context_length") or 0),
    }
    # ours, beside Ollama's fields: what the scheduler knows
    d["state"] = info.get("state")
    d["also_as"] = info.get("also_as") or []  # other names of the same file it has answered to
    d["refcount"] = info.get("refcount", 0)
    d["pinned"] = bool(info.get("pinned"))
    d["last_used"] = rfc3339(info["last_used"]) if info.get("last_used") else None  # its last request began or ended
    d["options"] = info.get("options")
    d["layers_offloaded"] = info.get("layers_offloaded")
    d["layers_total"] = info.get("layers_total")
    d["pid"] = info.get("pid")
    d["memory"] = info.get("memory")
    d["by_device"] = info.get("by_device")  # bytes per device: cpu, cuda:N, rpc:HOST:PORT
    d["workers"] = info.get("workers") or []
    return d


def ps_body(models: Iterable[dict]) -> dict:
    return {"models": list(models)}


def tags_body(entries: Iterable) -> dict:
    """``/api/tags`` from store entries (each has ``to_api()``)."""
    return {"models": [e.to_api() for e in entries]}


def _modelfile(show: dict) -> str:
    """A Modelfile that recreates the model: FROM its weights (the model's GGUF, and its
    projector's), then its preset."""
    preset = Preset.from_dict(show.get("preset"))
    header = ["# Modelfile generated by jupyter-llama", "# To build a new Modelfile based on this, replace FROM with:",
              f"# FROM {show.get('name')}", ""]
    froms = [str(f.get("path")) for f in show.get("files") or [] if f.get("role") in ("model", "projector")]
    return write_modelfile(froms, system=preset.system, template=preset.template, parameters=preset.parameters,
                           messages=preset.messages, license=preset.license, header=header)


# Ollama's template for a model that has none: the prompt as it is.
BARE_PROMPT_TEMPLATE = "{{ .Prompt }}"


def capabilities_of(show: dict, arch: str) -> list[str]:
    """What the model can do, read from the model itself, in Ollama's words: ``completion``,
    ``embedding`` (it pools), ``tools`` and ``thinking`` (its chat template handles them),
    ``insert`` (fill-in-the-middle tokens), ``vision`` (a projector)."""
    meta = show.get("model_info") or {}
    template = str(show.get("template") or meta.get("tokenizer.chat_template") or "")
    caps = ["completion"]
    if meta.get(f"{arch}.pooling_type") not in (None, 0, "none"):
        caps.append("embedding")
    if "tools" in template:
        caps.append("tools")
    if any(k in template for k in ("<think>", "enable_thinking", "reasoning_content")):
        caps.append("thinking")
    if any(meta.get(k) is not None for k in ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")):
        caps.append("insert")
    if show.get("projector_info"):
        caps.append("vision")
    return caps


def model_capabilities(ref) -> list[str]:
    """:func:`capabilities_of` a resolved model (a ``models.ref.ModelRef``): its GGUF's
    metadata and chat template (the one llama-server runs), and its projector."""
    meta = dict(getattr(ref.info, "metadata", None) or {})
    return capabilities_of({"model_info": meta, "projector_info": bool(ref.mmproj)},
                           getattr(ref.info, "architecture", "") or "")


def check_capabilities(name: str, ref, wanted: Iterable[str]) -> None:
    """Ollama's answer to a request for what the model cannot do: a 400 naming the model
    and what it lacks (``"tiny" does not support tools``)."""
    wanted = list(wanted)
    if not wanted:
        return
    have = model_capabilities(ref)
    missing = [c for c in wanted if c not in have]
    if missing:
        raise BadRequest(f"{json.dumps(name)} does not support {' or '.join(missing)}")


def show_body(show: dict, verbose: bool = False, arrays: dict | None = None, tensors: list | None = None) -> dict:
    """``/api/show`` from ``ModelStore.show(name)``'s dict. Its metadata arrays (the
    tokenizer's tokens, merges, scores) are null, as Ollama answers; with ``verbose``, the
    file's arrays whole (``arrays``, from ``gguf_info.read_arrays``: Ollama sends them all,
    however long, hundreds of thousands of tokens for a real model) and ``tensors`` (its
    tensor table, ``TensorInfo``s) as Ollama's name, type and shape (innermost dimension
    first, as the file and llama.cpp list it)."""
    info = show.get("info") or {}
    arch = info.get("architecture") or show.get("architecture") or "unknown"
    arrays = arrays or {}
    model_info = {k: (arrays.get(k) if verbose else None) if isinstance(v, str) and v.startswith("[array of") else v
                  for k, v in (show.get("model_info") or {}).items()}
    model_info.setdefault("general.architecture", arch)
    model_info["general.parameter_count"] = info.get("parameter_count") or show.get("parameters") or 0
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length"):
        if info.get(key) is not None:
            model_info.setdefault(f"{arch}.{key}", info[key])
    if not verbose:
        model_info.pop("tokenizer.chat_template", None)
    capabilities = capabilities_of(show, arch)
    preset = Preset.from_dict(show.get("preset"))
    return {
        "license": "\n".join(preset.license) or str((show.get("model_info") or {}).get("general.license", "") or ""),
        "modelfile": _modelfile(show),
        "parameters": parameters_text(preset.parameters),
        # the preset's (Ollama Go) template as written; else the GGUF's own chat template; else
        # Ollama's default, the bare prompt, which chat then runs (see engine.launch)
        "template": preset.template or show.get("template") or BARE_PROMPT_TEMPLATE,
        "system": preset.system,
        "messages": [dict(m) for m in preset.messages],
        "details": show.get("details") or model_details(info),
        "model_info": model_info,
        "modified_at": show.get("modified_at") or "",
        "capabilities": capabilities,
        # ours
        "has_chat_template": bool(preset.template or show.get("template")),
        "name": show.get("name"),
        "digest": show.get("digest"),
        "size": show.get("size"),
        "files": show.get("files"),
        "source": show.get("source"),
        "preset": preset.to_dict(),  # what the model carries besides its weights, as stored
        **({"tensors": [{"name": t.name, "type": t.ggml_type, "shape": list(t.shape)} for t in tensors]}
           if verbose and tensors is not None else {}),
    }


def mean_pool_normalize(vectors) -> list[float]:
    """One unit-length vector from llama-server's embedding output.

    ``/embedding`` answers one vector per input when the model pools, or one per token
    when it does not (pooling ``none``); the latter is mean-pooled here. Ollama's
    embeddings are L2-normalised, so these are too.
    """
    import numpy as np

    arr = np.asarray(vectors, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr.mean(axis=0)
    norm = float(np.linalg.norm(arr))
    if norm > 0:
        arr = arr / norm
    return arr.tolist()


def unit_vectors(raw: list) -> list[list[float]]:
    """One unit vector per input from ``/embedding``'s items (see :func:`mean_pool_normalize`)."""
    return [mean_pool_normalize(v) for v in raw]


def embed_body(model: str, embeddings: list[list[float]], total_s: float, load_s: float, prompt_tokens: int,
               dimensions: int | None = None) -> dict:
    if dimensions:
        embeddings = [mean_pool_normalize(e[:dimensions]) for e in embeddings]
    return {"model": model, "embeddings": embeddings, "total_duration": int(total_s * 1e9),
            "load_duration": int(load_s * 1e9), "prompt_eval_count": prompt_tokens}
