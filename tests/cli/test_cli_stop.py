"""What a shell shows around an answer, against a real manager: a load note only when a load
happened, `ps`'s UNTIL in words, Ctrl-C's quiet stop (which stops the manager's generation
too), and one sentence when the manager goes away mid-answer."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# long enough to be cut: a few seconds of answer on a CPU, greedy (the same text each time)
SLOW = ("--layers", "8", "--embd", "512", "--vocab", "32000", "--ctx", "8192", "--type", "q8_0")
LONG_ANSWER = ("Once upon a time", "--num-ctx", "4096", "--num-predict", "3000", "--temperature", "0")


def cli(env, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", "jupyter_llama.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


# The command as a terminal starts it, with Ctrl-C's signal handled: a suite started in the
# background of a shell without job control inherits SIGINT ignored, and Python then leaves
# it ignored in every process it starts.
AT_A_TERMINAL = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "sys.argv[0] = 'jupyter-llama'; runpy.run_module('jupyter_llama.cli', run_name='__main__')")


def answering(env, model) -> subprocess.Popen:
    """`run MODEL` with a long answer, returned once its first text is on standard output."""
    p = subprocess.Popen([sys.executable, "-c", AT_A_TERMINAL, "run", model, *LONG_ANSWER], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=120):
        p.kill()
        pytest.fail(f"no answer within 120 s: {p.communicate()}")
    sel.close()
    return p


def loaded(env, model) -> dict | None:
    return next((m for m in json.loads(cli(env, "ps", "--json").stdout)["models"] if m["name"] == model), None)


def test_a_load_is_said_when_it_happened_and_ps_says_until_in_words(manager):
    env = manager["env"]
    assert cli(env, "synth", "note-tiny", "--layers", "2", "--embd", "64", "--ctx", "1024").returncode == 0
    first = cli(env, "run", "note-tiny", "Hello", "--num-predict", "4")
    assert first.returncode == 0 and re.search(r"\(note-tiny was loaded first: \d+\.\d+s\)", first.stderr), first.stderr
    again = cli(env, "run", "note-tiny", "Hello", "--num-predict", "4")
    assert again.returncode == 0 and "loaded first" not in again.stderr, again.stderr
    stats = cli(env, "run", "note-tiny", "Hello", "--num-predict", "4", "--stats")
    assert "already loaded" in stats.stderr and "loaded first" not in stats.stderr, stats.stderr

    row = next(ln for ln in cli(env, "ps").stdout.splitlines() if ln.startswith("note-tiny:latest"))
    assert re.search(r"(\d+ seconds|About a minute) from now$", row.rstrip()), row  # (the manager's 30s)
    assert cli(env, "load", "note-tiny", "--keep-alive", "-1").returncode == 0
    row = next(ln for ln in cli(env, "ps").stdout.splitlines() if ln.startswith("note-tiny:latest"))
    assert row.rstrip().endswith("Forever"), row
    assert cli(env, "stop", "note-tiny").returncode == 0


def test_ctrl_c_keeps_the_text_says_stopped_and_stops_the_manager_generating(manager):
    env = manager["env"]
    assert cli(env, "synth", "stop-slow", *SLOW).returncode == 0
    assert cli(env, "load", "stop-slow", "--num-ctx", "4096").returncode == 0
    try:
        p = answering(env, "stop-slow")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        out, err = out.decode(), err.decode()
        assert p.returncode == 130, (p.returncode, err)
        assert out.strip() and err == "(stopped)\n", err  # the partial answer, and one line: no traceback
        # the connection was closed, so the manager let the runner go (3000 tokens would take far longer)
        deadline = time.monotonic() + 10
        while (loaded(env, "stop-slow:latest") or {}).get("refcount") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loaded(env, "stop-slow:latest")["refcount"] == 0
    finally:
        cli(env, "rm", "stop-slow")


def test_a_manager_gone_mid_answer_is_one_sentence(engine, tmp_path):
    from jupyter_llama.embedded import EmbeddedManager

    models = tmp_path / "models"
    m = EmbeddedManager(log_path=str(tmp_path / "serve.log"),
                        env={"JUPYTER_LLAMA_MODELS": str(models), "JUPYTER_LLAMA_SERVER": engine.path})
    m.start(timeout=180)
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
    env.update(m.extra_env, **m.client_env())
    runner = None
    try:
        assert cli(env, "synth", "gone-slow", *SLOW).returncode == 0
        assert cli(env, "load", "gone-slow", "--num-ctx", "4096").returncode == 0
        runner = loaded(env, "gone-slow:latest")["pid"]
        p = answering(env, "gone-slow")
        m.proc.send_signal(signal.SIGKILL)  # (its llama-server follows it: the parent-death signal)
        out, err = p.communicate(timeout=60)
        out, err = out.decode(), err.decode()
        assert p.returncode == 1 and out.strip(), (p.returncode, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: the manager at http://127.0.0.1:{m.port} closed the connection before its "
                              "answer was complete ("), err
        assert "`jupyter-llama status` says whether it still runs" in err, err
    finally:
        m.stop()
        deadline = time.monotonic() + 10
        while runner and _alive(runner) and time.monotonic() < deadline:
            time.sleep(0.2)
        if runner and _alive(runner):
            os.kill(runner, signal.SIGKILL)
            pytest.fail(f"llama-server {runner} outlived its killed manager")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
