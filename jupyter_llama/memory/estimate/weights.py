"""The weights' buffers per device, as llama.cpp allocates them: the memory-mapped span of
the host's tensors, the CPU backend's repacked copies, each GPU's tensors.
"""

from __future__ import annotations

import functools
import platform
from typing import Sequence

from ...load_options import LoadOptions
from ...models.gguf_info import GGUFInfo
from ..report import HOST
from .placement import layer_devices, tensor_devices


def _cpu_flags() -> tuple[str, frozenset[str]]:
    machine = platform.machine().lower()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        pass
    return machine, frozenset(flags)


@functools.lru_cache(maxsize=1)
def host_repack_rules() -> dict[str, int]:
    """Weight types the CPU backend repacks on this host, with the row multiple it needs
    (``ggml_repack_get_optimal_repack_type`` in ggml-cpu/repack.cpp). Repacked weights get a
    ``CPU_REPACK`` buffer of their own, beside the memory-mapped file."""
    machine, flags = _cpu_flags()
    rules: dict[str, int] = {}
    if machine in ("x86_64", "amd64", "i686", "i386"):
        if "avx2" in flags:
            rules.update({"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8})
        if "avx512f" in flags:
            rules["Q2_K"] = 8
    elif machine in ("aarch64", "arm64"):
        i8mm, dot = "i8mm" in flags, "asimddp" in flags
        if i8mm or dot:
            rules.update({"Q4_0": 4, "Q8_0": 4, "IQ4_NL": 4, "Q5_K": 8, "Q6_K": 8, "MXFP4": 4})
        if i8mm:
            rules["Q4_K"] = 8
    return rules


def _tensor_offsets(info: GGUFInfo) -> dict[str, tuple[int, int]]:
    """(start, end) of each tensor's data relative to the data section, in table order."""
    align = info.metadata.get("general.alignment")
    align = int(align) if isinstance(align, int) and align > 0 else 32
    out, off = {}, 0
    for t in info.tensors:
        out[t.name] = (off, off + t.n_bytes)
        off = (off + t.n_bytes + align - 1) // align * align
    return out


def weight_bytes(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None,
                 split: Sequence[float] | None = None) -> dict[str, int]:
    """Model-buffer bytes per device, as llama.cpp allocates (and logs) them.

    * every tensor of block N goes where layer N goes; ``output*`` tensors where the output
      layer goes; the token embedding (and anything else outside the blocks) stays in host
      memory; a model without ``output.weight`` (tied embeddings) gets a copy of the token
      embedding wherever its output layer is, unless that is host memory and the copy would
      not be repacked (then the output reads the embedding itself, mapped or not);
      a mixture of experts placed by ``--fit`` keeps the experts of its partial layers in host
      memory (:func:`tensor_devices`), inside the mapping;
    * host memory with mmap (the default): one ``CPU_Mapped`` buffer spanning the file from the
      first to the last host tensor (tensors on a GPU between them are inside the span), plus,
      on a CPU-only machine, a ``CPU_REPACK`` copy of the weights the CPU backend repacks
      (:func:`host_repack_rules`); with ``use_mmap=False`` a ``CPU`` buffer holding exactly the
      host tensors;
    * each GPU: the sum of its tensors.
    """
    devices, out_dev = layer_devices(info, options, gpus, split)
    # A local GPU puts its pinned host buffer type ahead of the CPU's repacking;
    # RPC devices have no host buffer type, so host layers still repack beside them.
    local_gpu = any(not g.startswith("rpc:") for g in (gpus or []))
    rules = {} if local_gpu else host_repack_rules()
    mmap = options.use_mmap is not False
    offsets = _tensor_offsets(info)
    per_dev: dict[str, int] = {}
    host_plain: list[str] = []
    repacked = 0

    def repackable(t) -> bool:
        if len(t.shape) != 2:
            return False
        need = rules.get(t.ggml_type)
        return bool(need) and t.shape[1] % need == 0

    has_output = any(t.name == "output.weight" for t in info.tensors)
    placed = tensor_devices(info, options, gpus, split)
    for t in info.tensors:
        dev = placed[t.name]
        if dev != HOST:
            per_dev[dev] = per_dev.get(dev, 0) + t.n_bytes
        elif t.name != "token_embd.weight" and repackable(t):
            repacked += t.n_bytes
        else:
            host_plain.append(t.name)
    if not has_output:
        embd = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
        if embd is not None:
            # (llama.cpp makes the copy only in a buffer type other than the embedding's: on a
            # device, or repacked; in plain host memory the output reads the embedding itself)
            if out_dev != HOST:
                per_dev[out_dev] = per_dev.get(out_dev, 0) + embd.n_bytes
            elif repackable(embd):
                repacked += embd.n_bytes
    if host_plain:
        if mmap:
            first = min(offsets[n][0] for n in host_plain)
            last = max(offsets[n][1] for n in host_plain)
            host = last - first
        else:
            sizes = {t.name: t.n_bytes for t in info.tensors}
            host = sum((sizes[n] + 31) // 32 * 32 for n in host_plain)
        per_dev[HOST] = per_dev.get(HOST, 0) + host
    if repacked:
        per_dev[HOST] = per_dev.get(HOST, 0) + repacked
    return per_dev
