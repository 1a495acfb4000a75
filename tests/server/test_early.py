"""Stream requests sent to their child before their handler runs (server/early.py), over a
real Jupyter server's application, serve's FrontServer and real llama-server children: what
the handler would send goes ahead once a stream of the same shape has been answered, the
answers are the same as without it, and a request sent ahead that is not the handler's is
dropped at the child, never answered."""

from __future__ import annotations

import json

import httpx
import pytest
from srvutil import OPTS, wait_until

from jupyter_llama.engine import http1, native
from jupyter_llama.engine.runner import free_port
from jupyter_llama.server.front import _LeanConnection, front_for

pytestmark = pytest.mark.engine

GREEDY = dict(OPTS, num_predict=8, temperature=0, ignore_eos=True)


@pytest.fixture
async def served(jp_serverapp, jp_base_url, token):
    """(server, client) for serve's front over the test server's application, sending ahead."""
    native.library(wait=True)
    server = front_for(jp_serverapp)
    port = free_port()
    server.listen(port, "127.0.0.1")
    _SERVERS.append(server)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}{jp_base_url}llama/", trust_env=False,
                                     timeout=60, headers={"Authorization": f"token {token}"}) as c:
            yield server, c
    finally:
        _SERVERS.remove(server)
        server.stop()
        await server.close_all_connections()


_SERVERS: list = []  # the fronts the tests' requests go to (the served fixture's)


async def handlers_ended() -> None:
    """Wait for every request's handler to have ended: a client has an answer's end before its
    handler does (the C relay writes it), and a recipe is learned, and a lease released, only
    then; a request that must be sent ahead waits for the one before it."""
    await wait_until(lambda: not any(getattr(conn, "_answering", False) for server in _SERVERS
                                     for conn in server._connections), timeout=5)


async def generate(c: httpx.AsyncClient, prompt: str, **extra) -> list[dict]:
    body = {"model": "tiny", "prompt": prompt, "raw": True, "options": GREEDY, **extra}
    async with c.stream("POST", "api/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        chunks = [json.loads(ln) async for ln in r.aiter_lines() if ln.strip()]
    await handlers_ended()
    return chunks


async def counted(early, sent: int, taken: int, missed: int = 0) -> None:
    """Wait for the server to have counted (sent, taken, missed): a request's end is counted as
    its handler finishes, which can be after its client has the answer's end."""
    try:
        await wait_until(lambda: (early.sent, early.taken, early.missed) == (sent, taken, missed), timeout=5)
    except AssertionError:
        raise AssertionError(f"(sent, taken, missed) is {(early.sent, early.taken, early.missed)}, "
                             f"not {(sent, taken, missed)}") from None


def texts(chunks: list[dict]) -> str:
    return "".join(c.get("response", "") for c in chunks)


async def test_a_stream_of_a_shape_answered_before_goes_to_the_child_before_its_handler_runs(served, ext):
    server, c = served
    early = server.early
    first = await generate(c, "Once upon a time")
    assert first[-1]["done"] and first[-1]["eval_count"] == 8
    await wait_until(lambda: early.learned == 1, timeout=5)
    await counted(early, 0, 0)
    # another prompt, the same head and body around it: sent ahead, and taken by the handler
    second = await generate(c, "The quick brown fox \"quoted\" \u00e9\n")
    await counted(early, 1, 1)
    assert second[-1]["done"] and second[-1]["eval_count"] == 8 and second[-1]["prompt_eval_count"] > 1
    # the same answers as a request the handler sends itself (greedy: the same text)
    server.early = None
    assert texts(await generate(c, "The quick brown fox \"quoted\" \u00e9\n")) == texts(second)
    assert texts(await generate(c, "Once upon a time")) == texts(first)
    server.early = early
    assert texts(await generate(c, "Once upon a time")) == texts(first)
    await counted(early, 2, 2)

    # OpenAI's chat: the last message's content is the prompt
    for n, content in enumerate(["hello world", "good morning"]):
        r = await c.post("v1/chat/completions", json={"model": "tiny", "stream": True, "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        await handlers_ended()
        await counted(early, 2 + n, 2 + n)
    # a body of another shape (another option) is not sent ahead, and its answer teaches it
    await generate(c, "Once upon a time", keep_alive="5m")
    await counted(early, 3, 3)
    await generate(c, "In a small village", keep_alive="5m")
    await counted(early, 4, 4)


async def test_a_request_sent_ahead_that_is_not_the_handlers_is_dropped_and_its_recipe_never_learned(
        served, ext, monkeypatch):
    """When what the handler sends differs from what went ahead (here the child's request
    gains a field between two requests, as a changed preset would make it), the one sent
    ahead is closed and the handler's goes out on a connection of its own; the answer is
    the handler's, and that recipe is not used again."""
    server, c = served
    early = server.early
    await generate(c, "Once upon a time")
    await wait_until(lambda: early.learned == 1, timeout=5)
    real = http1.sse_request
    monkeypatch.setattr(http1, "sse_request", lambda payload, key: real(dict(payload, n_probs=0), key))
    chunks = await generate(c, "In a small village")
    await counted(early, 1, 0, 1)
    assert chunks[-1]["done"] and chunks[-1]["eval_count"] == 8
    sched = ext.scheduler
    assert [lo.refcount for lo in sched.loaded.values()] == [0]
    # that answer taught the new shape, which now sends what the handler no longer sends
    monkeypatch.setattr(http1, "sse_request", real)
    chunks = await generate(c, "Write a poem about")
    await counted(early, 2, 0, 2)
    assert chunks[-1]["eval_count"] == 8
    # and the shape that answer teaches is the first one, refused: nothing goes ahead any more
    await generate(c, "Once upon a time")
    await counted(early, 2, 0, 2)


async def test_nothing_goes_ahead_for_a_request_its_handler_refuses(served, ext, jp_base_url):
    """A head that differs (no token here) has no recipe, a model that is not loaded has no
    runner to send to, and a request whose answer was not a stream teaches nothing."""
    server, c = served
    early = server.early
    await generate(c, "Once upon a time")
    await wait_until(lambda: early.learned == 1, timeout=5)
    async with httpx.AsyncClient(base_url=c.base_url, trust_env=False, timeout=60) as anonymous:
        r = await anonymous.post("api/generate", json={"model": "tiny", "prompt": "x", "raw": True,
                                                       "options": GREEDY})
    assert r.status_code in (401, 403) and early.sent == 0
    r = await c.post("api/generate", json={"model": "tiny", "prompt": "x", "raw": True, "stream": False,
                                           "options": GREEDY})
    assert r.status_code == 200  # (a body of another shape: learned from, not sent ahead)
    await wait_until(lambda: early.learned == 2, timeout=5)
    await ext.scheduler.unload("tiny")
    chunks = await generate(c, "In a small village")  # the runner it was learned on is gone: loaded anew
    assert chunks[-1]["done"]
    await wait_until(lambda: early.learned == 3, timeout=5)
    await generate(c, "Write a poem about")
    await counted(early, 1, 1)


async def test_requests_sent_ahead_never_take_more_of_a_child_than_its_free_slots(served, ext):
    """Each request sent ahead holds one of the child's HTTP threads (it has its slots and two
    more) until its handler takes it: with one slot (and none taken), one goes ahead, and the
    next only once the first's handler has ended."""
    server, c = served
    early = server.early
    await generate(c, "Once upon a time")
    await wait_until(lambda: early.learned == 1, timeout=5)
    (key, [recipe]), = early._recipes.items()
    body = recipe.before + b'"In a small village"' + recipe.after
    head = key + b"\r\nContent-Length: %d" % len(body)
    first, second = early.intake(head, body), early.intake(head, body)
    assert first.ahead is not None and second.ahead is None and early.sent == 1
    early.end(second, 0)
    early.end(first, 0)  # (its handler ended without a stream: what was sent ahead is closed)
    assert first.ahead is None and early.sent == 1
    third = early.intake(head, body)
    assert third.ahead is not None and early.sent == 2
    early.end(third, 0)
    chunks = await generate(c, "Write a poem about")  # the child, after two requests dropped at it
    assert chunks[-1]["eval_count"] == 8


async def test_only_a_request_its_head_authenticates_teaches_what_to_send_ahead(served, ext):
    """A request with a login cookie, an XSRF header and a token that is not the server's (what
    an OpenAI client sends as its api_key) is answered, authenticated by its cookie; but the
    head a recipe keys on leaves cookies out, so such a request teaches nothing: a stranger
    with the same head and no cookie must not get the child to read a prompt."""
    server, c = served
    early = server.early
    assert (await c.get("api/version")).status_code == 200  # (the server sets its login cookie)
    login = {k: v for k, v in c.cookies.items() if k.startswith("username-")}
    assert login, dict(c.cookies)
    async with httpx.AsyncClient(base_url=c.base_url, trust_env=False, timeout=60,
                                 cookies={**login, "_xsrf": "made-up"},
                                 headers={"Authorization": "Bearer sk-no-key", "X-XSRFToken": "made-up"}) as cookied:
        for prompt in ("Once upon a time", "In a small village"):
            chunks = await generate(cookied, prompt)
            assert chunks[-1]["done"]
    await generate(c, "Write a poem about")  # (one with the token: it does teach)
    await wait_until(lambda: early.learned == 1, timeout=5)
    assert early.sent == 0


async def test_a_request_refused_after_its_recipe_was_learned_drops_the_recipe(served, ext, jp_serverapp):
    """The token a recipe was learned with is no longer the server's: the request sent ahead
    for it is closed when its handler refuses it, and that recipe goes."""
    server, c = served
    early = server.early
    await generate(c, "Once upon a time")
    await wait_until(lambda: early.learned == 1, timeout=5)
    c.cookies.clear()
    token_before = jp_serverapp.identity_provider.token
    jp_serverapp.identity_provider.token = "another-token"
    try:
        for _ in range(2):
            r = await c.post("api/generate", json={"model": "tiny", "prompt": "In a small village", "raw": True,
                                                   "options": GREEDY})
            assert r.status_code in (401, 403)
            c.cookies.clear()
        await counted(early, 1, 0)  # the first was sent ahead and dropped; its recipe went with it
    finally:
        jp_serverapp.identity_provider.token = token_before
    assert early._recipes == {} or all(not v for v in early._recipes.values())


async def test_a_streams_child_that_answers_an_error_still_gets_its_status_through_the_lean_front(
        served, ext, monkeypatch):
    """On serve's connection a stream goes to the C relay as soon as its request is sent,
    with our head made and held for it to send (server/front.py's lend_before_head).
    A child that answers with an error's status instead gives that back unread: the client
    gets a 400 with a sentence, not a 200 with an error line. A chat longer than the context
    is refused by the child, then sent again shorter (its head made unsaid, then made again,
    its login cookie once), and later streams are whole."""
    server, c = served
    heads = []  # how far each hand-back's relay got with the heads (None: lent after the child's head)
    take_back = _LeanConnection.take_back

    def told(self, unsent, gone, ended=False, head=None):
        heads.append(head)
        return take_back(self, unsent, gone, ended, head)

    monkeypatch.setattr(_LeanConnection, "take_back", told)
    # a grammar the child cannot read: it answers 400 before any token
    r = await c.post("v1/chat/completions", json={"model": "tiny", "stream": True, "max_tokens": 3,
                                                  "grammar": "root ::= (((",
                                                  "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 400, r.text
    assert "failed to parse grammar" in r.json()["error"]["message"]
    assert heads == [native.HEAD_UNREAD]
    await handlers_ended()
    # longer than the context: refused, then cut to its last turn and sent again
    messages = [{"role": "user", "content": "once upon a time " * 1000}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "hello"}]
    async with c.stream("POST", "v1/chat/completions",
                        json={"model": "tiny", "stream": True, "max_tokens": 3, "messages": messages}) as r:
        text = (await r.aread()).decode()
    assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]") and '"content":' in text, text
    assert len(r.headers.get_list("set-cookie")) <= 1 and r.headers["content-type"].startswith("text/event-stream")
    await handlers_ended()  # (the relay hands the socket back after the client has the answer's end)
    assert heads[1:] == [native.HEAD_UNREAD, native.HEAD_SENT]
    relayed = native.relayed_events
    chunks = await generate(c, "Once upon a time")
    assert chunks[-1]["done"] and chunks[-1]["eval_count"] == 8 and texts(chunks)
    assert native.relayed_events > relayed  # (its tokens went below Python)
    assert heads[3] == native.HEAD_SENT  # (and our head with them)
