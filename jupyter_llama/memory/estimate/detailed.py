"""The detailed estimate: what llama-server will allocate, per device and component, from
the GGUF tensor table and llama.cpp's own sizing rules (REFERENCE section 4): the weights
(:mod:`.weights`), the KV cache (:mod:`.kv`), the compute buffers (:mod:`.compute`) and the
output buffer, where :mod:`.placement` puts them.
"""

from __future__ import annotations

from typing import Sequence

from ...load_options import LoadOptions
from ...models.gguf_info import GGUFInfo
from ..computegraph import CPU_ALIGNMENT, GPU_ALIGNMENT
from ..report import COMPUTE, DETAILED, HOST, KV, OUTPUT, RS, WEIGHTS, MemoryReport
from .archs import LLAMA_LIKE, MOE_ARCHS, VERIFIED_ARCHS
from .coarse import estimate_coarse
from .compute import PIPELINE_COPIES, compute_bytes, output_bytes, pipeline_parallel
from .kv import KV_TYPE_BLOCKS, kv_cache_bytes, plan_context, rs_bytes
from .placement import _placement_notes, experts_on_host, layer_devices, partial_layers
from .weights import weight_bytes

# llama.cpp's --fit never shrinks an automatic context below this (common/fit.cpp).
FIT_MIN_CTX = 4096


def _unsupported_reason(info: GGUFInfo) -> str | None:
    if info.architecture not in LLAMA_LIKE:
        return f"architecture {info.architecture!r} is not modelled"
    if info.architecture not in MOE_ARCHS and any("_exps" in t.name for t in info.tensors):
        return f"mixture-of-experts layers of {info.architecture!r} are not modelled"
    if not isinstance(info.head_count, list) and int(info.head_count) <= 0:
        return "layers without attention heads (recurrent) are not modelled"
    if info.block_count <= 0 or info.embedding_length <= 0 or info.vocab_size <= 0:
        return "the model's shape is incomplete"
    return None


def _coarse_fallback(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None, reason: str) -> MemoryReport:
    coarse = estimate_coarse(info, options, gpus)
    rep = MemoryReport(DETAILED, bytes=dict(coarse.bytes), n_ctx=coarse.n_ctx)
    rep.warnings.append(f"detailed estimate unavailable ({reason}); showing the coarse estimate")
    return rep


def estimate_detailed(info: GGUFInfo, options: LoadOptions, gpus: list[str],
                      split: Sequence[float] | None = None) -> MemoryReport:
    """Bytes per device and component that llama-server will allocate for this load.

    * weights: :func:`weight_bytes` (tensor table, layer placement, mmap span, CPU repacking);
    * KV: :func:`kv_cache_bytes` on the device of each layer (llama.cpp keeps a layer's cache
      with the layer);
    * compute: :func:`compute_bytes`, llama.cpp's worst-case graph replayed through ggml's
      allocator (exact on the CPU backend). With GPUs the graph runs on the GPU holding the
      most layers, and the host keeps a buffer for the embedding lookup, about three
      ``n_embd * n_ubatch`` f32 tensors; under partial offload the host also runs the graph for
      its layers and the GPU additionally receives copies of the largest host layer's weights
      for large batches. The GPU parts are derived, not calibrated (no GPU was available);
    * output: :func:`output_bytes`, in host memory.

    ``split`` is the share of offloaded layers per device (see :func:`layer_devices`): whole
    layer counts for a placement llama.cpp's ``--fit`` chose or :func:`fit_layers` predicts,
    free memory per device for llama.cpp's default split.

    Never raises: models it cannot model get the coarse numbers and a warning.
    """
    gpus = list(gpus or [])
    try:
        reason = _unsupported_reason(info)
        if reason:
            return _coarse_fallback(info, options, gpus, reason)
        return _estimate_detailed(info, options, gpus, split)
    except Exception as e:  # a malformed header must not take the scheduler down
        try:
            return _coarse_fallback(info, options, gpus, f"{type(e).__name__}: {e}")
        except Exception:
            rep = MemoryReport(DETAILED)
            rep.warnings.append(f"no estimate possible: {type(e).__name__}: {e}")
            return rep


def _estimate_detailed(info: GGUFInfo, options: LoadOptions, gpus: list[str],
                       split: Sequence[float] | None = None) -> MemoryReport:
    plan = plan_context(info, options)
    devices, out_dev = layer_devices(info, options, gpus, split)
    rep = MemoryReport(DETAILED, n_ctx=plan.n_ctx)
    if gpus:
        rep.layers_total = info.block_count + 1
        rep.layers_offloaded = sum(d != HOST for d in devices) + (out_dev != HOST)

    for dev, n in weight_bytes(info, options, gpus, split).items():
        rep.add(dev, WEIGHTS, n)
    for il, n in kv_cache_bytes(info, plan).items():
        rep.add(devices[il], KV, n)
    for il, n in rs_bytes(info, plan).items():
        rep.add(devices[il], RS, n)

    used_gpus: dict[str, int] = {}  # GPU -> layers on it (the output layer counts)
    for d in [*devices, out_dev]:
        if d != HOST:
            used_gpus[d] = used_gpus.get(d, 0) + 1
    if not used_gpus:
        rep.add(HOST, COMPUTE, compute_bytes(info, plan, CPU_ALIGNMENT))
    else:
        # Each backend sizes its own buffer for the part of the graph it runs (measured on
        # RPC devices: 1 last layer 4.51 MiB, the output layer alone 0.02 MiB, the host with
        # three full layers the same 13.58 MiB as the whole graph on the CPU).
        t = min(plan.n_ctx, plan.n_ubatch)
        host_layers = [il for il, d in enumerate(devices) if d == HOST]
        # (tensor overrides, such as a mixture of experts' partial layers, turn pipelining off)
        overridden = bool(partial_layers(info, gpus, split))
        copies = PIPELINE_COPIES if not overridden and pipeline_parallel(len(gpus), rep.layers_offloaded or 0,
                                                                         info.block_count + 1) else 1
        experts = experts_on_host(info, options, gpus, split)
        # the first partial layer of a device may move part of its feed-forward on
        moved = {il: (kind, where) for il, (kind, where) in partial_layers(info, gpus, split).items()
                 if kind != "moe" and il < info.block_count and devices[il] != HOST}
        away = {il: where for il, (_kind, where) in moved.items()}
        for d in [HOST, *used_gpus]:
            part = dict(layers=frozenset(il for il, dv in enumerate(devices) if dv == d),
                        output=out_dev == d, embed=d == HOST, host=frozenset(host_layers))
            if experts or away:
                firsts = [min(il for il, dv in enumerate(devices) if dv == g) for g in used_gpus if g in devices]
                part["inputs_until"] = max(firsts, default=0)
            if experts:
                part["experts"] = experts
            if away:
                part["ffn_away"] = frozenset(il for il in away if devices[il] == d)
                part["ffn_here"] = frozenset(il for il, where in away.items() if where == d)
                part["ffn_kind"] = tuple(sorted((il, kind) for il, (kind, _where) in moved.items()))
            align = CPU_ALIGNMENT if d == HOST or d.startswith("rpc:") else GPU_ALIGNMENT
            rep.add(d, COMPUTE, compute_bytes(info, plan, align, copies, **part))
        local = [d for d in used_gpus if not d.startswith("rpc:")]
        if (host_layers or experts) and local and t >= 32:
            # A local GPU runs large-batch matmuls of host weights, copying them over (RPC
            # devices do not: their backend offloads no operation).
            lb = info.layer_bytes()
            eb = {il: sum(x.n_bytes for x in info.tensors if x.layer == il and info.is_expert_tensor(x.name))
                  for il in experts}
            main = max(local, key=lambda d: used_gpus[d])
            rep.add(main, COMPUTE, max([lb.get(il, 0) for il in host_layers] + list(eb.values())))
    rep.add(HOST, OUTPUT, output_bytes(info, plan))

    if options.total_ctx is None and plan.n_ctx_requested > FIT_MIN_CTX:
        rep.warnings.append(f"automatic context: this estimate assumes the training context ({plan.n_ctx_requested}); "
                            f"llama.cpp's --fit shrinks it (to no less than {FIT_MIN_CTX}) when that would not fit "
                            "in free GPU memory or in total host memory")

    if info.architecture not in VERIFIED_ARCHS:
        rep.warnings.append(f"compute buffer for {info.architecture!r} assumes llama's graph "
                            f"(verified against {', '.join(sorted(VERIFIED_ARCHS))})")
    if gpus:
        rep.warnings += _placement_notes(info, options, gpus, split)
    if plan.flash_attn:
        for kind, ctype, dim in (("K", plan.type_k, info.head_dim_k), ("V", plan.type_v, info.head_dim_v)):
            block = KV_TYPE_BLOCKS[ctype][1]
            bad = sorted({dim(il) for il in range(info.block_count) if dim(il) % block})
            if block > 1 and bad:
                rep.warnings.append(f"{kind} cache type {ctype} needs a head size divisible by {block} under flash "
                                    f"attention (this model has {bad[0]}); llama.cpp will refuse to create the context")
    if options.num_ctx is not None and options.num_ctx > info.context_length:
        rep.warnings.append(f"num_ctx {options.num_ctx} exceeds the training context {info.context_length}")
    return rep
