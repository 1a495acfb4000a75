"""What a GGUF file holds, as read: :class:`GGUFInfo` (the model's hyperparameters, its
metadata and tensor table) and the facts derived from them (per-layer head sizes, family
features, bytes per layer, the quantization), and :class:`TensorInfo`, one tensor."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# llama.cpp's pattern for the experts of a layer (common/fit.cpp, --cpu-moe)
_EXPERT_RE = re.compile(r"^blk\.\d+\.ffn_(up|down|gate_up|gate)_(ch|)exps")


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
