"""llama-fit-params: command line, output parsing and failure handling (fake binaries)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory import fitparams as fp
from jupyter_llama.memory.report import COMPUTE, KV, LLAMA_CPP, WEIGHTS, MiB

SAMPLE = """\
0.00.017.430 I llama_fit_params: printing estimated memory in MiB to stdout (device, model, context, compute) ...
CUDA0 3904 512 304
CUDA1 1200 128 300
Host 281 0 24
"""


def fake_binary(tmp_path: Path, script: str, name: str = "llama-fit-params") -> Path:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + script + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


FITTED = "-c 2048 -ngl 7 -ts 2,5"
# A fake llama-fit-params: the fit prints a placement, the projection prints SAMPLE; each run's
# command line is appended to ARGV_LOG beside it.
TOOL = f"""echo "$@" >> "$(dirname "$0")/argv.log"
case " $* " in
  *" --fit-print on "*) printf '{SAMPLE}' ;;
  *) echo '{FITTED}' ;;
esac"""


def test_argv_mirrors_server_options():
    o = LoadOptions(num_ctx=1024, num_parallel=2, num_gpu=10, main_gpu=1, num_batch=1024, num_ubatch=256,
                    flash_attn="on", cache_type_k="q8_0", cache_type_v="q8_0", kv_unified=True, num_thread=3)
    argv = fp.fit_params_argv("/x/llama-fit-params", "/m/model.gguf", o)
    assert argv[:6] == ["/x/llama-fit-params", "--model", "/m/model.gguf", "--fit-print", "on", "--log-jsonl"]
    pairs = dict(zip(argv[6::2], argv[7::2], strict=True))
    assert pairs == {"-c": "2048", "-np": "2", "-ngl": "10", "-mg": "1", "-b": "1024", "-ub": "256", "-fa": "on",
                     "-ctk": "q8_0", "-ctv": "q8_0"}
    # automatic options pass nothing (the tool has no -kvu; its default is one slot)
    assert fp.fit_params_argv("b", "m", LoadOptions()) == ["b", "--model", "m", "--fit-print", "on", "--log-jsonl"]
    # the placement a fit chose comes last, so that it is what the projection is made for
    assert fp.fit_params_argv("b", "m", LoadOptions(num_ctx=512), ["-c", "512", "-ngl", "3"])[-4:] == \
        ["-c", "512", "-ngl", "3"]


def test_the_fit_gets_what_llama_server_gets_targets_included():
    placed = LoadOptions(num_ctx=1024, num_parallel=1, rpc=("10.0.0.1:50052", "10.0.0.2:50052"),
                         fit_target_mib=(4000, 4010))
    argv = fp.fit_argv("b", "m", placed)
    assert argv[:3] == ["b", "--model", "m"] and "--fit-print" not in argv
    assert argv[argv.index("--rpc") + 1] == "10.0.0.1:50052,10.0.0.2:50052"
    assert argv[-2:] == ["--fit-target", "4000,4010"]
    assert "--fit-target" not in fp.fit_argv("b", "m", placed.replace(num_gpu=3))  # (llama-server gets none either)
    assert fp.fit_argv("b", "m", placed.replace(fit=False)) is None  # -fit off: llama-server does not fit


@pytest.mark.parametrize("printed, flags", [
    ("-c 2048 -ngl -1\n", ["-c", "2048", "-ngl", "-1"]),
    ("log line\n-c 4096 -ngl 7 -ts 2,5\n", ["-c", "4096", "-ngl", "7", "-ts", "2,5"]),
    ('-c 4096 -ngl 30 -ts 10,20 -ot "blk\\.3\\.ffn_(up|down).*=CPU"\n',
     ["-c", "4096", "-ngl", "30", "-ts", "10,20", "-ot", "blk\\.3\\.ffn_(up|down).*=CPU"]),
    ("Host 3 1 4\n", None),
])
def test_the_placement_a_fit_printed(printed, flags):
    assert fp.parse_fitted(printed) == flags


def test_parse_fit_print():
    rep = fp.parse_fit_print(SAMPLE)
    assert rep.source == LLAMA_CPP
    assert rep.get("cuda:0", WEIGHTS) == 3904 * MiB and rep.get("cuda:0", KV) == 512 * MiB
    assert rep.get("cuda:0", COMPUTE) == 304 * MiB
    assert rep.get("cuda:1", WEIGHTS) == 1200 * MiB
    assert rep.get("cpu", WEIGHTS) == 281 * MiB and rep.get("cpu", KV) == 0 and rep.get("cpu", COMPUTE) == 24 * MiB
    assert rep.total() == (3904 + 512 + 304 + 1200 + 128 + 300 + 281 + 24) * MiB
    # the note says what it counts differently from llama-server
    assert any("logits of a whole micro-batch" in w and "output buffer" in w and "whole MiB" in w
               and "CPU_REPACK" in w for w in rep.warnings)
    assert fp.parse_fit_print("no figures here\n") is None
    assert fp.parse_fit_print("Host 3 1 4 \n").total() == 8 * MiB  # trailing space as the tool prints it
    # RPC devices, numbered by the tool, are the workers of --rpc in their order (they were rows "rpc0", "rpc1"
    # beside the workers' own, splitting each device in two in every table and plot)
    rpc = fp.parse_fit_print("RPC0 20 1 3\nRPC1 30 2 4\nHost 10 0 5\n", ("127.0.0.1:50152", "10.0.0.2:50052"))
    assert set(rpc.by_device()) == {"rpc:127.0.0.1:50152", "rpc:10.0.0.2:50052", "cpu"}
    assert rpc.total(device="rpc:10.0.0.2:50052") == 36 * MiB


def test_the_weights_the_cpu_repacks_count_in_host_memory():
    """The tool's per-device lines leave out buffers of no device; its memory breakdown
    (--log-jsonl) names them, and llama-server allocates them in host memory."""
    printed = ('{"type":"log","msg":"x"}\n'
               '{"type":"fit_memory_breakdown","data":{"unit":"MiB","rows":[{"kind":"host","name":"Host","self":102,'
               '"model":13,"context":16,"compute":73},{"kind":"buffer_type","name":"CPU_REPACK","self":40,"model":40,'
               '"context":0,"compute":0}]}}\nHost 13 16 73 \n')
    rep, extra = fp.parse_projection(printed)
    assert rep.get("cpu", WEIGHTS) == (13 + 40) * MiB and rep.total() == (13 + 40 + 16 + 73) * MiB
    assert [r["name"] for r in extra] == ["CPU_REPACK"]


def test_run_fits_then_projects_the_placement_it_chose(tmp_path):
    b = fake_binary(tmp_path, TOOL)
    placed = LoadOptions(num_ctx=512, num_parallel=1, fit_target_mib=(3000, 2000))
    res = fp.run_fit_params(b, tmp_path / "m.gguf", placed)
    assert res.error is None and res.returncode == 0 and res.fitted == FITTED.split()
    assert res.report.get("cuda:0", WEIGHTS) == 3904 * MiB
    fit, projection = (tmp_path / "argv.log").read_text().splitlines()
    assert fit.endswith("--fit-target 3000,2000") and "--fit-print" not in fit
    assert projection.endswith("--fit-print on --log-jsonl -c 512 -np 1 " + FITTED)
    assert fp.project(b, tmp_path / "m.gguf", LoadOptions()).total() > 0


def test_a_fit_that_finds_no_placement_projects_the_load_as_asked(tmp_path):
    b = fake_binary(tmp_path, f"""case " $* " in *" --fit-print on "*) printf '{SAMPLE}' ;; *) exit 1 ;; esac""")
    res = fp.run_fit_params(b, tmp_path / "m.gguf", LoadOptions(num_ctx=512))
    assert res.report is not None and res.fitted == []
    assert any("found no placement" in w for w in res.report.warnings)
    # with -fit off llama-server does not fit, and neither does the projection
    off = fake_binary(tmp_path, f"printf '{SAMPLE}'", "off")
    assert fp.run_fit_params(off, tmp_path / "m.gguf", LoadOptions(fit=False)).report is not None


def test_failures_give_none_and_never_raise(tmp_path, caplog):
    failing = fake_binary(tmp_path, "echo 'error: failed to load model' >&2; exit 3", "fail")
    res = fp.run_fit_params(failing, "m.gguf", LoadOptions())
    assert res.report is None and res.returncode == 3 and "failed to load model" in res.error
    silent = fake_binary(tmp_path, "echo nothing", "silent")
    assert fp.run_fit_params(silent, "m.gguf", LoadOptions()).error == "llama-fit-params printed no memory figures"
    missing = fp.run_fit_params(tmp_path / "absent", "m.gguf", LoadOptions())
    assert missing.report is None and "cannot run" in missing.error
    with caplog.at_level("WARNING"):
        assert fp.project(failing, "m.gguf", LoadOptions()) is None
        assert fp.project(None, "m.gguf", LoadOptions()) is None
    assert "unavailable" in caplog.text


# ----------------------------------------------------------------------------- shown, or not


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Headers of two synthetic models: a small vocabulary beside wide layers, and a large one."""
    from jupyter_llama.models.gguf_info import read_gguf_info
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    root = tmp_path_factory.mktemp("fitparams")
    shapes = {"deep": SynthShape(layers=2, embd=1536, heads=12, kv_heads=4, ff=4096, vocab=2000, type="q4_0"),
              "vocab": SynthShape(layers=2, embd=256, heads=4, kv_heads=2, vocab=32000, type="q4_0")}
    return {k: read_gguf_info(write_synthetic(root / f"{k}.gguf", v)) for k, v in shapes.items()}


def _projection(**mib) -> fp.MemoryReport:
    rep = fp.MemoryReport(LLAMA_CPP)
    for dev, (w, kv, c) in mib.items():
        rep.set(dev, WEIGHTS, w * MiB)
        rep.set(dev, KV, kv * MiB)
        rep.set(dev, COMPUTE, c * MiB)
    return rep


REPACK = [{"kind": "buffer_type", "name": "CPU_REPACK", "model": 100, "context": 0, "compute": 0}]


@pytest.mark.parametrize("model, options, figures, extra, fitted, said", [
    # a 32000-token vocabulary: the logits of 511 rows are 62 MiB of a 100 MiB figure
    ("vocab", LoadOptions(num_ctx=2048, num_parallel=1), {"cpu": (20, 16, 64)}, [], [],
     "reserves its graph for 511 more output rows than llama-server"),
    # wide layers, a small vocabulary: the feed-forward peak outweighs the logits; shown
    ("deep", LoadOptions(num_ctx=2048, num_parallel=1), {"cpu": (200, 24, 40)}, [], [], None),
    # ... unless its figures are a few MiB, where whole MiB are too coarse
    ("deep", LoadOptions(num_ctx=2048, num_parallel=1), {"cpu": (12, 2, 6)}, [], [], "whole MiB, rounded down"),
    # weights the CPU repacks, with the file mapped: llama-server holds them twice
    ("deep", LoadOptions(num_ctx=2048, num_parallel=1), {"cpu": (101, 24, 40)}, REPACK, [], "maps the model file"),
    ("deep", LoadOptions(num_ctx=2048, num_parallel=1, use_mmap=False), {"cpu": (101, 24, 40)}, REPACK, [], None),
    # logits over and repacked weights under do not cancel: how much of them the mapping holds
    # is not known, so the worse end counts
    ("vocab", LoadOptions(num_ctx=1024, num_parallel=1), {"cpu": (110, 6, 74)}, REPACK, [],
     "more output rows than llama-server"),
    # a worker holding only the last layer and the output: its part of the graph peaks at the
    # rows the tool reserves and llama-server does not
    ("deep", LoadOptions(num_ctx=2048, num_parallel=1, rpc=("10.0.0.1:1", "10.0.0.2:1")),
     {"cpu": (60, 8, 30), "rpc:10.0.0.1:1": (60, 8, 20), "rpc:10.0.0.2:1": (30, 8, 12)}, [],
     ["-c", "2048", "-ngl", "2", "-ts", "1,1"], "of its 50.0 MiB on rpc:10.0.0.2:1"),
], ids=["logits", "shown", "rounding", "mapped", "not-mapped", "no-cancelling", "output-device"])
def test_the_projection_is_shown_only_where_it_describes_the_load(models, model, options, figures, extra, fitted,
                                                                  said):
    rep = _projection(**figures)
    reason = fp.withheld(rep, models[model], options, extra, fitted)
    if said is None:
        assert reason is None
    else:
        assert reason is not None and said in reason, reason


def test_timeout_kills_the_tool(tmp_path):
    slow = fake_binary(tmp_path, "sleep 30", "slow")
    t0 = time.monotonic()
    res = fp.run_fit_params(slow, "m.gguf", LoadOptions(), timeout=0.5)
    assert res.report is None and "did not finish" in res.error
    assert time.monotonic() - t0 < 10


async def test_async_variant(tmp_path):
    b = fake_binary(tmp_path, TOOL)
    rep = await fp.project_async(b, "m.gguf", LoadOptions(num_ctx=512))
    assert rep is not None and rep.get("cpu", COMPUTE) == 24 * MiB
    slow = fake_binary(tmp_path, "sleep 30", "slow")
    t0 = time.monotonic()
    res = await fp.run_fit_params_async(slow, "m.gguf", LoadOptions(), timeout=0.5)
    assert res.report is None and "did not finish" in res.error
    assert time.monotonic() - t0 < 10
    assert await fp.project_async(tmp_path / "absent", "m.gguf", LoadOptions()) is None


async def test_async_cancellation_kills_the_tool(tmp_path):
    pidfile = tmp_path / "pid"
    slow = fake_binary(tmp_path, f"echo $$ > {pidfile}; exec sleep 30", "slow")
    task = asyncio.create_task(fp.run_fit_params_async(slow, "m.gguf", LoadOptions(), timeout=20))
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        await asyncio.sleep(0.05)
    pid = int(pidfile.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
