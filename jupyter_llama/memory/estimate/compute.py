"""The compute buffers, by replaying llama.cpp's worst-case graph through ggml's allocator
(:mod:`..computegraph`), and the host output buffer.
"""

from __future__ import annotations

from ...load_options import QUANTIZED_KV
from ...models.gguf_info import GGUFInfo
from ..computegraph import CPU_ALIGNMENT, GraphPlan, LayerShape, compute_buffer_bytes
from .archs import LLAMA_LIKE
from .kv import KV_TYPE_BLOCKS, ContextPlan, _is_swa


def _layer_shapes(info: GGUFInfo) -> tuple[LayerShape, ...]:
    by_name = {t.name: t for t in info.tensors}
    shapes = []
    for il in range(info.block_count):
        def dim(suffix: str, default: int, axis: int = 1, il: int = il) -> int:
            t = by_name.get(f"blk.{il}.{suffix}")
            return int(t.shape[axis]) if t is not None and len(t.shape) > axis else default

        hk, hv, hkv, hq = info.head_dim_k(il), info.head_dim_v(il), info.n_head_kv(il), info.n_head(il)
        n_ff = dim("ffn_up.weight", dim("ffn_gate.weight", info.feed_forward_length or 4 * info.embedding_length))
        kw: dict = {}
        if f"blk.{il}.ffn_up_exps.weight" in by_name:  # ggml shape {n_embd, n_ff_exp, n_expert}
            kw.update(n_expert=dim("ffn_up_exps.weight", info.n_expert, 2),
                      n_expert_used=max(1, info.n_expert_used), n_ff_exp=dim("ffn_up_exps.weight", n_ff))
        if info.is_recurrent(il):
            kw.update(mixer="conv", d_conv=info.shortconv_l_cache - 1)
            hkv = 0
        elif info.is_mla:
            rope = info.arch_int("rope.dimension_count")
            kw.update(mixer="mla", q_lora=dim("attn_q_a.weight", 0) if f"blk.{il}.attn_q_a.weight" in by_name else 0,
                      rope=rope, nope=info.arch_int("attention.key_length_mla") - rope,
                      head_v=info.arch_int("attention.value_length_mla"))
            shapes.append(LayerShape(n_embd_q=max(1, hq) * hk, n_embd_k=hk, n_embd_v=hv, n_head=max(1, hq),
                                     n_ff=n_ff, **kw))
            continue
        shapes.append(LayerShape(
            n_embd_q=dim("attn_q.weight", hq * hk), n_embd_k=hkv * hk, n_embd_v=hkv * hv,
            n_head=max(1, hq), n_ff=n_ff, swa=_is_swa(info, il), **kw))
    return tuple(shapes)


def _rotation(head_dim: int, quantized: bool, grow: bool) -> int:
    """Size of the Hadamard rotation llama.cpp applies for a quantized K (V) cache."""
    if not quantized or head_dim <= 0 or head_dim % 64:
        return 0
    n = 64
    while grow and head_dim % (2 * n) == 0:
        n *= 2
    return n


def graph_plan(info: GGUFInfo, plan: ContextPlan) -> GraphPlan:
    """The compute-graph parameters of :mod:`computegraph` for this model and context."""
    return GraphPlan(
        n_embd=info.embedding_length, n_vocab=info.vocab_size, layers=_layer_shapes(info),
        n_kv=plan.n_ctx_seq, n_kv_swa=plan.swa_cells, n_stream=plan.n_stream,
        flash_attn=plan.flash_attn,
        k_cast=plan.flash_attn and plan.type_k == "f32", v_cast=plan.flash_attn and plan.type_v == "f32",
        rot_k=_rotation(info.head_dim_k(0), plan.type_k in QUANTIZED_KV, grow=True),
        rot_v=_rotation(info.head_dim_v(0), plan.type_v in QUANTIZED_KV, grow=False),
        # A causal model computes its logits even when it embeds (llama.cpp builds the output
        # head into the graph, and an embedding load outputs every token of a micro-batch), so
        # its graph is the one with logits, for that many rows.
        embeddings=plan.embedding and info.architecture not in LLAMA_LIKE,
        n_rs=max(1, plan.n_seq) if info.shortconv_l_cache else 0,
        residual_first=info.architecture == "lfm2",
        v_cache_bytes=KV_TYPE_BLOCKS[plan.type_k][0] / KV_TYPE_BLOCKS[plan.type_k][1] if info.is_mla else 2)


def compute_bytes(info: GGUFInfo, plan: ContextPlan, alignment: int = CPU_ALIGNMENT, copies: int = 1,
                  **part) -> int:
    """Compute buffer of one backend running the whole graph, or the part of it given by
    ``layers``/``output``/``embed`` (see :func:`computegraph.build_llama_graph`); ``copies``
    is the scheduler's number of input copies (:data:`PIPELINE_COPIES` with pipeline
    parallelism)."""
    return compute_buffer_bytes(graph_plan(info, plan), n_ubatch=min(plan.n_ctx, plan.n_ubatch),
                                n_seq=plan.n_seq, n_outputs_max=plan.n_outputs_max, alignment=alignment,
                                copies=copies, **part)


# ggml's GGML_SCHED_MAX_COPIES: the input copies a scheduler with pipeline parallelism keeps.
PIPELINE_COPIES = 4


def pipeline_parallel(n_devices: int, layers_offloaded: int, n_layers_total: int) -> bool:
    """llama.cpp runs micro-batches through the devices as a pipeline (and its scheduler
    keeps :data:`PIPELINE_COPIES` copies of every input) when the model has more than one
    device and every layer, the output layer included, is offloaded (llama_context; its
    other conditions, layer split mode, KV offload, no tensor overrides and devices with
    async compute and events, hold for what the manager starts on CUDA and RPC devices).
    Measured on two RPC workers, 4 of 5 layers offloaded: no pipeline, compute buffers as
    for one copy; 5 of 5: "pipeline parallelism enabled, sched copies = 4" and the compute
    buffers 2.3 to 2.6 times as large."""
    return n_devices > 1 and layers_offloaded >= n_layers_total


def output_bytes(info: GGUFInfo, plan: ContextPlan) -> int:
    """The host output buffer: ``4 * n_vocab * n_seq`` (logits of one row per slot), plus
    ``4 * n_embd * n_seq`` with ``--embedding``."""
    n = 4 * info.vocab_size * plan.n_seq
    if plan.embedding:
        n += 4 * info.embedding_length * plan.n_seq
    return n
