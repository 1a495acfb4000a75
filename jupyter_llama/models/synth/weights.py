"""The weights of a synthetic model: random values straight from raw PCG64 output under bit
masks, in each weight type's own encoding, with the fixed "channels" that keep the model's
output plain text (see the package's docstring)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from gguf import TokenType

from .shape import _QBLOCK
from .vocab import _CHARS, _FIRST_PIECE, IM_END_ID, TOOL_CALL, TOOL_TURN

if TYPE_CHECKING:
    from .shape import SynthShape


_CHANNEL_LOGIT = 128.0  # weight of the tool channels in the output layer (beats the -64 of control tokens)


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
