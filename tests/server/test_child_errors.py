"""What llama-server refuses in a request body is the client's 400, with the child's own words
(issue 17 item 7): b11434 answers some of its body checks with a 500 "server_error".

Each request goes to a real child through the OpenAI routes, which pass the body on.
"""

from __future__ import annotations

import pytest
from srvutil import OPTS

from jupyter_llama.engine.http1 import child_error

pytestmark = pytest.mark.engine

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


async def _load(http):
    r = await http.post("api/generate", json={"model": "tiny", "options": OPTS})
    assert r.status_code == 200, r.text


async def test_an_image_for_a_model_without_a_projector_is_400(http):
    await _load(http)
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]}
    for stream in (False, True):
        r = await http.post("v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "image input is not supported" in err["message"] and "llama-server refused" in err["message"]
    # the child is fine afterwards
    r = await http.post("v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


async def test_conflicting_constraints_are_400(http):
    await _load(http)
    r = await http.post("v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "grammar": 'root ::= "a"',
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]  # (response_format goes to the child as its json_schema)
    assert message == "llama-server refused the request: Cannot use both json_schema and grammar", message
    r = await http.post("api/generate", json={"model": "tiny", "prompt": "Once", "stream": False,
                                              "options": dict(OPTS, num_predict=2), "format": {"type": "object"},
                                              "grammar": 'root ::= "a"'})
    assert r.status_code == 200, r.text  # Ollama's route has no grammar option: it is ignored


def test_other_child_failures_keep_their_status():
    assert child_error(500, '{"error": {"code": 500, "message": "Failed to decode the batch"}}').status == 500
    assert child_error(400, '{"error": {"message": "the request exceeds the available context size"}}').status == 400
    e = child_error(500, '{"error": {"message": "tools param requires --jinja flag", "type": "server_error"}}')
    assert e.status == 400 and str(e) == "llama-server refused the request: tools param requires --jinja flag"


async def test_embeddings_inputs_the_child_cannot_take_are_4xx(http):
    """Issue 17 item 7: a number as /v1/embeddings input, and an input far past the context."""
    for bad in (5, [1.5, "x"], {"text": "x"}, None):
        r = await http.post("v1/embeddings", json={"model": "tiny", "input": bad})
        assert 400 <= r.status_code < 500, (bad, r.status_code, r.text)
        assert "Traceback" not in r.text and "Error(" not in r.text
    long = "the quick brown fox " * 5000  # ~20,000 tokens against a 1024-token context
    r = await http.post("v1/embeddings", json={"model": "tiny", "input": long})
    assert r.status_code < 500, r.text
    r = await http.post("api/embed", json={"model": "tiny", "input": long, "truncate": False,
                                           "options": OPTS})
    assert r.status_code == 400 and "longer than the context" in r.json()["error"], r.text
