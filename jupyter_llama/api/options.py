"""Ollama's ``options`` object, split into what starts a child and what shapes one request.

Ollama puts load-time settings (``num_ctx``, ``num_gpu`` ...) and sampling settings
(``temperature``, ``top_k`` ...) in one ``options`` dict. Here they part ways:

* load options become a :class:`~jupyter_llama.engine.launch.LoadOptions` (changing one
  reloads the model, REFERENCE section 5);
* sampling options become the fields of llama-server's ``/completion`` (and of its
  OpenAI-compatible endpoints, which read the same names), per request, never a reload.

Unknown names are ignored with a line in the log, as Ollama ignores them; a known name with
a value of the wrong kind is refused with HTTP 400 naming it. A few options Ollama still
accepts but no longer uses are accepted and ignored (:data:`IGNORED_OPTIONS`). Sampling
options a request leaves unset get Ollama's defaults (:data:`OLLAMA_SAMPLING_DEFAULTS`).

Pure functions; the only errors raised are :class:`~jupyter_llama.scheduler.BadRequest`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import ConfigError, json_kind, parse_duration, shown
from ..errors import BadRequest
from ..load_options import FLASH_ATTN, KV_CACHE_TYPES, LoadOptions, LoadOptionsError

__all__ = [
    "LOAD_OPTIONS",
    "SAMPLING_OPTIONS",
    "IGNORED_OPTIONS",
    "SplitOptions",
    "split_options",
    "OLLAMA_SAMPLING_DEFAULTS",
    "with_sampling_defaults",
    "load_options",
    "parse_keep_alive",
    "format_to_schema",
    "parameter_kind",
    "parse_parameters",
    "parameter_from_text",
    "parameters_text",
    "format_parameter",
]

# Ollama name -> LoadOptions field. Ours (num_parallel, cache types, flash_attn ...) too.
LOAD_OPTIONS: dict[str, str] = {
    "num_ctx": "num_ctx",
    "num_batch": "num_batch",
    "num_ubatch": "num_ubatch",
    "num_gpu": "num_gpu",
    "main_gpu": "main_gpu",
    "use_mmap": "use_mmap",
    "num_thread": "num_thread",
    "num_parallel": "num_parallel",
    "flash_attn": "flash_attn",
    "cache_type_k": "cache_type_k",
    "cache_type_v": "cache_type_v",
    "kv_cache_type": "kv_cache_type",  # Ollama's server-wide OLLAMA_KV_CACHE_TYPE, per request: sets both
    "kv_unified": "kv_unified",
}

# Ollama name -> (llama-server field, kind). Kinds: int, float, bool, stop.
SAMPLING_OPTIONS: dict[str, tuple[str, str]] = {
    "num_predict": ("n_predict", "int"),
    "num_keep": ("n_keep", "int"),
    "seed": ("seed", "int"),
    "temperature": ("temperature", "float"),
    "top_k": ("top_k", "int"),
    "top_p": ("top_p", "float"),
    "min_p": ("min_p", "float"),
    "typical_p": ("typical_p", "float"),
    "repeat_last_n": ("repeat_last_n", "int"),
    "repeat_penalty": ("repeat_penalty", "float"),
    "presence_penalty": ("presence_penalty", "float"),
    "frequency_penalty": ("frequency_penalty", "float"),
    "mirostat": ("mirostat", "int"),
    "mirostat_tau": ("mirostat_tau", "float"),
    "mirostat_eta": ("mirostat_eta", "float"),
    "stop": ("stop", "stop"),
    # llama.cpp samplers that Ollama does not name, under llama.cpp's names
    "top_n_sigma": ("top_n_sigma", "float"),
    "xtc_probability": ("xtc_probability", "float"),
    "xtc_threshold": ("xtc_threshold", "float"),
    "dry_multiplier": ("dry_multiplier", "float"),
    "dry_base": ("dry_base", "float"),
    "dry_allowed_length": ("dry_allowed_length", "int"),
    "dry_penalty_last_n": ("dry_penalty_last_n", "int"),
    "ignore_eos": ("ignore_eos", "bool"),
}

# Ollama's sampling defaults (its api.DefaultOptions, at the version REFERENCE.md pins), under
# llama-server's names: what its runner sends the child for every option a request and the
# model's preset leave unset. Sent the same way here, so that a bare request samples as it
# would in Ollama, not with llama-server's own defaults (top_p 0.95, min_p 0.05, no repeat
# penalty). Left out, as Ollama leaves them out: num_predict (an answer ends when the
# request's context is full; see docs/settings.md), num_keep and seed (llama-server's own
# default seed is Ollama's -1, a random one), and the samplers Ollama does not name.
OLLAMA_SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    # llama.cpp's order of its samplers, with top_k moved before the penalties: they then
    # look at the top_k candidates, not at every token of the vocabulary (a lookup per entry
    # a token, which a large vocabulary feels: bench/sampling_defaults.py and
    # bench/PERFORMANCE.md say how much). The penalties only lower a recent token's logit, so the
    # two orders choose alike unless every one of the top_k candidates was among the last
    # repeat_last_n tokens.
    "samplers": ["top_k", "penalties", "dry", "top_n_sigma", "typ_p", "top_p", "min_p", "xtc", "temperature"],
}


def with_sampling_defaults(sampling: dict) -> dict:
    """``sampling`` (llama-server fields) over :data:`OLLAMA_SAMPLING_DEFAULTS`: what an Ollama
    API request sends the child."""
    return {**OLLAMA_SAMPLING_DEFAULTS, **sampling}


# Accepted for compatibility (older clients send them) and ignored, as Ollama does.
IGNORED_OPTIONS = frozenset({
    "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "tfs_z", "penalize_newline",
})


@dataclass
class SplitOptions:
    """An ``options`` dict taken apart."""

    load: dict[str, Any] = field(default_factory=dict)  # LoadOptions field -> value
    sampling: dict[str, Any] = field(default_factory=dict)  # llama-server field -> value
    ignored: list[str] = field(default_factory=list)

    def load_options(self, **extra) -> LoadOptions:
        return load_options(self.load, **extra)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _checked(kind: str, value, wrong: "Callable[[str], BadRequest]"):
    """``value`` checked for its kind (``int``, ``float``, ``bool``, ``stop``, ``flash_attn``,
    ``cache``: see :func:`parameter_kind`) and normalised (a whole float becomes an int, a
    single stop string a list); else ``wrong(what was expected)``, raised. Request options
    and a model's parameters are checked by this one function, in their own words."""
    if kind == "stop":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return list(value)
        raise wrong("a string or a list of strings")
    if kind == "bool":
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if kind == "flash_attn":
        if isinstance(value, bool) or value in FLASH_ATTN:
            return value
        raise wrong(f"true, false or one of {', '.join(FLASH_ATTN)}")
    if kind == "cache":
        if value not in KV_CACHE_TYPES:
            raise wrong(f"a KV cache type ({', '.join(KV_CACHE_TYPES)})")
        return value
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise wrong("a whole number" if kind == "int" else "a number")
    if kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise wrong("a whole number")
            value = int(value)
        return value
    return float(value)


# The least a whole-number option may be, where llama-server refuses less (its own message
# names its field, not ours): -1 means "the whole context" for the two windows (see
# Runner._windows), "keep the whole prompt" for num_keep. Every whole number is a 32-bit one.
_INT_FLOOR = {"num_keep": -1, "repeat_last_n": -1, "dry_penalty_last_n": -1, "dry_allowed_length": 0}
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT_CEILING = {"seed": (1 << 32) - 1}  # (an unsigned 32-bit number to llama.cpp; -1 is a random one)


def _option_value(name: str, kind: str, value):
    """A request's option, checked (:func:`_checked`) and as the child takes it."""
    v = _checked(kind, value, lambda expected: BadRequest(f"option {name} must be {expected}, got {shown(value)}"))
    if kind == "int" and name in SAMPLING_OPTIONS:  # (a load option's bounds are LoadOptions' to say)
        low, high = _INT_FLOOR.get(name, _INT32[0]), _INT_CEILING.get(name, _INT32[1])
        if not low <= v <= high:
            raise BadRequest(f"option {name} must be a whole number from {low} to {high}, got {shown(value)}")
    if name == "num_predict" and (v < -1 or v == 0):
        # Ollama's -2 (fill the context), and 0 (its runner stops at a count above 0 only):
        # no limit, llama-server's -1 (its 0 made one token)
        return -1
    if kind == "flash_attn" and isinstance(v, bool):
        return "on" if v else "off"
    return v


log = logging.getLogger("jupyter_llama")
_REPORTED: set[str] = set()  # unknown option names already logged once


def split_options(options: dict | None) -> SplitOptions:
    """Split an Ollama ``options`` object; BadRequest naming any unknown or ill-typed option."""
    out = SplitOptions()
    if options is None:
        return out
    if not isinstance(options, dict):
        raise BadRequest(f"options must be a JSON object, got {json_kind(options)}")
    unknown = sorted(k for k in options if k not in LOAD_OPTIONS and k not in SAMPLING_OPTIONS
                     and k not in IGNORED_OPTIONS)
    for name in unknown:  # Ollama ignores what it does not know (old clients send num_gqa, ...)
        out.ignored.append(name)
        if name not in _REPORTED:
            _REPORTED.add(name)
            log.info("jupyter-llama: ignoring the unknown option %r (it is not one of Ollama's)", name)
    for name, value in options.items():
        if name in unknown:
            continue
        if name in IGNORED_OPTIONS:
            out.ignored.append(name)
        elif name in LOAD_OPTIONS:
            if value is None:
                continue
            v = _option_value(name, _load_kind(name), value)
            if name == "kv_cache_type":
                out.load.setdefault("cache_type_k", v)
                out.load.setdefault("cache_type_v", v)
            else:
                out.load[LOAD_OPTIONS[name]] = v
        else:
            if value is None:
                continue
            field_name, kind = SAMPLING_OPTIONS[name]
            out.sampling[field_name] = _option_value(name, kind, value)
    return out


def load_options(values: dict, **extra) -> LoadOptions:
    """A LoadOptions from split load values; its own validation errors become BadRequest."""
    data = dict(values)
    data.update({k: v for k, v in extra.items() if v is not None})
    if data.get("num_gpu") is not None and data["num_gpu"] < 0:
        data["num_gpu"] = None  # -1: automatic
    try:
        return LoadOptions(**data)
    except LoadOptionsError as e:
        raise BadRequest(f"bad option: {e}") from None
    except TypeError as e:  # pragma: no cover - a name mapped to a missing field
        raise BadRequest(f"bad option: {e}") from None


def parse_keep_alive(value) -> float | None:
    """Seconds from a request's ``keep_alive`` (None when absent); BadRequest when unreadable.

    JSON numbers are seconds, strings are durations (``"10m"``, ``"1h30m"``, ``"-1"``);
    negative means forever (``math.inf``).
    """
    if value is None:
        return None
    try:
        return parse_duration(value, "keep_alive")
    except ConfigError as e:
        raise BadRequest(str(e)) from None


def format_to_schema(fmt) -> dict | None:
    """Ollama's ``format`` (``"json"`` or a JSON schema object) as llama-server's ``json_schema``."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "object"}  # Ollama's JSON mode answers with an object
    if isinstance(fmt, dict):
        return fmt
    raise BadRequest(f'format must be "json" or a JSON schema object, got {shown(fmt)}')


# ----------------------------------------------------------------------------- presets

# The kind of each load option's value (sampling options carry theirs in SAMPLING_OPTIONS).
_LOAD_KINDS = {"use_mmap": "bool", "kv_unified": "bool", "flash_attn": "flash_attn", "cache_type_k": "cache",
               "cache_type_v": "cache", "kv_cache_type": "cache"}
_TRUE = ("1", "t", "T", "true", "TRUE", "True")  # what a Modelfile may write for true/false (Go's spellings)
_FALSE = ("0", "f", "F", "false", "FALSE", "False")


def parameter_kind(name: str) -> str | None:
    """The kind of a model parameter's value (``int``, ``float``, ``bool``, ``stop``,
    ``flash_attn``, ``cache``), or None for a name that is not a parameter."""
    if name in SAMPLING_OPTIONS:
        return SAMPLING_OPTIONS[name][1]
    if name in LOAD_OPTIONS:
        return _load_kind(name)
    return None


def _load_kind(name: str) -> str:
    """The kind of a load option's value (one of :data:`LOAD_OPTIONS`): ``int`` unless it says otherwise."""
    return _LOAD_KINDS.get(name, "int")


def _unknown_parameter(name: str, where: str) -> BadRequest:
    import difflib

    known = sorted(set(LOAD_OPTIONS) | set(SAMPLING_OPTIONS))
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    return BadRequest(f'{where}: unknown parameter "{name}"{hint}; the parameters a model can carry are '
                      f"{', '.join(known)}")


def _wrong_parameter(where: str, name: str, value: Any) -> Callable[[str], BadRequest]:
    """The error for a parameter whose value is not of its kind, given what was expected."""
    return lambda expected: BadRequest(f"{where}: parameter {name} must be {expected}, not {shown(value)}")


def parse_parameters(raw, where: str = "parameters") -> dict:
    """A model's ``parameters`` (``/api/create``, a Modelfile's PARAMETER lines) checked: Ollama's
    option names (and ours, such as ``num_parallel``), each value of its kind; ``stop`` always a
    list. Options Ollama no longer uses (:data:`IGNORED_OPTIONS`) are dropped. BadRequest, in
    words, for an unknown name or a value of the wrong kind or out of range."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest(f'{where} must be an object of parameter names and values, such as {{"temperature": 0.7}}')
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None or name in IGNORED_OPTIONS:
            continue
        kind = parameter_kind(name)
        if kind is None:
            raise _unknown_parameter(name, where)
        out[name] = _checked(kind, value, _wrong_parameter(where, name, value))
    try:  # the ranges requests are held to (num_ctx at least 16, ...), checked now rather than at first use
        split_options(out).load_options()
    except BadRequest as e:
        raise BadRequest(f"{where}: {e}".replace("bad option: ", "")) from None
    return out


def parameter_from_text(name: str, text: str, where: str = "PARAMETER"):
    """The value a Modelfile line ``PARAMETER name text`` means (typed as the API takes it)."""
    kind = parameter_kind(name)
    if kind is None:
        raise _unknown_parameter(name, where)
    t = text.strip()

    def wrong(expected: str) -> BadRequest:
        return BadRequest(f"{where} {name}: {shown(text)} is not {expected}")

    if kind == "stop":
        return text
    if kind in ("bool", "flash_attn"):
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        if kind == "flash_attn" and t in FLASH_ATTN:
            return t
        raise wrong("true or false" + (f" or one of {', '.join(FLASH_ATTN)}" if kind == "flash_attn" else ""))
    if kind == "cache":
        if t not in KV_CACHE_TYPES:
            raise wrong(f"a KV cache type ({', '.join(KV_CACHE_TYPES)})")
        return t
    if kind == "int":
        try:
            return int(t, 10)
        except ValueError:
            raise wrong("a whole number") from None
    try:
        v = float(t)
    except ValueError:
        raise wrong("a number") from None
    if not math.isfinite(v):
        raise wrong("a finite number")
    return v


def format_parameter(value, quoted: bool = True) -> str:
    """One parameter value as text: strings quoted (``show``'s ``parameters``) or not (a
    Modelfile's PARAMETER line), numbers without a needless ``.0``, booleans as true/false."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False) if quoted else value
    return str(value)


def parameters_text(params: dict) -> str:
    """Ollama's ``parameters`` text of ``/api/show``: one ``name value`` line each (one per stop
    sequence), the name padded to 30 columns."""
    lines = []
    for name, value in (params or {}).items():
        for v in (value if isinstance(value, list) else [value]):
            lines.append(f"{name:<30} {format_parameter(v)}")
    return "\n".join(lines)
