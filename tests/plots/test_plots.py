"""Plots check their drawn data against the reports, and leave PNGs for a person to open."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.report import KV, MemoryReport, MiB
from jupyter_llama.plots import plot_memory, plot_sweep, run_sweep, scheduler_sweep_functions
from jupyter_llama.scheduler import Scheduler, SchedulerSettings

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def _save(fig, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    fig.savefig(path, dpi=100)
    assert path.stat().st_size > 5000
    return path


def _bar_totals(fig) -> list[float]:
    """Height of each stacked bar (sum of its segments), in drawing order of the x positions."""
    ax = fig.axes[0]
    stacks: dict[float, float] = {}
    for p in ax.patches:
        x = round(p.get_x() + p.get_width() / 2, 6)
        stacks[x] = stacks.get(x, 0.0) + p.get_height()
    return [stacks[x] for x in sorted(stacks)]


def test_plot_memory_draws_the_reports():
    a = MemoryReport("actual")
    a.add("cpu", "weights", 40 * MiB)
    a.add("cpu", KV, 8 * MiB)
    a.add("cpu", "compute", 3 * MiB)
    c = MemoryReport("coarse")
    c.add("cpu", "weights", 42 * MiB)
    c.add("cpu", KV, 16 * MiB)
    fig = plot_memory({"coarse": c, "actual": a}, model="toy")
    totals = _bar_totals(fig)
    assert totals == pytest.approx([58.0, 51.0])  # MiB, coarse then actual
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("+14%" in t for t in texts), texts  # (58 - 51) / 51
    assert "toy" in fig.axes[0].get_title()
    _save(fig, "plot_memory_toy.png")


def test_plot_memory_splits_devices():
    r = MemoryReport("actual")
    r.add("cuda:0", "weights", 3 * 1024 * MiB)
    r.add("cpu", "weights", 1024 * MiB)
    fig = plot_memory({"actual": r})
    assert fig.axes[0].get_ylabel() == "memory (GiB)"
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["actual\ncpu", "actual\ncuda:0"]
    assert _bar_totals(fig) == pytest.approx([1.0, 3.0])


def test_plot_memory_needs_a_report():
    with pytest.raises(ValueError, match="at least one"):
        plot_memory({})


@pytest.mark.engine
async def test_sweep_measured_by_loading_for_real(engine, make_model):
    model = str(make_model("sweep", layers=2, embd=128, heads=4, kv_heads=2, ctx=8192, seed=2))
    sched = Scheduler(SchedulerSettings(binary=engine.path, keep_alive=0.5, max_loaded_models=1))
    try:
        predict, measure = scheduler_sweep_functions(sched, model)
        result = await run_sweep("num_ctx", [512, 1024, 2048, 4096], LoadOptions(num_parallel=1), predict, measure,
                                 model="sweep")
        # one load at a time: the previous point's runner was replaced, never two children
        assert len(sched.ps()) == 1
        actual_kv = [p.reports["actual"].total(component=KV) for p in result.points]
        assert actual_kv[1] == pytest.approx(2 * actual_kv[0], rel=0.01)  # KV is linear in context
        budget = result.points[2].reports["actual"].total()
        fig = plot_sweep(result, budget=budget)
        ax = fig.axes[0]
        measured = [ln for ln in ax.lines if ln.get_label() == "actual (measured)"][0]
        # coarse carries llama-server's 2 GiB batch surcharge, so the axis may be in GiB
        scale = {"memory (MiB)": MiB, "memory (GiB)": 1024 * MiB}.get(ax.get_ylabel().replace("total ", ""), MiB)
        assert list(measured.get_xdata()) == [512, 1024, 2048, 4096]
        assert list(measured.get_ydata()) == pytest.approx([p.total("actual") / scale for p in result.points])
        coarse = [ln for ln in ax.lines if ln.get_label() == "coarse (predicted)"][0]
        assert list(coarse.get_ydata()) == pytest.approx([p.total("coarse") / scale for p in result.points])
        assert any("budget" in t.get_text() for t in ax.texts)
        rows = result.rows()
        assert rows[0]["num_ctx"] == 512 and rows[0]["actual_total"] == result.points[0].total("actual")
        _save(fig, "plot_sweep_num_ctx.png")
        fig2 = plot_memory(result.points[-1].reports, model="sweep", options=result.points[-1].options,
                           engine=engine.version)
        _save(fig2, "plot_memory_sweep_4096.png")
    finally:
        await sched.shutdown()
