"""The split llama.cpp's ``--fit`` arrives at for a load across accelerators: whole layers
per device, or for a mixture of experts its dense weights first and its experts with the
room left (:class:`~.placement.Share`), each candidate measured with the detailed estimate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from ...load_options import LoadOptions
from ...models.gguf_info import GGUFInfo
from .detailed import _estimate_detailed
from .placement import Share, layer_devices


def fit_layers(info: GGUFInfo, options: LoadOptions, rooms: Sequence[tuple[str, int]],
               free: Sequence[int] | None = None) -> list[float]:
    """The split llama.cpp's ``--fit`` arrives at, as ``--tensor-split`` weights per accelerator.

    First, as llama.cpp does, the default placement: every layer offloaded, split in
    proportion to the devices' ``free`` memory. If that keeps every device within its room,
    it stays ("targets for free memory can be met on all devices, no changes needed"), and
    the weights are the free memory. Otherwise the layers are filled from the back of the
    model (the output layer first) onto the last device, as many whole layers as keep its
    predicted use within its room, then the device before it, and so on; the weights are
    the layer counts.

    ``rooms`` is ``[(device id, bytes llama.cpp may use there)]`` in device order: what the
    scheduler's budgets leave, which it also passes to llama.cpp as ``--fit-target``. The
    per-device use of each candidate split is the detailed estimate for it, so this is the
    placement the detailed estimate then describes.
    """
    gpus = [d for d, _ in rooms]
    n_total = info.block_count + 1
    counts = [0] * len(gpus)

    def use(i: int, split: Sequence[float]) -> int:
        rep = _estimate_detailed(info, options.replace(num_gpu=None), gpus, split=split)
        return rep.total(device=gpus[i])

    if free is not None and gpus:
        default = [float(max(f, 1)) for f in free]
        if all(use(i, default) <= room for i, (_, room) in enumerate(rooms)):
            return default
    if gpus and any(info.is_expert_tensor(t.name) for t in info.tensors):
        return list(_fit_experts(info, options, rooms, free))

    remaining = n_total
    for i in range(len(gpus) - 1, -1, -1):
        room = rooms[i][1]
        lo, hi = 0, remaining
        while lo < hi:  # the largest n with use <= room
            mid = (lo + hi + 1) // 2
            trial = counts.copy()
            trial[i] = mid
            if use(i, trial) <= room:
                lo = mid
            else:
                hi = mid - 1
        counts[i] = lo
        remaining -= lo
        if remaining == 0:
            break
    return [float(c) for c in counts]


def _fit_experts(info: GGUFInfo, options: LoadOptions, rooms: Sequence[tuple[str, int]],
                 free: Sequence[int] | None) -> list[Share]:
    """llama.cpp's ``--fit`` for a mixture of experts (``common/fit.cpp``), when the default
    placement does not fit: its dense weights first, its experts with what room is left.

    1. From the last device to the first, as many layers as fit, each "dense-only": its
       experts in host memory (the output layer, on the last device, whole).
    2. If the dense weights of every layer fit in the devices' rooms together, layers are made
       whole from the front: the first device takes whole layers (taking them from the front
       of the dense-only ones) while it fits, then the next, and so on; then each device tries
       one more layer with part of its feed-forward moved on (to the next device, or host
       memory for the last): attention and up projection kept, then the gate too, else
       attention alone.

    Each candidate is measured with the detailed estimate, as llama.cpp measures it with a
    dry-run load. Returns :class:`Share` per device."""
    gpus = [d for d, _ in rooms]
    targets = [room for _, room in rooms]
    nd, n_total = len(gpus), info.block_count + 1
    opts = options.replace(num_gpu=None)

    @dataclass
    class Dev:
        n_layer: int = 0
        n_part: int = 0
        overflow: str = "moe"
        to_next: bool = False

    def shares(cfg: list[Dev]) -> list[Share]:
        return [Share(d.n_layer, d.n_part, d.overflow, d.to_next) for d in cfg]

    def mem(cfg: list[Dev]) -> list[int]:
        if not any(d.n_layer for d in cfg):
            return [0] * nd
        rep = _estimate_detailed(info, opts, gpus, split=shares(cfg))
        return [rep.total(device=g) for g in gpus]

    def copy(cfg: list[Dev]) -> list[Dev]:
        return [dataclasses.replace(d) for d in cfg]

    # The dense weights of every layer against all the rooms together (the default split, every
    # expert in host memory).
    default_devices, default_out = layer_devices(info, opts, gpus,
                                                 [float(max(f, 1)) for f in free] if free else None)
    dense_only = []
    for g in gpus:
        n = sum(d == g for d in default_devices) + (default_out == g)
        dense_only.append(Dev(n, n))  # (every layer's experts: the output layer has none)
    surplus = sum(targets) - sum(mem(dense_only))

    def with_layers(base: list[Dev], i: int, n: int) -> list[Dev]:
        """``base`` with ``n`` dense-only layers on device ``i`` (the last keeps the output layer whole)."""
        trial = copy(base)
        trial[i] = Dev(n, max(0, n - 1) if i == nd - 1 else n)
        return trial

    cfg = [Dev() for _ in gpus]
    for i in range(nd - 1, -1, -1):  # 1: dense-only layers, back to front
        unassigned = n_total - sum(d.n_layer for d in cfg[i + 1:])
        lo, hi = cfg[i].n_layer, unassigned
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mem(with_layers(cfg, i, mid))[i] <= targets[i]:
                lo = mid
            else:
                hi = mid - 1
        cfg = with_layers(cfg, i, lo)
    if surplus <= 0:
        return shares(cfg)

    start = nd  # 2: the first of the devices holding dense-only layers, to the end
    for i in range(nd - 1, -1, -1):
        if cfg[i].n_layer > 0:
            start = i
            continue
        break
    if start >= nd:
        return shares(cfg)

    def convert(base: list[Dev], i: int, n: int, first: int) -> tuple[list[Dev], int]:
        """``n`` dense-only layers, from the front of those, made whole layers of device ``i``."""
        trial, done = copy(base), 0
        j = first
        while j < nd:
            k = min(n - done, trial[j].n_part)
            trial[j].n_layer -= k
            trial[j].n_part -= k
            trial[i].n_layer += k
            done += k
            if trial[j].n_part > 0:
                break
            j += 1
        return trial, min(j, nd - 1)

    def fits(t: list[Dev], i: int) -> bool:
        """Whether ``t`` keeps device ``i`` and the one after it under their targets."""
        m = mem(t)
        return m[i] < targets[i] and (i + 1 == nd or m[i + 1] < targets[i + 1])

    i = 0
    while i <= start and start < nd:
        most = sum(d.n_part for d in cfg[start:])
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mem(convert(cfg, i, mid, start)[0])[i] <= targets[i]:
                lo = mid
            else:
                hi = mid - 1
        cfg, start = convert(cfg, i, lo, start)
        # One more layer, in part. (As in llama.cpp, this may take the output layer from the last
        # device, leaving it a layer count of 0 and a partial count of -1: no overrides there.)
        if cfg[start].n_layer > (0 if i < nd - 1 else 1):
            trial = copy(cfg)
            trial[start].n_layer -= 1
            trial[start].n_part -= 1
            trial[i].n_layer += 1
            trial[i].n_part += 1
            trial_start = start + 1 if trial[start].n_part == 0 and start + 1 < nd else start
            trial[i].to_next = i < nd - 1
            trial[i].overflow = "up"
            if fits(trial, i):
                cfg, start = copy(trial), trial_start
                trial[i].overflow = "gate"
                if fits(trial, i):
                    cfg = copy(trial)
            else:
                trial[i].overflow = "attn"
                if fits(trial, i):
                    cfg, start = copy(trial), trial_start
        i += 1
    return shares(cfg)
