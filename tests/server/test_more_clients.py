"""langchain-ollama and litellm against the server: the clients that hit issue 16's first items
(long embedding inputs, token counts from the second turn on). Each skips where it is not
installed. litellm's cost map is read from its own package, never fetched."""

from __future__ import annotations

import asyncio

import pytest
from srvutil import OPTS

pytestmark = pytest.mark.engine

CHUNK = " ".join(f"word{i % 97}" for i in range(900))  # a RAG-sized chunk: ~1,000 tokens or more


def run(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


async def test_langchain_ollama_embeds_long_chunks_and_counts_every_prompt_token(llama_url, token):
    lc = pytest.importorskip("langchain_ollama")
    headers = {"Authorization": f"token {token}"}
    emb = lc.OllamaEmbeddings(model="tiny", base_url=llama_url, client_kwargs={"headers": headers})
    vectors = await run(emb.embed_documents, [CHUNK, "short"])
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0
    chat = lc.ChatOllama(model="tiny", base_url=llama_url, client_kwargs={"headers": headers},
                         num_predict=2, num_ctx=OPTS["num_ctx"], temperature=0)
    first = await run(chat.invoke, "Once upon a time")
    second = await run(chat.invoke, "Once upon a time")  # the child's prompt cache has it now
    assert first.usage_metadata["input_tokens"] == second.usage_metadata["input_tokens"] > 1


async def test_litellm_counts_every_prompt_token_on_both_apis(llama_url, token, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the network
    litellm = pytest.importorskip("litellm")
    msgs = [{"role": "user", "content": "Once upon a time"}]
    oa = [await run(litellm.completion, model="openai/tiny", api_base=llama_url + "/v1", api_key=token,
                    messages=msgs, max_tokens=2) for _ in range(2)]
    assert oa[0].usage.prompt_tokens == oa[1].usage.prompt_tokens > 1
    ol = [await run(litellm.completion, model="ollama_chat/tiny", api_base=llama_url, messages=msgs,
                    max_tokens=2, extra_headers={"Authorization": f"token {token}"}) for _ in range(2)]
    assert ol[0].usage.prompt_tokens == ol[1].usage.prompt_tokens > 1
