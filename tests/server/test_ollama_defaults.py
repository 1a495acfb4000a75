"""Ollama's defaults through the real ``ollama`` and ``openai`` clients, with real children: the
default context, the sampling defaults a bare request sends, an answer with no num_predict,
the "with options" example of Ollama's docs/api.md, and embedding loads (the real Gemma 3 270M
model where it is installed: its 262,144-token vocabulary is what makes an embedding batch
costly). The policy alone: tests/memory/test_load_defaults.py."""

from __future__ import annotations

import asyncio

import pytest
from srvutil import OPTS

from jupyter_llama import config
from jupyter_llama.api.options import OLLAMA_SAMPLING_DEFAULTS
from jupyter_llama.engine import http1
from jupyter_llama.memory import estimate as est
from jupyter_llama.models.gguf_info import read_gguf_info

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")

ONE_THREAD = {"num_thread": 1}  # (a busy 2-core machine: one thread a child)


def run(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


def loaded(ext, name: str):
    (lo,) = [lo for lo in ext.scheduler.loaded.values() if lo.name == name]
    return lo


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture
def client(llama_url, token):
    return ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})


@pytest.fixture
def context_setting(monkeypatch):
    """Sets JUPYTER_LLAMA_CONTEXT_LENGTH for this test (the server reads it at each load)."""
    monkeypatch.delenv(config.OLLAMA_CONTEXT_LENGTH_VAR, raising=False)

    def set_to(value: int | None) -> None:
        if value is None:
            monkeypatch.delenv(config.CONTEXT_LENGTH_VAR, raising=False)
        else:
            monkeypatch.setenv(config.CONTEXT_LENGTH_VAR, str(value))

    return set_to


async def test_a_bare_request_gets_the_default_context_and_samples_like_ollama(client, ext, context_setting,
                                                                               monkeypatch):
    context_setting(2048)  # below tiny's training context of 4096
    r = await run(client.generate, model="tiny", prompt="Once upon a time", raw=True,
                  options=dict(ONE_THREAD, num_predict=3))
    assert r.done and r.eval_count == 3
    lo = loaded(ext, "tiny:latest")
    assert flag(lo.runner.argv, "-c") == "2048"
    (m,) = (await run(client.ps)).models
    assert m.context_length == 2048

    # the child's own record of the request's sampling: Ollama's defaults, not llama-server's
    slots = await http1.request_json(lo.runner.port, "/slots", None, lo.runner._headers())
    params = next(s["params"] for s in slots if s.get("params", {}).get("n_predict") == 3)
    for name, value in OLLAMA_SAMPLING_DEFAULTS.items():
        if name == "samplers":  # (their order: top_k before the penalties)
            assert params[name] == value
        else:
            assert params[name] == pytest.approx(value), name
    # what the request sets wins
    await run(client.generate, model="tiny", prompt="Once", raw=True,
              options=dict(ONE_THREAD, num_predict=2, top_p=0.5, repeat_penalty=1.0))
    slots = await http1.request_json(lo.runner.port, "/slots", None, lo.runner._headers())
    params = next(s["params"] for s in slots if s.get("params", {}).get("n_predict") == 2)
    assert (params["top_p"], params["repeat_penalty"], params["top_k"]) == (pytest.approx(0.5), 1.0, 40)

    # Ollama's OLLAMA_CONTEXT_LENGTH, when ours is unset; a request's num_ctx wins over both
    context_setting(None)
    monkeypatch.setenv(config.OLLAMA_CONTEXT_LENGTH_VAR, "1024")
    await run(client.generate, model="tiny", prompt="Once", raw=True, options=dict(ONE_THREAD, num_predict=1))
    assert flag(loaded(ext, "tiny:latest").runner.argv, "-c") == "1024"
    await run(client.generate, model="tiny", prompt="Once", raw=True,
              options=dict(ONE_THREAD, num_predict=1, num_ctx=512))
    lo = loaded(ext, "tiny:latest")
    assert flag(lo.runner.argv, "-c") == "512"
    # a request that sets no num_ctx is served as the model is loaded (unlike Ollama, which
    # reloads it with the default): no reload for a client that cannot set one
    await run(client.generate, model="tiny", prompt="Once", raw=True, options=dict(ONE_THREAD, num_predict=1))
    assert loaded(ext, "tiny:latest").runner.pid == lo.runner.pid


async def test_an_answer_without_num_predict_ends_when_its_context_is_full(client, ext):
    # (ignore_eos: the synthetic model's random text could end at an end-of-text token)
    options = dict(OPTS, num_ctx=256, ignore_eos=True)
    r = await run(client.generate, model="tiny", prompt="Once upon a time", raw=True, options=options)
    assert r.done and r.done_reason == "length"
    assert 100 < r.prompt_eval_count + r.eval_count <= 256
    chunks = await run(lambda: list(client.chat(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                options=options, stream=True)))
    assert chunks[-1].done and chunks[-1].done_reason == "length"
    assert chunks[-1].prompt_eval_count + chunks[-1].eval_count <= 256


async def test_ollamas_documented_example_with_every_option_is_served(client, ext):
    # docs/api.md, "Generate request (With options)", as its body is; num_thread 1 in place of 8
    # (a busy 2-core machine), and num_batch 2, which llama-server's four request slots cannot
    # start with: the child gets a batch of 4, one a slot, where Ollama's one-slot runner gets 2
    options = {
        "num_keep": 5, "seed": 42, "num_predict": 100, "draft_num_predict": 4, "top_k": 20, "top_p": 0.9,
        "min_p": 0.0, "typical_p": 0.7, "repeat_last_n": 33, "temperature": 0.8, "repeat_penalty": 1.2,
        "presence_penalty": 1.5, "frequency_penalty": 1.0, "penalize_newline": True, "stop": ["\n", "user:"],
        "numa": False, "num_ctx": 1024, "num_batch": 2, "num_gpu": 1, "main_gpu": 0, "use_mmap": True,
        "num_thread": 1,
    }
    r = await run(client.generate, model="tiny", prompt="Why is the sky blue?", stream=False, options=options)
    assert r.done and r.done_reason in ("stop", "length") and r.eval_count <= 100
    argv = loaded(ext, "tiny:latest").runner.argv
    assert (flag(argv, "-c"), flag(argv, "-b"), flag(argv, "-ngl"), flag(argv, "-mg")) == ("1024", "4", "1", "0")
    # the same options again: the runner matches them, no reload
    pid = loaded(ext, "tiny:latest").runner.pid
    await run(client.generate, model="tiny", prompt="Why?", options=dict(options, num_predict=2))
    assert loaded(ext, "tiny:latest").runner.pid == pid


async def test_a_plain_embed_load_has_the_default_context_and_a_bounded_batch(client, ext, llama_url, token,
                                                                             context_setting):
    context_setting(2048)
    emb = await run(client.embed, model="tiny", input="hello")
    assert len(emb.embeddings) == 1 and len(emb.embeddings[0]) == 64
    lo = loaded(ext, "tiny:latest")
    argv, batch = lo.runner.argv, str(est.embed_batch(lo.ref.info, 2048))
    assert "--embedding" in argv
    assert (flag(argv, "-c"), flag(argv, "-b"), flag(argv, "-ub")) == ("2048", batch, batch)
    assert lo.runner.parser.n_ubatch == int(batch)
    # the openai client's /v1/embeddings: the same load (no reload)
    pid = loaded(ext, "tiny:latest").runner.pid
    c = openai.OpenAI(base_url=llama_url + "/v1", api_key=token)
    assert len((await run(c.embeddings.create, model="tiny", input="hello")).data[0].embedding) == 64
    assert loaded(ext, "tiny:latest").runner.pid == pid


@pytest.fixture
def gemma(store, gemma_model):
    store.create("gemma", gemma_model)
    return read_gguf_info(gemma_model)


async def test_gemmas_embed_load_is_what_was_predicted(client, ext, llama_url, token, gemma, context_setting):
    """What LangChain, llama-index and litellm send: embed(model="gemma", input="hello"), no
    options. The load is Ollama's default context with a batch Gemma's size justifies, its
    argv is the one the fit check predicted, and ps says about what was predicted (the
    training context's batch reserved a 20.93 GiB compute buffer for this 253 MB model)."""
    context_setting(None)
    ctx = min(est.default_context(), gemma.context_length)
    emb = await run(client.embed, model="gemma", input="hello", options=ONE_THREAD)
    assert len(emb.embeddings) == 1 and len(emb.embeddings[0]) == 640
    lo = loaded(ext, "gemma:latest")
    batch = est.embed_batch(gemma, ctx)  # (Gemma's logits, 1 MiB a token: 512 to 2048 by the machine's memory)
    assert 512 <= batch <= 2048
    argv = lo.runner.argv
    assert (flag(argv, "-c"), flag(argv, "-b"), flag(argv, "-ub")) == (str(ctx), str(batch), str(batch))
    (m,) = (await run(client.ps)).models
    assert m.context_length == ctx
    predicted = lo.predictions["detailed"].total()
    assert m.size == pytest.approx(predicted, rel=0.1), (m.size, predicted)
    assert m.size < 2 * (1 << 30)

    # truncate (the default): an input longer than the load takes is cut to what it takes
    long_text = "The sky is blue because of the way air scatters sunlight. " * 250  # (about 3,000 tokens)
    r = await run(client.embed, model="gemma", input=long_text, options=ONE_THREAD)
    assert len(r.embeddings[0]) == 640 and 0 < r.prompt_eval_count <= batch
    assert loaded(ext, "gemma:latest").runner.pid == lo.runner.pid
    # truncate false: a 400 that says so
    with pytest.raises(ollama.ResponseError) as e:
        await run(client.embed, model="gemma", input=long_text, truncate=False, options=ONE_THREAD)
    assert e.value.status_code == 400
    assert f"longer than the batch of gemma:latest ({batch}:" in e.value.error, e.value.error
    # the openai client: truncated as Ollama's /v1/embeddings truncates
    c = openai.OpenAI(base_url=llama_url + "/v1", api_key=token)
    r = await run(c.embeddings.create, model="gemma", input=[long_text, "hello"])
    assert [len(d.embedding) for d in r.data] == [640, 640] and r.usage.prompt_tokens <= batch + 10

    # num_ctx 64: a batch of 64, and the input cut to 64 tokens (not to the 256 cells llama.cpp
    # pads the context to, which the micro-batch then refused)
    r = await run(client.embed, model="gemma", input=long_text, options=dict(ONE_THREAD, num_ctx=64))
    assert len(r.embeddings[0]) == 640 and 0 < r.prompt_eval_count <= 64
    argv = loaded(ext, "gemma:latest").runner.argv
    assert (flag(argv, "-c"), flag(argv, "-ub")) == ("64", "64")
    with pytest.raises(ollama.ResponseError) as e:
        await run(client.embed, model="gemma", input=long_text, truncate=False, options=dict(ONE_THREAD, num_ctx=64))
    assert e.value.status_code == 400 and "longer than the batch of gemma:latest (64:" in e.value.error, e.value.error
