"""The context llama.cpp builds for a load (:class:`ContextPlan`: its cells, streams, slots
and batches, resolved as llama.cpp resolves them), and what its caches take: the KV cache per
layer, and the recurrent state of layers that keep one instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...load_options import LoadOptions, batch_args
from ...models.gguf_info import GGUFInfo

# bytes per block and elements per block of each KV cache type (ggml's type traits)
KV_TYPE_BLOCKS = {
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "iq4_nl": (18, 32),
    "q5_0": (22, 32),
    "q5_1": (24, 32),
}

KV_PAD = 256  # llama.cpp pads n_ctx, per-stream contexts and the SWA cache to 256 cells
DEFAULT_BATCH = 2048  # llama-server's -b
DEFAULT_UBATCH = 512  # llama-server's -ub
AUTO_SLOTS = 4  # llama-server's -np auto: 4 slots sharing one unified cache


def _pad(n: int, to: int = KV_PAD) -> int:
    return (int(n) + to - 1) // to * to


def kv_row_bytes(cache_type: str, n: int) -> int:
    """Bytes of one cache row of ``n`` elements (ggml_row_size): f32 4n, f16/bf16 2n,
    q8_0 34n/32, q4_0 and iq4_nl 18n/32, q4_1 20n/32, q5_0 22n/32, q5_1 24n/32."""
    try:
        block_bytes, block = KV_TYPE_BLOCKS[cache_type]
    except KeyError:
        raise ValueError(f"unknown KV cache type {cache_type!r}") from None
    return block_bytes * (-(-int(n) // block))


@dataclass(frozen=True)
class ContextPlan:
    """The context llama-server will create for some load options, resolved the way
    llama.cpp resolves it (``llama_context`` constructor, ``tools/server/server.cpp``)."""

    n_ctx_requested: int  # -c, or the training context when automatic
    n_ctx: int  # total KV cells: padded to 256 (x slots without a unified cache)
    n_ctx_seq: int  # cells per stream (what each sequence may use)
    n_seq: int  # slots (n_seq_max)
    unified: bool  # one KV stream shared by all slots
    n_batch: int
    n_ubatch: int  # also the worst-case micro-batch of the compute reserve
    n_outputs_max: int  # output rows the context is built for (llama-server: one per slot)
    flash_attn: bool
    type_k: str
    type_v: str
    swa_cells: int = 0  # cells per stream of the sliding-window cache (0: no SWA layers)
    embedding: bool = False

    @property
    def n_stream(self) -> int:
        return 1 if self.unified else self.n_seq

    @property
    def v_trans(self) -> bool:
        """Without flash attention the V cache is stored transposed."""
        return not self.flash_attn


def plan_context(info: GGUFInfo, options: LoadOptions) -> ContextPlan:
    """Resolve ``options`` into the context llama.cpp will build for ``info``.

    * slots: ``num_parallel`` None is llama-server's auto, 4 slots with a unified cache
      (``-kvu`` forced); an explicit P has P slots and a unified cache only with
      ``kv_unified=True``;
    * context: ``-c`` is ``num_ctx * P`` (None: the training context, which llama.cpp's ``--fit``
      shrinks only when it would not fit in memory); llama.cpp pads it to 256 cells;
      without a unified cache each stream gets ``pad(n_ctx / P, 256)`` cells;
    * batches: ``n_batch = min(-c, -b)`` (before padding), ``n_ubatch = min(n_batch, -ub)``;
    * flash attention: ``auto`` counts as on (it resolves to on for these models on CPU and on
      current GPUs);
    * sliding-window layers keep ``pad(min(cells, n_swa * (P if unified else 1) + n_ubatch), 256)``
      cells per stream.
    """
    o = options
    if o.num_parallel is None:
        n_seq, unified = AUTO_SLOTS, True
    else:
        n_seq, unified = int(o.num_parallel), bool(o.kv_unified)
    requested = int(o.total_ctx) if o.total_ctx is not None else int(info.context_length)
    requested = max(1, requested)
    batch, ubatch = batch_args(o)  # (as the child's command line says them)
    n_ubatch_opt = ubatch or DEFAULT_UBATCH
    n_batch = batch or DEFAULT_BATCH
    if o.embedding and n_batch > n_ubatch_opt:
        n_batch = n_ubatch_opt  # llama-server: embeddings need the whole batch in one ubatch
    n_batch = min(requested, n_batch)
    n_ubatch = min(n_batch, n_ubatch_opt)
    n_ctx = _pad(requested)
    if unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = _pad(n_ctx // n_seq)
        n_ctx = n_ctx_seq * n_seq
    n_outputs_max = n_batch if o.embedding else max(1, min(n_batch, n_seq))
    swa_cells = 0
    if info.swa_layers and any(info.swa_layers) and info.sliding_window:
        swa_cells = _pad(min(n_ctx_seq, info.sliding_window * (n_seq if unified else 1) + n_ubatch))
    return ContextPlan(
        n_ctx_requested=requested, n_ctx=n_ctx, n_ctx_seq=n_ctx_seq, n_seq=n_seq, unified=unified,
        n_batch=n_batch, n_ubatch=n_ubatch, n_outputs_max=n_outputs_max,
        flash_attn=(o.flash_attn or "auto") != "off",
        type_k=o.cache_type_k or "f16", type_v=o.cache_type_v or "f16",
        swa_cells=swa_cells, embedding=bool(o.embedding))


def _is_swa(info: GGUFInfo, layer: int) -> bool:
    return bool(info.swa_layers and layer < len(info.swa_layers) and info.swa_layers[layer]
                and info.sliding_window)


def kv_cache_bytes(info: GGUFInfo, plan: ContextPlan) -> dict[int, int]:
    """KV bytes per layer (layers without KV heads are absent).

    Per layer: ``(row(type_k, head_dim_k * n_head_kv) + row(type_v, n_v)) * cells * streams``
    with ``cells`` = ``n_ctx_seq`` (``swa_cells`` for sliding-window layers), ``streams`` = 1
    with a unified cache, else the number of slots, and ``n_v`` = ``head_dim_v * n_head_kv``,
    or its maximum over layers when V is stored transposed (no flash attention).
    """
    out: dict[int, int] = {}
    v_max = max((info.head_dim_v(il) * info.n_head_kv(il) for il in range(info.block_count)), default=0)
    mla = info.is_mla
    for il in range(info.block_count):
        hkv = info.n_head_kv(il)
        if hkv <= 0:
            continue
        cells = plan.swa_cells if (_is_swa(info, il) and plan.swa_cells) else plan.n_ctx_seq
        n_k = info.head_dim_k(il) * hkv
        n_v = v_max if plan.v_trans else info.head_dim_v(il) * hkv
        # MLA caches one compressed row per token and reads V out of it: no V cache
        row = kv_row_bytes(plan.type_k, n_k) + (0 if mla else kv_row_bytes(plan.type_v, n_v))
        out[il] = row * cells * plan.n_stream
    return out


RS_ALIGNMENT = 32  # the recurrent state's buffer places each layer's tensors at this alignment


def rs_bytes(info: GGUFInfo, plan: ContextPlan) -> dict[int, int]:
    """Recurrent-state bytes per layer (llama.cpp's ``llama_memory_recurrent``): a layer that keeps
    a state instead of a KV cache has an f32 ``r`` state of ``n_embd_r`` and an ``s`` state of
    ``n_embd_s`` elements per sequence (``max(1, slots)`` of them, whatever the context). For
    LFM2's short convolutions ``n_embd_r = (l_cache - 1) * n_embd`` (the last positions of each
    sequence) and ``n_embd_s = 0``: a few KiB where attention would keep the whole context."""
    out: dict[int, int] = {}
    l_cache = info.shortconv_l_cache
    if not l_cache:
        return out
    n_rs = max(1, plan.n_seq)
    r = (l_cache - 1) * info.embedding_length * 4 * n_rs
    for il in range(info.block_count):
        if info.is_recurrent(il):
            out[il] = -(-r // RS_ALIGNMENT) * RS_ALIGNMENT
    return out
