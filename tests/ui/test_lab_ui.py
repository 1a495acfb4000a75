"""The JupyterLab front end in a real browser (Debian's Chromium driven by playwright-core).

One JupyterLab with one registered synthetic model, and a second one made from it with a
preset (``api/create``: a system message and a parameter); ``drive.mjs`` opens it, and:

* issue 16: the preset model's row in the panel shows its preset in a second line, its
  Modelfile as the tooltip; the plain model's row shows none; the panel asks ``api/show``
  once per model, not on every poll (screenshot ``tests/artifacts/lab-panel-preset.png``);
* the status-bar item opens the Llama panel; the panel's Load button loads the model, its
  card shows the memory bars (actual, with the prediction marked); Unload removes it
  (screenshot ``tests/artifacts/lab-panel.png``);
* another client (this test, through the REST API with the token) loads and unloads the
  model while the panel is open: the panel and the status bar follow;
* an API error (a pull from nowhere) becomes a notification;
* issue 8: in a notebook, ``%load_ext jupyter_llama`` and ``%llama panel`` render the
  ipywidgets panel (jupyterlab_widgets' front end), which follows a load and an unload
  made from outside (screenshot ``tests/artifacts/notebook-panel.png``).

Needs: the built labextension (``make labext``), Node.js, ``tests/ui/node_modules``
(``npm ci`` here, done on demand) and Chromium (``apt-get install chromium``; the path can
be set with ``JUPYTER_LLAMA_CHROMIUM``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest

from jupyter_llama.engine.runner import free_port

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
BUILT = ROOT / "jupyter_llama" / "labextension" / "package.json"
MODEL = "tiny:latest"
PRESET_MODEL = "mario:latest"
PRESET = {"system": "You are Mario", "parameters": {"num_predict": 3}}
OPTIONS = {"num_ctx": 1024, "num_parallel": 1, "num_thread": 1}
DRIVER_TIMEOUT = 240


def _need(ok: bool, why: str) -> None:
    """Skip, or fail where `make test` promises the tool (JUPYTER_LLAMA_REQUIRE_UI=1)."""
    if ok:
        return
    if os.environ.get("JUPYTER_LLAMA_REQUIRE_UI") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _chromium() -> str | None:
    env = os.environ.get("JUPYTER_LLAMA_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None




def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def driver_deps() -> dict:
    node, npm = shutil.which("node"), shutil.which("npm")
    _need(bool(node and npm), "Node.js and npm are needed for the UI test")
    chromium = _chromium()
    _need(chromium is not None, "no Chromium: apt-get install chromium (or set JUPYTER_LLAMA_CHROMIUM)")
    _need(BUILT.is_file(), "the labextension is not built: run `make labext`")
    if not (HERE / "node_modules" / "playwright-core" / "package.json").is_file():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True, timeout=300)
    return {"node": node, "chromium": chromium}


@pytest.fixture()
def workers(engine):
    """One live RPC worker and the id of one that is down (nothing listens on its port)."""
    from jupyter_llama.engine.worker import LocalWorker
    from jupyter_llama.memory import rpc

    with LocalWorker(engine) as live:
        yield live.id, rpc.device_id(f"127.0.0.1:{free_port()}")


@pytest.fixture()
def lab(engine, workers, tmp_path):
    """A JupyterLab with one registered synthetic model and two RPC workers configured (one
    down); yields (url, token, client, proc)."""
    from jupyter_llama.memory import rpc
    from jupyter_llama.models.store import ModelStore

    models = tmp_path / "models"
    ModelStore(models).synth("tiny", layers=2, embd=64)
    root = tmp_path / "root"
    root.mkdir()
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": "panel", "metadata": {}, "outputs": [],
                   "source": ["%load_ext jupyter_llama\n", "%llama panel"]}],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    (root / "panel.ipynb").write_text(json.dumps(nb))
    settings = tmp_path / "lab-settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    # no news or update toasts over the screenshots
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    token = "ui-" + os.urandom(8).hex()
    port = free_port()
    env = dict(os.environ)
    env.update({
        "JUPYTER_LLAMA_MODELS": str(models),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "JUPYTER_LLAMA_KEEP_ALIVE": "5m",
        "JUPYTER_LLAMA_RPC_WORKERS": ",".join(rpc.split_id(w)[0] for w in workers),
    })
    env.pop("JUPYTER_LLAMA_URL", None)
    env.pop("JUPYTER_LLAMA_TOKEN", None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", "--allow-root", f"--ServerApp.root_dir={root}",
         '--ServerApp.jpserver_extensions={"jupyter_llama": True}'],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    client = httpx.Client(base_url=url + "llama/", headers={"Authorization": f"token {token}"}, timeout=120)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if client.get("api/version").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-4000:])
            time.sleep(0.3)
        yield url, token, client, proc
    finally:
        client.close()
        _stop(proc)
        log.close()


def test_lab_panel_and_notebook_widget(lab, workers, driver_deps, tmp_path):
    url, token, client, proc = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name in ("lab-panel.png", "lab-panel-preset.png", "notebook-panel.png", "lab-failure.png"):
        (ARTIFACTS / name).unlink(missing_ok=True)
    pids: set[int] = set()

    # a second model: tiny's weights with a preset, as `jupyter-llama create -f Modelfile` makes one
    r = client.post("api/create", json={"model": PRESET_MODEL, "from": MODEL, "stream": False, **PRESET})
    r.raise_for_status()
    assert r.json().get("status") == "success", r.text
    shown = client.post("api/show", json={"model": PRESET_MODEL}).json()
    assert shown["system"] == PRESET["system"] and "SYSTEM You are Mario" in shown["modelfile"], shown

    def do(op: str) -> None:
        if op == "load":
            r = client.post("api/generate", json={"model": "tiny", "options": OPTIONS})
        elif op == "unload":
            r = client.post("api/generate", json={"model": "tiny", "keep_alive": 0})
        else:
            raise ValueError(op)
        r.raise_for_status()
        for m in client.get("api/ps").json()["models"]:
            if m.get("pid"):
                pids.add(int(m["pid"]))

    env = dict(os.environ, LAB_URL=url, LAB_TOKEN=token, ARTIFACTS=str(ARTIFACTS), MODEL=MODEL,
               PRESET_MODEL=PRESET_MODEL,
               LIVE_WORKER=workers[0], DEAD_WORKER=workers[1],
               CHROMIUM=driver_deps["chromium"], PROFILE=str(tmp_path / "chromium-profile"))
    drv = subprocess.Popen([driver_deps["node"], str(HERE / "drive.mjs")], cwd=HERE, env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    timer = threading.Timer(DRIVER_TIMEOUT, lambda: os.killpg(drv.pid, signal.SIGKILL))
    timer.start()
    transcript: list[str] = []
    started = time.monotonic()
    try:
        assert drv.stdout is not None and drv.stdin is not None
        for line in drv.stdout:
            line = line.rstrip("\n")
            transcript.append(f"{time.monotonic() - started:6.1f}s {line}")
            if line.startswith("CALL "):
                try:
                    do(json.loads(line[5:])["op"])
                    drv.stdin.write("OK\n")
                except Exception as e:  # noqa: BLE001 - reported to the driver, which fails
                    drv.stdin.write(f"ERR {e!r}\n")
                drv.stdin.flush()
            # the panel's own loads happen in the browser: note their runners too
            try:
                for m in client.get("api/ps", timeout=5).json().get("models", []):
                    if m.get("pid"):
                        pids.add(int(m["pid"]))
            except httpx.HTTPError:
                pass
        rc = drv.wait(30)
    finally:
        timer.cancel()
        if drv.poll() is None:
            os.killpg(drv.pid, signal.SIGKILL)
            drv.wait(10)
        for pipe in (drv.stdin, drv.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:  # the driver is gone: nothing to flush into
                    pass
        print("\n".join(transcript))
        # the kernel's live panel is stopped with the server; no llama-server may outlive it
        _stop(proc)
        for pid in pids:
            deadline = time.monotonic() + 15
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pid), f"llama-server {pid} outlived JupyterLab"
        log = (tmp_path / "lab.log").read_text() if (tmp_path / "lab.log").exists() else ""
        if drv.returncode not in (0, None):
            print("---- lab.log (tail) ----\n" + log[-6000:])

    assert rc == 0, "the browser check failed:\n" + "\n".join(transcript[-15:])
    for t in transcript:
        if "NOTE notebook panels rendered:" in t and not t.endswith(": 1"):
            warnings.warn(f"`%llama panel` renders its widget more than once ({t.split(': ')[-1]}): "
                          "it is displayed and also returned as the cell's value", stacklevel=1)
    assert any("done" in t for t in transcript)
    assert (ARTIFACTS / "lab-panel.png").stat().st_size > 10_000
    assert (ARTIFACTS / "lab-panel-preset.png").stat().st_size > 5_000
    assert (ARTIFACTS / "notebook-panel.png").stat().st_size > 10_000
