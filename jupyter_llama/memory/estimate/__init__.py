"""Memory predictions, each a :class:`MemoryReport`.

* ``coarse``: Ollama's deliberately conservative scheduling estimate (REFERENCE section 3):
  the file size as weights plus an f16 KV cache for the whole context, plus a surcharge for
  large batches. It has no compute buffer, so for very small models, where the compute
  buffer outweighs the weights, it can come out *below* what llama.cpp allocates.
* ``detailed``: what llama-server will allocate, per device and component, derived from the
  GGUF tensor table and llama.cpp's own sizing rules (REFERENCE section 4): exact weights
  and KV cache, the compute buffer by replaying llama.cpp's worst-case graph through ggml's
  allocator (:mod:`..computegraph`), the host output buffer.
* ``llama.cpp``: llama.cpp's own projection from ``llama-fit-params`` (:mod:`..fitparams`).

:func:`..sources.estimate_all` gathers the three; :func:`format_estimates` prints them side by side.

A package, one seam a module: ``defaults`` (a load's options as Ollama resolves them: the
context capped at the training one, the default context, an embedding load's batch),
``coarse``, ``archs`` (the architectures the detailed estimate models), ``kv`` (the context
llama.cpp builds and its caches), ``placement`` (layers and tensors across devices),
``weights``, ``compute`` (compute and output buffers), ``detailed``, ``fit`` (the split of
llama.cpp's ``--fit``) and ``text``. Each name below is importable from this package as it
was from the one module.
"""

from __future__ import annotations

from ...seams import forward_settings
from . import archs, coarse, compute, defaults, detailed, fit, kv, placement, text, weights
from .archs import LLAMA_LIKE, MOE_ARCHS, VERIFIED_ARCHS
from .coarse import LLAMA_SERVER_DEFAULT_BATCH, batch_surcharge, coarse_context, estimate_coarse
from .compute import PIPELINE_COPIES, compute_bytes, graph_plan, output_bytes, pipeline_parallel
from .defaults import (
    EMBED_BATCH,
    EMBED_BATCH_LEAST,
    EMBED_LOGITS_SHARE,
    capped_ctx,
    default_context,
    embed_batch,
    gpu_memory,
    machine_memory,
    with_cap_note,
    within_training,
)
from .detailed import FIT_MIN_CTX, estimate_detailed
from .fit import fit_layers
from .kv import (
    AUTO_SLOTS,
    DEFAULT_BATCH,
    DEFAULT_UBATCH,
    KV_PAD,
    KV_TYPE_BLOCKS,
    RS_ALIGNMENT,
    ContextPlan,
    kv_cache_bytes,
    kv_row_bytes,
    plan_context,
    rs_bytes,
)
from .placement import Share, estimate_layer_counts, experts_on_host, layer_devices, partial_layers, tensor_devices
from .text import format_estimates
from .weights import _tensor_offsets as _tensor_offsets
from .weights import host_repack_rules, weight_bytes

__all__ = [
    "AUTO_SLOTS", "DEFAULT_BATCH", "DEFAULT_UBATCH", "EMBED_BATCH", "EMBED_BATCH_LEAST", "EMBED_LOGITS_SHARE",
    "FIT_MIN_CTX", "KV_PAD", "KV_TYPE_BLOCKS", "LLAMA_LIKE", "LLAMA_SERVER_DEFAULT_BATCH", "MOE_ARCHS",
    "PIPELINE_COPIES", "RS_ALIGNMENT", "VERIFIED_ARCHS",
    "ContextPlan", "Share",
    "batch_surcharge", "capped_ctx", "coarse_context", "compute_bytes", "default_context", "embed_batch",
    "estimate_coarse", "estimate_detailed", "estimate_layer_counts", "experts_on_host", "fit_layers",
    "format_estimates", "gpu_memory", "graph_plan", "host_repack_rules", "kv_cache_bytes", "kv_row_bytes",
    "layer_devices", "machine_memory", "output_bytes", "partial_layers", "pipeline_parallel", "plan_context",
    "rs_bytes", "tensor_devices", "weight_bytes", "with_cap_note", "within_training",
]

# (a test that sets one of this package's names sets it where the seams use it: see seams.py)
forward_settings(__name__, (archs, coarse, compute, defaults, detailed, fit, kv, placement, text, weights))
