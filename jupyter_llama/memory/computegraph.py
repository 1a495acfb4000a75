"""The compute buffer, predicted by replaying llama.cpp's worst-case graph through ggml's allocator.

llama.cpp sizes its compute buffer once, at start-up (``sched_reserve``): it builds the graph
of a worst-case micro-batch and lets ggml's graph allocator (``ggml-alloc.c``) place every
intermediate tensor in one buffer, reusing memory as soon as a tensor's last consumer has
run. The buffer size is the allocator's high-water mark, taken as the largest over three
reserves: prompt processing (``T = min(n_ctx, n_ubatch)`` tokens), token generation
(``T = n_seq`` tokens) and prompt processing again.

That high-water mark is not a sum of a few products: which tensors are alive together
depends on the order of the nodes, on which operations may overwrite an input in place and
on how freed holes are reused. So rather than a regression this module rebuilds the graph's
*allocation-relevant skeleton* (tensor sizes, producers, consumers, views, inputs) and runs
the same best-fit allocator over it. On llama.cpp b11434's CPU backend it reproduces the
``CPU compute buffer size`` of real ``llama-server`` children to within 0.6% for every shape
we measured (420 random configurations: 1-6 layers, 64-1024 wide, GQA 1-8, n_ff 32-4096,
vocab 512-32000, f32/f16/q8_0/q4_0 weights, n_ctx 128-8192, n_ubatch 128-1024, -np
auto/1/2/4, flash attention on/off, K/V cache f32/f16/bf16/q8_0/q4_0), and
``bench/estimate_accuracy.py`` checks it again on every run, for every family of
:data:`jupyter_llama.models.synth.FAMILIES` (the CPU buffers of random shapes of each matched
the log to its rounding).

Besides llama's blocks the skeleton has those of the families Ollama users run: a
mixture-of-experts feed-forward (router logits and soft-max, the argsort of the experts, their
weights normalised, ``MUL_MAT_ID`` gate, up and down for ``k`` experts per token, the weighted
sum), LFM2's short convolution (a ``3E`` input projection, the recurrent state put before the
micro-batch, ``SSM_CONV``) and DeepSeek's multi-head latent attention (queries projected into
the compressed space, attention over one compressed KV head, per-head expansion after it).

The tensors, per token of the micro-batch (f32 = 4 bytes; ``E`` = n_embd, ``Q`` = n_head *
head_dim, ``K``/``V`` = n_head_kv * head_dim, ``F`` = n_ff, ``H`` = n_head, ``n_kv`` = KV
cells per stream):

* graph inputs, allocated before anything else: token ids, positions, K/V row indices
  (``8*T`` bytes each; without flash attention the transposed V cache is written element by
  element, so the V indices take ``8*T*V``), the attention mask ``n_kv*T`` elements (f16 with
  flash attention, f32 without), the output-row ids,
  a vector-embedding input ``E*T*4`` that llama.cpp reserves for embedding batches and that
  stays allocated for the whole graph, and the inputs of the "mixed batch" path
  (``E*T*4``, whose copy is kept alive by a view, so another ``E*T*4`` stays allocated too).
  A model with sliding-window layers has two caches (llama.cpp's iSWA cache), each with its
  own row indices, mask and rotations, so the sliding-window layers' set comes on top;
* per layer, attention: RMS norm (``E``), Q (``Q``) and its rotary copy (``Q``; RoPE does not
  run in place here), V (``V``), K and its rotary copy (``K``), with a quantized K cache a
  Hadamard-rotated copy of Q and K (``Q``, ``K``); then either flash attention (output ``Q``;
  an f32 K/V cache is first cast to f16: ``n_kv*K*2`` bytes over all streams) or
  ``KQ = n_kv*T*H*4`` bytes plus its soft-max (in place), ``KQV`` (``Q``) and a contiguous copy
  (``Q``); the output projection (``E``) and the residual add (in place);
* per layer, feed-forward: norm (``E``), gate and up (``F`` each) and the gated product
  (``F``, not in place), down projection (``E``), residual add (in place). The last layer
  runs its feed-forward only on the ``n_outputs`` rows that produce logits;
* output: norm (``E*n_outputs``) and logits ``n_vocab*n_outputs*4`` bytes.

In practice the peak falls in one of two places. In the *feed-forward* block it is
``mask + 4*T*(3F + 5E)`` plus the small integer inputs (gate, up and their product alive
together, beside the residual, the freed norm and the three ``E``-sized inputs above).
Without flash attention it is usually the *soft-max*: ``mask(f32) + n_kv*T*H*4`` plus a few
``E``-sized activations per token, which grows with ``n_ctx * n_ubatch * n_head`` and dominates
long contexts. With flash attention the attention block needs only a few ``E``/``Q``-sized
activations per token beside the f16 mask. The number of layers does not matter (a layer's
tensors are freed before the next layer's peak), and neither does the vocabulary for
llama-server, which reserves logits for one row per slot.

What this module does not model: GPU backends (the same graph runs there; the split between
a GPU and its host buffer under partial offload is approximated by the caller), recurrent
layers other than LFM2's (Mamba's scans, RWKV), multimodal projectors, and architectures whose
graph differs from llama's beyond in-place operations and the blocks above (the estimator
falls back to coarse numbers for those). Of ``--fit``'s ways of splitting one layer's
feed-forward between a device and the next, moving all of it and moving the down projection
were measured; moving all but the up projection is replayed from its scheduling, and can
come out some 0.2 MiB above the log on the device that runs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

F32 = 4

# Operations ggml-alloc lets overwrite their first suitable input (ggml_op_can_inplace),
# restricted to those that appear in this skeleton. Only an input that is not a view can be
# overwritten (ggml-alloc never counts a view as its own allocation), which is why llama's RoPE,
# whose input is a reshaped view of Q, gets memory of its own while Qwen3's, after a Q norm, does
# not.
_INPLACE_OPS = frozenset({"ADD", "MUL", "DIV", "RMS_NORM", "SOFT_MAX", "SCALE", "CLAMP", "ROPE", "UNARY"})

# Alignment of compute-buffer allocations: 32 bytes on the CPU backend; GPU backends use
# larger ones (CUDA 128, Vulkan up to 256), which changes nothing at these sizes.
CPU_ALIGNMENT = 32
GPU_ALIGNMENT = 256


@dataclass(eq=False)
class Tensor:
    """One graph tensor as the allocator sees it."""

    name: str
    nbytes: int = 0
    op: str = "NONE"  # "NONE": a leaf (weights, cache, inputs); "LEAF": an input no node reads
    srcs: list["Tensor"] = field(default_factory=list)
    view_src: "Tensor | None" = None
    is_input: bool = False
    is_output: bool = False
    external: bool = False  # data lives elsewhere (weights, KV cache): never allocated here


class _Allocator:
    """ggml's dynamic best-fit allocator (``ggml_dyn_tallocr``), one chunk."""

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, 1 << 62]]  # free [offset, size], sorted; last = tail
        self.high = 0

    def _align(self, n: int) -> int:
        a = self.alignment
        return (n + a - 1) // a * a

    def alloc(self, size: int) -> int:
        size = self._align(size)
        best, best_size = -1, None
        for i, (_, s) in enumerate(self.blocks[:-1]):  # best fit among the holes
            if s >= size and (best_size is None or s <= best_size):
                best, best_size = i, s
        if best == -1:
            best = len(self.blocks) - 1  # the tail
        offset, s = self.blocks[best]
        if s == size:
            del self.blocks[best]
        else:
            self.blocks[best] = [offset + size, s - size]
        self.high = max(self.high, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        size = self._align(size)
        b = self.blocks
        for i, (o, s) in enumerate(b):
            if o + s == offset:  # append to the block before
                b[i][1] += size
                if i + 1 < len(b) and b[i][0] + b[i][1] == b[i + 1][0]:
                    b[i][1] += b[i + 1][1]
                    del b[i + 1]
                return
            if offset + size == o:  # prepend to the block after
                b[i][0] = offset
                b[i][1] += size
                if i > 0 and b[i - 1][0] + b[i - 1][1] == b[i][0]:
                    b[i - 1][1] += b[i][1]
                    del b[i]
                return
        j = 0
        while j < len(b) and b[j][0] < offset:
            j += 1
        b.insert(j, [offset, size])


def simulate(nodes: list[Tensor], alignment: int = CPU_ALIGNMENT, copies: int = 1) -> int:
    """High-water mark in bytes of ggml-alloc placing ``nodes`` (graph order, views included).

    Mirrors ``ggml_gallocr_alloc_graph_impl``: leaves that are graph inputs are allocated
    first, in order of first use; then each node is allocated (in place over a parent when
    the operation allows it and the parent has no other consumer) and every parent whose
    last consumer this was is freed (a view frees its source when the source's last view
    goes). Outputs are never freed.

    ``copies`` > 1 is ggml's scheduler with pipeline parallelism: every input of a backend's
    part (a graph input, or a tensor copied in from another backend) has that many copies,
    all kept for the whole graph, so that micro-batches can overlap.
    """
    alloc = _Allocator(alignment)
    kept: set[Tensor] = set()
    state: dict[Tensor, dict] = {}

    def st(t: Tensor) -> dict:
        s = state.get(t)
        if s is None:
            s = state[t] = {"children": 0, "views": 0, "allocated": False, "offset": 0, "size": 0}
        return s

    leaves: list[Tensor] = []
    seen: set[Tensor] = set()
    graph: list[Tensor] = []
    for n in nodes:
        if n.op == "LEAF":
            if n not in seen:
                seen.add(n)
                leaves.append(n)
            continue
        graph.append(n)
        for s in n.srcs:
            if s.op == "NONE" and s not in seen:
                seen.add(s)
                leaves.append(s)

    def allocate(t: Tensor) -> None:
        s = st(t)
        if t.external or s["allocated"] or t.view_src is not None:
            return
        s["allocated"] = True
        if t.op in _INPLACE_OPS:
            for p in t.srcs:
                if p.external or p.is_output or p.view_src is not None or p.nbytes != t.nbytes:
                    continue
                sp = st(p)
                if sp["children"] != 1 or sp["views"] != 0 or not sp["allocated"]:
                    continue
                s["offset"], s["size"] = sp["offset"], sp["size"]
                sp["allocated"] = False
                return
        s["offset"] = alloc.alloc(t.nbytes)
        s["size"] = t.nbytes

    def free(t: Tensor) -> None:
        if t.is_output or t in kept:
            return
        s = st(t)
        alloc.free(s["offset"], s["size"])
        s["allocated"] = False

    if copies > 1:
        for leaf in leaves:
            if leaf.is_input:
                kept.add(leaf)
                for _ in range(copies - 1):
                    alloc.alloc(leaf.nbytes)
    for leaf in leaves:
        allocate(leaf)
    for n in graph:
        if n.view_src is not None:
            st(n.view_src)["views"] += 1
        for s in n.srcs:
            st(s)["children"] += 1
    for n in graph:
        for p in n.srcs:
            allocate(p)
        allocate(n)
        for p in n.srcs:
            sp = st(p)
            sp["children"] -= 1
            if sp["children"] == 0 and sp["views"] == 0:
                if p.view_src is not None:
                    so = st(p.view_src)
                    so["views"] -= 1
                    if so["views"] == 0 and so["children"] == 0 and so["allocated"]:
                        free(p.view_src)
                elif sp["allocated"]:
                    free(p)
    return alloc.high


# ----------------------------------------------------------------------------- the llama graph


@dataclass(frozen=True)
class LayerShape:
    """What one repeating block allocates per token (element counts, not bytes).

    ``mixer`` is what the block does before its feed-forward: ``attn`` (attention over the KV
    cache, llama's), ``mla`` (DeepSeek's multi-head latent attention: a compressed K cache row
    of ``n_embd_k = kv_lora + rope`` elements and no V cache) or ``conv`` (LFM2's short
    convolution over a recurrent state, no KV cache). A feed-forward with ``n_expert`` > 0 is
    a mixture of experts: a router picks ``n_expert_used`` of them per token, each
    ``n_ff_exp`` wide."""

    n_embd_q: int  # n_head * head_dim_k (mla: n_head * (kv_lora + rope), the query after absorption)
    n_embd_k: int  # n_head_kv * head_dim_k
    n_embd_v: int  # n_head_kv * head_dim_v (mla: kv_lora, a view of the K cache)
    n_head: int
    n_ff: int
    swa: bool = False  # uses the sliding-window cache and mask
    mixer: str = "attn"
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    q_lora: int = 0  # mla: rank of the query compression (0: a plain query projection)
    rope: int = 0  # mla: rotary part of a key
    nope: int = 0  # mla: the rest of a key, per head
    head_v: int = 0  # mla: value size per head once decompressed
    d_conv: int = 0  # conv: positions of state kept per sequence (the window less one)


@dataclass(frozen=True)
class GraphPlan:
    """The micro-batch and cache a reserve is made for (resolved as llama.cpp resolves them)."""

    n_embd: int
    n_vocab: int
    layers: tuple[LayerShape, ...]
    n_kv: int  # cells per stream of the full-attention cache
    n_kv_swa: int = 0  # cells per stream of the sliding-window cache (0: none)
    n_stream: int = 1  # 1 with a unified cache, else n_seq
    flash_attn: bool = True
    k_cast: bool = False  # f32 K cache under flash attention (cast to f16 per layer)
    v_cast: bool = False
    rot_k: int = 0  # Hadamard rotation size for a quantized K cache (0: none)
    rot_v: int = 0
    mixed_batch: bool = True  # llama.cpp reserves the mixed token/embedding input path
    embeddings: bool = False  # pooled embeddings instead of logits
    n_rs: int = 0  # recurrent states (one per sequence) when some layer is a conv layer
    residual_first: bool = False  # the residual is the first operand of its adds (LFM2)
    v_cache_bytes: float = 2  # bytes per element of the K cache (MLA's V, a view of it, is copied out)


@dataclass(frozen=True)
class _CacheInputs:
    k_idxs: Tensor
    v_idxs: Tensor
    mask: Tensor
    k_rot: Tensor
    v_rot: Tensor


def layers_elsewhere(here: frozenset[int], n_layer: int) -> bool:
    """Whether another backend runs some of the ``n_layer`` repeating layers."""
    return any(il not in here for il in range(n_layer))


def build_llama_graph(plan: GraphPlan, n_tokens: int, n_outputs: int, *, layers: frozenset[int] | None = None,
                      output: bool = True, embed: bool = True, host: frozenset[int] = frozenset(),
                      experts: frozenset[int] = frozenset(), ffn_away: frozenset[int] = frozenset(),
                      ffn_here: frozenset[int] = frozenset(), ffn_kind: tuple[tuple[int, str], ...] = (),
                      inputs_until: int = 0) -> list[Tensor]:
    """The allocation skeleton of llama.cpp's llama graph (``src/models/llama.cpp`` with
    ``build_inp_embd``, ``build_attn`` and ``build_ffn`` of ``src/llama-graph.cpp``) for one
    micro-batch of ``n_tokens`` tokens producing ``n_outputs`` logit rows.

    With several devices, ggml's scheduler runs each layer where its weights are and gives
    every backend an allocator of its own: ``layers`` (the repeating layers this backend
    holds), ``output`` (whether it holds the output layer) and ``embed`` (the token lookup,
    always the host's) restrict the graph to what one backend runs. Where its first layer
    follows another backend's, the incoming activations are an input copy, and the graph
    inputs it reads (positions, cache indices, mask, output ids) are copies of its own.

    ``host`` names the layers the host runs. A layer's closing residual ``ADD`` has no
    weights, so the scheduler gives it to the device that runs the next layer when the
    layer itself ran on the host: the host's last layer stops at its FFN output, and the
    device's first layer starts with copies of that output and of the residual (measured
    with GGML_SCHED_DEBUG: the device split's inputs were ``ffn_out-0`` and ``ffn_inp-0``).
    Between two devices the activations cross as one tensor (``l_out``).

    ``experts`` names offloaded mixture-of-experts layers whose experts stay in host memory
    (llama.cpp's ``--fit`` or ``--cpu-moe``): their expert matmuls run on the host, which gets
    copies of the normalised input and of the chosen experts' ids, and hands back the experts'
    outputs; the router, the weighting and the sum stay with the layer, and the weighting and
    sum of a device's last such layer run where the next layer does (measured with
    GGML_SCHED_DEBUG on two RPC workers).

    ``ffn_away`` names layers of this part whose feed-forward runs, in part, on another
    backend, and ``ffn_here`` those of other parts whose feed-forward this backend runs in
    part: what ``--fit`` does with the first partial layer of a device when it moves more than
    the experts (to the next device, or host memory). ``ffn_kind`` says what moved, as
    ``(layer, kind)``: ``attn``, all of the feed-forward (that backend gets copies of the
    normalised input, twice for a mixture of experts, as it is and reshaped, and of the
    residual, and returns the layer's output); ``gate``, the down projection (it gets the
    activations, and for experts their ids and weights, and the residual); ``up``, all but the
    up projection (counted as ``attn``, with the up projection's output crossing back and
    forth).

    ``inputs_until`` is the first layer of the last device that runs repeating layers: the host
    keeps the graph inputs every device reads (positions, cache indices, masks) until that
    device's part begins, so the experts and feed-forwards it runs for earlier layers run
    beside them.
    """
    T, n_out, E = n_tokens, max(1, n_outputs), plan.n_embd
    nodes: list[Tensor] = []
    n_layer = len(plan.layers)
    here = frozenset(range(n_layer)) if layers is None else layers

    def add(t: Tensor) -> Tensor:
        nodes.append(t)
        return t

    def view(t: Tensor) -> Tensor:
        return add(Tensor(t.name + "(view)", t.nbytes, "VIEW", [t], view_src=t.view_src or t))

    def weight(name: str) -> Tensor:
        return Tensor(name, external=True)

    tok_embd = weight("token_embd")
    inp_tokens = Tensor("inp_tokens", T * 4, is_input=True)
    embd = Tensor("embd", E * T * F32, "GET_ROWS", [tok_embd, inp_tokens])
    if embed:
        add(embd)
        # The vector-embeddings input of the select between input paths: a leaf no node reads.
        add(Tensor("inp_embd", E * T * F32, "LEAF", is_input=True))
    # The mixed token/embedding path: its token rows are looked up where the token embedding
    # is (the host); the copy it writes them into, and the write, run with the first layer
    # (measured: with layer 0 on an RPC device, the device's inputs are the token rows, the
    # mixed embeddings and slots, and the looked-up embeddings).
    first_here = n_layer > 0 and 0 in here
    mixed_embd = Tensor("inp_mixed_embd", E * T * F32, is_input=True)
    slots = Tensor("inp_mixed_slots", T * 8, is_input=True)
    if plan.mixed_batch and (embed or first_here):
        if embed:
            mixed_tokens = Tensor("inp_mixed_tokens", T * 4, is_input=True)
            tok_rows = add(Tensor("mixed_tok_rows", E * T * F32, "GET_ROWS", [tok_embd, mixed_tokens]))
        else:
            tok_rows = Tensor("mixed_tok_rows(copy)", E * T * F32, is_input=True)
        if first_here or not layers_elsewhere(here, n_layer):
            copy = add(Tensor("mixed_copy", E * T * F32, "DUP", [mixed_embd]))
            add(Tensor("mixed_set_rows", E * T * F32, "SET_ROWS", [tok_rows, slots, copy], view_src=copy))

    pos = Tensor("inp_pos", T * 4, is_input=True)
    mask_bytes = 2 if plan.flash_attn else 4
    out_ids = Tensor("out_ids", n_out * 4, is_input=True)

    def cache_inputs(suffix: str, swa: bool) -> _CacheInputs:
        """The inputs of one KV cache: row indices for K and V, the mask, the rotations."""
        max_v = max((ly.n_embd_v for ly in plan.layers if ly.swa == swa), default=0)
        n_kv = plan.n_kv_swa if swa else plan.n_kv
        return _CacheInputs(
            Tensor("k_idxs" + suffix, T * 8, is_input=True),
            Tensor("v_idxs" + suffix, (T if plan.flash_attn else T * max_v) * 8, is_input=True),
            Tensor("kq_mask" + suffix, n_kv * T * mask_bytes, is_input=True),
            Tensor("k_rot" + suffix, plan.rot_k * plan.rot_k * F32, is_input=True),
            Tensor("v_rot" + suffix, plan.rot_v * plan.rot_v * F32, is_input=True))

    # A model with sliding-window layers keeps two caches (llama.cpp's iSWA cache), and each has
    # inputs of its own: the sliding-window layers read only the second set. Without flash
    # attention the V indices are per element, so the second set is as large as the first.
    iswa = bool(plan.n_kv_swa) and any(ly.swa for ly in plan.layers)
    base = cache_inputs("", False)
    window = cache_inputs("_swa", True) if iswa else base

    inp = embd
    handed_on: list[Tensor] = []  # the host's last activations, read by the next backend
    s_copy = Tensor("rs_s_copy", max(1, plan.n_rs) * 4, is_input=True)

    def residual_add(name: str, rows: int, cur: Tensor, residual: Tensor) -> Tensor:
        srcs = [residual, cur] if plan.residual_first else [cur, residual]
        return add(Tensor(name, E * rows * F32, "ADD", srcs))

    def attention(il: int, ly: LayerShape, norm: Tensor) -> Tensor:
        """llama's attention (``build_qkv``, ``build_attn``): the output before ``wo``."""
        n_kv = plan.n_kv_swa if (ly.swa and iswa) else plan.n_kv
        cache = window if ly.swa else base
        k_idxs, v_idxs, lmask, k_rot, v_rot = cache.k_idxs, cache.v_idxs, cache.mask, cache.k_rot, cache.v_rot
        Q, K, V = ly.n_embd_q, ly.n_embd_k, ly.n_embd_v
        q = add(Tensor("Qcur", Q * T * F32, "MUL_MAT", [weight("wq"), norm]))
        q = add(Tensor("Qrope", Q * T * F32, "ROPE", [view(q), pos]))
        if plan.rot_k:
            q = add(Tensor("Qrot", Q * T * F32, "MUL_MAT", [k_rot, view(q)]))
        v = add(Tensor("Vcur", V * T * F32, "MUL_MAT", [weight("wv"), norm]))
        if plan.rot_v:
            v = add(Tensor("Vrot", V * T * F32, "MUL_MAT", [v_rot, view(v)]))
        k = add(Tensor("Kcur", K * T * F32, "MUL_MAT", [weight("wk"), norm]))
        k = add(Tensor("Krope", K * T * F32, "ROPE", [view(k), pos]))
        if plan.rot_k:
            k = add(Tensor("Krot", K * T * F32, "MUL_MAT", [k_rot, view(k)]))
        cache_k, cache_v = weight(f"cache_k{il}"), weight(f"cache_v{il}")
        add(Tensor("set_k", 0, "SET_ROWS", [view(k), k_idxs, cache_k], view_src=cache_k))
        add(Tensor("set_v", 0, "SET_ROWS", [view(v), v_idxs, cache_v], view_src=cache_v))
        qp, kp, vp = view(q), view(cache_k), view(cache_v)
        if plan.flash_attn:
            srcs = [qp, kp, vp, lmask]
            if plan.k_cast:
                srcs[1] = add(Tensor("k_f16", n_kv * plan.n_stream * K * 2, "CPY", [kp]))
            if plan.v_cast:
                srcs[2] = add(Tensor("v_f16", n_kv * plan.n_stream * V * 2, "CPY", [vp]))
            att = view(add(Tensor("fattn", Q * T * F32, "FLASH_ATTN_EXT", srcs)))
        else:
            kq = add(Tensor("kq", n_kv * T * ly.n_head * F32, "MUL_MAT", [kp, qp]))
            kq = add(Tensor("kq_soft_max", n_kv * T * ly.n_head * F32, "SOFT_MAX", [kq, lmask]))
            kqv = add(Tensor("kqv", Q * T * F32, "MUL_MAT", [vp, kq]))
            att = add(Tensor("kqv_out", Q * T * F32, "CONT", [view(kqv)]))
        if plan.rot_v:
            att = view(add(Tensor("Orot", Q * T * F32, "MUL_MAT", [v_rot, view(att)])))
        return att

    def latent_attention(il: int, ly: LayerShape, norm: Tensor) -> Tensor:
        """DeepSeek's MLA with the absorption (``src/models/deepseek2.cpp``): the query is
        projected into the compressed space (``attn_k_b``), attention runs against the
        compressed K cache as one KV head (V is a view of K) and its output is expanded per
        head (``attn_v_b``)."""
        H, C, R, N, VH = ly.n_head, ly.n_embd_v, ly.rope, ly.nope, ly.head_v
        lmask, n_kv = base.mask, plan.n_kv
        if ly.q_lora:
            q = add(Tensor("q_a", ly.q_lora * T * F32, "MUL_MAT", [weight("wq_a"), norm]))
            q = add(Tensor("q_a_norm", ly.q_lora * T * F32, "RMS_NORM", [q]))
            q = add(Tensor("q_a_norm_w", ly.q_lora * T * F32, "MUL", [q, weight("q_a_norm.w")]))
            q = add(Tensor("q", H * (N + R) * T * F32, "MUL_MAT", [weight("wq_b"), q]))
        else:
            q = add(Tensor("q", H * (N + R) * T * F32, "MUL_MAT", [weight("wq"), norm]))
        absorbed = add(Tensor("q_nope_absorbed", C * H * T * F32, "MUL_MAT", [weight("wk_b"), view(q)]))
        q_pe = add(Tensor("q_pe", R * H * T * F32, "ROPE", [view(q), pos]))
        qcur = add(Tensor("Qcur", (C + R) * H * T * F32, "CONCAT", [view(absorbed), q_pe]))
        kv = add(Tensor("kv_cmpr_pe", (C + R) * T * F32, "MUL_MAT", [weight("wkv_a_mqa"), norm]))
        kv_c = add(Tensor("kv_cmpr_norm", C * T * F32, "RMS_NORM", [view(kv)]))
        kv_c = add(Tensor("kv_cmpr", C * T * F32, "MUL", [kv_c, weight("kv_a_norm.w")]))
        k_pe = add(Tensor("k_pe", R * T * F32, "ROPE", [view(kv), pos]))
        kcur = add(Tensor("Kcur", (C + R) * T * F32, "CONCAT", [kv_c, k_pe]))
        cache_k = weight(f"cache_k{il}")
        add(Tensor("set_k", 0, "SET_ROWS", [view(kcur), base.k_idxs, cache_k], view_src=cache_k))
        kp, vp = view(cache_k), view(cache_k)
        if plan.flash_attn:
            srcs = [view(qcur), kp, vp, lmask]
            if plan.k_cast:
                srcs[1] = add(Tensor("k_f16", n_kv * plan.n_stream * (C + R) * 2, "CPY", [kp]))
                srcs[2] = add(Tensor("v_f16", n_kv * plan.n_stream * C * 2, "CPY", [vp]))
            att = add(Tensor("fattn", C * H * T * F32, "FLASH_ATTN_EXT", srcs))
            att = add(Tensor("fattn_mla", VH * H * T * F32, "MUL_MAT", [weight("wv_b"), view(att)]))
        else:
            v = add(Tensor("v_cont", int(n_kv * plan.n_stream * C * plan.v_cache_bytes), "CONT", [vp]))
            kq = add(Tensor("kq", n_kv * T * H * F32, "MUL_MAT", [kp, view(qcur)]))
            kq = add(Tensor("kq_soft_max", n_kv * T * H * F32, "SOFT_MAX", [kq, lmask]))
            att = add(Tensor("kqv", C * H * T * F32, "MUL_MAT", [v, kq]))
            att = add(Tensor("kqv_mla", VH * H * T * F32, "MUL_MAT", [weight("wv_b"), att]))
        return add(Tensor("kqv_out", VH * H * T * F32, "CONT", [view(att)]))

    def short_conv(il: int, ly: LayerShape, norm: Tensor) -> Tensor:
        """LFM2's short convolution (``src/models/lfm2.cpp``): the input projection into three
        parts, the previous ``d_conv`` positions of each sequence from the recurrent state put
        before the new ones, a depthwise convolution, and the output gate."""
        bcx = add(Tensor("in_proj", 3 * E * T * F32, "MUL_MAT", [weight("in_proj"), norm]))
        bx = add(Tensor("bx", E * T * F32, "MUL", [view(bcx), view(bcx)]))
        conv = add(Tensor("conv_with_state", E * (T + ly.d_conv * plan.n_rs) * F32, "CONCAT",
                          [view(states[il]), view(bx)]))
        out = add(Tensor("ssm_conv", E * T * F32, "SSM_CONV", [conv, weight("conv")]))
        return add(Tensor("conv_gated", E * T * F32, "MUL", [view(bcx), out]))

    def experts_ffn(ly: LayerShape, rows: int, x: Tensor, topk: Tensor) -> Tensor:
        """Gate, up and down of the chosen experts of each token (``MUL_MAT_ID``)."""
        k, F = ly.n_expert_used, ly.n_ff_exp
        gate = add(Tensor("moe_gate", F * k * rows * F32, "MUL_MAT_ID", [weight("gate_exps"), x, topk]))
        up = add(Tensor("moe_up", F * k * rows * F32, "MUL_MAT_ID", [weight("up_exps"), x, topk]))
        act = add(Tensor("moe_glu", F * k * rows * F32, "GLU", [gate, up]))
        return add(Tensor("moe_down", E * k * rows * F32, "MUL_MAT_ID", [weight("down_exps"), act, topk]))

    def experts_sum(ly: LayerShape, rows: int, down: Tensor, w: Tensor) -> Tensor:
        """The experts' outputs weighted by the router and summed."""
        k = ly.n_expert_used
        down = add(Tensor("moe_weighted", E * k * rows * F32, "MUL", [down, w]))
        parts = [view(down) for _ in range(k)]
        out = parts[0]
        for part in parts[1:]:
            out = add(Tensor("moe_out", E * rows * F32, "ADD", [out, part]))
        if k == 1:
            out = add(Tensor("moe_out", E * rows * F32, "CONT", [out]))
        return out

    def router(ly: LayerShape, rows: int, norm: Tensor) -> tuple[Tensor, Tensor]:
        """The router of ``build_moe_ffn``: its soft-max, the top experts of each token, and
        their weights normalised. Returns (the top experts' ids, the weights)."""
        X, k = ly.n_expert, ly.n_expert_used
        logits = add(Tensor("moe_logits", X * rows * F32, "MUL_MAT", [weight("gate_inp"), norm]))
        probs = add(Tensor("moe_probs", X * rows * F32, "SOFT_MAX", [logits]))
        order = add(Tensor("moe_argsort", X * rows * 4, "ARGSORT", [probs]))
        topk = view(order)
        w = add(Tensor("moe_weights", k * rows * F32, "GET_ROWS", [view(probs), topk]))
        w2 = view(w)
        wsum = add(Tensor("moe_weights_sum", rows * F32, "SUM_ROWS", [w2]))
        wsum = add(Tensor("moe_weights_sum_clamped", rows * F32, "CLAMP", [wsum]))
        return topk, add(Tensor("moe_weights_norm", k * rows * F32, "DIV", [w2, wsum]))

    def moe(il: int, ly: LayerShape, rows: int, norm: Tensor,
            hand_off: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """``build_moe_ffn``: the router (:func:`router`), then gate, up and down for each
        chosen expert of each token, weighted and summed. Returns (the sum, None), or (None,
        the weights) when the sum runs on the next device, or with ``hand_off`` (the experts'
        outputs, the weights): the next device sums them."""
        k = ly.n_expert_used
        topk, w = router(ly, rows, norm)
        if hand_off:
            return experts_ffn(ly, rows, view(norm), topk), view(w)
        if il not in experts:
            return experts_sum(ly, rows, experts_ffn(ly, rows, view(norm), topk), view(w)), None
        # the experts run on the host: it copies the input and the ids, and hands back their outputs
        add(Tensor("to_host", 0, "EXPORT", [view(norm), topk]))
        down = add(Tensor("moe_down(from the host)", E * k * rows * F32, "COPY_IN"))
        if (output if il == n_layer - 1 else il + 1 in here):
            return experts_sum(ly, rows, down, view(w)), None
        return None, view(w)

    kinds = dict(ffn_kind)

    def ffn_section(il: int) -> Tensor:
        """Layer ``il``'s feed-forward, the part of it run here for the backend that holds the
        layer (see ``ffn_kind``)."""
        ly = plan.layers[il]
        rows = n_out if il == n_layer - 1 else T
        kind = kinds.get(il, "attn")
        if kind == "gate":  # the down projection
            k = ly.n_expert_used if ly.n_expert else 1
            F = ly.n_ff_exp if ly.n_expert else ly.n_ff
            act = add(Tensor("ffn_act(copy)", F * k * rows * F32, "COPY_IN"))
            if ly.n_expert:
                topk = add(Tensor("moe_topk(copy)", k * rows * 4, "COPY_IN"))
                w = add(Tensor("moe_weights(copy)", k * rows * F32, "COPY_IN"))
                residual = add(Tensor("ffn_inp(copy)", E * rows * F32, "COPY_IN"))
                down = add(Tensor("moe_down", E * k * rows * F32, "MUL_MAT_ID", [weight("down_exps"), act, topk]))
                out = experts_sum(ly, rows, down, view(w))
            else:
                residual = add(Tensor("ffn_inp(copy)", E * rows * F32, "COPY_IN"))
                out = add(Tensor("ffn_down", E * rows * F32, "MUL_MAT", [weight("wd"), act]))
            return add(Tensor("l_out", E * rows * F32, "ADD", [out, residual]))
        x = add(Tensor("ffn_norm(copy)", E * rows * F32, "COPY_IN"))
        if ly.n_expert:
            x3 = add(Tensor("ffn_norm(reshaped copy)", E * rows * F32, "COPY_IN"))
        if kind != "up" or not ly.n_expert:
            residual = add(Tensor("ffn_inp(copy)", E * rows * F32, "COPY_IN"))
        if ly.n_expert:
            k = ly.n_expert_used
            topk, w = router(ly, rows, x)
            if kind == "up":  # the up projection and the activation run with the layer, in between
                F = ly.n_ff_exp
                gate = add(Tensor("moe_gate", F * k * rows * F32, "MUL_MAT_ID", [weight("gate_exps"), x3, topk]))
                add(Tensor("to_its_device", 0, "EXPORT", [gate]))
                act = add(Tensor("moe_glu(copy)", F * k * rows * F32, "COPY_IN"))
                residual = add(Tensor("ffn_inp(copy)", E * rows * F32, "COPY_IN"))
                down = add(Tensor("moe_down", E * k * rows * F32, "MUL_MAT_ID", [weight("down_exps"), act, topk]))
            else:
                down = experts_ffn(ly, rows, x3, topk)
            out = experts_sum(ly, rows, down, view(w))
        else:
            gate = add(Tensor("ffn_gate", ly.n_ff * rows * F32, "MUL_MAT", [weight("wg"), x]))
            up = add(Tensor("ffn_up", ly.n_ff * rows * F32, "MUL_MAT", [weight("wu"), x]))
            act = add(Tensor("ffn_glu", ly.n_ff * rows * F32, "GLU", [gate, up]))
            out = add(Tensor("ffn_down", E * rows * F32, "MUL_MAT", [weight("wd"), act]))
        return add(Tensor("l_out", E * rows * F32, "ADD", [out, residual]))

    def foreign_sections(which) -> None:
        """The host's share of offloaded layers (``which`` of them): their experts, or the
        feed-forwards moved to host memory."""
        for il in sorted(experts | ffn_here):
            if il in here or il >= n_layer or not which(il):
                continue
            if il in ffn_here:
                add(Tensor("to_its_device", 0, "EXPORT", [ffn_section(il)]))
                continue
            ly = plan.layers[il]
            if not ly.n_expert:
                continue
            rows = n_out if il == n_layer - 1 else T
            x = add(Tensor("ffn_norm(copy)", E * rows * F32, "COPY_IN"))
            topk = add(Tensor("moe_topk(copy)", ly.n_expert_used * rows * 4, "COPY_IN"))
            add(Tensor("to_the_device", 0, "EXPORT", [experts_ffn(ly, rows, x, topk)]))

    def expert_tail(ly: LayerShape, rows: int) -> Tensor:
        """A layer's experts' weighting, sum and residual add, run on the device after the one
        that holds the layer: its inputs are copies of the experts' outputs, of the router's
        weights and of the residual."""
        k = ly.n_expert_used
        # (the first inputs of this backend's part: allocated before the graph's own inputs)
        down = Tensor("moe_down(copy)", E * k * rows * F32, is_input=True)
        w = Tensor("moe_weights(copy)", k * rows * F32, is_input=True)
        residual = Tensor("ffn_inp(copy)", E * rows * F32, is_input=True)
        out = experts_sum(ly, rows, down, view(w))
        return add(Tensor("l_out", E * rows * F32, "ADD", [out, residual]))

    states: dict[int, Tensor] = {}
    from_section: Tensor | None = None  # a layer's output, from a feed-forward run here
    for il, ly in enumerate(plan.layers):
        last = il == n_layer - 1
        if il not in here:
            from_section = ffn_section(il) if not embed and il in ffn_here else None
            if from_section is not None and il + 1 not in here:
                add(Tensor("to_its_device", 0, "EXPORT", [from_section]))
                from_section = None
            continue
        if from_section is not None:  # the previous layer's feed-forward ran here
            inp, from_section = from_section, None
        elif (il == 0 and not embed) or (il > 0 and il - 1 not in here):
            if il > 0 and il - 1 in host and plan.layers[il - 1].n_expert:
                inp = expert_tail(plan.layers[il - 1], T)  # (the weighting and sum too, as for a device's)
            elif il > 0 and il - 1 in host:  # the host's last layer left its residual add to us
                inp = add(Tensor("l_out(of the host)", E * T * F32, "ADD",
                                 [Tensor("ffn_out(copy)", E * T * F32, is_input=True),
                                  Tensor("ffn_inp(copy)", E * T * F32, is_input=True)]))
            elif il > 0 and il - 1 in experts:  # the previous device left us its experts' sum
                inp = expert_tail(plan.layers[il - 1], T)
            else:
                inp = Tensor("inp_from_other_backend", E * T * F32, is_input=True)
        if ly.mixer == "conv":  # the sequences' states, gathered before the layer runs
            states[il] = add(Tensor("rs_states", ly.d_conv * E * max(1, plan.n_rs) * F32, "GET_ROWS",
                                    [weight(f"cache_r{il}"), s_copy]))
        norm = add(Tensor("attn_norm", E * T * F32, "RMS_NORM", [inp]))
        norm = add(Tensor("attn_norm_w", E * T * F32, "MUL", [norm, weight("attn_norm.w")]))
        if ly.mixer == "conv":
            att = short_conv(il, ly, norm)
        elif ly.mixer == "mla":
            att = latent_attention(il, ly, norm)
        else:
            att = attention(il, ly, norm)
        cur = add(Tensor("attn_out", E * T * F32, "MUL_MAT", [weight("wo"), att]))
        rows, residual = T, inp
        if last:
            rows = n_out
            cur = add(Tensor("attn_out_rows", E * n_out * F32, "GET_ROWS", [cur, out_ids]))
            residual = add(Tensor("inp_rows", E * n_out * F32, "GET_ROWS", [residual, out_ids]))
        ffn_inp = residual_add("ffn_inp", rows, cur, residual)
        norm = add(Tensor("ffn_norm", E * rows * F32, "RMS_NORM", [ffn_inp]))
        norm = add(Tensor("ffn_norm_w", E * rows * F32, "MUL", [norm, weight("ffn_norm.w")]))
        if il in ffn_away:  # (part of) its feed-forward runs on another backend, which hands back the output
            kind = kinds.get(il, "attn")
            if kind == "gate":  # all but the down projection here
                if ly.n_expert:
                    X, k, F = ly.n_expert, ly.n_expert_used, ly.n_ff_exp
                    logits = add(Tensor("moe_logits", X * rows * F32, "MUL_MAT", [weight("gate_inp"), norm]))
                    probs = add(Tensor("moe_probs", X * rows * F32, "SOFT_MAX", [logits]))
                    order = add(Tensor("moe_argsort", X * rows * 4, "ARGSORT", [probs]))
                    w = add(Tensor("moe_weights", k * rows * F32, "GET_ROWS", [view(probs), view(order)]))
                    wsum = add(Tensor("moe_weights_sum_clamped", rows * F32, "SUM_ROWS", [view(w)]))
                    w = add(Tensor("moe_weights_norm", k * rows * F32, "DIV", [view(w), wsum]))
                    gate = add(Tensor("moe_gate", F * k * rows * F32, "MUL_MAT_ID",
                                      [weight("gate_exps"), view(norm), view(order)]))
                    up = add(Tensor("moe_up", F * k * rows * F32, "MUL_MAT_ID",
                                    [weight("up_exps"), view(norm), view(order)]))
                    act = add(Tensor("moe_glu", F * k * rows * F32, "GLU", [gate, up]))
                    add(Tensor("to_other_backend", 0, "EXPORT", [act, view(order), view(w), ffn_inp]))
                else:
                    gate = add(Tensor("ffn_gate", ly.n_ff * rows * F32, "MUL_MAT", [weight("wg"), norm]))
                    up = add(Tensor("ffn_up", ly.n_ff * rows * F32, "MUL_MAT", [weight("wu"), norm]))
                    act = add(Tensor("ffn_glu", ly.n_ff * rows * F32, "GLU", [gate, up]))
                    add(Tensor("to_other_backend", 0, "EXPORT", [act, ffn_inp]))
            elif kind == "up" and ly.n_expert:  # the up projection here, on the ids the other backend chose
                k, F = ly.n_expert_used, ly.n_ff_exp
                topk = add(Tensor("moe_topk(copy)", k * rows * 4, "COPY_IN"))
                gate = add(Tensor("moe_gate(copy)", F * k * rows * F32, "COPY_IN"))
                up = add(Tensor("moe_up", F * k * rows * F32, "MUL_MAT_ID", [weight("up_exps"), view(norm), topk]))
                act = add(Tensor("moe_glu", F * k * rows * F32, "GLU", [gate, up]))
                add(Tensor("to_other_backend", 0, "EXPORT", [act, ffn_inp]))
            else:
                add(Tensor("to_other_backend", 0, "EXPORT", [norm, ffn_inp]))
            if il + 1 not in here:
                break
            inp = add(Tensor("l_out(copy)", E * rows * F32, "COPY_IN"))
            continue
        if ly.n_expert and embed and not last and il + 1 not in here:
            # the host's last layer: the device after it weights and sums the experts' outputs
            down, left = moe(il, ly, rows, norm, hand_off=True)
            assert down is not None and left is not None  # handed off: the outputs and the weights
            handed_on = [down, left, ffn_inp]
            break
        if ly.n_expert:
            down, left = moe(il, ly, rows, norm)
            if down is None:  # the next device weights and sums the experts' outputs
                assert left is not None  # (moe returns the weights where it returns no sum)
                add(Tensor("to_next_device", 0, "EXPORT", [left, ffn_inp]))
                break
        else:
            gate = add(Tensor("ffn_gate", ly.n_ff * rows * F32, "MUL_MAT", [weight("wg"), norm]))
            up = add(Tensor("ffn_up", ly.n_ff * rows * F32, "MUL_MAT", [weight("wu"), norm]))
            act = add(Tensor("ffn_glu", ly.n_ff * rows * F32, "GLU", [gate, up]))
            down = add(Tensor("ffn_down", E * rows * F32, "MUL_MAT", [weight("wd"), act]))
        if embed and not last and il + 1 not in here:
            handed_on = [down, ffn_inp]
            break  # the next backend adds the residual (see above)
        inp = add(Tensor("l_out", E * rows * F32, "ADD", [ffn_inp, down] if plan.residual_first else [down, ffn_inp]))

    if embed and layers is not None and (layers_elsewhere(here, n_layer) or not output):
        # ggml's scheduler puts every graph input on the host backend and gives each device a
        # copy made when the device's split starts, so the host keeps, to the end of its own
        # part, the inputs other backends read and the activations it hands on (measured on
        # an RPC worker holding all 3 layers of a 2-block model at n_ctx 2048: the host's
        # compute buffer was 2.52 MiB, nearly all of it the 2 MiB f16 mask).
        exported = list(handed_on)
        if n_layer and not first_here:  # (what the device holding the first layer copies)
            exported.append(embd)
            if plan.mixed_batch:
                exported += [tok_rows, mixed_embd, slots]
        if inputs_until:  # the first devices take theirs; the last one takes the inputs later
            add(Tensor("to_the_first_devices", 0, "EXPORT", exported))
            exported = []
            foreign_sections(lambda il: il < inputs_until)
        if n_layer and layers_elsewhere(here, n_layer):
            exported += [pos, base.k_idxs, base.v_idxs, base.mask]
            if iswa:
                exported += [window.k_idxs, window.v_idxs, window.mask]
            for cache in (base, window) if iswa else (base,):
                exported += [t for t, used in ((cache.k_rot, plan.rot_k), (cache.v_rot, plan.rot_v)) if used]
        if n_layer and n_layer - 1 not in here:
            exported.append(out_ids)
        add(Tensor("to_other_backends", 0, "EXPORT", exported))

    if embed:  # the host runs the experts, or feed-forwards, that offloaded layers keep in host memory
        foreign_sections(lambda il: il >= inputs_until)

    if not output:
        return nodes
    if n_layer - 1 not in here:
        if n_layer - 1 in experts and plan.layers[-1].n_expert:
            inp = expert_tail(plan.layers[-1], n_out)
        else:
            inp = Tensor("inp_from_other_backend", E * n_out * F32, is_input=True)
    norm = add(Tensor("out_norm", E * n_out * F32, "RMS_NORM", [inp]))
    norm = add(Tensor("result_norm", E * n_out * F32, "MUL", [norm, weight("output_norm")]))
    if plan.embeddings:
        add(Tensor("result_embd", E * n_out * F32, "CPY", [norm], is_output=True))
    else:
        add(Tensor("result_output", plan.n_vocab * n_out * F32, "MUL_MAT", [weight("output"), norm], is_output=True))
    return nodes


@functools.lru_cache(maxsize=4096)  # a fit tries many splits; each backend's part repeats
def compute_buffer_bytes(plan: GraphPlan, n_ubatch: int, n_seq: int, n_outputs_max: int,
                         alignment: int = CPU_ALIGNMENT, copies: int = 1, **part) -> int:
    """The compute buffer llama.cpp reserves: the largest high-water mark over its three
    reserves (prompt ``n_ubatch`` tokens, generation ``n_seq`` tokens, prompt again).

    ``n_ubatch`` must already be ``min(n_ctx, n_ubatch)``; ``n_outputs_max`` is the context's
    output limit (llama-server: the number of slots).
    """
    pp_outputs = min(n_ubatch, n_outputs_max)
    best = 0
    for n_tokens, n_outputs in ((n_ubatch, pp_outputs), (n_seq, n_seq)):
        best = max(best, simulate(build_llama_graph(plan, n_tokens, n_outputs, **part), alignment, copies))
    return best
