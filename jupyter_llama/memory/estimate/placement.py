"""Where llama.cpp puts a model's layers and tensors across devices: the slices of
offloaded layers per device (``-ngl``, ``--tensor-split``), and the partial layers of a
mixture of experts that ``--fit`` spreads between devices and host memory (:class:`Share`).
"""

from __future__ import annotations

import re
from typing import Sequence

from ...load_options import LoadOptions
from ...models.gguf_info import GGUFInfo
from ..report import HOST


class Share(float):
    """One accelerator's share of the offloaded layers, as llama.cpp's ``--fit`` sets it for a
    mixture-of-experts model: ``layers`` whole layers (the value), of which the last ``partial``
    keep their experts in host memory (llama.cpp's ``-ot`` overrides: a MoE model's dense
    weights go to the devices before its experts do). The first of those may instead move only
    part of its feed-forward (``overflow``: ``up`` keeps attention and the up projection,
    ``gate`` the gate too, ``attn`` only attention; ``moe``: just the experts) to the next
    device (``to_next``) or host memory. A plain float share means whole layers."""

    partial: int
    overflow: str
    to_next: bool

    def __new__(cls, layers: float, partial: int = 0, overflow: str = "moe", to_next: bool = False):
        obj = super().__new__(cls, layers)
        obj.partial, obj.overflow, obj.to_next = int(partial), overflow, bool(to_next)
        return obj

    def __str__(self) -> str:  # (as a number wherever a split is written out)
        return float.__repr__(self)

    def __repr__(self) -> str:
        extra = f", partial={self.partial}" if self.partial else ""
        if self.overflow != "moe":
            extra += f", overflow={self.overflow!r}" + (", to_next=True" if self.to_next else "")
        return f"Share({float(self)!r}{extra})"

    def __reduce__(self):
        return (Share, (float(self), self.partial, self.overflow, self.to_next))


# llama.cpp's overrides for a partial layer (common/fit.cpp): which of its tensors leave the device
_OVERFLOW_PATTERNS = {
    "attn": r"blk\.{il}\.ffn_(gate|up|gate_up|down).*",
    "up": r"blk\.{il}\.ffn_(gate|gate_up|down).*",
    "gate": r"blk\.{il}\.ffn_down.*",
    "moe": r"blk\.{il}\.ffn_(up|down|gate_up|gate)_(ch|)exps",
}


def partial_layers(info: GGUFInfo, gpus: list[str], split: Sequence[float] | None) -> dict[int, tuple[str, str]]:
    """``{layer: (overflow, where)}``: the layers whose experts (or part of whose feed-forward)
    llama.cpp keeps off their device under ``split`` (:class:`Share`), as ``--fit`` writes its
    overrides: in each device's slice the whole layers come first, then the partial ones; the
    first partial layer of a slice moves its ``overflow`` part to ``where`` (the next device, or
    host memory), the others their experts to host memory."""
    out: dict[int, tuple[str, str]] = {}
    if not split or not any(getattr(s, "partial", 0) for s in split):
        return out
    il0 = info.block_count + 1 - int(sum(float(s) for s in split))
    for i, s in enumerate(split):
        il0 += int(float(s)) - getattr(s, "partial", 0)
        for k in range(getattr(s, "partial", 0)):
            il = il0 + k
            assert isinstance(s, Share)  # only a Share has partial layers
            if k == 0 and s.overflow != "moe":
                out[il] = (s.overflow, gpus[i + 1] if s.to_next and i + 1 < len(gpus) else HOST)
            else:
                out[il] = ("moe", HOST)
        il0 += getattr(s, "partial", 0)
    return out


def tensor_devices(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None,
                   split: Sequence[float] | None = None) -> dict[str, str]:
    """The device of every tensor: a layer's tensors where the layer is (:func:`layer_devices`),
    ``output*`` where the output layer is, the rest in host memory; then the overrides of
    :func:`partial_layers` (a mixture of experts that ``--fit`` spread over devices and host)."""
    devices, out_dev = layer_devices(info, options, gpus, split)
    outs = _output_tensors(info)
    placed: dict[str, str] = {}
    for t in info.tensors:
        if t.layer is not None and t.layer < len(devices):
            placed[t.name] = devices[t.layer]
        elif t.name.startswith("output") or t.name in outs:
            placed[t.name] = out_dev
        else:
            placed[t.name] = HOST
    for il, (overflow, where) in partial_layers(info, list(gpus or []), split).items():
        if il >= info.block_count or devices[il] == HOST:
            continue
        pattern = re.compile(_OVERFLOW_PATTERNS[overflow].format(il=il))
        for t in info.tensors:
            if t.layer == il and pattern.search(t.name):
                placed[t.name] = where
    return placed


def experts_on_host(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None,
                    split: Sequence[float] | None = None) -> frozenset[int]:
    """Offloaded layers whose expert matmuls run in host memory, next to their weights."""
    devices, _ = layer_devices(info, options, gpus, split)
    return frozenset(il for il, (_o, where) in partial_layers(info, list(gpus or []), split).items()
                     if il < info.block_count and devices[il] != HOST and where == HOST)


def layer_devices(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None,
                  split: Sequence[float] | None = None) -> tuple[list[str], str]:
    """(device of each repeating layer, device of the output layer), as llama.cpp assigns them.

    llama.cpp offloads the *last* ``n_gpu_layers`` of the ``n_layer + 1`` layers, where the
    extra one is the output layer (``i_gpu_start = n_layer + 1 - n_gpu_layers``): ``-ngl 1``
    puts only the output layer on the GPU. The offloaded layers are cut into contiguous
    slices, one per device in device order (the last device gets the output layer), in
    proportion to ``split``: llama.cpp's default split is each device's free memory, and
    ``--fit`` sets it to the number of layers it chose per device. Without ``split`` the shares
    are equal. The input (token embedding) layer always stays in host memory. ``num_gpu``
    None means all layers, unless ``split`` says how many (its sum, when it is whole layers
    summing to fewer than all: what ``--fit`` decided).
    """
    n = info.block_count
    if not gpus or options.num_gpu == 0:
        return [HOST] * n, HOST
    if split is not None and len(split) != len(gpus):
        raise ValueError(f"split has {len(split)} entries for {len(gpus)} devices")
    ngl = n + 1 if options.num_gpu is None else int(options.num_gpu)
    if options.num_gpu is None and split is not None and all(float(x).is_integer() for x in split):
        ngl = min(ngl, int(sum(split)))
    if ngl <= 0:
        return [HOST] * n, HOST
    start = max(n + 1 - ngl, 0)
    active = min(ngl, n + 1)
    weights = [max(0.0, float(x)) for x in split] if split is not None else [1.0] * len(gpus)
    total = sum(weights) or 1.0
    acc, cuts = 0.0, []
    for w in weights:
        acc += w
        cuts.append(acc / total)

    def device(il: int) -> str:
        if il < start or il - start >= active:
            return HOST
        x = (il - start) / active
        idx = next((i for i, s in enumerate(cuts) if s > x), len(gpus) - 1)
        return gpus[idx]

    return [device(il) for il in range(n)], device(n)


def estimate_layer_counts(info: GGUFInfo, options: LoadOptions, gpus: list[str],
                          split: Sequence[float] | None = None) -> list[int]:
    """Layers (the output layer counted) each of ``gpus`` gets under :func:`layer_devices`."""
    blocks, out = layer_devices(info, options, gpus, split)
    return [sum(d == g for d in blocks) + (out == g) for g in gpus]


def _placement_notes(info: GGUFInfo, options: LoadOptions, gpus: list[str],
                     split: Sequence[float] | None) -> list[str]:
    """What the estimate of a placement says of itself where it is not measured: a mixture of
    experts whose experts stay in host memory, and a layer whose feed-forward is split between
    two devices."""
    notes = []
    parts = partial_layers(info, gpus, split)
    devices, _ = layer_devices(info, options, gpus, split)
    on_host = sorted(il for il, (kind, where) in parts.items()
                     if kind == "moe" and where == HOST and il < info.block_count and devices[il] != HOST)
    if on_host:
        notes.append(f"llama.cpp's --fit keeps the experts of {len(on_host)} offloaded layer"
                     f"{'s' if len(on_host) > 1 else ''} in host memory (their expert matmuls run there)")
        if any(not g.startswith("rpc:") for g in gpus):
            notes.append("a local GPU copies host experts over for large batches: counted as the largest layer's "
                         "experts in its compute buffer (derived, not measured)")
    for il, (kind, where) in sorted(parts.items()):
        if kind != "moe" and il < info.block_count and devices[il] != HOST:
            moved = {"attn": "its whole feed-forward", "gate": "its down projection",
                     "up": "all of its feed-forward but the up projection"}[kind]
            notes.append(f"llama.cpp's --fit moves {moved} of layer {il} to {where}"
                         + (": the compute buffers of that split are replayed from its scheduling, not measured "
                            "(some 0.2 MiB high on small models)" if kind == "up" else ""))
    return notes


def _output_tensors(info: GGUFInfo) -> frozenset[str]:
    """Tensors of the output layer whose names do not start with ``output`` (LFM2 names its
    final norm ``token_embd_norm``; llama.cpp still places it with the output layer)."""
    return frozenset({"token_embd_norm.weight"}) if info.architecture == "lfm2" else frozenset()
