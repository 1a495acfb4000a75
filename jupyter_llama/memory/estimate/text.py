"""Estimates as text: the predictions side by side, and their errors against what a child
really allocated."""

from __future__ import annotations

from ..report import ACTUAL, COMPONENTS, HOST, SOURCES, MemoryReport, MiB, format_pct, render_table


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
