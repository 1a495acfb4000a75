"""The official ``ollama`` and ``openai`` clients, and our own client, against the server.

The synchronous clients block, and the server runs on this test's event loop, so each of
their calls runs in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import os

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

    models = await run(c.models.list)
    ids = [m.id for m in models.data]
    assert "tiny:latest" in ids and "other:latest" in ids
    assert (await run(c.models.retrieve, "tiny")).id == "tiny:latest"

    emb = await run(c.embeddings.create, model="tiny", input=["hello", "world"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64

    with pytest.raises(openai.NotFoundError) as e:
        await run(c.chat.completions.create, model="nope", messages=msgs)
    assert "not found" in str(e.value)
    bad = openai.OpenAI(base_url=llama_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # 401 for a wrong key, as OpenAI answers it
        await run(bad.models.list)


async def test_our_client(llama_url, server_root, token, ext, monkeypatch, jp_runtime_dir):
    from jupyter_llama.client import (AsyncLlamaClient, BadRequestError, LlamaClient, ModelNotFoundError,
                                      ServerNotFound, find_server)

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
