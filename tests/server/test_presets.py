"""Model presets through a real Jupyter server and real llama-server children, driven by the
official ``ollama`` client: ``create`` with system/parameters/template/messages, ``show``,
and requests whose answers (token counts, lengths, the context the child got) show the
preset applied."""

from __future__ import annotations

import asyncio

import pytest
from srvutil import OPTS

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")


def run(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


@pytest.fixture
def client(llama_url, token):
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    yield c
    c.close()


def one(**kw):
    """Options for a one-token answer on the suite's light child (same load options: no reload)."""
    return dict(OPTS, num_predict=1, **kw)


async def test_create_from_a_model_with_a_system_prompt_and_parameters(client, http):
    # ollama-python's README example, with parameters
    r = await run(client.create, model="mario", from_="tiny", system="You are Mario",
                  parameters=dict(OPTS, num_predict=3, temperature=0.0))
    assert r.status == "success"

    show = await run(client.show, "mario")
    params = dict(ln.split(None, 1) for ln in show.parameters.splitlines())
    assert params == {"num_ctx": "1024", "num_parallel": "1", "num_thread": "1", "num_predict": "3",
                      "temperature": "0"}
    assert "SYSTEM You are Mario\n" in show.modelfile and "PARAMETER num_predict 3\n" in show.modelfile
    raw = (await http.post("api/show", json={"model": "mario"})).json()
    assert raw["system"] == "You are Mario" and raw["messages"] == []
    tiny = (await http.post("api/show", json={"model": "tiny"})).json()
    assert tiny["parameters"] == "" and tiny["system"] == ""
    model_file = [f for f in raw["files"] if f["role"] == "model"]
    assert model_file == [f for f in tiny["files"] if f["role"] == "model"]  # the same blob: weights shared
    assert f"FROM {model_file[0]['path']}\n" in raw["modelfile"]
    assert raw["details"]["parent_model"] == "tiny:latest"

    # parameters are the request's defaults: num_predict 3 without options, the request's value wins
    r = await run(client.generate, model="mario", prompt="Hello")
    assert r.eval_count == 3 and r.done_reason == "length"
    r = await run(client.generate, model="mario", prompt="Hello", options={"num_predict": 2})
    assert r.eval_count == 2

    # the system prompt reaches the child: mario's prompt is tiny's with that system message
    with_system = await run(client.generate, model="tiny", prompt="Hello", system="You are Mario", options=one())
    without = await run(client.generate, model="tiny", prompt="Hello", options=one())
    mario = await run(client.generate, model="mario", prompt="Hello", options={"num_predict": 1})
    assert mario.prompt_eval_count == with_system.prompt_eval_count > without.prompt_eval_count
    # a request's own system message replaces the preset's
    own = await run(client.generate, model="mario", prompt="Hello", system="Be brief", options={"num_predict": 1})
    brief = await run(client.generate, model="tiny", prompt="Hello", system="Be brief", options=one())
    assert own.prompt_eval_count == brief.prompt_eval_count != mario.prompt_eval_count

    # chat: the system message goes first unless the request opens with its own
    hello = [{"role": "user", "content": "Hello"}]
    c_mario = await run(client.chat, model="mario", messages=hello)
    assert c_mario.eval_count == 3 and c_mario.message.role == "assistant"
    c_tiny = await run(client.chat, model="tiny", messages=[{"role": "system", "content": "You are Mario"}, *hello],
                       options=one())
    c_plain = await run(client.chat, model="tiny", messages=hello, options=one())
    assert c_mario.prompt_eval_count == c_tiny.prompt_eval_count > c_plain.prompt_eval_count
    c_own = await run(client.chat, model="mario", messages=[{"role": "system", "content": "Be brief"}, *hello])
    c_brief = await run(client.chat, model="tiny", messages=[{"role": "system", "content": "Be brief"}, *hello],
                        options=one())
    assert c_own.prompt_eval_count == c_brief.prompt_eval_count

    # a preset on a preset merges: luigi keeps mario's load options and takes its own system and num_predict
    r = await run(client.create, model="luigi", from_="mario", system="You are Luigi", parameters={"num_predict": 2},
                  license=["MIT", "Apache-2.0"])
    assert r.status == "success"
    show = await run(client.show, "luigi")
    assert "num_ctx                        1024" in show.parameters and "num_predict                    2" in \
        show.parameters and "num_predict                    3" not in show.parameters
    assert show.license == "MIT\nApache-2.0" and "SYSTEM You are Luigi\n" in show.modelfile
    assert (await run(client.generate, model="luigi", prompt="Hello")).eval_count == 2
    # tiny itself is untouched
    assert (await run(client.show, "tiny")).parameters in ("", None)


async def test_a_stop_parameter_in_the_preset_cuts_the_answer(client):
    base = dict(OPTS, num_predict=16, temperature=0.0, seed=1)
    full = await run(client.generate, model="tiny", prompt="Once upon a time", raw=True, options=base)
    text = full.response
    # a stop text from the middle of the greedy answer (skipping whitespace the child may trim)
    start = len(text) // 2
    while start < len(text) - 1 and text[start].isspace():
        start += 1
    stop = text[start:start + 2]
    assert stop.strip() and text.find(stop) > 0, text
    await run(client.create, model="stops", from_="tiny", parameters=dict(base, stop=[stop]))
    cut = await run(client.generate, model="stops", prompt="Once upon a time", raw=True)
    assert cut.response == text[:text.find(stop)] and cut.done_reason == "stop"
    assert cut.eval_count < full.eval_count
    # the request's own stop list replaces the preset's
    again = await run(client.generate, model="stops", prompt="Once upon a time", raw=True, options={"stop": ["\x00"]})
    assert again.response == text


async def test_messages_and_a_template_in_the_preset_shape_the_prompt(client, http):
    history = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "It is me, Mario"}]
    hello = [{"role": "user", "content": "Hello"}]
    await run(client.create, model="remembers", from_="tiny", messages=history, parameters=dict(OPTS))
    r = await run(client.chat, model="remembers", messages=hello, options={"num_predict": 1})
    same = await run(client.chat, model="tiny", messages=history + hello, options=one())
    plain = await run(client.chat, model="tiny", messages=hello, options=one())
    assert r.prompt_eval_count == same.prompt_eval_count > plain.prompt_eval_count
    show = (await http.post("api/show", json={"model": "remembers"})).json()
    assert show["messages"] == history and 'MESSAGE assistant It is me, Mario\n' in show["modelfile"]

    # a preset template (an Ollama Go template) renders the prompt we send to the child
    template = "SYSTEM: {{ .System }} USER: {{ .Prompt }} ANSWER:"
    r = await run(client.create, model="templated", from_="tiny", template=template, system="You are Mario",
                  parameters=dict(OPTS, num_predict=2, temperature=0.0))  # greedy: the same answer each time
    assert r.status == "success" and (await run(client.show, "templated")).template == template
    rendered = await run(client.generate, model="tiny", prompt="SYSTEM: You are Mario USER: Hello ANSWER:",
                         raw=True, options=one())
    g = await run(client.generate, model="templated", prompt="Hello")
    assert g.prompt_eval_count == rendered.prompt_eval_count and g.eval_count == 2
    c = await run(client.chat, model="templated", messages=hello)
    assert c.prompt_eval_count == rendered.prompt_eval_count and c.eval_count == 2
    assert c.message.role == "assistant" and c.done and c.done_reason == "length"
    chunks = await run(lambda: list(client.chat(model="templated", messages=hello, stream=True)))
    assert chunks[-1].done and chunks[-1].eval_count == 2 and not chunks[0].done
    assert "".join(ch.message.content for ch in chunks) == c.message.content
    # a per-request template is rendered the same way
    g = await run(client.generate, model="tiny", prompt="Hello", template=template, system="You are Mario",
                  options=one())
    assert g.prompt_eval_count == rendered.prompt_eval_count

    # a template we cannot run is kept as written, and the model's own chat template is used
    odd = '{{ define "x" }}{{ end }}{{ .Prompt }}'
    statuses = await run(lambda: [s.status for s in client.create(model="odd", from_="tiny", template=odd,
                                                                  parameters=OPTS, stream=True)])
    assert statuses[-1] == "success" and any("cannot run" in s for s in statuses)
    assert (await run(client.show, "odd")).template == odd
    r = await run(client.chat, model="odd", messages=hello, options={"num_predict": 1})
    assert r.prompt_eval_count == plain.prompt_eval_count


async def test_load_options_in_a_preset_are_the_models_default_load_options(client):
    await run(client.create, model="small-ctx", from_="tiny", parameters=dict(OPTS, num_ctx=512))
    await run(client.generate, model="small-ctx", prompt="Hi", options={"num_predict": 1})
    ps = await run(client.ps)
    assert [m.context_length for m in ps.models] == [512]
    await run(client.generate, model="small-ctx", prompt="Hi", options={"num_predict": 1, "num_ctx": 1024})
    assert [m.context_length for m in (await run(client.ps)).models] == [1024]  # the request's value wins
    # an empty request loads the model with them too
    await run(client.generate, model="small-ctx", prompt="")
    assert [m.context_length for m in (await run(client.ps)).models] == [512]


async def test_a_preset_and_its_model_each_keep_their_own_load_options(client, http):
    """Ollama gives each name its own options: after a preset with a small context loaded,
    its base model asked with no options is not served by that runner (its context would cut
    the base model's prompts); it is loaded as itself, and ps names it. The same name asked
    again with no options takes the runner as it is (no reload for a client that sets none)."""
    async def ps() -> list[tuple[str, int, int]]:
        return [(m["name"], m["context_length"], m["pid"]) for m in (await http.get("api/ps")).json()["models"]]

    await run(client.create, model="pirate", from_="tiny", parameters=dict(OPTS, num_ctx=512))
    await run(client.generate, model="pirate", prompt="Hi", options={"num_predict": 1})
    ((name, ctx, pid),) = await ps()
    assert (name, ctx) == ("pirate:latest", 512)

    await run(client.generate, model="tiny", prompt="Hi", options={"num_predict": 1})
    ((name, ctx, tiny_pid),) = await ps()
    assert name == "tiny:latest" and ctx != 512 and tiny_pid != pid  # another child, loaded for tiny as tiny is
    await run(client.generate, model="tiny", prompt="Hi", options={"num_predict": 1})
    assert [p for _, _, p in await ps()] == [tiny_pid]


@pytest.mark.parametrize("kw, words", [
    ({"parameters": {"temprature": 0.5}}, 'unknown parameter "temprature" (did you mean "temperature"?)'),
    ({"parameters": {"num_ctx": "big"}}, 'parameter num_ctx must be a whole number, not "big"'),
    ({"parameters": {"num_ctx": 4}}, "num_ctx 4 is too small"),
    ({"parameters": {"stop": [1]}}, "parameter stop must be a string or a list of strings, not [1]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 'messages[0].role must be system, user or assistant'),
    ({"template": "{{ if .System }}"}, "{{ if }} has no {{ end }}"),
    ({"adapters": {"lora.gguf": "sha256:" + "1" * 64}}, "adapters (LoRA) are not supported"),
])
async def test_bad_presets_are_a_400_in_words(client, http, kw, words):
    with pytest.raises(ollama.ResponseError) as e:
        await run(client.create, model="bad", from_="tiny", **kw)
    assert e.value.status_code == 400 and words in e.value.error, e.value.error
    assert "Traceback" not in e.value.error
    assert (await http.post("api/show", json={"model": "bad"})).status_code == 404  # nothing was made


async def test_a_preset_applies_on_the_openai_and_anthropic_routes(client, llama_url, token):
    """The OpenAI and Anthropic clients get the preset too (the request's values win)."""
    openai = pytest.importorskip("openai")
    r = await run(client.create, model="luigi", from_="tiny", system="You are Luigi",
                  parameters=dict(OPTS, num_predict=3, temperature=0.0))
    assert r.status == "success"
    oa = openai.OpenAI(base_url=llama_url + "/v1", api_key=token, max_retries=0)
    hello = [{"role": "user", "content": "Hello"}]
    luigi = await run(oa.chat.completions.create, model="luigi", messages=hello)
    assert luigi.usage.completion_tokens == 3  # the preset's num_predict
    done = await run(oa.chat.completions.create, model="luigi", messages=hello, max_tokens=1)
    assert done.usage.completion_tokens == 1
    with_system = await run(oa.chat.completions.create, model="tiny", max_tokens=1,
                            messages=[{"role": "system", "content": "You are Luigi"}, *hello])
    plain = await run(oa.chat.completions.create, model="tiny", max_tokens=1, messages=hello)
    assert luigi.usage.prompt_tokens == with_system.usage.prompt_tokens > plain.usage.prompt_tokens
    streamed = await run(lambda: list(oa.chat.completions.create(model="luigi", messages=hello, stream=True,
                                                                  stream_options={"include_usage": True})))
    assert [c for c in streamed if c.usage][-1].usage.completion_tokens == 3
    anthropic = pytest.importorskip("anthropic")
    an = anthropic.Anthropic(base_url=llama_url, api_key=token, max_retries=0)
    m_luigi = await run(an.messages.create, model="luigi", max_tokens=2, messages=hello)
    m_tiny = await run(an.messages.create, model="tiny", max_tokens=2, messages=hello)
    m_sys = await run(an.messages.create, model="tiny", max_tokens=2, messages=hello, system="You are Luigi")
    def seen(m):  # the prompt the child read: new tokens and those from its cache
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

    assert seen(m_luigi) == seen(m_sys) > seen(m_tiny)


async def test_the_clis_length_limit_yields_to_a_modelfiles_num_predict(client, llama_url, token):
    """`jupyter-llama run` and `%llama run` send their 256-token limit as default_options: a
    preset's num_predict wins over it, the user's --num-predict over both."""
    from jupyter_llama.client import LlamaClient

    r = await run(client.create, model="short", from_="tiny", parameters=dict(OPTS, num_predict=3))
    assert r.status == "success"
    c = LlamaClient(llama_url, token)
    try:
        out = await run(c.generate, "short", "Once", stream=False, default_options={"num_predict": 256})
        assert out["eval_count"] == 3
        out = await run(c.generate, "short", "Once", stream=False, options={"num_predict": 2},
                        default_options={"num_predict": 256})
        assert out["eval_count"] == 2
        out = await run(c.generate, "tiny", "Once", stream=False, options=dict(OPTS),
                        default_options={"num_predict": 5})
        assert out["eval_count"] == 5  # no preset: the default applies
    finally:
        c.close()


async def test_a_preset_changed_by_another_process_applies_to_the_next_request(client, store):
    """The server keeps presets in memory between requests (no file read before a first
    token), but only while the model's manifest is unchanged: a preset written by another
    process (here another ModelStore on the same folder, as the CLI would) applies at once."""
    from jupyter_llama.models.preset import Preset

    await run(client.create, model="capped", from_="tiny", parameters=dict(OPTS, num_predict=2, temperature=0.0))
    r = await run(client.generate, model="capped", prompt="Once upon a time", raw=True)
    assert r.eval_count == 2
    weights = store.resolve_sync("tiny").path
    await asyncio.to_thread(store.create, "capped", weights,
                            preset=Preset(parameters=dict(OPTS, num_predict=3, temperature=0.0)))
    r = await run(client.generate, model="capped", prompt="Once upon a time", raw=True)
    assert r.eval_count == 3
