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
from jupyter_llama.memory.report import COMPUTE, KV, LLAMA_CPP, MiB, WEIGHTS

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


def test_argv_mirrors_server_options():
    o = LoadOptions(num_ctx=1024, num_parallel=2, num_gpu=10, main_gpu=1, num_batch=1024, num_ubatch=256,
                    flash_attn="on", cache_type_k="q8_0", cache_type_v="q8_0", kv_unified=True, num_thread=3)
    argv = fp.fit_params_argv("/x/llama-fit-params", "/m/model.gguf", o)
    assert argv[:5] == ["/x/llama-fit-params", "--model", "/m/model.gguf", "--fit-print", "on"]
    pairs = dict(zip(argv[5::2], argv[6::2]))
    assert pairs == {"-c": "2048", "-np": "2", "-ngl": "10", "-mg": "1", "-b": "1024", "-ub": "256", "-fa": "on",
                     "-ctk": "q8_0", "-ctv": "q8_0"}
    # automatic options pass nothing (the tool has no -kvu; its default is one slot)
    assert fp.fit_params_argv("b", "m", LoadOptions()) == ["b", "--model", "m", "--fit-print", "on"]


def test_parse_fit_print():
    rep = fp.parse_fit_print(SAMPLE)
    assert rep.source == LLAMA_CPP
    assert rep.get("cuda:0", WEIGHTS) == 3904 * MiB and rep.get("cuda:0", KV) == 512 * MiB
    assert rep.get("cuda:0", COMPUTE) == 304 * MiB
    assert rep.get("cuda:1", WEIGHTS) == 1200 * MiB
    assert rep.get("cpu", WEIGHTS) == 281 * MiB and rep.get("cpu", KV) == 0 and rep.get("cpu", COMPUTE) == 24 * MiB
    assert rep.total() == (3904 + 512 + 304 + 1200 + 128 + 300 + 281 + 24) * MiB
    assert rep.warnings  # says the figures are rounded down
    assert fp.parse_fit_print("no figures here\n") is None
    assert fp.parse_fit_print("Host 3 1 4 \n").total() == 8 * MiB  # trailing space as the tool prints it
    # RPC devices, numbered by the tool, are the workers of --rpc in their order (they were rows "rpc0", "rpc1"
    # beside the workers' own, splitting each device in two in every table and plot)
    rpc = fp.parse_fit_print("RPC0 20 1 3\nRPC1 30 2 4\nHost 10 0 5\n", ("127.0.0.1:50152", "10.0.0.2:50052"))
    assert set(rpc.by_device()) == {"rpc:127.0.0.1:50152", "rpc:10.0.0.2:50052", "cpu"}
    assert rpc.total(device="rpc:10.0.0.2:50052") == 36 * MiB


def test_run_parses_a_fake_tool(tmp_path):
    b = fake_binary(tmp_path, f"printf '{SAMPLE}'; echo log >&2")
    res = fp.run_fit_params(b, tmp_path / "m.gguf", LoadOptions(num_ctx=512))
    assert res.error is None and res.returncode == 0
    assert res.report.get("cuda:0", WEIGHTS) == 3904 * MiB
    assert fp.project(b, tmp_path / "m.gguf", LoadOptions()).total() > 0


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


def test_timeout_kills_the_tool(tmp_path):
    slow = fake_binary(tmp_path, "sleep 30", "slow")
    t0 = time.monotonic()
    res = fp.run_fit_params(slow, "m.gguf", LoadOptions(), timeout=0.5)
    assert res.report is None and "did not finish" in res.error
    assert time.monotonic() - t0 < 10


async def test_async_variant(tmp_path):
    b = fake_binary(tmp_path, f"printf '{SAMPLE}'")
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
