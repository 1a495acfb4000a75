"""The real-model tier, through the server: Gemma 3 270M answered through the official
``ollama`` and ``openai`` clients as a user's first request would be. Skips where the Gemma
package is absent (the ``test`` extra installs it).

Gemma 3 270M is a base model: it continues text. Greedy, both APIs give the same continuation
(both sample with Ollama's defaults, its repeat penalty included, as Ollama's OpenAI layer
does), and it is real text.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0, "seed": 1, "num_ctx": 2048}


async def test_gemma_continues_text_alike_through_both_apis(store, gemma_model, llama_url, token):
    store.create("gemma3:270m", gemma_model)
    oc = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    prompt = "The capital of France is Paris. The capital of Germany is"

    r = await asyncio.to_thread(oc.generate, model="gemma3:270m", prompt=prompt, options=dict(GREEDY, num_predict=8))
    assert r.done and r.eval_count == 8 and r.prompt_eval_count > 0
    assert "Berlin" in r.response, r.response

    ps = await asyncio.to_thread(oc.ps)
    assert [m.name for m in ps.models] == ["gemma3:270m"]
    assert ps.models[0].details.family == "gemma3" and ps.models[0].context_length == 2048

    client = openai.OpenAI(base_url=llama_url + "/v1", api_key=token)
    c = await asyncio.to_thread(client.completions.create, model="gemma3:270m", prompt=prompt, max_tokens=8,
                                temperature=0, seed=1)
    assert c.choices[0].text == r.response
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens == r.prompt_eval_count


async def test_a_model_without_a_chat_template_chats_through_the_bare_prompt(store, gemma_model, llama_url, token,
                                                                             ext):
    """Gemma 3 270M has no chat template. Ollama runs its default one, the bare prompt; without
    it llama-server falls back to ChatML, whose control words the base model never saw and
    writes on and on. Chat through both APIs gets the user's text as it is (the same greedy
    continuation as generate), and show says the model has no template."""
    import psutil

    store.create("gemma3:270m", gemma_model)
    oc = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    shown = await asyncio.to_thread(oc.show, "gemma3:270m")
    assert shown.template == "{{ .Prompt }}" and shown.capabilities == ["completion"]
    assert (await asyncio.to_thread(oc._client.post, "/api/show", json={"model": "gemma3:270m"})).json()[
        "has_chat_template"] is False

    text = "The capital of France is Paris. The capital of Germany is"
    options = dict(GREEDY, num_predict=8)
    chat = await asyncio.to_thread(oc.chat, model="gemma3:270m", messages=[{"role": "user", "content": text}],
                                   options=options)
    generated = await asyncio.to_thread(oc.generate, model="gemma3:270m", prompt=text, options=options)
    assert "<|im_" not in chat.message.content and "Berlin" in chat.message.content, chat.message.content
    assert chat.message.content == generated.response

    (loaded,) = ext.scheduler.live()
    argv = psutil.Process(loaded.runner.pid).cmdline()
    assert argv[argv.index("--chat-template") + 1].startswith("{%- for message in messages")

    client = openai.OpenAI(base_url=llama_url + "/v1", api_key=token)
    c = await asyncio.to_thread(client.chat.completions.create, model="gemma3:270m", max_tokens=8, temperature=0,
                                seed=1, messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": text}])
    assert "<|im_" not in c.choices[0].message.content and "Berlin" in c.choices[0].message.content
