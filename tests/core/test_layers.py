"""The package's layering, read from its source: what may import what.

Base modules (errors, config, load_options, procs, private, seams, _version) import nothing of the package above
them; the core (models, memory, engine, api, scheduler) never imports the front ends
(server, widgets, magics, commands, cli, client, plots, embedded) and nothing below the
scheduler imports it; no two packages import each other, and no module import cycle exists
(imports under ``if TYPE_CHECKING:`` are annotations, not imports, and are not counted;
imports inside functions are).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "jupyter_llama"
BASE = {"errors", "config", "load_options", "_version", "procs", "private", "seams"}
CORE = {"models", "memory", "engine", "api", "scheduler"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    mods = {_module(p): p for p in ROOT.rglob("*.py") if "labextension" not in p.parts}
    out: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # ``from pkg import mod`` depends on that module, ``from mod import name`` on mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("jupyter_llama"):
                    out[mod].add(t)
    return out


def _area(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "jupyter_llama"


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for mod, targets in _imports().items():
        a = _area(mod)
        for t in targets:
            b = _area(t)
            if a in BASE and b not in BASE:
                wrong.append((mod, t))
            elif a in CORE and b not in CORE | BASE:
                wrong.append((mod, t))
            elif a in CORE - {"scheduler"} and b == "scheduler":
                wrong.append((mod, t))
    assert not wrong, "upward imports: " + ", ".join(f"{m} -> {t}" for m, t in wrong)


def test_no_two_packages_import_each_other():
    areas: dict[str, set[str]] = defaultdict(set)
    for mod, targets in _imports().items():
        for t in targets:
            if _area(mod) != _area(t):
                areas[_area(mod)].add(_area(t))
    both = sorted({tuple(sorted((a, b))) for a, bs in areas.items() for b in bs if a in areas.get(b, ())})
    assert not both, f"packages that import each other: {both}"


def test_no_module_import_cycle():
    graph = _imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_scheduler_policy_is_pure():
    """``scheduler/policy.py`` decides over plain data: it imports nothing that reaches the event
    loop, a process, a file or a clock, nor the engine or the scheduler's loop (so its tests in
    ``tests/scheduler/test_policy.py`` need no engine, and the loop is where effects live)."""
    path = ROOT / "scheduler" / "policy.py"
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names |= {base} | {base + ("" if base.endswith(".") else ".") + a.name for a in node.names}
    effects = {"asyncio", "os", "subprocess", "threading", "concurrent", "socket", "time", "signal", "shutil",
               "pathlib", "tempfile"}
    wrong = sorted(n for n in names if n.split(".")[0] in effects
                   or n.startswith(("..engine", "..procs", ".loop", "jupyter_llama.engine", "jupyter_llama.procs",
                                    "jupyter_llama.scheduler.loop")))
    assert not wrong, f"the policy imports effects: {wrong}"
