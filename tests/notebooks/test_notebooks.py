"""The teaching notebooks in notebooks/, executed top to bottom through a real kernel.

Each runs twice: in a kernel that finds the session's manager (a real `jupyter-llama serve`
child) through JUPYTER_LLAMA_URL / JUPYTER_LLAMA_TOKEN in its environment, exactly as a
kernel started by JupyterLab with the extension does; and in a plain kernel with none of
that, as VS Code and IPython run it, where the magics and widgets find the user's
background manager, with the same claims checked. Notebooks 04 and 05 start budgeted managers of their own
and stop them in their last cell; the test also watches the kernel's child processes and makes
sure every manager a notebook started is gone once the kernel has shut down, even after a
failed cell.

Each notebook ends with a cell that prints ``CLAIMS {json}``: the numbers its prose is about.
The test checks them, renders the executed notebook to tests/artifacts/notebooks/NAME.html
(outputs included, for a person to read) and records its run time (printed after the run).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from jupyter_llama.client import LlamaClient
from jupyter_llama.demo import gemma_path


def notebook_test(func):
    """A notebook run: needs the engine, takes seconds to a minute."""
    return pytest.mark.engine(pytest.mark.slow(pytest.mark.timeout(600)(func)))

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "tests" / "artifacts" / "notebooks"
STORIES = ROOT.parent / "shared" / "models" / "stories260K.gguf"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
MiB = 1024 * 1024


def test_the_course_is_complete():
    assert [n[:2] for n in NAMES] == ["01", "02", "03", "04", "05", "06"], NAMES


def test_notebooks_are_committed_without_outputs():
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name} cell {i} has outputs"
        assert "widgets" not in nb.metadata, f"{name} carries saved widget state"


def _serve_descendants(pid: int) -> set[int]:
    """Managers (`jupyter_llama.server.serve`) started under process ``pid``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return set()
    out = set()
    for p in children:
        try:
            if "jupyter_llama.server.serve" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def execute(name: str, lasting: set[int] | None = None) -> tuple[nbformat.NotebookNode, float, set[int]]:
    """Run one notebook in a fresh kernel with cwd notebooks/; returns it, its run time and the
    managers its kernel started (all of which are stopped, by pid, before this returns, but
    for ``lasting`` ones: the background manager is meant to outlive its kernel)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    started: set[int] = set()
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=False, coalesce_streams=True,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})

    def watch(**_):
        pid = client.km.provisioner.pid if client.km is not None and client.km.provisioner else None
        if pid:
            started.update(_serve_descendants(pid))

    client.on_cell_executed = watch
    t0 = time.monotonic()
    error = None
    try:
        client.execute()
    except CellExecutionError as e:
        error = e
    elapsed = time.monotonic() - t0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    render(nb, ARTIFACTS / name.replace(".ipynb", ".html"))
    leftovers = _stop_all(started - (lasting or set()))
    if error is not None:
        pytest.fail(f"{name}: a cell failed (rendered to {ARTIFACTS / name.replace('.ipynb', '.html')}):\n{error}")
    assert not leftovers, f"{name}: managers still running after the kernel stopped: {leftovers}"
    return nb, elapsed, started


def _stop_all(pids: set[int], grace: float = 20.0) -> list[int]:
    """Wait for the notebook's managers to end (their kernel stops them); kill stragglers by pid."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in alive]


def render(nb: nbformat.NotebookNode, path: Path) -> None:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    path.write_text(body, encoding="utf-8")


def claims_of(nb: nbformat.NotebookNode) -> dict:
    for cell in reversed(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                for line in out.get("text", "").splitlines():
                    if line.startswith("CLAIMS "):
                        return json.loads(line[len("CLAIMS "):])
    raise AssertionError("the notebook printed no CLAIMS line")


def all_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") if out.get("output_type") == "stream" else
                         out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.fixture(params=["server", "plain kernel"])
def run_notebook(request, engine, monkeypatch, tmp_path, notebook_timings):
    """Execute a notebook in a kernel that finds a manager two ways: "server", the session's
    manager through JUPYTER_LLAMA_URL/TOKEN, as a kernel JupyterLab starts; "plain kernel",
    none of that (VS Code, plain IPython): its magics and widgets find the user's background
    manager (its own state directory here; started before the kernel, as a first %llama
    would start it, so the test can tell it from managers the notebook starts itself, and
    stopped afterwards). ``run.manager_pid`` is the manager's pid."""
    monkeypatch.setenv("JUPYTER_LLAMA_SERVER", engine.path)  # notebooks' own managers use the same engine
    monkeypatch.delenv("JUPYTER_TOKEN", raising=False)
    lasting: set[int] = set()
    if request.param == "server":
        manager = request.getfixturevalue("manager")
        monkeypatch.setenv("JUPYTER_LLAMA_URL", manager["env"]["JUPYTER_LLAMA_URL"])
        monkeypatch.setenv("JUPYTER_LLAMA_TOKEN", manager["env"]["JUPYTER_LLAMA_TOKEN"])
        manager_pid = manager["pid"]
        # the lab holds a model of its own while the course runs (a student's usual state)
        lab = LlamaClient(manager["url"], manager["token"])
        lab.create("lab-model", files={"lab.gguf": lab.create_blob(request.getfixturevalue("tiny_model"))})
        lab.load("lab-model", options={"num_ctx": 512}, keep_alive="10m")
        request.addfinalizer(lambda: (lab.unload("lab-model"), lab.delete("lab-model"), lab.close()))
    else:
        from jupyter_llama import background

        for k in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN", "JPY_PARENT_PID"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("JUPYTER_LLAMA_MODELS", str(tmp_path / "models"))
        monkeypatch.setenv("JUPYTER_LLAMA_KEEP_ALIVE", "30s")
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
        monkeypatch.setenv("JUPYTER_LLAMA_MANAGER_DIR", str(tmp_path / "manager"))
        manager_pid = background.ensure().pid
        lasting.add(manager_pid)
        request.addfinalizer(background.stop)

    def run(name: str):
        nb, elapsed, managers = execute(name, lasting)
        with LlamaClient(start=False) as c:  # the manager the kernel used: the notebook left its list as it was
            left = [m["name"] for m in c.tags()["models"] if re.match(r"nb\d", m["name"])]
        assert not left, f"{name} left models registered: {left}"
        label = name if request.param == "server" else f"{name} ({request.param})"
        notebook_timings[label] = elapsed
        print(f"{label}: {elapsed:.1f} s")
        return nb, claims_of(nb), managers - lasting

    run.manager_pid = manager_pid
    return run


@notebook_test
def test_01_first_model(run_notebook):
    nb, c, _ = run_notebook("01-first-model.ipynb")
    assert c["host"] == "127.0.0.1" and c["port_in_argv"]
    assert c["parent_pid"] == run_notebook.manager_pid, "the llama-server child belongs to the manager"
    assert not c["api_key_on_command_line"]
    assert c["actual_total"] > 0 and c["ps_size"] == c["actual_total"]
    assert c["tokens"] == 24
    assert c["gone_after_stop"] and "llama-server" not in " ".join(_cmdline(c["pid"]))
    if STORIES.is_file():
        assert c["story_model"] == "nb1-stories" and c["story_chars"] > 0
    assert "application/vnd.jupyter.widget-view+json" in json.dumps([o for cell in nb.cells
                                                                     for o in cell.get("outputs", [])])


@notebook_test
def test_02_who_decides_gpu_layers(run_notebook):
    _, c, _ = run_notebook("02-who-decides-gpu-layers.ipynb")
    M = c["M"]
    assert c["ngl"] == {"automatic": None, "num_gpu 0": "0", "num_gpu 3": "3"}, "-ngl only when num_gpu is set"
    assert c["reloads"] == 2 and c["reload_changed"] == [["num_gpu"], ["num_gpu"]]
    assert c["distinct_pids"] == 3
    assert c["predicted_ngl3"] == f"3/{M}"
    if c["offloaded"]["automatic"] is None:  # a CPU build prints no offload line, and ps says so
        assert set(c["offloaded"].values()) == {None} and set(c["layers_total"].values()) == {None}
        assert c["same_memory"]
    else:
        assert c["layers_total"] == {k: M for k in c["ngl"]}
        assert c["offloaded"]["num_gpu 0"] == 0 and c["offloaded"]["num_gpu 3"] == 3
    # two RPC workers under a budget each: llama.cpp's own fit, then num_gpu 3, on real devices
    r = c["rpc"]
    assert r["log_has_offloaded"] and r["stopped"]
    assert 0 < r["auto"][0] < M and r["auto"][1] == M, "a partial offload, chosen by llama.cpp under the budgets"
    assert r["auto_within_budget"] and r["forced_within_budget"]
    assert set(r["workers"]) <= set(r["auto_by_device"]), "the automatic fit used both workers"
    assert r["forced"] == [3, M]
    for placed, predicted in ((r["auto_by_device"], r["auto_predicted"]),
                              (r["forced_by_device"], r["forced_predicted"])):
        for dev in r["workers"]:
            if placed.get(dev, 0) > MiB:  # a worker with layers on it, not just an empty compute buffer
                assert abs(predicted[dev] - placed[dev]) / placed[dev] < 0.10, (dev, predicted, placed)


@notebook_test
def test_03_where_the_memory_goes(run_notebook):
    _, c, _ = run_notebook("03-where-the-memory-goes.ipynb")
    assert c["kv_by_hand"] == 2 * 8 * 2 * 64 * 4096 * 2  # K and V x layers x kv heads x head dim x cells x f16
    assert c["kv_matches"] and f"{c['kv_log'] / MiB:.2f}" == f"{c['kv_by_hand'] / MiB:.2f}", \
        "the KV figure from the log equals the hand formula"
    assert c["formula_matches_sweep"] and c["linear"] and c["kv_growth"] == pytest.approx(c["ctx_growth"], rel=0.01)
    assert c["q8_ratio"] == pytest.approx(34 / 64, abs=0.005) and c["q8_ratio_rule"] == 34 / 64
    assert c["detailed_max_error"] < 0.10
    assert c["coarse_ignores_cache_type"]
    assert c["kv_vs_weights"] > 1
    # the two rules the text states, shown: cells rounded up to 256, a q8_0 V cache refused without flash attention
    assert c["rounded_to_256"] and c["kv_1000"] == c["kv_1024_by_hand"] == 2 * 8 * 2 * 64 * 1024 * 2
    assert c["q8_v_refusal"] and "cache_type_v q8_0 needs flash attention, and flash_attn is off" in c["q8_v_refusal"]
    # on the real model (when its package is here): the sliding window and the vocabulary, as the text says
    if gemma_path() is None:
        assert c["swa"] == {} and c["vocab"] == {}
        return
    swa = c["swa"]
    assert swa["2048"]["formula"] > swa["2048"]["actual"]
    ratios = [swa[k]["formula"] / swa[k]["actual"] for k in ("2048", "8192", "32768")]
    assert ratios == sorted(ratios) and ratios[-1] > 3, "further off the longer the context; several times at 32k"
    assert all(v["detailed"] == pytest.approx(v["actual"], abs=0.02 * MiB) for v in swa.values())
    assert c["vocab"]["embd_share"] > 0.5, "the embedding table is most of the weights"
    assert c["vocab"]["output_log"] == pytest.approx(c["vocab"]["logits_by_hand"], abs=0.01 * MiB)
    slots = c["slots"]  # num_ctx is per request: KV and logits grow with the request slots
    assert slots["2"]["kv"] == 2 * slots["1"]["kv"] and slots["4"]["kv"] == 4 * slots["1"]["kv"]
    assert slots["4"]["output"] == 4 * slots["1"]["output"]


@notebook_test
def test_04_estimates_versus_reality(run_notebook):
    nb, c, managers = run_notebook("04-estimates-versus-reality.ipynb")
    assert c["coarse"] > c["actual"], "coarse is conservative"
    assert abs(c["detailed"] - c["actual"]) / c["actual"] < 0.10, "detailed is within 10% of actual"
    assert c["coarse_by_hand"] == c["coarse"] and c["surcharge"] == 2 * 1024 * MiB
    assert c["coarse512"] < c["actual512"], "without the surcharge coarse falls short of a small model"
    assert c["need_detailed"] < c["budget"] < c["need_coarse"]
    assert c["refused_status"] == 507
    assert "coarse estimate" in c["refused_message"] and "budget" in c["refused_message"]
    assert "allowance for large batches" in c["refused_message"] and "num_batch 512" in c["refused_message"]
    assert "does not fit" in all_text(nb), "the refusal is shown as the manager recorded it"
    assert c["detailed_loaded"] and 0 < c["used"] <= c["budget"]
    assert c["managers_stopped"] and set(c["manager_pids"]) <= managers
    sp = c["split"]
    assert sp["stopped"] and sp["offloaded"][0] == 3 and len(sp["devices"]) == 2, sp
    assert all(abs(e) < 0.10 for e in sp["errors"].values()), f"detailed per device within 10%: {sp['errors']}"
    assert not any("jupyter_llama.server.serve" in " ".join(_cmdline(p)) for p in c["manager_pids"])
    g = c["gemma"]  # the real model, when its package is here: conservative in total, short in its KV cache
    if gemma_path() is None:
        assert g == {}
        return
    assert g["coarse"]["kv"] / g["actual"]["kv"] == pytest.approx(160 / 256), "head dim 640/4 where keys are 256"
    assert g["coarse"]["total"] > g["actual"]["total"]
    assert g["detailed"]["total"] == pytest.approx(g["actual"]["total"], rel=0.01)


@notebook_test
def test_05_sharing_memory(run_notebook):
    _, c, managers = run_notebook("05-sharing-memory.ipynb")
    assert all(c["checks"].values())
    assert c["expired"] == ["small1:latest"]
    assert c["evicted"] == ["small2:latest"] and c["evicted_for"] == ["small3:latest"], \
        "the evicted model is the one with the shortest keep_alive, not the oldest"
    assert "shortest keep_alive" in c["evict_rule"][0]
    assert c["loaded_after_eviction"] == ["small1:latest", "small3:latest"]
    assert c["refusal_status"] == 507 and "small3:latest" in c["refusal_message"], "the refusal names the pinned model"
    assert c["refusal_pinned"] == ["small3:latest"]
    assert c["big_loaded_after_unpin"]
    assert c["manager_stopped"] and c["manager_pid"] in managers
    assert "jupyter_llama.server.serve" not in " ".join(_cmdline(c["manager_pid"]))


@notebook_test
def test_06_clients(run_notebook):
    _, c, _ = run_notebook("06-clients.ipynb")
    assert c["pid_ollama"] is not None and c["pid_ollama"] == c["pid_openai"], "both clients reach one runner"
    assert c["loads"] == 1
    assert c["ollama_tokens"] == 16 and c["openai_tokens"] == 16


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


@notebook_test
@pytest.mark.parametrize("run_notebook", ["server"], indirect=True)
def test_the_course_runs_again_in_the_same_lab(run_notebook):
    """"Restart kernel and run all", the second time: after every notebook has run once in
    the session's manager (the tests above), each runs again there, while the lab holds a
    model of its own, with nothing in its way (each left the model list as it was)."""
    for name in NAMES:
        nb, claims, _ = run_notebook(name)
        assert claims, f"{name} printed no claims the second time"
