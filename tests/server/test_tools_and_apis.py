"""Tools, thinking and fill-in-the-middle on Ollama's routes, OpenAI's Responses API and
Anthropic's Messages API, with the real clients, a real Jupyter server and real children.

``agent`` is a synthetic model whose chat template renders tools and reasoning and whose
weights are wired to call the tool it is offered (models/synth/, ``template="tools"``):
offered ``get_weather`` (one enum argument) it answers with one call,
``get_weather(city="Paris")``, which llama-server parses; asked to think, it thinks. ``tiny``
has a plain ChatML template: no tools, no thinking, no fill-in-the-middle tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from srvutil import OPTS, TINY

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

AGENT = dict(TINY, template="tools", fim=True, seed=5)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PREDICT = dict(OPTS, num_predict=200)  # room for the call (the grammar's whitespace is the model's choice)


@pytest.fixture
def store(store, make_model):
    store.create("agent", make_model("srv-agent", **AGENT))
    return store


def run(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


async def test_ollama_client_tools_thinking_and_insert(llama_url, token):
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})

    r = await run(c.chat, model="agent", messages=ASK, tools=[WEATHER], think=False, options=PREDICT)
    assert r.done and r.done_reason == "stop", r
    calls = r.message.tool_calls
    assert [(t.function.name, dict(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    chunks = await run(lambda: list(c.chat(model="agent", messages=ASK, tools=[WEATHER], think=False,
                                           options=PREDICT, stream=True)))
    streamed = [t for ch in chunks for t in (ch.message.tool_calls or [])]
    assert [(t.function.name, dict(t.function.arguments)) for t in streamed] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].done
    # the tool's answer goes back as a tool message (with the call it answers), and the chat goes on
    follow = ASK + [r.message.model_dump(exclude_none=True), {"role": "tool", "content": "sunny",
                                                               "tool_name": "get_weather"}]
    r2 = await run(c.chat, model="agent", messages=follow, think=False, options=dict(OPTS, num_predict=4))
    assert r2.done and r2.eval_count >= 1

    r = await run(c.chat, model="agent", messages=ASK, think=True, options=dict(OPTS, num_predict=6))
    assert r.message.thinking and r.done, r  # it thinks (at random), and the thinking comes apart
    chunks = await run(lambda: list(c.chat(model="agent", messages=ASK, think=True, stream=True,
                                           options=dict(OPTS, num_predict=6))))
    assert "".join(ch.message.thinking or "" for ch in chunks) and chunks[-1].done
    # generate thinks too: through the child's chat route, with the reasoning apart
    r = await run(c.generate, model="agent", prompt="What is the weather in Paris?", think=True,
                  options=dict(OPTS, num_predict=6))
    # (its wiring may end the turn early, at a ">")
    assert r.thinking and r.done and 1 <= r.eval_count <= 6 and isinstance(r.response, str), r
    chunks = await run(lambda: list(c.generate(model="agent", prompt="Weather?", think=True, stream=True,
                                               options=dict(OPTS, num_predict=6))))
    assert "".join(ch.thinking or "" for ch in chunks) and chunks[-1].done
    with pytest.raises(ollama.ResponseError, match="does not support thinking"):
        await run(c.generate, model="tiny", prompt="hi", think=True)

    r = await run(c.generate, model="agent", prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))",
                  options=dict(OPTS, num_predict=5))
    assert r.done and 1 <= r.eval_count <= 5 and r.response  # (its wiring may end it early at a ">")

    # what the model cannot do is a 400 naming it, before anything loads
    for call, what in ((lambda: c.chat(model="tiny", messages=ASK, tools=[WEATHER]), "tools"),
                       (lambda: c.chat(model="tiny", messages=ASK, think=True), "thinking"),
                       (lambda: c.generate(model="tiny", prompt="a", suffix="b"), "insert")):
        with pytest.raises(ollama.ResponseError) as e:
            await run(call)
        assert e.value.status_code == 400 and e.value.error == f'"tiny" does not support {what}', e.value.error
    assert "tiny:latest" not in [m.name for m in (await run(c.ps)).models]
    with pytest.raises(ollama.ResponseError) as e:
        await run(c.chat, model="agent", messages=ASK, think="deeply")
    assert e.value.status_code == 400 and "think must be" in e.value.error
    c.close()


async def test_a_chat_longer_than_the_context_drops_its_oldest_messages(http):
    msgs = [{"role": "system", "content": "system"}]
    for i in range(12):
        msgs += [{"role": "user", "content": f"q{i} " + "x" * 32},
                 {"role": "assistant", "content": f"a{i} " + "y" * 32}]
    msgs.append({"role": "user", "content": "last?"})
    opts = dict(OPTS, num_ctx=256, num_predict=4)
    for stream in (False, True):
        r = await http.post("api/chat", json={"model": "tiny", "messages": msgs, "stream": stream, "options": opts})
        assert r.status_code == 200, r.text
        last = [json.loads(ln) for ln in r.text.splitlines() if ln.strip()][-1]
        assert last["done"] and last["eval_count"] == 4 and 0 < last["prompt_eval_count"] <= 256 - 4, last
    r = await http.post("api/chat", json={"model": "tiny", "messages": msgs, "stream": True, "options": opts,
                                          "truncate": False})
    assert r.status_code == 400 and "longer than the context" in r.json()["error"], r.text
    # a last message that alone is too long: what is too long, and by how much, in numbers
    huge = [msgs[0], {"role": "user", "content": "z " * 400}]
    r = await http.post("api/chat", json={"model": "tiny", "messages": huge, "stream": False, "options": opts})
    said = r.json()["error"]
    assert r.status_code == 400 and "the chat's last message and its system messages, which a cut chat keeps, are " \
        "longer than the context of tiny" in said and "tokens, where the context of 256 has room for 251 beside the " \
        "answer)" in said, said
    # the OpenAI route cuts the same way (the model is loaded with the 256-token context above)
    for stream in (False, True):
        r = await http.post("v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 4,
                                                         "stream": stream, "stream_options": {"include_usage": True}}
                            if stream else {"model": "tiny", "messages": msgs, "max_tokens": 4})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            usage = [e["usage"] for e in events if e.get("usage")][-1]
        else:
            usage = r.json()["usage"]
        assert usage["completion_tokens"] == 4 and 0 < usage["prompt_tokens"] <= 256 - 4, usage


async def test_openai_tools_and_the_responses_api(llama_url, token):
    c = openai.OpenAI(base_url=llama_url + "/v1", api_key=token, max_retries=0)

    r = await run(c.chat.completions.create, model="agent", messages=ASK, tools=[WEATHER], max_tokens=200,
                  reasoning_effort="none")
    call = r.choices[0].message.tool_calls[0]
    assert r.model == "agent" and r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = await run(lambda: list(c.chat.completions.create(model="agent", messages=ASK, tools=[WEATHER],
                                                              max_tokens=200, reasoning_effort="none",
                                                              stream=True)))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}

    r = await run(c.responses.create, model="tiny", input="Hello", max_output_tokens=4)
    assert r.model == "tiny" and r.status == "incomplete" and r.output_text, r  # (cut by its limit)
    events = await run(lambda: list(c.responses.create(model="tiny", input="Hello", max_output_tokens=4,
                                                       stream=True)))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.model == "tiny"
    r = await run(c.responses.create, model="agent", input="What is the weather in Paris?", max_output_tokens=200,
                  tools=[{"type": "function", **WEATHER["function"]}], reasoning={"effort": "none"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(o.name, json.loads(o.arguments)) for o in calls] == [("get_weather", {"city": "Paris"})], r.output

    with pytest.raises(openai.BadRequestError) as e:
        await run(c.responses.create, model="tiny", input=None)
    assert e.value.status_code == 400 and "input is required" in e.value.message

    # what a Responses request's input counts, through the model's template (the child's own count)
    short = await run(c.responses.input_tokens.count, model="tiny", input="Hello")
    assert short.object == "response.input_tokens" and short.input_tokens > 0
    longer = await run(c.responses.input_tokens.count, model="tiny", input="Hello there, how are you today?",
                       instructions="Answer in one short sentence.")
    assert longer.input_tokens > short.input_tokens + 5
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.responses.input_tokens.count, model="tiny")
    assert e.value.status_code == 400 and "input is required" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.chat.completions.create, model="tiny", messages=ASK, tools=[WEATHER])
    assert '"tiny" does not support tools' in e.value.message and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        await run(c.responses.create, model="nope", input="x")
    assert "not found" in e.value.message


async def test_anthropic_messages(llama_url, token, http):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=llama_url, auth_token=token, max_retries=0)

    r = await run(c.messages.create, model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hello"}])
    assert r.model == "tiny" and r.type == "message" and r.stop_reason == "max_tokens"
    assert r.content[0].type == "text" and r.content[0].text and r.usage.output_tokens == 4

    def stream():
        with c.messages.stream(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hello"}]) as s:
            kinds = [e.type for e in s]
            return kinds, s.get_final_message()
    kinds, final = await run(stream)
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop", kinds
    assert final.model == "tiny" and final.content[0].text
    # on the wire: named events, as Anthropic writes them (event line, data line, blank line)
    raw = await http.post("v1/messages", json={"model": "tiny", "max_tokens": 2, "stream": True,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert raw.text.startswith("event: message_start\ndata: {") and "[DONE]" not in raw.text, raw.text[:200]
    assert raw.text.rstrip("\n").endswith('event: message_stop\ndata: {"type":"message_stop"}')

    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    r = await run(c.messages.create, model="agent", max_tokens=200, tools=[tool],
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and [(b.name, b.input) for b in uses] == [("get_weather", {"city": "Paris"})]
    assert (await run(c.messages.count_tokens, model="tiny", messages=[{"role": "user", "content": "Hello"}])
            ).input_tokens > 0

    with pytest.raises(anthropic.BadRequestError) as e:
        await run(c.messages.create, model="tiny", max_tokens=4, messages=[])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "messages" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        await run(c.messages.create, model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    assert e.value.body["error"]["message"].startswith('model "nope" not found, try pulling it first')
    with pytest.raises(anthropic.BadRequestError) as e:
        await run(c.messages.create, model="tiny", max_tokens=4, tools=[tool],
                  messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["message"] == '"tiny" does not support tools'


async def test_a_child_lost_mid_stream_ends_named_streams_with_an_error_event(http, ext):
    """Anthropic's and the Responses API's streams end, as every stream does, with the error
    as their last event: an ``error`` event in each API's own shape."""
    import os
    import signal

    from srvutil import LONG

    from jupyter_llama.engine.runner import CRASH_MESSAGE

    msgs = [{"role": "user", "content": "Hello"}]
    for path, body in (("v1/messages", {"messages": msgs, "max_tokens": 3000}),
                       ("v1/responses", {"input": "Hello", "max_output_tokens": 3000})):
        await http.post("api/generate", json={"model": "tiny", "options": LONG})  # loaded as the stream wants it
        lo = next(lo for lo in ext.scheduler.loaded.values() if lo.name == "tiny:latest")
        events: list[tuple[str, dict]] = []
        name = ""
        async with http.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as r:
            assert r.status_code == 200
            async for ln in r.aiter_lines():
                if ln.startswith("event: "):
                    name = ln[7:]
                elif ln.startswith("data: "):
                    events.append((name, json.loads(ln[6:])))
                    name = ""
                    if len(events) == 3:
                        os.kill(lo.runner.pid, signal.SIGKILL)
        kind, last = events[-1]
        assert kind == "error" and last["type"] == "error", events[-3:]
        assert last["error"]["message"].startswith(CRASH_MESSAGE), last
        if path == "v1/messages":
            assert last == {"type": "error", "error": {"type": "api_error", "message": last["error"]["message"]}}
        else:
            assert last["message"] == last["error"]["message"]
