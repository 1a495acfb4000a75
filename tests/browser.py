"""What the browser tests share (tests/ui/test_lab_ui.py, tests/hub/test_hub_panel.py): the
tools they need, how a missing one is told, and running their drivers (which share
tests/ui/protocol.mjs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

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


def drive(node: str, script: Path, env: dict, do: Callable[[str], None], transcript: list[str], *,
          timeout: float, each_line: Callable[[], None] | None = None) -> int:
    """Run the driver ``script`` (tests/ui/protocol.mjs's protocol), answering its CALL lines with
    ``do(op)`` and calling ``each_line()`` after every line; its lines go to ``transcript``,
    with the seconds since it started. Returns its exit status; killed after ``timeout``."""
    drv = subprocess.Popen([node, str(script)], cwd=script.parent, env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(drv.pid, signal.SIGKILL))
    timer.start()
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
            if each_line is not None:
                each_line()
        return drv.wait(30)
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
