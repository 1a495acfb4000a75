"""The real-model tier, on the engine: Gemma 3 270M (Q4_K_M) loaded by real llama-server
children across a grid of load options, each prediction held against what the child's own
log says it allocated; a plot of one load written as a PNG. Skips where the Gemma package
is absent (the ``test`` extra installs it).

Gemma 3 has what the synthetic Llama models lack: a sliding-window cache beside the global
one, a key length (256) unlike embedding / heads, and a 262k-token vocabulary whose output
layer is tied to the embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.estimate import estimate_coarse, estimate_detailed, format_estimates
from jupyter_llama.memory.report import ACTUAL, COARSE, COMPUTE, DETAILED, KV, WEIGHTS
from jupyter_llama.models.gguf_info import read_gguf_info

pytestmark = pytest.mark.engine

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MiB = 2**20

GRID = [
    LoadOptions(num_ctx=512, num_parallel=1),
    LoadOptions(num_ctx=4096, num_parallel=4),
    LoadOptions(num_ctx=32768, num_parallel=1),
    LoadOptions(num_ctx=8192, num_parallel=2, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on"),
    LoadOptions(num_ctx=2048, num_parallel=1, flash_attn="off", num_ubatch=256),
]


@pytest.mark.parametrize("options", GRID, ids=["512", "4k-np4", "32k", "8k-q8-fa", "2k-fa-off-ub256"])
async def test_the_detailed_estimate_holds_on_gemma(start_runner, gemma_model, options):
    """Within 1% in total, and the KV cache, weights and compute buffer to the log's rounding:
    the sliding window (most of Gemma's layers keep only their last 512 positions) included,
    and its cache's own inputs in the compute buffer (without flash attention its V indices
    are one per element: 8 bytes x 256 x n_ubatch beside the global cache's)."""
    info = read_gguf_info(gemma_model)
    predicted = estimate_detailed(info, options, [])
    actual = (await start_runner(gemma_model, options)).memory()
    table = format_estimates({DETAILED: predicted}, actual)
    assert predicted.total() == pytest.approx(actual.total(), rel=0.01), table
    assert predicted.total(component=KV) == pytest.approx(actual.total(component=KV), abs=0.02 * MiB), table
    assert predicted.total(component=WEIGHTS) == pytest.approx(actual.total(component=WEIGHTS), abs=0.02 * MiB), table
    # (the log gives MiB to two decimals)
    assert predicted.total(component=COMPUTE) == pytest.approx(actual.total(component=COMPUTE), abs=0.005 * MiB), table


async def test_one_kv_formula_for_every_layer_overcounts_a_sliding_window_model(start_runner, gemma_model):
    """What the course teaches first, 2 x layers x KV heads x head dim x cells x bytes, counts
    every layer at the full context; on Gemma at 32k most layers keep a 512-position window,
    so the formula is several times the cache llama.cpp allocates."""
    info = read_gguf_info(gemma_model)
    options = LoadOptions(num_ctx=32768, num_parallel=1)
    md = info.metadata
    arch = md["general.architecture"]
    layers, kv_heads = md[f"{arch}.block_count"], md[f"{arch}.attention.head_count_kv"]
    key_length, value_length = md[f"{arch}.attention.key_length"], md[f"{arch}.attention.value_length"]
    formula = layers * kv_heads * (key_length + value_length) * 32768 * 2  # f16
    actual = (await start_runner(gemma_model, options)).memory()
    assert formula > 3 * actual.total(component=KV)
    assert estimate_detailed(info, options, []).total(component=KV) == pytest.approx(
        actual.total(component=KV), abs=0.02 * MiB)


async def test_a_plot_of_a_gemma_load_is_written(start_runner, gemma_model):
    pytest.importorskip("matplotlib")
    from jupyter_llama.plots import plot_memory

    info = read_gguf_info(gemma_model)
    options = LoadOptions(num_ctx=4096, num_parallel=1)
    actual = (await start_runner(gemma_model, options)).memory()
    reports = {COARSE: estimate_coarse(info, options), DETAILED: estimate_detailed(info, options, []), ACTUAL: actual}
    fig = plot_memory(reports, model="gemma3:270m", options=options)
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / "gemma3-270m-memory.png"
    fig.savefig(out, dpi=80)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4096" in fig.axes[0].get_title()
