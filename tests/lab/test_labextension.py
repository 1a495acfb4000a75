"""The built JupyterLab extension: its bundle, its settings schema, and that JupyterLab
lists it as enabled (after `make labext` or a wheel install)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BUILT = ROOT / "jupyter_llama" / "labextension"


def _need_built() -> None:
    if (BUILT / "package.json").is_file():
        return
    why = "the labextension is not built: run `make labext`"
    if os.environ.get("JUPYTER_LLAMA_REQUIRE_UI") == "1":
        pytest.fail(why)
    pytest.skip(why)


def test_bundle_and_schema_are_built():
    _need_built()
    meta = json.loads((BUILT / "package.json").read_text())
    assert meta["name"] == "jupyter-llama"
    load = meta["jupyterlab"]["_build"]["load"]
    assert (BUILT / load).is_file(), load
    assert (BUILT / "static" / "style.js").is_file()
    schema = json.loads((BUILT / "schemas" / "jupyter-llama" / "plugin.json").read_text())
    interval = schema["properties"]["refreshInterval"]
    assert interval["type"] == "number" and interval["default"] >= interval["minimum"] >= 1
    source = json.loads((ROOT / "labextension" / "package.json").read_text())
    assert meta["version"] == source["version"]


def test_jupyter_labextension_list_shows_it_enabled():
    _need_built()
    pytest.importorskip("jupyterlab")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               NO_COLOR="1")
    res = subprocess.run([sys.executable, "-m", "jupyterlab.labextensions", "list"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = res.stdout.replace("\x1b[32m", "").replace("\x1b[0m", "")
    line = next((ln for ln in out.splitlines() if "jupyter-llama" in ln), None)
    assert line is not None, f"jupyter-llama is not among the lab extensions:\n{out}"
    assert "enabled" in line and "OK" in line, line
