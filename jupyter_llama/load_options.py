"""Load options: everything that decides how a model's llama-server child is started.

A base module (it imports nothing of the package) because every layer speaks it: the
estimators predict for a set of options, the engine turns them into a command line, the
scheduler compares them, the API parses them from requests.

The manager decides *what* to load; llama.cpp decides *how* to place it. So ``-ngl`` is
passed only when the user sets ``num_gpu`` (REFERENCE section 1): ``num_gpu > 0`` gives
``-ngl N``, ``0`` gives ``-ngl 0`` (CPU only), and ``None``/``-1`` (automatic) passes
nothing, leaving llama.cpp's ``--fit`` to choose the split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import shown

AUTO_SLOTS = 4  # what llama-server's automatic -np gives
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_ATTN = ("auto", "on", "off")
QUANTIZED_KV = frozenset(KV_CACHE_TYPES) - {"f32", "f16", "bf16"}  # (a V cache of these needs flash attention)


class LoadOptionsError(ValueError):
    """A load option has a value llama-server would refuse; the message says which."""


@dataclass(frozen=True)
class LoadOptions:
    """Everything that decides how a child is started. Changing any of these needs a reload.

    ``None`` means automatic: the option is not passed and llama.cpp picks the value.
    Sampling options (temperature, top_k, ...) are per request and deliberately absent.
    """

    num_ctx: int | None = None  # context per request; None = automatic (default_ctx, else the training context)
    # What an automatic num_ctx stands for: Ollama's default context capped at the training
    # context, filled in (whether num_ctx is set or not) by memory.estimate.within_training.
    # None, with num_ctx None: llama-server's own choice, the training context, which llama.cpp's
    # fit may shrink.
    default_ctx: int | None = None
    num_parallel: int | None = None  # -np; None = llama-server's auto (4 slots, unified KV)
    num_gpu: int | None = None  # -ngl; None or -1 = automatic placement by llama.cpp
    main_gpu: int | None = None  # -mg
    num_batch: int | None = None  # -b
    num_ubatch: int | None = None  # -ub
    num_thread: int | None = None  # -t
    use_mmap: bool | None = None  # --load-mode mmap | none
    flash_attn: str | None = None  # -fa on|off|auto
    cache_type_k: str | None = None  # -ctk
    cache_type_v: str | None = None  # -ctv
    kv_unified: bool | None = None  # -kvu / -no-kvu
    mmproj: str | None = None  # --mmproj FILE (multimodal projector)
    mmproj_offload: bool = True  # False gives --no-mmproj-offload
    embedding: bool = False  # --embedding (embedding models)
    fit: bool | None = None  # llama.cpp's own fitting of unset options to free memory (-fit on|off)
    fit_target_mib: tuple[int, ...] | None = None  # --fit-target: free MiB llama.cpp must leave per device
    rpc: tuple[str, ...] | None = None  # --rpc: the RPC workers (HOST:PORT) this child may use

    def __post_init__(self):
        def positive(name, allow_zero=False):
            v = getattr(self, name)
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int):
                raise LoadOptionsError(f"{name} must be a whole number, got {shown(v)}")
            if v < 0 or (v == 0 and not allow_zero):
                raise LoadOptionsError(f"{name} must be {'0 or more' if allow_zero else 'at least 1'}, got {v}")

        if self.num_gpu is not None and self.num_gpu < 0:
            object.__setattr__(self, "num_gpu", None)  # -1 is Ollama's "automatic"
        if self.num_ctx == 0:
            object.__setattr__(self, "num_ctx", None)  # 0 is "automatic" in Ollama's API too
        positive("num_ctx")
        positive("default_ctx")
        positive("num_parallel")
        positive("num_gpu", allow_zero=True)
        positive("main_gpu", allow_zero=True)
        positive("num_batch")
        positive("num_ubatch")
        positive("num_thread")
        for name in ("cache_type_k", "cache_type_v"):
            v = getattr(self, name)
            if v is not None and v not in KV_CACHE_TYPES:
                raise LoadOptionsError(f"{name} {shown(v)} is not a KV cache type; "
                                       f"use one of {', '.join(KV_CACHE_TYPES)}")
        if self.flash_attn is not None:
            fa = {True: "on", False: "off"}.get(self.flash_attn, self.flash_attn)
            if fa not in FLASH_ATTN:
                raise LoadOptionsError(f"flash_attn must be one of on, off, auto, got {shown(self.flash_attn)}")
            object.__setattr__(self, "flash_attn", fa)
        if self.flash_attn == "off" and self.cache_type_v in QUANTIZED_KV:  # (llama.cpp refuses the context)
            raise LoadOptionsError(f"cache_type_v {self.cache_type_v} needs flash attention, and flash_attn is off: "
                                   "set flash_attn on (or auto), or use cache_type_v f16")
        if self.num_ctx is not None and self.num_ctx < 16:
            raise LoadOptionsError(f"num_ctx {self.num_ctx} is too small; use at least 16 tokens")
        for name, most, why in (("num_ctx", 1 << 27, "128M tokens, far beyond any model's training context"),
                                ("default_ctx", 1 << 27, "128M tokens"),
                                ("num_parallel", 256, "256 slots, llama.cpp's LLAMA_MAX_SEQ"),
                                ("num_thread", 1024, "1024 threads"),
                                # llama-server reads these as C ints: past that it exits at start
                                ("num_gpu", (1 << 31) - 1, "2147483647; any number from the model's layer count "
                                                           "up puts every layer on the GPU"),
                                ("main_gpu", (1 << 31) - 1, "2147483647"),
                                ("num_batch", 1 << 20, "1M tokens"), ("num_ubatch", 1 << 20, "1M tokens")):
            v = getattr(self, name)
            if v is not None and v > most:
                raise LoadOptionsError(f"{name} {v} is more than llama-server can be given here (at most {why})")
        ctx = self.num_ctx or self.default_ctx
        if ctx is not None and ctx * (self.num_parallel or 1) >= 1 << 31:
            raise LoadOptionsError(f"num_ctx {ctx} x num_parallel {self.num_parallel} is more context than "
                                   "llama-server can hold (under 2^31 cells)")
        # (a num_batch below what llama-server starts with is raised on its command line: batch_args)
        if self.fit_target_mib is not None:
            object.__setattr__(self, "fit_target_mib", tuple(int(x) for x in self.fit_target_mib))
        if self.rpc is not None:
            object.__setattr__(self, "rpc", tuple(str(x) for x in self.rpc) or None)

    @property
    def total_ctx(self) -> int | None:
        """The ``-c`` value: ``num_ctx`` is the context *each request* gets (Ollama's meaning),
        so with ``P`` explicit slots the child needs ``num_ctx * P`` cells. With automatic
        slots llama-server shares one unified cache in which every request may use all of it.
        An automatic ``num_ctx`` counts as its ``default_ctx``; None when both are unset."""
        ctx = self.num_ctx or self.default_ctx
        if ctx is None:
            return None
        return ctx * (self.num_parallel or 1)

    @property
    def request_ctx(self) -> int | None:
        """The context each request gets: ``num_ctx``, else ``default_ctx`` (None: the
        training context, llama-server's own choice)."""
        return self.num_ctx or self.default_ctx

    @property
    def gpu_automatic(self) -> bool:
        return self.num_gpu is None

    def replace(self, **changes) -> "LoadOptions":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> "LoadOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise LoadOptionsError(f"unknown load option(s): {', '.join(sorted(unknown))}")
        return cls(**data)


def least_batch(options: LoadOptions) -> int:
    """The smallest batch llama-server starts with under ``options``: two tokens, and one per
    request slot (below it, it aborts at start on ``GGML_ASSERT n_outputs_max``, measured)."""
    return max(2, options.num_parallel or AUTO_SLOTS)


def batch_args(options: LoadOptions) -> tuple[int | None, int | None]:
    """``(-b, -ub)`` as the child is given them (None: not passed, llama-server's default).

    As asked, except that a batch below :func:`least_batch` is raised to it: Ollama takes any
    ``num_batch`` (its runner has one request slot, where llama-server's automatic slots are
    four), so such a request is served rather than refused. An embedding load runs a batch in
    one micro-batch (llama-server sets ``-b`` to ``-ub``), so there the micro-batch is raised too.
    """
    least = least_batch(options)
    batch, ubatch = options.num_batch, options.num_ubatch
    if batch is not None:
        batch = max(batch, least)
    if options.embedding and ubatch is not None:
        ubatch = max(ubatch, least)
    return batch, ubatch


def memory_args(options: LoadOptions) -> list[str]:
    """The options that decide placement and memory, as llama.cpp's tools spell them.

    llama-server and llama-fit-params share these flags, so the projection is made for
    exactly what the child will be asked to do (``--rpc`` included: the same workers).
    """
    o = options
    rpc = [("--rpc", ",".join(o.rpc))] if o.rpc else []
    batch, ubatch = batch_args(o)
    pairs = [*rpc, ("-c", o.total_ctx), ("-np", o.num_parallel), ("-ngl", o.num_gpu), ("-mg", o.main_gpu),
             ("-b", batch), ("-ub", ubatch), ("-fa", o.flash_attn),
             ("-ctk", o.cache_type_k), ("-ctv", o.cache_type_v)]
    return [x for flag, value in pairs if value is not None for x in (flag, str(value))]
