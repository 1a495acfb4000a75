"""The runner against real llama-server children on synthetic models."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from jupyter_llama.engine.launch import build_argv
from jupyter_llama.engine.runner import LoadError, Runner, RunnerCrashed
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.report import COMPUTE, KV, OUTPUT, WEIGHTS, MiB
from jupyter_llama.procs import process_alive

pytestmark = pytest.mark.engine


async def test_start_health_and_text(start_runner, tiny_model):
    r = await start_runner(tiny_model)
    assert r.state == "ready" and r.alive
    assert await r.health()
    text, timings = await r.complete_text("Once upon a time", n_predict=12, temperature=0)
    assert text.strip(), "a synthetic model still returns text"
    assert timings["predicted_n"] >= 1
    # The child is reachable only with its own key.
    async with httpx.AsyncClient(trust_env=False) as c:
        denied = await c.post(r.url + "/completion", json={"prompt": "x", "n_predict": 1})
    assert denied.status_code == 401


async def test_api_key_never_on_command_line(start_runner, tiny_model):
    r = await start_runner(tiny_model)
    with open(f"/proc/{r.pid}/cmdline", "rb") as f:
        cmdline = f.read().decode()
    assert r.api_key and r.api_key not in cmdline
    assert "--api-key" not in cmdline
    assert "--host\x00127.0.0.1" in cmdline
    with open(f"/proc/{r.pid}/environ", "rb") as f:
        assert f"LLAMA_API_KEY={r.api_key}".encode() in f.read()


async def test_parsed_memory_equals_the_childs_own_log(start_runner, tiny_model):
    r = await start_runner(tiny_model, LoadOptions(num_ctx=1024, num_parallel=1))
    rep = r.memory()
    log = "\n".join(r.parser.lines)

    def mib(pattern: str) -> float:
        values = [float(v) for v in re.findall(pattern, log)]
        assert values, f"no line matches {pattern!r} in the child's log"
        return sum(values)

    assert rep.total(component=WEIGHTS) == pytest.approx(mib(r"model buffer size =\s+([\d.]+) MiB") * MiB, abs=8)
    assert rep.total(component=KV) == pytest.approx(mib(r"KV buffer size =\s+([\d.]+) MiB") * MiB, abs=8)
    assert rep.total(component=COMPUTE) == pytest.approx(mib(r"compute buffer size =\s+([\d.]+) MiB") * MiB, abs=8)
    assert rep.total(component=OUTPUT) == pytest.approx(mib(r"output buffer size =\s+([\d.]+) MiB") * MiB, abs=8)
    assert rep.devices == ["cpu"]
    assert rep.n_ctx == 1024


async def test_kv_grows_linearly_with_context(start_runner, tiny_model):
    kv = {}
    for ctx in (512, 1024, 2048):
        r = await start_runner(tiny_model, LoadOptions(num_ctx=ctx, num_parallel=1))
        kv[ctx] = r.memory().total(component=KV)
        await r.stop()
    assert kv[512] > 0
    assert kv[1024] == pytest.approx(2 * kv[512], rel=0.01)
    assert kv[2048] == pytest.approx(4 * kv[512], rel=0.01)


async def test_num_gpu_argv_and_offload_report(start_runner, tiny_model, engine):
    auto = build_argv(engine.path, tiny_model, LoadOptions(), port=1)
    cpu = build_argv(engine.path, tiny_model, LoadOptions(num_gpu=0), port=1)
    some = build_argv(engine.path, tiny_model, LoadOptions(num_gpu=3), port=1)
    assert "-ngl" not in auto  # automatic: llama.cpp's --fit decides
    assert cpu[cpu.index("-ngl") + 1] == "0"
    assert some[some.index("-ngl") + 1] == "3"
    assert LoadOptions(num_gpu=-1).num_gpu is None  # Ollama's -1 is automatic

    r_auto = await start_runner(tiny_model, LoadOptions(num_ctx=512))
    r_cpu = await start_runner(tiny_model, LoadOptions(num_ctx=512, num_gpu=0))
    for r in (r_auto, r_cpu):
        offload_lines = [ln for ln in r.parser.lines if "offloaded" in ln and "layers to GPU" in ln]
        if engine.backend in (None, "cpu") and not any("using device" in ln for ln in r.parser.lines):
            # A plain CPU build prints no offload lines (REFERENCE section 2); one with the RPC
            # backend compiled in prints "offloaded N/N" with no device used: nothing is offloaded.
            assert offload_lines == [] or r.memory().layers_offloaded is None
        else:
            m = re.search(r"offloaded (\d+)/(\d+) layers", offload_lines[-1])
            assert (r.parser.layers_offloaded, r.parser.layers_total) == (int(m.group(1)), int(m.group(2)))
        assert r.memory().gpu_total == 0  # nothing on a GPU on this machine


async def test_a_serving_childs_log_is_read_whole_and_in_order_and_its_exit_at_once(start_runner, tiny_model,
                                                                                       monkeypatch):
    """Once serving, the child logs ~40 lines for each request, a line at a time, and they are
    read in batches (see Runner._read_log): every request's lines still arrive, in order, and
    when the child exits the rest is read at once, however long the pause between reads."""
    from jupyter_llama.engine import runner as runmod

    r = await start_runner(tiny_model, LoadOptions(num_ctx=512, num_parallel=1))
    loop = asyncio.get_running_loop()
    before = r.parser.n_lines
    for _ in range(4):
        await r.complete_text("Once upon a time", n_predict=4, temperature=0)
    deadline = loop.time() + 10
    while sum(1 for ln in list(r.parser.lines)[-400:] if "stop processing" in ln) < 4 and loop.time() < deadline:
        await asyncio.sleep(0.02)
    seen = list(r.parser.lines)[-(r.parser.n_lines - before):]
    stops = [i for i, ln in enumerate(seen) if "stop processing" in ln]
    assert len(stops) >= 4, "every request's lines arrive"
    assert r.parser.n_lines - before >= 4 * 10
    # in order: each request's "stop processing" comes after its own "new prompt" line
    starts = [i for i, ln in enumerate(seen) if "new prompt" in ln or "launch_slot_" in ln]
    assert starts and all(any(s < t for s in starts) for t in stops), seen[:60]
    # its exit ends a pause far longer than the wait below: the reader reads to the end and stops
    monkeypatch.setattr(runmod, "LOG_READ_EVERY_S", 600.0)
    n = r.parser.n_lines
    await r.complete_text("Once upon a time", n_predict=2, temperature=0)
    while r.parser.n_lines == n and loop.time() < deadline + 10:  # read, and now in a long pause
        await asyncio.sleep(0.02)
    assert r.parser.n_lines > n
    n = r.parser.n_lines
    await r.complete_text("Once upon a time", n_predict=2, temperature=0)  # its lines wait in the pipe
    while r.proc.output_waiting() == 0 and loop.time() < deadline + 20:
        await asyncio.sleep(0.02)
    assert r.proc.output_waiting() > 0 and r.parser.n_lines == n
    os.kill(r.pid, signal.SIGKILL)
    await asyncio.wait_for(r._exited.wait(), 10)
    assert r.parser.n_lines > n  # read to the end


async def test_child_killed_mid_stream_gives_clear_error(start_runner, tiny_model):
    # A context long enough that the answer is still being generated when the child dies.
    r = await start_runner(tiny_model, LoadOptions(num_ctx=4096, num_parallel=1))
    got = []
    with pytest.raises(RunnerCrashed, match="unexpectedly stopped"):
        async for chunk in r.completion("Tell me a story", n_predict=100000, temperature=1.0, ignore_eos=True):
            got.append(chunk)
            if len(got) == 3:
                os.kill(r.pid, signal.SIGKILL)
    assert len(got) >= 3
    assert not r.alive


async def test_a_request_that_fails_while_the_child_lives_says_why_in_words(start_runner, tiny_model):
    """Not a Python repr: what failed, and the reason (its type's name when it has no text)."""
    from jupyter_llama.engine.runner import free_port
    from jupyter_llama.errors import EngineError

    r = await start_runner(tiny_model, LoadOptions(num_ctx=512, num_parallel=1))
    assert await r.tokenize("Once upon")
    assert (await r.post("/apply-template", {"messages": []}))["prompt"].endswith("assistant\n")
    port = r.port

    async def not_json(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_json, "127.0.0.1", 0)
    try:
        r.port = free_port()  # nothing listens there: the connection is refused
        with pytest.raises(EngineError) as refused:
            await r.tokenize("Once upon")
        assert str(refused.value).startswith(f"request to llama-server for {r.name} failed: ")
        assert "Error(" not in str(refused.value)
        assert len(str(refused.value)) > len(f"request to llama-server for {r.name} failed: ")
        err = await r._after_transport_error(asyncio.TimeoutError())
        assert str(err) == f"request to llama-server for {r.name} failed: TimeoutError"
        r.port = server.sockets[0].getsockname()[1]
        with pytest.raises(EngineError, match="answered /tokenize with something that is not JSON"):
            await r.tokenize("Once upon")
    finally:
        r.port = port
        server.close()
        await server.wait_closed()
    assert r.alive and await r.tokenize("Once upon")


async def test_corrupt_gguf_fails_with_the_childs_last_lines(start_runner, tiny_model, tmp_path):
    bad = tmp_path / "corrupt.gguf"
    data = Path(tiny_model).read_bytes()
    bad.write_bytes(data[: len(data) // 3])  # header intact, tensor data cut off
    with pytest.raises(LoadError) as info:
        await start_runner(bad)
    err = info.value
    assert err.exit_code not in (None, 0)
    assert err.log_lines, "the error carries the child's last log lines"
    assert "exited while loading" in str(err)
    assert "corrupt.gguf" in str(err) or any("corrupt.gguf" in ln for ln in err.log_lines)


async def test_missing_model_file_is_a_clear_error(engine, tmp_path):
    r = Runner(tmp_path / "nope.gguf", binary=engine.path)
    with pytest.raises(LoadError, match="does not exist"):
        await r.start()
    assert r.proc is None


async def test_cancelled_consumer_stops_generation(start_runner, tiny_model):
    r = await start_runner(tiny_model, LoadOptions(num_ctx=2048, num_parallel=1))
    stream = r.completion("Go on forever", n_predict=100000, ignore_eos=True)
    async for i, _ in _enumerate(stream):
        if i == 2:
            break
    await stream.aclose()
    # With one slot, a fresh request is served only once the abandoned one was stopped.
    text, timings = await asyncio.wait_for(r.complete_text("Hi", n_predict=4), 60)
    assert timings["predicted_n"] >= 1


async def _enumerate(aiter):
    i = 0
    async for x in aiter:
        yield i, x
        i += 1


def test_sigkill_of_parent_leaves_no_child(engine, tiny_model, tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, sys
        from jupyter_llama.engine.runner import Runner
        from jupyter_llama.load_options import LoadOptions
        async def main():
            r = Runner({str(tiny_model)!r}, LoadOptions(num_ctx=512), binary={engine.path!r})
            await r.start()
            print(r.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        line = parent.stdout.readline()
        child_pid = int(line)
        assert process_alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 2.0
        while process_alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(child_pid), "llama-server outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
        if child_pid and process_alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


async def test_twenty_cycles_leave_no_process_and_no_fd(engine, tiny_model):
    def fds():
        return len(os.listdir("/proc/self/fd"))

    # One warm-up cycle so lazily created things (the shared HTTP client) exist already.
    r = Runner(tiny_model, LoadOptions(num_ctx=256, num_parallel=1), binary=engine.path)
    await r.start()
    await r.stop()
    before = fds()
    pids = []
    for _ in range(20):
        r = Runner(tiny_model, LoadOptions(num_ctx=256, num_parallel=1), binary=engine.path)
        try:
            await r.start()
            pids.append(r.pid)
        finally:
            await r.stop()
    assert not any(process_alive(p) for p in pids)
    assert fds() <= before


async def test_real_english_from_stories260k(start_runner, stories_model):
    r = await start_runner(stories_model, LoadOptions(num_ctx=512))
    text, _ = await r.complete_text("Once upon a time, there was a little", n_predict=40, temperature=0, seed=1)
    words = re.findall(r"[A-Za-z]+", text)
    common = {"the", "a", "and", "was", "he", "she", "to", "it", "they", "her", "his", "of", "in", "with", "said"}
    assert len(words) >= 10 and sum(w.lower() in common for w in words) >= 3, text


# ----------------------------------------------------------------------------- a stop during the start


async def test_a_stop_while_the_child_is_being_started_stops_that_child(engine, tiny_model):
    """Issue 58 item 3: between the fork and ``proc`` (the child's pipe is being watched, an
    await) a stop found no process and returned, and the child went on to serve, owned by
    nobody. Now the stop waits for the start, stops the child, and the start says it was
    stopped (LoadStopped, no crash)."""
    from jupyter_llama.engine.runner import LoadStopped

    r = Runner(tiny_model, LoadOptions(num_ctx=256, num_parallel=1), binary=engine.path)
    starting = asyncio.create_task(r.start())
    await asyncio.sleep(0)  # the start runs up to its first wait: the pipe of a child just forked
    assert r.proc is None and r._spawning is not None and not r._spawning.is_set(), "not in the spawn"
    await r.stop()
    with pytest.raises(LoadStopped, match="stopped by its manager"):
        await starting
    assert r.pid is not None, "the child had been forked"
    assert not process_alive(r.pid) and not r.alive
    assert r.state == "stopped"


async def test_a_stop_while_the_child_loads_is_a_stop_not_a_crash(engine, tiny_model):
    """SIGTERM from the manager while the model loads was told as "llama-server exited while
    loading (killed by SIGTERM)": the manager's own stop worded as an engine crash."""
    from jupyter_llama.engine.runner import LoadStopped

    r = Runner(tiny_model, LoadOptions(num_ctx=256, num_parallel=1), binary=engine.path)
    starting = asyncio.create_task(r.start())
    while r.proc is None:
        await asyncio.sleep(0)
    await r.stop()
    with pytest.raises(LoadStopped):
        await starting
    assert not process_alive(r.pid)


async def test_a_runner_stopped_before_its_start_starts_no_child(engine, tiny_model):
    from jupyter_llama.engine.runner import LoadStopped

    r = Runner(tiny_model, LoadOptions(num_ctx=256, num_parallel=1), binary=engine.path)
    await r.stop()
    with pytest.raises(LoadStopped):
        await r.start()
    assert r.proc is None and r.pid is None


async def test_a_killed_child_is_dead_to_the_next_asker_at_once(start_runner, tiny_model):
    """Ollama #16830: for a moment after a SIGKILL the runner still said it served. Once the
    kernel has the child as exited (a zombie), ``alive`` and ``serving`` say so, without
    waiting for the loop to run the exit's callback, and a request to it fails as a crash that
    may be retried (nothing of its answer went anywhere)."""
    r = await start_runner(tiny_model, LoadOptions(num_ctx=256, num_parallel=1))
    os.kill(r.pid, signal.SIGKILL)
    # Until its exit can be reaped (every thread gone; asked without reaping it), blocking on
    # purpose: the loop runs no callback meanwhile.
    while os.waitid(os.P_PID, r.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        time.sleep(0.001)
    assert not r.alive and not r.serving
    with pytest.raises(RunnerCrashed) as info:
        await r.complete_text("Hi", n_predict=2)
    assert info.value.retryable


async def test_a_crash_after_the_answer_began_is_not_retryable(start_runner, tiny_model):
    r = await start_runner(tiny_model, LoadOptions(num_ctx=4096, num_parallel=1))
    got = []

    def on_data(batch):
        got.extend(batch)
        if len(got) >= 3 and process_alive(r.pid):
            os.kill(r.pid, signal.SIGKILL)

    with pytest.raises(RunnerCrashed) as info:
        await r.relay_completion("Tell me a story", on_data, n_predict=100000, ignore_eos=True)
    assert got and not info.value.retryable
