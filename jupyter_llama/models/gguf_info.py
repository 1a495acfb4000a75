"""GGUF metadata and tensor table, read without loading tensor data.

``read_gguf_info(path)`` memory-maps the file with the ``gguf`` package's
``GGUFReader`` and walks only the header: the key/value section and the tensor
table. Tensor data is never touched (the reader builds lazy views into the map).

The stock reader parses every element of every array one by one, which takes
seconds on a real vocabulary (150k tokens plus as many merges). ``_HeaderReader``
keeps the stock parsing but reads numeric arrays in one step and skips long string
arrays (their contents are never needed here), and checks every read against the
end of the file so that a short file is reported as truncated rather than failing
somewhere inside numpy.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType

__all__ = [
    "GGUFError",
    "TensorInfo",
    "GGUFInfo",
    "read_gguf_info",
    "read_arrays",
    "format_info",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# String arrays up to this length are decoded (general.tags, languages, ...);
# longer ones (tokenizer tokens, merges) are skipped and only counted.
_MAX_DECODED_STRING_ARRAY = 256
# Numeric arrays up to this length are kept for lookups (per-layer hparams).
_MAX_KEPT_NUMERIC_ARRAY = 65536

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
# llama.cpp's pattern for the experts of a layer (common/fit.cpp, --cpu-moe)
_EXPERT_RE = re.compile(r"^blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps")


class GGUFError(ValueError):
    """A file that cannot be read as a GGUF model. ``str()`` is ``"<path>: <reason>"``, one line."""

    def __init__(self, path: os.PathLike | str, reason: str):
        self.path = str(path)
        self.reason = " ".join(str(reason).split())  # one line
        super().__init__(f"{self.path}: {self.reason}")


class _Truncated(Exception):
    def __init__(self, needed: int, size: int, phase: str = "header"):
        super().__init__(needed, size, phase)
        self.needed = needed
        self.size = size
        self.phase = phase


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (innermost, row length) first, as llama.cpp prints it
    ggml_type: str  # "F32", "F16", "Q8_0", ...
    n_elements: int
    n_bytes: int
    layer: int | None  # N for "blk.N.*", else None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "type": self.ggml_type,
            "n_elements": self.n_elements,
            "n_bytes": self.n_bytes,
            "layer": self.layer,
        }


@dataclass
class GGUFInfo:
    path: str
    file_size: int
    version: int
    architecture: str
    name: str | None
    block_count: int
    embedding_length: int
    feed_forward_length: int | None
    head_count: int | list[int]
    head_count_kv: int | list[int]
    key_length: int | None
    value_length: int | None
    context_length: int
    sliding_window: int | None
    swa_layers: list[bool] | None
    file_type: str | None
    parameter_count: int
    vocab_size: int
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)

    # -- per-layer attention shape --------------------------------------------------

    @staticmethod
    def _per_layer(value: int | list[int], layer: int) -> int:
        if isinstance(value, list):
            if not value:
                return 0
            return int(value[layer]) if 0 <= layer < len(value) else int(value[-1])
        return int(value)

    def n_head(self, layer: int) -> int:
        return self._per_layer(self.head_count, layer)

    def n_head_kv(self, layer: int) -> int:
        return self._per_layer(self.head_count_kv, layer)

    def _head_dim(self, layer: int) -> int:
        n = self.n_head(layer)
        if n <= 0:  # a layer without attention in a per-layer array: use the widest one
            heads = self.head_count if isinstance(self.head_count, list) else [self.head_count]
            n = max([h for h in heads if h > 0], default=0)
        return self.embedding_length // n if n > 0 else 0

    def head_dim_k(self, layer: int = 0) -> int:
        return self.key_length if self.key_length else self._head_dim(layer)

    def head_dim_v(self, layer: int = 0) -> int:
        return self.value_length if self.value_length else self._head_dim(layer)

    # -- family features ----------------------------------------------------------------

    def arch_int(self, key: str, default: int = 0) -> int:
        """The integer ``{architecture}.{key}`` of the metadata (``default`` when absent)."""
        v = self.metadata.get(f"{self.architecture}.{key}")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    @property
    def is_mla(self) -> bool:
        """DeepSeek's multi-head latent attention: the cache holds one compressed row per token
        (``key_length``, the compressed KV and the rotary key) and no V; ``key_length_mla`` /
        ``value_length_mla`` are the head sizes once decompressed."""
        return bool(self.arch_int("attention.key_length_mla") and self.arch_int("attention.value_length_mla"))

    @property
    def n_expert(self) -> int:
        """Experts per mixture-of-experts layer (0: a dense model)."""
        return self.arch_int("expert_count")

    @property
    def n_expert_used(self) -> int:
        """Experts a token is routed to."""
        return self.arch_int("expert_used_count")

    @property
    def shortconv_l_cache(self) -> int:
        """LFM2's convolution window (0: no short-convolution layers)."""
        return self.arch_int("shortconv.l_cache")

    def is_recurrent(self, layer: int) -> bool:
        """A layer that keeps a recurrent state instead of a KV cache: in a hybrid model
        (LFM2), a layer without KV heads."""
        return self.shortconv_l_cache > 0 and self.n_head_kv(layer) == 0

    def is_expert_tensor(self, name: str) -> bool:
        """A mixture-of-experts expert tensor (``blk.N.ffn_{gate,up,down,gate_up}_exps``): what
        llama.cpp's ``--cpu-moe`` and its ``--fit`` keep in host memory."""
        return _EXPERT_RE.match(name) is not None

    # -- bytes ------------------------------------------------------------------------

    def layer_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.tensors:
            if t.layer is not None:
                out[t.layer] = out.get(t.layer, 0) + t.n_bytes
        return dict(sorted(out.items()))

    def non_layer_bytes(self) -> dict[str, int]:
        return {t.name: t.n_bytes for t in self.tensors if t.layer is None}

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def quantization(self) -> str:
        if self.file_type:
            return self.file_type
        by_type: Counter[str] = Counter()
        for t in self.tensors:
            if len(t.shape) >= 2 and t.shape[1] > 1:
                by_type[t.ggml_type] += t.n_bytes
        if not by_type:
            for t in self.tensors:
                by_type[t.ggml_type] += t.n_bytes
        return by_type.most_common(1)[0][0] if by_type else "unknown"

    def to_dict(self, tensors: bool = True) -> dict:
        d: dict[str, Any] = {
            "path": self.path,
            "file_size": self.file_size,
            "version": self.version,
            "architecture": self.architecture,
            "name": self.name,
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "feed_forward_length": self.feed_forward_length,
            "head_count": self.head_count,
            "head_count_kv": self.head_count_kv,
            "key_length": self.key_length,
            "value_length": self.value_length,
            "head_dim_k": self.head_dim_k(),
            "head_dim_v": self.head_dim_v(),
            "context_length": self.context_length,
            "sliding_window": self.sliding_window,
            "swa_layers": self.swa_layers,
            "file_type": self.file_type,
            "quantization": self.quantization,
            "parameter_count": self.parameter_count,
            "vocab_size": self.vocab_size,
            "tensor_count": len(self.tensors),
            "tensor_bytes": self.tensor_bytes,
            "layer_bytes": {str(k): v for k, v in self.layer_bytes().items()},
            "non_layer_bytes": self.non_layer_bytes(),
            "metadata": {k: _json_value(v) for k, v in self.metadata.items()},
        }
        if tensors:
            d["tensors"] = [t.to_dict() for t in self.tensors]
        return d


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    return v


# ----------------------------------------------------------------------------- reader


class _HeaderReader(GGUFReader):
    """GGUFReader with bounds-checked reads and one-step array parsing."""

    def __init__(self, path: str, size: int):
        self._size = size
        self.phase = "header"
        super().__init__(path, "r")

    def _build_tensors(self, start_offs, fields):
        self.phase = "tensor data"
        # Report the whole extent the table claims, not just the first tensor past the end.
        end = 0
        for f in fields:
            _nl, _name, _nd, dims, raw_dtype, offset = f.parts
            try:
                block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                continue
            n = int(np.prod(dims.astype(np.uint64))) if len(dims) else 1
            end = max(end, int(start_offs) + int(offset[0]) + n * tsize // block)
        if end > self._size:
            raise _Truncated(end, self._size, self.phase)
        return super()._build_tensors(start_offs, fields)

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if count < 0 or offset < 0 or end > self._size:
            raise _Truncated(end, self._size, self.phase)
        return super()._get(offset, dtype, count, override_order)

    def _struct_prefix(self) -> str:
        file_little = (sys.byteorder == "little") == (self.byte_order == "I")
        return "<" if file_little else ">"

    def _get_field_parts(self, orig_offs, raw_type):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n = int(alen[0])
        offs = orig_offs + 12
        try:
            itype = GGUFValueType(int(raw_itype[0]))
        except ValueError:
            raise ValueError(f"unknown array element type {int(raw_itype[0])}") from None
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            arr = self._get(offs, nptype, n)
            return 12 + int(arr.nbytes), [raw_itype, alen, arr], [2], [GGUFValueType.ARRAY, itype]
        if itype == GGUFValueType.STRING and (n == 0 or n > _MAX_DECODED_STRING_ARRAY):
            # Skip the strings: 8-byte length then the bytes, n times.
            if offs + 8 * n > self._size:
                raise _Truncated(offs + 8 * n, self._size, self.phase)
            buf = memoryview(self.data)
            unpack = struct.Struct(self._struct_prefix() + "Q").unpack_from
            size = self._size
            p = offs
            for _ in range(n):
                if p + 8 > size:
                    raise _Truncated(p + 8, size, self.phase)
                p += 8 + unpack(buf, p)[0]
            if p > size:
                raise _Truncated(p, size, self.phase)
            return p - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]
        return super()._get_field_parts(orig_offs, raw_type)


def _type_name(t: GGUFValueType) -> str:
    return t.name.lower()


def _field_value(f) -> tuple[Any, Any]:
    """(value for the metadata dict, full value for lookups or None)."""
    types = f.types
    if not types:
        return None, None
    main = types[0]
    if main == GGUFValueType.STRING:
        s = bytes(f.parts[-1]).decode("utf-8", "replace")
        return s, s
    if main == GGUFValueType.ARRAY:
        # a key/value field's parts: key length, key bytes, value type, then the
        # value's own parts (element type, length, elements...)
        sub = types[1] if len(types) > 1 else None
        n = int(f.parts[4][0])
        summary = f"[array of {n} {_type_name(sub) if sub is not None else 'unknown'}]"
        full = None
        nested = len(types) > 2
        if sub is not None and not nested and sub != GGUFValueType.STRING and len(f.parts) > 5:
            arr = f.parts[5]
            if n <= _MAX_KEPT_NUMERIC_ARRAY:
                full = arr.tolist()
            else:
                full = n
        elif sub == GGUFValueType.STRING and f.data:
            full = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
        return summary, (full if full is not None else n)
    v = f.parts[-1][0].item()
    return v, v


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


def _check_magic(path: str, size: int) -> int:
    """Return the version, or raise GGUFError for a bad magic, short header or bad version."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    if size == 0:
        raise GGUFError(path, "empty file (0 bytes)")
    magic = head[:4]
    if magic != GGUF_MAGIC[: len(magic)]:
        shown = (f'"{magic.decode()}"' if magic.isascii() and magic.decode().isprintable()
                 else " ".join(f"{b:02x}" for b in magic))
        raise GGUFError(path, f'not a GGUF file (it begins {shown}, where a GGUF file begins "GGUF")')
    if len(head) < 24:
        raise GGUFError(path, f"truncated: GGUF header needs 24 bytes, file has {size}")
    (version,) = struct.unpack("<I", head[4:8])
    if version & 0xFFFF == 0:  # written for the other byte order
        (version,) = struct.unpack(">I", head[4:8])
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(path, f"unsupported GGUF version {version}")
    return version


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


# ----------------------------------------------------------------------------- whole arrays

# element type -> (struct code, size); strings and nested arrays are read one by one
_SCALARS = {GGUFValueType.UINT8: ("B", 1), GGUFValueType.INT8: ("b", 1), GGUFValueType.UINT16: ("H", 2),
            GGUFValueType.INT16: ("h", 2), GGUFValueType.UINT32: ("I", 4), GGUFValueType.INT32: ("i", 4),
            GGUFValueType.FLOAT32: ("f", 4), GGUFValueType.BOOL: ("?", 1), GGUFValueType.UINT64: ("Q", 8),
            GGUFValueType.INT64: ("q", 8), GGUFValueType.FLOAT64: ("d", 8)}


def read_arrays(path: os.PathLike | str) -> dict[str, list]:
    """Every array of a GGUF file's metadata, whole (the tokenizer's tokens, merges and
    scores among them: hundreds of thousands of items in a real model), by key. This is
    what Ollama's ``show`` with ``verbose`` gives; :func:`read_gguf_info` skips long string
    arrays, which nothing else needs. Only the key/value section is read. GGUFError for a
    file that is not a readable GGUF."""
    import mmap

    p = str(path)
    try:
        size = os.path.getsize(p)
        version = _check_magic(p, size)
        fh = open(p, "rb")
    except OSError as e:
        raise GGUFError(p, e.strerror or str(e)) from None
    with fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        order = "<" if struct.unpack_from("<I", buf, 4)[0] == version else ">"
        count = "Q" if version >= 3 else "I"
        count_size = struct.calcsize(count)
        pos = 8 + 2 * count_size  # magic, version, tensor count, key/value count

        def take(fmt: str, n: int = 1):
            nonlocal pos
            width = struct.calcsize(order + fmt) * n
            if pos + width > size:
                raise _Truncated(pos + width, size, "metadata")
            out = struct.unpack_from(f"{order}{n}{fmt}", buf, pos)
            pos += width
            return out

        def text() -> str:
            nonlocal pos
            (n,) = take(count)
            if pos + n > size:
                raise _Truncated(pos + n, size, "metadata")
            s = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
            pos += n
            return s

        def value(kind: int):
            kind = GGUFValueType(kind)
            if kind == GGUFValueType.STRING:
                return text()
            if kind == GGUFValueType.ARRAY:
                (sub,) = take("I")
                (n,) = take(count)
                sub = GGUFValueType(sub)
                if sub in _SCALARS:
                    items = list(take(_SCALARS[sub][0], n)) if n else []
                    return [_json_value(x) for x in items] if sub in (GGUFValueType.FLOAT32,
                                                                     GGUFValueType.FLOAT64) else items
                return [value(sub) for _ in range(n)]
            return take(_SCALARS[kind][0])[0]

        (n_kv,) = struct.unpack_from(order + count, buf, 8 + count_size)
        arrays: dict[str, list] = {}
        try:
            for _ in range(n_kv):
                key = text()
                (kind,) = take("I")
                v = value(kind)
                if isinstance(v, list):
                    arrays[key] = v
        except _Truncated as e:
            raise GGUFError(p, f"truncated: {e.phase} needs at least {e.needed:,} bytes, file has {e.size:,}") from None
        except (ValueError, KeyError, struct.error) as e:
            raise GGUFError(p, f"malformed GGUF metadata: {e}") from None
    return arrays


# ----------------------------------------------------------------------------- text


def _human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def _human_count(n: int) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _compact(v: int | list[int]) -> str:
    if isinstance(v, list):
        if v and all(x == v[0] for x in v):
            return f"{v[0]} (all {len(v)} layers)"
        return "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)


def format_info(info: GGUFInfo, tensors: bool = False) -> str:
    """Readable text for ``jupyter-llama inspect FILE``."""
    lines = []

    def row(label: str, value: Any) -> None:
        lines.append(f"{label + ':':<18} {value}")

    row("file", info.path)
    row("size", f"{_human_bytes(info.file_size)} ({info.file_size:,} bytes), GGUF v{info.version}")
    if info.name:
        row("name", info.name)
    row("architecture", info.architecture)
    row("parameters", f"{_human_count(info.parameter_count)} ({info.parameter_count:,})")
    row("quantization", info.quantization + ("" if info.file_type else " (most common weight type)"))
    row("context length", f"{info.context_length:,}")
    row("blocks", info.block_count)
    row("embedding", info.embedding_length)
    if info.feed_forward_length is not None:
        row("feed-forward", info.feed_forward_length)
    row("heads", _compact(info.head_count))
    row("kv heads", _compact(info.head_count_kv))
    hk, hv = info.head_dim_k(), info.head_dim_v()
    row("head dim", f"{hk}" if hk == hv else f"k {hk}, v {hv}")
    if info.sliding_window:
        sw = f"{info.sliding_window:,}"
        if info.swa_layers is not None:
            n_swa = sum(info.swa_layers)
            sw += f" on {n_swa} of {len(info.swa_layers)} layers"
        row("sliding window", sw)
    row("vocabulary", f"{info.vocab_size:,}")
    row("tensors", f"{len(info.tensors)} ({_human_bytes(info.tensor_bytes)})")

    if tensors:
        lines.append("")
        name_w = max([len(t.name) for t in info.tensors] + [4])
        shape_strs = ["[" + ", ".join(str(d) for d in t.shape) + "]" for t in info.tensors]
        shape_w = max([len(s) for s in shape_strs] + [5])
        lines.append(f"{'name':<{name_w}}  {'shape':<{shape_w}}  {'type':<7}  {'bytes':>14}")
        for t, s in zip(info.tensors, shape_strs, strict=True):
            lines.append(f"{t.name:<{name_w}}  {s:<{shape_w}}  {t.ggml_type:<7}  {t.n_bytes:>14,}")
        lines.append("")
        lines.append("bytes per layer:")
        rows = [(f"blk.{layer}", b) for layer, b in info.layer_bytes().items()]
        rows += list(info.non_layer_bytes().items())
        w = max([len(r[0]) for r in rows] + [4])
        for label, b in rows:
            lines.append(f"  {label:<{w}}  {b:>14,}  {_human_bytes(b):>11}")
    return "\n".join(lines)
