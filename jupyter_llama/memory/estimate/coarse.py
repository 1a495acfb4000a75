"""The coarse estimate: Ollama's deliberately conservative scheduling rule (REFERENCE
section 3), the file size as weights plus an f16 KV cache for the whole context, plus a
surcharge for large batches. It has no compute buffer, so for very small models, where the
compute buffer outweighs the weights, it can come out *below* what llama.cpp allocates.
"""

from __future__ import annotations

from ...load_options import LoadOptions, batch_args
from ...models.gguf_info import GGUFInfo
from ..report import COARSE, HOST, KV, OTHER, WEIGHTS, GiB, MemoryReport, MiB, format_bytes
from .defaults import capped_ctx


def _scalar(v) -> int:
    if isinstance(v, (list, tuple)):
        nonzero = [x for x in v if x]
        return nonzero[0] if nonzero else 0
    return int(v)


def coarse_context(info: GGUFInfo, options: LoadOptions) -> int:
    """Cells the coarse estimate assumes: min(num_ctx, training context) x slots (an automatic
    num_ctx counts as its default context, else the training context)."""
    per_request = capped_ctx(options.request_ctx, info) or info.context_length
    return per_request * (options.num_parallel or 1)


LLAMA_SERVER_DEFAULT_BATCH = 2048  # llama-server's -b when we pass none


def batch_surcharge(options: LoadOptions) -> int:
    """Ollama's extra allowance for large batches, for the batch the child will really use.

    We do not pass ``-b`` unless asked, so the child runs llama-server's default of 2048
    and the coarse estimate carries the full 2 GiB: deliberately conservative (and, on small
    models, the very cost of being conservative that notebook 04 shows).
    """
    batch = batch_args(options)[0] or LLAMA_SERVER_DEFAULT_BATCH
    if batch >= 2048:
        return 2 * GiB
    if batch >= 1024:
        return 768 * MiB
    return 0


def estimate_coarse(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None = None) -> MemoryReport:
    """The conservative prediction, attributed to the device it would use.

    With GPUs and ``num_gpu`` not 0 the whole model is charged to the first GPU (or
    ``main_gpu``), the way a scheduler that assumes full offload would; otherwise to host
    memory.
    """
    ctx = coarse_context(info, options)
    head_dim = info.embedding_length // max(1, _scalar(info.head_count))
    hkv = info.head_count_kv
    kv_heads_sum = sum(hkv) if isinstance(hkv, (list, tuple)) else info.block_count * int(hkv)
    kv = 2 * kv_heads_sum * head_dim * ctx * 2
    device = HOST
    if gpus and options.num_gpu != 0:
        device = gpus[min(options.main_gpu or 0, len(gpus) - 1)]
    rep = MemoryReport(COARSE, n_ctx=ctx)
    rep.add(device, WEIGHTS, info.file_size)
    rep.add(device, KV, kv)
    surcharge = batch_surcharge(options)
    if surcharge:
        rep.add(device, OTHER, surcharge)
        rep.warnings.append(f"'other' is Ollama's allowance of {format_bytes(surcharge)} for a batch of "
                            f"{batch_args(options)[0] or LLAMA_SERVER_DEFAULT_BATCH} tokens (num_batch; llama-server's "
                            f"default is {LLAMA_SERVER_DEFAULT_BATCH}): conservative, and on a small model most of "
                            "what it predicts")
    return rep
