"""What a notebook shows of `%llama run`, without a manager: a stopped answer stays on the screen
with "(stopped)" under it, and a result already streamed into its cell is not echoed again."""

from __future__ import annotations

import argparse

import pytest
from IPython.core.interactiveshell import InteractiveShell
from test_magics import RecordingPublisher

from jupyter_llama import commands
from jupyter_llama.commands import RunResult
from jupyter_llama.magics import LlamaMagics, NotebookFrontend


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    old = sh.display_pub
    sh.display_pub = RecordingPublisher(shell=sh)
    yield sh
    sh.display_pub = old


@pytest.fixture
def magics(shell):
    m = LlamaMagics(shell=shell)
    yield m
    shell.events.unregister("post_run_cell", m._cell_done)


def test_the_stop_button_leaves_the_text_and_one_line(shell, magics, monkeypatch, capsys):
    monkeypatch.setattr(commands.run, "_placement", lambda fe, model: "")  # (it asks a manager; there is none here)
    magics.update_interval = 3600  # (only the first piece is shown as it comes: the stop must show the rest)
    closed = []

    def chunks():
        try:
            yield {"response": "Once", "done": False}
            yield {"response": " upon", "done": False}
            raise KeyboardInterrupt  # (what the stop button raises in the kernel, in the middle of a read)
        finally:
            closed.append(True)

    r = commands._generate(argparse.Namespace(model="tiny", raw=False, stats=True), NotebookFrontend(magics),
                           chunks, lambda c: c.get("response", ""))
    assert r.stopped and r.text == "Once upon" and closed
    assert shell.display_pub.published[-1]["data"]["text/plain"] == "Once upon"
    out, err = capsys.readouterr()
    assert out == "(stopped)\n" and err == ""


def test_a_streamed_result_is_not_echoed_in_its_cell_but_shows_later(shell, magics):
    """`%llama run ...` unassigned echoed `Out[n]: <RunResult ...>` under its answer; the result
    is still the cell's value (`_`), and `r` in a later cell shows it."""
    r = RunResult("tiny", "Once upon a time", {"eval_count": 4})
    shell.user_ns["_streamed_now"] = r
    r._shown_in_cell = True  # (as the magic marks what it streamed into the running cell)
    magics._streamed.append(r)
    shell.run_cell("_streamed_now", store_history=True)
    assert shell.display_pub.published == [] and shell.user_ns["_"] is r
    shell.run_cell("_streamed_now", store_history=True)  # a later cell: shown
    assert [p["data"] for p in shell.display_pub.published] == [{"text/plain": repr(r)}]
    assert "<RunResult tiny: 4 tokens" in repr(r)
