"""The scheduler's decisions, tried as tables of cases on the pure policy (no engine, no process).

Each row is a situation (devices and budgets, the models loaded, what a new load needs) and
the verdict the policy must reach, with the models an eviction would take, in order, and
the words where they matter. The scenarios follow the ones Ollama's scheduler is tested on
(a model that fits; one that must evict, and whom; the loaded-model cap; a model too large
for the machine alone), with the budgets per device, the user's other managers and the
safety margin that this scheduler adds. What the loop then does with a verdict, on real
llama-server children, is judged in ``test_scheduler.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory import devices as devmod
from jupyter_llama.memory import peers as peermod
from jupyter_llama.memory import rpc
from jupyter_llama.memory.estimate import estimate_detailed, fit_layers
from jupyter_llama.memory.report import COARSE, DETAILED, HOST, KV, WEIGHTS, MemoryReport, MiB
from jupyter_llama.scheduler import policy
from jupyter_llama.scheduler.settings import SchedulerSettings
from jupyter_llama.scheduler.state import LoadedSnapshot, ModelState

GiB = 1 << 30
A, B = "10.0.0.1:50052", "10.0.0.2:50052"  # two RPC workers (never contacted: the inventory is given)
RPC_A, RPC_B = rpc.device_id(A), rpc.device_id(B)
FOREVER = math.inf
AUTO = LoadOptions(fit_target_mib=(1024,))  # automatic placement: llama.cpp's --fit places the layers
MANUAL = LoadOptions(num_gpu=99)  # layers placed by num_gpu: every device is checked


def loaded(name: str, mib: float = 100, keep_alive: float = 300, refcount: int = 0,
           state: ModelState = ModelState.READY, on: dict[str, float] | None = None) -> LoadedSnapshot:
    """A loaded model ``name`` (file /models/NAME.gguf) holding ``mib`` MiB of host memory, or
    ``on`` (device -> MiB)."""
    by_device = {d: int(m * MiB) for d, m in (on or {HOST: mib}).items()}
    return LoadedSnapshot(f"{name}:latest", f"/models/{name}.gguf", f"/models/{name}.gguf", keep_alive, refcount,
                          state, by_device)


def prediction(layers: tuple[int, int] | None = None, sources=(DETAILED, COARSE),
               **mib: float) -> dict[str, MemoryReport]:
    """Both estimates of a load, the same bytes, as weights per device (``cpu=100``,
    ``rpc_a=40``); ``kv_cpu=...`` puts that much K/V cache on the host. ``layers``: (offloaded,
    in all), as the detailed estimate placed them."""
    names = {"cpu": HOST, "rpc_a": RPC_A, "rpc_b": RPC_B, "cuda0": "cuda:0"}
    out = {}
    for source in sources:
        rep = MemoryReport(source, layers_offloaded=layers[0] if layers else None,
                           layers_total=layers[1] if layers else None)
        for k, v in mib.items():
            part, _, dev = k.rpartition("_") if k.startswith("kv_") else ("", "", k)
            rep.add(names.get(dev, dev), KV if part == "kv" else WEIGHTS, int(v * MiB))
        out[source] = rep
    return out


def inventory(cpu_free: float = 16 * 1024, budgets: dict[str, float] | None = None,
              workers: dict[str, float] | None = None, held: dict[str, str] | None = None,
              gpu_free: float | None = None) -> devmod.Inventory:
    """Host memory with ``cpu_free`` MiB available, budgets in MiB per device, RPC workers
    (endpoint -> MiB free, out of 8 GiB each) and an optional GPU cuda:0 (8 GiB)."""
    host = devmod.HostMemory(total=32 * GiB, available=int(cpu_free * MiB))
    ws = [rpc.WorkerStatus(ep, True, [rpc.WorkerDevice(rpc.device_id(ep), ep, 0, 8 * GiB, int(free * MiB))])
          for ep, free in (workers or {}).items()]
    gpus = [] if gpu_free is None else [devmod.GPU(0, "cuda:0", "a GPU", "GPU-0", 8 * GiB, int(gpu_free * MiB), 0)]
    limits = {d: int(v * MiB) for d, v in (budgets or {}).items()}
    return devmod.Inventory(host, gpus, devmod.Budgets(limits=limits), workers=ws, held=dict(held or {}))


def used_by(models: list[LoadedSnapshot]) -> dict[str, int]:
    """What the loaded models hold, per device (the loop's ``usage``)."""
    used: dict[str, int] = {}
    for m in models:
        if m.state != ModelState.GONE:
            for d, n in m.by_device.items():
                used[d] = used.get(d, 0) + n
    return used


@dataclass
class Case:
    """One situation and what the policy must decide in it."""

    id: str
    need: dict[str, float]  # MiB per device, the detailed estimate before its margin
    verdict: str
    evict: list[str] = field(default_factory=list)  # the names, in order (without ":latest")
    models: list[LoadedSnapshot] = field(default_factory=list)
    inv: devmod.Inventory = field(default_factory=inventory)
    placed: LoadOptions = AUTO
    settings: dict = field(default_factory=dict)
    peers: list[peermod.Peer] = field(default_factory=list)
    said: tuple[str, ...] = ()  # phrases the verdict's words must contain (the refusal, or the fit words)
    not_said: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None  # (offloaded, in all) in the detailed estimate
    sources: tuple[str, ...] = (DETAILED, COARSE)  # the estimates the load has

    def preds(self) -> dict[str, MemoryReport]:
        return prediction(self.layers, self.sources, **self.need)


def plan_for(case: Case) -> policy.FitPlan:
    settings = dataclasses.replace(SchedulerSettings(), **case.settings)
    return policy.fit_plan("new:latest", "/models/new.gguf", case.placed, case.preds(), case.inv,
                           used_by(case.models), case.models, settings, case.peers)


def words_of(plan: policy.FitPlan, case: Case) -> str:
    """What a person is told: the refusal for a refused load, else the fit words (with the
    eviction's reason when it evicts)."""
    if plan.verdict in ("over_budget", "peers", "refuse"):
        return policy.refusal(plan, case.preds()[plan.fit_source], bool(case.inv.accelerators()),
                              peermod.usage(case.peers))
    if plan.verdict == "evict":
        return policy.eviction_reason(plan)
    return plan.words()


CASES = [
    # ---- a model that fits
    Case("fits alone", need={"cpu": 100}, verdict="fits"),
    Case("fits beside others under the budget", need={"cpu": 100}, verdict="fits",
         models=[loaded("a", 100), loaded("b", 100)], inv=inventory(budgets={"cpu": 1024}),
         said=("cpu needs 110.0 MiB (detailed+10%), 824.0 MiB available (200.0 MiB in use by loaded models, "
               "budget 1.00 GiB)",)),
    Case("the model's own runner is neither counted nor evicted", need={"cpu": 100}, verdict="fits",
         models=[dataclasses.replace(loaded("new", 100), name="new:latest")], settings={"max_loaded_models": 1}),
    # ---- one that needs an eviction: whom, in what order
    Case("shortest keep_alive first", need={"cpu": 200}, verdict="evict", evict=["b"],
         models=[loaded("a", 200, keep_alive=600), loaded("b", 200, keep_alive=60), loaded("c", 50, keep_alive=300)],
         inv=inventory(budgets={"cpu": 500}), said=("not enough memory: cpu needs 220.0 MiB",)),
    Case("ties by model path", need={"cpu": 200}, verdict="evict", evict=["a"],
         models=[loaded("b", 200), loaded("a", 200)], inv=inventory(budgets={"cpu": 500})),
    Case("idle before busy", need={"cpu": 200}, verdict="evict", evict=["a"],
         models=[loaded("a", 200, keep_alive=600), loaded("b", 200, keep_alive=60, refcount=2)],
         inv=inventory(budgets={"cpu": 500})),
    Case("a busy one when the idle ones are not enough", need={"cpu": 400}, verdict="evict", evict=["a", "b"],
         models=[loaded("a", 200, keep_alive=600), loaded("b", 200, keep_alive=60, refcount=1)],
         inv=inventory(budgets={"cpu": 500})),
    Case("as many as it takes, and no more", need={"cpu": 250}, verdict="evict", evict=["c", "b"],
         models=[loaded("a", 100, keep_alive=900), loaded("b", 100, keep_alive=600), loaded("c", 100, keep_alive=60)],
         inv=inventory(budgets={"cpu": 450})),
    Case("pinned models are not evicted without evict_pinned", need={"cpu": 300}, verdict="refuse", evict=["u"],
         models=[loaded("p", 300, keep_alive=FOREVER), loaded("u", 100)], inv=inventory(budgets={"cpu": 500})),
    Case("pinned last, with evict_pinned", need={"cpu": 300}, verdict="evict", evict=["u", "p"],
         models=[loaded("p", 300, keep_alive=FOREVER), loaded("u", 100, keep_alive=3600)],
         inv=inventory(budgets={"cpu": 500}), settings={"evict_pinned": True}),
    Case("a loading model is counted, never evicted", need={"cpu": 300}, verdict="refuse",
         models=[loaded("l", 300, state=ModelState.LOADING)], inv=inventory(budgets={"cpu": 500})),
    Case("an unloading model is neither counted nor evicted", need={"cpu": 100}, verdict="fits",
         models=[loaded("x", 10, state=ModelState.UNLOADING)], settings={"max_loaded_models": 1}),
    # ---- the loaded-model cap
    Case("the cap evicts though memory suffices", need={"cpu": 10}, verdict="evict", evict=["b"],
         models=[loaded("a", 10, keep_alive=600), loaded("b", 10, keep_alive=60)], settings={"max_loaded_models": 2},
         said=("the loaded-model cap (2) is reached",)),
    Case("the default cap is 3 with no accelerator", need={"cpu": 10}, verdict="evict", evict=["a"],
         models=[loaded("a", 10, keep_alive=1), loaded("b", 10), loaded("c", 10)]),
    Case("the default cap is 3 per accelerator", need={"cpu": 10}, verdict="fits",
         models=[loaded(n, 10) for n in "abcde"], inv=inventory(workers={A: 4096, B: 4096})),
    Case("under the cap and short of memory: memory decides", need={"cpu": 300}, verdict="evict", evict=["a"],
         models=[loaded("a", 300)], inv=inventory(budgets={"cpu": 500}), settings={"max_loaded_models": 4}),
    # ---- alone: over a budget, peers, or the first model's try
    Case("over a budget alone", need={"cpu": 200}, verdict="over_budget", inv=inventory(budgets={"cpu": 100}),
         said=("new:latest needs 200.0 MiB on cpu by the detailed estimate, 220.0 MiB with its 10% safety margin "
               "(JUPYTER_LLAMA_SAFETY_MARGIN), but the budget there is 100.0 MiB; 200.0 MiB of it is the weights: "
               "use a smaller quantisation of the model, or a smaller model, or raise JUPYTER_LLAMA_MEMORY_LIMIT",)),
    Case("over a budget alone, with devices to offload to", need={"cpu": 200}, verdict="over_budget",
         inv=inventory(budgets={"cpu": 100}, workers={A: 4096}),
         said=("use a smaller quantisation of the model, or put more layers on devices (num_gpu)",)),
    Case("over a budget alone by its K/V cache", need={"cpu": 20, "kv_cpu": 180}, verdict="over_budget",
         inv=inventory(budgets={"cpu": 100}),
         said=("180.0 MiB of it is the K/V cache: load it with a smaller context",)),
    Case("the first model gets to try when the host is short", need={"cpu": 2048}, verdict="first",
         inv=inventory(cpu_free=1024),
         said=("cpu needs 2.20 GiB (detailed+10%: 2.00 GiB by the estimate, 204.8 MiB its safety margin), "
               "1.00 GiB available",)),
    Case("the user's other managers hold the rest of the budget", need={"cpu": 200}, verdict="peers",
         inv=inventory(budgets={"cpu": 500}),
         peers=[peermod.Peer(4242, "http://127.0.0.1:8888/llama/", [{"name": "big:latest",
                                                                      "by_device": {HOST: 400 * MiB}}])],
         said=("your other jupyter-llama managers hold 400.0 MiB of it (pid 4242 at http://127.0.0.1:8888/llama/: "
               "big:latest 400.0 MiB)", "Unload models there")),
    Case("what peers hold elsewhere does not count here", need={"cpu": 200}, verdict="fits",
         inv=inventory(budgets={"cpu": 500}),
         peers=[peermod.Peer(4242, "", [{"name": "big:latest", "by_device": {RPC_A: 400 * MiB}}])]),
    # ---- refuse: evicting everything would not help
    Case("evicting everything would not make room", need={"cpu": 400}, verdict="refuse", evict=["a"],
         models=[loaded("a", 100)], inv=inventory(budgets={"cpu": 300}),
         said=("cannot load new:latest: not enough memory: cpu needs 440.0 MiB (detailed+10%: 400.0 MiB by the "
               "estimate, 40.0 MiB its safety margin), 200.0 MiB available",
               "unloading every other model would not make room (detailed+10% estimate), so none was unloaded",
               "or unload the others yourself to let it try alone")),
    Case("the coarse estimate decides without a margin", need={"cpu": 400}, verdict="refuse", evict=["a"],
         models=[loaded("a", 100)], inv=inventory(budgets={"cpu": 300}), settings={"fit_estimator": COARSE},
         said=("cpu needs 400.0 MiB (coarse)", "(coarse estimate)")),
    # ---- need and margin said apart (issue 52: a 291 MiB model refused by a 305 MiB budget as
    # "use a smaller quantisation", when only the 10% margin, 320 MiB, did not fit)
    Case("only the margin is over a budget: said so, and how much margin fits", need={"cpu": 291},
         verdict="over_budget", inv=inventory(budgets={"cpu": 305}),
         said=("new:latest needs 291.0 MiB on cpu by the detailed estimate, 320.1 MiB with its 10% safety margin "
               "(JUPYTER_LLAMA_SAFETY_MARGIN), but the budget there is 305.0 MiB: the estimate fits, the safety "
               "margin alone does not",
               "A safety margin of 4% or less fits it (JUPYTER_LLAMA_SAFETY_MARGIN=4%; it is 10% now)",
               "or raise JUPYTER_LLAMA_MEMORY_LIMIT there to 320.1 MiB or more"),
         not_said=("quantisation", "smaller model", "smaller context")),
    Case("what peers hold counts in the margin that fits and the budget that would", need={"cpu": 291},
         verdict="over_budget", inv=inventory(budgets={"cpu": 315}),
         peers=[peermod.Peer(7, "", [{"name": "small:latest", "by_device": {HOST: 10 * MiB}}])],
         said=("the budget there is 315.0 MiB: the estimate fits, the safety margin alone does not",
               "A safety margin of 4% or less fits it", "raise JUPYTER_LLAMA_MEMORY_LIMIT there to 330.1 MiB or more")),
    Case("the margin it names fits", need={"cpu": 291}, verdict="fits", inv=inventory(budgets={"cpu": 305}),
         settings={"safety_margin": 0.04}),
    Case("one point more does not", need={"cpu": 291}, verdict="over_budget", inv=inventory(budgets={"cpu": 305}),
         settings={"safety_margin": 0.05}, said=("A safety margin of 4% or less fits it", "it is 5% now")),
    Case("no margin, no refusal", need={"cpu": 291}, verdict="fits", inv=inventory(budgets={"cpu": 305}),
         settings={"safety_margin": 0.0}),
    Case("over by the estimate itself: the model is what to shrink", need={"cpu": 291}, verdict="over_budget",
         inv=inventory(budgets={"cpu": 280}),
         said=("needs 291.0 MiB on cpu by the detailed estimate, 320.1 MiB with its 10% safety margin",
               "291.0 MiB of it is the weights: use a smaller quantisation of the model"),
         not_said=("margin alone", "margin of")),
    Case("the coarse estimate has no margin to say apart", need={"cpu": 291}, verdict="over_budget",
         inv=inventory(budgets={"cpu": 280}), settings={"fit_estimator": COARSE},
         said=("needs 291.0 MiB on cpu (coarse estimate) but the budget there is 280.0 MiB",),
         not_said=("safety margin",)),
    Case("with every other model gone only the margin would not fit", need={"cpu": 291}, verdict="refuse",
         evict=["a"], models=[loaded("a", 100)], inv=inventory(budgets={"cpu": 305}),
         said=("cpu needs 320.1 MiB (detailed+10%: 291.0 MiB by the estimate, 29.1 MiB its safety margin), "
               "205.0 MiB available",
               "With them gone the estimate would fit and the safety margin alone would not: a safety margin of "
               "4% or less fits it (JUPYTER_LLAMA_SAFETY_MARGIN=4%; it is 10% now), or raise "
               "JUPYTER_LLAMA_MEMORY_LIMIT"),
         not_said=("quantisation",)),
    Case("peers hold the rest, and the margin alone is over what is left", need={"cpu": 291}, verdict="peers",
         inv=inventory(budgets={"cpu": 505}),
         peers=[peermod.Peer(7, "", [{"name": "big:latest", "by_device": {HOST: 200 * MiB}}])],
         said=("needs 291.0 MiB on cpu by the detailed estimate, 320.1 MiB with its 10% safety margin",
               "your other jupyter-llama managers hold 200.0 MiB of it",
               "or lower the safety margin: a safety margin of 4% or less fits it")),
    Case("a margin given in the settings is the one said", need={"cpu": 100}, verdict="over_budget",
         inv=inventory(budgets={"cpu": 110}), settings={"safety_margin": 0.125},
         said=("112.5 MiB with its 12.5% safety margin", "A safety margin of 10% or less fits it")),
    Case("and that margin fits", need={"cpu": 100}, verdict="fits", inv=inventory(budgets={"cpu": 110}),
         settings={"safety_margin": 0.10}),
    # ---- several devices: host + RPC workers, with budgets
    # Automatic placement: the detailed estimate is made for the placement llama.cpp's --fit is
    # predicted to reach (pipeline parallelism included), so each worker is checked by it, as it
    # is: --fit measures each placement it tries there, and a margin would refuse every worker
    # --fit fills to its budget. (Issue 52: a plan that predicted a worker at 114.9 MiB with its
    # margin, over a 90 MiB budget, said `fits` without checking it.)
    Case("automatic placement: each worker is checked by the estimate of --fit's placement, without a margin",
         need={"cpu": 50, "rpc_a": 88, "rpc_b": 87.5}, verdict="fits", placed=AUTO, layers=(9, 9),
         inv=inventory(budgets={RPC_A: 90, RPC_B: 90}, workers={A: 4096, B: 4096}),
         said=("cpu needs 55.0 MiB (detailed+10%), 16.00 GiB available",
               f"{RPC_A} needs 88.0 MiB (detailed, as llama.cpp's --fit will place it; no safety margin: --fit "
               "measures what it places), 90.0 MiB available (0 B in use by loaded models, budget 90.0 MiB)"),
         not_said=("not checked",)),
    Case("a worker predicted over its budget under --fit is refused before loading",
         need={"cpu": 50, "rpc_a": 100, "rpc_b": 80}, verdict="over_budget", placed=AUTO, layers=(9, 9),
         inv=inventory(budgets={RPC_A: 90, RPC_B: 90}, workers={A: 4096, B: 4096}),
         said=(f"new:latest needs 100.0 MiB on {RPC_A} (detailed, as llama.cpp's --fit will place it",
               "but the budget there is 90.0 MiB: llama.cpp's --fit would leave it over the budget there. Place the "
               "layers with num_gpu (fewer on the devices), or raise JUPYTER_LLAMA_MEMORY_LIMIT there"),
         not_said=("smaller context", "safety margin of")),
    Case("layers the workers' budgets cannot hold stay on the host: a device's budget is what would fit",
         need={"cpu": 200, "rpc_a": 88, "rpc_b": 87.5}, verdict="over_budget", placed=AUTO, layers=(6, 9),
         inv=inventory(budgets={HOST: 150, RPC_A: 90, RPC_B: 90}, workers={A: 4096, B: 4096}),
         said=("new:latest needs 200.0 MiB on cpu by the detailed estimate, 220.0 MiB with its 10% safety margin",
               "200.0 MiB of it is weights: 3 of the 9 layers stay on the host, as the devices' room holds 6",
               "Raise a device's budget (JUPYTER_LLAMA_MEMORY_LIMIT) to take more layers there, or use a smaller "
               "quantisation of the model"),
         not_said=("num_gpu",)),
    Case("without a detailed estimate nothing says where --fit puts the layers: only the host is checked",
         need={"cpu": 50, "rpc_a": 100}, verdict="fits", placed=AUTO, sources=(COARSE,),
         inv=inventory(budgets={RPC_A: 90}, workers={A: 4096}),
         said=(f"{RPC_A} needs 100.0 MiB (coarse), 90.0 MiB available", "not checked: llama.cpp's --fit places")),
    Case("the coarse estimate decides the host; the workers are checked by the detailed one",
         need={"cpu": 50, "rpc_a": 100}, verdict="over_budget", placed=AUTO, settings={"fit_estimator": COARSE},
         inv=inventory(budgets={RPC_A: 90}, workers={A: 4096}), layers=(9, 9),
         said=(f"needs 100.0 MiB on {RPC_A} (detailed, as llama.cpp's --fit will place it",)),
    Case("layers placed by num_gpu: each worker is checked against its budget",
         need={"cpu": 50, "rpc_a": 100, "rpc_b": 50}, verdict="over_budget", placed=MANUAL,
         inv=inventory(budgets={RPC_A: 90, RPC_B: 90}, workers={A: 4096, B: 4096}),
         said=(f"needs 100.0 MiB on {RPC_A} by the detailed estimate, 110.0 MiB with its 10% safety margin "
               "(JUPYTER_LLAMA_SAFETY_MARGIN), but the budget there is 90.0 MiB",
               "or put fewer layers here (num_gpu)")),
    Case("a worker short by free memory, not budget, lets the first model try",
         need={"cpu": 50, "rpc_a": 100}, verdict="first", placed=MANUAL, inv=inventory(workers={A: 64})),
    Case("a budget per device: the host's is met, a worker's is not, after others",
         need={"cpu": 50, "rpc_a": 100}, verdict="refuse", placed=MANUAL, evict=["a"],
         models=[loaded("a", 100)], inv=inventory(budgets={HOST: 1024, RPC_A: 90}, workers={A: 4096})),
    Case("an evicted model's GPU memory comes back to free memory", need={"cpu": 10, "cuda0": 2048}, verdict="evict",
         evict=["g"], placed=MANUAL, models=[loaded("g", on={"cuda:0": 3072})], inv=inventory(gpu_free=1024)),
    Case("a GPU's overhead is kept free", need={"cuda0": 900}, verdict="first", placed=MANUAL,
         inv=dataclasses.replace(inventory(gpu_free=1024), budgets=devmod.Budgets(gpu_overhead=200 * MiB))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_verdict_and_the_eviction(case: Case):
    plan = plan_for(case)
    assert (plan.verdict, plan.evict) == (case.verdict, [f"{n}:latest" for n in case.evict]), plan.to_dict()
    words = words_of(plan, case)
    for phrase in case.said:
        assert phrase in words, words
    for phrase in case.not_said:
        assert phrase not in words, words
    assert plan.verdict_words and plan.to_dict()["text"] == plan.words()


# ----------------------------------------------------------------------------- the eviction order itself


def _names(models) -> list[str]:
    return [m.name.split(":")[0] for m in models]


ORDER_CASES = [
    ("shortest keep_alive first, ties by path", [loaded("c", keep_alive=60), loaded("b", keep_alive=5),
                                                 loaded("a", keep_alive=60)], False, ["b", "a", "c"]),
    ("idle before busy, then by keep_alive", [loaded("a", keep_alive=5, refcount=1), loaded("b", keep_alive=50),
                                              loaded("c", keep_alive=500)], False, ["b", "c", "a"]),
    ("pinned never, without evict_pinned", [loaded("p", keep_alive=FOREVER), loaded("a")], False, ["a"]),
    ("pinned last, idle before busy, by path", [loaded("q", keep_alive=FOREVER, refcount=1),
                                                loaded("p", keep_alive=FOREVER), loaded("r", keep_alive=FOREVER),
                                                loaded("a", refcount=3)], True, ["a", "p", "r", "q"]),
    ("only ready models", [loaded("l", state=ModelState.LOADING), loaded("u", state=ModelState.UNLOADING),
                           loaded("g", state=ModelState.GONE), loaded("r")], False, ["r"]),
    ("never the model being loaded", [loaded("new"), loaded("a")], False, ["a"]),
]


@pytest.mark.parametrize("models, evict_pinned, expected", [c[1:] for c in ORDER_CASES],
                         ids=[c[0] for c in ORDER_CASES])
def test_the_eviction_order(models, evict_pinned, expected):
    assert _names(policy.eviction_order(models, "/models/new.gguf", evict_pinned)) == expected


@pytest.mark.parametrize("victim, rule", [
    (loaded("a", keep_alive=60), "idle, shortest keep_alive (1m)"),
    (loaded("a", keep_alive=90, refcount=2), "shortest keep_alive (1m30s); busy, so it unloads when its 2 request(s) "
                                             "finish"),
    (loaded("p", keep_alive=FOREVER), "pinned, idle, shortest keep_alive (forever)"),
], ids=["idle", "busy", "pinned"])
def test_the_victims_rule_in_words(victim, rule):
    assert policy.choose_victim([victim], "/models/new.gguf", evict_pinned=True) == (victim, rule)


def test_no_victim_and_the_pinned_models_in_the_way():
    models = [loaded("q", 300, keep_alive=FOREVER), loaded("p", 300, keep_alive=FOREVER), loaded("u", 100)]
    assert policy.choose_victim(models[:2], "/models/new.gguf", evict_pinned=False) is None
    # evicting the unpinned one would not cover what is short: refuse now, naming the pinned ones by path
    pinned = policy.only_pinned_would_help(models, "/models/new.gguf", {HOST: 200 * MiB}, evict_pinned=False)
    assert _names(pinned) == ["p", "q"]
    said = policy.pinned_refusal("new:latest", "not enough memory", pinned, unpinned_first=True)
    assert "only pinned models (p:latest, q:latest) could make room" in said and "JUPYTER_LLAMA_EVICT_PINNED=1" in said
    # it would cover it, or pinned models may go: evicting goes on
    assert policy.only_pinned_would_help(models, "/models/new.gguf", {HOST: 50 * MiB}, evict_pinned=False) == []
    assert policy.only_pinned_would_help(models, "/models/new.gguf", {HOST: 200 * MiB}, evict_pinned=True) == []


# ----------------------------------------------------------------------------- room under budgets


def test_room_under_a_budget_counts_our_runners_and_the_users_other_managers():
    inv = inventory(cpu_free=1024, budgets={HOST: 500, RPC_A: 300}, workers={A: 200}, gpu_free=1000)
    cpu, worker, gpu = inv.devices()[0], inv.device(RPC_A), inv.device("cuda:0")
    assert policy.budget_room(cpu, {HOST: 100 * MiB}, {HOST: 150 * MiB}) == 250 * MiB
    assert policy.budget_room(worker, {HOST: 100 * MiB}, {HOST: 150 * MiB}) == 300 * MiB  # (the host's use, not here)
    assert policy.budget_room(cpu, {HOST: 600 * MiB}, None) == -100 * MiB  # over by that much
    assert policy.budget_room(gpu, {}, None) is None  # no budget there
    room = policy.available(inv, {HOST: 100 * MiB, RPC_A: 50 * MiB}, {HOST: 150 * MiB})
    assert room[HOST] == (250 * MiB, 500 * MiB)
    assert room[RPC_A] == (200 * MiB, 300 * MiB), "free memory caps the budget's room"
    assert room["cuda:0"] == (1000 * MiB, None)
    assert policy.available(inv, {}, None, returned={"cuda:0": 24 * MiB})["cuda:0"][0] == 1024 * MiB


def test_the_need_carries_the_margin_on_the_detailed_estimate_only():
    preds = prediction(cpu=100)
    assert policy.need(preds, DETAILED, 0.10).total() == 110 * MiB
    assert policy.need(preds, DETAILED, 0.10).source == "detailed+10%"
    assert policy.need(preds, COARSE, 0.10).total() == 100 * MiB
    assert policy.need(preds, DETAILED, 0.0) is preds[DETAILED]
    assert policy.fit_source(SchedulerSettings(fit_estimator=COARSE), preds) == COARSE
    assert policy.fit_source(SchedulerSettings(), {COARSE: preds[COARSE]}) == COARSE
    assert policy.max_loaded(SchedulerSettings(), 0) == 3 and policy.max_loaded(SchedulerSettings(), 2) == 6
    assert policy.max_loaded(SchedulerSettings(max_loaded_models=1), 4) == 1


# ----------------------------------------------------------------------------- placement


@pytest.fixture(scope="module")
def info(make_model):
    from jupyter_llama.models.gguf_info import read_gguf_info

    return read_gguf_info(str(make_model("policy", layers=8, embd=128, heads=4, kv_heads=2, ctx=2048)))


def test_placement_with_num_gpu_0_uses_no_device(info):
    where = policy.placement(info, LoadOptions(num_gpu=0), inventory(workers={A: 4096}), {})
    assert where.devices == () and where.split is None
    assert where.options.rpc is None and where.options.fit_target_mib is None


def test_placement_with_num_gpu_splits_by_free_memory_over_the_free_workers(info):
    inv = inventory(workers={A: 1000, B: 3000})
    where = policy.placement(info, LoadOptions(num_gpu=4), inv, {})
    assert where.devices == (RPC_A, RPC_B) and where.split == (1000.0 * MiB, 3000.0 * MiB)
    assert where.options.rpc == (A, B) and where.options.fit_target_mib is None
    held = dataclasses.replace(inv, held={A: "other:latest"})  # a worker serves one client: not this one
    assert policy.placement(info, LoadOptions(num_gpu=4), held, {}).options.rpc == (B,)


def test_automatic_placement_leaves_free_what_the_budget_does_not_give(info):
    """The room under each worker's budget becomes --fit-target: llama.cpp must leave the rest
    of the worker free (at least 1 GiB, llama.cpp's own default)."""
    inv = inventory(budgets={RPC_A: 300}, workers={A: 4096, B: 4096})
    where = policy.placement(info, LoadOptions(), inv, {RPC_A: 100 * MiB})
    assert where.options.fit_target_mib == (4096 - 200, 1024)
    assert where.options.rpc == (A, B) and where.devices == (RPC_A, RPC_B)


@pytest.fixture(scope="module")
def wide(make_model):
    """The model of issue 52's scenario: 8 GQA layers of Q4_0 weights, 12 to 14 MiB a layer at
    a 2048-token context, a 32000-token vocabulary."""
    from jupyter_llama.models.gguf_info import read_gguf_info

    return read_gguf_info(str(make_model("policy-wide", layers=8, embd=1024, heads=16, kv_heads=4, vocab=32000,
                                         ctx=4096, type="q4_0", seed=4)))


def _by_device(info, where: policy.Placement) -> dict[str, int]:
    rep = estimate_detailed(info, where.options, list(where.devices), split=where.split)
    return {d: rep.total(device=d) for d in where.devices}


@pytest.mark.parametrize("budget, plain_over", [
    # the issue's case: --fit alone fills the last worker to 7 layers and the first to 2; all 9
    # offloaded turns pipeline parallelism on, and the last worker grows past its budget
    (90, True),
    (82, True),  # the raised target leaves a layer on the host, which keeps pipeline parallelism off
    (64, True),  # the last worker grows when the first takes the layers before it from the host
    (100, False),  # the default split (by free memory) fits: nothing to raise
    (40, False),
])
def test_automatic_placement_keeps_every_worker_within_its_budget(wide, budget, plain_over):
    """The placement predicts what llama.cpp's --fit does with each --fit-target, pipeline
    parallelism included, and raises the target of a worker --fit would leave over its room
    until none is: every worker's predicted use is then within its budget."""
    options = LoadOptions(num_ctx=2048)
    inv = inventory(budgets={RPC_A: budget, RPC_B: budget}, workers={A: 4096, B: 4096})
    where = policy.placement(wide, options, inv, {})
    assert all(n <= budget * MiB for n in _by_device(wide, where).values()), _by_device(wide, where)
    assert where.rooms == {RPC_A: budget * MiB, RPC_B: budget * MiB}
    # what --fit would do with the budgets alone as its targets
    accel = inv.accelerators()
    split = fit_layers(wide, options, [(d.id, budget * MiB) for d in accel], free=[d.free for d in accel])
    plain = estimate_detailed(wide, options, [d.id for d in accel], split=split)
    assert any(plain.total(device=d.id) > budget * MiB for d in accel) == plain_over
    plain_targets = (4096 - budget, 4096 - budget)
    assert (where.options.fit_target_mib != plain_targets) == plain_over


def test_the_issue_case_is_planned_within_the_budgets_and_refused_when_the_host_cannot_take_the_rest(wide):
    options = LoadOptions(num_ctx=2048)
    settings = SchedulerSettings()
    inv = inventory(budgets={RPC_A: 90, RPC_B: 90}, workers={A: 4096, B: 4096})
    where = policy.placement(wide, options, inv, {})
    preds = {DETAILED: estimate_detailed(wide, where.options, list(where.devices), split=where.split)}
    plan = policy.fit_plan("wide:latest", "/models/wide.gguf", where.options, preds, inv, {}, [], settings)
    assert plan.verdict == "fits" and all(r["checked"] for r in plan.devices.values())
    assert plan.devices[RPC_A]["fitted"] and plan.devices[RPC_A]["need"] <= 90 * MiB
    # Smaller budgets leave layers on the host; with a host budget too small for them, the load is
    # refused before it starts, naming the layers the workers cannot take.
    inv = inventory(budgets={RPC_A: 40, RPC_B: 40, HOST: 60}, workers={A: 4096, B: 4096})
    where = policy.placement(wide, options, inv, {})
    preds = {DETAILED: estimate_detailed(wide, where.options, list(where.devices), split=where.split)}
    plan = policy.fit_plan("wide:latest", "/models/wide.gguf", where.options, preds, inv, {}, [], settings)
    assert plan.verdict == "over_budget" and plan.layers[0] < plan.layers[1]
    said = policy.refusal(plan, preds[DETAILED], True)
    assert f"layers stay on the host, as the devices' room holds {plan.layers[0]}" in said, said
    assert "Raise a device's budget (JUPYTER_LLAMA_MEMORY_LIMIT)" in said and "num_gpu" not in said


def test_a_worker_left_without_layers_is_left_out_and_the_fit_is_made_without_it(wide):
    """With worker A's budget too small for a layer, llama.cpp would put every layer on worker
    B: listed beside A, that turns pipeline parallelism on (over B's budget); A is left out of
    --rpc, so B is the only device, pipeline parallelism stays off, and every layer fits there
    as it is."""
    options = LoadOptions(num_ctx=2048)
    inv = inventory(budgets={RPC_A: 5, RPC_B: 120}, workers={A: 4096, B: 4096})
    alone = estimate_detailed(wide, options, [RPC_B]).total(device=RPC_B)
    beside = estimate_detailed(wide, options, [RPC_A, RPC_B], split=[0.0, 9.0]).total(device=RPC_B)
    assert alone <= 120 * MiB < beside
    where = policy.placement(wide, options, inv, {})
    assert where.devices == (RPC_B,) and where.options.rpc == (B,)
    assert where.options.fit_target_mib == (4096 - 120,)
    rep = estimate_detailed(wide, where.options, list(where.devices), split=where.split)
    assert rep.layers_offloaded == rep.layers_total == 9 and rep.total(device=RPC_B) == alone
