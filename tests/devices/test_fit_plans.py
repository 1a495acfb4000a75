"""Plans that hold, on real devices: two ggml-rpc-server workers with budgets (issue 52).

llama.cpp's --fit fills the workers one at a time from the last; when the first worker's share
makes every layer offloaded, pipeline parallelism turns on and the compute buffers grow on
every device, which --fit does not measure again. The scheduler predicts that and gives
--fit targets that leave room for it, so the load lands within the budgets; a load the
budgets cannot hold is refused before any child starts, naming what would fit.
"""

from __future__ import annotations

import pytest

from jupyter_llama.errors import DoesNotFit
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.report import DETAILED, HOST, MiB
from jupyter_llama.scheduler import EventKind

pytestmark = pytest.mark.engine

# The model: 8 GQA layers of Q4_0 weights (12 to 14 MiB a layer on a worker at this
# context), a 32000-token vocabulary; at 90 MiB a worker, llama.cpp's --fit alone put 7 layers
# on the last worker and 2 on the first, and the last one ended 13 MiB over its budget.
WIDE = dict(layers=8, embd=1024, heads=16, kv_heads=4, vocab=32000, ctx=4096, type="q4_0", seed=4)
OPTS = LoadOptions(num_ctx=2048)


@pytest.fixture
def wide(make_model):
    return str(make_model("wide-q4_0", **WIDE))


async def test_every_layer_offloaded_lands_within_the_workers_budgets(workers, make_scheduler, wide):
    a, b = workers(2)
    sched = make_scheduler([a, b], {a.id: 90 * MiB, b.id: 90 * MiB})
    est = await sched.estimate(wide, OPTS)
    fit = est["fit"]
    assert fit.verdict == "fits" and all(r["checked"] for r in fit.devices.values()), fit.words()
    lo = await sched.load(wide, OPTS)
    used = lo.actual.by_device()
    assert used[a.id] <= 90 * MiB and used[b.id] <= 90 * MiB, used
    assert used[HOST] > 0
    # the placement --fit reached is the predicted one: every layer offloaded (pipeline
    # parallelism on), each worker's figure as predicted
    assert lo.actual.layers_offloaded == lo.actual.layers_total == 9
    pred = lo.predictions[DETAILED]
    for dev in (HOST, a.id, b.id):
        assert pred.total(device=dev) == pytest.approx(used[dev], abs=0.05 * MiB), dev
    argv = lo.runner.argv
    assert argv[argv.index("--fit-target") + 1] == ",".join(str(t) for t in lo.options.fit_target_mib)


async def test_a_load_the_budgets_cannot_hold_is_refused_before_any_child_starts(workers, make_scheduler, wide):
    a, b = workers(2)
    sched = make_scheduler([a, b], {a.id: 40 * MiB, b.id: 40 * MiB, HOST: 60 * MiB})
    with pytest.raises(DoesNotFit) as refused:
        await sched.load(wide, OPTS)
    said = str(refused.value)
    assert "on cpu by the detailed estimate" in said and "but the budget there is 60.0 MiB" in said, said
    assert "layers stay on the host, as the devices' room holds" in said, said
    assert "Raise a device's budget (JUPYTER_LLAMA_MEMORY_LIMIT)" in said, said
    assert not [e for e in sched.events.history if e.kind == EventKind.LOAD], "no child was started"
    assert sched.ps() == []
