"""Streaming, disconnects, crashes, the queue limit and idle-culler activity, on real children."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import pytest
from srvutil import LONG, OPTS, lines, wait_until

from jupyter_llama.engine.runner import CRASH_MESSAGE

pytestmark = pytest.mark.engine

LONG_GEN = {"model": "tiny", "prompt": "Once", "raw": True, "options": dict(LONG, num_predict=3000)}


def loaded(ext, name="tiny:latest"):
    return next((lo for lo in ext.scheduler.loaded.values() if lo.name == name), None) if ext.scheduler else None


async def slot_busy(lo) -> bool:
    slots = await lo.runner.get("/slots")
    return any(s.get("is_processing") for s in slots)


async def test_first_chunk_arrives_while_generation_runs(http, ext):
    await http.post("api/generate", json={"model": "tiny", "options": LONG})  # load first
    lo = loaded(ext)
    body = dict(LONG_GEN, options=dict(LONG, num_predict=3000))
    t0 = time.monotonic()
    arrivals = []
    async with http.stream("POST", "api/generate", json=body) as r:
        async for ln in r.aiter_lines():
            if not ln.strip():
                continue
            chunk = json.loads(ln)
            arrivals.append((time.monotonic() - t0, chunk))
            if len(arrivals) == 1:
                # the first token is here; the request still holds the runner and the child still works
                assert chunk["done"] is False
                assert lo.refcount == 1
                assert await slot_busy(lo)
    first, last = arrivals[0], arrivals[-1]
    assert last[1]["done"] is True and last[1]["eval_count"] == 3000
    assert len(arrivals) > 100  # chunk by chunk, not one buffered body
    assert first[0] < last[0]


async def test_disconnect_stops_generation_and_releases_runner(http, ext):
    await http.post("api/generate", json={"model": "tiny", "options": LONG})
    lo = loaded(ext)
    for path, body in (("api/generate", LONG_GEN),
                       ("api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                     "options": dict(LONG, num_predict=3000)})):
        async with http.stream("POST", path, json=body) as r:
            async for ln in r.aiter_lines():
                if ln.strip():
                    break  # first chunk: leave
            assert lo.refcount == 1
        await wait_until(lambda: lo.refcount == 0)
        await wait_until(lambda: ext.scheduler.in_flight == 0)

        async def idle_slot():
            slots = await lo.runner.get("/slots")
            return None if any(s.get("is_processing") for s in slots) else slots[0]

        # Cancelled or not, the child goes idle within a second here (3000 tokens of a tiny model);
        # what tells them apart is how many tokens it made: all of them, or the few before the cancel.
        slot = await wait_until(idle_slot, timeout=60)
        decoded = slot["next_token"][0]["n_decoded"]
        assert decoded < 3000, f"{path}: the child kept generating after the client left ({decoded} tokens)"
    assert ext.current_activity() is None
    # the runner is healthy and serves the next request
    r = await http.post("api/generate", json=dict(LONG_GEN, stream=False, options=dict(LONG, num_predict=3)))
    assert r.status_code == 200 and r.json()["eval_count"] == 3
    assert loaded(ext).runner.pid == lo.runner.pid


async def test_disconnect_during_openai_sse(http, ext):
    await http.post("api/generate", json={"model": "tiny", "options": LONG})
    lo = loaded(ext)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "stream": True}
    async with http.stream("POST", "v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        async for ln in r.aiter_lines():
            if ln.startswith("data:"):
                break
    await wait_until(lambda: lo.refcount == 0, timeout=1.0)


async def test_child_killed_mid_stream_ends_with_an_error_line(http, ext):
    await http.post("api/generate", json={"model": "tiny", "options": LONG})
    lo = loaded(ext)
    pid = lo.runner.pid
    got = []
    async with http.stream("POST", "api/generate", json=LONG_GEN) as r:
        assert r.status_code == 200
        async for ln in r.aiter_lines():
            if not ln.strip():
                continue
            got.append(json.loads(ln))
            if len(got) == 1:
                os.kill(pid, signal.SIGKILL)
    assert len(got) >= 2
    assert set(got[-1]) == {"error"} and got[-1]["error"].startswith(CRASH_MESSAGE), got[-1]
    assert not any(c.get("done") for c in got)
    # the next request loads it again
    r = await http.post("api/generate", json=dict(LONG_GEN, stream=False, options=dict(LONG, num_predict=2)))
    assert r.status_code == 200, r.text
    assert loaded(ext).runner.pid != pid


async def test_error_before_output_is_an_http_status(http, ext):
    """A child that is already dead when a request arrives: reloaded, never a half stream."""
    await http.post("api/generate", json={"model": "tiny", "options": OPTS})
    lo = loaded(ext)
    os.kill(lo.runner.pid, signal.SIGKILL)
    await wait_until(lambda: loaded(ext) is None, timeout=5)  # the scheduler noticed
    r = await http.post("api/generate", json={"model": "tiny", "prompt": "x", "raw": True,
                                              "options": dict(OPTS, num_predict=2)})
    assert r.status_code == 200 and lines(r.content)[-1]["done"] is True


@pytest.mark.llama_config(max_queue=1)
async def test_queue_full_is_503(http, ext):
    body = {"model": "tiny", "prompt": "x", "raw": True, "stream": False, "options": dict(OPTS, num_predict=2)}
    results = await asyncio.gather(*(http.post("api/generate", json=body) for _ in range(4)))
    codes = sorted(r.status_code for r in results)
    assert 200 in codes and 503 in codes, codes
    busy = next(r for r in results if r.status_code == 503).json()["error"]
    assert "server busy" in busy and "JUPYTER_LLAMA_MAX_QUEUE" in busy
    assert any(e.kind == "busy" for e in ext.scheduler.events.history)
    # OpenAI clients get the same status, in their error format
    results = await asyncio.gather(
        http.post("api/generate", json={"model": "other", "options": OPTS}),
        http.post("v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}],
                                               "max_tokens": 1}))
    if results[1].status_code == 503:
        assert results[1].json()["error"]["message"].startswith("server busy")


async def test_activity_for_the_idle_culler(http, ext, jp_serverapp):
    settings = jp_serverapp.web_app.settings
    assert ext.current_activity() is None
    await http.post("api/generate", json={"model": "tiny", "options": LONG})
    lo = loaded(ext)
    async with http.stream("POST", "api/generate", json=LONG_GEN) as r:
        async for ln in r.aiter_lines():
            if ln.strip():
                break
        act = ext.current_activity()
        assert act and act["in_flight"] == 1 and act["requests"] == 1
        started = settings["last_activity_times"]["jupyter_llama"]
        await asyncio.sleep(0.35)  # the ticker (every 0.1 s here) stamps while the request runs
        if lo.refcount == 1:
            assert settings["last_activity_times"]["jupyter_llama"] > started
            assert jp_serverapp.web_app.last_activity() >= settings["last_activity_times"]["jupyter_llama"]
    await wait_until(lambda: ext.current_activity() is None, timeout=1.0)
    assert loaded(ext) is not None  # loaded but idle: not activity, the culler may stop the server
    # a panel polling read-only routes does not count as activity either
    before = settings.get("api_last_activity")
    last_times = dict(settings["last_activity_times"])
    for path in ("api/ps", "api/tags", "api/version", "api/devices", "api/events", "v1/models"):
        assert (await http.get(path)).status_code == 200
    assert settings.get("api_last_activity") == before
    assert settings["last_activity_times"] == last_times


async def test_url_exported_for_kernels(http, ext, jp_base_url):
    await http.get("api/version")
    url = os.environ["JUPYTER_LLAMA_URL"]
    assert url == ext.url and url.endswith(jp_base_url + "llama/")


@pytest.fixture
async def wedgeable(http, ext, monkeypatch):
    """The pid of tiny's loaded child, with stall timers short enough for a test; a child the
    test stopped (SIGSTOP) and the manager did not kill is let go again afterwards."""
    from jupyter_llama.engine import runner as runner_mod

    monkeypatch.setattr(runner_mod, "STALL_CHECK_S", 0.3)
    monkeypatch.setattr(runner_mod, "STALL_HEALTH_TIMEOUT_S", 0.3)
    await http.post("api/generate", json={"model": "tiny", "options": LONG})
    pid = loaded(ext).runner.pid
    yield pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


async def assert_replaced(http, ext, pid: int) -> None:
    """The next request gets a fresh child."""
    r = await http.post("api/generate", json=dict(LONG_GEN, stream=False, options=dict(LONG, num_predict=2)))
    assert r.status_code == 200, r.text
    assert loaded(ext).runner.pid != pid


async def test_a_wedged_child_ends_the_stream_with_an_error_and_is_replaced(http, ext, wedgeable):
    """Issue 17 item 5: a child that stops answering (SIGSTOP) does not hang its requests:
    with no byte and no /health answer for the stall interval it is killed, the stream ends
    with an error line that says so, and the next request gets a fresh child."""
    got = []
    async with http.stream("POST", "api/generate", json=LONG_GEN) as r:
        async for ln in r.aiter_lines():
            if ln.strip():
                got.append(json.loads(ln))
                if len(got) == 1:
                    os.kill(wedgeable, signal.SIGSTOP)
    assert set(got[-1]) == {"error"} and "stopped answering" in got[-1]["error"], got[-1]
    await assert_replaced(http, ext, wedgeable)


async def test_a_wedged_child_fails_a_request_that_is_not_streamed(http, ext, wedgeable):
    """The same for answers in one piece (here a non-streamed OpenAI completion)."""
    os.kill(wedgeable, signal.SIGSTOP)
    r = await http.post("v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and "stopped answering" in r.json()["error"]["message"], r.text
    await assert_replaced(http, ext, wedgeable)


async def test_a_wedged_child_fails_the_count_of_a_context_too(http, ext, wedgeable):
    """Counting the tokens of a generate with Ollama's ``context`` (here before the answer
    starts: the prompt may not fit) is watched like every request to the child: a wedged child
    fails it, saying so, rather than holding the request (and its model) forever."""
    os.kill(wedgeable, signal.SIGSTOP)
    # (a template of the request's own: the prompt is made here, not by the child's)
    r = await http.post("api/generate", json={"model": "tiny", "prompt": "Once upon a time " * 400,
                                              "template": "{{ .Prompt }}", "context": [1] * 64,
                                              "stream": False, "options": LONG})
    assert r.status_code == 500 and "stopped answering" in r.json()["error"], r.text
    await assert_replaced(http, ext, wedgeable)
