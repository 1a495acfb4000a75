"""The Ollama-compatible REST API through a real Jupyter server and real llama-server children."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math

import httpx
import pytest
from srvutil import LONG, OPTS, FileHost, lines, png, wait_until

pytestmark = pytest.mark.engine

NOT_FOUND = 'model "nope" not found, try pulling it first'  # the store may add " (did you mean ...?)"


def gen(model="tiny", prompt="Once upon a time", **kw):
    body = {"model": model, "prompt": prompt, "raw": True, "options": dict(OPTS, num_predict=4)}
    body.update(kw)
    return body


# ----------------------------------------------------------------------------- auth


async def test_every_route_needs_auth(llama_url, token):
    routes = [("GET", "api/version"), ("GET", "api/ps"), ("GET", "api/tags"), ("POST", "api/generate"),
              ("POST", "api/chat"), ("POST", "api/show"), ("POST", "api/pull"), ("DELETE", "api/delete"),
              ("POST", "api/copy"), ("POST", "api/create"), ("POST", "api/embed"),
              ("HEAD", "api/blobs/sha256:" + "0" * 64), ("POST", "api/blobs/sha256:" + "0" * 64),
              ("GET", "api/devices"), ("POST", "api/estimate"), ("GET", "api/events"), ("GET", "api/log"),
              ("GET", "v1/models"),
              ("POST", "v1/chat/completions"), ("POST", "v1/completions"), ("POST", "v1/embeddings")]
    async with httpx.AsyncClient(base_url=llama_url + "/", trust_env=False) as c:
        for method, path in routes:
            for headers in ({}, {"Authorization": "token wrong"}, {"Authorization": "Bearer wrong"}):
                r = await c.request(method, path, headers=headers, content=b'{"model": "tiny"}')
                # 401, as API clients expect, with a sentence on how to authenticate (Jupyter says 403,
                # and for a POST without a token it speaks of a missing '_xsrf' argument)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                if method != "HEAD":
                    err = r.json()["error"]  # a sentence (Ollama routes) or OpenAI's error object
                    assert "Authorization: Bearer TOKEN" in (err["message"] if isinstance(err, dict) else err)
                    assert "_xsrf" not in r.text
        # the token works in either spelling of the header (openai sends Bearer)
        for scheme in ("token", "Bearer"):
            r = await c.get("api/version", headers={"Authorization": f"{scheme} {token}"})
            assert r.status_code == 200, r.text


async def test_cookie_requests_need_xsrf(llama_url, token):
    """A browser-style request (login cookie, no token) must carry the XSRF token to POST."""
    async with httpx.AsyncClient(base_url=llama_url + "/", trust_env=False) as c:
        r = await c.get("api/version", params={"token": token})  # logs in: sets the cookie
        assert r.status_code == 200
        assert any(k.startswith("username-") for k in c.cookies.keys()), c.cookies
        r = await c.get("api/tags")  # GET with the cookie alone is fine
        assert r.status_code == 200
        r = await c.post("api/show", json={"model": "tiny"})
        assert r.status_code == 403, r.text
        xsrf = c.cookies.get("_xsrf")
        if xsrf:
            r = await c.post("api/show", json={"model": "tiny"}, headers={"X-XSRFToken": xsrf})
            assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- listing


async def test_version_tags_show(jp_fetch):
    r = await jp_fetch("llama", "api", "version")
    v = json.loads(r.body)
    assert v["version"].count(".") == 2 and v["engine"]
    tags = json.loads((await jp_fetch("llama", "api", "tags")).body)
    names = {m["name"] for m in tags["models"]}
    assert {"tiny:latest", "other:latest"} <= names
    m = next(m for m in tags["models"] if m["name"] == "tiny:latest")
    assert m["details"]["format"] == "gguf" and m["details"]["family"] == "llama"
    assert m["details"]["parameter_size"] and m["details"]["quantization_level"]
    assert m["size"] > 0 and len(m["digest"]) == 64 and m["modified_at"]
    r = await jp_fetch("llama", "api", "show", method="POST", body=json.dumps({"model": "tiny"}))
    show = json.loads(r.body)
    assert show["details"]["family"] == "llama"
    assert show["model_info"]["general.architecture"] == "llama"
    assert show["model_info"]["llama.context_length"] == 4096
    assert "im_start" in show["template"]
    assert show["capabilities"] == ["completion"]
    ps = json.loads((await jp_fetch("llama", "api", "ps")).body)
    assert ps == {"models": []}


# ----------------------------------------------------------------------------- generate / chat


async def test_generate_streams_ndjson(http):
    async with http.stream("POST", "api/generate", json=gen()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        chunks = [json.loads(ln) async for ln in r.aiter_lines() if ln.strip()]
    *parts, last = chunks
    assert parts and all(c["done"] is False and c["model"] == "tiny" for c in parts)
    assert "".join(c["response"] for c in parts)
    dt.datetime.fromisoformat(parts[0]["created_at"])
    assert last["done"] is True and last["done_reason"] == "length" and last["response"] == ""
    assert last["eval_count"] == 4 and last["prompt_eval_count"] >= 1
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[k], int) and last[k] >= 0, k
    assert last["total_duration"] >= last["eval_duration"] > 0


async def test_generate_non_stream_seed_and_format(http):
    body = gen(stream=False, options=dict(OPTS, num_predict=8, seed=42, temperature=1.0))
    a = (await http.post("api/generate", json=body)).json()
    b = (await http.post("api/generate", json=body)).json()
    assert a["done"] and a["response"] and a["eval_count"] == 8
    assert a["response"] == b["response"]  # seed and temperature reach the child
    # templated (not raw) prompts go through the model's chat template
    c = (await http.post("api/generate", json=gen(raw=False, system="Be brief.", stream=False))).json()
    assert c["prompt_eval_count"] > a["prompt_eval_count"]
    # format: llama-server constrains the output to JSON
    j = (await http.post("api/generate", json=gen(format="json", stream=False,
                                                  options=dict(OPTS, num_predict=6)))).json()
    assert j["response"].lstrip().startswith("{"), j["response"]


async def test_empty_prompt_loads_and_keep_alive_0_unloads(http, ext):
    r = (await http.post("api/generate", json={"model": "tiny", "options": OPTS})).json()
    assert r["done"] is True and r["done_reason"] == "load" and r["load_duration"] > 0
    ps = (await http.get("api/ps")).json()["models"]
    assert [m["name"] for m in ps] == ["tiny:latest"]
    m = ps[0]
    assert m["size"] > 0 and m["size_vram"] == 0 and m["context_length"] == 1024 and len(m["digest"]) == 64
    assert m["details"]["family"] == "llama"
    expires = dt.datetime.fromisoformat(m["expires_at"])
    left = (expires - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert 20 < left <= 31  # the server's keep_alive is 30s
    assert dt.datetime.fromisoformat(m["last_used"]) <= dt.datetime.now(dt.timezone.utc)  # ours: its last request
    r = (await http.post("api/generate", json={"model": "tiny", "keep_alive": 0})).json()
    assert r["done_reason"] == "unload"
    assert (await http.get("api/ps")).json()["models"] == []
    # chat: no messages loads; a pinned keep_alive shows a far-away expiry
    r = (await http.post("api/chat", json={"model": "other", "messages": [], "keep_alive": -1,
                                           "options": OPTS})).json()
    assert r["done_reason"] == "load" and r["message"] == {"role": "assistant", "content": ""}
    m = (await http.get("api/ps")).json()["models"][0]
    assert dt.datetime.fromisoformat(m["expires_at"]).year > 2200 and m["pinned"] is True
    r = (await http.post("api/chat", json={"model": "other", "messages": [], "keep_alive": "0s"})).json()
    assert r["done_reason"] == "unload"
    assert (await http.get("api/ps")).json()["models"] == []


async def test_a_context_above_the_models_training_context_is_brought_down_to_it(http):
    """As Ollama does: tiny was trained on 4096 tokens, so num_ctx 8192 loads 4096 (ps says
    so), and a prompt longer than that is cut to it rather than refused by llama-server."""
    opts = dict(OPTS, num_ctx=8192, num_predict=2)
    r = await http.post("api/generate", json=gen(prompt="Once upon a time " * 1500, stream=False, options=opts))
    assert r.status_code == 200, r.text
    assert 3000 < r.json()["prompt_eval_count"] <= 4096, r.json()
    assert [m["context_length"] for m in (await http.get("api/ps")).json()["models"]] == [4096]
    # asked for again the same way, it is the same load (no reload for a context it cannot have)
    r = await http.post("api/generate", json=gen(stream=False, options=opts))
    assert r.status_code == 200 and r.json()["load_duration"] == 0, r.json()
    # the estimate of such a load is of what it gets, and says why
    est = (await http.post("api/estimate", json={"model": "tiny", "options": opts})).json()
    assert est["estimates"]["detailed"]["n_ctx"] == 4096 and ("num_ctx 8192 is more than the model's training "
                                                              "context: it is loaded with 4096") in \
        " ".join(est["estimates"]["detailed"]["warnings"]), est["estimates"]["detailed"]
    await http.post("api/generate", json={"model": "tiny", "keep_alive": 0})


async def test_a_penalty_window_of_minus_one_is_the_whole_context(http):
    """Ollama's repeat_last_n -1 (and llama.cpp's dry_penalty_last_n -1): the child's context,
    which llama-server takes where it refuses -1 ("Field 'repeat_last_n': Value must be
    between 0 ..."), as the ollama client sends it."""
    for opt in ("repeat_last_n", "dry_penalty_last_n"):
        r = await http.post("api/generate", json=gen(stream=False, options=dict(OPTS, num_predict=3, **{opt: -1})))
        assert r.status_code == 200 and r.json()["eval_count"] == 3, r.text
    # the OpenAI routes pass the body to the child, whose JSON library's tag is left out of its message
    r = await http.post("v1/chat/completions", json={"model": "tiny", "max_tokens": "3",
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    said = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_tokens" in said and "type must be number, but is string" in said, said
    assert "json.exception" not in said


async def test_chat_stream_and_not(http):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello"}],
            "options": dict(OPTS, num_predict=4)}
    r = await http.post("api/chat", json=body)
    assert r.headers["content-type"].startswith("application/x-ndjson")
    *parts, last = lines(r.content)
    assert parts and all(p["message"]["role"] == "assistant" and not p["done"] for p in parts)
    assert last["done"] and last["done_reason"] == "length" and last["eval_count"] == 4
    assert last["prompt_eval_count"] > 5 and last["eval_duration"] > 0
    one = (await http.post("api/chat", json=dict(body, stream=False))).json()
    assert one["done"] and one["message"]["role"] == "assistant" and one["message"]["content"]


async def test_logprobs_on_generate_and_chat(http):
    """Ollama's logprobs and top_logprobs: each chunk carries its tokens' log probabilities
    (with the likeliest tokens at each position when asked), the answer not streamed all of
    them; without logprobs there are none."""
    def check(entries, top):
        for e in entries:
            assert set(e) == {"token", "logprob", "bytes"} | ({"top_logprobs"} if top else set()), e
            assert e["logprob"] <= 0 and bytes(e["bytes"]).decode("utf-8", "replace")
            if top:
                alts = [t["logprob"] for t in e["top_logprobs"]]
                assert len(alts) == top and alts == sorted(alts, reverse=True) and e["logprob"] <= alts[0] + 1e-6

    greedy = dict(OPTS, num_predict=4, temperature=0)
    for raw in (True, False):  # (the raw path, and the templated one whose last chunk carries context)
        one = (await http.post("api/generate", json=gen(raw=raw, stream=False, logprobs=True, top_logprobs=3,
                                                            options=greedy))).json()
        assert one["done_reason"] == "length" and len(one["logprobs"]) == one["eval_count"] == 4
        check(one["logprobs"], 3)
        assert b"".join(bytes(e["bytes"]) for e in one["logprobs"]).decode() == one["response"]
        # greedy: the chosen token is the likeliest
        assert all(e["token"] == e["top_logprobs"][0]["token"] for e in one["logprobs"])
        r = await http.post("api/generate", json=gen(raw=raw, logprobs=True, options=greedy))
        *parts, last = lines(r.content)
        assert "logprobs" not in last and all(p["logprobs"] for p in parts)
        for p in parts:
            check(p["logprobs"], 0)
            assert b"".join(bytes(e["bytes"]) for e in p["logprobs"]).decode() == p["response"]
        assert [e["logprob"] for p in parts for e in p["logprobs"]] == pytest.approx(
            [e["logprob"] for e in one["logprobs"]], abs=1e-4)  # (the same greedy answer, streamed)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "options": greedy,
            "logprobs": True, "top_logprobs": 2}
    one = (await http.post("api/chat", json=dict(chat, stream=False))).json()
    assert len(one["logprobs"]) == one["eval_count"] == 4
    check(one["logprobs"], 2)
    *parts, last = lines((await http.post("api/chat", json=chat)).content)
    assert all(len(p["logprobs"]) >= 1 for p in parts) and "logprobs" not in last
    # not asked (top_logprobs alone asks nothing, as in Ollama): no logprobs anywhere
    plain = (await http.post("api/generate", json=gen(stream=False, top_logprobs=2))).json()
    assert "logprobs" not in plain and plain["eval_count"] == 4
    for bad in (21, -1, "3", 1.5, True):
        r = await http.post("api/generate", json=gen(logprobs=True, top_logprobs=bad))
        assert r.status_code == 400 and r.json()["error"].startswith("top_logprobs must be a whole number from 0 to 20")


async def test_embed(http):
    r = (await http.post("api/embed", json={"model": "tiny", "input": ["hello", "world peace"],
                                            "options": OPTS})).json()
    vecs = r["embeddings"]
    assert len(vecs) == 2 and len(vecs[0]) == 64
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-6 for v in vecs)
    assert r["prompt_eval_count"] > 0
    legacy = (await http.post("api/embeddings", json={"model": "tiny", "prompt": "hello", "options": OPTS})).json()
    assert len(legacy["embedding"]) == 64
    ps = (await http.get("api/ps")).json()["models"]
    assert ps[0]["options"]["embedding"] is True
    # an input longer than llama-server's default micro-batch (512) embeds: the embedding load
    # gets a batch as large as its context (RAG chunks of ~1000 tokens answered 500 before)
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)  # ~1300 tokens here
    r = await http.post("api/embed", json={"model": "tiny", "input": long_text,
                                           "options": dict(OPTS, num_ctx=2048)})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] > 512 and len(r.json()["embeddings"][0]) == 64
    # longer than the context: its beginning is embedded (Ollama's truncate), or with truncate false a 400
    r = await http.post("api/embed", json={"model": "tiny", "input": long_text * 4,
                                           "options": dict(OPTS, num_ctx=2048)})
    assert r.status_code == 200 and 512 < r.json()["prompt_eval_count"] <= 2048, r.text
    r = await http.post("api/embed", json={"model": "tiny", "input": long_text * 4, "truncate": False,
                                           "options": dict(OPTS, num_ctx=2048)})
    assert r.status_code == 400 and "longer than the context" in r.json()["error"], r.text


# ----------------------------------------------------------------------------- errors


def test_an_unexpected_error_is_said_as_a_bug_with_where_its_traceback_is():
    from jupyter_llama.server.handlers import error_status

    status, msg = error_status(AttributeError("'X' object has no attribute 'final'"))
    assert status == 500 and msg.startswith("internal error in jupyter-llama (AttributeError: 'X' object has no")
    assert "AttributeError(" not in msg and "log has its traceback" in msg


async def test_error_statuses(http):
    async def err(method, path, status, **kw):
        r = await http.request(method, path, **kw)
        assert r.status_code == status, (path, r.status_code, r.text)
        return r.json()["error"]

    far = "qqqqqqqqqqqqqqqqqqqqqqqq"  # nothing like it in the store: Ollama's message exactly
    assert await err("POST", "api/generate", 404, json=gen(far)) == f'model "{far}" not found, try pulling it first'
    assert (await err("POST", "api/generate", 404, json=gen("nope"))).startswith(NOT_FOUND)
    assert (await err("POST", "api/chat", 404,
                      json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})).startswith(NOT_FOUND)
    assert (await err("POST", "api/generate", 404, json={"model": "nope", "keep_alive": 0})).startswith(NOT_FOUND)
    assert (await err("POST", "api/show", 404, json={"model": "nope"})).startswith(NOT_FOUND)
    # the store names the model in its full form here ("nope:latest")
    assert "not found, try pulling it first" in await err("DELETE", "api/delete", 404, json={"model": "nope"})
    assert "not found, try pulling it first" in await err("POST", "api/copy", 404,
                                                          json={"source": "nope", "destination": "x"})
    assert (await err("POST", "api/embed", 404, json={"model": "nope", "input": "x"})).startswith(NOT_FOUND)
    assert "malformed JSON" in await err("POST", "api/generate", 400, content=b'{"model": "tiny",')
    # HEAD answers where Ollama's does (clients probe a server so); a wrong method names the right one
    for path in ("api/version", "api/tags"):
        r = await http.head(path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    said = await err("POST", "api/delete", 405, json={"model": "x"})
    assert said.endswith("/llama/api/delete: use DELETE"), said
    assert "JSON object, got an array" in await err("POST", "api/generate", 400, content=b"[1, 2]")
    assert "JSON object, got null" in await err("POST", "api/generate", 400, content=b"null")
    for path, body in (("api/generate", b'{"model": "tiny", "prompt": "\\ud800 x", "stream": false}'),
                       ("api/embed", b'{"model": "tiny", "input": "\\ud800"}'),
                       ("v1/embeddings", b'{"model": "tiny", "input": ["a", "\\ud800"]}')):
        said = await err("POST", path, 400, content=body)
        assert "half of a UTF-16 surrogate pair" in (said["message"] if path.startswith("v1/") else said), said
    assert "model is required" in await err("POST", "api/generate", 400, json={"prompt": "x"})
    # an option Ollama does not know is ignored, as Ollama ignores it
    r = await http.post("api/generate", json=gen(stream=False, options={"num_gqa": 8, "num_predict": 2}))
    assert r.status_code == 200 and r.json()["eval_count"] == 2, r.text
    await http.post("api/generate", json={"model": "tiny", "keep_alive": 0})  # the checks below load nothing
    assert "num_ctx" in await err("POST", "api/generate", 400, json=gen(options={"num_ctx": "big"}))
    assert "keep_alive" in await err("POST", "api/generate", 400, json=gen(keep_alive="forever-ish"))
    # whole numbers llama-server would wrap round, or refuse in its own field names
    for opt, value, said in (("num_predict", 3_000_000_000, "from -2147483648 to 2147483647, got 3000000000"),
                             ("num_predict", 1e30, "from -2147483648 to 2147483647, got 1e+30"),
                             ("num_keep", -100, "from -1 to 2147483647, got -100"),
                             ("dry_allowed_length", -1, "from 0 to 2147483647, got -1")):
        assert f"option {opt} must be a whole number {said}" in await err(
            "POST", "api/generate", 400, json=gen(options=dict(OPTS, **{opt: value})))
    said = await err("POST", "api/chat", 400, json={"model": "tiny", "messages": [], "keep_alive": True})
    assert "keep_alive" in said
    assert "role" in await err("POST", "api/chat", 400, json={"model": "tiny", "messages": [{"content": "x"}]})
    for bad in ("sha256:xyz", "md5:" + "0" * 32, "sha256:" + "0" * 63, "..%2F..%2Fetc"):
        assert "digest" in await err("POST", f"api/blobs/{bad}", 400, content=b"data")
        r = await http.head(f"api/blobs/{bad}")
        assert r.status_code == 400
    # nothing touched the store for the bad digests
    assert (await http.get("api/ps")).json()["models"] == []


@pytest.mark.llama_config(max_request_size=2000)
async def test_request_size_limit(http):
    r = await http.post("api/generate", json=gen(prompt="x" * 5000))
    assert r.status_code == 413 and "limit" in r.json()["error"]


# ----------------------------------------------------------------------------- blobs, create, copy, delete


async def test_blobs_create_copy_delete(http, make_model, ext):
    from srvutil import TINY

    path = make_model("srv-upload", **dict(TINY, seed=11))
    data = path.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert (await http.head(f"api/blobs/{digest}")).status_code == 404
    wrong = "sha256:" + "1" * 64
    r = await http.post(f"api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and "mismatch" in r.json()["error"]
    assert (await http.head(f"api/blobs/{wrong}")).status_code == 404

    async def body():  # streamed in pieces, as a large upload would be
        for i in range(0, len(data), 256 * 1024):
            yield data[i:i + 256 * 1024]

    r = await http.post(f"api/blobs/{digest}", content=body())
    assert r.status_code == 201, r.text
    assert (await http.head(f"api/blobs/{digest}")).status_code == 200

    r = await http.post("api/create", json={"model": "made", "files": {"nope.gguf": "sha256:" + "2" * 64}})
    assert r.status_code == 400 and "uploaded" in r.json()["error"]
    r = await http.post("api/create", json={"model": "made", "files": {"made.gguf": digest}})
    statuses = [s["status"] for s in lines(r.content)]
    assert statuses[0] == "parsing GGUF" and statuses[-1] == "success", statuses
    r = await http.post("api/create", json={"model": "made2", "from": "made", "stream": False})
    assert r.json()["status"] == "success"
    names = {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    assert {"made:latest", "made2:latest"} <= names

    # a copy onto the model's own name (in any case) would change nothing but its parent: a 400
    for dst in ("made", "MADE:latest"):
        r = await http.post("api/copy", json={"source": "made", "destination": dst})
        assert r.status_code == 400 and "are the same model, made:latest (names ignore case)" in r.json()["error"]
    assert {"made:latest", "made2:latest"} <= {m["name"] for m in (await http.get("api/tags")).json()["models"]}

    # copy, load the copy, delete it: it is unloaded first; the original keeps its blob
    assert (await http.post("api/copy", json={"source": "made", "destination": "made3"})).status_code == 200
    await http.post("api/generate", json={"model": "made3", "options": OPTS})
    assert [m["name"] for m in (await http.get("api/ps")).json()["models"]] == ["made3:latest"]
    r = await http.request("DELETE", "api/delete", json={"model": "made3"})
    assert r.status_code == 200, r.text
    assert (await http.get("api/ps")).json()["models"] == []
    names = {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    assert "made3:latest" not in names and "made:latest" in names
    r = await http.post("api/generate", json=gen("made", stream=False))
    assert r.status_code == 200 and r.json()["eval_count"] == 4
    assert (await http.request("DELETE", "api/delete", json={"model": "made3"})).status_code == 404
    # a model that shares the loaded one's file (made2, made FROM it) goes; the loaded one stays
    assert [m["name"] for m in (await http.get("api/ps")).json()["models"]] == ["made:latest"]
    assert (await http.request("DELETE", "api/delete", json={"model": "made2"})).status_code == 200
    assert [m["name"] for m in (await http.get("api/ps")).json()["models"]] == ["made:latest"]
    assert (await http.request("DELETE", "api/delete", json={"model": "made"})).status_code == 200
    assert (await http.get("api/ps")).json()["models"] == []


@pytest.mark.llama_config(max_upload_size=1000)
async def test_upload_size_limit(http):
    r = await http.post("api/blobs/sha256:" + "3" * 64, content=b"x" * 5000)
    assert r.status_code == 413 and "limit" in r.json()["error"]


async def test_pull_stream_from_a_local_host(http, make_model):
    from srvutil import TINY

    path = make_model("srv-pull", **dict(TINY, seed=21))
    with FileHost({"/m/pulled.gguf": path}) as host:
        async with http.stream("POST", "api/pull", json={"model": host.url + "/m/pulled.gguf",
                                                         "destination": "pulled"}) as r:
            assert r.status_code == 200
            statuses = [json.loads(ln) async for ln in r.aiter_lines() if ln.strip()]
        assert statuses[-1] == {"status": "success"}, statuses
        assert any(s.get("total") == path.stat().st_size and s.get("completed") == s.get("total") for s in statuses)
        # an error before any progress is an HTTP status; a missing file upstream is an error
        r = await http.post("api/pull", json={"model": host.url + "/m/missing.gguf", "destination": "x"})
        assert r.status_code >= 400 or "error" in lines(r.content)[-1], r.text
        r = await http.post("api/pull", json={"model": "ftp://example/x.gguf"})
        assert r.status_code == 400
    names = {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    assert "pulled:latest" in names


# ----------------------------------------------------------------------------- ours


async def test_devices_estimate_events(http, ext):
    dev = (await http.get("api/devices")).json()
    assert dev["devices"][0]["id"] == "cpu" and dev["usage"] == {} and "text" in dev
    est = (await http.post("api/estimate", json={"model": "tiny", "options": OPTS})).json()
    assert {"coarse", "detailed"} <= set(est["estimates"]) and est["actual"] is None
    assert est["estimates"]["detailed"]["total"] > 0
    assert (await http.post("api/estimate", json={"model": "nope"})).status_code == 404

    await http.post("api/generate", json={"model": "tiny", "options": OPTS})
    est = (await http.post("api/estimate", json={"model": "tiny", "options": OPTS})).json()
    assert est["actual"]["total"] > 0 and est["loaded"]["name"] == "tiny:latest" and est["loaded"]["same_options"]
    # the predictions are the ones made for that load
    assert est["estimates"]["detailed"] == est["loaded"]["predictions"]["detailed"]
    # other load options: a prediction for them, and no actual (that load allocated something else)
    other = (await http.post("api/estimate", json={"model": "tiny", "options": dict(OPTS, num_ctx=512)})).json()
    assert other["actual"] is None and other["loaded"]["same_options"] is False
    assert other["estimates"]["detailed"]["total"] != est["estimates"]["detailed"]["total"]
    dev = (await http.get("api/devices")).json()
    assert dev["usage"]["cpu"] > 0 and dev["loaded"][0]["name"] == "tiny:latest"

    events = (await http.get("api/events")).json()["events"]
    kinds = [e["kind"] for e in events]
    assert "fit" in kinds and "loaded" in kinds
    last = events[-1]["seq"]
    assert (await http.get("api/events", params={"since": last})).json()["events"] == []
    assert all(e["model"] == "tiny:latest"
               for e in (await http.get("api/events", params={"model": "tiny:latest"})).json()["events"])

    # the live feed: history after `since`, then new events as they happen
    async with http.stream("GET", "api/events", params={"stream": "1", "since": last}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        await http.post("api/generate", json={"model": "other", "options": OPTS})
        seen = []
        async for ln in r.aiter_lines():
            if ln.strip():
                seen.append(json.loads(ln))
                if seen[-1]["kind"] == "loaded":
                    break
    assert seen[-1]["model"] == "other:latest" and all(e["seq"] > last for e in seen)
    assert (await http.get("api/events", params={"since": "x"})).status_code == 400


async def test_long_options_reach_the_child(http, ext):
    """Load options are load options: num_ctx reaches llama-server's -c, num_thread its -t."""
    await http.post("api/generate", json={"model": "tiny", "options": LONG})
    lo = next(iter(ext.scheduler.loaded.values()))
    assert "-c" in lo.runner.argv and lo.runner.argv[lo.runner.argv.index("-c") + 1] == "4096"
    assert lo.runner.argv[lo.runner.argv.index("-t") + 1] == "1"
    await wait_until(lambda: lo.refcount == 0)


@pytest.mark.llama_config(server_binary="/nonexistent/llama-server")
async def test_without_an_engine_the_registry_still_works(http):
    r = await http.post("api/generate", json=gen())
    assert r.status_code == 503 and "llama-server" in r.json()["error"]
    assert (await http.get("api/version")).json()["engine_error"]
    assert "tiny:latest" in {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    assert (await http.get("api/ps")).json() == {"models": []}
    assert (await http.post("api/show", json={"model": "tiny"})).status_code == 200


# ----------------------------------------------------------------------------- the child's log


async def test_log_of_a_loaded_model(http):
    r = await http.get("api/log", params={"model": "tiny"})
    assert r.status_code == 404 and "is not loaded" in r.json()["error"], r.text
    # a load that failed: its child's log is what the user needs then (it was "not loaded")
    bad = dict(OPTS, cache_type_k="q4_0", flash_attn="on")  # (a head of 16 is not a q4_0 block of 32)
    r = await http.post("api/generate", json=gen(options=dict(bad, num_predict=1)))
    assert r.status_code in (400, 500), r.text
    failed = (await http.get("api/log", params={"model": "tiny"})).json()
    assert failed["state"] == "its load failed" and failed["lines"], failed
    # ... until it loads: then, and once unloaded again, that old failure is not what log shows
    assert (await http.post("api/generate", json=gen())).status_code == 200
    await http.post("api/generate", json={"model": "tiny", "keep_alive": 0})
    r = await http.get("api/log", params={"model": "tiny"})
    assert r.status_code == 404 and "is not loaded" in r.json()["error"], r.text
    assert (await http.post("api/generate", json=gen())).status_code == 200
    r = await http.get("api/log", params={"model": "tiny", "match": "buffer size"})
    body = r.json()
    assert r.status_code == 200 and body["model"] == "tiny:latest" and body["state"] == "ready"
    assert body["lines"] and all("buffer size" in ln for ln in body["lines"])
    assert any("KV buffer size" in ln for ln in body["lines"])  # what llama.cpp allocated, as it said it
    assert body["argv"][0].endswith("llama-server") and body["lines_seen"] > len(body["lines"])
    tail = (await http.get("api/log", params={"model": "tiny:latest", "lines": 3})).json()["lines"]
    assert len(tail) == 3
    for bad, says in (({"model": "tiny", "lines": "x"}, "whole number"), ({}, "?model=NAME")):
        r = await http.get("api/log", params=bad)
        assert r.status_code == 400 and says in r.json()["error"], r.text


# ----------------------------------------------------------------------------- images

async def test_chat_with_an_image_on_a_vision_model(http, store):
    from srvutil import TINY

    # the same weights as "tiny" (so the same model file), plus a synthetic projector: a runner is
    # for a file and its projector, so "tiny" below must not be served by vision's child
    store.synth("vision", projector=True, **TINY)
    msg = {"role": "user", "content": "What is in the picture?", "images": [png()]}
    r = await http.post("api/chat", json={"model": "vision", "messages": [msg], "stream": False,
                                          "options": dict(OPTS, num_predict=4)})
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["done"] and body["eval_count"] == 4
    assert body["prompt_eval_count"] > 4, "the image's embeddings count as prompt tokens"
    show = (await http.post("api/show", json={"model": "vision"})).json()
    assert show["capabilities"] == ["completion", "vision"], show["capabilities"]
    # one model, one details object: ps (the model loaded) says what tags and show say
    tags = {m["name"]: m["details"] for m in (await http.get("api/tags")).json()["models"]}
    ps = {m["name"]: m["details"] for m in (await http.get("api/ps")).json()["models"]}
    assert ps["vision:latest"] == tags["vision:latest"] == show["details"], (ps, tags, show["details"])
    assert tags["vision:latest"]["families"] == ["llama", "clip"], tags

    r = await http.post("api/chat", json={"model": "tiny", "messages": [msg], "stream": False, "options": OPTS})
    assert r.status_code == 400 and "no multimodal projector" in r.json()["error"], r.text
    r = await http.post("api/chat", json={"model": "vision", "stream": False, "options": OPTS,
                                          "messages": [dict(msg, images=["not base64!"])]})
    assert r.status_code == 400 and "not base64" in r.json()["error"], r.text


async def test_prompt_tokens_count_the_whole_prompt_cached_or_not(http):
    body = gen(prompt="The same prompt, word for word, twice in a row", stream=False)
    first = (await http.post("api/generate", json=body)).json()
    second = (await http.post("api/generate", json=body)).json()  # llama-server finds it in its cache
    assert first["prompt_eval_count"] == second["prompt_eval_count"] > 5, (first, second)


async def test_a_prompt_longer_than_the_context_keeps_its_end(http):
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~1700 tokens here
    opts = dict(OPTS, num_ctx=512, num_predict=8)
    r = await http.post("api/generate", json=gen(prompt=long_prompt, stream=False, options=opts))
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["eval_count"] == 8 and 256 <= body["prompt_eval_count"] < 512, body  # cut to fit, room kept
    r = await http.post("api/generate", json=gen(prompt=long_prompt, stream=False, options=opts, truncate=False))
    assert r.status_code == 400 and "longer than the context" in r.json()["error"], r.text
    short = (await http.post("api/generate", json=gen(prompt="Once upon a time", stream=False,
                                                      options=opts, truncate=False))).json()
    assert short["eval_count"] == 8, "a prompt that fits is sent as it is"


async def test_push_and_unknown_routes_answer_json(http):
    r = await http.post("api/push", json={"model": "tiny"})
    assert r.status_code == 501 and "not supported" in r.json()["error"], r.text
    for method, path in (("GET", "api/nothing"), ("POST", "v1/responses-not-yet"), ("DELETE", "api/x/y")):
        r = await http.request(method, path)
        assert r.status_code == 404 and f"/llama/{path}" in r.json()["error"], (method, path, r.text)


async def test_nothing_from_strangers_touches_the_disk(llama_url, ext):
    """An upload with no token, but a made-up _xsrf cookie and header (which pass Jupyter's XSRF
    check), is refused before its body is accepted: nothing lands in the store."""
    store = ext.store
    before = sorted(p.name for p in store.root.rglob("*"))
    body = b"x" * (4 << 20)
    async with httpx.AsyncClient(base_url=llama_url + "/", trust_env=False) as c:
        try:
            r = await c.post("api/blobs/sha256:" + "ab" * 32, content=body,
                             headers={"X-XSRFToken": "made-up", "Cookie": "_xsrf=made-up"})
            assert r.status_code == 401, r.text
        except httpx.TransportError:
            pass  # refused while the body was still coming: the server closed the connection on it
        r = await c.post("api/blobs/sha256:" + "ab" * 32, content=b"small",
                         headers={"X-XSRFToken": "made-up", "Cookie": "_xsrf=made-up"})
        assert r.status_code == 401 and "Authorization: Bearer TOKEN" in r.json()["error"], r.text
    assert sorted(p.name for p in store.root.rglob("*")) == before, "no file was written"


async def test_a_huge_keep_alive_is_forever_and_ps_still_answers(http):
    r = await http.post("api/generate", json=gen(stream=False, keep_alive=1e18))
    assert r.status_code == 200, r.text
    ps = await http.get("api/ps")
    assert ps.status_code == 200 and ps.json()["models"][0]["expires_at"].startswith(("2", "3")), ps.text
    await http.post("api/generate", json={"model": "tiny", "keep_alive": 0})


async def test_openai_answers_name_the_model_as_asked(http):
    """The child names its model by the alias it was loaded under; an OpenAI client gets the
    name it asked for, streamed or not, by the short name or by a copy of the same file."""
    r = await http.post("api/copy", json={"source": "tiny", "destination": "tiny-copy"})
    assert r.status_code == 200, r.text
    try:
        for name in ("tiny", "tiny:latest", "tiny-copy"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "temperature": 0}
            one = await http.post("v1/chat/completions", json=body)
            assert one.status_code == 200 and one.json()["model"] == name, one.text
            models = set()
            async with http.stream("POST", "v1/chat/completions", json=dict(body, stream=True)) as r:
                async for ln in r.aiter_lines():
                    if ln.startswith("data: {"):
                        models.add(json.loads(ln[6:])["model"])
            assert models == {name}
    finally:
        await http.request("DELETE", "api/delete", json={"model": "tiny-copy"})


@pytest.mark.llama_config(model_paths="*")  # it creates from a file path over HTTP
async def test_a_name_pointed_at_another_file_leaves_no_stale_runner(http, make_model, ext, store):
    """Issue 17 item 6: creating or copying over a loaded model's name retires its runner (it
    held a slot and answered `stop`/`rm` for the wrong file); the next request loads the new one."""
    from srvutil import TINY

    other = make_model("srv-renamed", **dict(TINY, seed=23))
    await http.post("api/create", json={"model": "swap-a", "from": "tiny", "stream": False})
    try:
        await http.post("api/generate", json={"model": "swap-a", "options": OPTS})
        old_pid = next(m["pid"] for m in (await http.get("api/ps")).json()["models"] if m["name"] == "swap-a:latest")
        r = await http.post("api/create", json={"model": "swap-a", "from": str(other), "stream": False})
        assert r.status_code == 200, r.text
        assert "swap-a:latest" not in [m["name"] for m in (await http.get("api/ps")).json()["models"]]
        events = (await http.get("api/events", params={"model": "swap-a"})).json()["events"]  # m is m:latest
        assert any(e["kind"] == "unload" and "now names another file" in e["message"] for e in events), events
        r = await http.post("api/generate", json=gen("swap-a", stream=False))
        assert r.status_code == 200
        new = next(m for m in (await http.get("api/ps")).json()["models"] if m["name"] == "swap-a:latest")
        assert new["pid"] != old_pid and new["digest"] != next(
            m for m in (await http.get("api/tags")).json()["models"] if m["name"] == "tiny:latest")["digest"]
        # a copy over it does the same; `stop` of a stale name finds what is loaded under it
        assert (await http.post("api/copy", json={"source": "tiny", "destination": "swap-a"})).status_code == 200
        assert "swap-a:latest" not in [m["name"] for m in (await http.get("api/ps")).json()["models"]]
    finally:
        await http.request("DELETE", "api/delete", json={"model": "swap-a"})
    assert "swap-a:latest" not in [m["name"] for m in (await http.get("api/ps")).json()["models"]]


async def test_pulling_an_update_of_a_loaded_model_retires_its_runner(http, make_model, tmp_path):
    """Issue 17 item 6, for pulls: the same URL now serves a new file; pulling it again under
    the same name replaces the model, and the runner for the old file goes."""
    import shutil

    from srvutil import TINY

    served = tmp_path / "served.gguf"
    shutil.copy(make_model("srv-v1", **dict(TINY, seed=31)), served)
    with FileHost({"/m/upd.gguf": served}) as host:
        body = {"model": host.url + "/m/upd.gguf", "destination": "upd", "stream": False}
        assert (await http.post("api/pull", json=body)).status_code == 200
        await http.post("api/generate", json={"model": "upd", "options": OPTS})
        assert "upd:latest" in [m["name"] for m in (await http.get("api/ps")).json()["models"]]
        before = [m["digest"] for m in (await http.get("api/tags")).json()["models"] if m["name"] == "upd:latest"]
        shutil.copy(make_model("srv-v2", **dict(TINY, seed=32)), served)  # the upstream file changed
        r = await http.post("api/pull", json=body)
        assert r.status_code == 200, r.text
        after = [m["digest"] for m in (await http.get("api/tags")).json()["models"] if m["name"] == "upd:latest"]
        assert before != after
    try:
        assert "upd:latest" not in [m["name"] for m in (await http.get("api/ps")).json()["models"]]
        events = (await http.get("api/events", params={"model": "upd"})).json()["events"]
        assert any(e["kind"] == "unload" and "now names another file" in e["message"] for e in events), events
    finally:
        await http.request("DELETE", "api/delete", json={"model": "upd"})
