"""The JupyterLab extension's unit tests (vitest, in labextension/) run from pytest, so
`make test` covers them: view rows from recorded API answers, countdown text, byte
formatting, the polling back-off policy, NDJSON pull progress."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

LABEXT = Path(__file__).resolve().parent.parent.parent / "labextension"


def _need_npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        if os.environ.get("JUPYTER_LLAMA_REQUIRE_UI") == "1":
            pytest.fail("npm is missing (Node.js 20+ is needed to build and test the labextension)")
        pytest.skip("npm is missing (Node.js 20+ is needed to build and test the labextension)")
    return npm


@pytest.mark.timeout(600)
def test_frontend_unit_tests_pass():
    npm = _need_npm()
    if not (LABEXT / "node_modules" / "vitest" / "package.json").is_file():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=LABEXT, check=True, timeout=540,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    env = dict(os.environ, CI="true", NO_COLOR="1", FORCE_COLOR="0")
    res = subprocess.run([npm, "test", "--", "--reporter=verbose"], cwd=LABEXT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    out = res.stdout
    print(out[-6000:])
    assert res.returncode == 0, f"npm test failed (exit {res.returncode}):\n{out[-4000:]}"
    m = re.search(r"Tests\s+(\d+) passed(?: \((\d+)\))?", out)
    assert m, f"no test count in vitest's output:\n{out[-2000:]}"
    assert int(m.group(1)) > 0
    assert not re.search(r"Tests\s+.*\d+ failed", out)
