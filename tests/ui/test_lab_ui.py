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
  made from outside (screenshot ``tests/artifacts/notebook-panel.png``);
* issue 56 (what a newcomer reads): with two models of different sizes loaded, their memory
  bars share one scale that the panel states, so the smaller model's bar is the shorter
  (``lab-panel-scale.png``); a pull from a slow server shows its speed and the time left
  (``lab-panel-pull.png``); a pull of a file the server does not have says so in one
  sentence that names the address once (``lab-panel-404.png``); ``%llama picker`` opens on
  the loaded model, says "automatic" for the context and labels every field
  (``notebook-picker.png``); with no model registered the panel's help shows its command as
  code, not between backticks (``lab-panel-empty.png``).

Needs: the built labextension (``make labext``), Node.js, ``tests/ui/node_modules``
(``npm ci`` here, done on demand) and Chromium (``apt-get install chromium``; the path can
be set with ``JUPYTER_LLAMA_CHROMIUM``).
"""

from __future__ import annotations

import functools
import http.server
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
from browser import drive, find_chromium, need

from jupyter_llama.engine.runner import free_port

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(480)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
BUILT = ROOT / "jupyter_llama" / "labextension" / "package.json"
MODEL = "tiny:latest"
PRESET_MODEL = "mario:latest"
WIDE_MODEL = "wide:latest"  # a larger model beside tiny: bars of two lengths on one scale
PRESET = {"system": "You are Mario", "parameters": {"num_predict": 3}}
OPTIONS = {"num_ctx": 1024, "num_parallel": 1, "num_thread": 1}
DRIVER_TIMEOUT = 360
SLOW_SECONDS = 5.0  # how long the slow server takes to send the pulled file


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
    need(bool(node and npm), "Node.js and npm are needed for the UI test")
    chromium = find_chromium()
    need(chromium is not None, "no Chromium: apt-get install chromium (or set JUPYTER_LLAMA_CHROMIUM)")
    need(BUILT.is_file(), "the labextension is not built: run `make labext`")
    if not (HERE / "node_modules" / "playwright-core" / "package.json").is_file():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True, timeout=300)
    return {"node": node, "chromium": chromium}


class _SlowFiles(http.server.SimpleHTTPRequestHandler):
    """Serves its folder at a pace that makes the file take ``SLOW_SECONDS``, so a pull's
    progress arrives over seconds, as from a real registry."""

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        size = os.fstat(source.fileno()).st_size
        chunk = 16 * 1024
        pause = SLOW_SECONDS / max(1, size // chunk)
        while block := source.read(chunk):
            outputfile.write(block)
            time.sleep(pause)


@pytest.fixture()
def slow_server(tmp_path):
    """A local HTTP server with one GGUF (``slow.gguf``), sent slowly; yields its base URL.
    The file is some MiB: a pull reports progress per MiB it reads."""
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    www = tmp_path / "www"
    www.mkdir()
    write_synthetic(www / "slow.gguf", SynthShape(layers=2, embd=384, seed=11))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_SlowFiles, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


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
    ModelStore(models).synth("wide", layers=4, embd=256)
    root = tmp_path / "root"
    root.mkdir()
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": "panel", "metadata": {}, "outputs": [],
                   "source": ["%load_ext jupyter_llama\n", "%llama panel"]},
                  {"cell_type": "code", "execution_count": None, "id": "picker", "metadata": {}, "outputs": [],
                   "source": ["%llama picker"]}],
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


SCREENSHOTS = ("lab-panel.png", "lab-panel-preset.png", "notebook-panel.png", "lab-panel-scale.png",
               "lab-panel-pull.png", "lab-panel-404.png", "notebook-picker.png", "lab-panel-empty.png")


def test_lab_panel_and_notebook_widget(lab, workers, slow_server, driver_deps, tmp_path):
    url, token, client, proc = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name in (*SCREENSHOTS, "lab-failure.png"):
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
        elif op == "load_wide":
            r = client.post("api/generate", json={"model": "wide", "options": OPTIONS})
        elif op == "unload_wide":
            r = client.post("api/generate", json={"model": "wide", "keep_alive": 0})
        elif op == "delete_all":  # an empty registry, as a newcomer's first look
            for m in client.get("api/tags").json()["models"]:
                client.request("DELETE", "api/delete", json={"model": m["name"]}).raise_for_status()
            r = client.get("api/tags")
        else:
            raise ValueError(op)
        r.raise_for_status()
        for m in client.get("api/ps").json()["models"]:
            if m.get("pid"):
                pids.add(int(m["pid"]))

    env = dict(os.environ, LAB_URL=url, LAB_TOKEN=token, ARTIFACTS=str(ARTIFACTS), MODEL=MODEL,
               PRESET_MODEL=PRESET_MODEL, WIDE_MODEL=WIDE_MODEL,
               SLOW_URL=slow_server + "slow.gguf", MISSING_URL=slow_server + "nothing-here.gguf",
               LIVE_WORKER=workers[0], DEAD_WORKER=workers[1],
               CHROMIUM=driver_deps["chromium"], PROFILE=str(tmp_path / "chromium-profile"))
    transcript: list[str] = []

    def note_runners() -> None:  # the panel's own loads happen in the browser: note their runners too
        try:
            for m in client.get("api/ps", timeout=5).json().get("models", []):
                if m.get("pid"):
                    pids.add(int(m["pid"]))
        except httpx.HTTPError:
            pass

    rc = None
    try:
        rc = drive(driver_deps["node"], HERE / "drive.mjs", env, do, transcript, timeout=DRIVER_TIMEOUT,
                   each_line=note_runners)
    finally:
        print("\n".join(transcript))
        # the kernel's live panel is stopped with the server; no llama-server may outlive it
        _stop(proc)
        for pid in pids:
            deadline = time.monotonic() + 15
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pid), f"llama-server {pid} outlived JupyterLab"
        log = (tmp_path / "lab.log").read_text() if (tmp_path / "lab.log").exists() else ""
        if rc not in (0, None):
            print("---- lab.log (tail) ----\n" + log[-6000:])

    assert rc == 0, "the browser check failed:\n" + "\n".join(transcript[-15:])
    for t in transcript:
        if "NOTE notebook panels rendered:" in t and not t.endswith(": 1"):
            warnings.warn(f"`%llama panel` renders its widget more than once ({t.split(': ')[-1]}): "
                          "it is displayed and also returned as the cell's value", stacklevel=1)
    assert any("done" in t for t in transcript)
    for name in SCREENSHOTS:
        assert (ARTIFACTS / name).stat().st_size > 5_000, name
