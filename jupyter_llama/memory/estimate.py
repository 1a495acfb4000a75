"""Memory predictions, each a :class:`MemoryReport`.

* ``coarse``: Ollama's deliberately conservative scheduling estimate (REFERENCE section 3):
  the file size as weights plus an f16 KV cache for the whole context, plus a surcharge for
  large batches. It has no compute buffer, so for very small models, where the compute
  buffer outweighs the weights, it can come out *below* what llama.cpp allocates.
* ``detailed``: what llama-server will allocate, per device and component, derived from the
  GGUF tensor table and llama.cpp's own sizing rules (REFERENCE section 4): exact weights
  and KV cache, the compute buffer by replaying llama.cpp's worst-case graph through ggml's
  allocator (:mod:`.computegraph`), the host output buffer.
* ``llama.cpp``: llama.cpp's own projection from ``llama-fit-params`` (:mod:`.fitparams`).

:func:`.sources.estimate_all` gathers the three; :func:`format_estimates` prints them side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import re
from dataclasses import dataclass
from typing import Sequence

from .. import config
from ..load_options import QUANTIZED_KV, LoadOptions, batch_args
from ..models.gguf_info import GGUFInfo
from .computegraph import CPU_ALIGNMENT, GPU_ALIGNMENT, GraphPlan, LayerShape, compute_buffer_bytes
from .report import (
    ACTUAL,
    COARSE,
    COMPONENTS,
    COMPUTE,
    DETAILED,
    HOST,
    KV,
    OTHER,
    OUTPUT,
    RS,
    SOURCES,
    WEIGHTS,
    GiB,
    MemoryReport,
    MiB,
    format_bytes,
    format_pct,
    render_table,
)

# llama.cpp's --fit never shrinks an automatic context below this (common/fit.cpp).
FIT_MIN_CTX = 4096


def _scalar(v) -> int:
    if isinstance(v, (list, tuple)):
        nonzero = [x for x in v if x]
        return nonzero[0] if nonzero else 0
    return int(v)


def capped_ctx(num_ctx: int | None, info: GGUFInfo) -> int | None:
    """``num_ctx`` brought down to the model's training context, as Ollama does before it
    loads (None, and a model that does not say its training context, stay as they are)."""
    trained = info.context_length or 0
    return trained if num_ctx and trained and num_ctx > trained else num_ctx


@functools.lru_cache(maxsize=1)
def gpu_memory() -> int:
    """Bytes of memory on this machine's visible GPUs, all together (0 without one), as the
    manager first saw them: Ollama also sizes its default context once, at start."""
    from .devices import list_gpus

    return sum(g.total for g in list_gpus())


def default_context() -> int:
    """The context a request gets when neither it nor the model's preset sets ``num_ctx``:
    ``JUPYTER_LLAMA_CONTEXT_LENGTH``, else ``OLLAMA_CONTEXT_LENGTH``, else Ollama's default
    for the GPUs' memory (4096 tokens, 32768 from 23 GiB in all, 262144 from 47 GiB; see
    :func:`config.context_for_gpu_memory`). A setting that cannot be read is a ConfigError
    naming it."""
    setting = config.context_length()
    return setting[0] if setting else config.context_for_gpu_memory(gpu_memory())


# The batch of an embedding load: Ollama's (its DefaultEmbeddingNumBatch) at most, llama-server's
# own micro-batch at least. An input is embedded in one micro-batch, so this is also the longest
# input such a load takes, unless the context is shorter.
EMBED_BATCH = 2048
EMBED_BATCH_LEAST = 512  # (llama-server's default -ub)
# What the logits of an embedding batch may take, as a share of the machine's memory: what
# Ollama's batch of logits costs a model with Llama 3's vocabulary on a 16 GiB machine.
EMBED_LOGITS_SHARE = 16


@functools.lru_cache(maxsize=1)
def machine_memory() -> int:
    """The memory a load may use on this machine, as first seen: its GPUs' together, else the
    host's (its cgroup limit counted), 0 when unknown."""
    if gpu_memory():
        return gpu_memory()
    try:
        from .devices import read_host_memory

        return read_host_memory().total
    except OSError:
        return 0


def _has_output_head(info: GGUFInfo) -> bool:
    """The model ends in an output projection to its vocabulary (a causal language model: its
    own ``output.weight``, or the token embedding tied to it in an architecture we model)."""
    return info.architecture in LLAMA_LIKE or any(t.name == "output.weight" for t in info.tensors)


def embed_batch(info: GGUFInfo, ctx: int, memory: int | None = None) -> int:
    """The batch (and micro-batch) an embedding load of ``info`` gets when the request sets
    neither: :data:`EMBED_BATCH`, halved down to :data:`EMBED_BATCH_LEAST` while the logits of
    the batch would outweigh both the model itself and a :data:`EMBED_LOGITS_SHARE`-th of the
    machine's memory (``memory``; None: :func:`machine_memory`); never more than ``ctx``.

    A causal model computes the logits of every token of a micro-batch when it embeds
    (``4 * n_vocab`` bytes a token), and llama.cpp reserves its compute buffer for them: with a
    large vocabulary a batch as long as the context costs many times the model's own size, so
    the cost has to be justified by the model's size or by the machine's.
    A model without an output head (an encoder such as BERT) computes no logits and gets
    Ollama's batch. The result depends on the model and the machine only, never on what is free
    now: a request's options must resolve to those of the runner it is served by."""
    batch = EMBED_BATCH
    if _has_output_head(info):
        memory = machine_memory() if memory is None else memory
        room = max(info.file_size, memory // EMBED_LOGITS_SHARE)
        while batch > EMBED_BATCH_LEAST and 4 * info.vocab_size * batch > room:
            batch //= 2
    return max(1, min(batch, ctx))


def within_training(options: LoadOptions, info: GGUFInfo, default_ctx: int | None = None) -> LoadOptions:
    """``options`` as a load of ``info`` uses them, the way Ollama resolves a request's:

    * ``num_ctx`` above the training context is brought down to it (:func:`capped_ctx`);
    * ``LoadOptions.default_ctx``, what an automatic ``num_ctx`` stands for, is ``default_ctx``
      (None: :func:`default_context`) capped at the training context the same way (a model
      that says no training context, or one below the least a load takes, keeps llama-server's
      own). It is set whether or not ``num_ctx`` is, so that it is the same in every request
      for the model: a request that sets no ``num_ctx`` still matches a runner loaded with one
      (no reload for a client that cannot set it, such as OpenAI's);
    * an embedding load with neither ``num_batch`` nor ``num_ubatch`` gets a batch and
      micro-batch of :func:`embed_batch` (an input is embedded in one micro-batch), not the
      context itself; with only ``num_batch``, a micro-batch of that size, as Ollama gives it.

    Resolving the same options twice gives the same result, so a request's options match
    those its runner was loaded with."""
    capped = capped_ctx(options.num_ctx, info)
    if capped != options.num_ctx:
        options = options.replace(num_ctx=capped)
    if options.default_ctx is None:
        ctx = capped_ctx(default_context() if default_ctx is None else default_ctx, info)
        if ctx is not None and ctx >= config.MIN_CONTEXT:
            options = options.replace(default_ctx=ctx)
    else:
        capped = capped_ctx(options.default_ctx, info)
        if capped != options.default_ctx:
            options = options.replace(default_ctx=capped)
    if options.embedding and options.num_ubatch is None:
        ctx = options.request_ctx or info.context_length or EMBED_BATCH
        batch = options.num_batch or embed_batch(info, ctx * (options.num_parallel or 1))
        options = options.replace(num_batch=batch, num_ubatch=batch)
    return options


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


# =============================================================================== detailed

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

# Architectures the detailed estimate models: llama's graph up to in-place operations (biases,
# scales, q/k norms, post-norms), and the families whose blocks :mod:`.computegraph` replays
# besides: mixture-of-experts feed-forwards (qwen3moe), short-convolution layers with a
# recurrent state (lfm2) and multi-head latent attention (deepseek2).
LLAMA_LIKE = frozenset({"llama", "mistral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "granite",
                        "qwen3moe", "lfm2", "deepseek2"})
# Those whose compute buffer was held against real children (bench/estimate_accuracy.py):
# the rest are assumed to follow llama's graph, and the estimate says so.
VERIFIED_ARCHS = frozenset({"llama", "qwen3", "gemma3", "qwen3moe", "lfm2", "deepseek2"})

MOE_ARCHS = frozenset({"qwen3moe"})  # mixture-of-experts families whose router and experts are replayed

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


# ----------------------------------------------------------------------------- placement


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


def _output_tensors(info: GGUFInfo) -> frozenset[str]:
    """Tensors of the output layer whose names do not start with ``output`` (LFM2 names its
    final norm ``token_embd_norm``; llama.cpp still places it with the output layer)."""
    return frozenset({"token_embd_norm.weight"}) if info.architecture == "lfm2" else frozenset()


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


# ----------------------------------------------------------------------------- compute


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


# ----------------------------------------------------------------------------- the context cap


def with_cap_note(reports: dict[str, MemoryReport], asked: int | None, info: GGUFInfo) -> dict[str, MemoryReport]:
    """``reports`` (copies), each with a note that ``asked``, the context the user asked for,
    was brought down to the training context (:func:`capped_ctx`), when it was: the figures
    are for the context a load really gets, not the one asked for."""
    capped = capped_ctx(asked, info)
    if capped == asked:
        return reports
    note = (f"num_ctx {asked} is more than the model's training context: it is loaded with {capped}, as Ollama "
            "does, and estimated so")
    return {k: dataclasses.replace(r, warnings=[*r.warnings, note]) for k, r in reports.items()}


# ----------------------------------------------------------------------------- text


def _pct(pred: int, actual: int) -> str:
    if actual == 0:
        return "" if pred == 0 else "n/a"
    return format_pct((pred - actual) / actual * 100, 1)


def format_estimates(reports: dict[str, MemoryReport], actual: MemoryReport | None = None) -> str:
    """Predictions side by side, one row per device and component (MiB), a total per device
    and overall; with ``actual``, its column and each prediction's error against it."""
    order = [s for s in SOURCES if s in reports and s != ACTUAL] + [s for s in reports if s not in SOURCES]
    cols = [(s, reports[s]) for s in order]
    if actual is not None:
        cols.append((ACTUAL, actual))
    devices = sorted({d for _, r in cols for d in r.devices}, key=lambda d: (d != HOST, d))
    header = ["device", "component", *[s for s, _ in cols]]
    if actual is not None:
        header += [f"{s} err" for s, _ in cols[:-1]]

    def cells(get) -> list[str]:
        vals = [get(r) for _, r in cols]
        row = [f"{v / MiB:.2f}" for v in vals]
        if actual is not None:
            row += [_pct(v, vals[-1]) for v in vals[:-1]]
        return row

    rows = []
    for d in devices:
        for c in COMPONENTS:
            if any(r.get(d, c) for _, r in cols):
                rows.append([d, c, *cells(lambda r, d=d, c=c: r.get(d, c))])
        rows.append([d, "total", *cells(lambda r, d=d: r.total(device=d))])
    rows.append(["all", "total", *cells(lambda r: r.total())])
    lines = [render_table(header, rows, title="memory estimates (MiB)")]
    said: dict[str, list[str]] = {}  # a note several sources make is said once, naming them all
    for s, r in cols:
        for w in r.warnings:
            said.setdefault(w, []).append(s)
    lines += [f"note ({', '.join(sources)}): {w}" for w, sources in said.items()]
    return "\n".join(lines)
