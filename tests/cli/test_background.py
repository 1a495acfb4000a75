"""The per-user background manager: what plain IPython, VS Code, scripts and shells share.

Each test gets its own state and runtime directories (no other manager can be found there),
so the commands below must start one; the fixture stops it by the PID in its state file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_llama.private import write_private
from jupyter_llama.procs import process_alive

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def cli(env, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", "jupyter_llama.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture
def alone(engine, tmp_path, monkeypatch):
    """An environment where no manager can be found: its own runtime and state directories."""
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN",
                                                            "JPY_PARENT_PID")}
    env.update(JUPYTER_LLAMA_MODELS=str(tmp_path / "models"), JUPYTER_LLAMA_SERVER=engine.path,
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_LLAMA_MANAGER_DIR=str(tmp_path / "manager"),
               JUPYTER_LLAMA_KEEP_ALIVE="60s")
    for k in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN", "JPY_PARENT_PID"):
        monkeypatch.delenv(k, raising=False)
    for k in ("JUPYTER_LLAMA_MODELS", "JUPYTER_LLAMA_SERVER", "JUPYTER_RUNTIME_DIR", "JUPYTER_LLAMA_MANAGER_DIR"):
        monkeypatch.setenv(k, env[k])
    yield env
    from jupyter_llama import background

    pid = background.stop()
    assert pid is None or not process_alive(pid)


def status(env) -> dict:
    r = cli(env, "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_commands_share_one_background_manager_and_its_loaded_model(alone):
    env = alone
    assert cli(env, "synth", "solo", "--layers", "2", "--embd", "64").returncode == 0
    first = status(env)
    assert first["source"].startswith("background manager") and process_alive(first["pid"])
    for _ in range(2):
        r = cli(env, "run", "solo", "Hello", "--num-predict", "4")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()
    again = status(env)
    assert again["pid"] == first["pid"] and again["url"] == first["url"]  # one manager, found again
    assert again["loaded"] == ["solo:latest"]  # the second run found the model loaded
    events = json.loads(cli(env, "explain", "solo", "--json").stdout)
    loads = [e for e in events if e.get("kind") == "load"]
    assert len(loads) == 1, loads
    human = cli(env, "status")
    assert "found:   background manager (pid" in human.stdout and "solo:latest" in human.stdout
    stopped = cli(env, "status", "--stop")
    assert f"pid {first['pid']}" in stopped.stdout
    assert not process_alive(first["pid"])


def test_a_running_jupyter_server_is_found_before_a_background_one(alone, tmp_path):
    from jupyter_llama.client import find_server
    from jupyter_llama.embedded import EmbeddedManager

    m = EmbeddedManager(log_path=str(tmp_path / "serve.log"), env={"JUPYTER_RUNTIME_DIR": alone["JUPYTER_RUNTIME_DIR"]})
    m.start(timeout=120)
    try:
        info = find_server(environ={}, start=False)  # no URL, no token: its runtime file says where
        assert info.url == m.url and info.token == m.token and info.pid == m.proc.pid
        assert info.source.startswith("Jupyter server")
        assert status(alone)["pid"] == m.proc.pid
    finally:
        m.stop()


def test_an_embedded_manager_is_found_by_no_other_tool_and_counts_only_itself(alone, tmp_path):
    """A notebook's private manager writes nothing into the user's runtime folder (so `ps` in
    a terminal does not talk to it), keeps its runtime files in a folder of its own (so it
    counts no other manager's memory), and removes that folder when it stops."""
    from pathlib import Path

    from jupyter_llama.client import running_server
    from jupyter_llama.embedded import EmbeddedManager

    m = EmbeddedManager(log_path=str(tmp_path / "serve.log"))
    m.start(timeout=120)
    try:
        own = Path(m.own_runtime_dir)
        assert any(own.glob("jpserver-*.json"))
        assert not list(Path(alone["JUPYTER_RUNTIME_DIR"]).glob("jpserver-*.json"))
        assert running_server(environ={}) is None
    finally:
        m.stop()
    assert not own.exists()


def test_the_background_manager_exits_by_itself_when_idle(alone):
    env = dict(alone, JUPYTER_LLAMA_MANAGER_IDLE="1s")
    assert cli(env, "ps").returncode == 0  # (starts it: status only looks)
    # Its PID from the state file, which outlives it: asking `status` takes a second Python
    # start, by which time a manager idle for 1 s may already be gone.
    from jupyter_llama.background import STATE_NAME

    pid = json.loads((Path(env["JUPYTER_LLAMA_MANAGER_DIR"]) / STATE_NAME).read_text())["pid"]
    deadline = time.monotonic() + 60
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(pid), "the idle background manager is still running after 60 s"


def _managers_for(env) -> set[int]:
    """The serve processes started for ``env``'s state folder (read from each process's environment)."""
    mine = f"JUPYTER_LLAMA_MANAGER_DIR={env['JUPYTER_LLAMA_MANAGER_DIR']}".encode()
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if b"jupyter_llama.server.serve" in cmd and mine in environ:
            found.add(int(pid))
    return found


def test_two_first_uses_at_once_start_one_manager(alone):
    procs = [subprocess.Popen([sys.executable, "-m", "jupyter_llama.cli", "ps", "--json"], env=alone,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    assert _managers_for(alone) == {status(alone)["pid"]}


def test_status_looks_without_starting_a_manager(alone):
    """`status` says none runs (it started one, and said "started now"); once one runs it
    names it, and the versions for what they are."""
    r = cli(alone, "status")
    assert r.returncode == 0 and r.stdout.startswith("manager: none runs") and not _managers_for(alone), r.stdout
    assert json.loads(cli(alone, "status", "--json").stdout)["url"] is None
    assert cli(alone, "ps").returncode == 0  # (a command that needs one starts it)
    r = cli(alone, "status")
    assert "found:   background manager (pid" in r.stdout and "version: jupyter-llama " in r.stdout, r.stdout
    assert "(Ollama's API 0." in r.stdout and "also:" not in r.stdout
    # found by its URL, it is not "another manager of yours" too (a manager with a model loaded publishes it)
    assert cli(alone, "synth", "looked", "--layers", "2", "--embd", "64").returncode == 0
    assert cli(alone, "run", "looked", "Hi", "--num-predict", "1").returncode == 0
    st = status(alone)
    r = cli(dict(alone, JUPYTER_LLAMA_URL=st["url"], JUPYTER_LLAMA_TOKEN=background_token(alone)), "status")
    assert r.returncode == 0 and "also:" not in r.stdout, r.stdout


def background_token(env) -> str:
    with open(os.path.join(env["JUPYTER_LLAMA_MANAGER_DIR"], "jupyter-llama-manager.json")) as f:
        return json.load(f)["token"]


def test_a_client_outlives_its_background_manager(alone):
    """A kernel's LlamaClient() keeps working after the manager exited (it does when idle):
    the next call starts a new one and goes there."""
    from jupyter_llama import background
    from jupyter_llama.client import LlamaClient

    with LlamaClient() as c:
        first = c.server.pid
        assert c.version()["version"]
        assert background.stop() == first and not process_alive(first)
        assert c.ps()["models"] == []  # found again, started again
        assert c.server.pid != first and process_alive(c.server.pid)


def test_stop_never_signals_a_process_that_is_not_the_manager(alone, tmp_path):
    """A state file left by a manager that exited names a PID the system may give to anyone."""
    from jupyter_llama import background

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = background.state_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)  # (as a manager leaves them: this user's alone)
        write_private(d / background.STATE_NAME, json.dumps({"url": "http://127.0.0.1:9/llama/", "token": "t",
                                                             "pid": sleeper.pid}))
        assert background.find() is None and background.stop() is None
        assert sleeper.poll() is None, "stop() signalled a process that is not a manager"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_manager_that_cannot_start_is_a_sentence_at_once(alone):
    """A setting the manager cannot read: the command says so as soon as the manager has
    exited (it had waited a minute on a server answering 404, then printed a traceback), in
    the manager's own words, and no manager is left behind."""
    env = dict(alone, JUPYTER_LLAMA_KEEP_ALIVE="banana")
    r = cli(env, "ps")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: the background jupyter-llama manager exited at start (code 1)"), r.stderr
    assert '"banana" is not a duration' in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli(env, "--url", "localhost:9", "ps")  # no scheme: read as http://, and the refusal is a sentence
    assert r.returncode == 1 and "cannot reach the jupyter-llama server at http://localhost:9/llama/" in r.stderr, \
        r.stderr
    # the background manager's own settings, read by the command that starts it: sentences, not tracebacks
    alone_dir = alone["JUPYTER_LLAMA_MANAGER_DIR"] + "-file"
    open(alone_dir, "w").close()
    for extra, said in (({"JUPYTER_LLAMA_MANAGER_IDLE": "never"}, 'error: JUPYTER_LLAMA_MANAGER_IDLE: "never" is '
                                                                   "not a duration"),
                        ({"JUPYTER_LLAMA_MANAGER_DIR": alone_dir}, "error: the background manager keeps its state in "
                                                                   f"JUPYTER_LLAMA_MANAGER_DIR, {alone_dir}, which "
                                                                   "cannot be made a folder: File exists")):
        r = cli(dict(alone, **extra), "ps")
        assert r.returncode == 2 and r.stderr.startswith(said) and "Traceback" not in r.stderr, r.stderr


def test_a_setting_applies_where_it_is_given_never_to_another_store(alone, tmp_path):
    """A background manager keeps the settings it was started with. A command run with other
    ones (another model folder here) must not act on the manager's store: while the manager
    holds no model it is restarted with the command's settings, and said so; while it holds
    one, the command stops with a sentence that says how to proceed. `status` only looks."""
    assert cli(alone, "synth", "theirs", "--layers", "2", "--embd", "64").returncode == 0  # starts it
    first = status(alone)["pid"]
    mine = dict(alone, JUPYTER_LLAMA_MODELS=str(tmp_path / "my-models"))
    looked = cli(mine, "status")
    assert looked.returncode == 0 and status(alone)["pid"] == first
    assert f"JUPYTER_LLAMA_MODELS is '{tmp_path / 'my-models'}' here, but the background manager runs with " \
           f"JUPYTER_LLAMA_MODELS='{tmp_path / 'models'}'" in looked.stderr + looked.stdout

    r = cli(mine, "synth", "mine", "--layers", "2", "--embd", "64")  # it holds nothing: restarted with mine
    assert r.returncode == 0, r.stderr
    assert "held no model: restarted it with these" in r.stderr
    assert status(mine)["pid"] != first and not process_alive(first)
    assert (tmp_path / "my-models").is_dir()
    listed = cli(mine, "list").stdout
    assert "mine:latest" in listed and "theirs:latest" not in listed

    assert cli(mine, "load", "mine", "--num-ctx", "256").returncode == 0
    second = status(mine)["pid"]
    r = cli(alone, "list")  # the other folder again, while a model is loaded: refused, said how to proceed
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "It holds mine:latest, so it was not restarted" in r.stderr and "`jupyter-llama status --stop`" in r.stderr
    assert status(mine)["pid"] == second
    assert "note:" not in cli(mine, "ps").stderr  # the same settings: nothing to say


def test_a_manager_whose_model_folder_was_deleted_says_so(alone):
    """Deleting the model folder under a running manager: it says the folder is gone and what
    to do, rather than list nothing or make a new empty folder behind the user's back."""
    assert cli(alone, "synth", "doomed", "--layers", "2", "--embd", "64").returncode == 0
    models = Path(alone["JUPYTER_LLAMA_MODELS"])
    shutil.rmtree(models)
    for argv in (("list",), ("run", "doomed", "Hello"), ("synth", "again", "--layers", "2", "--embd", "64")):
        r = cli(alone, *argv)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"the model folder {models} was deleted while this manager was using it" in r.stderr, r.stderr
        assert "`jupyter-llama status --stop`" in r.stderr
    assert not models.exists()
    assert cli(alone, "status", "--stop").returncode == 0
    assert cli(alone, "list").returncode == 0  # a new manager, a new folder


def test_an_embedded_manager_keeps_its_log_where_only_its_user_can_look(alone):
    """Plain IPython's and VS Code's manager (embedded.py) writes its log, by default, in a
    folder of its own, named at random and closed to other users: a fixed name in the shared
    temporary folder is one another user could have made first (a link to a file of ours).
    A manager that cannot start says so, naming that log, which holds its own words."""
    from jupyter_llama.client import ServerNotFound
    from jupyter_llama.embedded import EmbeddedManager

    made = [EmbeddedManager(env={"JUPYTER_LLAMA_KEEP_ALIVE": "banana"}) for _ in range(2)]
    try:
        for m in made:
            with pytest.raises(ServerNotFound) as caught:
                m.start(timeout=60)
            said = str(caught.value)
            assert said.startswith("the embedded jupyter-llama manager exited at start (code 1); its log: "
                                   f"{m.log_path}"), said
            assert '"banana" is not a duration' in Path(m.log_path).read_text() and not m.running
        folder = Path(made[0].log_path).parent
        assert folder.is_dir() and folder.stat().st_mode & 0o077 == 0 and str(os.getpid()) not in folder.name
        assert Path(made[1].log_path).parent != folder  # (another of this process's: a folder of its own)
    finally:
        for m in made:
            m.stop()
            if m.log_path is not None:
                shutil.rmtree(Path(m.log_path).parent, ignore_errors=True)
