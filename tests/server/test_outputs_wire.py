"""The pure parts of issue 55's items 4 to 7, without processes: structured-output formats to
one schema, what is mended in the child's answers (a Responses answer cut by its limit, the
usage of ``n`` answers, Anthropic's stop reason), ``dimensions``, Anthropic's checks, images
on ``/api/generate``, and a GGUF's arrays read whole."""

from __future__ import annotations

import json
import math

import pytest

from jupyter_llama.api import anthropic as anth
from jupyter_llama.api import ollama as oa
from jupyter_llama.api import openai as oai
from jupyter_llama.errors import BadRequest

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Paris"]}}, "required": ["name"]}


def test_every_structured_output_format_is_one_schema():
    def sent(route: str, extra: dict) -> dict:
        base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "x", "input": "x"}
        return oai.parse_request(route, {**base, **extra}).body

    ollama_json = oa.parse_chat({"model": "m", "format": "json"}).sampling["json_schema"]
    assert sent("chat/completions", {"response_format": {"type": "json_object"}})["json_schema"] == ollama_json
    chat = sent("chat/completions", {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "c", "schema": SCHEMA}}})
    assert chat["json_schema"] == SCHEMA and "response_format" not in chat
    completion = sent("completions", {"response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": SCHEMA}}})
    assert completion["json_schema"] == SCHEMA
    resp = sent("responses", {"text": {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA,
                                                  "strict": True}}})
    assert resp["json_schema"] == SCHEMA
    assert sent("responses", {"text": {"format": {"type": "json_object"}}})["json_schema"] == ollama_json
    for plain in ({"text": {"format": {"type": "text"}}}, {"text": {}}, {}):
        assert "json_schema" not in sent("responses", plain)
    for bad, said in (({"text": {"format": {"type": "yaml"}}}, 'text.format.type must be "text"'),
                      ({"text": "json"}, "text must be an object"),
                      ({"text": {"format": {"type": "json_schema", "schema": [1]}}}, "text.format.schema must be")):
        with pytest.raises(BadRequest, match=said):
            sent("responses", bad)
    with pytest.raises(BadRequest, match="response_format.json_schema.schema must be"):
        sent("chat/completions", {"response_format": {"type": "json_schema", "json_schema": "x"}})


def test_a_responses_answer_of_as_many_tokens_as_its_limit_is_incomplete():
    def answer(tokens: int) -> dict:
        return {"object": "response", "status": "completed", "usage": {"output_tokens": tokens},
                "output": [{"type": "message", "status": "completed"}]}

    mend = oai.ResponsesMend(4)
    cut, whole = answer(4), answer(3)
    mend.answer(cut)
    mend.answer(whole)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    last = b"event: response.completed\ndata: " + json.dumps({"type": "response.completed",
                                                               "response": answer(4)}).encode()
    name, _, data = mend.event(last).partition(b"\ndata: ")
    assert name == b"event: response.incomplete" and json.loads(data)["type"] == "response.incomplete"
    other = b'event: response.output_text.delta\ndata: {"delta":"x"}'
    assert mend.event(other) is other and oai.ResponsesMend(None).event(last) is last


def test_the_usage_of_n_answers_counts_all_of_them():
    one = {"choices": [{"index": 0, "text": "a"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                              "total_tokens": 8}}
    two = {"choices": [{"index": 0, "text": "b"}], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                              "total_tokens": 7}}
    merged = oai.merged_answers([one, two])
    assert [c["index"] for c in merged["choices"]] == [0, 1] and [c["text"] for c in merged["choices"]] == ["a", "b"]
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    mend = oai.UsageMend()  # a chat's usage chunks (include_usage): held back, one at the end
    chunks = [json.dumps({"choices": [], "usage": u["usage"]}, separators=(",", ":")).encode() for u in (one, two)]
    assert [mend.event(c) for c in chunks] == [None, None]
    text = b'{"choices":[{"index":1,"delta":{"content":"\\"usage\\": x"}}]}'
    assert mend.event(text) is text
    (last,) = mend.end()
    assert json.loads(last) == {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 5,
                                                         "total_tokens": 10}}
    mend = oai.UsageMend()  # a completion's last chunks carry theirs: taken off, one chunk at the end
    finals = [json.dumps({"choices": [{"index": i, "text": "", "finish_reason": "length"}], "id": "c",
                          "usage": u["usage"]}).encode() for i, u in enumerate((one, two))]
    assert [json.loads(mend.event(f)) for f in finals] == [
        {"choices": [{"index": i, "text": "", "finish_reason": "length"}], "id": "c"} for i in (0, 1)]
    assert json.loads(mend.end()[0]) == {"choices": [], "id": "c", "usage": merged["usage"]}
    req = oai.parse_request("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "n": 2, "stream": True})
    assert req.choices == 2 and isinstance(oai.mend_for(req), oai.UsageMend)
    with pytest.raises(BadRequest, match="n must be a whole number from 1 to 128"):
        oai.parse_request("completions", {"model": "m", "prompt": "x", "n": 0})


def test_dimensions_cut_and_make_unit_length_again():
    v = [[3.0, 4.0, 12.0]]
    (cut,) = oai.cut_dimensions(v, 2, "m")
    assert cut == pytest.approx([0.6, 0.8]) and math.isclose(math.fsum(x * x for x in cut), 1.0)
    assert oai.cut_dimensions(v, None, "m") is v
    with pytest.raises(BadRequest, match="dimensions is 4, more than the 3 numbers of each embedding m makes"):
        oai.cut_dimensions(v, 4, "m")
    req = oai.parse_request("embeddings", {"model": "m", "input": "x", "dimensions": 8, "encoding_format": "base64"})
    assert req.dimensions == 8 and "dimensions" not in req.body and req.body["encoding_format"] == "base64"
    with pytest.raises(BadRequest, match="dimensions must be a positive whole number"):
        oai.parse_request("embeddings", {"model": "m", "input": "x", "dimensions": True})


def test_completions_suffix_is_fill_in_the_middle():
    req = oai.parse_request("completions", {"model": "m", "prompt": "a", "suffix": "b", "max_tokens": 3,
                                            "stop": ["\n"]})
    assert req.suffix == "b" and req.needs == ["insert"]
    assert oai.infill_body(req) == {"max_tokens": 3, "stop": ["\n"], "input_prefix": "a", "input_suffix": "b"}
    assert oai.parse_request("completions", {"model": "m", "prompt": "a", "suffix": ""}).suffix is None
    for extra, said in (({"prompt": ["a", "b"]}, "prompt must be one string"), ({"n": 2}, "n greater than 1"),
                        ({"logprobs": 2}, "logprobs is not supported with suffix"), ({"suffix": 5}, "suffix must be")):
        with pytest.raises(BadRequest, match=said):
            oai.parse_request("completions", {"model": "m", "prompt": "a", "suffix": "b", **extra})
    tr = oai.InfillTranslator("m", include_usage=True)
    chunks = tr.feed({"content": "x"}) + tr.feed({"content": "", "stop": True, "stop_type": "limit",
                                                  "timings": {"prompt_n": 7, "cache_n": 2, "predicted_n": 3}})
    assert [c["choices"][0]["finish_reason"] for c in chunks[:2]] == [None, "length"] and chunks[2]["choices"] == []
    whole = tr.combined()
    assert whole["choices"][0]["text"] == "x" and whole["usage"] == {"prompt_tokens": 9, "completion_tokens": 3,
                                                                      "total_tokens": 12}


def test_anthropic_max_tokens_thinking_and_stop_sequence():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(BadRequest, match="max_tokens: Field required"):
        anth.parse_request("messages", {"model": "m", "messages": msgs})
    assert anth.parse_request("messages/count_tokens", {"model": "m", "messages": msgs})  # (no max_tokens there)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(BadRequest, match="max_tokens: must be a positive whole number"):
            anth.parse_request("messages", {"model": "m", "messages": msgs, "max_tokens": bad})

    def kwargs(**extra) -> tuple[dict, list]:
        req = anth.parse_request("messages", {"model": "m", "messages": msgs, "max_tokens": 5, **extra})
        return req.body["chat_template_kwargs"], req.needs

    assert kwargs() == ({"enable_thinking": False}, [])
    assert kwargs(thinking={"type": "disabled"}) == ({"enable_thinking": False}, [])
    assert kwargs(thinking={"type": "enabled", "budget_tokens": 100}) == ({"enable_thinking": True}, ["thinking"])
    assert kwargs(chat_template_kwargs={"enable_thinking": True, "x": 1})[0] == {"enable_thinking": True, "x": 1}
    with pytest.raises(BadRequest, match="thinking: must be"):
        kwargs(thinking={"type": "sometimes"})

    req = anth.parse_request("messages", {"model": "m", "messages": msgs, "max_tokens": 5, "stop_sequences": ["."]})
    mend = anth.mend_for(req)
    res = {"stop_reason": "end_turn", "stop_sequence": "."}
    mend.answer(res)
    assert res["stop_reason"] == "stop_sequence"
    delta = (b'event: message_delta\ndata: {"delta":{"stop_reason":"end_turn","stop_sequence":"."},'
             b'"type":"message_delta"}')
    assert json.loads(mend.event(delta).partition(b"data: ")[2])["delta"]["stop_reason"] == "stop_sequence"
    ended = b'event: message_delta\ndata: {"delta":{"stop_reason":"end_turn","stop_sequence":null}}'
    assert mend.event(ended) is ended
    assert anth.mend_for(anth.parse_request("messages", {"model": "m", "messages": msgs, "max_tokens": 5})) is None


def test_generate_with_images():
    from srvutil import png

    req = oa.parse_generate({"model": "m", "prompt": "What is it?", "images": [png()]})
    assert req.images and req.needs == ["vision"]
    (user,) = req.prompt_messages()
    assert user["content"][0] == {"type": "text", "text": "What is it?"}
    assert user["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    for extra, said in (({"raw": True}, "images cannot go with raw"), ({"suffix": "x"}, "images cannot go with suffix"),
                        ({"images": ["not base64!"]}, "images: not base64"),
                        ({"images": "x"}, "images must be a list of base64-encoded images")):
        with pytest.raises(BadRequest, match=said):
            oa.parse_generate({"model": "m", "prompt": "x", "images": [png()], **extra})


def test_a_gguf_s_arrays_read_whole(tmp_path):
    import gguf
    import numpy as np

    from jupyter_llama.models.gguf_info import read_arrays

    n = 1000  # (longer than the header reader decodes)
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_scores([float(i) / 2 for i in range(n)])
    w.add_array("general.tags", ["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((n, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arrays = read_arrays(tmp_path / "v.gguf")
    assert arrays["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(n)]
    assert arrays["tokenizer.ggml.scores"] == [i / 2 for i in range(n)]
    assert arrays["general.tags"] == ["a", "b"] and "llama.block_count" not in arrays
