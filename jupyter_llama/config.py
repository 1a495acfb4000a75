"""Settings shared by the core: environment variables, sizes and durations.

Every setting has an environment variable ``JUPYTER_LLAMA_<NAME>``; the server extension
exposes the same settings as traitlets whose defaults come from here.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

ENV_PREFIX = "JUPYTER_LLAMA_"


class ConfigError(ValueError):
    """A setting's value could not be understood; the message names the setting."""


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def shown(value) -> str:
    """A value as a person reads it in a message: JSON's spelling (true, null, "text"), not
    Python's (True, None, 'text'), and cut when long."""
    import json

    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_kind(value) -> str:
    """What a JSON value is, as a message names it ("null", "a number", "an array"), not
    Python's type name ("NoneType", "int", "list")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``"8GiB"``, ``"8G"``, ``"8000MB"``, ``"512MiB"`` or a plain number of bytes.

    KiB/MiB/GiB are binary and KB/MB/GB decimal; a bare K, M, G or T is read as binary, as
    ``free -g`` and llama.cpp's MiB figures mean it. ``what`` names the setting in errors.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{what}: expected a size such as 8GiB, got {shown(text)}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"{what}: a size cannot be negative ({text})")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {shown(text)} is not a size; write bytes or a number with a unit, "
                          "e.g. 8GiB, 512MiB, 8000MB")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit in ("k", "m", "g", "t"):  # bare letters: binary, like `free -g` and llama.cpp's MiB figures
        unit += "ib"
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"{what}: unknown unit {shown(m.group(2))} in {shown(text)}; "
                          "use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")
    return int(number * _SIZE_UNITS[unit])


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_SCALE = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# Longer than this is forever: a timer past it would overflow the clocks that show it
# (``expires_at``), and a century of keep-alive is not a different wish from "keep it".
FOREVER_AFTER = 100 * 365 * 86400.0


def parse_duration(value, what: str = "keep_alive") -> float:
    """Seconds from an Ollama-style duration.

    Numbers are seconds; strings are Go-style durations (``"10m"``, ``"1h30m"``, ``"250ms"``)
    or a bare number of seconds (``"300"``, ``"-1"``). Negative means forever (returned as
    ``math.inf``), and so does anything past :data:`FOREVER_AFTER`; zero means at once.
    """
    seconds = _parse_duration(value, what)
    return math.inf if seconds > FOREVER_AFTER else seconds


def _parse_duration(value, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{what}: expected a number of seconds or a duration like '5m', got {shown(value)}")
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise ConfigError(f"{what}: NaN is not a duration")
        return math.inf if value < 0 else float(value)
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        return math.inf if number < 0 else number
    negative = text.startswith("-")
    body = text[1:] if negative else text
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_SCALE[m.group(2)]
        pos = m.end()
    if pos != len(body) or not body:
        raise ConfigError(f"{what}: {shown(value)} is not a duration; use seconds (300), "
                          "or units like '10m', '1h30m', '-1' for forever")
    if negative:
        return math.inf
    return total


def format_duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "forever"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m}m{s:02d}s" if s else f"{m}m"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(ENV_PREFIX + name)
    return default if value is None or value == "" else value


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """A setting that names one of ``choices`` (the first is the default), any case; a
    ConfigError for another word (it was taken as the default without a word)."""
    value = (env(name) or choices[0]).strip().lower()
    if value not in choices:
        raise ConfigError(f"{ENV_PREFIX}{name}: {value!r} is not one of {', '.join(choices)} "
                          f"(unset: {choices[0]})")
    return value


def parse_bool(value, what: str) -> bool:
    """The one way a setting says yes or no: 1/0, true/false, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: expected 1/0, true/false, yes/no or on/off, got {shown(value)}")


def parse_int(value, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{what}: expected a whole number, got {shown(value)}") from None


def cache_dir() -> Path:
    """Per-user, per-machine cache (engine builds): ``$XDG_CACHE_HOME/jupyter-llama``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jupyter-llama"


# ----------------------------------------------------------------------------- default context

CONTEXT_LENGTH_VAR = ENV_PREFIX + "CONTEXT_LENGTH"
OLLAMA_CONTEXT_LENGTH_VAR = "OLLAMA_CONTEXT_LENGTH"  # Ollama's own name for it, honoured as Ollama does
MIN_CONTEXT = 16  # the least num_ctx a load takes (LoadOptions says the same of a request's)
MAX_CONTEXT = 1 << 27  # the most (far beyond any model's training context)
_WARNED: set[str] = set()  # Ollama's values already warned about (once each, not on every request)

# Ollama's default context when no setting gives one: by the GPUs' total memory, the first
# tier that the total reaches (47 and 23 GiB: a little under 48 and 24, so that a card that
# reports slightly less than its label still counts), else the last.
CONTEXT_TIERS = ((47 * 1024**3, 262144), (23 * 1024**3, 32768))
SMALL_CONTEXT = 4096


def context_for_gpu_memory(total: int) -> int:
    """Ollama's default context for ``total`` bytes of GPU memory in all (0: no GPU)."""
    return next((ctx for least, ctx in CONTEXT_TIERS if total >= least), SMALL_CONTEXT)


def context_length(environ=None) -> tuple[int, str] | None:
    """The default context set by the environment, and the variable that set it:
    ``JUPYTER_LLAMA_CONTEXT_LENGTH``, else Ollama's ``OLLAMA_CONTEXT_LENGTH``; None when neither
    sets one (unset, empty or 0, which Ollama also reads as unset): the default then follows
    the GPUs' memory (:func:`context_for_gpu_memory`).

    Ours must be a whole number of at least :data:`MIN_CONTEXT` (a ConfigError naming it
    otherwise). Ollama's variable is read as Ollama reads it: a value it cannot read is left
    out with a warning in the log, and one below the least a load takes is raised to it."""
    environ = os.environ if environ is None else environ
    ours = (environ.get(CONTEXT_LENGTH_VAR) or "").strip()
    if ours:
        n = parse_int(ours, CONTEXT_LENGTH_VAR)
        if n and not MIN_CONTEXT <= n <= MAX_CONTEXT:
            raise ConfigError(f"{CONTEXT_LENGTH_VAR} must be 0 (unset) or {MIN_CONTEXT} to {MAX_CONTEXT} tokens, "
                              f"got {n}")
        if n:
            return n, CONTEXT_LENGTH_VAR
    theirs = (environ.get(OLLAMA_CONTEXT_LENGTH_VAR) or "").strip().strip("\"'")  # (Ollama drops quotes too)
    if not theirs:
        return None
    if not (theirs.isascii() and theirs.isdigit()):
        if theirs not in _WARNED:
            import logging

            _WARNED.add(theirs)
            logging.getLogger("jupyter_llama").warning(
                "jupyter-llama: %s=%s is not a whole number of tokens; it is left out, as Ollama leaves it out",
                OLLAMA_CONTEXT_LENGTH_VAR, shown(theirs))
        return None
    n = int(theirs)
    return (min(max(n, MIN_CONTEXT), MAX_CONTEXT), OLLAMA_CONTEXT_LENGTH_VAR) if n else None
