"""``read_gguf_info``: a GGUF file's header read into a :class:`GGUFInfo`, with the
architecture's own keys (``{arch}.block_count``, its attention shape, its sliding window) and
the checks that refuse a file llama.cpp could never load."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from .errors import GGUFError, _Truncated
from .header import _check_magic, _field_value, _HeaderReader
from .info import GGUFInfo, TensorInfo

# Sliding-window layer period that llama.cpp assumes per architecture when the
# file has a sliding window but no explicit pattern (the last layer of each
# period is a full-attention layer).
_ARCH_SWA_PERIOD = {
    "gemma2": 2,
    "gemma3": 6,
    "gemma3n": 5,
    "gemma-embedding": 6,
    "cohere2": 4,
    "gpt-oss": 2,
    "olmo2": 4,
    "exaone4": 4,
}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def _file_type_name(v: Any) -> str | None:
    if v is None:
        return None
    try:
        ft = LlamaFileType(int(v))
    except (ValueError, TypeError):
        return f"unknown ({v})"
    if ft == LlamaFileType.GUESSED:
        return None
    name = ft.name
    for prefix in ("MOSTLY_", "ALL_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _as_int_or_list(v: Any) -> int | list[int] | None:
    if v is None:
        return None
    if isinstance(v, list):
        vals = [int(x) for x in v]
        return vals
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, float):
        return int(v)
    return None


LLAMA_MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS


def read_gguf_info(path: os.PathLike | str) -> GGUFInfo:
    """Read a GGUF file's metadata and tensor table. Raises GGUFError."""
    p = str(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise GGUFError(p, "no such file") from None
    except PermissionError:
        raise GGUFError(p, "permission denied") from None
    except OSError as e:
        raise GGUFError(p, e.strerror or str(e)) from None
    if Path(p).is_dir():
        raise GGUFError(p, "is a directory, not a GGUF file")
    size = st.st_size
    try:
        version = _check_magic(p, size)
    except PermissionError:
        raise GGUFError(p, "permission denied") from None
    except OSError as e:
        raise GGUFError(p, e.strerror or str(e)) from None

    try:
        reader = _HeaderReader(p, size)
    except _Truncated as e:
        raise GGUFError(p, f"truncated: {e.phase} needs at least {e.needed:,} bytes, file has {e.size:,}") from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError, struct.error) as e:
        raise GGUFError(p, f"malformed GGUF: {e}") from None
    except OSError as e:
        raise GGUFError(p, e.strerror or str(e)) from None

    metadata: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            shown, full = _field_value(f)
        except (ValueError, IndexError) as e:
            raise GGUFError(p, f"malformed value for {key}: {e}") from None
        metadata[key] = shown
        values[key] = full

    tensors: list[TensorInfo] = []
    for t in reader.tensors:
        m = _LAYER_RE.match(t.name)
        try:
            tname = GGMLQuantizationType(int(t.tensor_type)).name
        except ValueError:
            tname = str(int(t.tensor_type))
        tensors.append(
            TensorInfo(
                name=t.name,
                shape=tuple(int(x) for x in t.shape.tolist()),
                ggml_type=tname,
                n_elements=int(t.n_elements),
                n_bytes=int(t.n_bytes),
                layer=int(m.group(1)) if m else None,
            )
        )
    del reader

    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError(p, "missing required metadata general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return values.get(f"{arch}.{key}", default)

    def require_int(key: str) -> int:
        v = get(key)
        if v is None:
            raise GGUFError(p, f"missing required metadata {arch}.{key}")
        if isinstance(v, list):
            if not v:
                raise GGUFError(p, f"empty array for {arch}.{key}")
            return int(max(v))
        if not isinstance(v, (int, float)):
            raise GGUFError(p, f"bad value for {arch}.{key}: {v!r}")
        return int(v)

    block_count = require_int("block_count")
    embedding_length = require_int("embedding_length")
    context_length = require_int("context_length")
    # Files llama.cpp can never load are refused here, before anything is sized from them (a
    # block_count of 1e7 once held the scheduler for minutes while per-layer lists were built).
    if not 0 < block_count <= LLAMA_MAX_LAYERS:
        raise GGUFError(p, f"{arch}.block_count is {block_count}; llama.cpp loads 1 to {LLAMA_MAX_LAYERS} layers")
    for key, v in (("embedding_length", embedding_length), ("context_length", context_length)):
        if v <= 0:
            raise GGUFError(p, f"{arch}.{key} is {v}; a model needs more than 0")

    head_count = _as_int_or_list(get("attention.head_count"))
    if head_count is None:
        recurrent = any(k.startswith((f"{arch}.ssm.", f"{arch}.wkv.", f"{arch}.rwkv.")) for k in values)
        if not recurrent:
            raise GGUFError(p, f"missing required metadata {arch}.attention.head_count")
        head_count = 0
    head_count_kv = _as_int_or_list(get("attention.head_count_kv"))
    if head_count_kv is None:
        head_count_kv = list(head_count) if isinstance(head_count, list) else head_count

    ff = get("feed_forward_length")
    if isinstance(ff, list):
        ff = max(ff) if ff else None
    feed_forward_length = int(ff) if isinstance(ff, (int, float)) else None

    def opt_int(key: str) -> int | None:
        v = get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    key_length = opt_int("attention.key_length")
    value_length = opt_int("attention.value_length")
    sliding_window = opt_int("attention.sliding_window")

    swa_layers: list[bool] | None = None
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        swa_layers = [bool(x) for x in pattern][:block_count]
        if len(swa_layers) < block_count:
            swa_layers += [False] * (block_count - len(swa_layers))
    else:
        period = None
        if isinstance(pattern, (int, float)) and not isinstance(pattern, bool):
            period = int(pattern)
        elif sliding_window and arch in _ARCH_SWA_PERIOD:
            period = _ARCH_SWA_PERIOD[arch]
        if period is not None:
            swa_layers = [period == 0 or (il % period < period - 1) for il in range(block_count)]

    vocab_size = opt_int("vocab_size")
    if vocab_size is None:
        toks = values.get("tokenizer.ggml.tokens")
        if isinstance(toks, int):
            vocab_size = toks
        elif isinstance(toks, list):
            vocab_size = len(toks)
    if vocab_size is None:
        emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
        vocab_size = emb.shape[1] if emb is not None and len(emb.shape) >= 2 else 0

    # Every layer has its tensors in a file llama.cpp can load (it fails at the first missing
    # one); a table cut short, or metadata that claims more layers than the file holds, is refused.
    have = {t.layer for t in tensors if t.layer is not None}
    missing = [i for i in range(block_count) if i not in have]
    if missing:
        shown = ", ".join(str(i) for i in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise GGUFError(p, f"{arch}.block_count is {block_count}, but the file has no tensors for layer "
                           f"{shown}: it is incomplete, or its metadata does not describe it")

    name = values.get("general.name")
    return GGUFInfo(
        path=p,
        file_size=size,
        version=version,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        block_count=block_count,
        embedding_length=embedding_length,
        feed_forward_length=feed_forward_length,
        head_count=head_count,
        head_count_kv=head_count_kv,
        key_length=key_length,
        value_length=value_length,
        context_length=context_length,
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        file_type=_file_type_name(values.get("general.file_type")),
        parameter_count=sum(t.n_elements for t in tensors),
        vocab_size=int(vocab_size),
        tensors=tensors,
        metadata=metadata,
    )
