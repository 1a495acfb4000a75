"""What a newcomer reads in the picker and the panel (issue 56, item 9).

* The picker says "automatic" for an automatic context (never a bare 0) and what it came
  to; every number field is labelled with what it is; it opens on the loaded model (the
  most recently used of several), not the first name.
* The panel's memory bars share one scale, and say which: a bar's length is bytes.
* Pull progress says the speed and the time left; a file that is not there is said once.
* Help text shows commands as code, not between backticks.

The pure parts run on hand-made API answers; the picker runs against the real manager of
conftest.py (``tiny`` and ``other``, a 32 MiB CPU budget).
"""

from __future__ import annotations

import html
import time

import ipywidgets as W
import pytest

from jupyter_llama.client import LlamaClient
from jupyter_llama.memory.report import MiB
from jupyter_llama.widgets import ModelPicker, PullProgress, panel_rows, render_panel_row
from jupyter_llama.widgets.base import _descendants
from jupyter_llama.widgets.model import (
    CTX_AUTO,
    CTX_SET,
    GPU_AUTO,
    GPU_N,
    TransferRate,
    initial_model,
    memory_scale,
    memory_scale_text,
    nice_bytes,
    pull_error_text,
    rate_text,
)
from jupyter_llama.widgets.render import _help, render_devices

GiB = 1024 * MiB
OPTS = {"num_ctx": 1024}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + "Z"


def _report(**by_dev):
    return {"devices": {d: {"weights": n} for d, n in by_dev.items()}}


def _loaded(name, actual, detailed, **kw):
    d = {"name": name, "model": name, "state": "ready", "refcount": 0,
         "memory": {"detailed": _report(**detailed), **({"actual": _report(**actual)} if actual else {})}}
    d.update(kw)
    return d


# ---------------------------------------------------------------------------- the bars' scale


def test_bars_share_one_scale_so_a_bars_length_is_bytes():
    ps = {"models": [_loaded("big", {"cuda:0": 6 * GiB, "cpu": 512 * MiB}, {"cuda:0": 6.2 * GiB, "cpu": 500 * MiB}),
                     _loaded("small", {"cpu": 600 * MiB}, {"cpu": 640 * MiB})]}
    rows = panel_rows(ps, None, 0.0)
    bars = [d for r in rows for d in r["devices"]]
    assert {d["scale"] for d in bars} == {8 * GiB}  # 6.2 GiB, the largest figure shown, rounded up
    assert memory_scale(rows) == 8 * GiB
    big_gpu = next(d for d in rows[0]["devices"] if d["device"] == "cuda:0")
    small_cpu = rows[1]["devices"][0]
    # the same bytes, the same length, whichever model and device
    assert small_cpu["actual_pct"] / big_gpu["actual_pct"] == pytest.approx(600 / (6 * 1024))
    assert big_gpu["predicted_pct"]["detailed"] == pytest.approx(100 * 6.2 / 8)
    # and the panel says what the scale is
    text = memory_scale_text(rows)
    assert text == "Memory bars share one scale, 0 to 8 GiB: a bar's length is bytes."
    assert html.escape(text) in render_devices([], len(rows), text)
    assert "0 to 8 GiB" in render_panel_row(rows[1])  # each bar's tooltip too
    assert memory_scale(panel_rows({"models": []}, None, 0.0)) is None


def test_the_largest_bar_never_reads_as_full():
    assert nice_bytes(4 * GiB) == 5 * GiB
    assert nice_bytes(13.2 * MiB) == 15 * MiB
    (row,) = panel_rows({"models": [_loaded("m", {"cpu": 4 * GiB}, {"cpu": 4 * GiB})]}, None, 0.0)
    assert row["devices"][0]["actual_pct"] == pytest.approx(80)


# ---------------------------------------------------------------------------- pull progress


def test_pull_speed_and_time_left_from_bytes_over_time():
    r = TransferRate(window=8, min_span=1)
    assert r.add(100.0, "sha256:a", 0, 100 * MiB) == (None, None)
    assert r.add(100.5, "sha256:a", 5 * MiB, 100 * MiB) == (None, None)  # too soon to tell
    speed, left = r.add(102.0, "sha256:a", 20 * MiB, 100 * MiB)
    assert speed == pytest.approx(10 * MiB) and left == pytest.approx(8)
    assert rate_text(speed, left) == "10.0 MiB/s · about 8s left"
    assert r.add(103.0, "sha256:b", 0, 50 * MiB) == (None, None)  # another file: measured afresh
    assert rate_text(0.0, None) == "0 B/s · stalled"

    w = PullProgress()
    try:
        st = {"status": "pulling 7d1ec38fec2d", "digest": "sha256:7d1e", "total": 40 * MiB}
        w.update(dict(st, completed=0), now=10.0)
        assert "0 B / 40.0 MiB (0%)<" in w.label.value and "B/s" not in w.label.value
        w.update(dict(st, completed=8 * MiB), now=12.0)
        assert "8.0 MiB / 40.0 MiB (20%) · 4.0 MiB/s · about 8s left" in w.label.value
    finally:
        w.close()


def test_a_file_that_is_not_there_is_said_once():
    url = "http://127.0.0.1:8000/missing.gguf"
    server_words = f"{url}: not found (HTTP 404 File not found)"
    assert pull_error_text(url, server_words) == "nothing is at this address (HTTP 404 not found)."
    assert pull_error_text(url, server_words + " (HTTP 400)") == "nothing is at this address (HTTP 404 not found)."
    file = "https://huggingface.co/o/r/resolve/main/m.gguf"
    assert pull_error_text("hf.co/o/r", f"{file}: not found (HTTP 404 Not Found)") == \
        f"the server has no file {file} (HTTP 404 not found)."
    assert pull_error_text(url, f"{url}: access denied (HTTP 403 Forbidden)") == "access denied (HTTP 403 Forbidden)"

    w = PullProgress()
    try:
        w.source = url
        w.fail(server_words)
        assert w.label.value.count(url) == 1 and "nothing is at this address" in w.label.value
    finally:
        w.close()


# ---------------------------------------------------------------------------- help text


def test_help_text_shows_commands_as_code():
    html = _help("pull one with `%llama pull <url>`.")
    assert "`" not in html and "<code" in html and "%llama pull &lt;url&gt;</code>" in html
    assert "an odd ` stays" in _help("an odd ` stays")


# ---------------------------------------------------------------------------- the picker


def test_the_picker_opens_on_the_model_in_use():
    tags = {"models": [{"name": n} for n in ("alpha:latest", "beta:latest", "gamma:latest")]}
    now = time.time()
    assert initial_model(tags, {"models": []}) == "alpha:latest"
    one = {"models": [{"name": "gamma:latest", "expires_at": _iso(now + 60)}]}
    assert initial_model(tags, one) == "gamma:latest"
    # of several, the most recently used: the later expiry (keep-alives alike), a server's
    # last_used where it gives one, and one answering a request now before all
    two = {"models": [{"name": "beta:latest", "expires_at": _iso(now + 100)},
                      {"name": "gamma:latest", "expires_at": _iso(now + 200)}]}
    assert initial_model(tags, two) == "gamma:latest"
    two["models"][0]["last_used"] = _iso(now)
    two["models"][1]["last_used"] = _iso(now - 50)
    assert initial_model(tags, two) == "beta:latest"
    two["models"][1]["refcount"] = 1
    assert initial_model(tags, two) == "gamma:latest"
    # a model kept loaded for good says nothing of its use by its expiry; "x" is "x:latest"
    pinned = {"models": [{"name": "alpha", "pinned": True}, {"name": "beta", "expires_at": _iso(now + 5)}]}
    assert initial_model(tags, pinned) == "beta:latest"
    assert initial_model(tags, {"models": [{"name": "alpha", "pinned": True}]}) == "alpha:latest"


def test_picker_controls_say_what_they_are():
    picker = ModelPicker(LlamaClient("http://127.0.0.1:9/", "nothing"))  # nothing answers: the controls alone
    try:
        assert picker.ctx_select.value == CTX_AUTO
        assert dict(picker.ctx_select.options)["automatic"] == CTX_AUTO
        assert picker.ctx_input.layout.display == "none", "no bare 0 stands for automatic"
        assert picker.gpu_layers_input.layout.display == "none"
        assert picker.options == {}
        for w in _descendants(picker):
            if isinstance(w, (W.BoundedIntText, W.IntText, W.Text, W.Dropdown)) and not isinstance(w, W.Textarea):
                assert len(w.description) > 1 or w is picker.model_select, f"an unlabelled field: {w.description!r}"
        assert "N" not in dict(picker.gpu_select.options)
        assert picker.gpu_layers_input.description == "layers on the GPU"

        picker.ctx_input.value = 2048  # a size given is a size chosen
        assert picker.ctx_select.value == CTX_SET and picker.ctx_input.layout.display is None
        assert picker.options == {"num_ctx": 2048}
        picker.ctx_select.value = CTX_AUTO
        assert picker.options == {} and picker.ctx_input.layout.display == "none"

        picker.gpu_select.value = GPU_N
        assert picker.gpu_layers_input.layout.display is None
        picker.gpu_layers_input.value = 7
        assert picker.options == {"num_gpu": 7}
        picker.gpu_select.value = GPU_AUTO
        picker.gpu_layers_input.value = 3  # a number given is a number chosen
        assert picker.gpu_select.value == GPU_N and picker.options == {"num_gpu": 3}
    finally:
        picker.close()


@pytest.mark.engine
def test_picker_says_what_automatic_came_to_and_opens_on_the_loaded_model(manager, client):
    picker = ModelPicker(client)
    try:
        assert picker.model_select.value == "other:latest"  # none loaded: the first
        note = picker.ctx_note.value
        n_ctx = picker.last_summary["n_ctx"]
        assert n_ctx and f"(comes to {n_ctx} tokens)" in note, note
        picker.ctx_select.value = CTX_SET  # starts from what automatic came to
        assert picker.ctx_input.value == n_ctx and picker.ctx_note.value == ""
    finally:
        picker.close()

    client.load("tiny", options=OPTS, keep_alive="30s")
    picker = ModelPicker(client)
    try:
        assert picker.model_select.value == "tiny:latest"
    finally:
        picker.close()

    # two loaded: the most recently used
    client.load("other", options=OPTS, keep_alive="30s")
    picker = ModelPicker(client)
    try:
        assert picker.model_select.value == "other:latest"
    finally:
        picker.close()
    client.generate("tiny", "Once", stream=False, options=dict(OPTS, num_predict=2), keep_alive="30s")
    picker = ModelPicker(client)
    try:
        assert picker.model_select.value == "tiny:latest"
    finally:
        picker.close()


def test_empty_registry_help_shows_the_command_as_code():
    picker = ModelPicker(LlamaClient("http://127.0.0.1:9/", "nothing"))
    try:
        picker._apply_models({"models": []}, {"models": []})
        html = picker.estimate_html.value
        assert "<code" in html and "`" not in html and "%llama pull" in html
    finally:
        picker.close()
