"""Synthetic GGUFs of each family: determinism, types, shape checks, and a real llama-server on them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from jupyter_llama.engine.runner import free_port
from jupyter_llama.models import synth
from jupyter_llama.models.gguf_info import read_arrays, read_gguf_info
from jupyter_llama.models.synth import MIN_VOCAB, SynthShape, special_token_ids, write_synthetic

SMALL = dict(layers=2, embd=64, heads=4, kv_heads=2, vocab=400, ctx=1024)


# ----------------------------------------------------------------------------- files


def test_same_shape_and_seed_same_bytes(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", SynthShape(**SMALL, type="q4_0", seed=5))
    b = write_synthetic(tmp_path / "b.gguf", type="q4_0", seed=5, **SMALL)
    assert a.read_bytes() == b.read_bytes()
    c = write_synthetic(tmp_path / "c.gguf", SynthShape(**SMALL, type="q4_0", seed=6))
    assert c.read_bytes() != a.read_bytes()
    assert c.stat().st_size == a.stat().st_size


def test_defaults(tmp_path):
    s = SynthShape()
    shape = (s.layers, s.embd, s.heads, s.kv_heads, s.vocab, s.ctx, s.type, s.seed)
    assert shape == (4, 128, 4, 2, 512, 2048, "f32", 0)
    assert s.n_ff == 352  # 8/3 * 128 rounded up to a multiple of 32
    info = read_gguf_info(write_synthetic(tmp_path / "d.gguf"))
    assert info.feed_forward_length == 352 and info.vocab_size == 512


@pytest.mark.parametrize(
    "wtype,ggml,file_type",
    [("f32", "F32", "F32"), ("f16", "F16", "F16"), ("q8_0", "Q8_0", "Q8_0"), ("q4_0", "Q4_0", "Q4_0")],
)
def test_each_type_reads_back(tmp_path, wtype, ggml, file_type):
    s = SynthShape(layers=3, embd=128, heads=4, kv_heads=1, ff=256, vocab=MIN_VOCAB, ctx=4096, type=wtype, seed=1)
    path = write_synthetic(tmp_path / f"{wtype}.gguf", s)
    info = read_gguf_info(path)
    assert info.file_type == file_type
    assert (info.block_count, info.embedding_length, info.feed_forward_length) == (3, 128, 256)
    assert (info.head_count, info.head_count_kv, info.context_length, info.vocab_size) == (4, 1, 4096, MIN_VOCAB)
    for t in info.tensors:
        assert t.ggml_type == ("F32" if len(t.shape) == 1 else ggml), t.name
    md = info.metadata
    assert md["llama.rope.dimension_count"] == 32
    assert md["llama.attention.layer_norm_rms_epsilon"] > 0
    assert md["tokenizer.ggml.bos_token_id"] == special_token_ids()["bos"]
    assert md["tokenizer.ggml.eos_token_id"] == special_token_ids()["eos"]


def test_write_is_atomic_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "m.gguf"
    write_synthetic(target, **SMALL)
    good = target.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf"]

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(synth, "_make_tensor", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_synthetic(target, **SMALL, seed=9)
    assert target.read_bytes() == good  # the old file is untouched
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(embd=100, heads=3), "heads (3) must divide embd (100)"),
        (dict(heads=4, kv_heads=3), "kv_heads (3) must divide heads (4)"),
        (dict(type="q5_k"), "unknown type 'q5_k'"),
        (dict(vocab=100), f"vocab must be at least {MIN_VOCAB}"),
        (dict(layers=0), "layers must be at least 1"),
        (dict(embd=-8), "embd must be at least 1"),
        (dict(ctx=1.5), "ctx must be an integer"),
        (dict(embd=80, heads=4, kv_heads=2, type="q8_0"), "embd (80) must be a multiple of 32 for type q8_0"),
        (dict(ff=100, type="q4_0"), "ff (100) must be a multiple of 32"),
        (dict(embd=12, heads=4, kv_heads=2), "must be even"),
        (dict(seed=-1), "seed must be a non-negative integer"),
        (dict(template="jinja"), "unknown template 'jinja'"),
        (dict(template="tools", type="q8_0"), "template 'tools' needs a float type"),
        (dict(template="tools", fim=True, vocab=MIN_VOCAB + 4), f"vocab must be at least {MIN_VOCAB + 5}"),
        (dict(fim=1), "fim must be true or false"),
    ],
)
def test_shape_errors(kw, needle):
    with pytest.raises(ValueError) as ei:
        SynthShape(**kw)
    assert needle in str(ei.value)


def test_shape_errors_through_write(tmp_path):
    with pytest.raises(ValueError, match="must divide"):
        write_synthetic(tmp_path / "x.gguf", heads=5)
    with pytest.raises(ValueError, match="unknown shape field"):
        write_synthetic(tmp_path / "x.gguf", colour="red")
    assert not list(tmp_path.iterdir())


def test_tool_and_fill_in_the_middle_tokens_take_the_last_ids(tmp_path):
    plain = read_gguf_info(write_synthetic(tmp_path / "plain.gguf", **SMALL)).metadata
    shape = SynthShape(template="tools", fim=True, **SMALL)
    meta = read_gguf_info(write_synthetic(tmp_path / "tools.gguf", shape)).metadata
    assert meta["tokenizer.chat_template"] == synth.TOOLS_TEMPLATE != plain["tokenizer.chat_template"]
    assert [shape.token_id(t) for t in (synth.TOOL_TURN, synth.TOOL_CALL, *synth.FIM_TOKENS)] == list(range(395, 400))
    assert [meta[f"tokenizer.ggml.fim_{k}_token_id"] for k in ("pre", "suf", "mid")] == [397, 398, 399]
    assert meta["tokenizer.ggml.add_space_prefix"] is False and "tokenizer.ggml.fim_pre_token_id" not in plain


# ----------------------------------------------------------------------------- families


def _tensors(info) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in info.tensors}


@pytest.mark.parametrize("family", sorted(synth.FAMILIES))
def test_each_family_reads_back_with_its_architecture_and_shapes(tmp_path, family):
    """Every family's file is one our reader reads back: its architecture, and the tensors and
    metadata that make it that family, in llama.cpp's shapes (ggml order, row length first)."""
    shape = synth.FAMILIES[family]
    info = read_gguf_info(write_synthetic(tmp_path / f"{family}.gguf", shape))
    t, md, E = _tensors(info), info.metadata, shape.embd
    assert info.architecture == family and info.block_count == shape.layers and info.embedding_length == E
    assert info.name == f"synthetic-{family}-{shape.layers}x{E}-f32-seed0"
    assert t["token_embd.weight"] == (E, shape.vocab)
    assert info.path.endswith(f"{family}.gguf") and info.file_size < 10 * 2**20  # small: a few MB
    hd = shape.head_dim
    if family in ("llama", "qwen3", "gemma3", "qwen3moe"):
        assert t["blk.0.attn_q.weight"] == (E, shape.heads * hd)
        assert t["blk.0.attn_k.weight"] == t["blk.0.attn_v.weight"] == (E, shape.kv_heads * hd)
        assert info.head_dim_k() == hd and (family == "llama") == (hd == E // shape.heads)
    if family in ("qwen3", "gemma3", "qwen3moe"):  # Q and K normalised per head
        assert t["blk.0.attn_q_norm.weight"] == t["blk.0.attn_k_norm.weight"] == (hd,)
        assert info.key_length == info.value_length == hd
    if family == "gemma3":
        assert "output.weight" not in t  # tied to the token embedding
        assert info.sliding_window == shape.window == 256
        assert info.swa_layers == [True, True, True, True, True, False, False]  # every sixth and the last are global
        assert t["blk.0.post_attention_norm.weight"] == t["blk.0.post_ffw_norm.weight"] == (E,)
    else:
        assert t["output.weight"] == (E, shape.vocab) and not info.sliding_window
    if family == "qwen3moe":
        X, FX = shape.n_experts, shape.n_expert_ff
        assert (info.n_expert, info.n_expert_used) == (8, 2) and md["qwen3moe.expert_feed_forward_length"] == FX
        assert t["blk.0.ffn_gate_inp.weight"] == (E, X)
        assert t["blk.0.ffn_gate_exps.weight"] == t["blk.0.ffn_up_exps.weight"] == (E, FX, X)
        assert t["blk.0.ffn_down_exps.weight"] == (FX, E, X)
        assert all(info.is_expert_tensor(f"blk.{il}.ffn_{k}_exps.weight") for il in range(4) for k in ("up", "down"))
        assert not any(n.startswith("blk.0.ffn_up.") for n in t)
    if family == "lfm2":
        recurrent = [info.is_recurrent(il) for il in range(shape.layers)]
        assert recurrent == [True, True, False, True, True, False]  # every third layer is attention
        assert info.head_count_kv == [0, 0, 2, 0, 0, 2] and info.shortconv_l_cache == 3
        assert t["blk.0.shortconv.conv.weight"] == (3, E) and t["blk.0.shortconv.in_proj.weight"] == (E, 3 * E)
        assert "blk.0.attn_q.weight" not in t and t["blk.2.attn_q.weight"] == (E, E)
        assert "token_embd_norm.weight" in t and "output_norm.weight" not in t  # (LFM2's name for it)
    if family == "deepseek2":
        C, R, QL, H = shape.n_kv_lora, shape.n_rope, shape.n_q_lora, shape.heads
        nope = hd - R
        assert info.is_mla and info.head_count_kv == 1
        assert (info.key_length, info.value_length) == (C + R, C)  # what the cache holds per token
        assert (md["deepseek2.attention.key_length_mla"], md["deepseek2.attention.value_length_mla"]) == (hd, nope)
        assert t["blk.0.attn_q_a.weight"] == (E, QL) and t["blk.0.attn_q_b.weight"] == (QL, H * hd)
        assert t["blk.0.attn_kv_a_mqa.weight"] == (E, C + R)
        assert t["blk.0.attn_k_b.weight"] == (nope, C, H) and t["blk.0.attn_v_b.weight"] == (C, nope, H)
        assert t["blk.0.attn_output.weight"] == (H * nope, E)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3moe", "lfm2", "deepseek2"])
def test_families_quantize_and_keep_their_small_tensors_in_f32(tmp_path, family):
    shape = dataclasses.replace(synth.FAMILIES[family], type="q8_0")
    info = read_gguf_info(write_synthetic(tmp_path / "q.gguf", shape))
    for t in info.tensors:
        small = len(t.shape) == 1 or t.name.endswith("shortconv.conv.weight")
        assert t.ggml_type == ("F32" if small else "Q8_0"), t.name


def test_the_same_family_shape_and_seed_give_the_same_bytes(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", synth.FAMILIES["qwen3moe"]).read_bytes()
    b = write_synthetic(tmp_path / "b.gguf", arch="qwen3moe", experts=8, experts_used=2, expert_ff=128,
                        layers=4, embd=128, heads=4, kv_heads=2, vocab=512, ctx=8192).read_bytes()
    assert a == b


@pytest.mark.parametrize("kw,needle", [
    (dict(arch="mamba"), "unknown arch 'mamba'"),
    (dict(experts=4), "experts is for the qwen3moe family, not llama"),
    (dict(arch="qwen3", sliding_window=64), "sliding_window is for the gemma3 family, not qwen3"),
    (dict(arch="qwen3moe", experts=2, experts_used=3), "experts_used (3) must be at most experts (2)"),
    (dict(arch="lfm2", layers=2), "lfm2 needs at least 3 layers"),
    (dict(arch="lfm2", key_length=64), "key_length is for the llama, qwen3, gemma3, qwen3moe and deepseek2 families"),
    (dict(arch="deepseek2", rope_dim=64, key_length=64), "rope_dim (64) must be even and less than key_length"),
    (dict(arch="deepseek2", kv_lora_rank=48, type="q8_0"), "has rows of 48"),
    (dict(arch="gemma3", template="tools"), "template 'tools' is wired for the llama family only"),
    (dict(arch="gemma3", vocab=MIN_VOCAB), f"vocab must be at least {MIN_VOCAB + 1}"),
])
def test_family_shape_errors(kw, needle):
    with pytest.raises(ValueError) as ei:
        SynthShape(**kw)
    assert needle in str(ei.value)


def test_a_tied_vocabulary_has_a_plain_newline(tmp_path):
    """With the output tied to the embedding a byte token at the end of a prompt would make the
    next token a control or byte token; a chat prompt ends in a newline, so it is a plain piece."""
    info = read_gguf_info(write_synthetic(tmp_path / "g.gguf", synth.FAMILIES["gemma3"]))
    tokens = read_arrays(info.path)["tokenizer.ggml.tokens"]
    types = read_arrays(info.path)["tokenizer.ggml.token_type"]
    assert types[tokens.index("\n")] == 1 and tokens.index("\n") == synth._FIRST_PIECE
    plain = read_arrays(write_synthetic(tmp_path / "l.gguf", **SMALL))["tokenizer.ggml.tokens"]
    assert "\n" not in plain


def test_hundred_megabyte_model_reads_back(tmp_path):
    # How long this takes is measured by bench/synth_speed.py, never asserted here.
    path = write_synthetic(tmp_path / "big.gguf", layers=8, embd=1024, heads=8, kv_heads=4, type="q8_0")
    assert path.stat().st_size > 90_000_000
    info = read_gguf_info(path)
    assert info.block_count == 8 and info.embedding_length == 1024 and info.quantization == "Q8_0"


# ----------------------------------------------------------------------------- llama-server




class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@pytest.fixture
def start_server(llama_server_binary, tmp_path):
    """Start llama-server children on models; each one is stopped by its PID after the test."""
    started: list[Server] = []

    def start(model: Path, ctx: int = 512) -> Server:
        port = free_port()
        log = tmp_path / f"server-{len(started)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [
                    llama_server_binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                    "-c", str(ctx), "--no-webui", "--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps",
                ],
                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
            )
        srv = Server(proc, f"http://127.0.0.1:{port}", log)
        started.append(srv)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode} while loading:\n{srv.log_tail()}")
            try:
                r = httpx.get(srv.url + "/health", timeout=0.5)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return srv
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"llama-server did not become healthy in 120 s:\n{srv.log_tail()}")

    yield start
    for srv in started:
        if srv.proc.poll() is None:
            os.kill(srv.proc.pid, 15)
            try:
                srv.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(srv.proc.pid, 9)
                srv.proc.wait(timeout=10)
        assert srv.proc.poll() is not None


def completion(srv: Server, **body) -> httpx.Response:
    return httpx.post(srv.url + "/completion", json=body, timeout=60)


def chat(srv: Server, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hello there, ünïcödé ✓"}])
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


def chat_stream(srv: Server, **body) -> tuple[int, str, list[dict]]:
    """(status, concatenated delta content, chunks) of a streamed chat completion."""
    body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    body["stream"] = True
    chunks: list[dict] = []
    text = ""
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        status = r.status_code
        if status != 200:
            r.read()
            return status, r.text, chunks
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
        assert done, "stream did not end with [DONE]"
    return status, text, chunks


def _printable(text: str) -> bool:
    return all(32 <= ord(c) < 127 for c in text)


@pytest.mark.engine
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0", "q4_0"])
def test_llama_server_answers_with_text(tmp_path, start_server, wtype):
    model = write_synthetic(tmp_path / f"{wtype}.gguf", layers=2, embd=128, heads=4, kv_heads=2, vocab=512, type=wtype)
    srv = start_server(model)

    r = completion(srv, prompt="Hello", n_predict=16)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] and _printable(body["content"])
    assert body["tokens_predicted"] == 16

    r = chat(srv, max_tokens=16)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]
    assert msg["message"]["role"] == "assistant"
    assert msg["message"]["content"] and _printable(msg["message"]["content"])
    assert msg["finish_reason"] == "length"

    status, text, chunks = chat_stream(srv, max_tokens=16)
    assert status == 200, text
    assert text and _printable(text)
    assert chunks[-1]["choices"] == [] or chunks[-1]["choices"][0].get("finish_reason") in ("length", None)


@pytest.mark.engine
def test_only_plain_pieces_are_ever_sampled(tmp_path, start_server):
    """Hot, unfiltered sampling still yields printable text and never stops on its own."""
    model = write_synthetic(tmp_path / "m.gguf", layers=4, embd=128, heads=4, kv_heads=2, type="q8_0", seed=2)
    srv = start_server(model, ctx=1024)
    hot = dict(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0)
    texts = set()
    for seed in range(4):
        r = completion(srv, prompt="Once upon a time", n_predict=64, seed=seed, **hot)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens_predicted"] == 64 and body["stop_type"] == "limit"
        assert body["content"] and _printable(body["content"])
        texts.add(body["content"])
    assert len(texts) == 4  # different seeds, different text
    r = chat(srv, max_tokens=48, seed=1, **hot)
    assert r.status_code == 200 and _printable(r.json()["choices"][0]["message"]["content"])


@pytest.mark.engine
def test_the_tools_model_calls_the_tool_it_is_offered_and_thinks_when_asked(tmp_path, start_server):
    """What the server tests build on: offered a tool whose argument is an enum, the ``tools``
    model makes exactly that call, which llama-server parses; asked to think, it thinks; and
    with neither it answers text. Its FIM tokens make /infill answer."""
    model = write_synthetic(tmp_path / "agent.gguf", template="tools", fim=True, **SMALL)
    srv = start_server(model)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "enum": ["red"]}}, "required": ["colour"]}}}
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    for _ in range(3):
        r = chat(srv, max_tokens=200, tools=[tool], **no_think).json()["choices"][0]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r["message"]["tool_calls"]]
        assert r["finish_reason"] == "tool_calls" and calls == [("pick", {"colour": "red"})], r
    r = chat(srv, max_tokens=8, chat_template_kwargs={"enable_thinking": True}).json()["choices"][0]["message"]
    assert r["reasoning_content"] and not r.get("content"), r
    r = chat(srv, max_tokens=8, **no_think).json()["choices"][0]["message"]
    assert r["content"] and not r.get("tool_calls"), r
    r = httpx.post(srv.url + "/infill", json={"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4},
                   timeout=60)
    assert r.status_code == 200 and r.json()["content"], r.text


@pytest.mark.engine
def test_control_and_byte_tokens_do_not_break_the_server(tmp_path, start_server):
    """Forced control tokens (end of turn, BOS) and lone UTF-8 lead bytes still give HTTP 200."""
    model = write_synthetic(tmp_path / "m.gguf", **SMALL)
    srv = start_server(model)
    ids = special_token_ids()
    lead_byte = synth._BYTE_BASE + 0xE3  # "<0xE3>": the first byte of a 3-byte UTF-8 character

    r = chat(srv, max_tokens=8, logit_bias=[[ids["im_end"], 1000]])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["message"]["content"] == ""

    r = completion(srv, prompt="Hello", n_predict=8, logit_bias=[[ids["eos"], 1000]])
    assert r.status_code == 200 and r.json()["stop_type"] == "eos"

    for bias in ([[ids["bos"], 1000]], [[lead_byte, 1000]]):
        r = chat(srv, max_tokens=8, logit_bias=bias)
        assert r.status_code == 200, r.text
        status, _text, _ = chat_stream(srv, max_tokens=8, logit_bias=bias)
        assert status == 200

    # and normal text right after
    r = chat(srv, max_tokens=8)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_the_cli_makes_a_tools_model_with_fim_tokens(tmp_path):
    """`jupyter-llama synth --template tools --fim`: the maker's tools template and FIM tokens
    from the command line (no manager needed with --output)."""
    import subprocess
    import sys

    from jupyter_llama.models.gguf_info import read_gguf_info

    out = tmp_path / "agent.gguf"
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "synth", "--output", str(out), "--template",
                        "tools", "--fim", "--layers", "2", "--embd", "64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    meta = read_gguf_info(out).metadata
    assert "<tool_call>" in str(meta.get("tokenizer.chat_template"))
    assert any("fim_pre" in k for k in meta), sorted(k for k in meta if "fim" in k)
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "synth", "--output", str(out), "--template", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'x'" in r.stderr


def test_the_cli_makes_each_family(tmp_path):
    """`jupyter-llama synth --arch FAMILY`: the family from the command line, and a shape the
    family cannot have said as a usage error."""
    import subprocess
    import sys

    out = tmp_path / "moe.gguf"
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "synth", "--output", str(out), "--arch", "qwen3moe",
                        "--layers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = read_gguf_info(out)
    assert info.architecture == "qwen3moe" and info.n_expert == 8 and info.block_count == 2
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "synth", "--output", str(out), "--arch", "lfm2",
                        "--layers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "lfm2 needs at least 3 layers" in r.stderr
