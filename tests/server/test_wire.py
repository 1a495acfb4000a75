"""The wire formats as pure functions (no server, no engine)."""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest

from jupyter_llama.api import ollama as oa
from jupyter_llama.api import openai as oai
from jupyter_llama.api.options import OLLAMA_SAMPLING_DEFAULTS, parse_keep_alive, split_options
from jupyter_llama.load_options import LoadOptions
from jupyter_llama.scheduler import BadRequest


def test_options_split_into_load_and_sampling():
    s = split_options({"num_ctx": 2048, "num_gpu": -1, "num_thread": 2, "use_mmap": False, "flash_attn": True,
                       "kv_cache_type": "q8_0", "temperature": 0.2, "top_k": 5, "num_predict": -2,
                       "stop": "END", "seed": 7.0, "low_vram": True})
    opts = s.load_options()
    assert opts == LoadOptions(num_ctx=2048, num_thread=2, use_mmap=False, flash_attn="on", cache_type_k="q8_0",
                               cache_type_v="q8_0")
    assert opts.num_gpu is None  # -1: automatic
    assert s.sampling == {"temperature": 0.2, "top_k": 5, "n_predict": -1, "stop": ["END"], "seed": 7}
    assert s.ignored == ["low_vram"]
    assert split_options(None).load_options() == LoadOptions()
    # Ollama's runner limits a count above 0 only: 0 is no limit there, and here (llama-server's 0 made a token)
    assert [split_options({"num_predict": n}).sampling["n_predict"] for n in (0, -1, -2, 1)] == [-1, -1, -1, 1]


def test_unknown_options_are_ignored_as_ollama_ignores_them(caplog):
    with caplog.at_level("INFO", logger="jupyter_llama"):
        s = split_options({"num_gqa": 8, "temperature": 0.5, "num_gqa_again": 1})
        split_options({"num_gqa": 8})
    assert s.sampling == {"temperature": 0.5} and set(s.ignored) == {"num_gqa", "num_gqa_again"}
    assert sum("'num_gqa'" in r.getMessage() for r in caplog.records) <= 1, "logged once per name"


@pytest.mark.parametrize("options, words", [
    ({"num_ctx": "big"}, "num_ctx"),
    ({"num_ctx": 1 << 31}, "num_ctx 2147483648 is more than"),
    ({"num_batch": 10**12}, "num_batch"),
    ({"num_parallel": 10**6}, "num_parallel"),
    ({"num_thread": 10**6}, "num_thread"),
    ({"num_ctx": 8}, "num_ctx"),
    ({"top_k": 1.5}, "top_k"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": [1]}, "stop"),
    ({"cache_type_k": "q3"}, "cache_type_k"),
    ({"use_mmap": "no"}, "use_mmap"),
    ({"temperature": float("nan")}, "temperature"),
    ([1, 2], "options must be a JSON object"),
])
def test_bad_options_are_400_naming_them(options, words):
    with pytest.raises(BadRequest) as e:
        split_options(options).load_options()
    assert words in str(e.value)
    assert e.value.status == 400


def test_keep_alive():
    assert parse_keep_alive(None) is None
    assert parse_keep_alive(30) == 30.0
    assert parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1") == math.inf
    assert parse_keep_alive(0) == 0.0
    for bad in ("soon", True, "5x"):
        with pytest.raises(BadRequest, match="keep_alive"):
            parse_keep_alive(bad)


def test_parse_requests():
    g = oa.parse_generate({"model": "m", "prompt": "hi", "format": "json", "options": {"num_predict": 3},
                           "keep_alive": "5m", "stream": False})
    assert g.sampling == {**OLLAMA_SAMPLING_DEFAULTS, "n_predict": 3, "json_schema": {"type": "object"}}
    assert g.keep_alive == 300 and not g.stream
    assert oa.parse_generate({"name": "m"}).is_load_only  # "name": Ollama's older spelling
    assert oa.parse_generate({"model": "m", "keep_alive": 0}).unloads
    assert not oa.parse_generate({"model": "m", "prompt": "x", "keep_alive": 0}).unloads
    for body, words in (({}, "model is required"), ({"model": 3}, "model must be a string"),
                        ({"model": "m", "stream": "yes"}, "stream"), ({"model": "m", "images": ["x"]}, "images"),
                        ({"model": "m", "format": "xml"}, "format")):
        with pytest.raises(BadRequest, match=words):
            oa.parse_generate(body)
    c = oa.parse_chat({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "3", "tool_name": "f"}]})
    assert c.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert c.messages[2]["name"] == "f"
    assert oa.parse_chat({"model": "m"}).is_load_only
    with pytest.raises(BadRequest, match="role"):
        oa.parse_chat({"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    e = oa.parse_embed({"model": "m", "input": ["a", "b"]})
    assert e.inputs == ["a", "b"] and e.options.embedding is True
    assert oa.parse_embeddings({"model": "m", "prompt": "a"}).legacy
    assert oa.parse_pull({"model": "https://x/y.gguf", "destination": "y"}).name == "y"
    assert oa.parse_copy({"source": "a", "destination": "b"}) == ("a", "b")
    cr = oa.parse_create({"model": "m", "files": {"m.gguf": "sha256:" + "0" * 64}})
    assert cr.files and cr.stream
    for body, words in (({"model": "m"}, "needs files"), ({"model": "m", "quantize": "q4_0", "from": "x"}, "quantize"),
                        ({"model": "m", "files": ["x"]}, "files")):
        with pytest.raises(BadRequest, match=words):
            oa.parse_create(body)
    for raw, words in ((b"", "missing"), (b"{", "malformed JSON"), (b"[]", "JSON object"), (b"\xff", "malformed")):
        with pytest.raises(BadRequest, match=words):
            oa.parse_body(raw)


def test_generate_translator():
    tr = oa.GenerateTranslator("m", started=0.0, load_s=0.5)
    assert tr.feed({"content": "Hel", "stop": False})[0]["response"] == "Hel"
    assert tr.feed({"content": "", "stop": False}) == []
    out = tr.feed({"content": "lo", "stop": True, "stop_type": "limit",
                   "timings": {"prompt_n": 4, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 3.25}})
    assert [c["done"] for c in out] == [False, True]
    final = out[1]
    assert final["done_reason"] == "length" and final["load_duration"] == 500_000_000
    assert final["prompt_eval_count"] == 4 and final["prompt_eval_duration"] == 1_500_000
    assert final["eval_count"] == 2 and final["eval_duration"] == 3_250_000
    assert dt.datetime.fromisoformat(final["created_at"]).tzinfo is not None
    assert tr.combined()["response"] == "Hello"
    tr2 = oa.GenerateTranslator("m", 0.0, 0.0)
    assert tr2.feed({"content": "", "stop": True, "stop_type": "eos"})[0]["done_reason"] == "stop"


def test_generate_context_is_parsed_and_the_answers_ids_kept():
    from jupyter_llama.models.preset import Preset

    preset = Preset(system="S", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    g = oa.parse_generate({"model": "m", "prompt": "hi"}, preset)
    assert g.context is None and len(g.history) == 2 and g.answers_context
    g = oa.parse_generate({"model": "m", "prompt": "hi", "context": [1, 5, 9]}, preset)
    assert g.context == [1, 5, 9] and g.history == [] and g.default_system == "S"  # Ollama: messages left out
    assert oa.parse_generate({"model": "m", "prompt": "hi", "context": []}, preset).history == []
    raw = oa.parse_generate({"model": "m", "prompt": "hi", "context": [1], "raw": True}, preset)
    assert raw.context is None and not raw.answers_context
    assert not oa.parse_generate({"model": "m", "prompt": "a", "suffix": "b"}).answers_context
    for bad, words in (("1,2", "context must be a list"), ([1, -1], r"context\[1\] must be a token id"),
                       ([0, 1.0], r"context\[1\]"), ([None], r"context\[0\] .* got null")):
        with pytest.raises(BadRequest, match=words):
            oa.parse_generate({"model": "m", "prompt": "hi", "context": bad})

    def event(text, ids):
        return json.dumps({"index": 0, "content": text, "tokens": ids, "stop": False, "id_slot": -1,
                           "tokens_predicted": 1}, separators=(",", ":")).encode()

    last = {"index": 0, "content": "", "tokens": [], "stop": True, "stop_type": "limit",
            "timings": {"predicted_n": 3, "prompt_n": 4}}
    tr = oa.ContextGenerateTranslator("m", 0.0, 0.0)
    assert tr.lines(event("Hel", [40])) and tr.lines(event("", [41])) == b""  # (text held for a stop word)
    assert json.loads(tr.lines(event("lo", [42])))["response"] == "lo"
    assert tr.lines(json.dumps(last).encode()) == b"", "the last chunk is held back, for its context"
    assert tr.final["done"] and tr.final["eval_count"] == 3
    assert tr.answer() == ([40, 41, 42], "Hello")
    tr = oa.ContextGenerateTranslator("m", 0.0, 0.0)  # a token that ended mid-character had no event
    tr.lines(event("é", [7]))
    tr.lines(json.dumps(dict(last, timings={"predicted_n": 2})).encode())
    assert tr.answer() == (None, "é")
    tr = oa.ContextGenerateTranslator("m", 0.0, 0.0)  # cut at a stop word: its text, not its ids
    word = dict(last, stop_type="word", timings={"predicted_n": 2})
    for data in (event("a", [1]), event("b", [2]), json.dumps(word).encode()):
        tr.feed(json.loads(data))
    assert tr.answer() == (None, "ab") and tr.combined()["response"] == "ab"


def test_chat_translator_with_tool_calls():
    tr = oa.ChatTranslator("m", 0.0, 0.0)
    tr.feed({"choices": [{"delta": {"role": "assistant", "content": None}}]})
    assert tr.feed({"choices": [{"delta": {"content": "Hi"}}]})[0]["message"] == {"role": "assistant",
                                                                                 "content": "Hi"}
    tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "add", "arguments": '{"a":'}}]}}]})
    tr.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ' 1}'}}]}}]})
    out = tr.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}],
                   "timings": {"prompt_n": 9, "prompt_ms": 1, "predicted_n": 5, "predicted_ms": 2}})
    calls, final = out[-2:]  # the calls in a chunk of their own, before the last (as Ollama streams them)
    assert final["done"] and final["done_reason"] == "stop" and final["eval_count"] == 5
    assert not calls["done"] and "tool_calls" not in final["message"]
    assert calls["message"]["tool_calls"] == [{"function": {"name": "add", "arguments": {"a": 1}}}]
    whole = tr.combined()["message"]  # not streamed: one answer with both
    assert whole["content"] == "Hi" and whole["tool_calls"] == calls["message"]["tool_calls"]


def test_ps_and_show_bodies():
    from jupyter_llama.models.gguf_info import GGUFInfo

    info = GGUFInfo(path="/x", file_size=10, version=3, architecture="llama", name="x", block_count=2,
                    embedding_length=64, feed_forward_length=128, head_count=4, head_count_kv=2, key_length=None,
                    value_length=None, context_length=4096, sliding_window=None, swa_layers=None, file_type="Q8_0",
                    parameter_count=1_230_000, vocab_size=512)
    base = {"name": "x:latest", "size": 100, "size_vram": 0, "digest": "d" * 64, "context_length": 1024,
            "expires_at": None, "keep_alive": 30.0, "pinned": False, "state": "ready", "refcount": 1}
    now = 1_000_000.0
    m = oa.ps_model(base, info, now)
    assert m["details"] == {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                            "parameter_size": "1.2M", "quantization_level": "Q8_0"}
    assert dt.datetime.fromisoformat(m["expires_at"]).timestamp() == now + 30  # busy: keep_alive after it ends
    m = oa.ps_model(dict(base, expires_at=now + 5), info, now)
    assert dt.datetime.fromisoformat(m["expires_at"]).timestamp() == now + 5
    m = oa.ps_model(dict(base, keep_alive=None, pinned=True), info, now)
    assert dt.datetime.fromisoformat(m["expires_at"]).year > 2200
    json.dumps(m)
    show = oa.show_body({"name": "x:latest", "info": {"architecture": "llama", "parameter_count": 5,
                                                     "context_length": 4096},
                         "model_info": {"general.architecture": "llama", "tokenizer.ggml.tokens": "[array of 5]",
                                        "tokenizer.chat_template": "{{x}}"},
                         "template": "{{x}}", "files": [{"role": "model", "path": "/b"}],
                         "details": {"family": "llama"}, "modified_at": "2026-01-01T00:00:00+00:00"})
    assert show["model_info"]["llama.context_length"] == 4096 and show["model_info"]["general.parameter_count"] == 5
    assert show["model_info"]["tokenizer.ggml.tokens"] is None and "FROM /b" in show["modelfile"]  # (Ollama's null)
    assert "tensors" not in show
    assert show["template"] == "{{x}}" and show["capabilities"] == ["completion"]


def test_embeddings_are_pooled_and_unit_length():
    v = oa.mean_pool_normalize([[1.0, 0.0], [0.0, 1.0]])
    assert v == pytest.approx([math.sqrt(0.5), math.sqrt(0.5)])
    assert oa.mean_pool_normalize([3.0, 4.0]) == pytest.approx([0.6, 0.8])
    body = oa.embed_body("m", [[0.6, 0.8]], 1.0, 0.0, 3, dimensions=1)
    assert body["embeddings"] == [[1.0]] and body["prompt_eval_count"] == 3


def test_openai_requests():
    r = oai.parse_request("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                               "stream": True, "keep_alive": "1m", "max_tokens": 3})
    assert r.endpoint == "/v1/chat/completions" and r.stream and r.keep_alive == 60
    assert "stream" not in r.body and "keep_alive" not in r.body and r.body["max_tokens"] == 3
    assert oai.parse_request("embeddings", {"model": "m", "input": "x", "stream": True}).stream is False
    assert oai.parse_request("embeddings", {"model": "m", "input": "x"}).options.embedding
    for route, body, words in (("chat/completions", {"model": "m"}, "messages"),
                               ("completions", {"model": "m"}, "prompt"),
                               ("chat/completions", {"messages": [{}]}, "model")):
        with pytest.raises(BadRequest, match=words):
            oai.parse_request(route, body)
    count = oai.parse_request("responses/input_tokens", {"model": "m", "input": "x", "stream": True})
    assert count.endpoint == "/v1/responses/input_tokens" and not count.stream and not count.named
    from jupyter_llama.models.preset import Preset

    counted = oai.with_preset(count, Preset(system="Be brief.", parameters={"num_predict": 5}))
    assert counted.body["instructions"] == "Be brief." and counted.body["max_output_tokens"] == 5  # as a create
    # Ollama's OpenAI layer: temperature and top_p 1.0, its other defaults, the request's and the preset's winning
    chat = oai.parse_request("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  "temperature": 0.2, "top_p": None})
    sent = oai.with_sampling_defaults(oai.with_preset(chat, Preset(parameters={"top_k": 7}))).body
    assert sent["temperature"] == 0.2 and sent["top_p"] == 1.0 and sent["top_k"] == 7 and sent["repeat_penalty"] == 1.1
    responses = oai.with_sampling_defaults(oai.parse_request("responses", {"model": "m", "input": "x"})).body
    assert responses["temperature"] == 1.0 and responses["top_p"] == 1.0 and "top_k" not in responses
    embeddings = oai.parse_request("embeddings", {"model": "m", "input": "x"})
    assert oai.with_sampling_defaults(embeddings).body == embeddings.body
    assert oai.error_body(404, "gone")["error"] == {"message": "gone", "type": "not_found_error", "param": None,
                                                    "code": None}
    assert oai.sse({"a": 1}) == b'data: {"a":1}\n\n'


def test_client_discovery(tmp_path, monkeypatch):
    from jupyter_llama.client import ServerNotFound, api_url, find_server

    assert api_url("http://h:1/base") == "http://h:1/base/llama/"
    assert api_url("http://h:1/base/llama") == "http://h:1/base/llama/"
    assert api_url("localhost:9") == "http://localhost:9/llama/"  # as curl and OLLAMA_HOST read it
    with pytest.raises(ServerNotFound, match="give it as http://HOST:PORT/"):
        api_url("ftp://h:1/")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("JUPYTER_LLAMA_MANAGER_DIR", str(tmp_path / "manager"))  # none runs there
    (tmp_path / "jpserver-4242.json").write_text(json.dumps(
        {"url": "http://localhost:8888/", "base_url": "/user/me/", "token": "tok", "pid": 4242}))
    env = {"JUPYTER_LLAMA_URL": "http://127.0.0.1:8888/user/me/llama/", "JPY_PARENT_PID": "4242"}
    s = find_server(environ=env)
    assert s.url == "http://127.0.0.1:8888/user/me/llama/" and s.token == "tok"
    assert find_server(environ=dict(env, JUPYTER_LLAMA_TOKEN="t2")).token == "t2"
    assert find_server("http://other:1/", "explicit", environ=env).token == "explicit"
    assert find_server(environ={"JUPYTER_LLAMA_URL": "http://127.0.0.1:9999/llama/"}).token is None
    with pytest.raises(ServerNotFound, match="jupyter-llama serve"):
        find_server(environ={}, start=False)


def test_capabilities_come_from_the_model():
    from jupyter_llama.api.ollama import capabilities_of

    assert capabilities_of({}, "llama") == ["completion"]
    tmpl = "{% if tools %}...{% endif %}{% if enable_thinking %}<think>{% endif %}"
    meta = {"tokenizer.chat_template": tmpl, "tokenizer.ggml.fim_pre_token_id": 7, "bert.pooling_type": 1}
    assert capabilities_of({"model_info": meta, "projector_info": {"projector_type": "mlp"}}, "bert") == [
        "completion", "embedding", "tools", "thinking", "insert", "vision"]


def test_a_batch_llama_server_would_abort_on_is_raised_on_its_command_line():
    from jupyter_llama.load_options import memory_args

    # Ollama takes any num_batch; llama-server needs one token per slot (and two) to start
    assert memory_args(split_options({"num_batch": 1}).load_options()) == ["-b", "4"]
    assert memory_args(split_options({"num_batch": 2, "num_parallel": 2}).load_options()) == ["-np", "2", "-b", "2"]


def test_bodies_nested_too_deeply_or_with_nan_are_400():
    from jupyter_llama.api.ollama import parse_body

    for raw in ('{"a": ' + "[" * 100 + "]" * 100 + "}", '{"a": ' + "[" * 5000 + "]" * 5000 + "}"):
        with pytest.raises(BadRequest, match="nested too deeply"):
            parse_body(raw)
    for raw in ('{"options": {"temperature": NaN}}', '{"format": {"x": Infinity}}'):
        with pytest.raises(BadRequest, match="no NaN or Infinity"):
            parse_body(raw)
    assert parse_body('{"a": [[1]]}') == {"a": [[1]]}


def test_bodies_with_half_a_surrogate_pair_are_400():
    """A lone \\ud800 in a JSON string parses, but is no character: the child (and our own
    tokenizer call) could not encode it. A 400 names where it is; a whole pair, or the
    same six characters escaped as text, are fine."""
    from jupyter_llama.api.ollama import parse_body

    for raw, where in ((b'{"prompt": "\\ud800 x"}', "the text of prompt holds \\ud800"),
                       ('{"messages": [{"content": "ok \\uDC00"}]}', "the text of messages[0].content holds \\udc00"),
                       (b'{"options": {"stop": ["a", "\\udfff"]}}', "the text of options.stop[1]"),
                       (b'{"o": {"a\\ud800": 1}}', "a name in o holds \\ud800"),
                       (b'{"prompt": "\xed\xa0\x80"}', "the text of prompt holds \\ud800")):  # (as UTF-8 bytes)
        with pytest.raises(BadRequest) as e:
            parse_body(raw)
        assert str(e.value).startswith(where) and "send valid Unicode" in str(e.value), e.value
        str(e.value).encode("utf-8")  # (the message itself is whole Unicode: it can be sent)
    assert parse_body(b'{"prompt": "\\ud83d\\ude00!"}') == {"prompt": "\U0001F600!"}
    assert parse_body(b'{"prompt": "\\\\ud800"}') == {"prompt": "\\ud800"}


@pytest.mark.parametrize("text", ["Hel", ' "quoted" \\ back', "line\nbreak\ttab", "naïve ☃ 日本", "\u0001", "}]{"])
def test_streamed_lines_equal_the_chunks_feed_makes(text):
    """The relay's template for a text-only event says what feed() says, for any text the
    child may escape; other events (the last one, empty text) go through feed() itself."""
    gen = {"index": 0, "content": text, "tokens": [503, 7], "stop": False, "id_slot": -1, "tokens_predicted": 1,
           "tokens_evaluated": 4}
    chat = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}], "created": 1,
            "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk"}
    translators = ((oa.GenerateTranslator("m:latest", 0.0, 0.0), gen), (oa.ChatTranslator("m:latest", 0.0, 0.0), chat),
                   (oa.ContextGenerateTranslator("m:latest", 0.0, 0.0), gen))
    for tr, event in translators:
        for wire in (json.dumps(event, separators=(",", ":")), json.dumps(event, separators=(",", ":"),
                                                                            ensure_ascii=False)):
            line = tr.lines(wire.encode())
            assert tr._text_event.match(wire.encode()), "the fast path was not taken"
            expect = oa.ndjson(tr.feed(event)[0])
            got, want = json.loads(line), json.loads(expect)
            assert line.endswith(b"\n") and line.count(b"\n") == 1
            assert got.pop("created_at") and want.pop("created_at")
            assert got == want
    last = {"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "stop_type": "limit",
            "timings": {"predicted_n": 3, "prompt_n": 4}}
    tr = oa.GenerateTranslator("m", 0.0, 0.0)
    done = json.loads(tr.lines(json.dumps(last).encode()))
    assert done["done"] is True and done["done_reason"] == "length" and done["eval_count"] == 3


def test_log_probabilities_keep_every_line_in_python():
    """With logprobs asked, no line is written from the text template (it would drop the
    probabilities): a text event's line carries its token's log probabilities."""
    from jupyter_llama.api import ollama as oa

    for cls in (oa.GenerateTranslator, oa.ContextGenerateTranslator, oa.TemplatedChatTranslator,
                oa.ThinkingGenerateTranslator, oa.ChatTranslator):
        asked = cls("m", 0.0, 0.0, logprobs=2)
        plain = cls("m", 0.0, 0.0)
        assert plain.top is None and asked.top == 2, cls
    event = (b'{"index":0,"content":" a","tokens":[261],"stop":false,"id_slot":-1,"tokens_predicted":1,'
             b'"completion_probabilities":[{"id":261,"token":" a","bytes":[32,97],"logprob":-0.5,'
             b'"top_logprobs":[{"id":261,"token":" a","bytes":[32,97],"logprob":-0.5},'
             b'{"id":7,"token":" b","bytes":[32,98],"logprob":-1.5}]}]}')
    line = json.loads(oa.GenerateTranslator("m", 0.0, 0.0, logprobs=1).lines(event))
    assert line["response"] == " a" and line["logprobs"] == [
        {"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": [{"token": " a", "logprob": -0.5,
                                                                              "bytes": [32, 97]}]}]
    assert "logprobs" not in json.loads(oa.GenerateTranslator("m", 0.0, 0.0).lines(event))
