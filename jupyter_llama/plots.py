"""Plots of predicted against actual memory (matplotlib). Every function returns its figure.

* :func:`plot_memory`: for one model and one set of load options, stacked bars per source
  (coarse, detailed, llama.cpp's projection, actual) and per device, split into weights,
  KV cache, compute and output, with totals and error percentages against actual.
* :func:`plot_sweep`: memory against a load option (context length, GPU layers, ...),
  predicted lines and measured points, with the budget drawn as a line.
  :func:`run_sweep` makes the measurements itself, loading the model at each point.

Colours are the Okabe-Ito palette (safe for the common forms of colour blindness); sizes
are shown in MiB or GiB, whichever reads better for the data.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

from .load_options import LoadOptions
from .memory.report import ACTUAL, COARSE, COMPONENTS, OTHER, SOURCES, GiB, MemoryReport, MiB, format_bytes, format_pct

# Okabe-Ito: distinguishable with deuteranopia, protanopia and tritanopia.
COMPONENT_COLOURS = {
    "weights": "#0072B2",  # blue
    "kv": "#E69F00",  # orange
    "compute": "#009E73",  # bluish green
    "output": "#CC79A7",  # reddish purple
    "rs": "#56B4E9",  # sky blue
    "other": "#999999",  # grey
}
SOURCE_COLOURS = {"coarse": "#D55E00", "detailed": "#0072B2", "llama.cpp": "#009E73", "actual": "#000000"}
SOURCE_MARKERS = {"coarse": "s", "detailed": "o", "llama.cpp": "^", "actual": "D"}
COMPONENT_LABELS = {"weights": "weights", "kv": "KV cache", "compute": "compute buffer", "output": "output buffer",
                    "rs": "recurrent state", "other": "other / surcharge"}


def _figure(figsize):
    # Import lazily and without pyplot's global state when possible, so plotting works in
    # a server, a test or a notebook alike (pyplot is used only to get inline display).
    import matplotlib

    if matplotlib.get_backend().lower() in ("", "agg") or not _in_notebook():
        from matplotlib.figure import Figure

        return Figure(figsize=figsize, layout="constrained")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=figsize, layout="constrained")
    plt.close(fig)  # returned, displayed by the notebook as the cell's value, not twice
    return fig


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def unit_for(max_bytes: float) -> tuple[float, str]:
    return (GiB, "GiB") if max_bytes >= 2 * GiB else (MiB, "MiB")


def _ordered_sources(reports: Mapping[str, MemoryReport]) -> list[str]:
    known = [s for s in SOURCES if s in reports]
    return known + [s for s in reports if s not in known]


# A bar this many times the tallest of the others is drawn cut, so the others stay readable.
OFF_SCALE = 4


def plot_memory(reports: Mapping[str, MemoryReport], *, title: str | None = None, model: str | None = None,
                options: LoadOptions | None = None, engine: str | None = None, figsize=(8, 4.5)):
    """Stacked bars: one group per device, one bar per source, stacks per component.

    ``reports`` maps a source name (``coarse``, ``detailed``, ``llama.cpp``, ``actual``) to
    its report. Each bar is labelled with its total and, for predictions, the error against
    ``actual`` when present.
    """
    if not reports:
        raise ValueError("plot_memory needs at least one MemoryReport")
    sources = _ordered_sources(reports)
    devices = sorted({d for r in reports.values() for d in r.devices} or {"cpu"}, key=lambda d: (d != "cpu", d))
    comps = [c for c in COMPONENTS if any(r.total(component=c) for r in reports.values())]
    totals = {(src, d): reports[src].total(device=d) for src in sources for d in devices}
    # One estimate far above the rest (the coarse estimate's 2 GiB batch surcharge on a small
    # model) would squash every other bar to nothing: the axis then fits the others, and
    # those bars are cut at the top, marked, and labelled with their real value.
    ceiling = None
    if len(sources) > 1:
        top_src = max(sources, key=lambda src: max(totals[(src, d)] for d in devices))
        rest = max((v for (src, _), v in totals.items() if src != top_src), default=0)
        if rest > 0 and max(totals[(top_src, d)] for d in devices) > OFF_SCALE * rest:
            ceiling = rest * 1.3
    scale, unit = unit_for(ceiling if ceiling is not None else max(totals.values()))
    actual = reports.get(ACTUAL)

    fig = _figure(figsize)
    ax = fig.add_subplot()
    width = 0.8 / len(sources)
    xticks, xlabels = [], []
    for di, dev in enumerate(devices):
        for si, src in enumerate(sources):
            rep = reports[src]
            x = di + (si - (len(sources) - 1) / 2) * width
            bottom = 0.0
            top = ceiling / scale if ceiling is not None else math.inf
            # A bar beyond the axis is drawn to scale and cut at the axis's top, but its last
            # part keeps the top band of the bar, so it stays in sight (on the coarse estimate,
            # the batch allowance the note explains, above its cut KV cache).
            cut = totals[(src, dev)] / scale > top
            parts = [c for c in comps if rep.get(dev, c)]
            for c in comps:
                v = rep.get(dev, c) / scale
                if cut:
                    room = top if c == parts[-1] else top * 0.85
                    v = max(0.0, min(v, room - bottom))
                ax.bar(x, v, width * 0.92, bottom=bottom, color=COMPONENT_COLOURS[c],
                       edgecolor="white", linewidth=0.5, label=COMPONENT_LABELS[c] if (di, si) == (0, 0) else None)
                bottom += v
            value = totals[(src, dev)] / scale
            label = f"{value:.1f}" if value < 100 else f"{value:.0f}"
            if cut:  # a zig-zag across the top: the bar goes on beyond the axis
                ax.plot([x - width * 0.46, x - width * 0.15, x + width * 0.15, x + width * 0.46],
                        [top * 0.97, top * 0.99, top * 0.95, top * 0.97], color="white", linewidth=2.5)
                label = f"{format_bytes(totals[(src, dev)])}\n(off scale)"
            if src != ACTUAL and actual is not None and actual.total(device=dev):
                err = (rep.total(device=dev) - actual.total(device=dev)) / actual.total(device=dev) * 100
                label += "\n" + format_pct(err)
            ax.annotate(label, (x, bottom), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
            xticks.append(x)
            xlabels.append(src if len(devices) == 1 else f"{src}\n{dev}")
    ax.set_xticks(xticks, xlabels, fontsize=8)
    ax.set_ylabel(f"memory ({unit})")
    ax.margins(y=0.18)
    if ceiling is not None:
        ax.set_ylim(0, ceiling / scale * 1.25)
        note = (f"cut bars go beyond the axis;\ntheir real size is printed\nabove them ({top_src} is more\n"
                f"than {OFF_SCALE}x the others)")
        surcharge = reports[top_src].total(component=OTHER) if top_src == COARSE else 0
        if surcharge:  # say what makes it so large
            note += ("\n\nthe grey part of coarse is\nOllama's allowance for large\n"
                     f"batches ({format_bytes(surcharge)}): room it\nkeeps free, not memory\nllama.cpp allocates")
        ax.text(1.01, 0.0, note, transform=ax.transAxes, fontsize=7, va="bottom", ha="left", color="#555")
    # The legend sits right of the axes, where no bar or label can be under it.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, borderaxespad=0)
    ax.spines[["top", "right"]].set_visible(False)
    what = "predicted and actual memory" if actual is not None else "predicted memory (not loaded: no actual)"
    ax.set_title(title or _title(model, options, engine, what=what), fontsize=10)
    return fig


def _title(model: str | None, options: LoadOptions | None, engine: str | None, what: str) -> str:
    parts = [what]
    if model:
        parts[0] = f"{model}: {what}"
    if options is not None:
        opts = []
        if options.num_ctx:
            opts.append(f"num_ctx {options.num_ctx}")
        if options.num_parallel:
            opts.append(f"{options.num_parallel} slot{'' if options.num_parallel == 1 else 's'}")
        if options.num_gpu is not None:
            opts.append(f"num_gpu {options.num_gpu}")
        if options.cache_type_k or options.cache_type_v:
            opts.append(f"KV {options.cache_type_k or 'f16'}/{options.cache_type_v or 'f16'}")
        if opts:
            parts.append(", ".join(opts))
    if engine:
        parts.append(engine)
    return "\n".join(parts)


# ----------------------------------------------------------------------------- sweeps


@dataclass
class SweepPoint:
    value: int | str
    options: LoadOptions
    reports: dict[str, MemoryReport] = field(default_factory=dict)  # source -> report (actual when measured)

    def total(self, source: str) -> int | None:
        r = self.reports.get(source)
        return r.total() if r is not None else None


@dataclass
class SweepResult:
    param: str
    points: list[SweepPoint]
    model: str | None = None

    def rows(self) -> list[dict]:
        """Flat rows (one per point) for a DataFrame or a CSV: totals and per-component bytes."""
        out = []
        for p in self.points:
            row: dict = {self.param: p.value}
            for src, rep in p.reports.items():
                row[f"{src}_total"] = rep.total()
                for c, v in rep.by_component().items():
                    row[f"{src}_{c}"] = v
            out.append(row)
        return out


Predict = Callable[[LoadOptions], Awaitable[Mapping[str, MemoryReport]]]
Measure = Callable[[LoadOptions], Awaitable[MemoryReport]]


async def run_sweep(param: str, values: Iterable, base: LoadOptions, predict: Predict, measure: Measure | None = None,
                    model: str | None = None) -> SweepResult:
    """Predict (and, with ``measure``, load and measure) memory at each value of ``param``."""
    if param not in LoadOptions.__dataclass_fields__:
        raise ValueError(f"{param!r} is not a load option; try num_ctx, num_gpu, num_parallel or cache_type_k")
    points = []
    for v in values:
        changes = {param: v}
        if param == "cache_type_k":  # sweep both halves of the cache together
            changes["cache_type_v"] = v
            if v not in (None, "f16", "f32", "bf16"):
                changes["flash_attn"] = "on"  # a quantised V cache needs flash attention
        opts = base.replace(**changes)
        reports = dict(await predict(opts))
        if measure is not None:
            reports[ACTUAL] = await measure(opts)
        points.append(SweepPoint(v, opts, reports))
    return SweepResult(param, points, model)


def scheduler_sweep_functions(scheduler, model: str) -> tuple[Predict, Measure]:
    """(predict, measure) callables that use an in-process :class:`~jupyter_llama.scheduler.Scheduler`."""

    async def predict(opts: LoadOptions):
        _, preds = await scheduler.predict(model, opts)
        return preds

    async def measure(opts: LoadOptions) -> MemoryReport:
        lo = await scheduler.load(model, opts)
        rep = lo.actual
        if rep is None:
            raise RuntimeError(f"{model} loaded but its log reported no memory figures")
        return rep

    return predict, measure


def plot_sweep(result: SweepResult, *, budget: int | None = None, sources: Sequence[str] | None = None,
               title: str | None = None, engine: str | None = None, figsize=(7, 4.2)):
    """Total memory against the swept option: predicted lines, measured points, budget line."""
    if not result.points:
        raise ValueError("the sweep has no points")
    sources = list(sources or _ordered_sources(result.points[0].reports))
    numbers = [p.value for p in result.points if isinstance(p.value, (int, float))]
    numeric = len(numbers) == len(result.points)
    xs: Sequence[float] = numbers if numeric else list(range(len(result.points)))
    peak = max([p.total(s) or 0 for p in result.points for s in sources] + [budget or 0])
    values = [t for p in result.points for s in sources if (t := p.total(s))]
    log_y = bool(values) and max(values) / min(values) > 50  # e.g. coarse's 2 GiB beside a few MiB measured
    scale, unit = unit_for(min(values + [budget] if budget else values) if log_y else peak)
    fig = _figure(figsize)
    ax = fig.add_subplot()
    for src in sources:
        ys = [(t / scale) if (t := p.total(src)) is not None else None for p in result.points]
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if not pts:
            continue
        px, py = zip(*pts, strict=True)
        if src == ACTUAL:
            ax.plot(px, py, linestyle="none", marker=SOURCE_MARKERS[src], color=SOURCE_COLOURS[src],
                    markersize=6, label="actual (measured)", zorder=3)
        else:
            ax.plot(px, py, marker=SOURCE_MARKERS.get(src, "o"), markersize=3,
                    color=SOURCE_COLOURS.get(src, None), label=f"{src} (predicted)")
    if budget:
        ax.axhline(budget / scale, color="#D55E00", linestyle="--", linewidth=1)
        ax.annotate(f"budget {budget / scale:.1f} {unit}", (xs[0], budget / scale), xytext=(2, 3),
                    textcoords="offset points", fontsize=8, color="#D55E00")
    if numeric and result.param in ("num_ctx",):
        # a linear axis, ticks at the swept values: memory grows linearly with the context, and
        # a log axis would draw that as a curve
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_xlim(0, max(xs) * 1.05)
    if not numeric:
        ax.set_xticks(xs, [str(p.value) for p in result.points])
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)  # (an axis from zero: a bar or a line's height is its size)
    ax.set_xlabel(result.param)
    ax.set_ylabel(f"total memory ({unit})")
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or _title(result.model, None, engine, what=f"memory against {result.param}"), fontsize=10)
    return fig


def sweep(param: str, values: Iterable, base: LoadOptions, predict: Predict, measure: Measure | None = None,
          model: str | None = None) -> SweepResult:
    """Synchronous :func:`run_sweep` for scripts (not inside a running event loop)."""
    return asyncio.run(run_sweep(param, values, base, predict, measure, model))
