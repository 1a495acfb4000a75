"""jupyter-llama serve as a JupyterHub service: every request is someone's, as the Hub says."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.engine


def test_each_token_is_its_owner(hub):
    for user, groups in (("alice", []), ("carol", ["staff"])):
        with hub.client(user) as c:
            r = c.get("api/me")
            assert r.status_code == 200, r.text
            me = r.json()
            assert (me["name"], me["groups"], me["admin"], me["shared"]) == (user, groups, False, True)
            assert me["namespace"] == user
    with hub.client("admin") as c:
        assert c.get("api/me").json()["admin"] is True


def test_no_token_is_a_401_that_says_what_to_send(hub):
    with hub.client(None) as c:
        r = c.get("api/ps")
        assert r.status_code == 401
        assert "JupyterHub API token" in r.json()["error"]
        r = c.get("api/ps", headers={"Authorization": "token not-a-token"})
        assert r.status_code == 401
        # the root answers anyone, as Ollama's does
        assert c.get("").text == "jupyter-llama is running"


def test_a_token_without_the_services_scope_is_refused(hub):
    tok = hub.token("bob", scopes=["read:users:name!user"])  # a token for something else
    r = httpx.get(hub.service_url + "api/ps", headers={"Authorization": f"token {tok}"}, trust_env=False, timeout=30)
    assert r.status_code == 403
    assert "may not use this service" in r.json()["error"] and "access:services" in r.json()["error"]


def test_clients_send_their_own_token_as_key(hub):
    """Ollama's and OpenAI's clients, given a user's token as their key, are that user."""
    import ollama
    import openai

    tok = hub.token("bob")
    o = ollama.Client(host=hub.service_url.rstrip("/"), headers={"Authorization": f"Bearer {tok}"})
    assert o.generate(model="tiny", prompt="hi", options={"num_predict": 2, "num_ctx": 256}).done
    ps = o.ps()
    assert [m.model for m in ps.models] == ["tiny:latest"]
    oc = openai.OpenAI(base_url=hub.service_url + "v1", api_key=tok)
    assert oc.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    with hub.client("bob") as c:
        assert c.get("api/me").json()["requests_last_minute"] >= 2


def test_a_browser_logs_in_through_the_hubs_oauth(hub):
    """No token: the service's login sends the browser through the Hub's OAuth, and its cookie
    then says who it is (for this service's path alone)."""
    with httpx.Client(base_url=hub.url, follow_redirects=True, timeout=60, trust_env=False) as browser:
        r = browser.get("/services/llama/login", params={"next": "/services/llama/llama/api/me"})
        # the Hub's login form (its Dummy authenticator takes any password)
        assert "/hub/login" in str(r.url), r.url
        xsrf = browser.cookies.get("_xsrf", path="/hub/")
        r = browser.post(str(r.url), data={"username": "carol", "password": "x", "_xsrf": xsrf or ""})
        assert r.status_code == 200, (r.url, r.text[:500])
        assert str(r.url).endswith("/services/llama/llama/api/me"), r.url
        assert r.json()["name"] == "carol"
        # a login page may not send a browser anywhere but this service
        r = browser.get("/services/llama/login", params={"next": "http://elsewhere.example/"},
                        follow_redirects=False)
        assert r.status_code == 302
        assert "elsewhere" not in httpx.URL(r.headers["location"]).params.get("redirect_uri", "")
