"""What the browser tests share (tests/ui/test_lab_ui.py, tests/hub/test_hub_panel.py): the
tools they need, and how a missing one is told. Their drivers share tests/ui/protocol.mjs."""

from __future__ import annotations

import os
import shutil

import pytest


def need(ok: bool, why: str) -> None:
    """Skip, or fail where `make test` promises the tool (JUPYTER_LLAMA_REQUIRE_UI=1)."""
    if ok:
        return
    if os.environ.get("JUPYTER_LLAMA_REQUIRE_UI") == "1":
        pytest.fail(why)
    pytest.skip(why)


def find_chromium() -> str | None:
    """Debian's Chromium (or JUPYTER_LLAMA_CHROMIUM), if it is here."""
    env = os.environ.get("JUPYTER_LLAMA_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None
