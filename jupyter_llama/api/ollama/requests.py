"""Ollama's requests, parsed and checked: ``parse_*`` take a decoded JSON body and return a
small dataclass holding what goes to llama-server (load options, sampling fields, the
prompt's parts), or raise :class:`~jupyter_llama.errors.BadRequest` with a message that
says what is wrong.

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
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from ...config import json_kind, shown
from ...errors import BadRequest
from ...load_options import LoadOptions
from ...models.preset import Preset
from ..gotemplate import GoTemplate, TemplateUnsupported
from ..options import format_to_schema, parse_keep_alive, parse_parameters, split_options, with_sampling_defaults
from .fields import _bool, _str, model_name
from .messages import _chat_message, _image_type, _images


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
        words: dict[str, bool | str] = {"max": "high", "true": True, "false": False}
        return words.get(v, v)
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
