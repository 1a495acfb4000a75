"""Users' servers started by the Hub find the shared manager with no setup of their own: the
spawner settings (jupyter_llama.hub.spawner) give them its URL and their token, and their
llama/ routes (the JupyterLab panel's) relay to it instead of running a manager."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from jupyter_llama.hub.spawner import environment, server_token_scopes

pytestmark = pytest.mark.engine


class FakeSpawner:
    api_token = "the-servers-own-token"


def test_the_spawner_settings():
    env = environment("http://hub.example/services/llama/")
    assert env["JUPYTER_LLAMA_URL"] == "http://hub.example/services/llama/llama/"
    assert env["OLLAMA_HOST"] == "http://hub.example/services/llama/llama"
    assert env["OPENAI_BASE_URL"] == "http://hub.example/services/llama/llama/v1"
    for key in ("JUPYTER_LLAMA_TOKEN", "OLLAMA_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        assert env[key](FakeSpawner()) == "the-servers-own-token"  # the Hub calls it with each server's spawner
    assert server_token_scopes("llama")[-1] == "access:services!service=llama"


def _wait_ready(hub, user: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = hub.api("GET", f"users/{user}").json()
        server = (model.get("servers") or {}).get("")
        if server and server.get("ready"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{user}'s server did not start:\n{hub.read_log()[-4000:]}")


def test_a_users_server_relays_to_the_shared_manager(hub):
    r = hub.api("POST", "users/alice/server")
    assert r.status_code in (201, 202), r.text
    try:
        _wait_ready(hub, "alice")
        alice = {"Authorization": f"token {hub.token('alice')}"}
        base = f"{hub.url}/user/alice/llama/"
        # the server's own llama/ route answers as the shared manager, for alice
        r = httpx.get(base + "api/me", headers=alice, trust_env=False, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["name"] == "alice" and r.json()["shared"] is True
        # a stream comes through as it is made
        lines = []
        with httpx.stream("POST", base + "api/generate", headers=alice, trust_env=False, timeout=120,
                          json={"model": "tiny", "prompt": "hi", "options": {"num_predict": 3, "num_ctx": 256}}) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(x) for x in s.iter_lines() if x]
        assert lines[-1]["done"] is True and len(lines) >= 2
        # the model it loaded is the shared manager's (the one ps there shows), used by alice
        with hub.client("admin") as admin:
            models = admin.get("api/ps").json()["models"]
        assert any(m["name"] == "tiny:latest" and "alice" in m.get("used_by", []) for m in models), models
        # an error of the shared manager's comes back as it was
        r = httpx.post(base + "api/show", headers=alice, json={"model": "no-such"}, trust_env=False, timeout=60)
        assert r.status_code == 404 and "not found" in r.json()["error"]
        # bob may not use alice's server (the Hub's rule for it), so not her token either
        r = httpx.get(base + "api/me", headers={"Authorization": f"token {hub.token('bob')}"}, trust_env=False,
                      timeout=60)
        assert r.status_code in (403, 404)
    finally:
        hub.api("DELETE", "users/alice/server")
