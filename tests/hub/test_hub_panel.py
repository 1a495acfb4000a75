"""The JupyterLab panel of a Hub user's server, in a real browser (issue 57).

A real JupyterHub with jupyter-llama as its service (conftest.py's ``hub``) starts alice's
server (``jupyterhub-singleuser`` serving JupyterLab with the labextension). ``drive_hub.mjs``
(Debian's Chromium driven by tests/ui's playwright-core) logs in as alice with the Hub's login
form and lands in her JupyterLab, where:

* the panel shows ``tiny``, which bob loaded through the service's API with his token: the
  shared manager's ps, through alice's relay (her server's ``llama/`` routes);
* ``tiny``'s card says "loaded by another user" (never bob's name), and its Unload buttons
  (the card's, the registered row's) are off, their tooltip saying why: another user's
  request loaded it, only they or an admin can unload it (the panel knows alice is no admin
  from ``api/me``); once alice's own request used it, the card says "used by you and 1 other";
* alice loads ``other`` with its Load button and sees its memory card, "loaded by you" and an
  Unload button that is on; the service says her request loaded it;
* bob's own model ``bob/mine`` (``api/copy``) is not in her panel;
* every ``llama/`` request of the page goes to her own server's relay, and none is refused;
* alice unloads ``other`` with its card's button; bob's ``tiny`` stays.

Screenshot: ``tests/artifacts/hub-panel.png``. Needs what tests/hub needs (JupyterHub,
configurable-http-proxy) and what tests/ui needs (the built labextension, Node.js,
``tests/ui/node_modules``, Chromium); skips saying which is missing, or fails where
``JUPYTER_LLAMA_REQUIRE_UI=1`` (``make test``) promises them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import drive, find_chromium, need

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(480)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
UI = ROOT / "tests" / "ui"
ARTIFACTS = ROOT / "tests" / "artifacts"
BUILT = ROOT / "jupyter_llama" / "labextension" / "package.json"
USER, OTHER = "alice", "bob"
SHARED, TO_LOAD, PRIVATE = "tiny:latest", "other:latest", "bob/mine:latest"
DRIVER_TIMEOUT = 300


def _installed_labextension() -> Path | None:
    """Where JupyterLab (the users' servers run from this environment) finds ours, if it does."""
    from jupyter_core.paths import jupyter_path

    for folder in jupyter_path("labextensions"):
        if (Path(folder) / "jupyter-llama" / "package.json").is_file():
            return Path(folder) / "jupyter-llama"
    return None


@pytest.fixture(scope="module")
def driver_deps() -> dict:
    """Node.js, Chromium, tests/ui's playwright-core and the labextension, or a skip (a failure
    under JUPYTER_LLAMA_REQUIRE_UI=1) that says which is missing. Module-scoped, and asked for
    before ``hub``, so a skip starts no Hub."""
    node, npm = shutil.which("node"), shutil.which("npm")
    need(bool(node), "Node.js is needed for the browser test")
    chromium = find_chromium()
    need(chromium is not None, "no Chromium: apt-get install chromium (or set JUPYTER_LLAMA_CHROMIUM)")
    need(importlib.util.find_spec("jupyterlab") is not None,
          "JupyterLab is not installed: the users' servers would serve no JupyterLab")
    need(BUILT.is_file(), "the labextension is not built: run `make labext`")
    need(_installed_labextension() is not None,
          "JupyterLab does not find the jupyter-llama labextension: run `make labext`")
    playwright = UI / "node_modules" / "playwright-core" / "package.json"
    if not playwright.is_file() and npm:  # (tests/ui's own test installs it on demand the same way)
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=UI, check=True, timeout=300)
    need(playwright.is_file(), "tests/ui/node_modules has no playwright-core: run `npm ci` in tests/ui")
    return {"node": node, "chromium": chromium}


def _quiet_lab(home: Path) -> None:
    """No news or update toasts over the screenshot: the user's JupyterLab settings."""
    folder = home / ".jupyter" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def test_the_panel_through_the_hub(driver_deps: dict, hub, tmp_path: Path) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name in ("hub-panel.png", "hub-panel-failure.png"):
        (ARTIFACTS / name).unlink(missing_ok=True)
    _quiet_lab(hub.root / "homes" / USER)
    transcript: list[str] = []
    rc = None
    hub.start_server(USER)
    try:
        with hub.client(OTHER) as bob, hub.client("admin") as admin:
            # bob's own model, and the shared one loaded by his request (an empty prompt loads)
            r = bob.post("api/copy", json={"source": "other", "destination": "bob/mine"})
            assert r.status_code == 200, r.text
            r = bob.post("api/generate", json={"model": "tiny", "stream": False})
            assert r.status_code == 200, r.text
            loaded = {m["name"]: m for m in admin.get("api/ps").json()["models"]}
            assert loaded[SHARED]["loaded_by"] == OTHER, loaded
            assert PRIVATE in [m["name"] for m in admin.get("api/tags").json()["models"]]

            def do(op: str) -> None:
                models = {m["name"]: m for m in admin.get("api/ps").json()["models"]}
                if op == "use_shared_as_user":  # alice's own request (her token) uses bob's load
                    with hub.client(USER) as alice:
                        r = alice.post("api/generate", json={"model": SHARED, "stream": False})
                        assert r.status_code == 200, r.text
                    models = {m["name"]: m for m in admin.get("api/ps").json()["models"]}
                    assert models[SHARED]["loaded_by"] == OTHER, models
                    assert models[SHARED]["used_by"] == sorted([USER, OTHER]), models
                elif op == "check_loaded_by_user":  # the panel's load was alice's, at the shared manager
                    assert models[TO_LOAD]["loaded_by"] == USER, models
                elif op == "check_unloaded":  # the panel's unload of alice's own load, and only that
                    assert TO_LOAD not in models and SHARED in models, models
                else:
                    raise ValueError(op)

            env = dict(os.environ, HUB_URL=hub.url + "/", HUB_USER=USER, OTHER_USER=OTHER,
                       SHARED_MODEL=SHARED, LOAD_MODEL=TO_LOAD, PRIVATE_MODEL=PRIVATE,
                       ARTIFACTS=str(ARTIFACTS), CHROMIUM=driver_deps["chromium"],
                       PROFILE=str(tmp_path / "chromium-profile"))
            rc = drive(driver_deps["node"], HERE / "drive_hub.mjs", env, do, transcript, timeout=DRIVER_TIMEOUT)
    finally:
        print("\n".join(transcript))
        hub.stop_server(USER)
        if rc not in (0, None):
            print("---- hub.log (tail) ----\n" + hub.read_log()[-6000:], file=sys.stderr)

    assert rc == 0, "the browser check failed:\n" + "\n".join(transcript[-15:])
    assert any(t.endswith("STEP done") for t in transcript)
    assert (ARTIFACTS / "hub-panel.png").stat().st_size > 5_000
