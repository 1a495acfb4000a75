"""`jupyter-llama pull NAME` from an Ollama registry, through a real `jupyter-llama serve` whose
JUPYTER_LLAMA_REGISTRY is a local registry look-alike (tests/models/registryserver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from registryserver import RegistryServer  # noqa: E402

from jupyter_llama.models.preset import PARAMS_MEDIA_TYPE, SYSTEM_MEDIA_TYPE, TEMPLATE_MEDIA_TYPE  # noqa: E402
from jupyter_llama.models.store import MODEL_MEDIA_TYPE  # noqa: E402
from jupyter_llama.models.synth import SynthShape, write_synthetic  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TEMPLATE = "{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}"
SYSTEM = "You answer in five tokens."
PARAMS = {"num_predict": 5, "temperature": 0.5}


def cli(env, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", "jupyter_llama.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def api(env, route, body):
    """POST ``body`` to the manager's ``route``: (HTTP status, the last JSON object it sent)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(env["JUPYTER_LLAMA_URL"] + route, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"token {env['JUPYTER_LLAMA_TOKEN']}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    return status, json.loads(text.strip().splitlines()[-1])


@pytest.fixture
def registry_manager(engine, tmp_path):
    """A registry look-alike, and a manager of this test's own that pulls from it."""
    from jupyter_llama.embedded import EmbeddedManager

    with RegistryServer(tmp_path / "registry") as reg:
        models = tmp_path / "models"
        models.mkdir()
        m = EmbeddedManager(log_path=str(tmp_path / "serve.log"),
                            env={"JUPYTER_LLAMA_MODELS": str(models), "JUPYTER_LLAMA_SERVER": engine.path,
                                 "JUPYTER_LLAMA_REGISTRY": reg.url, "HF_HOME": str(tmp_path / "hf-home"),
                                 "JUPYTER_LLAMA_KEEP_ALIVE": "0"})
        m.start(timeout=180)
        try:
            env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
            env.update(m.extra_env, **m.client_env())
            yield reg, env
        finally:
            m.stop(timeout=30)


def test_pull_by_name_through_the_cli(registry_manager, tmp_path):
    reg, env = registry_manager
    gguf = write_synthetic(tmp_path / "tiny.gguf", SynthShape(layers=2, embd=64, heads=4, kv_heads=2, ctx=1024, seed=7))
    manifest = reg.add_model("tiny", "1b", [(MODEL_MEDIA_TYPE, gguf), (TEMPLATE_MEDIA_TYPE, TEMPLATE.encode()),
                                            (SYSTEM_MEDIA_TYPE, SYSTEM.encode()),
                                            (PARAMS_MEDIA_TYPE, json.dumps(PARAMS).encode())])
    r = cli(env, "pull", "tiny:1b")
    assert r.returncode == 0, r.stderr
    assert "pulling manifest" in r.stderr and r.stderr.rstrip().endswith("success")
    for ly in manifest["layers"]:
        assert f"pulling {ly['digest'][7:19]}" in r.stderr
        assert reg.blob_sent(ly["digest"][7:]) == ly["size"]
    listed = json.loads(cli(env, "list", "--json").stdout)["models"]
    assert "tiny:1b" in [m["name"] for m in listed]  # shown as Ollama shows a pulled model
    assert "tiny:1b" in cli(env, "list").stdout

    shown = json.loads(cli(env, "show", "tiny:1b", "--json").stdout)
    assert shown["system"] == SYSTEM and shown["template"] == TEMPLATE
    assert shown["preset"]["parameters"] == PARAMS and shown["source"]["type"] == "registry"
    text = cli(env, "show", "tiny:1b").stdout
    assert SYSTEM in text and "num_predict" in text

    run = cli(env, "run", "tiny:1b", "Once upon a time", "--stats")
    assert run.returncode == 0, run.stderr
    assert "5 tokens" in run.stderr, run.stderr  # the params layer's num_predict, applied by the manager

    sent = reg.total_blob_bytes_sent()
    again = cli(env, "pull", "tiny:1b")
    assert again.returncode == 0, again.stderr
    assert reg.total_blob_bytes_sent() == sent  # a second pull downloads nothing

    missing = cli(env, "pull", "nosuch:7b")
    assert missing.returncode == 1, missing.stderr
    assert f'model "nosuch:7b" not found in registry {reg.url}' in missing.stderr
    assert "Traceback" not in missing.stderr

    # Ollama's API: a name the registry lacks is a 404 before any progress, streamed or not
    for stream in (True, False):
        status, body = api(env, "api/pull", {"model": "nosuch", "stream": stream})
        assert status == 404 and body["error"].startswith(f'model "nosuch:latest" not found in registry {reg.url}')
    status, body = api(env, "api/pull", {"model": "tiny:1b", "stream": False})
    assert (status, body) == (200, {"status": "success"})

    assert cli(env, "rm", "tiny:1b").returncode == 0
    assert "tiny:1b" not in [m["name"] for m in json.loads(cli(env, "list", "--json").stdout)["models"]]


def _at_a_terminal(env, argv, typed: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal (a person at a keyboard), typing each line of
    ``typed`` once the previous output has gone quiet; returns its exit code and output."""
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # (the child: the CLI, its standard streams the terminal)
        os.execve(sys.executable, [sys.executable, "-m", "jupyter_llama.cli", *argv], env)
    out, deadline = b"", time.monotonic() + timeout
    pending = list(typed)

    def read_until_quiet(quiet: float) -> bool:
        nonlocal out
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], quiet)
            if not ready:
                return True
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # (the child has closed the terminal: it is done)
                return False
            if not chunk:
                return False
            out += chunk
        return False

    try:
        while read_until_quiet(3.0) and pending:
            if pending[0] and pending[0] not in ("\x04",) and b">>> " not in out.rsplit(b"\n", 1)[-1]:
                continue  # (not yet at a prompt)
            os.write(fd, pending.pop(0).encode())
        read_until_quiet(3.0)
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace").replace("\r\n", "\n")


def test_a_person_at_a_terminal_gets_a_missing_model_pulled_and_a_conversation(registry_manager, tmp_path):
    """`ollama run`'s two habits: a registry model that is not here is pulled first, and
    `run MODEL` without a prompt holds a conversation (a line at a time, /bye ends it). A
    script (no terminal) is told how to pull instead, and downloads nothing."""
    reg, env = registry_manager
    gguf = write_synthetic(tmp_path / "talk.gguf", SynthShape(layers=2, embd=64, heads=4, kv_heads=2, ctx=1024, seed=9))
    reg.add_model("talk", "1b", [(MODEL_MEDIA_TYPE, gguf)])

    scripted = cli(env, "run", "talk:1b", "Hello", "--num-predict", "4")
    assert scripted.returncode == 1 and "`pull talk:1b` downloads it" in scripted.stderr, scripted.stderr
    assert reg.total_blob_bytes_sent() == 0

    code, said = _at_a_terminal(env, ["run", "talk:1b", "Hello", "--num-predict", "4"], [])
    assert code == 0, said
    assert "talk:1b is not here: pulling it" in said and "success" in said
    assert "talk:1b" in [m["name"] for m in json.loads(cli(env, "list", "--json").stdout)["models"]]

    code, said = _at_a_terminal(env, ["run", "talk:1b", "--num-predict", "3"], ["Hello\n", "Again\n", "/bye\n"])
    assert code == 0, said
    assert "type a message (/bye or Ctrl-D to end" in said
    assert said.count(">>> ") >= 3  # a prompt for each line, and one for the /bye
