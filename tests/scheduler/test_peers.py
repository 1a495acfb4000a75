"""Two managers of one user know about each other (issue 15): each publishes what its models
hold; a budget is the user's, so what the other manager holds counts against it, and a load
that does not fit names the other manager and its models.

The other manager is a real `jupyter-llama serve` process (the embedded manager's code)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory import peers as peermod
from jupyter_llama.scheduler import DoesNotFit

pytestmark = pytest.mark.engine

SHAPE = dict(layers=2, embd=256, heads=4, kv_heads=4, ctx=2048)
OPTS = {"num_ctx": 512, "num_parallel": 1, "num_thread": 1}


def test_a_board_lists_live_managers_only_and_drops_dead_ones(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = peermod.PeerBoard(tmp_path, "http://127.0.0.1:1/llama/", pid=sleeper.pid)
        other.publish([{"name": "a:latest", "by_device": {"cpu": 3 << 20}}])
        assert os.stat(other.path).st_mode & 0o777 == 0o600
        me = peermod.PeerBoard(tmp_path, "http://127.0.0.1:2/llama/")
        me.publish([])
        (found,) = me.others()
        assert found.pid == sleeper.pid and found.by_device() == {"cpu": 3 << 20}
        assert found.describe("cpu") == f"pid {sleeper.pid} at http://127.0.0.1:1/llama/: a:latest 3.0 MiB"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert me.others() == [] and not other.path.exists()  # its process is gone: so is its entry
    me.close()
    assert not me.path.exists()


def test_an_entry_whose_pid_another_process_now_has_is_dropped(tmp_path):
    """A manager that died without removing its entry (killed, or its machine stopped) leaves
    a PID that the kernel gives out again: the entry keeps its process's start time, so the
    process that has the PID now is not taken for it, and its memory stops counting."""
    import json

    from jupyter_llama.procs import start_time

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(sleeper.pid)
        assert isinstance(started, int) and started > 0
        entry = tmp_path / f"{peermod.PREFIX}{sleeper.pid}.json"
        me = peermod.PeerBoard(tmp_path)
        entry.write_text(json.dumps({"pid": sleeper.pid, "started": started, "url": "",
                                     "models": [{"name": "a:latest", "by_device": {"cpu": 1 << 20}}]}))
        assert [p.pid for p in me.others()] == [sleeper.pid]  # its own entry
        entry.write_text(json.dumps({"pid": sleeper.pid, "started": started - 1, "url": "",
                                     "models": [{"name": "a:latest", "by_device": {"cpu": 1 << 20}}]}))
        assert me.others() == [] and not entry.exists()  # an earlier process's entry
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_a_scheduler_announces_the_url_its_server_listens_on(engine, tmp_path):
    """The URL the other managers' messages name: given when the scheduler is made (one made
    after the server listens), or announced once it is known; either way it is published."""
    import json

    from jupyter_llama.scheduler import Scheduler, SchedulerSettings

    made = Scheduler(SchedulerSettings(binary=engine.path, peers_dir=str(tmp_path / "a"),
                                       manager_url="http://127.0.0.1:1/llama/"))
    await made._publish()
    assert json.loads(made.peers.path.read_text())["url"] == "http://127.0.0.1:1/llama/"
    later = Scheduler(SchedulerSettings(binary=engine.path, peers_dir=str(tmp_path / "b")))
    later.announce("http://127.0.0.1:2/llama/")
    await later._publish()  # (announce's own write goes first, on the board's thread)
    assert json.loads(later.peers.path.read_text())["url"] == "http://127.0.0.1:2/llama/"
    assert later.settings.manager_url == "http://127.0.0.1:2/llama/"
    for s in (made, later):
        await s.shutdown()


async def test_another_managers_models_count_against_the_users_budget(engine, make_scheduler, make_model, tmp_path):
    from jupyter_llama.client import LlamaClient
    from jupyter_llama.embedded import EmbeddedManager

    peers_dir = tmp_path / "runtime"
    a, b = make_model("peer-a", seed=41, **SHAPE), make_model("peer-b", seed=42, **SHAPE)
    other = EmbeddedManager(log_path=str(tmp_path / "serve.log"),
                            env={"JUPYTER_LLAMA_MODELS": str(tmp_path / "models"), "JUPYTER_LLAMA_SERVER": engine.path,
                                 "JUPYTER_RUNTIME_DIR": str(peers_dir), "JUPYTER_LLAMA_KEEP_ALIVE": "5m"})
    other.start(timeout=120)
    try:
        c = LlamaClient(other.url, other.token)
        c.create("peer-a", files={"a.gguf": c.create_blob(a)})
        c.generate("peer-a", "", options=OPTS, stream=False)  # loaded there
        held = next(m for m in c.ps()["models"] if m["name"] == "peer-a:latest")["by_device"]["cpu"]

        sched = make_scheduler(peers_dir=str(peers_dir), budget=int(held * 1.6))
        (peer,) = sched.peer_holdings()
        assert peer.pid == other.proc.pid and peer.by_device()["cpu"] == held
        with pytest.raises(DoesNotFit) as e:
            await sched.load(str(b), LoadOptions(**OPTS))
        msg = str(e.value)
        assert "your other jupyter-llama managers hold" in msg and f"pid {other.proc.pid}" in msg
        assert "peer-a:latest" in msg and "Unload models there" in msg
        assert sched.loaded == {}
        est = await sched.estimate(str(b), LoadOptions(**OPTS))
        assert est["fit"].verdict == "peers" and est["fit"].peers

        c.unload("peer-a")  # the other manager lets go: now it fits
        assert sched.peer_holdings()[0].by_device().get("cpu", 0) == 0
        lo = await sched.load(str(b), LoadOptions(**OPTS))
        assert lo.runner.alive
        # and the other manager sees this one's model in turn
        board = peermod.PeerBoard(peers_dir, pid=-1)
        mine = next(p for p in board.others() if p.pid == os.getpid())
        assert [m["name"] for m in mine.models] == [lo.name] and mine.by_device()["cpu"] > 0

        r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "status"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, **other.client_env(), "JUPYTER_RUNTIME_DIR": str(peers_dir)})
        assert r.returncode == 0, r.stderr
        assert f"also:    another manager of yours, pid {os.getpid()}" in r.stdout and lo.name in r.stdout
    finally:
        other.stop(timeout=30)


async def test_the_placement_leaves_what_the_other_managers_hold_out_of_a_gpu_budget(make_scheduler, make_model):
    """A shared GPU with a budget of the user's: what the user's other managers hold there is
    off the room the planner gives llama.cpp (its ``--fit-target``), as it is off the room the
    fit check measures against. So a model that fits only partly in what is left gets fewer
    layers on the GPU and loads, instead of being planned for the whole budget and refused.

    The GPU is this machine's description of one (no GPU here); the planning is the real code."""
    from jupyter_llama.memory import devices as devmod
    from jupyter_llama.memory.peers import Peer
    from jupyter_llama.memory.report import DETAILED
    from jupyter_llama.scheduler import FileResolver

    MiB, GiB = 1 << 20, 1 << 30
    path = make_model("peer-gpu", layers=8, embd=512, heads=8, kv_heads=8, ctx=2048, seed=43)
    sched = make_scheduler()
    ref = await FileResolver()(str(path))
    opts = sched.effective_options(LoadOptions(**OPTS), ref)
    gpu = devmod.GPU(0, "cuda:0", "NVIDIA H200", "GPU-aaaa", 140 * GiB, 100 * GiB, 40 * GiB)
    host = devmod.HostMemory(total=64 * GiB, available=40 * GiB)
    whole = sched.plan(ref, opts, devmod.Inventory(host, [gpu], devmod.Budgets({})), {})[1][DETAILED]
    need = whole.total(device="cuda:0")  # every layer on the GPU
    peer = Peer(4242, "http://127.0.0.1:1/llama/", [{"name": "big:latest", "by_device": {"cuda:0": 20 * GiB}}])
    inv = devmod.Inventory(host, [gpu], devmod.Budgets({"cuda:0": 20 * GiB + need // 2}))

    placed, preds = sched.plan(ref, opts, inv, {}, peermod.usage([peer]))
    # the GPU's free memory but half the need, in whole MiB rounded up (llama.cpp's room is never above the budget's)
    assert placed.fit_target_mib == (-(-(100 * GiB - need // 2) // MiB),)
    part = preds[DETAILED]
    assert 0 < part.layers_offloaded < whole.layers_offloaded
    plan = sched.fit(ref, placed, preds, inv, {}, [peer])
    assert plan.fits and plan.devices["cuda:0"]["available"] == need // 2
    assert plan.devices["cuda:0"]["need"] <= need // 2  # (the estimate the settings fit with)

    # without the other manager's 20 GiB, the same budget takes the whole model
    placed, preds = sched.plan(ref, opts, inv, {}, {})
    assert preds[DETAILED].layers_offloaded == whole.layers_offloaded


async def test_a_load_larger_than_predicted_is_held_to_the_budget_with_the_other_managers_share(
        make_scheduler, make_model, tmp_path):
    """Once a load's real size is known, the budget is enforced with what the user's other
    managers hold counted in, as the fit before it counted it: a model the estimate got badly
    wrong (here a predictor that says 1 MiB) is unloaded when it and the other manager's
    models together pass the budget, and the message says who holds the rest."""
    from jupyter_llama.memory.report import MemoryReport

    def optimistic(ref, options, gpus, split=None):
        rep = MemoryReport("coarse")
        rep.add("cpu", "weights", 1 << 20)
        return {"coarse": rep}

    GiB, MiB = 1 << 30, 1 << 20
    model = make_model("peer-enforce", seed=44, **SHAPE)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        other = peermod.PeerBoard(tmp_path, "http://127.0.0.1:1/llama/", pid=sleeper.pid)
        other.publish([{"name": "big:latest", "by_device": {"cpu": GiB - 2 * MiB}}])
        sched = make_scheduler(peers_dir=str(tmp_path), budget=GiB, fit_estimator="coarse", predictor=optimistic)
        with pytest.raises(DoesNotFit) as e:
            await sched.load(str(model), LoadOptions(**OPTS))
        msg = str(e.value)
        assert "over the budget there (your other jupyter-llama managers hold 1022.0 MiB of it)" in msg, msg
        assert sched.loaded == {}
        other.close()  # that manager lets go: the same load stays
        lo = await sched.load(str(model), LoadOptions(**OPTS))
        assert lo.runner.alive and lo.charge.total(device="cpu") > 2 * MiB
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_advice_and_the_fit_words_say_which_way_to_go():
    """Over budget on the host by its weights: more layers on devices (it said "fewer layers
    here", which for the host means the opposite); a device the verdict leaves to llama.cpp's
    --fit says so when it looks short (estimate said "fits" beside a need above what was there)."""
    from jupyter_llama.memory.report import DETAILED, HOST, WEIGHTS, MemoryReport
    from jupyter_llama.scheduler import _fit_words, _what_to_shrink

    rep = MemoryReport(DETAILED)
    rep.add(HOST, WEIGHTS, 900 << 20)
    rep.add("rpc:127.0.0.1:50052", WEIGHTS, 900 << 20)
    assert _what_to_shrink(rep, HOST, DETAILED).endswith("or put more layers on devices (num_gpu)")
    alone = MemoryReport(DETAILED)  # a machine with no GPU and no worker: no devices to name
    alone.add(HOST, WEIGHTS, 900 << 20)
    assert _what_to_shrink(alone, HOST, DETAILED, offload=False).endswith(
        "use a smaller quantisation of the model, or a smaller model")
    assert _what_to_shrink(rep, "rpc:127.0.0.1:50052", DETAILED).endswith("or put fewer layers here (num_gpu)")
    numbers = {"rpc:127.0.0.1:50052": {"need": 70 << 20, "available": 60 << 20, "in_use": 0, "budget": 60 << 20,
                                       "checked": False, "fits": True}}
    assert "not checked: llama.cpp's --fit places layers within that room" in _fit_words(numbers, "detailed+10%")
    numbers["rpc:127.0.0.1:50052"]["need"] = 50 << 20
    assert "not checked" not in _fit_words(numbers, "detailed+10%")
