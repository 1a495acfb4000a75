"""Model names with control characters in them (issue 58 item 6).

``{"model": "/\\u0000"}`` was a 500 "internal error" on a dozen routes: the name is no model
name, so it was tried as a file path, and the NUL reached the file system (``ValueError:
embedded null byte``). A NUL or any other control character (C0, DEL) is now refused where
names and paths are told apart (``models/names.py``), so every route that takes a name
answers 400 with a sentence saying what a name may hold, and echoes no Python repr of it.
No model is loaded here: each request is refused before any would be.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

BAD = ["/\u0000", "a\u0000b", "x\u0007", "\u0000", "ti\u007fny", "/tmp/\u001b[31m.gguf"]

MESSAGES = [{"role": "user", "content": "hi"}]


def _bodies(bad: str) -> list[tuple[str, dict]]:
    """(route, body) for every route that takes a model name, the bad name in each name field
    (a route is POSTed, unless it starts with another method)."""
    return [
        ("api/generate", {"model": bad, "prompt": "hi", "stream": False}),
        ("api/generate", {"model": bad, "prompt": "hi"}),  # streamed: refused before the stream starts
        ("api/generate", {"model": bad, "keep_alive": 0, "stream": False}),  # an unload
        ("api/chat", {"model": bad, "messages": MESSAGES, "stream": False}),
        ("api/embed", {"model": bad, "input": "hi"}),
        ("api/embeddings", {"model": bad, "prompt": "hi"}),
        ("api/show", {"model": bad}),
        ("api/show", {"model": bad, "verbose": True}),
        ("api/copy", {"source": bad, "destination": "copied"}),
        ("api/copy", {"source": "tiny", "destination": bad}),
        ("DELETE api/delete", {"model": bad}),
        ("api/create", {"model": bad, "from": "tiny", "stream": False}),
        ("api/create", {"model": "made", "from": bad, "stream": False}),
        ("api/pull", {"model": bad, "stream": False}),
        ("api/pull", {"model": bad}),
        ("api/estimate", {"model": bad}),
        ("v1/chat/completions", {"model": bad, "messages": MESSAGES}),
        ("v1/completions", {"model": bad, "prompt": "hi"}),
        ("v1/embeddings", {"model": bad, "input": "hi"}),
        ("v1/responses", {"model": bad, "input": "hi"}),
        ("v1/responses/input_tokens", {"model": bad, "input": "hi"}),
        ("v1/messages", {"model": bad, "max_tokens": 8, "messages": MESSAGES}),
        ("v1/messages/count_tokens", {"model": bad, "messages": MESSAGES}),
    ]


def _message(body: dict) -> str:
    err = body.get("error")
    if isinstance(err, dict):  # OpenAI's and Anthropic's shapes
        return err["message"]
    return err


async def test_a_control_character_in_a_name_is_a_400_with_a_sentence(http, ext):
    before = sorted(e.display for e in ext.store.list())
    for bad in BAD:
        for route, body in _bodies(bad):
            method, _, path = route.rpartition(" ")
            r = await http.request(method or "POST", path, json=body)
            where = (route, body, r.status_code, r.text)
            assert r.status_code == 400, where
            message = _message(r.json())
            assert isinstance(message, str), where
            assert "has a control character (U+" in message, where
            assert "a model name may hold only letters, digits" in message, where
            assert "[host/][namespace/]model[:tag]" in message, where
            assert "internal error" not in r.text.lower(), where
            # no Python repr of the name ('a\x00b'), nor the character itself
            assert "\\x" not in message and "'" + bad not in message, where
            assert not any(ch < " " or ch == "\u007f" for ch in message), where
    # the character it names, and where
    r = await http.post("api/show", json={"model": "a\u0000b"})
    assert "(U+0000) at character 2" in r.json()["error"]
    r = await http.post("v1/chat/completions", json={"model": "x\u0007", "messages": MESSAGES})
    assert "(U+0007) at character 2" in r.json()["error"]["message"]
    assert sorted(e.display for e in ext.store.list()) == before  # nothing made, copied or deleted
    assert (await http.get("api/ps")).json()["models"] == []  # and nothing loaded


async def test_names_in_urls_and_around_control_characters(http):
    # a name in a URL: not found (no such model can exist), never a 500
    for path in ("v1/models/a%00b", "v1/models/%2F%00"):
        r = await http.get(path)
        assert r.status_code in (400, 404) and "internal error" not in r.text.lower(), (path, r.text)
    # space, tab and line ends around a name are still read away, as before
    r = await http.post("api/show", json={"model": " tiny\n"})
    assert r.status_code == 200, r.text
    # one inside a name is refused, even where str.strip() would take it for white space
    r = await http.post("api/show", json={"model": "ti\u001fny"})
    assert r.status_code == 400 and "(U+001F) at character 3" in r.json()["error"], r.text
