"""What a synthetic model is: :class:`SynthShape` (its family, sizes, weight type, template,
seed), the checks that it can be written and loaded, and a small shape of each family
(:data:`FAMILIES`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf import TokenType

from .plan import _QUANTIZED_KINDS, _tensor_plan
from .vocab import FIM_TOKENS, MIN_VOCAB, TOOL_CALL, TOOL_TURN

TYPES = ("f32", "f16", "q8_0", "q4_0")
TEMPLATES = ("chatml", "tools")
ARCHS = ("llama", "qwen3", "gemma3", "qwen3moe", "lfm2", "deepseek2")
TIED = frozenset({"gemma3"})  # families whose output layer is the token embedding

_QBLOCK = 32  # elements per Q8_0 / Q4_0 block


@dataclass
class SynthShape:
    layers: int = 4
    embd: int = 128
    heads: int = 4
    kv_heads: int = 2
    ff: int | None = None  # default: 8/3 * embd rounded up to a multiple of 32
    vocab: int = 512
    ctx: int = 2048
    type: str = "f32"  # f32 | f16 | q8_0 | q4_0
    seed: int = 0
    template: str = "chatml"  # chatml | tools (tool calls and reasoning; see the package's docstring)
    fim: bool = False  # fill-in-the-middle tokens (llama-server's /infill)
    arch: str = "llama"  # one of ARCHS (see the package's docstring)
    # Family parameters; None is the family's default (the properties below say it). Setting one
    # that the family does not have is an error.
    key_length: int | None = None  # head size (embd / heads; qwen3, gemma3, qwen3moe: twice that; deepseek2: 64)
    sliding_window: int | None = None  # gemma3: positions a sliding-window layer attends to (128)
    experts: int | None = None  # qwen3moe: experts per layer (8)
    experts_used: int | None = None  # qwen3moe: experts per token (2)
    expert_ff: int | None = None  # qwen3moe: feed-forward width of one expert (ff / 2)
    kv_lora_rank: int | None = None  # deepseek2: width of the compressed KV (64)
    q_lora_rank: int | None = None  # deepseek2: width of the compressed query (96)
    rope_dim: int | None = None  # deepseek2: rotary part of each key (32)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def extra_tokens(self) -> list[tuple[str, TokenType]]:
        """Tokens beyond the base vocabulary, at its end (none by default)."""
        out = []
        if self.template == "tools":
            out += [(TOOL_TURN, TokenType.CONTROL), (TOOL_CALL, TokenType.USER_DEFINED)]
        if self.fim:
            out += [(t, TokenType.CONTROL) for t in FIM_TOKENS]
        return out

    def token_id(self, text: str) -> int:
        """The id of one of :attr:`extra_tokens`."""
        extra = [t for t, _ in self.extra_tokens]
        return self.vocab - len(extra) + extra.index(text)

    @property
    def n_ff(self) -> int:
        if self.ff is not None:
            return self.ff
        return max(_QBLOCK, int(math.ceil(self.embd * 8 / 3 / _QBLOCK)) * _QBLOCK)

    @property
    def tied(self) -> bool:
        """The output layer is the token embedding (no ``output.weight``)."""
        return self.arch in TIED

    @property
    def head_dim(self) -> int:
        """Head size of Q, K and V (deepseek2: of a decompressed key, ``nope + rope``)."""
        if self.key_length is not None:
            return self.key_length
        if self.arch in ("qwen3", "gemma3", "qwen3moe"):
            return 2 * (self.embd // self.heads)
        if self.arch == "deepseek2":
            return 64
        return self.embd // self.heads

    @property
    def window(self) -> int:
        """gemma3's sliding window (0 for the other families)."""
        if self.arch != "gemma3":
            return 0
        return self.sliding_window if self.sliding_window is not None else 128

    def swa_layers(self) -> list[bool]:
        """gemma3: which layers use the sliding window (all but every sixth and the last)."""
        n = self.layers
        return [il % 6 < 5 and il != n - 1 for il in range(n)] if self.window else [False] * n

    @property
    def n_experts(self) -> int:
        return (self.experts or 8) if self.arch == "qwen3moe" else 0

    @property
    def n_experts_used(self) -> int:
        return (self.experts_used or 2) if self.arch == "qwen3moe" else 0

    @property
    def n_expert_ff(self) -> int:
        if self.expert_ff is not None:
            return self.expert_ff
        return max(_QBLOCK, int(math.ceil(self.n_ff / 2 / _QBLOCK)) * _QBLOCK)

    @property
    def n_kv_lora(self) -> int:
        return self.kv_lora_rank if self.kv_lora_rank is not None else 64

    @property
    def n_q_lora(self) -> int:
        return self.q_lora_rank if self.q_lora_rank is not None else 96

    @property
    def n_rope(self) -> int:
        """Rotary dimensions per head (all of the head but deepseek2's)."""
        if self.arch == "deepseek2":
            return self.rope_dim if self.rope_dim is not None else 32
        return self.head_dim

    def is_recurrent(self, layer: int) -> bool:
        """lfm2: a short-convolution layer (every layer but each third)."""
        return self.arch == "lfm2" and layer % 3 != 2

    def validate(self) -> None:
        def positive_int(name: str, v) -> None:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
            if v >= 2**32:
                raise ValueError(f"{name} must be below 2**32 (a GGUF uint32), got {v}")

        if not isinstance(self.arch, str) or self.arch.lower() not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        self.arch = self.arch.lower()
        for name in ("layers", "embd", "heads", "kv_heads", "vocab", "ctx"):
            positive_int(name, getattr(self, name))
        for name in ("ff", *_FAMILY_FIELDS):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        for name, archs in _FAMILY_FIELDS.items():
            if getattr(self, name) is not None and self.arch not in archs:
                which = archs[0] if len(archs) == 1 else f"{', '.join(archs[:-1])} and {archs[-1]}"
                raise ValueError(f"{name} is for the {which} famil{'ies' if len(archs) > 1 else 'y'}, not {self.arch}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.type, str) or self.type.lower() not in TYPES:
            raise ValueError(f"unknown type {self.type!r}; choose one of {', '.join(TYPES)}")
        self.type = self.type.lower()
        if self.embd % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide embd ({self.embd})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.arch == "deepseek2":
            if self.n_rope % 2 or self.n_rope >= self.head_dim:
                raise ValueError(f"rope_dim ({self.n_rope}) must be even and less than key_length ({self.head_dim})")
        elif self.head_dim % 2:
            raise ValueError(f"key_length ({self.head_dim}) must be even (rotary embedding)" if self.key_length
                             else f"head dimension embd/heads = {self.head_dim} must be even (rotary embedding)")
        if self.arch == "lfm2" and self.layers < 3:
            raise ValueError(f"lfm2 needs at least 3 layers (every third is attention, and llama.cpp needs one), "
                             f"got {self.layers}")
        if self.arch == "qwen3moe" and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"experts_used ({self.n_experts_used}) must be at most experts ({self.n_experts})")
        if not isinstance(self.template, str) or self.template.lower() not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")
        self.template = self.template.lower()
        if not isinstance(self.fim, bool):
            raise ValueError(f"fim must be true or false, got {self.fim!r}")
        if self.template == "tools" and self.type not in ("f32", "f16"):
            raise ValueError(f"template 'tools' needs a float type (f32 or f16), got {self.type}")
        if self.template == "tools" and self.arch != "llama":
            raise ValueError(f"template 'tools' is wired for the llama family only, not {self.arch}")
        least = MIN_VOCAB + len(self.extra_tokens) + self.tied
        if self.vocab < least:
            raise ValueError(f"vocab must be at least {least} (control, byte and character tokens"
                             + (", and the tool and fill-in-the-middle tokens" if self.extra_tokens else "")
                             + f"), got {self.vocab}")
        if self.type in ("q8_0", "q4_0"):
            for name, v in (("embd", self.embd), ("ff", self.n_ff)):
                if v % _QBLOCK:
                    raise ValueError(f"{name} ({v}) must be a multiple of {_QBLOCK} for type {self.type}")
            for tname, tshape, kind in _tensor_plan(self):
                if kind in _QUANTIZED_KINDS and tshape[-1] % _QBLOCK:
                    raise ValueError(f"{tname} has rows of {tshape[-1]}, which type {self.type} needs to be a "
                                     f"multiple of {_QBLOCK}: choose other sizes, or a float type")


# Family parameters and the families that have them.
_FAMILY_FIELDS = {
    "key_length": ("llama", "qwen3", "gemma3", "qwen3moe", "deepseek2"),
    "sliding_window": ("gemma3",),
    "experts": ("qwen3moe",),
    "experts_used": ("qwen3moe",),
    "expert_ff": ("qwen3moe",),
    "kv_lora_rank": ("deepseek2",),
    "q_lora_rank": ("deepseek2",),
    "rope_dim": ("deepseek2",),
}

# A small model of each family (a few MB at most), for tests, benches and `synth --arch`.
FAMILIES: dict[str, SynthShape] = {
    "llama": SynthShape(layers=4, embd=128, heads=4, kv_heads=2, vocab=512, ctx=8192),
    "qwen3": SynthShape(arch="qwen3", layers=4, embd=128, heads=4, kv_heads=2, vocab=512, ctx=8192),
    "gemma3": SynthShape(arch="gemma3", layers=7, embd=128, heads=4, kv_heads=1, vocab=1024, ctx=8192,
                         sliding_window=256),
    "qwen3moe": SynthShape(arch="qwen3moe", layers=4, embd=128, heads=4, kv_heads=2, vocab=512, ctx=8192,
                           experts=8, experts_used=2, expert_ff=128),
    "lfm2": SynthShape(arch="lfm2", layers=6, embd=128, heads=4, kv_heads=2, vocab=512, ctx=8192),
    "deepseek2": SynthShape(arch="deepseek2", layers=4, embd=128, heads=4, kv_heads=1, vocab=512, ctx=8192),
}
