"""The official ``ollama`` and ``openai`` clients, and our own client, against the server.

The synchronous clients block, and the server runs on this test's event loop, so each of
their calls runs in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct

import pytest
from srvutil import OPTS, TINY, FileHost

pytestmark = pytest.mark.engine

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")


def run(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


def collect(iterator):
    return list(iterator)


async def test_ollama_client(llama_url, token, make_model):
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    opts = dict(OPTS, num_predict=4)

    r = await run(c.generate, model="tiny", prompt="Once upon a time", raw=True, options=opts)
    assert r.done and r.done_reason == "length" and r.response and r.eval_count == 4
    chunks = await run(lambda: list(c.generate(model="tiny", prompt="Once", raw=True, options=opts, stream=True)))
    assert len(chunks) >= 2 and chunks[-1].done and not chunks[0].done

    msgs = [{"role": "user", "content": "Hello"}]
    r = await run(c.chat, model="tiny", messages=msgs, options=opts)
    assert r.message.role == "assistant" and r.message.content and r.done
    chunks = await run(lambda: list(c.chat(model="tiny", messages=msgs, options=opts, stream=True)))
    assert chunks[-1].done and chunks[-1].eval_count == 4

    ps = await run(c.ps)
    assert [m.name for m in ps.models] == ["tiny:latest"]
    m = ps.models[0]
    assert m.size > 0 and m.size_vram == 0 and m.expires_at is not None and m.context_length == 1024
    assert m.details.family == "llama" and m.details.format == "gguf"

    names = [m.model for m in (await run(c.list)).models]
    assert "tiny:latest" in names and "other:latest" in names
    show = await run(c.show, "tiny")
    assert show.details.family == "llama" and show.modelinfo["general.architecture"] == "llama"

    # pull from a local host that serves a GGUF with Range support
    path = make_model("cli-pull", **dict(TINY, seed=31))
    with FileHost({"/x/cli-pulled.gguf": path}) as host:
        statuses = await run(lambda: list(c.pull(host.url + "/x/cli-pulled.gguf", stream=True)))
        assert statuses[-1].status == "success"
        assert any(s.total == path.stat().st_size for s in statuses if s.total)
        assert (await run(c.pull, host.url + "/x/cli-pulled.gguf")).status == "success"  # again: already there
    names = [m.model for m in (await run(c.list)).models]
    assert any(n.startswith("cli-pulled") for n in names), names

    assert (await run(c.copy, "tiny", "tiny-copy")).status == "success"
    assert "tiny-copy:latest" in [m.model for m in (await run(c.list)).models]
    assert (await run(c.delete, "tiny-copy")).status == "success"
    assert "tiny-copy:latest" not in [m.model for m in (await run(c.list)).models]

    # create from an uploaded blob
    upload = make_model("cli-upload", **dict(TINY, seed=32))
    digest = await run(c.create_blob, upload)
    r = await run(c.create, model="uploaded", files={"uploaded.gguf": digest})
    assert r.status == "success"
    r = await run(c.generate, model="uploaded", prompt="x", raw=True, options=dict(OPTS, num_predict=2))
    assert r.eval_count == 2

    emb = await run(c.embed, model="tiny", input=["a", "b c"], options=OPTS)
    assert len(emb.embeddings) == 2 and len(emb.embeddings[0]) == 64

    with pytest.raises(ollama.ResponseError) as e:
        await run(c.generate, model="nope", prompt="x")
    assert e.value.status_code == 404 and "not found, try pulling it first" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        await run(c.generate, model="tiny", prompt="x", options={"num_ctx": "big"})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    # an option Ollama does not know is ignored (old clients still send num_gqa)
    assert (await run(c.generate, model="tiny", prompt="x", options={"num_gqa": 8, "num_predict": 2})).eval_count == 2
    c.close()


async def test_ollama_async_client(llama_url, token):
    c = ollama.AsyncClient(host=llama_url, headers={"Authorization": f"token {token}"})
    parts = []
    async for chunk in await c.generate(model="tiny", prompt="Once", raw=True, stream=True,
                                        options=dict(OPTS, num_predict=3)):
        parts.append(chunk)
    assert parts[-1].done and parts[-1].eval_count == 3
    assert (await c.ps()).models[0].name == "tiny:latest"


def _runner(ext):
    """tiny's child (which a model made from tiny with the same load options shares)."""
    (lo,) = ext.scheduler.loaded.values()
    return lo.runner


async def _tokens(ext, messages: list[dict], special: bool = True) -> list[int]:
    """The ids tiny's child makes of these messages through its chat template (the oracle)."""
    runner = _runner(ext)
    text = (await runner.post("/apply-template", {"messages": messages}))["prompt"]
    return (await runner.post("/tokenize", {"content": text, "add_special": special}))["tokens"]


def _user(text: str, system: str = "") -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


async def test_generate_context_round_trips(llama_url, token, ext, http):
    """Ollama's (deprecated) ``context``: the last chunk carries the conversation's token ids (the
    prompt's, then the answer's), and sent back they come before the next prompt."""
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    opts = dict(OPTS, num_predict=6, temperature=0.0, seed=7)

    first = await run(c.generate, model="tiny", prompt="Once upon a time", options=opts)
    ctx = first.context
    assert isinstance(ctx, list) and all(type(t) is int for t in ctx), ctx
    asked = await _tokens(ext, _user("Once upon a time"))
    assert ctx[:len(asked)] == asked and first.prompt_eval_count == len(asked) and asked[0] == 1  # with its BOS
    assert len(ctx) == first.prompt_eval_count + first.eval_count
    assert (await _runner(ext).post("/detokenize", {"tokens": ctx[len(asked):]}))["content"] == first.response
    # streamed: the last chunk carries it, and only the last
    chunks = await run(lambda: list(c.generate(model="tiny", prompt="Once upon a time", options=opts, stream=True)))
    assert [ch.context is None for ch in chunks] == [True] * (len(chunks) - 1) + [False] and chunks[-1].done
    last = chunks[-1].context
    assert last[:len(asked)] == asked and len(last) == chunks[-1].prompt_eval_count + chunks[-1].eval_count

    # the second turn: the first turn's ids, then the new prompt's (no second BOS); its context goes on
    new = await _tokens(ext, _user("And then?"), special=False)
    second = await run(c.generate, model="tiny", prompt="And then?", context=ctx, options=opts)
    assert second.prompt_eval_count == len(ctx) + len(new), (second.prompt_eval_count, len(ctx), len(new))
    assert second.context[:len(ctx) + len(new)] == ctx + new
    assert len(second.context) == second.prompt_eval_count + second.eval_count
    chunks = await run(lambda: list(c.generate(model="tiny", prompt="And then?", context=ctx, options=opts,
                                               stream=True)))
    assert chunks[-1].prompt_eval_count == len(ctx) + len(new) and chunks[-1].context[:len(ctx) + len(new)] == ctx + new
    third = await run(c.generate, model="tiny", prompt="The end", context=second.context, options=opts)
    assert third.prompt_eval_count == len(second.context) + len(await _tokens(ext, _user("The end"), special=False))

    # an answer cut at a stop word: the prompt and the answer's text, tokenized together (as Ollama does)
    word = first.response.strip()[:1]
    stopped = await run(c.generate, model="tiny", prompt="Once upon a time", options=dict(opts, stop=[word]))
    assert stopped.done_reason == "stop" and word not in stopped.response
    text = (await _runner(ext).post("/apply-template", {"messages": _user("Once upon a time")}))["prompt"]
    together = await _runner(ext).post("/tokenize", {"content": text + stopped.response, "add_special": True})
    assert stopped.context == together["tokens"]

    # raw: no context in, none out (the prompt is as given)
    plain = await run(c.generate, model="tiny", prompt="Once upon a time", raw=True, options=opts)
    raw = await run(c.generate, model="tiny", prompt="Once upon a time", raw=True, context=ctx, options=opts)
    assert plain.context is None and raw.context is None and raw.prompt_eval_count == plain.prompt_eval_count
    chunks = await run(lambda: list(c.generate(model="tiny", prompt="Once", raw=True, context=ctx, options=opts,
                                               stream=True)))
    assert chunks[-1].done and all(ch.context is None for ch in chunks)

    # longer than the context window: its first token and its end, as a long prompt is cut
    long = [1] + [300] * 1500
    cut = await run(c.generate, model="tiny", prompt="Hi", context=long, options=dict(opts, num_predict=4))
    assert cut.prompt_eval_count <= 1024 - 4 and cut.context[0] == 1
    assert len(cut.context) == cut.prompt_eval_count + cut.eval_count
    r = await http.post("api/generate", json={"model": "tiny", "prompt": "Hi", "context": long, "stream": False,
                                              "truncate": False, "options": opts})
    assert r.status_code == 400 and "the context and the prompt are 15" in r.json()["error"], r.text

    # what is not a context: a 400 that says so
    for bad, said in ((-1, "context[1] must be a token id (a whole number of 0 or more), got -1"),
                      (10 ** 6, "context[1] is 1000000, which is not a token of tiny: its vocabulary has 512 tokens")):
        with pytest.raises(ollama.ResponseError) as e:
            await run(c.generate, model="tiny", prompt="x", context=[1, bad], options=opts)
        assert e.value.status_code == 400 and said in e.value.error, e.value.error
    for bad, said in (("abc", "context must be a list of token ids"), ([1, 2.5], "context[1] must be a token id"),
                      ([True], "context[0] must be a token id (a whole number of 0 or more), got true"),
                      ({"a": 1}, "got an object")):
        r = await http.post("api/generate", json={"model": "tiny", "prompt": "x", "context": bad, "stream": False})
        assert r.status_code == 400 and said in r.json()["error"], r.text
    c.close()


async def test_generate_context_leaves_out_the_presets_messages(llama_url, token, ext):
    """Ollama: with a context, a model's messages are not added again (they are in it); its
    system message still is."""
    c = ollama.Client(host=llama_url, headers={"Authorization": f"token {token}"})
    history = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "It is me, Mario"}]
    await run(c.create, model="remembers", from_="tiny", system="You are Mario", messages=history,
              parameters=dict(OPTS))
    one = dict(OPTS, num_predict=1)
    fresh = await run(c.generate, model="remembers", prompt="Hello", options={"num_predict": 1})
    assert fresh.prompt_eval_count == len(await _tokens(ext, [{"role": "system", "content": "You are Mario"},
                                                                *history, *_user("Hello")]))
    ctx = fresh.context
    later = await run(c.generate, model="remembers", prompt="Hello", context=ctx, options={"num_predict": 1})
    alike = await run(c.generate, model="tiny", prompt="Hello", system="You are Mario", context=ctx, options=one)
    new = await _tokens(ext, _user("Hello", system="You are Mario"), special=False)
    assert later.prompt_eval_count == alike.prompt_eval_count == len(ctx) + len(new)
    # an empty context too (a context was given): the messages stay out
    empty = await run(c.generate, model="remembers", prompt="Hello", context=[], options={"num_predict": 1})
    assert empty.prompt_eval_count == len(await _tokens(ext, _user("Hello", system="You are Mario")))
    assert empty.context[:empty.prompt_eval_count] == await _tokens(ext, _user("Hello", system="You are Mario"))
    c.close()


async def test_openai_client(llama_url, token):
    c = openai.OpenAI(base_url=llama_url + "/v1", api_key=token)  # sends "Authorization: Bearer <token>"
    msgs = [{"role": "user", "content": "Hello"}]
    r = await run(c.chat.completions.create, model="tiny", messages=msgs, max_tokens=4)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chunks = await run(lambda: list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                                              stream=True)))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)

    r = await run(c.completions.create, model="tiny", prompt="Once upon", max_tokens=3)
    assert r.choices[0].text
    # what llama-server's routes would leave out of their answer without a word is a 400 that says so
    for call, kw, said in ((c.completions.create, dict(prompt="Once", echo=True), "echo is not supported"),
                           (c.completions.create, dict(prompt="Once", best_of=3), "best_of is not supported"),
                           (c.chat.completions.create, dict(messages=msgs, stop=5), "stop must be a string or a list")):
        with pytest.raises(openai.BadRequestError) as e:
            await run(call, model="tiny", max_tokens=3, **kw)
        assert said in e.value.body["message"], e.value.body
    r = await run(c.chat.completions.create, model="tiny", messages=msgs, max_tokens=3, stop=["\n\n", "."])
    assert r.choices[0].finish_reason in ("length", "stop")

    models = await run(c.models.list)
    ids = [m.id for m in models.data]
    assert "tiny:latest" in ids and "other:latest" in ids
    assert (await run(c.models.retrieve, "tiny")).id == "tiny:latest"

    emb = await run(c.embeddings.create, model="tiny", input=["hello", "world"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64
    # asked for base64 (the client asks for it unless told otherwise, and decodes it): the same vectors
    b64 = await run(c.embeddings.create, model="tiny", input=["hello", "world"], encoding_format="base64")
    raw = base64.b64decode(b64.data[1].embedding)
    assert struct.unpack("<64f", raw) == pytest.approx(emb.data[1].embedding, rel=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        await run(c.embeddings.create, model="tiny", input="hi", encoding_format="bogus")
    assert 'encoding_format must be "float" or "base64", got "bogus"' in str(e.value)

    with pytest.raises(openai.NotFoundError) as e:
        await run(c.chat.completions.create, model="nope", messages=msgs)
    assert "not found" in str(e.value)
    bad = openai.OpenAI(base_url=llama_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # 401 for a wrong key, as OpenAI answers it
        await run(bad.models.list)


async def test_our_client(llama_url, server_root, token, ext, monkeypatch, jp_runtime_dir):
    from jupyter_llama.client import (
        AsyncLlamaClient,
        BadRequestError,
        LlamaClient,
        ModelNotFoundError,
        ServerNotFound,
        find_server,
    )

    # explicit url (the server's root or the API root) and token
    c = LlamaClient(url=server_root, token=token)
    assert c.url == llama_url + "/"
    parts = await run(lambda: list(c.generate("tiny", "Once", raw=True, options=dict(OPTS, num_predict=3))))
    assert parts[-1]["done"] and parts[-1]["eval_count"] == 3
    one = await run(c.chat, "tiny", [{"role": "user", "content": "hi"}], stream=False,
                    options=dict(OPTS, num_predict=2))
    assert one["message"]["content"]
    assert (await run(c.ps))["models"][0]["name"] == "tiny:latest"
    assert "tiny:latest" in [m["name"] for m in (await run(c.tags))["models"]]
    assert (await run(c.show, "tiny"))["details"]["family"] == "llama"
    assert (await run(c.version))["version"]
    assert (await run(c.devices))["usage"]["cpu"] > 0
    assert "detailed" in (await run(c.estimate, "tiny", OPTS))["estimates"]
    assert any(e["kind"] == "loaded" for e in await run(c.events))
    await run(c.copy, "tiny", "t2")
    await run(c.delete, "t2")
    with pytest.raises(ModelNotFoundError) as e:
        await run(lambda: list(c.generate("nope", "x")))
    assert e.value.status == 404 and "not found" in e.value.message
    with pytest.raises(BadRequestError):
        await run(c.generate, "tiny", "x", stream=False, keep_alive="soon")
    assert (await run(c.unload, "tiny"))["done_reason"] == "unload"
    c.close()

    # found from the environment a kernel inherits: the URL, and the token from the runtime file
    monkeypatch.delenv("JUPYTER_LLAMA_TOKEN", raising=False)
    monkeypatch.setenv("JUPYTER_LLAMA_URL", ext.url)
    monkeypatch.setenv("JPY_PARENT_PID", str(os.getpid()))
    ext.serverapp.write_server_info_file()
    info = find_server()
    assert info.url == ext.url and info.token == token and info.source == "JUPYTER_LLAMA_URL"
    async with AsyncLlamaClient() as ac:
        parts = [p async for p in ac.generate("tiny", "Once", raw=True, options=dict(OPTS, num_predict=2))]
        assert parts[-1]["done"]
        assert (await ac.load("other", options=OPTS))["done_reason"] == "load"
    monkeypatch.setenv("JUPYTER_LLAMA_TOKEN", "explicit")
    assert find_server().token == "explicit"

    monkeypatch.delenv("JUPYTER_LLAMA_URL")
    ext.serverapp.remove_server_info_file()  # else its runtime file finds it (test_background.py)
    monkeypatch.setenv("JUPYTER_LLAMA_MANAGER_DIR", str(jp_runtime_dir / "no-manager"))
    with pytest.raises(ServerNotFound) as e:
        find_server()
    assert "jupyter-llama serve" in str(e.value) and "JupyterLab" in str(e.value)


async def test_clients_work_unconfigured_with_what_the_server_exports(http, ext, token, monkeypatch):
    """A kernel the server starts inherits its environment: the variables Ollama's and OpenAI's
    clients read point at this server, so both work with no arguments in a cell."""
    await http.get("api/version")  # the extension has started and exported its variables
    assert os.environ["OLLAMA_HOST"] == ext.url.rstrip("/") and os.environ["OPENAI_API_KEY"] == token
    assert os.environ["OPENAI_BASE_URL"].endswith("/llama/v1") and os.environ["JUPYTER_LLAMA_TOKEN"] == token
    opts = dict(OPTS, num_predict=2)
    r = await run(ollama.Client().generate, model="tiny", prompt="Once", raw=True, options=opts)
    assert r.eval_count == 2
    r = await run(openai.OpenAI(max_retries=0).completions.create, model="tiny", prompt="Once", max_tokens=2)
    assert r.usage.completion_tokens == 2
    anthropic = pytest.importorskip("anthropic")  # it sends the key as x-api-key
    assert os.environ["ANTHROPIC_BASE_URL"] == ext.url.rstrip("/") and os.environ["ANTHROPIC_API_KEY"] == token
    r = await run(anthropic.Anthropic(max_retries=0).messages.create, model="tiny", max_tokens=2,
                  messages=[{"role": "user", "content": "hi"}])
    assert r.usage.output_tokens == 2 and r.model == "tiny"
    wrong = anthropic.Anthropic(max_retries=0, api_key="not-the-token")
    with pytest.raises(anthropic.AuthenticationError):
        await run(wrong.messages.create, model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_a_users_own_client_settings_are_left_alone(monkeypatch):
    from types import SimpleNamespace

    from jupyter_llama.server.app import LlamaExtension

    monkeypatch.setenv("OPENAI_BASE_URL", "https://api.openai.com/v1")
    for k in ("OLLAMA_HOST", "OPENAI_API_KEY", "OLLAMA_API_KEY", "JUPYTER_LLAMA_TOKEN", "JUPYTER_LLAMA_URL",
              "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    ext = LlamaExtension()
    ext.serverapp = SimpleNamespace(connection_url="http://127.0.0.1:9/", identity_provider=SimpleNamespace(token="t"))
    ext.export_url()
    assert os.environ["OPENAI_BASE_URL"] == "https://api.openai.com/v1", "set by the user: kept"
    assert os.environ["OLLAMA_HOST"] == "http://127.0.0.1:9/llama" and os.environ["OPENAI_API_KEY"] == "t"
    ext._started = True
    asyncio.run(ext.stop_extension())
    assert "OLLAMA_HOST" not in os.environ and os.environ["OPENAI_BASE_URL"] == "https://api.openai.com/v1"
