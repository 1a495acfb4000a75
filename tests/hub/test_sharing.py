"""One manager, several Hub users: a shared model, users' own models, quotas hit, fair turns,
who holds what (ps, events, /metrics), each as the Hub's users see it."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.engine

SHORT = {"num_predict": 2, "num_ctx": 256}


def generate(c: httpx.Client, model: str, **extra) -> httpx.Response:
    return c.post("api/generate", json={"model": model, "prompt": "hi", "stream": False, "options": SHORT, **extra})


def unload(c: httpx.Client, model: str) -> httpx.Response:
    """Ollama's way to unload a model: no prompt, keep_alive 0."""
    return c.post("api/generate", json={"model": model, "keep_alive": 0})


def by_name(ps: dict) -> dict:
    return {m["name"]: m for m in ps["models"]}


def test_a_shared_model_and_private_ones(hub):
    with hub.client("alice") as alice, hub.client("bob") as bob, hub.client("carol") as carol, \
            hub.client("admin") as admin:
        assert generate(alice, "tiny").status_code == 200
        assert generate(bob, "tiny").status_code == 200
        # one runner for both; each sees their own part of who uses it, the admin everyone's
        everyone = by_name(admin.get("api/ps").json())["tiny:latest"]
        assert everyone["loaded_by"] == "alice" and everyone["used_by"] == ["alice", "bob"]
        mine = by_name(bob.get("api/ps").json())["tiny:latest"]
        assert (mine["loaded_by"], mine["used_by"], mine["other_users"]) == (None, ["bob"], 1)
        assert len(admin.get("api/ps").json()["models"]) == 1
        # bob may not stop what alice's request loaded, nor have it unloaded after his answer
        r = unload(bob, "tiny")
        assert r.status_code == 403 and "another user's request loaded it" in r.json()["error"]
        assert generate(bob, "tiny", keep_alive=0).status_code == 200
        assert "tiny:latest" in by_name(admin.get("api/ps").json())

        # carol's own model (a copy of another file: a runner of its own): hers to load and
        # stop, nobody else's to see
        assert carol.post("api/copy", json={"source": "other", "destination": "carol/mine"}).status_code == 200
        assert generate(carol, "carol/mine").status_code == 200
        assert "carol/mine:latest" in [m["name"] for m in admin.get("api/tags").json()["models"]]
        assert "carol/mine:latest" not in [m["name"] for m in bob.get("api/tags").json()["models"]]
        assert "carol/mine:latest" not in by_name(bob.get("api/ps").json())
        assert "carol/mine:latest" in by_name(admin.get("api/ps").json())
        for r in (generate(bob, "carol/mine"), unload(bob, "carol/mine"),
                  bob.post("api/show", json={"model": "carol/mine"}),
                  bob.request("DELETE", "api/delete", json={"model": "carol/mine"}),
                  bob.get("v1/models/carol/mine"), bob.get("api/log", params={"model": "carol/mine"})):
            assert r.status_code == 404, r.text
        bob_events = bob.get("api/events").json()["events"]
        assert not [e for e in bob_events if e["model"] and e["model"].startswith("carol/")]
        assert all(e["data"].get("user") in (None, "bob") for e in bob_events)
        assert any(e["data"].get("user") == "carol" for e in admin.get("api/events").json()["events"])
        assert "carol/mine:latest" in by_name(admin.get("api/ps").json())  # still loaded
        assert unload(carol, "carol/mine").status_code == 200
        assert "carol/mine:latest" not in by_name(admin.get("api/ps").json())

        # the shared library is the admin's; a user's own namespace is theirs
        r = bob.post("api/copy", json={"source": "tiny", "destination": "tiny-copy"})
        assert r.status_code == 403 and "shared library is the admin's" in r.json()["error"] \
            and "bob/tiny-copy" in r.json()["error"]
        assert bob.post("api/copy", json={"source": "tiny", "destination": "bob/tiny-copy"}).status_code == 200
        assert admin.post("api/copy", json={"source": "tiny", "destination": "tiny-copy"}).status_code == 200

        # quota 'models' (default 1): alice's request loaded tiny, so not a second one
        r = generate(alice, "other")
        assert r.status_code == 507
        assert "quota 'models' (default) allows (1)" in r.json()["error"]
        r = alice.post("v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 507 and "quota 'models'" in r.json()["error"]["message"]


def test_requests_over_their_quotas(hub):
    with hub.client("dave") as dave:  # per_minute 3
        for _ in range(3):
            assert generate(dave, "tiny").status_code == 200
        r = generate(dave, "tiny")
        assert r.status_code == 429, r.text
        assert "quota 'per_minute' (user dave) allows (3)" in r.json()["error"]
    # erin's concurrent 1: a second request while her first is in flight. The first is held
    # there by stopping the model's child (a short answer may otherwise end before the second
    # is sent), as in test_turns_go_round_the_users.
    with hub.client("admin") as admin:
        pid = by_name(admin.get("api/ps").json())["tiny:latest"]["pid"]
    first: list[int] = []

    def ask_first() -> None:
        with hub.client("erin") as c:
            first.append(generate(c, "tiny").status_code)

    with hub.client("erin") as erin:
        os.kill(pid, signal.SIGSTOP)
        try:
            holder = threading.Thread(target=ask_first)
            holder.start()
            _until(lambda: erin.get("api/me").json()["in_flight"] == 1)
            r = generate(erin, "tiny")
            assert r.status_code == 429 and "quota 'concurrent' (user erin)" in r.json()["error"], r.text
        finally:
            os.kill(pid, signal.SIGCONT)
        holder.join(120)
        assert first == [200]
        assert generate(erin, "tiny").status_code == 200  # her first has finished
    with hub.client("erin") as erin:
        me = erin.get("api/me").json()
        assert me["quota"]["concurrent"] == 1 and me["in_flight"] == 0
    with hub.client("admin") as admin:
        r = admin.get("metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
        assert 'jupyter_llama_refusals_total{user="dave",quota="per_minute"} 1' in text
        assert 'jupyter_llama_refusals_total{user="erin",quota="concurrent"} 1' in text
        assert 'jupyter_llama_requests_total{model="tiny",user="dave"} 3' in text
        assert 'jupyter_llama_model_loaded_bytes{model="tiny:latest",device="cpu"}' in text
        assert 'jupyter_llama_generated_tokens_total{model="tiny:latest",user="dave"}' in text
    with hub.client("bob") as bob:  # the numbers are everyone's: an admin's
        r = bob.get("metrics")
        assert r.status_code == 403 and "only this service's admins" in r.json()["error"]


def test_a_copy_shares_the_runner_and_a_refusal_unloads_nothing(hub):
    """Another name of a loaded file, asking for no options, shares its runner (the service's
    configured slots are no difference); a request over its quota that would reload another
    user's runner (other options) is refused before that runner is stopped."""
    with hub.client("admin") as admin, hub.client("carol") as carol, hub.client("erin") as erin:
        for name in by_name(admin.get("api/ps").json()):
            assert unload(admin, name).status_code == 200
        assert generate(carol, "other").status_code == 200
        pid = by_name(admin.get("api/ps").json())["other:latest"]["pid"]
        since = max([e["seq"] for e in admin.get("api/events").json()["events"]] or [0])
        assert erin.post("api/copy", json={"source": "other", "destination": "erin/mine"}).status_code == 200
        assert generate(erin, "erin/mine").status_code == 200
        ps = by_name(admin.get("api/ps").json())
        assert list(ps) == ["other:latest"] and ps["other:latest"]["pid"] == pid
        assert ps["other:latest"]["used_by"] == ["carol", "erin"]
        assert generate(erin, "tiny").status_code == 200  # her one model (quota 'models' 1)
        r = generate(erin, "erin/mine", options={"num_predict": 2, "num_ctx": 512})  # (a reload of carol's)
        assert r.status_code == 507 and "quota 'models'" in r.json()["error"], r.text
        assert by_name(admin.get("api/ps").json())["other:latest"]["pid"] == pid
        events = admin.get("api/events", params={"since": since}).json()["events"]
        assert not [e for e in events if e["kind"] in ("reload", "unload") and e["model"] == "other:latest"], events
        for name in ("other", "tiny"):
            assert unload(admin, name).status_code == 200


def test_streamed_openai_answers_count_their_tokens(hub):
    """/metrics counts the tokens of streamed OpenAI answers too (the child's last event's timings)."""
    def counted(admin) -> float:
        for line in admin.get("metrics").text.splitlines():
            if line.startswith('jupyter_llama_generated_tokens_total{model="tiny:latest",user="bob"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    with hub.client("admin") as admin, hub.client("bob") as bob:
        before = counted(admin)
        for route, body in (("v1/completions", {"prompt": "hi"}),
                            ("v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            with bob.stream("POST", route, json={"model": "tiny", "max_tokens": 3, "stream": True,
                                                 "ignore_eos": True, **body}) as r:
                assert r.status_code == 200
                assert [x for x in r.iter_lines() if x][-1] == "data: [DONE]"
        assert counted(admin) == before + 6


def test_turns_go_round_the_users(hub):
    """One slot (num_parallel 1), held while alice queues six requests and then bob one: bob's
    waits behind at most one of hers, measured by the order of the service's turn events (the
    slot is held by stopping the model's child for that while: SIGSTOP, then SIGCONT)."""
    with hub.client("admin") as admin, hub.client("alice") as alice:
        assert generate(alice, "tiny").status_code == 200
        pid = by_name(admin.get("api/ps").json())["tiny:latest"]["pid"]
        since = max([e["seq"] for e in admin.get("api/events").json()["events"]] or [0])
        results: dict[str, list[int]] = {"alice": [], "bob": []}

        def ask(user: str, predict: int) -> None:
            with hub.client(user) as c:
                r = c.post("api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                 "options": {"num_predict": predict, "num_ctx": 256}})
                results[user].append(r.status_code)

        # The child is stopped first: the next request takes the one slot and waits in it
        # (nothing is answered) until the child goes on, so the rest must queue.
        os.kill(pid, signal.SIGSTOP)
        try:
            holder = threading.Thread(target=ask, args=("alice", 2))
            holder.start()
            _until(lambda: 'jupyter_llama_model_requests_in_flight{model="tiny:latest"} 1' in admin.get("metrics").text)
            threads = [threading.Thread(target=ask, args=("alice", 2)) for _ in range(6)]
            for t in threads:
                t.start()
            _until(lambda: _count(admin, since, "queue", "alice") == 6)
            bobs = threading.Thread(target=ask, args=("bob", 2))
            bobs.start()
            threads.append(bobs)
            _until(lambda: _count(admin, since, "queue", "bob") == 1)
        finally:
            os.kill(pid, signal.SIGCONT)
        holder.join(120)
        for t in threads:
            t.join(120)
        assert results == {"alice": [200] * 7, "bob": [200]}, results
        turns = [e["data"]["user"] for e in admin.get("api/events", params={"since": since}).json()["events"]
                 if e["kind"] == "turn"]
        assert sorted(turns) == ["alice"] * 6 + ["bob"]
        assert turns.index("bob") <= 1, turns


def _count(admin: httpx.Client, since: int, kind: str, user: str) -> int:
    events = admin.get("api/events", params={"since": since}).json()["events"]
    return sum(1 for e in events if e["kind"] == kind and e["data"].get("user") == user)


def _until(cond, timeout: float = 60.0) -> None:
    """Poll until ``cond()`` holds (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)
