"""Estimates against what real llama-server children allocate (and llama.cpp's own projection)."""

from __future__ import annotations

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.estimate import estimate_detailed, format_estimates
from jupyter_llama.memory.fitparams import project, project_async, run_fit_params
from jupyter_llama.memory.report import COARSE, COMPUTE, DETAILED, KV, LLAMA_CPP, WEIGHTS
from jupyter_llama.memory.sources import estimate_all_async
from jupyter_llama.models.gguf_info import read_gguf_info

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("options", [
    LoadOptions(num_ctx=1024),  # automatic slots: 4, one unified cache
    LoadOptions(num_ctx=768, num_parallel=2, flash_attn="off"),  # per-slot streams, KQ scores in f32
    LoadOptions(num_ctx=2048, num_parallel=1, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on",
                num_ubatch=256),
], ids=["auto", "np2-fa-off", "q8-cache"])
async def test_detailed_within_ten_percent_of_actual(start_runner, tiny_model, options):
    info = read_gguf_info(tiny_model)
    predicted = estimate_detailed(info, options, [])
    r = await start_runner(tiny_model, options)
    actual = r.memory()
    assert actual.total() > 0
    assert predicted.total() == pytest.approx(actual.total(), rel=0.10), format_estimates({DETAILED: predicted}, actual)
    # the parts that are exact by construction
    assert predicted.total(component=KV) == pytest.approx(actual.total(component=KV), abs=0.01 * 2**20)
    assert predicted.total(component=WEIGHTS) == pytest.approx(actual.total(component=WEIGHTS), abs=0.01 * 2**20)


async def test_stories_model_detailed(start_runner, stories_model):
    options = LoadOptions(num_ctx=512)
    predicted = estimate_detailed(read_gguf_info(stories_model), options, [])
    r = await start_runner(stories_model, options)
    assert predicted.total() == pytest.approx(r.memory().total(), rel=0.10)


# Wide layers and a small vocabulary: a load llama.cpp's projection can describe (the logits of a
# micro-batch are small beside the feed-forward peak, and whole MiB beside its figures).
# (Two layers: llama-server runs the last layer's feed-forward for one row per slot, the tool for the
# whole micro-batch, so a model of one layer would peak higher in the tool.)
WIDE_SMALL_VOCAB = dict(layers=2, embd=1024, heads=16, kv_heads=4, ff=4096, vocab=2000, ctx=8192, type="f16")


@pytest.fixture
def wide_model(make_model):
    return make_model("wide-small-vocab", **WIDE_SMALL_VOCAB)


async def test_llama_cpps_projection_describes_the_load_where_it_is_shown(engine, start_runner, wide_model):
    if not engine.fit_params:
        pytest.skip("this engine has no llama-fit-params beside it")
    options = LoadOptions(num_ctx=2048, num_parallel=1)
    rep = project(engine.fit_params, wide_model, options)
    assert rep is not None and rep.source == LLAMA_CPP
    assert rep.devices == ["cpu"]
    assert rep.get("cpu", WEIGHTS) > 0 and rep.get("cpu", COMPUTE) > 0
    actual = (await start_runner(wide_model, options)).memory()
    assert rep.total() == pytest.approx(actual.total(), rel=0.10), format_estimates({LLAMA_CPP: rep}, actual)


def test_llama_cpps_projection_of_a_tiny_model_is_not_shown(engine, tiny_model):
    """Its figures are whole MiB, rounded down: too coarse for a load of a few MiB, which it
    would describe as another's. It ran, and says why it is not shown."""
    if not engine.fit_params:
        pytest.skip("this engine has no llama-fit-params beside it")
    res = run_fit_params(engine.fit_params, tiny_model, LoadOptions(num_ctx=1024))
    assert res.report is None and res.withheld and res.projection is not None
    assert "whole MiB" in res.error or "output rows" in res.error, res.error
    assert project(engine.fit_params, tiny_model, LoadOptions(num_ctx=1024)) is None


async def test_estimate_all_async_has_three_sources_where_llama_cpp_describes_the_load(engine, tiny_model, wide_model):
    if not engine.fit_params:
        pytest.skip("this engine has no llama-fit-params beside it")
    reports = await estimate_all_async(read_gguf_info(wide_model), LoadOptions(num_ctx=512), [], engine=engine)
    assert set(reports) == {COARSE, DETAILED, LLAMA_CPP}
    assert (await project_async(engine.fit_params, wide_model, LoadOptions(num_ctx=512))).total() > 0
    tiny = await estimate_all_async(read_gguf_info(tiny_model), LoadOptions(num_ctx=512), [], engine=engine)
    assert set(tiny) == {COARSE, DETAILED}
