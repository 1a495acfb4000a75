"""``format_info``: a :class:`GGUFInfo` as text a person reads (``jupyter-llama inspect``)."""

from __future__ import annotations

from typing import Any

from .info import GGUFInfo


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
