"""What a client of each API expects of its answers (issue 55, items 4 to 7), through the real
clients against a real Jupyter server and real llama-server children: structured outputs on
every OpenAI route, a Responses answer cut by its limit, ``dimensions`` and ``suffix``;
Anthropic's required ``max_tokens``, its thinking switch and stop reason; images on
``/api/generate``; ``show`` with ``verbose``; the count of ``n`` answers; a streamed tool
call; and the root that answers without the token.

``agent`` (tests/server/test_tools_and_apis.py) has fill-in-the-middle tokens and a template
that thinks and calls tools; ``vision`` is tiny's weights with a synthetic projector.
"""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import httpx
import pytest
from srvutil import OPTS, TINY, png

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

AGENT = dict(TINY, template="tools", fim=True, seed=5)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"]}}}


class City(pydantic.BaseModel):
    name: Literal["Paris", "Rome"]


@pytest.fixture
def store(store, make_model):
    store.create("agent", make_model("srv-agent", **AGENT))
    return store


def run(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


def _openai(llama_url, token):
    return openai.OpenAI(base_url=llama_url + "/v1", api_key=token, max_retries=0)


# ----------------------------------------------------------------------------- item 4


async def test_structured_outputs_on_every_openai_route(llama_url, token):
    c = _openai(llama_url, token)
    # Responses: responses.parse sends text.format (a json_schema); the answer follows the schema,
    # and ends there (the grammar allows nothing after it): completed, not cut. (The child's grammar
    # for the chat route starts with the template's assistant turn, which tiny's vocabulary cannot
    # spell: agent's can. Its template can think, and that grammar lets a thinking template think
    # first, which agent does at random: reasoning_format none leaves that part out.)
    plain = {"temperature": 0, "extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                                              "reasoning_format": "none"}}
    r = await run(c.responses.parse, model="agent", input="Which city?", text_format=City, max_output_tokens=200,
                  **plain)
    assert r.output_parsed is not None and r.output_parsed.name in ("Paris", "Rome"), r.output_text
    assert r.status == "completed" and r.incomplete_details is None, r
    # json_object: any JSON object (the start of one: random weights write on until the limit)
    r = await run(c.responses.create, model="agent", input="Answer in JSON", max_output_tokens=80,
                  text={"format": {"type": "json_object"}}, **plain)
    assert r.output_text.strip().startswith("{"), r.output_text
    # chat's response_format and completions' take the same schema
    r = await run(c.chat.completions.parse, model="agent", messages=[{"role": "user", "content": "Which city?"}],
                  response_format=City, max_tokens=200, **plain)
    assert r.choices[0].message.parsed.name in ("Paris", "Rome"), r.choices[0].message.content
    r = await run(c.completions.create, model="tiny", prompt="City:", max_tokens=200,
                  extra_body={"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "city", "schema": City.model_json_schema()}}})
    assert City.model_validate_json(r.choices[0].text).name in ("Paris", "Rome"), r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.responses.create, model="tiny", input="x", text={"format": {"type": "yaml"}})
    assert 'text.format.type must be "text", "json_object" or "json_schema"' in e.value.message


async def test_a_responses_answer_cut_by_its_limit_is_incomplete(llama_url, token):
    c = _openai(llama_url, token)
    r = await run(c.responses.create, model="tiny", input="Hello", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 4 and r.output_text
    events = await run(lambda: list(c.responses.create(model="tiny", input="Hello", max_output_tokens=4,
                                                       stream=True)))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete", [e.type for e in events]
    assert last.response.incomplete_details.reason == "max_output_tokens"


async def test_embeddings_dimensions(llama_url, token):
    c = _openai(llama_url, token)
    whole = await run(c.embeddings.create, model="tiny", input=["hello", "world"], encoding_format="float")
    for fmt in ({"encoding_format": "float"}, {}):  # (the client asks for base64 by default, and decodes it)
        cut = await run(c.embeddings.create, model="tiny", input=["hello", "world"], dimensions=16, **fmt)
        for short, full in zip(cut.data, whole.data, strict=False):
            assert len(short.embedding) == 16
            assert math.fsum(x * x for x in short.embedding) == pytest.approx(1.0, rel=1e-5)
            norm = math.sqrt(math.fsum(x * x for x in full.embedding[:16]))
            assert short.embedding == pytest.approx([x / norm for x in full.embedding[:16]], rel=1e-4, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.embeddings.create, model="tiny", input="hello", dimensions=65)
    assert "dimensions is 65, more than the 64 numbers of each embedding tiny makes" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.embeddings.create, model="tiny", input="hello", dimensions=0)
    assert "dimensions must be a positive whole number" in e.value.message


async def test_completions_fill_in_the_middle(llama_url, token):
    c = _openai(llama_url, token)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    r = await run(c.completions.create, model="agent", prompt=prefix, suffix=suffix, max_tokens=5)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == "agent" and isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 5, r
    assert r.usage.prompt_tokens > 10  # the prefix and the suffix, with the FIM tokens around them
    chunks = await run(lambda: list(c.completions.create(model="agent", prompt=prefix, suffix=suffix, max_tokens=5,
                                                         stream=True, stream_options={"include_usage": True})))
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] in ("stop", "length") and chunks[-1].usage.completion_tokens >= 1, chunks
    with pytest.raises(openai.BadRequestError) as e:  # a model without FIM tokens: what Ollama says
        await run(c.completions.create, model="tiny", prompt=prefix, suffix=suffix, max_tokens=5)
    assert e.value.body["message"] == '"tiny" does not support insert'
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.completions.create, model="agent", prompt=[prefix, prefix], suffix=suffix, max_tokens=5)
    assert "with suffix, prompt must be one string" in e.value.message


# ----------------------------------------------------------------------------- item 5


async def test_anthropic_max_tokens_thinking_and_stop_sequences(llama_url, token):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=llama_url, auth_token=token, max_retries=0)
    hello = [{"role": "user", "content": "Hello"}]
    # max_tokens is required (the client's own signature requires it too: sent without it, through its
    # low-level post), and positive
    with pytest.raises(anthropic.BadRequestError) as e:
        await run(c.post, "/v1/messages", cast_to=httpx.Response, body={"model": "tiny", "messages": hello})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("max_tokens: Field required"), e.value.body
    for bad in (0, -1):
        with pytest.raises(anthropic.BadRequestError) as e:
            await run(c.messages.create, model="tiny", max_tokens=bad, messages=hello)
        assert "max_tokens: must be a positive whole number" in e.value.body["error"]["message"]

    # thinking: off unless asked for (the agent's template thinks when it is on)
    for thinking in ({}, {"thinking": {"type": "disabled"}}):
        r = await run(c.messages.create, model="agent", max_tokens=8, messages=ASK, **thinking)
        assert [b.type for b in r.content if b.type == "thinking"] == [], r.content
    r = await run(c.messages.create, model="agent", max_tokens=8, messages=ASK,
                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert any(b.type == "thinking" and b.thinking for b in r.content), r.content
    with pytest.raises(anthropic.BadRequestError) as e:
        await run(c.messages.create, model="tiny", max_tokens=8, messages=ASK,
                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["message"] == '"tiny" does not support thinking'

    # stop_sequences: a sequence from the answer itself (the same answer again: temperature 0)
    greedy = {"extra_body": {"temperature": 0}}  # (this client's create takes no temperature of its own)
    r = await run(c.messages.create, model="tiny", max_tokens=12, messages=hello, **greedy)
    text = r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and len(text) > 4, r
    stop = text[2:4]
    r = await run(c.messages.create, model="tiny", max_tokens=12, messages=hello, stop_sequences=[stop, "\u2603"],
                  **greedy)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop, r

    def streamed():
        with c.messages.stream(model="tiny", max_tokens=12, messages=hello, stop_sequences=[stop], **greedy) as s:
            return s.get_final_message()
    final = await run(streamed)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop, final


# ----------------------------------------------------------------------------- item 6


async def test_generate_with_images(llama_url, token, store):
    store.synth("vision", projector=True, **TINY)
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    opts = dict(OPTS, num_predict=4)
    r = await run(c.generate, model="vision", prompt="What is in the picture?", images=[png()], options=opts)
    assert r.done and r.eval_count <= 4 and r.response is not None, r
    assert r.prompt_eval_count > 20, "the image's embeddings count as prompt tokens"
    chunks = await run(lambda: list(c.generate(model="vision", prompt="And now?", images=[png()], options=opts,
                                               stream=True)))
    assert chunks[-1].done and chunks[-1].prompt_eval_count > 20
    # a model without a projector: the 400 /api/chat gives, before anything loads
    with pytest.raises(ollama.ResponseError) as e:
        await run(c.generate, model="tiny", prompt="What is in the picture?", images=[png()], options=opts)
    assert e.value.status_code == 400 and "tiny has no multimodal projector" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        await run(c.chat, model="tiny", messages=[{"role": "user", "content": "x", "images": [png()]}], options=opts)
    assert e.value.status_code == 400 and "tiny has no multimodal projector" in e.value.error
    assert "tiny:latest" not in [m.name for m in (await run(c.ps)).models]
    with pytest.raises(ollama.ResponseError) as e:
        await run(c.generate, model="vision", prompt="x", images=[png()], raw=True, options=opts)
    assert e.value.status_code == 400 and "images cannot go with raw" in e.value.error
    c.close()


# ----------------------------------------------------------------------------- item 7


async def test_show_verbose_gives_the_arrays_and_the_tensors(llama_url, token, http, store):
    from jupyter_llama.models.gguf_info import read_gguf_info

    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    plain = await run(c.show, "tiny")
    assert plain.modelinfo["tokenizer.ggml.tokens"] is None  # (Ollama: null unless verbose)
    full = (await http.post("api/show", json={"model": "tiny", "verbose": True})).json()
    path = store.resolve_sync("tiny").path
    info = read_gguf_info(path)
    tokens = full["model_info"]["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == info.vocab_size and all(isinstance(t, str) for t in tokens)
    assert len(full["model_info"]["tokenizer.ggml.token_type"]) == info.vocab_size
    assert full["tensors"] == [{"name": t.name, "type": t.ggml_type, "shape": list(t.shape)} for t in info.tensors]
    assert "tensors" not in (await http.post("api/show", json={"model": "tiny"})).json()
    c.close()


async def test_openai_error_code_is_a_string_or_null(llama_url, token):
    c = _openai(llama_url, token)
    with pytest.raises(openai.NotFoundError) as e:
        await run(c.chat.completions.create, model="nope", messages=ASK)
    assert e.value.code is None and e.value.body["code"] is None and e.value.type == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.chat.completions.create, model="tiny", messages=ASK, n=0)
    assert e.value.code is None and "n must be a whole number from 1 to 128" in e.value.message


async def test_usage_counts_every_choice(llama_url, token):
    c = _openai(llama_url, token)
    r = await run(c.chat.completions.create, model="tiny", messages=ASK, max_tokens=3, n=2)
    assert [ch.index for ch in r.choices] == [0, 1] and all(ch.finish_reason == "length" for ch in r.choices)
    one = await run(c.chat.completions.create, model="tiny", messages=ASK, max_tokens=3)
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == one.usage.prompt_tokens, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    chunks = await run(lambda: list(c.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, n=2,
                                                              stream=True, stream_options={"include_usage": True})))
    usages = [ch.usage for ch in chunks if ch.usage]
    assert len(usages) == 1 and usages[0].completion_tokens == 6, usages
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}
    r = await run(c.completions.create, model="tiny", prompt="Once", max_tokens=2, n=3)
    assert len(r.choices) == 3 and r.usage.completion_tokens == 6, r.usage
    chunks = await run(lambda: list(c.completions.create(model="tiny", prompt="Once", max_tokens=2, n=2,
                                                         stream=True)))
    usages = [ch.usage for ch in chunks if ch.usage]
    assert len(usages) == 1 and usages[0].completion_tokens == 4 and chunks[-1].usage, usages


async def test_a_streamed_tool_call_comes_before_the_last_chunk(llama_url, token):
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    chunks = await run(lambda: list(c.chat(model="agent", messages=ASK, tools=[WEATHER], think=False, stream=True,
                                           options=dict(OPTS, num_predict=200))))
    with_calls = [ch for ch in chunks if ch.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done, chunks[-3:]
    assert [(t.function.name, dict(t.function.arguments)) for t in with_calls[0].message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert chunks[-1].done and not chunks[-1].message.tool_calls
    r = await run(c.chat, model="agent", messages=ASK, tools=[WEATHER], think=False,
                  options=dict(OPTS, num_predict=200))
    assert [t.function.name for t in r.message.tool_calls] == ["get_weather"]  # (not streamed: in the one answer)
    c.close()


async def test_the_root_answers_without_the_token(llama_url, token):
    async with httpx.AsyncClient(trust_env=False) as anyone:
        for method in ("GET", "HEAD"):
            r = await anyone.request(method, llama_url + "/")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        r = await anyone.get(llama_url + "/")
        assert r.text == "jupyter-llama is running" and token not in r.text
        r = await anyone.get(llama_url + "/api/version")  # every other route still wants it
        assert r.status_code == 401


async def test_did_you_mean_names_only_a_close_model(llama_url, token):
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    with pytest.raises(ollama.ResponseError) as e:
        await run(c.generate, model="tinny", prompt="x")
    assert e.value.status_code == 404 and 'did you mean "tiny:latest"' in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # nothing like it: no suggestion (every NAME:latest passed)
        await run(c.generate, model="nope", prompt="x")
    assert e.value.status_code == 404 and "did you mean" not in e.value.error, e.value.error
    c.close()
