"""A notebook run by nbclient through a real IPython kernel that finds a real manager (as a
kernel inside JupyterLab does, through JUPYTER_LLAMA_URL)."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.engine, pytest.mark.slow]


class CountingClient(NotebookClient):
    """Counts the display updates each cell sends while it runs."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.updates: dict[int, int] = {}

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] == "update_display_data":
            self.updates[cell_index] = self.updates.get(cell_index, 0) + 1
        return super().process_message(msg, cell, cell_index)


def test_notebook_streams_remembers_and_reports_errors_briefly(manager, monkeypatch, tmp_path):
    for k in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN"):
        monkeypatch.setenv(k, manager["env"][k])  # what the server extension exports to its kernels
    cells = [
        "%load_ext jupyter_llama\n%config LlamaMagics.update_interval = 0",
        "%llama synth nb-tiny --layers 2 --embd 64 --ctx 4096",
        "r = %llama run nb-tiny 'Once upon a time' --num-predict 120\nlen(r.text) > 0, r.tokens",
        "%%llama chat nb-tiny --conversation story --num-predict 8\nMy name is Ada.",
        "%%llama chat nb-tiny --conversation story --num-predict 8\nWhat is my name?",
        "turns = _LlamaMagics_conversations = get_ipython().magics_manager.registry['LlamaMagics'].conversations"
        "['story']\n[m['role'] for m in turns], turns[0]['content']",
        "%llama run no-such-model hello",
        f"%llama plot nb-tiny -o {tmp_path / 'nb.png'}",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = CountingClient(nb, timeout=300, kernel_name="python3", allow_errors=True)
    client.execute()

    run_out = nb.cells[2].outputs
    assert client.updates.get(2, 0) >= 2, f"the answer streamed into the cell: {client.updates}"
    assert any(o.get("output_type") == "display_data" and "text/markdown" in o.get("data", {}) for o in run_out)
    result = [o for o in run_out if o.get("output_type") == "execute_result"][0]["data"]["text/plain"]
    assert result == "(True, 120)"

    roles = [o for o in nb.cells[5].outputs if o.get("output_type") == "execute_result"][0]["data"]["text/plain"]
    assert roles == "(['user', 'assistant', 'user', 'assistant'], 'My name is Ada.')"

    err = nb.cells[6].outputs
    # IPython shows a UsageError as one short line on stderr: no traceback for a user mistake.
    assert len(err) == 1 and err[0]["output_type"] == "stream" and err[0]["name"] == "stderr"
    assert err[0]["text"].startswith('UsageError: model "no-such-model" not found')
    assert len(err[0]["text"].strip().splitlines()) == 1 and "Traceback" not in err[0]["text"]

    # a plot is shown in the cell, and written where -o says too
    plot = nb.cells[7].outputs
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in plot), plot
    assert (tmp_path / "nb.png").read_bytes()[:4] == b"\x89PNG"
    assert any(f"plot written to {tmp_path / 'nb.png'}" in o.get("text", "") for o in plot), plot
