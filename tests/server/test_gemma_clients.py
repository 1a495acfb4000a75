"""The real-model tier, through the server: Gemma 3 270M answered through the official
``ollama`` and ``openai`` clients as a user's first request would be. Skips where the Gemma
package is absent (the ``test`` extra installs it).

Gemma 3 270M is a base model: it continues text. Greedy, with no repeat penalty (Ollama's
default has one, OpenAI's none), both APIs give the same continuation, and it is real text.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0, "seed": 1, "num_ctx": 2048, "repeat_penalty": 1.0}  # (Ollama's default is 1.1)


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
