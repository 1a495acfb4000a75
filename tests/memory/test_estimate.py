"""The coarse and detailed estimators against hand-computed cases (no engine needed)."""

from __future__ import annotations

import pytest

from jupyter_llama.load_options import LoadOptions, LoadOptionsError
from jupyter_llama.memory import estimate as est
from jupyter_llama.memory.computegraph import GraphPlan, LayerShape, Tensor, _Allocator, compute_buffer_bytes, simulate
from jupyter_llama.memory.estimate import (
    estimate_coarse,
    estimate_detailed,
    format_estimates,
    kv_cache_bytes,
    kv_row_bytes,
    layer_devices,
    plan_context,
    weight_bytes,
)
from jupyter_llama.memory.report import (
    ACTUAL,
    COARSE,
    COMPUTE,
    DETAILED,
    KV,
    OTHER,
    OUTPUT,
    WEIGHTS,
    GiB,
    MemoryReport,
    MiB,
)
from jupyter_llama.memory.sources import estimate_all
from jupyter_llama.models.gguf_info import GGUFInfo, TensorInfo

KiB = 1024


def make_info(*, layers=4, embd=256, heads=8, kv_heads=2, ff=512, vocab=1000, ctx=4096, arch="llama",
              layer_bytes=1000, embd_bytes=5000, output_bytes=5000, tied=False, wtype="F16",
              sliding_window=None, swa_layers=None, key_length=None, value_length=None) -> GGUFInfo:
    """A GGUFInfo written by hand: token_embd, ``layers`` blocks of three tensors, output."""
    tensors = [TensorInfo("token_embd.weight", (embd, vocab), wtype, embd * vocab, embd_bytes, None)]
    hk = key_length or embd // heads
    for il in range(layers):
        tensors += [
            TensorInfo(f"blk.{il}.attn_norm.weight", (embd,), "F32", embd, 100, il),
            TensorInfo(f"blk.{il}.attn_q.weight", (embd, heads * hk), wtype, embd * heads * hk, layer_bytes // 2, il),
            TensorInfo(f"blk.{il}.ffn_up.weight", (embd, ff), wtype, embd * ff,
                       layer_bytes - layer_bytes // 2 - 100, il),
        ]
    tensors.append(TensorInfo("output_norm.weight", (embd,), "F32", embd, 100, None))
    if not tied:
        tensors.append(TensorInfo("output.weight", (embd, vocab), wtype, embd * vocab, output_bytes, None))
    return GGUFInfo(
        path="/nonexistent/hand.gguf", file_size=sum(t.n_bytes for t in tensors) + 4096, version=3,
        architecture=arch, name="hand", block_count=layers, embedding_length=embd, feed_forward_length=ff,
        head_count=heads, head_count_kv=kv_heads, key_length=key_length, value_length=value_length,
        context_length=ctx, sliding_window=sliding_window, swa_layers=swa_layers, file_type=None,
        parameter_count=sum(t.n_elements for t in tensors), vocab_size=vocab, tensors=tensors, metadata={})


@pytest.fixture
def no_repack(monkeypatch):
    monkeypatch.setattr(est, "host_repack_rules", lambda: {})


# ----------------------------------------------------------------------------- KV rows


@pytest.mark.parametrize("cache_type, expected", [
    ("f32", 4 * 128), ("f16", 2 * 128), ("bf16", 2 * 128),
    ("q8_0", 34 * 4), ("q4_0", 18 * 4), ("q4_1", 20 * 4), ("q5_0", 22 * 4), ("q5_1", 24 * 4), ("iq4_nl", 18 * 4),
])
def test_kv_row_bytes_per_type(cache_type, expected):
    assert kv_row_bytes(cache_type, 128) == expected


def test_kv_row_bytes_rejects_unknown_type():
    with pytest.raises(ValueError):
        kv_row_bytes("q3_k", 128)


# ----------------------------------------------------------------------------- context plan


def test_plan_auto_slots_is_four_unified_and_padded():
    p = plan_context(make_info(), LoadOptions(num_ctx=300))
    assert (p.n_seq, p.unified, p.n_stream) == (4, True, 1)
    assert (p.n_ctx_requested, p.n_ctx, p.n_ctx_seq) == (300, 512, 512)
    assert (p.n_batch, p.n_ubatch) == (300, 300)  # n_batch = min(-c, 2048) before padding
    assert p.n_outputs_max == 4 and p.flash_attn and not p.v_trans


def test_plan_explicit_slots_pad_each_stream():
    # -c 1200 -np 4: pad(1200) = 1280, per stream pad(1280 / 4 = 320) = 512, total 2048
    p = plan_context(make_info(), LoadOptions(num_ctx=300, num_parallel=4))
    assert (p.n_seq, p.unified, p.n_stream) == (4, False, 4)
    assert (p.n_ctx, p.n_ctx_seq) == (2048, 512)
    # -c 3000 -np 3: pad 3072, per stream 1024
    p = plan_context(make_info(), LoadOptions(num_ctx=1000, num_parallel=3))
    assert (p.n_ctx, p.n_ctx_seq) == (3072, 1024)
    # explicit slots with a unified cache: one stream of all cells
    p = plan_context(make_info(), LoadOptions(num_ctx=300, num_parallel=4, kv_unified=True))
    assert (p.n_ctx, p.n_ctx_seq, p.n_stream) == (1280, 1280, 1)


def test_plan_automatic_context_is_the_training_context():
    p = plan_context(make_info(ctx=4096), LoadOptions())
    assert (p.n_ctx_requested, p.n_ctx) == (4096, 4096)
    assert (p.n_batch, p.n_ubatch) == (2048, 512)


def test_plan_batches_and_flash_attention():
    p = plan_context(make_info(), LoadOptions(num_ctx=4096, num_batch=1024, num_ubatch=2048, flash_attn="off"))
    assert (p.n_batch, p.n_ubatch) == (1024, 1024)
    assert not p.flash_attn and p.v_trans


# ----------------------------------------------------------------------------- KV bytes


def test_kv_gqa_f16():
    # head_dim 256/8 = 32, 2 KV heads: K and V rows of 64 f16 = 128 B each, 256 B per cell
    info = make_info(layers=4, embd=256, heads=8, kv_heads=2)
    kv = kv_cache_bytes(info, plan_context(info, LoadOptions(num_ctx=1024, num_parallel=1)))
    assert kv == {il: 256 * 1024 for il in range(4)}


def test_kv_quantized_types():
    info = make_info(layers=2, embd=256, heads=8, kv_heads=2)
    plan = plan_context(info, LoadOptions(num_ctx=1024, num_parallel=1, cache_type_k="q8_0",
                                          cache_type_v="q4_0", flash_attn="on"))
    # rows of 64 elements: q8_0 2 blocks x 34 B, q4_0 2 x 18 B
    assert kv_cache_bytes(info, plan) == {0: (68 + 36) * 1024, 1: (68 + 36) * 1024}


def test_kv_per_layer_head_counts_and_transposed_v():
    info = make_info(layers=4, embd=256, heads=8, kv_heads=[2, 4, 0, 1])
    fa = kv_cache_bytes(info, plan_context(info, LoadOptions(num_ctx=512, num_parallel=1, flash_attn="on")))
    # layer 2 has no KV heads: no cache; others 2*2*32*n_kv bytes per cell
    assert fa == {0: 2 * 2 * 64 * 512, 1: 2 * 2 * 128 * 512, 3: 2 * 2 * 32 * 512}
    no_fa = kv_cache_bytes(info, plan_context(info, LoadOptions(num_ctx=512, num_parallel=1, flash_attn="off")))
    # without flash attention V is stored transposed at the widest layer's size (4 heads x 32)
    assert no_fa == {0: (2 * 64 + 2 * 128) * 512, 1: (2 * 128 + 2 * 128) * 512, 3: (2 * 32 + 2 * 128) * 512}


def test_kv_unified_vs_per_slot():
    info = make_info(layers=1, embd=256, heads=8, kv_heads=2)
    per_cell = 256
    auto = kv_cache_bytes(info, plan_context(info, LoadOptions(num_ctx=300)))
    assert auto == {0: per_cell * 512}  # pad(300) cells, one stream
    slots = kv_cache_bytes(info, plan_context(info, LoadOptions(num_ctx=300, num_parallel=4)))
    assert slots == {0: per_cell * 512 * 4}  # 4 streams of pad(1280/4) = 512


def test_kv_sliding_window_layers():
    info = make_info(layers=4, embd=256, heads=8, kv_heads=2, sliding_window=128,
                     swa_layers=[True, True, True, False])
    # auto: 4 unified slots, n_ubatch 512: pad(min(4096, 128*4 + 512), 256) = 1024 cells
    plan = plan_context(info, LoadOptions(num_ctx=4096))
    assert plan.swa_cells == 1024
    assert kv_cache_bytes(info, plan) == {0: 256 * 1024, 1: 256 * 1024, 2: 256 * 1024, 3: 256 * 4096}
    # 2 explicit slots, not unified: per stream pad(min(4096, 128 + 512), 256) = 768, two streams
    plan = plan_context(info, LoadOptions(num_ctx=4096, num_parallel=2))
    assert (plan.n_ctx_seq, plan.swa_cells) == (4096, 768)
    kv = kv_cache_bytes(info, plan)
    assert kv[0] == 256 * 768 * 2 and kv[3] == 256 * 4096 * 2
    # a window larger than the context is capped at the context
    plan = plan_context(info, LoadOptions(num_ctx=256, num_parallel=1))
    assert plan.swa_cells == 256


# ----------------------------------------------------------------------------- placement and weights


def test_layer_devices_last_layers_and_output_first():
    info = make_info(layers=4)
    g = ["cuda:0"]
    assert layer_devices(info, LoadOptions(num_gpu=1), g) == (["cpu"] * 4, "cuda:0")  # output only
    assert layer_devices(info, LoadOptions(num_gpu=2), g) == (["cpu", "cpu", "cpu", "cuda:0"], "cuda:0")
    assert layer_devices(info, LoadOptions(num_gpu=5), g) == (["cuda:0"] * 4, "cuda:0")
    assert layer_devices(info, LoadOptions(num_gpu=99), g) == (["cuda:0"] * 4, "cuda:0")
    assert layer_devices(info, LoadOptions(), g) == (["cuda:0"] * 4, "cuda:0")  # automatic: all
    assert layer_devices(info, LoadOptions(num_gpu=0), g) == (["cpu"] * 4, "cpu")
    assert layer_devices(info, LoadOptions(num_gpu=3), []) == (["cpu"] * 4, "cpu")  # no GPU at all


def test_layer_devices_two_gpus_split_evenly():
    info = make_info(layers=5)  # 6 layers with the output one: 3 each
    devs, out = layer_devices(info, LoadOptions(), ["cuda:0", "cuda:1"])
    assert devs == ["cuda:0", "cuda:0", "cuda:0", "cuda:1", "cuda:1"] and out == "cuda:1"


def test_weights_split_with_num_gpu(no_repack):
    # token_embd 5000 (+ alignment pad to 5024), 4 blocks of 1000 B (3 tensors: 100, 500, 400), norm 100, output 5000
    info = make_info(layers=4, layer_bytes=1000, embd_bytes=5000, output_bytes=5000)
    w = weight_bytes(info, LoadOptions(num_gpu=2), ["cuda:0"])
    assert w["cuda:0"] == 1000 + 100 + 5000  # block 3 and the output layer
    # host: the mapped span from token_embd to the end of block 2 (offsets aligned to 32 bytes)
    offs = est._tensor_offsets(info)
    assert w["cpu"] == offs["blk.2.ffn_up.weight"][1] - 0
    w = weight_bytes(info, LoadOptions(num_gpu=1), ["cuda:0"])
    assert w["cuda:0"] == 5100  # output layer first
    w = weight_bytes(info, LoadOptions(), ["cuda:0"])
    assert w == {"cuda:0": 4 * 1000 + 5100, "cpu": 5000}  # the input layer stays in host memory
    w = weight_bytes(info, LoadOptions(num_gpu=2, use_mmap=False), ["cuda:0"])
    # without mmap: the host tensors themselves, each padded to 32 bytes
    assert w["cpu"] == 5024 + 3 * (128 + 512 + 416)


def test_weights_tied_output_copied_to_the_gpu(no_repack):
    info = make_info(layers=2, tied=True, embd_bytes=6000)
    w = weight_bytes(info, LoadOptions(num_gpu=1), ["cuda:0"])
    assert w["cuda:0"] == 100 + 6000  # output_norm and the duplicated token embedding


def test_weights_cpu_repack_buffer(monkeypatch):
    monkeypatch.setattr(est, "host_repack_rules", lambda: {"Q4_0": 8})
    info = make_info(layers=2, wtype="Q4_0", layer_bytes=1000, embd_bytes=5000, output_bytes=5000)
    w = weight_bytes(info, LoadOptions(), [])
    offs = est._tensor_offsets(info)
    repacked = 2 * (500 + 400) + 5000  # block matrices and output; never the token embedding
    mapped = offs["output_norm.weight"][1]  # token_embd ... output_norm (output is last and repacked)
    assert w == {"cpu": mapped + repacked}


def test_output_buffer_in_host_memory_per_slot(no_repack):
    info = make_info(vocab=1000)
    auto = estimate_detailed(info, LoadOptions(num_ctx=512), ["cuda:0"])
    assert auto.get("cpu", OUTPUT) == 4 * 1000 * 4 and auto.get("cuda:0", OUTPUT) == 0
    two = estimate_detailed(info, LoadOptions(num_ctx=512, num_parallel=2), [])
    assert two.get("cpu", OUTPUT) == 4 * 1000 * 2


def test_detailed_gpu_report_places_kv_with_layers(no_repack):
    info = make_info(layers=4, embd=256, heads=8, kv_heads=2)
    rep = estimate_detailed(info, LoadOptions(num_ctx=1024, num_parallel=1, num_gpu=3), ["cuda:0"])
    assert rep.source == DETAILED
    assert rep.get("cuda:0", KV) == 2 * 256 * 1024 and rep.get("cpu", KV) == 2 * 256 * 1024
    assert (rep.layers_offloaded, rep.layers_total) == (3, 5)
    assert rep.get("cuda:0", COMPUTE) > 0 and rep.get("cpu", COMPUTE) > 0


# ----------------------------------------------------------------------------- fallbacks


def test_unknown_architecture_falls_back_to_coarse_with_a_warning():
    info = make_info(arch="mamba")
    opts = LoadOptions(num_ctx=1024)
    rep = estimate_detailed(info, opts, [])
    coarse = estimate_coarse(info, opts, [])
    assert rep.source == DETAILED
    assert rep.bytes == coarse.bytes
    assert rep.warnings and "mamba" in rep.warnings[0]


def test_malformed_info_never_raises():
    info = make_info()
    info.tensors = None  # type: ignore[assignment]
    rep = estimate_detailed(info, LoadOptions(num_ctx=512), [])
    assert rep.source == DETAILED and rep.warnings


def test_quantized_v_without_flash_attention_is_refused_before_any_estimate():
    # llama.cpp refuses the context (notebook 03 showed its words): every estimate, the
    # scheduler and the CLI are told so by the options themselves, not told it "fits"
    with pytest.raises(LoadOptionsError, match="^cache_type_v q8_0 needs flash attention, and flash_attn is off: "
                                               "set flash_attn on"):
        LoadOptions(num_ctx=512, cache_type_v="q8_0", flash_attn="off")
    for fine in (dict(cache_type_v="q8_0", flash_attn="auto"), dict(cache_type_v="f16", flash_attn="off"),
                 dict(cache_type_k="q8_0", flash_attn="off")):
        assert not any("flash attention" in w for w in estimate_detailed(make_info(), LoadOptions(**fine), []).warnings)


# ----------------------------------------------------------------------------- coarse


def test_coarse_hand_computed_with_batch_surcharge():
    info = make_info(layers=4, embd=256, heads=8, kv_heads=2, ctx=4096)
    rep = estimate_coarse(info, LoadOptions(num_ctx=1000, num_parallel=2, num_batch=1024), ["cuda:0"])
    ctx = 1000 * 2
    kv = 2 * (4 * 2) * 32 * ctx * 2  # 2 (K and V) x layers x kv heads x head dim x ctx x f16
    assert rep.source == COARSE and rep.n_ctx == ctx
    assert rep.bytes == {("cuda:0", WEIGHTS): info.file_size, ("cuda:0", KV): kv, ("cuda:0", OTHER): 768 * MiB}
    big = estimate_coarse(info, LoadOptions(num_ctx=8192, num_batch=2048), [])
    # context capped at the training context; 2 GiB surcharge for batch >= 2048; host memory without GPUs
    assert big.get("cpu", KV) == 2 * 8 * 32 * 4096 * 2 and big.get("cpu", OTHER) == 2 * GiB
    # no -b passed: the child uses llama-server's default batch of 2048, so the full surcharge applies
    assert estimate_coarse(info, LoadOptions(num_ctx=512), []).get("cpu", OTHER) == 2 * GiB
    assert estimate_coarse(info, LoadOptions(num_ctx=512, num_batch=512), []).get("cpu", OTHER) == 0


# ----------------------------------------------------------------------------- compute graph


def test_allocator_best_fit_and_merge():
    a = _Allocator(32)
    x, y, z = a.alloc(100), a.alloc(64), a.alloc(32)
    assert (x, y, z) == (0, 128, 192) and a.high == 224
    a.free(x, 100)
    a.free(y, 64)  # merges with the hole before it: one 192-byte hole
    assert a.alloc(150) == 0 and a.high == 224  # fits the merged hole, no growth


def test_simulate_in_place_and_freeing():
    inp = Tensor("in", 1000, is_input=True)
    a = Tensor("a", 1000, "MUL_MAT", [Tensor("w", external=True), inp])
    b = Tensor("b", 1000, "ADD", [a, Tensor("w2", external=True)])  # in place over a
    c = Tensor("c", 4000, "GLU", [b])  # not in place
    d = Tensor("d", 1000, "MUL_MAT", [Tensor("w3", external=True), c], is_output=True)
    # in (1024) + a (1024, b reuses it) + c (4000): in and b are freed before d reuses their space
    assert simulate([a, b, c, d], 32) == 1024 + 1024 + 4000


def _plan(**kw) -> GraphPlan:
    layer = LayerShape(n_embd_q=256, n_embd_k=64, n_embd_v=64, n_head=8, n_ff=704)
    base = dict(n_embd=256, n_vocab=2000, layers=(layer,) * 4, n_kv=1024, flash_attn=True)
    base.update(kw)
    return GraphPlan(**base)


def test_compute_grows_with_ctx_times_ubatch_times_heads_without_flash_attention():
    # Without flash attention the KQ scores (f32, per head) and the f32 mask grow with n_kv.
    small = compute_buffer_bytes(_plan(n_kv=1024, flash_attn=False), 512, 1, 1)
    large = compute_buffer_bytes(_plan(n_kv=2048, flash_attn=False), 512, 1, 1)
    assert large - small == 1024 * 512 * (8 * 4 + 4)
    # With flash attention only the f16 mask does.
    small = compute_buffer_bytes(_plan(n_kv=2048), 512, 1, 1)
    large = compute_buffer_bytes(_plan(n_kv=4096), 512, 1, 1)
    assert large - small == 2048 * 512 * 2


def test_compute_does_not_grow_with_layers():
    one_more = _plan(layers=(LayerShape(256, 64, 64, 8, 704),) * 12)
    assert compute_buffer_bytes(one_more, 512, 4, 4) == compute_buffer_bytes(_plan(), 512, 4, 4)


def test_a_sliding_window_cache_brings_its_own_inputs():
    # llama.cpp's iSWA cache gives the sliding-window layers row indices of their own; without
    # flash attention the V indices are one per element (8 bytes x V x T), so they cost as much
    # again as the global cache's (measured on Gemma 3: 8 x 256 x n_ubatch bytes).
    wide = LayerShape(n_embd_q=256, n_embd_k=256, n_embd_v=256, n_head=1, n_ff=704)
    window = LayerShape(n_embd_q=256, n_embd_k=256, n_embd_v=256, n_head=1, n_ff=704, swa=True)
    one_cache = _plan(layers=(wide,) * 4, n_kv=1024, flash_attn=False)
    two_caches = _plan(layers=(window, window, window, wide), n_kv=1024, n_kv_swa=1024, flash_attn=False)
    # (the same cells in both caches, so only the second set of inputs differs: its mask, f32,
    # and its indices)
    extra = compute_buffer_bytes(two_caches, 512, 1, 1) - compute_buffer_bytes(one_cache, 512, 1, 1)
    assert extra == 1024 * 512 * 4 + 512 * 8 + 512 * 256 * 8


def test_compute_feed_forward_peak_closed_form():
    # Feed-forward dominated (F >> E): mask + 4*T*(3F + 5E) plus the small integer inputs.
    plan = _plan(layers=(LayerShape(256, 64, 64, 8, 4096),) * 2, n_kv=2048)
    got = compute_buffer_bytes(plan, 512, 1, 1)
    closed = 2048 * 512 * 2 + 4 * 512 * (3 * 4096 + 5 * 256)
    assert abs(got - closed) < 64 * KiB


@pytest.mark.parametrize("shape, args, measured_mib", [
    # measured from llama-server b11434 (CPU) logs: "CPU compute buffer size = X MiB"
    (dict(embd=128, heads=4, kv=2, ff=352, vocab=512, layers=4), dict(num_ctx=1024), 4.33),
    (dict(embd=256, heads=8, kv=2, ff=704, vocab=2000, layers=4), dict(num_ctx=4096, flash_attn="off"), 75.26),
    (dict(embd=256, heads=8, kv=2, ff=704, vocab=2000, layers=4), dict(num_ctx=4096), 10.64),
    (dict(embd=512, heads=8, kv=2, ff=256, vocab=512, layers=4),
     dict(num_ctx=1024, num_parallel=1, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on"), 7.05),
    (dict(embd=64, heads=2, kv=1, ff=32, vocab=4000, layers=2),
     dict(num_ctx=512, num_parallel=1, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on"), 1.39),
])
def test_compute_matches_measured_children(shape, args, measured_mib, no_repack):
    info = make_info(layers=shape["layers"], embd=shape["embd"], heads=shape["heads"], kv_heads=shape["kv"],
                     ff=shape["ff"], vocab=shape["vocab"])
    rep = estimate_detailed(info, LoadOptions(**args), [])
    assert rep.get("cpu", COMPUTE) / MiB == pytest.approx(measured_mib, abs=0.015)


# ----------------------------------------------------------------------------- text


def test_format_estimates_side_by_side_with_errors():
    a = MemoryReport(COARSE, {("cpu", WEIGHTS): 10 * MiB, ("cpu", KV): 2 * MiB})
    b = MemoryReport(DETAILED, {("cpu", WEIGHTS): 9 * MiB, ("cpu", KV): 1 * MiB, ("cpu", COMPUTE): 3 * MiB})
    actual = MemoryReport(ACTUAL, {("cpu", WEIGHTS): 9 * MiB, ("cpu", KV): 1 * MiB, ("cpu", COMPUTE): 2 * MiB})
    b.warnings.append("something to know")
    text = format_estimates({DETAILED: b, COARSE: a}, actual)
    lines = text.splitlines()
    header = lines[1].split()
    assert header[:5] == ["device", "component", "coarse", "detailed", "actual"]
    total = next(ln for ln in lines if ln.startswith("all"))
    assert "12.00" in total and "13.00" in total and "  0.0%" in total  # coarse 12 vs 12 actual
    compute = next(ln for ln in lines if " compute " in ln)
    assert "+50.0%" in compute and "-100.0%" in compute
    assert "note (detailed): something to know" in text
    assert "err" not in format_estimates({COARSE: a})


def test_quantized_cache_needs_head_size_divisible_by_block():
    info = make_info(embd=64, heads=8, kv_heads=4)  # head size 8
    rep = estimate_detailed(info, LoadOptions(num_ctx=512, cache_type_k="q8_0", flash_attn="on"), [])
    assert any("divisible by 32" in w for w in rep.warnings)
    ok = estimate_detailed(info, LoadOptions(num_ctx=512, cache_type_k="q8_0", flash_attn="off"), [])
    assert not any("divisible" in w for w in ok.warnings)


def test_a_context_beyond_the_training_one_is_estimated_as_the_load_will_have_it():
    """A load of num_ctx above the training context gets the training context (Ollama's rule,
    Scheduler.effective_options): every estimate of those options says what that load takes."""
    info = make_info(ctx=4096)
    assert est.capped_ctx(65536, info) == 4096 and est.capped_ctx(2048, info) == 2048
    assert est.capped_ctx(None, info) is None
    assert est.capped_ctx(65536, make_info(ctx=0)) == 65536  # (a model that does not say: as asked)
    over, at = (estimate_all(info, LoadOptions(num_ctx=n, num_parallel=1)) for n in (65536, 4096))
    assert {k: r.total() for k, r in over.items()} == {k: r.total() for k, r in at.items()}
    assert est.coarse_context(info, LoadOptions(num_ctx=65536, num_parallel=2)) == 8192
    # and each says so (the picker, the CLI and the panel show an estimate's notes)
    cap = "num_ctx 65536 is more than the model's training context: it is loaded with 4096, as Ollama does"
    assert all(any(w.startswith(cap) for w in r.warnings) for r in over.values())
    assert not any("training context" in w for r in at.values() for w in r.warnings)
