"""Widgets: the pure view-model functions on hand-made API answers, then the widgets driven
programmatically against a real manager (``jupyter-llama serve`` with real llama-server
children, see conftest.py), and the live panel inside a real ipykernel."""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import os
import threading
import time

import pytest

from jupyter_llama.client import AsyncLlamaClient, LlamaClient
from jupyter_llama.memory.report import MiB, format_bytes
from jupyter_llama.widgets import (
    ModelPicker,
    PullProgress,
    RunningPanel,
    device_rows,
    duration_text,
    error_text,
    event_rows,
    fit_summary,
    keep_alive_text,
    load_options,
    model_rows,
    panel_rows,
    parse_time,
    pull_progress,
    render_events,
    render_fit,
    render_panel_row,
)

OPTS = {"num_ctx": 1024}


def wait_for(cond, timeout: float = 30.0, interval: float = 0.05):
    """Poll ``cond()`` until truthy; return its value or fail."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


async def await_until(cond, timeout: float = 30.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def _report(source, **by_dev):
    return {"source": source, "devices": {d: {"weights": n} for d, n in by_dev.items()},
            "total": sum(by_dev.values()), "layers_offloaded": None, "layers_total": None, "n_ctx": 1024,
            "warnings": []}


def _devices(free=20 * 1024 * MiB, budget=None, loaded=(), gpus=(), available=None):
    devs = [{"id": "cpu", "name": "host memory", "total": 24 * 1024 * MiB, "free": free, "budget": budget,
             "overhead": 0, "usable": free, "available": available}]
    for gid, total, gfree, overhead in gpus:
        devs.append({"id": gid, "name": "GPU", "total": total, "free": gfree, "budget": None, "overhead": overhead,
                     "usable": gfree - overhead})
    usage = {}
    for lo in loaded:
        for d, n in lo["by_device"].items():
            usage[d] = usage.get(d, 0) + n
    return {"devices": devs, "usage": usage, "loaded": list(loaded)}


# ============================================================================ pure functions


def test_model_rows_mark_loaded_models():
    tags = {"models": [
        {"name": "tiny:latest", "size": 670176, "details": {"quantization_level": "F32", "parameter_size": "164K",
                                                            "family": "llama"}},
        {"name": "big:q4", "size": 4 * 1024 * MiB, "details": {"quantization_level": "Q4_K_M"}},
    ]}
    ps = {"models": [{"name": "big:q4", "state": "ready"}]}
    rows = model_rows(tags, ps)
    assert [r["name"] for r in rows] == ["tiny:latest", "big:q4"]
    assert rows[0]["loaded"] is False and rows[1]["loaded"] is True
    assert rows[0]["label"] == "tiny:latest · 654.5 KiB · F32 · 164K params"
    assert rows[1]["label"] == "big:q4 · 4.00 GiB · Q4_K_M · loaded"
    assert model_rows({}, None) == []


def test_load_options_map_the_fields():
    assert load_options(0, "auto") == {}
    assert load_options(2048, "auto") == {"num_ctx": 2048}
    assert load_options(None, "cpu", 7) == {"num_gpu": 0}
    assert load_options(4096, "n", 12) == {"num_ctx": 4096, "num_gpu": 12}
    assert load_options(0, "n", -1) == {}  # -1 is automatic
    assert load_options(0, "auto", num_predict=5) == {"num_predict": 5}


def _fit(verdict, estimator="detailed+10%", evict=(), **devices):
    """A fit plan as /api/estimate returns it (the scheduler computes it; the widget renders it)."""
    devs = {d: dict(need=n[0], available=n[1], in_use=n[2] if len(n) > 2 else 0, budget=n[3] if len(n) > 3 else None,
                    checked=True, fits=n[0] <= n[1]) for d, n in devices.items()}
    from jupyter_llama.scheduler import FitPlan

    return FitPlan("m", "detailed", estimator, devs, cap=3, others=1, verdict=verdict, evict=list(evict)).to_dict()


def test_fit_summary_renders_the_schedulers_plan():
    est = {"model": "tiny", "options": {"num_ctx": 1024},
           "estimates": {"coarse": _report("coarse", cpu=1 * MiB), "detailed": _report("detailed", cpu=4 * MiB)},
           "loaded": None, "fit": _fit("fits", cpu=(round(4.4 * MiB), 100 * MiB))}
    s = fit_summary(est, _devices(free=100 * MiB))
    assert s["fits"] is True and s["verdict"] == "fits" and s["estimator"] == "detailed+10%"
    (row,) = s["devices"]
    assert row["device"] == "cpu" and row["detailed"] == 4 * MiB and row["coarse"] == 1 * MiB
    assert row["need"] == round(4.4 * MiB) and row["available"] == 100 * MiB
    assert "Fits: cpu needs 4.4 MiB (detailed+10%) of 100.0 MiB available" in s["text"]
    assert "with context 1024" in s["text"]
    html = render_fit(s)
    assert ">fits<" in html and "100.0 MiB" in html and "<table" in html


def test_fit_summary_says_what_a_load_would_evict():
    est = {"model": "m", "estimates": {"detailed": _report("detailed", cpu=20 * MiB)},
           "fit": _fit("evict", evict=["other:latest"], cpu=(22 * MiB, 12 * MiB, 20 * MiB, 32 * MiB))}
    s = fit_summary(est, _devices(budget=32 * MiB))
    assert s["fits"] is False and s["evict"] == ["other:latest"]
    assert s["devices"][0]["available"] == 12 * MiB and s["devices"][0]["budget"] == 32 * MiB
    assert ("Fits after evicting other:latest: cpu needs 22.0 MiB (detailed+10%) of 12.0 MiB available, "
            "budget 32.0 MiB") in s["text"]
    assert ">fits after evicting<" in render_fit(s)
    refused = fit_summary(dict(est, fit=_fit("refuse", cpu=(40 * MiB, 12 * MiB))), None)
    assert "Does not fit, and evicting would not make room" in refused["text"]
    assert ">does not fit<" in render_fit(refused)


def test_fit_summary_without_a_scheduler_has_no_verdict():
    est = {"model": "m", "estimates": {"detailed": _report("detailed", cpu=MiB, **{"cuda:0": 900 * MiB})}}
    s = fit_summary(est, _devices())
    assert s["fits"] is None and s["verdict"] is None
    assert [r["device"] for r in s["devices"]] == ["cpu", "cuda:0"]
    assert "no fit verdict" in s["text"] and ">no verdict<" in render_fit(s)


def test_parse_time_and_durations():
    assert parse_time("2026-11-30T07:05:34.275419+00:00") == pytest.approx(1796022334.275419)
    assert parse_time("2026-11-30T07:05:34Z") == pytest.approx(1796022334.0)
    assert parse_time("2026-11-30T07:05:34.275419123Z") == pytest.approx(1796022334.275419)
    assert parse_time(None) is None and parse_time("soon") is None
    assert duration_text(9.4) == "9s" and duration_text(75) == "1m 15s" and duration_text(3700) == "1h 01m"


def test_keep_alive_countdown():
    now = 1_000_000.0
    assert keep_alive_text({"expires_at": _iso(now + 30)}, now) == ("unloads in 30s", pytest.approx(30))
    assert keep_alive_text({"expires_at": _iso(now + 30)}, now + 12)[0] == "unloads in 18s"
    assert keep_alive_text({"expires_at": _iso(now + 300), "refcount": 2}, now)[0].startswith("busy; unloads 5m")
    assert keep_alive_text({"pinned": True, "expires_at": _iso(now + 1e10)}, now) == \
        ("kept loaded (keep_alive < 0)", None)
    assert keep_alive_text({"expires_at": _iso(now + 1e10)}, now)[1] is None
    assert keep_alive_text({"expires_at": _iso(now - 1)}, now)[0] == "unloading now"


def _ps_entry(now, name="tiny:latest", **kw):
    mem = {"coarse": _report("coarse", cpu=1 * MiB), "detailed": _report("detailed", cpu=4 * MiB),
           "actual": _report("actual", cpu=5 * MiB)}
    d = {"name": name, "model": name, "size": 5 * MiB, "size_vram": 0, "expires_at": _iso(now + 42),
         "context_length": 1024, "state": "ready", "refcount": 0, "pinned": False, "options": {"num_ctx": 1024},
         "layers_offloaded": None, "layers_total": None, "pid": 1234, "memory": mem}
    d.update(kw)
    return d


def test_a_prediction_far_off_the_scale_is_an_arrow_and_the_actual_bar_stays_readable():
    """The coarse estimate's 2 GiB batch surcharge on a 3.4 MiB model: the bars keep the
    scale of the figures they show (as the sidebar does), the coarse marker is an arrow at
    its end."""
    from jupyter_llama.widgets.render import C_COARSE

    now = 1_000_000.0
    entry = _ps_entry(now)
    entry["memory"]["coarse"] = _report("coarse", cpu=2048 * MiB)
    (d,) = panel_rows({"models": [entry]}, _devices(), now)[0]["devices"]
    assert d["scale"] == 6 * MiB and d["actual_pct"] == pytest.approx(500 / 6)  # 5 MiB on a 0-6 MiB scale
    assert d["off_scale"] == {"detailed": False, "coarse": True} and d["predicted_pct"]["coarse"] == 100.0
    html = render_panel_row(panel_rows({"models": [entry]}, _devices(), now)[0])
    assert "coarse prediction 2.00 GiB (off the scale)" in html and f"border-left:6px solid {C_COARSE}" in html
    assert "width:83.33%" in html


def test_panel_rows_from_ps_and_devices():
    now = 1_000_000.0
    ps = {"models": [_ps_entry(now), _ps_entry(now, name="gpu:latest", size_vram=3 * MiB, layers_offloaded=20,
                                               layers_total=33, refcount=1)]}
    rows = panel_rows(ps, _devices(budget=32 * MiB, loaded=[{"name": "tiny:latest", "by_device": {"cpu": 5 * MiB}}]),
                      now)
    r = rows[0]
    assert r["name"] == "tiny:latest" and r["context"] == 1024 and r["layers"] == "0 (CPU only)"
    assert r["keep_alive"] == "unloads in 42s" and r["expires_in"] == pytest.approx(42)
    (d,) = r["devices"]
    assert d["device"] == "cpu" and d["actual"] == 5 * MiB and d["predicted"] == {"detailed": 4 * MiB, "coarse": MiB}
    assert d["error_pct"] == pytest.approx(-20.0)
    assert d["actual_pct"] == pytest.approx(500 / 6) and d["predicted_pct"]["detailed"] < d["actual_pct"]
    assert d["capacity"] == 32 * MiB and d["capacity_kind"] == "budget" and d["share_pct"] == pytest.approx(15.625)
    assert rows[1]["layers"] == "20/33" and rows[1]["refcount"] == 1 and rows[1]["keep_alive"].startswith("busy")
    html = render_panel_row(r)
    assert "context 1024" in html and "unloads in 42s" in html and "0 requests in flight" in html
    assert "width:83.33%" in html  # the actual bar: 5 MiB on the 0-6 MiB scale both models share
    assert "detailed prediction 4.0 MiB" in html and "prediction error -20%" in html
    assert "1 request in flight" in render_panel_row(rows[1])
    # a model still loading: predictions only
    loading = _ps_entry(now, state="loading")
    del loading["memory"]["actual"]
    r = panel_rows({"models": [loading]}, _devices(), now)[0]
    assert r["devices"][0]["actual"] is None and not r["has_actual"]
    assert "actual: not yet known" in render_panel_row(r) and "(loading)" in render_panel_row(r)


def test_device_rows_and_events():
    devs = device_rows(_devices(budget=32 * MiB, loaded=[{"name": "a", "by_device": {"cpu": 8 * MiB}}],
                                available=24 * MiB))
    assert devs[0]["used"] == 8 * MiB and devs[0]["capacity"] == 32 * MiB and devs[0]["used_pct"] == 25.0
    assert devs[0]["available"] == 24 * MiB, "the scheduler's figure, shown as given"
    evs = [{"seq": i, "time": 1_000_000.0 + i, "kind": "load", "model": "m", "message": f"m{i}"} for i in range(1, 12)]
    rows = event_rows(evs, limit=3)
    assert [r["seq"] for r in rows] == [11, 10, 9]
    assert "no scheduler decisions yet" in render_events([])


def test_html_is_escaped():
    now = 1_000_000.0
    r = panel_rows({"models": [_ps_entry(now, name="<script>x</script>")]}, _devices(), now)[0]
    assert "<script>" not in render_panel_row(r)
    html = render_events(event_rows([{"seq": 1, "time": now, "kind": "fit", "model": "m", "message": "<b>x</b>"}]))
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html


def test_error_text_is_short():
    from jupyter_llama.client import DoesNotFitError

    assert error_text(DoesNotFitError("cannot load m: too big", 507)) == "cannot load m: too big (HTTP 507)"
    assert error_text(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert error_text(RuntimeError()) == "RuntimeError"


def test_pull_progress_widget_from_statuses():
    w = PullProgress()
    w.update({"status": "pulling manifest"})
    assert w.bar.value == 0.0 and "pulling manifest" in w.label.value
    w.update({"status": "pulling 7d1ec38fec2d", "digest": "sha256:7d1e", "total": 4 * MiB, "completed": MiB})
    assert w.bar.value == pytest.approx(0.25) and "1.0 MiB / 4.0 MiB (25%)" in w.label.value
    w.update({"status": "success"})
    assert w.bar.value == 1.0 and w.bar.bar_style == "success"
    w.fail("boom")
    assert w.bar.bar_style == "danger" and "boom" in w.label.value
    w.close()


# ============================================================================ against a real manager



def _unreachable_client() -> LlamaClient:
    from jupyter_llama.engine.runner import free_port

    return LlamaClient(f"http://127.0.0.1:{free_port()}/", "nothing")


def test_widgets_show_errors_instead_of_raising():
    c = _unreachable_client()
    picker = ModelPicker(c)
    panel = RunningPanel(c)
    try:
        assert "cannot reach the jupyter-llama server" in picker.status_html.value
        assert "cannot reach the jupyter-llama server" in panel.status_html.value
        assert "Traceback" not in picker.status_html.value
        picker.load()  # nothing selected: a message, no exception
        assert "choose a model first" in picker.status_html.value
        assert not panel.running  # no event loop here: refresh() only
        with pytest.raises(RuntimeError, match="running asyncio event loop"):
            panel.start()
    finally:
        picker.close()
        panel.close()


@pytest.mark.engine
def test_picker_estimate_load_run_unload(client):
    picker = ModelPicker(client)  # no running loop: every action is synchronous
    try:
        names = [v for _, v in picker.model_select.options]
        assert names == ["other:latest", "tiny:latest"]
        picker.model_select.value = "tiny:latest"
        picker.ctx_input.value = 1024  # (its own, trained, context of 32768 is what the next step shows not fitting)
        s = picker.last_summary
        assert s["model"] == "tiny:latest" and s["fits"] is True
        assert "fits" in picker.estimate_html.value and "budget 32.0 MiB" in picker.estimate_html.value
        assert s["devices"][0]["detailed"] > 0 and s["devices"][0]["budget"] == 32 * MiB

        # a context that does not fit the 32 MiB budget: said before anything loads
        picker.ctx_input.value = 32768
        s = picker.last_summary
        assert s["fits"] is False and s["n_ctx"] == 32768
        assert "does not fit" in picker.estimate_html.value
        assert f"needs {format_bytes(s['devices'][0]['need'])}" in picker.estimate_html.value
        picker.load_button.click()  # the scheduler agrees: a short message, not a traceback
        assert "HTTP 507" in picker.status_html.value, picker.status_html.value
        assert client.ps()["models"] == []

        picker.ctx_input.value = 1024
        assert picker.last_summary["fits"] is True
        picker.keep_alive_input.value = "30s"
        picker.load_button.click()
        (m,) = client.ps()["models"]
        assert m["name"] == "tiny:latest" and m["context_length"] == 1024
        assert "tiny:latest loaded" in picker.status_html.value
        assert dict(picker.model_select.options)["tiny:latest · 654.5 KiB · F32 · 164K params · loaded"] == \
            "tiny:latest"
        assert "(tiny:latest is loaded now.)" in picker.last_summary["text"]

        seen = []
        picker.answer_html.observe(lambda ch: seen.append(ch["new"]), names="value")
        picker.num_predict_input.value = 8
        picker.prompt_input.value = "Once upon a time"
        picker.run_button.click()
        assert picker.last_response and picker.last_response["done"] is True
        assert picker.updates >= 3 and len(seen) >= 4  # "thinking", then chunk by chunk
        texts = [v for v in seen if "<pre" in v]
        assert len(texts) >= 3 and all(len(a) < len(b) for a, b in zip(texts, texts[1:], strict=False))
        assert picker.answer and "tokens" in picker.answer_html.value
        assert not picker.run_button.disabled

        picker.unload_button.click()
        assert client.ps()["models"] == []
        assert "tiny:latest unloaded" in picker.status_html.value
    finally:
        picker.close()


@pytest.mark.engine
def test_picker_shows_api_errors(client):
    picker = ModelPicker(client)
    try:
        picker.keep_alive_input.value = "for a while"
        picker.load()
        assert "HTTP 400" in picker.status_html.value and "Traceback" not in picker.status_html.value
        client.copy("tiny", "doomed")
        picker.refresh_models()
        picker.model_select.value = "doomed:latest"
        client.delete("doomed")
        picker.keep_alive_input.value = ""
        picker.run("hello")
        assert "HTTP 404" in picker.status_html.value and picker.answer_html.value == ""
        assert not picker.run_button.disabled and picker.stop_button.disabled
    finally:
        picker.close()


@pytest.mark.engine
def test_panel_follows_a_model_loaded_elsewhere(manager, client):
    panel = RunningPanel(client, autostart=False)
    other = LlamaClient(manager.url, manager.token)  # "another kernel"
    try:
        assert panel.rows_box.children == () and "no models loaded" in panel.title_html.value
        other.load("tiny", options=OPTS, keep_alive="30s")
        panel.refresh()
        row = panel.row("tiny")
        assert row is not None and panel.rows_box.children == (row,)
        r = panel.last_rows[0]
        assert r["context"] == 1024 and r["refcount"] == 0 and r["layers"] == "0 (CPU only)"
        assert r["has_actual"] and r["devices"][0]["actual"] > 0 and r["devices"][0]["predicted"]["detailed"] > 0
        assert 0 < r["expires_in"] <= 30
        html = row.html.value
        assert "context 1024" in html and "unloads in" in html and "position:absolute" in html
        assert "detailed prediction" in html and "of the budget 32.0 MiB" in html
        assert "budget 32.0 MiB" in panel.devices_html.value and "1 model loaded" in panel.devices_html.value
        assert "loaded tiny:latest" in panel.events_html.value

        # the countdown runs down
        first = r["expires_in"]
        wait_for(lambda: (panel.refresh(), panel.last_rows[0]["expires_in"] < first - 0.5)[1], timeout=10)

        # a request in flight shows in the refcount and the keep-alive
        stop = threading.Event()

        def generate():
            # The tiny model fills its 1024-token context in well under a second, which a
            # slow machine's refresh can miss: so ask again until the panel has seen one.
            with LlamaClient(manager.url, manager.token) as c:
                while not stop.is_set():
                    for _ in c.generate("tiny", "Tell me a long story", options=dict(OPTS, num_predict=2000)):
                        if stop.is_set():
                            break

        t = threading.Thread(target=generate)
        t.start()
        try:
            wait_for(lambda: (panel.refresh(), panel.last_rows and panel.last_rows[0]["refcount"] == 1)[1])
            assert "1 request in flight" in panel.row("tiny").html.value
            assert "busy; unloads" in panel.row("tiny").html.value
        finally:
            stop.set()
            t.join(timeout=120)
        wait_for(lambda: (panel.refresh(), panel.last_rows[0]["refcount"] == 0)[1])

        # Unload from the panel
        panel.row("tiny").unload_button.click()
        assert client.ps()["models"] == []
        assert panel.row("tiny") is None and panel.rows_box.children == ()
        assert "unloaded tiny:latest" in panel.events_html.value
    finally:
        other.close()
        panel.close()


@pytest.mark.engine
async def test_panel_live_loop_updates_without_blocking(manager, client, monkeypatch):
    # The live loop must use the async client only: record any call to the sync one.
    sync_calls = []
    panel = RunningPanel(client, interval=10.0)  # long interval: the events stream must drive updates
    for meth in ("ps", "devices", "events", "unload"):
        orig = getattr(client, meth)

        def spy(*a, _orig=orig, _meth=meth, **kw):
            sync_calls.append(_meth)
            return _orig(*a, **kw)

        monkeypatch.setattr(client, meth, spy)
    ticks: list[float] = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    tick_task = asyncio.ensure_future(ticker())
    try:
        assert panel.running  # created on a running loop: started by itself
        await asyncio.sleep(0.3)  # let it connect to the event stream
        async with AsyncLlamaClient(manager.url, manager.token) as ac:
            await ac.load("tiny", options=OPTS, keep_alive="30s")
            t0 = time.monotonic()
            await await_until(lambda: panel.row("tiny") is not None, timeout=8.0)
            assert time.monotonic() - t0 < 8.0  # well before the 10 s poll
            assert "unloads in" in panel.row("tiny").html.value
            assert "live" in panel.status_html.value
            await ac.unload("tiny")
            await await_until(lambda: panel.row("tiny") is None, timeout=8.0)
            assert "unloaded tiny:latest" in panel.events_html.value
        assert sync_calls == []
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
        assert gaps and max(gaps) < 1.0, f"the event loop stalled for {max(gaps):.2f}s"

        updates = panel.updates
        panel.stop()
        await await_until(lambda: not panel.running, timeout=5)
        assert "stopped" in panel.status_html.value
        await asyncio.sleep(0.2)
        assert panel.updates == updates

        # start again, then closing the widget ends the loop
        panel.interval = 0.1
        panel.start()
        await await_until(lambda: panel.updates > updates + 2, timeout=10)
        # a newer panel (the cell run again) takes over: the older one stops polling
        newer = RunningPanel(client, interval=0.1)
        try:
            assert newer.running
            await await_until(lambda: not panel.running, timeout=5)
            panel.start()
            await await_until(lambda: not newer.running, timeout=5)
        finally:
            newer.close()
        task = panel._task
        panel.close()
        await await_until(lambda: task.done(), timeout=5)
    finally:
        tick_task.cancel()
        panel.close()


@pytest.mark.engine
async def test_picker_runs_in_the_background_and_stops(manager, client, monkeypatch):
    picker = ModelPicker(client)  # on a running loop: actions are tasks on it
    sync_calls = []
    for meth in ("tags", "ps", "estimate", "devices", "load", "unload", "generate"):
        monkeypatch.setattr(client, meth, functools.partial(lambda _m, *a, **kw: sync_calls.append(_m), meth))
    try:
        await picker.wait_tasks(30)
        assert [v for _, v in picker.model_select.options] == ["other:latest", "tiny:latest"]
        picker.model_select.value = "tiny:latest"
        picker.ctx_input.value = 1024
        await picker.wait_tasks(30)
        assert picker.last_summary["model"] == "tiny:latest" and picker.last_summary["n_ctx"] == 1024

        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick_task = asyncio.ensure_future(ticker())
        seen = []
        picker.answer_html.observe(lambda ch: seen.append(ch["new"]), names="value")
        picker.num_predict_input.value = 8
        task = picker.run("Once upon a time")
        assert isinstance(task, asyncio.Task) and picker.run_button.disabled and not picker.stop_button.disabled
        await picker.wait_tasks(120)
        tick_task.cancel()
        assert picker.last_response["done"] is True and picker.updates >= 3
        assert len([v for v in seen if "<pre" in v]) >= 3
        assert len(ticks) >= 2, "the loop kept turning while the answer streamed"
        assert sync_calls == []

        # Stop in the middle of a long answer: the request ends on the server too
        picker.num_predict_input.value = 2000
        task = picker.run("Tell me a long story")
        await await_until(lambda: picker.updates >= 1, timeout=60)
        picker.stop_button.click()
        await picker.wait_tasks(30)
        assert task.cancelled() and "stopped" in picker.status_html.value
        assert not picker.run_button.disabled and picker.stop_button.disabled
        async with AsyncLlamaClient(manager.url, manager.token) as ac:
            async def idle():
                return all(m["refcount"] == 0 for m in (await ac.ps())["models"])

            deadline = time.monotonic() + 30
            while not await idle():
                assert time.monotonic() < deadline, "the stopped request still holds the model"
                await asyncio.sleep(0.05)
    finally:
        picker.close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.engine
def test_pull_progress_real_pull(client, make_model, tmp_path):
    import shutil

    src = make_model("w-pull", layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=9)
    shutil.copy(src, tmp_path / "pulled.gguf")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(tmp_path)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}/"
        w = PullProgress()
        final = pull_progress(client, base + "pulled.gguf", "pulled", display=False, widget=w)
        assert final["status"] == "success", final
        assert w.bar.value == 1.0 and w.bar.bar_style == "success"
        assert any(st.get("total") for st in w.statuses)
        assert "pulled:latest" in [m["name"] for m in client.tags()["models"]]

        bad = PullProgress()
        final = pull_progress(client, base + "missing.gguf", "missing", display=False, widget=bad)
        assert final["status"] == "error" and "404" in final["error"]
        assert bad.bar.bar_style == "danger" and "404" in bad.label.value
    finally:
        httpd.shutdown()
        httpd.server_close()
        try:
            client.delete("pulled")
        except Exception:  # noqa: BLE001
            pass


# ============================================================================ in a real kernel


def _run_cell(kc, code: str, timeout: float = 120) -> list[dict]:
    """Execute ``code``; every iopub message up to its idle status."""
    msg_id = kc.execute(code)
    msgs = []
    deadline = time.monotonic() + timeout
    while True:
        m = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        msgs.append(m)
        if (m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                and m["content"]["execution_state"] == "idle"):
            return msgs


def _outputs(msgs: list[dict]) -> list[tuple[str, str]]:
    out = []
    for m in msgs:
        t = m["msg_type"]
        if t == "stream":
            out.append((t, m["content"]["text"]))
        elif t in ("error", "display_data", "execute_result", "update_display_data"):
            out.append((t, json.dumps(m["content"])[:300]))
    return out


@pytest.mark.engine
def test_panel_in_a_kernel_updates_while_idle_and_prints_nothing(manager, client):
    from jupyter_client.manager import KernelManager

    env = dict(os.environ, JUPYTER_LLAMA_URL=manager.url, JUPYTER_LLAMA_TOKEN=manager.token)
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        msgs = _run_cell(kc, "from jupyter_llama.widgets import RunningPanel\n"
                             "p = RunningPanel(interval=0.3)\nprint('live', p.running)")
        assert _outputs(msgs) == [("stream", "live True\n")]

        # While the kernel is idle (no cell running), another client loads a model:
        # the panel sees it and says so through comm messages only.
        client.load("tiny", options=OPTS, keep_alive="30s")
        idle_msgs = []
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "no widget update while the kernel was idle"
            m = kc.get_iopub_msg(timeout=30)
            idle_msgs.append(m)
            if m["msg_type"] == "comm_msg" and "unloads in" in json.dumps(m["content"].get("data", {})):
                break
        assert _outputs(idle_msgs) == []

        # A cell that runs while the panel updates gets only its own output.
        msgs = _run_cell(kc, "import asyncio\nprint('cell starts')\nawait asyncio.sleep(1.5)\nprint('cell ends')")
        assert _outputs(msgs) == [("stream", "cell starts\n"), ("stream", "cell ends\n")]
        assert any(m["msg_type"] == "comm_msg" for m in msgs)  # the panel kept updating meanwhile

        client.unload("tiny")
        msgs = _run_cell(kc, "for _ in range(300):\n"
                             "    if not p.last_rows: break\n"
                             "    await asyncio.sleep(0.1)\n"
                             "print('rows', len(p.last_rows))")
        assert _outputs(msgs) == [("stream", "rows 0\n")]

        msgs = _run_cell(kc, "t = p._task\np.close()\nawait asyncio.sleep(0.2)\nprint('done', t.done(), p.running)")
        assert _outputs(msgs) == [("stream", "done True False\n")]

        # The picker's Run (as a click from the frontend would) streams on the kernel's loop
        # after the cell has finished, into the widget only.
        msgs = _run_cell(kc, "from jupyter_llama.widgets import ModelPicker\n"
                             "m = ModelPicker()\nawait m.wait_tasks(60)\n"
                             "m.model_select.value = 'tiny:latest'\nm.ctx_input.value = 1024\n"
                             "m.num_predict_input.value = 8\nm.prompt_input.value = 'Once upon a time'\n"
                             "m.run_button.click()\nprint('clicked', m._run_task is not None)")
        assert _outputs(msgs) == [("stream", "clicked True\n")]
        msgs = _run_cell(kc, "await m.wait_tasks(120)\n"
                             "print('answered', m.updates >= 1, m.last_response['done'])\nm.close()")
        assert _outputs(msgs) == [("stream", "answered True True\n")]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
