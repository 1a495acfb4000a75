"""Deterministic synthetic GGUF models of the architecture families Ollama users run.

``write_synthetic(path, SynthShape(...))`` writes a small (or not so small) model with
random weights that llama.cpp's ``llama-server`` loads and answers with text. Same
shape and seed, same bytes.

Families (``SynthShape.arch``; :data:`FAMILIES` has a small shape of each):

* ``llama``: the default; attention (grouped-query) and a gated feed-forward.
* ``qwen3``: llama plus RMS norms on Q and K per head, and a head size (``key_length``)
  unlike ``embd / heads`` (by default twice it, as in Qwen3).
* ``gemma3``: sliding-window attention on most layers (``sliding_window``; every sixth layer
  and the last keep the whole context), a head size unlike ``embd / heads``, norms after
  attention and after the feed-forward, and the output layer tied to the token embedding
  (no ``output.weight``).
* ``qwen3moe``: qwen3's attention, and a mixture of ``experts`` feed-forward experts per
  layer of which a router picks ``experts_used`` per token (``ffn_*_exps`` tensors,
  ``expert_ff`` wide).
* ``lfm2``: a hybrid recurrent model: most layers are short convolutions that keep a small
  recurrent state per sequence (``shortconv``, a window of 3) instead of a KV cache; every
  third layer is attention.
* ``deepseek2``: DeepSeek's multi-head latent attention (MLA): keys and values are cached
  compressed, one ``kv_lora_rank + rope_dim`` row per token whatever the number of heads,
  and expanded per head by ``attn_k_b`` / ``attn_v_b``; queries go through a low-rank
  ``q_lora_rank`` projection.

How it stays usable with random weights
---------------------------------------
* Vocabulary: a SentencePiece ("llama") vocabulary: ``<unk>``, ``<s>``, ``</s>``, the
  ChatML control tokens ``<|im_start|>``/``<|im_end|>``, the 256 byte-fallback tokens
  ``<0x00>``..``<0xFF>`` (any input text tokenizes), then plain ASCII pieces (``▁``, the
  printable characters, common words, syllables) with decreasing scores.
* Random weights would sample random tokens, and a lone byte token such as ``<0xE3>``
  decodes to half a UTF-8 character; control tokens end the reply or render as nothing.
  So the weights carry a fixed "channel": element 0 of every token embedding is a
  constant, no layer ever writes to element 0 (row 0 of ``attn_output`` and
  ``ffn_down`` is zero), so after the final norm element 0 is a large positive value
  for every position, and the output row of every control and byte token has a large
  negative weight there. Those tokens sit hundreds of logits below the plain pieces
  and are never sampled; the model only ever emits whole ASCII pieces (valid UTF-8).
  Generation ends at ``n_predict``/``max_tokens`` or the context size, not at EOS.
* With a tied output layer (gemma3) the token embedding is also the output layer, so the
  channel is carried by the sign of element 0: plain pieces have ``+sqrt(E)``, control and byte
  tokens ``-sqrt(E)``. A prompt that ends in a plain piece then never samples a control or
  byte token; so that chat prompts (which end in a newline) do too, such a vocabulary has a
  plain ``"\n"`` piece, and the newline is never a byte token.
* ``tokenizer.chat_template`` is a small ChatML template, so ``/v1/chat/completions``
  works; ``<|im_end|>`` is recognised by llama.cpp as an end-of-generation token.
* ``template="tools"``: a ChatML template that also renders tools, tool calls (Hermes
  style: ``<tool_call>`` + JSON ``{"name", "arguments"}``), tool results and reasoning
  (``<think>``, opened by the generation prompt when ``enable_thinking`` is true), which
  llama.cpp's chat parser reads back as ``tool_calls`` and ``reasoning_content``. Random
  weights never choose a tool, so the model is made to: the template ends its generation
  prompt with a control token ``<|tool_turn|>`` when tools are offered (and thinking is
  off), and more residual elements that no layer writes (like element 0) hard-wire a few
  next tokens (see ``_channels``): after ``<|tool_turn|>`` the single token
  ``<tool_call>``, after ``}`` a ``<``, after ``>`` the end of the turn. So, offered
  tools, it opens a call; llama-server's tool grammar writes the JSON (a tool whose
  arguments are enums is called the same way every time), closes it and the turn ends:
  one call. Float types only (the channels need exact weights).
* ``fim=True``: fill-in-the-middle tokens (``<|fim_prefix|>``, ``<|fim_suffix|>``,
  ``<|fim_middle|>``, named in the metadata), so llama-server's ``/infill`` answers.

Speed: weights are produced straight from raw PCG64 output with bit masks (no normal
sampling, no float quantisation): float types get random mantissas and signs under a
fixed exponent; Q8_0/Q4_0 get random quants under a valid f16 scale per block.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, Keys, LlamaFileType, TokenType

__all__ = ["SynthShape", "write_synthetic", "MIN_VOCAB", "TYPES", "TEMPLATES", "CHAT_TEMPLATE", "TOOLS_TEMPLATE",
           "ARCHS", "FAMILIES", "special_token_ids"]

TYPES = ("f32", "f16", "q8_0", "q4_0")
TEMPLATES = ("chatml", "tools")
ARCHS = ("llama", "qwen3", "gemma3", "qwen3moe", "lfm2", "deepseek2")
TIED = frozenset({"gemma3"})  # families whose output layer is the token embedding

_GGML_TYPE = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}
_FILE_TYPE = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
}
_QBLOCK = 32  # elements per Q8_0 / Q4_0 block

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tools, tool calls (Hermes style, on one line), tool results and reasoning, for llama.cpp's
# chat parser (see the module's docstring); the generation prompt ends with <|tool_turn|>
# when tools are offered and thinking is off.
TOOLS_TEMPLATE = """\
{%- set thinking = enable_thinking is defined and enable_thinking %}
{%- if tools %}<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call these tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer with <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call><|im_end|>
{% elif messages and messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not loop.first %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if thinking %}<think>
{% elif tools %}<|tool_turn|>{% endif %}
{%- endif %}"""
TOOL_TURN = "<|tool_turn|>"
TOOL_CALL = "<tool_call>"
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
_CHANNEL_LOGIT = 128.0  # weight of the tool channels in the output layer (beats the -64 of control tokens)

_SPECIALS = [
    ("<unk>", TokenType.UNKNOWN),
    ("<s>", TokenType.CONTROL),
    ("</s>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
_BYTE_BASE = len(_SPECIALS)
_FIRST_PIECE = _BYTE_BASE + 256
_SPACE = "\u2581"  # SentencePiece's word-boundary mark
_CHARS = [_SPACE] + [chr(c) for c in range(0x21, 0x7F)]
MIN_VOCAB = _FIRST_PIECE + len(_CHARS)  # specials, bytes and single characters: 356

_WORDS = (
    "the of and to in is was for that on as with by he it at from his an are were which this be or "
    "has had not first one their its new after who they two her she been other when there all during "
    "into school time may years more most only over city some world would where later up such used many "
    "can state about national out known university united then made also year people what system because "
    "part work called between several while large number three under both found day well since before "
    "these team town based general second him film water like through could light river small music "
    "house long great early place play game local name will high each model data token word text hello "
    "llama server memory layer cache graph tensor weight value note book cell plot line point level"
).split()


def special_token_ids() -> dict[str, int]:
    """Ids of the control tokens in every synthetic vocabulary."""
    return {"unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "im_start": IM_START_ID, "im_end": IM_END_ID}


def _pieces():
    """Endless stream of distinct plain ASCII pieces, most 'useful' first."""
    yield from _CHARS
    seen = set(_CHARS)

    def fresh(p):
        if p not in seen:
            seen.add(p)
            return True
        return False

    for w in _WORDS:
        if fresh(_SPACE + w):
            yield _SPACE + w
    cons = "bcdfghjklmnprstvwxyz"
    vows = "aeiou"
    syll = [c + v for c in cons for v in vows]
    for s in syll:
        for p in (s, _SPACE + s):
            if fresh(p):
                yield p
    for w in _WORDS:
        if fresh(w):
            yield w
    for s in syll:
        for c in cons:
            for p in (s + c, _SPACE + s + c):
                if fresh(p):
                    yield p
    for s1 in syll:
        for s2 in syll:
            for p in (s1 + s2, _SPACE + s1 + s2):
                if fresh(p):
                    yield p
    i = 0
    while True:
        p = f"{_SPACE}w{i}"
        if fresh(p):
            yield p
        i += 1


def _vocabulary(n: int, extra: Sequence[tuple[str, TokenType]] = (), newline: bool = False,
                ) -> tuple[list[str], list[float], list[int]]:
    """``n`` tokens; the ``extra`` ones (tool and fill-in-the-middle tokens) take the last ids;
    with ``newline``, a plain ``"\n"`` piece comes first among the pieces."""
    tokens = [t for t, _ in _SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(tt) for _, tt in _SPECIALS] + [int(TokenType.BYTE)] * 256
    scores = [0.0] * len(tokens)
    gen = _pieces()
    if newline:
        gen = itertools.chain(["\n"], gen)
    for i in range(n - len(tokens) - len(extra)):
        tokens.append(next(gen))
        types.append(int(TokenType.NORMAL))
        scores.append(float(-i))
    for text, ttype in extra:
        tokens.append(text)
        types.append(int(ttype))
        scores.append(0.0)
    return tokens, scores, types


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
    template: str = "chatml"  # chatml | tools (tool calls and reasoning; see the module's docstring)
    fim: bool = False  # fill-in-the-middle tokens (llama-server's /infill)
    arch: str = "llama"  # one of ARCHS (see the module's docstring)
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


# ----------------------------------------------------------------------------- weights


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index, 0x5EED])))


def _raw(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """nbytes of random uint8, from raw generator output (fast)."""
    words = rng.bit_generator.random_raw((nbytes + 7) // 8)
    return words.view(np.uint8)[:nbytes]


def _exp2_floor(std: float) -> int:
    # Magnitudes uniform in [2^e, 2^(e+1)) have rms 1.53 * 2^e; pick e so rms <= std.
    return int(math.floor(math.log2(std / 1.53)))


def _float_matrix(rng, rows: int, cols: int, std: float, dtype: str) -> np.ndarray:
    """rows x cols of random sign/mantissa under a fixed exponent (|x| in [2^e, 2^(e+1)))."""
    e = _exp2_floor(std)
    n = rows * cols
    if dtype == "f16":
        bits = _raw(rng, 2 * n).view(np.uint16)
        bits &= np.uint16(0x83FF)  # sign + mantissa
        bits |= np.uint16((e + 15) << 10)
        return bits.view(np.float16).reshape(rows, cols)
    bits = _raw(rng, 4 * n).view(np.uint32)
    bits &= np.uint32(0x807FFFFF)
    bits |= np.uint32((e + 127) << 23)
    return bits.view(np.float32).reshape(rows, cols)


def _q8_0_matrix(rng, rows: int, cols: int, std: float) -> np.ndarray:
    nb = cols // _QBLOCK
    blocks = _raw(rng, rows * nb * 34).reshape(rows, nb, 34)
    d = np.float16(std / 73.9)  # uniform int8 has rms ~73.9
    blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    return blocks


def _q4_0_matrix(rng, rows: int, cols: int, std: float) -> np.ndarray:
    nb = cols // _QBLOCK
    blocks = _raw(rng, rows * nb * 18).reshape(rows, nb, 18)
    d = np.float16(std / 4.64)  # uniform nibble - 8 has rms ~4.64
    blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    return blocks


def _matrix(rng, rows: int, cols: int, std: float, wtype: str) -> np.ndarray:
    if wtype == "q8_0":
        return _q8_0_matrix(rng, rows, cols, std)
    if wtype == "q4_0":
        return _q4_0_matrix(rng, rows, cols, std)
    return _float_matrix(rng, rows, cols, std, wtype)


def _set_row_zero(m: np.ndarray, row: int, wtype: str) -> None:
    if wtype in ("q8_0", "q4_0"):
        m[row, :, 0:2] = 0  # scale 0: every element of the row is 0
    else:
        m[row, :] = 0


def _set_col0(m: np.ndarray, values: np.ndarray, wtype: str) -> None:
    """Set element 0 of every row to values[row] (exactly representable choices only)."""
    values = np.asarray(values, dtype=np.float32)
    if wtype == "q8_0":
        blk = m[:, 0, :]  # (rows, 34): first block of each row
        big = np.abs(values) > 0
        # rows with a value: scale so that q = +-127 gives it; rest of the block zero
        d = np.where(big, np.abs(values) / 127.0, 0).astype(np.float16)
        q = blk[:, 2:].view(np.int8)
        rows_big = np.nonzero(big)[0]
        if rows_big.size:
            blk[rows_big, 0:2] = d[rows_big].view(np.uint8).reshape(-1, 2)
            q[rows_big, :] = 0
            q[rows_big, 0] = np.where(values[rows_big] > 0, 127, -127).astype(np.int8)
        rows_zero = np.nonzero(~big)[0]
        q[rows_zero, 0] = 0
    elif wtype == "q4_0":
        blk = m[:, 0, :]  # (rows, 18)
        big = np.abs(values) > 0
        rows_big = np.nonzero(big)[0]
        if rows_big.size:
            v = values[rows_big]
            # positive: nibble 15 -> +7d ; negative: nibble 0 -> -8d
            d = np.where(v > 0, v / 7.0, -v / 8.0).astype(np.float16)
            blk[rows_big, 0:2] = d.view(np.uint8).reshape(-1, 2)
            blk[rows_big, 2:] = 0x88  # every element 0
            blk[rows_big, 2] = np.where(v > 0, 0x8F, 0x80).astype(np.uint8)
        rows_zero = np.nonzero(~big)[0]
        blk[rows_zero, 2] = (blk[rows_zero, 2] & 0xF0) | 0x08
    else:
        m[:, 0] = values.astype(m.dtype)


def _norm_weight(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


# ----------------------------------------------------------------------------- file


_QUANTIZED_KINDS = frozenset({"embd", "output", "in", "out"})  # kinds stored in the shape's type

_Planned = tuple[str, tuple[int, ...], str]  # a tensor's name, numpy shape and kind (see _tensor_plan)


def _tensor_plan(s: SynthShape) -> list[_Planned]:
    """(name, numpy shape (..., rows, cols), kind) in file order. Kinds: ``embd``, ``output``,
    ``in`` (reads the residual or another activation), ``out`` (writes the residual: row 0
    and the channels' rows are zero), ``norm`` (ones, f32), ``post_norm`` (fours, f32),
    ``signs`` (a norm of random signs, element 0 positive, f32), ``f32`` (small random f32)."""
    E, V, F = s.embd, s.vocab, s.n_ff
    hd = s.head_dim
    q = s.heads * hd
    kv = s.kv_heads * hd
    plan: list[_Planned] = [("token_embd.weight", (V, E), "embd")]

    def attention(b: str, qk_norm: bool) -> list[_Planned]:
        out: list[_Planned] = [(b + "attn_q.weight", (q, E), "in"), (b + "attn_k.weight", (kv, E), "in"),
               (b + "attn_v.weight", (kv, E), "in"), (b + "attn_output.weight", (E, q), "out")]
        if qk_norm:
            out += [(b + "attn_k_norm.weight", (hd,), "norm"), (b + "attn_q_norm.weight", (hd,), "norm")]
        return out

    def ffn(b: str) -> list[_Planned]:
        return [(b + "ffn_gate.weight", (F, E), "in"), (b + "ffn_up.weight", (F, E), "in"),
                (b + "ffn_down.weight", (E, F), "out")]

    for i in range(s.layers):
        b = f"blk.{i}."
        if s.arch == "llama":
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, False),
                     (b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
        elif s.arch == "qwen3":
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, True),
                     (b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
        elif s.arch == "gemma3":
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, True),
                     (b + "post_attention_norm.weight", (E,), "post_norm"), (b + "ffn_norm.weight", (E,), "norm"),
                     *ffn(b), (b + "post_ffw_norm.weight", (E,), "post_norm")]
        elif s.arch == "qwen3moe":
            X, FX = s.n_experts, s.n_expert_ff
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, True),
                     (b + "ffn_norm.weight", (E,), "norm"), (b + "ffn_gate_inp.weight", (X, E), "in"),
                     (b + "ffn_gate_exps.weight", (X, FX, E), "in"), (b + "ffn_up_exps.weight", (X, FX, E), "in"),
                     (b + "ffn_down_exps.weight", (X, E, FX), "out")]
        elif s.arch == "lfm2":
            plan += [(b + "attn_norm.weight", (E,), "norm")]
            if s.is_recurrent(i):
                plan += [(b + "shortconv.conv.weight", (E, _SHORTCONV_CACHE), "f32"),
                         (b + "shortconv.in_proj.weight", (3 * E, E), "in"),
                         (b + "shortconv.out_proj.weight", (E, E), "out")]
            else:
                plan += attention(b, True)
            plan += [(b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
        else:  # deepseek2 (MLA)
            R, C, QL = s.n_rope, s.n_kv_lora, s.n_q_lora
            nope = hd - R
            plan += [(b + "attn_norm.weight", (E,), "norm"),
                     (b + "attn_q_a_norm.weight", (QL,), "norm"), (b + "attn_kv_a_norm.weight", (C,), "norm"),
                     (b + "attn_q_a.weight", (QL, E), "in"), (b + "attn_q_b.weight", (s.heads * hd, QL), "in"),
                     (b + "attn_kv_a_mqa.weight", (C + R, E), "in"),
                     (b + "attn_k_b.weight", (s.heads, C, nope), "in"),
                     (b + "attn_v_b.weight", (s.heads, nope, C), "in"),
                     (b + "attn_output.weight", (E, s.heads * nope), "out"),
                     (b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
    plan += [("token_embd_norm.weight" if s.arch == "lfm2" else "output_norm.weight", (E,),
              "signs" if s.tied else "norm")]
    if not s.tied:
        plan += [("output.weight", (V, E), "output")]
    return plan


_SHORTCONV_CACHE = 3  # lfm2's convolution window (shortconv.l_cache)


def _nbytes(shape, wtype: str) -> int:
    n = int(np.prod(shape))
    if len(shape) == 1 or wtype == "f32":
        return 4 * n
    if wtype == "f16":
        return 2 * n
    if wtype == "q8_0":
        return n // _QBLOCK * 34
    return n // _QBLOCK * 18


def _char_id(c: str) -> int:
    return _FIRST_PIECE + _CHARS.index(c)


def _channels(s: SynthShape) -> list[tuple[int, int]]:
    """(token, next token) pairs the weights hard-wire: residual element k (1, 2, ...) is set
    only by the k-th pair's first token, and no layer writes it, so the output layer gives its
    second token a logit far above the rest wherever the first one is the current token. The
    ``tools`` template's: <|tool_turn|> opens a tool call, ``}`` (the end of a call's JSON)
    goes on to ``</tool_call>`` rather than to another call, and ``>`` ends the turn."""
    if s.template != "tools":
        return []
    return [(s.token_id(TOOL_TURN), s.token_id(TOOL_CALL)), (_char_id("}"), _char_id("<")),
            (_char_id(">"), IM_END_ID)]


def _make_tensor(s: SynthShape, index: int, shape, kind: str) -> np.ndarray:
    if kind == "norm":
        return _norm_weight(shape[0])
    if kind == "post_norm":
        # gemma3 scales the token embedding up by sqrt(E) and normalises what each layer adds:
        # a larger weight here lets the layers, not the current token alone, decide the next one
        return np.full(shape[0], 4.0, dtype=np.float32)
    if kind == "signs":
        # A tied output layer scores each token by its own embedding: with a plain norm the
        # current token (the largest part of the residual) would always score highest and be
        # repeated. Random signs take that away; element 0 keeps its sign (the channel).
        signs = np.where(_raw(_rng(s.seed, index), shape[0]) & 1, 1.0, -1.0).astype(np.float32)
        signs[0] = 1.0
        return signs
    *lead, rows, cols = shape
    stack = int(np.prod(lead)) if lead else 1  # experts (or heads) stored one after another
    wtype = "f32" if kind == "f32" else s.type
    rng = _rng(s.seed, index)
    E = s.embd
    if kind == "embd":
        # element std 1; element 0 carries a constant sqrt(E) that no layer touches (tied: its sign
        # is the channel, minus for the control and byte tokens the output layer must never pick)
        m = _matrix(rng, rows, cols, 1.0, wtype)
        col0 = np.full(rows, math.sqrt(E), dtype=np.float32)
        if s.tied:
            col0[_suppressed(s)] = -math.sqrt(E)
        _set_col0(m, col0, wtype)
        channels = _channels(s)
        if channels:  # element k: "this token is the k-th channel's trigger"
            m[:, 1:1 + len(channels)] = 0
            for k, (src, _dst) in enumerate(channels, 1):
                m[src, k] = math.sqrt(E)
        return m
    if kind == "output":
        # logits of plain pieces ~ N(0, 3^2); control and byte tokens pushed far down
        m = _matrix(rng, rows, cols, 3.0 / math.sqrt(E), wtype)
        col0 = np.zeros(rows, dtype=np.float32)
        col0[_suppressed(s)] = -64.0
        _set_col0(m, col0, wtype)
        channels = _channels(s)
        if channels:  # after the k-th channel's trigger, its token
            m[:, 1:1 + len(channels)] = 0
            for k, (_src, dst) in enumerate(channels, 1):
                m[dst, k] = _CHANNEL_LOGIT
        return m
    m = _matrix(rng, stack * rows, cols, 0.7 / math.sqrt(cols), wtype)
    if kind == "out":
        for first in range(0, stack * rows, rows):
            for row in range(1 + len(_channels(s))):
                _set_row_zero(m, first + row, wtype)  # never write residual element 0 (nor the channels)
    return m


def _suppressed(s: SynthShape) -> list[int]:
    """Ids of the tokens the output layer must never pick: control and byte tokens."""
    ids = list(range(_FIRST_PIECE))
    ids += [s.token_id(text) for text, ttype in s.extra_tokens if ttype == TokenType.CONTROL]
    return ids


def write_synthetic(path: os.PathLike | str, shape: SynthShape | None = None, **overrides) -> Path:
    """Write a synthetic llama GGUF to ``path`` atomically; return the path."""
    s = shape if shape is not None else SynthShape()
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(SynthShape)}
        if unknown:
            raise ValueError(f"unknown shape field(s): {', '.join(sorted(unknown))}")
        s = dataclasses.replace(s, **overrides)
    else:
        s = dataclasses.replace(s)  # validates a shape mutated after construction
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    # a unique name beside the target (same filesystem, so the rename is atomic);
    # created by the writer with the usual umask-derived permissions
    tmp = str(out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        _write(tmp, s)
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return out


def _write(tmp: str, s: SynthShape) -> None:
    w = GGUFWriter(tmp, s.arch)
    name = f"synthetic-{s.arch}-{s.layers}x{s.embd}-{s.type}-seed{s.seed}"
    w.add_name(name)
    w.add_description(f"Synthetic random-weight {s.arch} model written by jupyter_llama.models.synth")
    w.add_file_type(int(_FILE_TYPE[s.type]))
    if s.type in ("q8_0", "q4_0"):
        w.add_quantization_version(2)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.embd)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.heads)
    if s.arch == "lfm2":  # no KV heads in a recurrent layer: that is how llama.cpp tells them apart
        w.add_head_count_kv([0 if s.is_recurrent(il) else s.kv_heads for il in range(s.layers)])
        w.add_shortconv_l_cache(_SHORTCONV_CACHE)
    elif s.arch == "deepseek2":  # one compressed row per token, shared by every head
        w.add_head_count_kv(1)
    else:
        w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(s.n_rope)
    if s.arch == "deepseek2":
        # What the cache holds per token (the compressed KV and the rotary key), and the head
        # sizes once decompressed.
        w.add_key_length(s.n_kv_lora + s.n_rope)
        w.add_value_length(s.n_kv_lora)
        w.add_key_length_mla(s.head_dim)
        w.add_value_length_mla(s.head_dim - s.n_rope)
        w.add_q_lora_rank(s.n_q_lora)
        w.add_kv_lora_rank(s.n_kv_lora)
        w.add_leading_dense_block_count(s.layers)
        w.add_expert_feed_forward_length(s.n_ff)
        w.add_expert_shared_count(0)
    elif s.head_dim != s.embd // s.heads:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.window:
        w.add_sliding_window(s.window)
        w.add_sliding_window_pattern(s.swa_layers())
    if s.n_experts:
        w.add_expert_count(s.n_experts)
        w.add_expert_used_count(s.n_experts_used)
        w.add_expert_feed_forward_length(s.n_expert_ff)
    w.add_vocab_size(s.vocab)

    tokens, scores, types = _vocabulary(s.vocab, s.extra_tokens, newline=s.tied)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if s.template == "tools":
        # no space before the text after a control token: the generation prompt, tokenized,
        # must read back as written (llama-server feeds it to the tool-call grammar)
        w.add_add_space_prefix(False)
    if s.fim:
        for key, text in zip((Keys.Tokenizer.FIM_PRE_ID, Keys.Tokenizer.FIM_SUF_ID, Keys.Tokenizer.FIM_MID_ID),
                             FIM_TOKENS, strict=True):
            w.add_uint32(key, s.token_id(text))
    w.add_chat_template(TOOLS_TEMPLATE if s.template == "tools" else CHAT_TEMPLATE)

    plan = _tensor_plan(s)
    for tname, tshape, kind in plan:
        if kind not in _QUANTIZED_KINDS:
            w.add_tensor_info(tname, tshape, np.dtype(np.float32), _nbytes(tshape, "f32"))
        else:
            w.add_tensor_info(
                tname, tshape, np.dtype(np.float32), _nbytes(tshape, s.type), raw_dtype=_GGML_TYPE[s.type]
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (_tname, tshape, kind) in enumerate(plan):
        w.write_tensor_data(_make_tensor(s, index, tshape, kind))
    w.close()


def write_projector(path: os.PathLike | str, text_embd: int, *, embd: int = 32, ff: int = 64, heads: int = 2,
                    layers: int = 2, image_size: int = 28, patch_size: int = 14, hidden: int = 64,
                    seed: int = 0) -> Path:
    """A small multimodal projector (``mmproj``) that llama.cpp's multimodal loader accepts: a
    LLaVA-style vision tower (``clip``, projector type ``mlp``) of ``layers`` blocks over
    ``image_size`` pixels in ``patch_size`` patches, and a two-layer MLP into the text model's
    ``text_embd``. Its weights are random: it turns an image into ``(image_size / patch_size)**2``
    embeddings of the right shape, which is what loading, memory and offload need.
    """
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    if embd % heads:
        raise ValueError(f"embd {embd} is not a multiple of heads {heads}")
    rng = np.random.default_rng(seed)

    def r(*shape) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    path = Path(path)
    w = GGUFWriter(str(path), "clip")
    w.add_string("general.name", "synthetic projector")
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", embd)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.attention.head_count", heads)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_tensor("v.patch_embd.weight", r(embd, 3, patch_size, patch_size).astype(np.float16))
    w.add_tensor("v.position_embd.weight", r((image_size // patch_size) ** 2, embd))
    for il in range(layers):
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{il}.{t}.weight", r(embd, embd))
            w.add_tensor(f"v.blk.{il}.{t}.bias", r(embd))
        for t in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{il}.{t}.weight", np.ones(embd, np.float32))
            w.add_tensor(f"v.blk.{il}.{t}.bias", np.zeros(embd, np.float32))
        w.add_tensor(f"v.blk.{il}.ffn_up.weight", r(ff, embd))
        w.add_tensor(f"v.blk.{il}.ffn_up.bias", r(ff))
        w.add_tensor(f"v.blk.{il}.ffn_down.weight", r(embd, ff))
        w.add_tensor(f"v.blk.{il}.ffn_down.bias", r(embd))
    w.add_tensor("mm.0.weight", r(hidden, embd))
    w.add_tensor("mm.0.bias", r(hidden))
    w.add_tensor("mm.2.weight", r(text_embd, hidden))
    w.add_tensor("mm.2.bias", r(text_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
