"""The scheduler's settings: one parser for every source (the environment, the extension's traits).

Plain data: the policy (:mod:`.policy`) reads these, and the loop (:mod:`.loop`) holds one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .. import config
from ..config import ConfigError, parse_duration
from ..memory import devices as devmod
from ..memory import rpc
from ..memory.report import COARSE, DETAILED

SAFETY_MARGIN_VAR = config.ENV_PREFIX + "SAFETY_MARGIN"


def format_margin(margin: float) -> str:
    """A safety margin as people write it: ``10%``, ``4.5%``."""
    return f"{margin * 100:.3g}%"


def _text(value: object) -> str | None:
    """A text setting as given, None where it is not: its traits and variables are strings."""
    assert value is None or isinstance(value, str), value
    return value


def parse_margin(value, what: str = SAFETY_MARGIN_VAR) -> float:
    """A safety margin from ``10%`` or ``0.1`` (a number is taken as it is); the range is
    checked by :meth:`SchedulerSettings.validate`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a percentage (10%) or a fraction (0.1), got {config.shown(value)}") from None


@dataclass
class SchedulerSettings:
    binary: str = ""
    keep_alive: float = 300.0  # seconds; inf = forever
    max_loaded_models: int = 0  # 0 = 3 x max(GPUs, 1)
    max_queue: int = 512
    load_timeout: float = 300.0
    fit_estimator: str = "detailed"  # or "coarse"
    safety_margin: float = 0.10  # added to the detailed estimate when fitting (JUPYTER_LLAMA_SAFETY_MARGIN)
    evict_pinned: bool = False
    num_parallel: int | None = None  # default slots per runner (None: llama-server's auto)
    budgets: devmod.Budgets = field(default_factory=devmod.Budgets)
    recovery_timeout: float = 5.0  # after an unload, wait up to this for GPU memory to come back
    recovery_poll: float = 0.25
    rpc_workers: tuple[str, ...] = ()  # llama.cpp RPC workers (HOST:PORT), each a device
    worker_timeout: float = 2.0  # a probe of a worker gives up after this (never a hang)
    peers_dir: str = ""  # where this user's managers publish what they hold (memory.peers); "" = alone
    manager_url: str = ""  # this manager's API root, for the others' messages

    # The settings a person sets (an environment variable each, or a LlamaExtension trait).
    SETTABLE = ("keep_alive", "max_loaded_models", "max_queue", "load_timeout", "fit_estimator", "evict_pinned",
                "num_parallel", "memory_limit", "gpu_overhead", "rpc_workers")
    # Settings a person sets by their environment variable only (no LlamaExtension trait names
    # them): ``from_values`` reads them from the environment unless ``values`` gives them.
    FROM_ENV_ONLY = ("safety_margin",)

    @classmethod
    def from_values(cls, values: Mapping[str, object], label: Callable[[str], str],
                    environ: Mapping[str, str] | None = None, **overrides) -> "SchedulerSettings":
        """Settings from ``values`` (keys from :attr:`SETTABLE` and :attr:`FROM_ENV_ONLY`;
        strings are parsed, typed values taken as they are, None or "" leave the default).
        ``label(key)`` names the setting in error messages (``JUPYTER_LLAMA_KEEP_ALIVE``,
        ``LlamaExtension.keep_alive``). A :attr:`FROM_ENV_ONLY` setting that ``values`` does
        not give is read from ``environ`` (default ``os.environ``) and named by its variable."""
        unknown = set(values) - set(cls.SETTABLE) - set(cls.FROM_ENV_ONLY)
        if unknown:
            raise ConfigError(f"unknown scheduler settings: {', '.join(sorted(unknown))}")
        given = {k: v for k, v in values.items() if v is not None and v != ""}
        environ = os.environ if environ is None else environ
        labels = {k: label(k) for k in given}
        for key in cls.FROM_ENV_ONLY:
            var = config.ENV_PREFIX + key.upper()
            if key not in given and environ.get(var, "").strip():
                given[key], labels[key] = environ[var], var
        s = cls()
        if "keep_alive" in given:
            s.keep_alive = parse_duration(given["keep_alive"], label("keep_alive"))
        if "load_timeout" in given:
            s.load_timeout = parse_duration(given["load_timeout"], label("load_timeout"))
        for key in ("max_loaded_models", "max_queue"):
            if key in given:
                setattr(s, key, config.parse_int(given[key], label(key)))
        if "num_parallel" in given:  # 0 means automatic, as unset does
            s.num_parallel = config.parse_int(given["num_parallel"], label("num_parallel")) or None
        if "fit_estimator" in given:
            s.fit_estimator = str(given["fit_estimator"]).strip()
        if "evict_pinned" in given:
            s.evict_pinned = config.parse_bool(given["evict_pinned"], label("evict_pinned"))
        if "safety_margin" in given:
            s.safety_margin = parse_margin(given["safety_margin"], labels["safety_margin"])
        s.budgets = devmod.budgets_from(_text(given.get("memory_limit")), _text(given.get("gpu_overhead")),
                                        label("memory_limit"), label("gpu_overhead"))
        s.rpc_workers = rpc.parse_workers(_text(given.get("rpc_workers")), label("rpc_workers"))
        for k, v in overrides.items():
            setattr(s, k, v)
        s.validate(lambda k: labels.get(k) or label(k))
        return s

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "SchedulerSettings":
        environ = os.environ if environ is None else environ
        keys = cls.SETTABLE + cls.FROM_ENV_ONLY
        values = {k: environ.get(config.ENV_PREFIX + k.upper()) for k in keys}  # JUPYTER_LLAMA_KEEP_ALIVE, ...
        return cls.from_values(values, lambda k: config.ENV_PREFIX + k.upper(), environ, **overrides)

    def validate(self, label: Callable[[str], str] = lambda k: config.ENV_PREFIX + k.upper()) -> None:
        if self.fit_estimator not in (COARSE, DETAILED):
            raise ConfigError(f"{label('fit_estimator')} must be 'coarse' or 'detailed', got {self.fit_estimator!r}")
        if self.max_queue < 1:
            raise ConfigError(f"{label('max_queue')} must be at least 1, got {self.max_queue}")
        if self.max_loaded_models < 0:
            raise ConfigError(f"{label('max_loaded_models')} must be 0 (automatic) or more, "
                              f"got {self.max_loaded_models}")
        # (each of these was taken, and every load or request then failed in words that blamed it)
        if self.num_parallel is not None and not 0 <= self.num_parallel <= 256:  # (0: automatic, as None)
            raise ConfigError(f"{label('num_parallel')} must be 0 (automatic) or 1 to 256 request slots per model, "
                              f"got {self.num_parallel}")
        if not self.load_timeout > 0:
            raise ConfigError(f"{label('load_timeout')} must be a duration above 0 (how long a loading model may "
                              f"stay silent; -1 for never), got {self.load_timeout:g}s")
        if not 0 <= self.safety_margin <= 1:  # (a NaN fails this too)
            raise ConfigError(f"{label('safety_margin')} must be 0% to 100% (what the fit adds to the detailed "
                              f"estimate; 10% is written 10% or 0.1), got {self.safety_margin:g}")
