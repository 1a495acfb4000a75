"""The llama-server log parser, checked against recorded and hand-written logs (tests/data/logs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jupyter_llama.engine.logparse import FitDecision, LogParser
from jupyter_llama.memory.report import ACTUAL, COMPUTE, KV, OUTPUT, RS, WEIGHTS, MiB

LOGS = Path(__file__).resolve().parent.parent / "data" / "logs"

RECORDED_OK = ["cpu_stories_c2048.log", "cpu_stories_c4096_np4.log", "cpu_stories_ngl0.log",
               "cpu_synth_c2048.log", "cpu_synth_q8_0_fa.log"]
RECORDED_FAIL = ["cpu_stories_q8_0_ctx_fail.log", "cpu_truncated_gguf.log", "cpu_corrupt_gguf.log"]
HANDWRITTEN_OK = ["cuda_full_offload.log", "cuda_partial_offload.log", "cuda_recoverable_pp.log", "cuda_swa.log",
                  "cuda_hybrid_rs.log", "vulkan_full_offload.log"]
HANDWRITTEN_FAIL = ["cuda_oom_kv.log", "vulkan_oom.log"]
ALL = RECORDED_OK + RECORDED_FAIL + HANDWRITTEN_OK + HANDWRITTEN_FAIL + ["cuda_fit_moe_2gpu.log"]

# The test's own reading of the buffer lines: one explicit pattern per line kind, written
# from the log text, independent of the parser's regular expressions.
_EXPECT = {
    WEIGHTS: re.compile(r"^load_tensors: +(\S+) model buffer size = +(\d+\.\d\d) MiB$"),
    KV: re.compile(r"^llama_kv_cache: +(\S+) KV buffer size = +(\d+\.\d\d) MiB$"),
    RS: re.compile(r"^llama_memory_recurrent: +(\S+) RS buffer size = +(\d+\.\d\d) MiB$"),
    COMPUTE: re.compile(r"^sched_reserve: +(\S+) compute buffer size = +(\d+\.\d\d) MiB$"),
    OUTPUT: re.compile(r"^llama_context: +(\S+)  output buffer size = +(\d+\.\d\d) MiB$"),
}
_HOST_BACKENDS = {"CPU", "CPU_Mapped", "CUDA_Host", "Vulkan_Host"}
_DEVICE_BACKENDS = {"CUDA0": "cuda:0", "CUDA1": "cuda:1", "Vulkan0": "vulkan:0"}


def read(name: str) -> str:
    return (LOGS / name).read_text()


def parse(name: str) -> LogParser:
    p = LogParser()
    p.feed_text(read(name))
    return p


def expected_bytes(text: str, after: str | None = None) -> dict[tuple[str, str], int]:
    """(device, component) -> bytes, summing every buffer line (after the line containing ``after``)."""
    lines = text.splitlines()
    if after is not None:
        lines = lines[next(i for i, ln in enumerate(lines) if after in ln) + 1:]
    out: dict[tuple[str, str], int] = {}
    for ln in lines:
        for comp, rx in _EXPECT.items():
            m = rx.match(ln)
            if m:
                backend = m.group(1)
                dev = "cpu" if backend in _HOST_BACKENDS else _DEVICE_BACKENDS[backend]
                out[(dev, comp)] = out.get((dev, comp), 0) + round(float(m.group(2)) * MiB)
    return out


def nonzero(report) -> dict[tuple[str, str], int]:
    return {k: v for k, v in report.bytes.items() if v}


# ---------------------------------------------------------------------- recorded, CPU build


@pytest.mark.parametrize("name", RECORDED_OK)
def test_recorded_figures_equal_log_text(name):
    text = read(name)
    p = parse(name)
    rep = p.report()
    exp = expected_bytes(text)
    assert {c for _, c in exp} == {WEIGHTS, KV, COMPUTE, OUTPUT}
    assert nonzero(rep) == exp
    assert rep.source == ACTUAL
    assert rep.devices == ["cpu"]  # CPU-only build: host memory only
    n_ctx = int(re.search(r"^llama_context: n_ctx += (\d+)$", text, re.M).group(1))
    assert p.n_ctx == rep.n_ctx == n_ctx
    assert p.ready and not p.failed and not p.oom and p.errors == []
    assert p.build == "11434" and p.build_commit == "b11434"
    # a CPU-only build prints no offload and no device lines
    assert "offloaded" not in text
    assert p.layers_offloaded is None and p.layers_total is None
    assert p.free_memory == {} and p.device_names == {}
    # the summary line restates the buffer, it is not added to it
    assert p.kv_summary_bytes() == rep.total(component=KV)
    assert p.fit_ok is True and any("no changes needed" in d.text for d in p.fit)
    assert p.listening and p.listening.startswith("http://127.0.0.1:")


def test_recorded_stories_numbers_hard_coded():
    p = parse("cpu_stories_c2048.log")
    rep = p.report()
    assert rep.get("cpu", WEIGHTS) == round(1.12 * MiB)  # "CPU_Mapped model buffer size =     1.12 MiB"
    assert rep.get("cpu", KV) == round(1.25 * MiB)  # "CPU KV buffer size =     1.25 MiB"
    assert rep.get("cpu", COMPUTE) == round(3.65 * MiB)  # "CPU compute buffer size =     3.65 MiB"
    assert rep.get("cpu", OUTPUT) == round(0.01 * MiB)  # "CPU  output buffer size =     0.01 MiB"
    assert rep.total() == round(1.12 * MiB) + round(1.25 * MiB) + round(3.65 * MiB) + round(0.01 * MiB)
    assert (p.n_ctx, p.n_ctx_seq, p.n_seq, p.n_batch, p.n_ubatch) == (2048, 2048, 4, 2048, 512)
    assert p.kv_unified is True
    assert p.flash_attn == "auto" and p.flash_attn_enabled is True  # "resolve_fused_ops: Flash Attention enabled"


def test_kv_doubles_with_double_context():
    small = parse("cpu_stories_c2048.log")
    big = parse("cpu_stories_c4096_np4.log")
    assert big.report().get("cpu", KV) == 2 * small.report().get("cpu", KV)
    assert big.n_ctx == 4096 and big.n_ctx_seq == 1024 and big.n_seq == 4 and big.kv_unified is False
    assert big.report().get("cpu", WEIGHTS) == small.report().get("cpu", WEIGHTS)


def test_quantised_kv_is_smaller():
    f16 = parse("cpu_synth_c2048.log")
    q8 = parse("cpu_synth_q8_0_fa.log")
    assert q8.report().get("cpu", KV) == round(1.06 * MiB)
    assert f16.report().get("cpu", KV) == round(2.00 * MiB)
    assert q8.flash_attn == "enabled" and q8.flash_attn_enabled is True
    assert q8.report().get("cpu", WEIGHTS) == f16.report().get("cpu", WEIGHTS)


def test_ngl0_on_cpu_build_same_memory():
    assert parse("cpu_stories_ngl0.log").report().bytes == parse("cpu_stories_c2048.log").report().bytes
    # "warning: no usable GPU found" is not an error
    assert parse("cpu_stories_ngl0.log").errors == []


@pytest.mark.parametrize("name, cause", [
    ("cpu_stories_q8_0_ctx_fail.log", "does not divide n_embd_head_k"),
    ("cpu_truncated_gguf.log", "not within the file bounds"),
    ("cpu_corrupt_gguf.log", "failed to load model from"),
])
def test_recorded_failed_starts(name, cause):
    p = parse(name)
    assert p.failed and not p.ready and not p.oom
    assert p.errors
    assert any("exiting due to model loading error" in e for e in p.errors)
    assert any(cause in ln for ln in p.last_error_lines(10))
    assert p.fit_ok is False  # the fit probe hits the same failure first


def test_context_failure_keeps_weights_figure():
    rep = parse("cpu_stories_q8_0_ctx_fail.log").report()
    assert nonzero(rep) == {("cpu", WEIGHTS): round(1.12 * MiB)}
    assert parse("cpu_truncated_gguf.log").report().total() == 0


# ---------------------------------------------------------------------- hand-written, GPU


@pytest.mark.parametrize("name", HANDWRITTEN_OK + HANDWRITTEN_FAIL)
def test_handwritten_figures_equal_log_text(name):
    assert nonzero(parse(name).report()) == expected_bytes(read(name))


def test_cuda_full_offload():
    p = parse("cuda_full_offload.log")
    rep = p.report()
    assert (p.layers_offloaded, p.layers_total) == (6, 6)
    assert (rep.layers_offloaded, rep.layers_total) == (6, 6)
    assert rep.devices == ["cpu", "cuda:0"]
    assert rep.get("cuda:0", WEIGHTS) == round(1100.25 * MiB)  # CUDA0 model buffer
    assert rep.get("cpu", WEIGHTS) == round(40.50 * MiB)  # CPU_Mapped model buffer
    assert rep.get("cuda:0", KV) == 256 * MiB
    assert rep.get("cpu", OUTPUT) == round(1.95 * MiB) and rep.get("cuda:0", OUTPUT) == 0  # CUDA_Host
    assert rep.get("cpu", COMPUTE) == round(2.02 * MiB)  # CUDA_Host compute buffer
    # the teardown line "compute buffer size of 24.5000 MiB, does not match expectation" is ignored
    assert rep.get("cuda:0", COMPUTE) == round(24.01 * MiB)
    assert any("does not match expectation" in w for w in p.warnings)
    assert p.free_memory == {"cuda:0": 142000 * MiB}
    assert p.device_names == {"cuda:0": "NVIDIA H200"}
    assert p.ready and not p.oom and p.errors == []


def test_cuda_partial_offload_splits_weights_and_kv():
    p = parse("cuda_partial_offload.log")
    rep = p.report()
    assert (p.layers_offloaded, p.layers_total) == (20, 33)
    assert rep.get("cuda:0", WEIGHTS) == round(2862.19 * MiB)
    assert rep.get("cpu", WEIGHTS) == round(4685.30 * MiB)
    assert rep.get("cuda:0", KV) == 304 * MiB and rep.get("cpu", KV) == 208 * MiB
    assert rep.total(component=KV) == p.kv_summary_bytes() == 512 * MiB  # counted once, not with the summary
    assert rep.gpu_total == round(2862.19 * MiB) + 304 * MiB + 296 * MiB
    assert p.device_names["cuda:0"] == "NVIDIA GeForce RTX 4060 Laptop GPU"


def test_fit_section_and_projections_replaced():
    name = "cuda_fit_moe_2gpu.log"
    text = read(name)
    p = parse(name)
    rep = p.report()
    # only the real load counts, not the fit probe's projected buffers printed before it
    assert nonzero(rep) == expected_bytes(text, after="fitting params to free memory took")
    assert rep.get("cuda:0", WEIGHTS) == round(120500.50 * MiB)
    assert rep.get("cuda:0", KV) == 9000 * MiB
    assert p.n_ctx == rep.n_ctx == 65536
    assert p.free_memory == {"cuda:0": 141990 * MiB, "cuda:1": 141995 * MiB}  # later line wins
    reduced = [d for d in p.fit if d.ctx_from is not None]
    assert [(d.ctx_from, d.ctx_to) for d in reduced] == [(262144, 65536)]
    final = [d for d in p.fit if d.overflowing is not None]
    assert [(d.device, d.layers, d.overflowing, d.used_bytes, d.free_bytes) for d in final] == [
        ("cuda:0", 25, 3, 140500 * MiB, 1500 * MiB),
        ("cuda:1", 24, 0, 139800 * MiB, 2200 * MiB),
    ]
    dense = [d for d in p.fit if d.layers is not None and d.overflowing is None]
    assert [(d.device, d.layers) for d in dense] == [("cuda:1", 24), ("cuda:0", 25)]
    proj = [d for d in p.fit if "vs. target" in d.text]
    assert [(d.device, d.free_bytes) for d in proj] == [("cuda:0", -16000 * MiB), ("cuda:1", -12100 * MiB)]
    assert p.fit_ok is True
    assert all(isinstance(d, FitDecision) and d.text.startswith("common_") for d in p.fit)


def test_swa_counts_both_caches_once():
    p = parse("cuda_swa.log")
    rep = p.report()
    assert rep.get("cuda:0", KV) == 104 * MiB + 105 * MiB
    assert rep.total(component=KV) == p.kv_summary_bytes()
    assert {s.kind for s in p.kv_summaries} == {"base", "swa"}


def test_hybrid_recurrent_state():
    rep = parse("cuda_hybrid_rs.log").report()
    assert rep.get("cuda:0", RS) == round(113.25 * MiB)
    assert rep.get("cuda:0", KV) == 64 * MiB


def test_cuda_oom():
    p = parse("cuda_oom_kv.log")
    assert p.oom and p.failed and not p.ready
    assert any("cudaMalloc failed: out of memory" in ln for ln in p.oom_lines)
    assert any("cudaMalloc failed" in ln for ln in p.last_error_lines())
    # what was allocated before the failure is still reported
    assert p.report().get("cuda:0", WEIGHTS) == round(18508.35 * MiB)


def test_recoverable_compute_failure_is_not_oom():
    p = parse("cuda_recoverable_pp.log")
    assert not p.oom and p.errors == [] and p.ready and not p.failed
    assert any("retrying without pipeline parallelism" in w for w in p.warnings)
    assert any("cudaMalloc failed" in w for w in p.warnings)
    assert p.report().get("cuda:1", COMPUTE) == 1030 * MiB


def test_vulkan():
    p = parse("vulkan_full_offload.log")
    rep = p.report()
    assert rep.devices == ["cpu", "vulkan:0"]
    assert rep.get("vulkan:0", WEIGHTS) == round(1100.25 * MiB)
    assert rep.get("cpu", OUTPUT) == round(1.95 * MiB)  # Vulkan_Host
    assert rep.get("cpu", COMPUTE) == round(18.02 * MiB)
    assert p.device_names == {"vulkan:0": "AMD Radeon RX 7900 XTX (RADV NAVI31)"}  # parentheses inside the name
    assert p.free_memory == {"vulkan:0": 23800 * MiB}
    assert p.flash_attn_enabled is False
    assert not p.oom

    q = parse("vulkan_oom.log")
    assert q.oom and q.failed and not q.ready
    assert any("ErrorOutOfDeviceMemory" in ln for ln in q.oom_lines)
    assert any("ErrorOutOfDeviceMemory" in ln for ln in q.last_error_lines())


# ---------------------------------------------------------------------- rules, on small inputs


def test_later_line_replaces_earlier_for_same_key():
    p = LogParser()
    p.feed_text("""load_tensors:        CUDA0 model buffer size =   100.00 MiB
load_tensors:   CPU_Mapped model buffer size =    10.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB
sched_reserve:      CUDA0 compute buffer size =    30.00 MiB
llama_context: constructing llama_context
load_tensors:        CUDA0 model buffer size =    50.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =    32.00 MiB
sched_reserve:      CUDA0 compute buffer size =    20.00 MiB
""")
    rep = p.report()
    assert rep.get("cuda:0", WEIGHTS) == 50 * MiB
    assert rep.get("cpu", WEIGHTS) == 10 * MiB  # a key not restated keeps its figure
    assert rep.get("cuda:0", KV) == 32 * MiB
    assert rep.get("cuda:0", COMPUTE) == 20 * MiB


def test_one_run_of_model_buffers_sums_per_backend():
    # a split GGUF maps one CPU_Mapped buffer per file, printed in one run of lines
    p = LogParser()
    p.feed_text("load_tensors:   CPU_Mapped model buffer size =  1000.00 MiB\n"
                "load_tensors:   CPU_Mapped model buffer size =   500.50 MiB\n")
    assert p.report().get("cpu", WEIGHTS) == round(1500.50 * MiB)


def test_teardown_and_debug_compute_lines_ignored():
    p = LogParser()
    p.feed("~llama_context:      CUDA0 compute buffer size of  24.5000 MiB, does not match expectation of  24.0100 MiB")
    p.feed("~llama_context:      CUDA0 compute buffer size is  24.0100 MiB, matches expectation of  24.0100 MiB")
    assert p.report().total() == 0
    assert not p.errors and not p.oom


def test_output_line_with_double_space_is_host():
    p = LogParser()
    p.feed("llama_context:  CUDA_Host  output buffer size =     0.49 MiB\n")
    p.feed("llama_context:        CPU  output buffer size =     0.01 MiB\r\n")
    assert p.report().bytes == {("cpu", OUTPUT): round(0.49 * MiB) + round(0.01 * MiB)}


def test_prefix_does_not_matter():
    # with log prefixes and timestamps switched on, the same figures come out
    p = LogParser()
    p.feed("0.01.123.456 I llama_kv_cache:      CUDA0 KV buffer size =   256.00 MiB")
    p.feed("0.01.123.457 I load_tensors: offloaded 6/6 layers to GPU")
    assert p.report().get("cuda:0", KV) == 256 * MiB and p.layers_offloaded == 6


@pytest.mark.parametrize("line, oom", [
    ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 10.00 MiB on device 0: cudaMalloc failed: out of memory",
     True),
    ("CUDA error: OUT OF MEMORY", True),
    ("ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory", True),
    ("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 123", True),
    # a projector's weights that no device could hold, when the abort beat the logger's thread
    ("/llama.cpp/ggml/src/ggml-backend.cpp:328: GGML_ASSERT(buffer) failed", True),
    ("/llama.cpp/ggml/src/ggml.c:1714: GGML_ASSERT(view_src == NULL || data_size == 0) failed", False),
    ("llama_context: compute buffer allocation failed, retrying without pipeline parallelism", False),
    ("srv  update_slots: all slots are idle", False),
])
def test_oom_markers(line, oom):
    p = LogParser()
    p.feed(line)
    assert p.oom is oom


def test_oom_before_unrelated_retry_is_kept():
    # an OOM far back is not withdrawn by a later recoverable warning
    p = LogParser()
    p.feed("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8.00 MiB on device 0: "
           "cudaMalloc failed: out of memory")
    p.feed("llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB")
    p.feed("sched_reserve: compute buffer allocation failed, retrying without pipeline parallelism")
    assert p.oom


def test_bounded_line_buffer():
    p = LogParser(max_lines=5)
    for i in range(20):
        p.feed(f"line {i}\n")
    assert list(p.lines) == [f"line {i}" for i in range(15, 20)]
    assert p.n_lines == 20
    assert p.last_error_lines(3) == ["line 17", "line 18", "line 19"]


def _state(p: LogParser) -> dict:
    return {
        "report": p.report().to_dict(), "lines": list(p.lines), "errors": p.errors, "oom": p.oom,
        "ready": p.ready, "fit": p.fit, "free": p.free_memory, "names": p.device_names, "n_ctx": p.n_ctx,
        "n_seq": p.n_seq, "n_batch": p.n_batch, "n_ubatch": p.n_ubatch, "fa": p.flash_attn,
        "kvu": p.kv_unified, "build": p.build, "warnings": p.warnings, "kvs": p.kv_summaries,
    }


@pytest.mark.parametrize("name", ALL)
def test_line_by_line_equals_whole_text(name):
    text = read(name)
    whole = LogParser()
    whole.feed_text(text)
    by_line = LogParser()
    for line in text.splitlines(keepends=True):
        by_line.feed(line)
    assert _state(by_line) == _state(whole)
    assert _state(whole)["lines"]  # something was read


def test_readme_names_every_log():
    readme = (LOGS / "README.md").read_text()
    logs = sorted(f.name for f in LOGS.glob("*.log"))
    assert sorted(ALL) == logs
    for name in logs:
        assert f"`{name}`" in readme, name


def test_markers_are_lower_case_and_found_in_any_case():
    """The error markers are matched against the lowered line (one case-sensitive search a
    line): each must be lower case, and a line in any case must still be caught."""
    from jupyter_llama.engine import logparse as lp

    for marker in (*lp.RECOVERABLE_MARKERS, *lp.OOM_MARKERS, *lp.ERROR_MARKERS):
        assert marker == marker.lower(), marker
    p = lp.LogParser()
    p.feed("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 512.00 MiB on device 0: CUDAMALLOC FAILED")
    p.feed("llama_init_from_model: Failed To Create Context")
    assert len(p.oom_lines) == 1 and "CUDAMALLOC" in p.oom_lines[0]
    assert any("Failed To Create Context" in e for e in p.errors)


def test_a_serving_childs_blocks_are_kept_and_still_searched_for_failures():
    """feed_lines, the runner's call for each read: once the child serves, a block of request
    chatter is kept line by line with one search for failure markers over the block; a
    failure anywhere in a block is still found, on its own line."""
    from jupyter_llama.engine import logparse as lp

    p = lp.LogParser()
    p.feed_lines(["main: model loaded", "main: server is listening on http://127.0.0.1:5000 - starting the main loop"])
    assert p.ready and p.listening
    chatter = [f"slot get_availabl: id  {i} | task -1 |  - skipping, slot is empty" for i in range(8)]
    before = p.n_lines
    p.feed_lines(chatter + ["slot print_timing: id  7 | task 17 | n_ctx = 4096"])
    assert p.n_lines == before + 9
    assert list(p.lines)[-9:] == chatter + ["slot print_timing: id  7 | task 17 | n_ctx = 4096"]
    assert p.n_ctx != 4096 and not p.errors and not p.oom_lines  # serving chatter is not read for figures
    p.feed_lines(chatter[:3] + ["ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 9 MiB"]
                 + chatter[3:])
    assert len(p.oom_lines) == 1 and p.oom_lines[0].endswith("9 MiB")
    assert p.n_lines == before + 9 + 9
