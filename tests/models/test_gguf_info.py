"""GGUF metadata and tensor table: fields, per-layer arrays, sliding windows, errors, speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from jupyter_llama.models.gguf_info import GGUFError, GGUFInfo, format_info, read_gguf_info
from jupyter_llama.models.synth import SynthShape, write_synthetic

# bytes per element (as block size, block bytes) for the types the synthetic models use
TYPE_SIZE = {"F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18)}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    shape = SynthShape(layers=3, embd=96, heads=6, kv_heads=2, ff=160, vocab=400, ctx=1024, type="f16", seed=3)
    path = write_synthetic(tmp_path_factory.mktemp("gi") / "m.gguf", shape)
    return shape, path


def expected_params(s: SynthShape) -> int:
    hd = s.embd // s.heads
    per_layer = (
        2 * s.embd  # attn_norm, ffn_norm
        + s.embd * s.heads * hd  # q
        + 2 * s.embd * s.kv_heads * hd  # k, v
        + s.heads * hd * s.embd  # output
        + 3 * s.embd * s.n_ff  # gate, up, down
    )
    return s.layers * per_layer + 2 * s.vocab * s.embd + s.embd


def test_synthetic_fields_match_the_shape(synth):
    s, path = synth
    info = read_gguf_info(path)
    assert isinstance(info, GGUFInfo)
    assert info.path == str(path)
    assert info.file_size == path.stat().st_size
    assert info.version == 3
    assert info.architecture == "llama"
    assert info.name and "synthetic" in info.name
    assert info.block_count == s.layers
    assert info.embedding_length == s.embd
    assert info.feed_forward_length == s.n_ff == 160
    assert info.head_count == s.heads and info.head_count_kv == s.kv_heads
    assert info.n_head(0) == s.heads and info.n_head_kv(2) == s.kv_heads
    assert info.key_length is None and info.value_length is None
    assert info.head_dim_k() == info.head_dim_v() == s.embd // s.heads == 16
    assert info.context_length == s.ctx
    assert info.sliding_window is None and info.swa_layers is None
    assert info.file_type == "F16" and info.quantization == "F16"
    assert info.vocab_size == s.vocab
    assert info.parameter_count == expected_params(s)
    assert len(info.tensors) == 3 + 9 * s.layers


def test_tensor_table_bytes_and_layers(synth):
    s, path = synth
    info = read_gguf_info(path)
    by_name = {t.name: t for t in info.tensors}
    for t in info.tensors:
        block, size = TYPE_SIZE[t.ggml_type]
        assert t.n_elements == int(np.prod(t.shape))
        assert t.n_bytes == t.n_elements // block * size, t.name
        assert t.layer == (int(t.name.split(".")[1]) if t.name.startswith("blk.") else None)
        if t.name.endswith("norm.weight"):
            assert t.ggml_type == "F32" and len(t.shape) == 1
        else:
            assert t.ggml_type == "F16"
    # ggml order: row length (ne0) first
    assert by_name["token_embd.weight"].shape == (s.embd, s.vocab)
    assert by_name["blk.0.attn_k.weight"].shape == (s.embd, s.kv_heads * 16)
    assert by_name["blk.1.ffn_down.weight"].shape == (s.n_ff, s.embd)

    lb = info.layer_bytes()
    assert sorted(lb) == list(range(s.layers))
    for layer, b in lb.items():
        assert b == sum(t.n_bytes for t in info.tensors if t.name.startswith(f"blk.{layer}."))
    assert len(set(lb.values())) == 1
    nl = info.non_layer_bytes()
    assert set(nl) == {"token_embd.weight", "output.weight", "output_norm.weight"}
    assert nl["output_norm.weight"] == 4 * s.embd
    assert sum(lb.values()) + sum(nl.values()) == info.tensor_bytes
    # the data section is the tensors plus alignment padding, nothing more
    assert info.tensor_bytes <= info.file_size < info.tensor_bytes + 64 * 1024 + 32 * len(info.tensors)


@pytest.mark.parametrize("wtype,expect", [("f32", "F32"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_types_and_sizes_per_type(tmp_path, wtype, expect):
    s = SynthShape(layers=2, embd=64, heads=2, kv_heads=1, vocab=400, type=wtype)
    info = read_gguf_info(write_synthetic(tmp_path / "m.gguf", s))
    assert info.file_type == expect and info.quantization == expect
    block, size = TYPE_SIZE[expect]
    for t in info.tensors:
        if len(t.shape) == 2:
            assert t.ggml_type == expect
            assert t.n_bytes == t.n_elements // block * size
    assert info.parameter_count == expected_params(s)


def test_metadata_is_scalar_and_json_ready(synth):
    _s, path = synth
    info = read_gguf_info(path)
    md = info.metadata
    assert md["general.architecture"] == "llama"
    assert md["llama.block_count"] == 3
    assert md["tokenizer.ggml.model"] == "llama"
    assert md["tokenizer.ggml.tokens"] == "[array of 400 string]"
    assert md["tokenizer.ggml.scores"] == "[array of 400 float32]"
    assert md["tokenizer.ggml.token_type"] == "[array of 400 int32]"
    assert "<|im_start|>" in md["tokenizer.chat_template"]
    assert not any(k.startswith("GGUF.") for k in md)
    d = info.to_dict()
    text = json.dumps(d)
    assert json.loads(text)["block_count"] == 3
    assert len(d["tensors"]) == len(info.tensors)
    assert d["quantization"] == "F16"
    assert "tensors" not in info.to_dict(tensors=False)


def test_format_info(synth):
    _s, path = synth
    info = read_gguf_info(path)
    short = format_info(info)
    for needle in ("architecture:", "llama", "blocks:", "kv heads:", "F16", "context length:", "1,024"):
        assert needle in short
    assert "blk.0.attn_q.weight" not in short
    long = format_info(info, tensors=True)
    assert long.startswith(short)
    assert "blk.0.attn_q.weight" in long and "bytes per layer:" in long and "output_norm.weight" in long


# ----------------------------------------------------------------------------- hand-made files


def write_gguf(path: Path, arch: str = "llama", *, layers: int = 4, skip: tuple = (), **extra) -> Path:
    """A minimal GGUF with the required keys (minus ``skip``), extra keys and one tiny tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": layers,
        "embedding_length": 64,
        "context_length": 512,
        "attention.head_count": 4,
        "feed_forward_length": 128,
    }
    for k, v in keys.items():
        if k not in skip:
            w.add_uint32(f"{arch}.{k}", v)
    for k, v in extra.items():
        k = f"{arch}.{k.replace('__', '.')}"
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        else:
            w.add_uint32(k, v)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_per_layer_head_count_kv_array(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", attention__head_count_kv=[4, 2, 2, 1])
    info = read_gguf_info(p)
    assert info.head_count == 4
    assert info.head_count_kv == [4, 2, 2, 1]
    assert [info.n_head_kv(i) for i in range(4)] == [4, 2, 2, 1]
    assert info.n_head(3) == 4
    assert info.metadata["llama.attention.head_count_kv"].startswith("[array of 4 ")
    assert info.vocab_size == 10  # from token_embd when there is no tokenizer
    assert info.layer_bytes() == {i: 256 for i in range(4)}
    assert "[4, 2, 2, 1]" in format_info(info)


def test_per_layer_head_count_array_and_explicit_head_dims(tmp_path):
    p = write_gguf(
        tmp_path / "b.gguf",
        skip=("attention.head_count",),
        attention__head_count=[8, 8, 0, 8],
        attention__key_length=32,
        attention__value_length=16,
    )
    info = read_gguf_info(p)
    assert info.head_count == [8, 8, 0, 8]
    assert info.head_count_kv == [8, 8, 0, 8]  # defaults to head_count, per layer
    assert info.n_head(2) == 0
    assert info.key_length == 32 and info.value_length == 16
    assert info.head_dim_k(1) == 32 and info.head_dim_v(1) == 16


def test_head_dim_defaults_to_embd_over_heads(tmp_path):
    info = read_gguf_info(write_gguf(tmp_path / "c.gguf"))
    assert info.head_dim_k() == info.head_dim_v() == 16
    assert info.head_count_kv == 4  # missing -> head_count
    assert info.file_type is None and info.quantization == "F32"


def test_sliding_window_with_explicit_bool_pattern(tmp_path):
    pattern = [True, False, True, False]
    p = write_gguf(tmp_path / "d.gguf", attention__sliding_window=128, attention__sliding_window_pattern=pattern)
    info = read_gguf_info(p)
    assert info.sliding_window == 128
    assert info.swa_layers == pattern
    assert "sliding window:" in format_info(info) and "2 of 4 layers" in format_info(info)


def test_sliding_window_with_int_period(tmp_path):
    p = write_gguf(tmp_path / "e.gguf", layers=8, attention__sliding_window=256, attention__sliding_window_pattern=4)
    info = read_gguf_info(p)
    assert info.sliding_window == 256
    # period 4: three sliding-window layers, then one full-attention layer
    assert info.swa_layers == [True, True, True, False] * 2


def test_sliding_window_arch_default_pattern(tmp_path):
    p = write_gguf(tmp_path / "g.gguf", arch="gemma3", layers=12, attention__sliding_window=512)
    info = read_gguf_info(p)
    assert info.architecture == "gemma3"
    assert info.sliding_window == 512
    assert info.swa_layers == ([True] * 5 + [False]) * 2


def test_sliding_window_without_pattern_is_none(tmp_path):
    info = read_gguf_info(write_gguf(tmp_path / "h.gguf", attention__sliding_window=64))
    assert info.sliding_window == 64 and info.swa_layers is None


# ----------------------------------------------------------------------------- errors


def assert_gguf_error(path, *needles):
    with pytest.raises(GGUFError) as ei:
        read_gguf_info(path)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_error_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is text\n")
    assert_gguf_error(p, 'not a GGUF file (it begins "hell", where a GGUF file begins "GGUF")')
    z = tmp_path / "archive.gguf"
    z.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert_gguf_error(z, 'not a GGUF file (it begins 50 4b 03 04, where a GGUF file begins "GGUF")')


def test_error_truncated(tmp_path, synth):
    _s, path = synth
    data = path.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    assert_gguf_error(half, "truncated", "tensor data", f"{len(data):,}", f"{len(data) // 2:,}")
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:300])
    assert_gguf_error(head, "truncated", "header")
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF\x03\x00")
    assert_gguf_error(tiny, "truncated")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_gguf_error(empty, "empty")


@pytest.mark.parametrize("version", [1, 99])
def test_error_bad_version(tmp_path, synth, version):
    _s, path = synth
    data = bytearray(path.read_bytes())
    data[4:8] = version.to_bytes(4, "little")
    p = tmp_path / f"v{version}.gguf"
    p.write_bytes(bytes(data))
    assert_gguf_error(p, f"unsupported GGUF version {version}")


def test_error_missing_file_and_directory(tmp_path):
    assert_gguf_error(tmp_path / "nope.gguf", "no such file")
    assert_gguf_error(tmp_path, "directory")


def test_error_missing_required_metadata(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", skip=("block_count",))
    assert_gguf_error(p, "missing required metadata llama.block_count")
    p = write_gguf(tmp_path / "n.gguf", skip=("attention.head_count",))
    assert_gguf_error(p, "llama.attention.head_count")


# ----------------------------------------------------------------------------- speed, memory


def test_large_vocabulary_is_summarised(tmp_path):
    # The stock reader walks every array element in Python: seconds for a real vocabulary.
    n = 100_000
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    for k, v in (("block_count", 1), ("embedding_length", 8), ("context_length", 64), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{k}", v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges([f"t{i} t{i + 1}" for i in range(n)])
    w.add_tensor("token_embd.weight", np.zeros((n, 8), dtype=np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # How fast this is against the stock reader is measured by bench/synth_speed.py, not here.
    info = read_gguf_info(tmp_path / "v.gguf")
    assert info.vocab_size == n
    assert info.metadata["tokenizer.ggml.merges"] == f"[array of {n} string]"


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_reading_does_not_load_tensor_data(tmp_path):
    path = write_synthetic(tmp_path / "big.gguf", SynthShape(layers=4, embd=1024, heads=8, kv_heads=4, type="f16"))
    size = path.stat().st_size
    assert size > 60_000_000
    read_gguf_info(path)  # warm imports
    before = _rss()
    info = read_gguf_info(path)
    grew = _rss() - before
    assert info.tensor_bytes > 0.95 * size
    assert grew < size / 10, f"RSS grew by {grew:,} bytes reading a {size:,}-byte file"


def test_real_model_when_present(stories_model):
    info = read_gguf_info(stories_model)
    assert info.architecture == "llama"
    assert (info.block_count, info.embedding_length, info.head_count, info.head_count_kv) == (5, 64, 8, 4)
    assert info.context_length == 2048 and info.vocab_size == 512
    assert info.file_type is None and info.quantization == "F32"
    assert info.parameter_count == sum(t.n_elements for t in info.tensors)
    assert info.head_dim_k() == 8


def test_a_file_missing_a_layers_tensors_is_refused(tmp_path):
    """Issue 17 item 9: a file whose tensor table lacks a layer was registered, and only its
    load failed (llama.cpp stops at the first missing tensor)."""
    good = write_gguf(tmp_path / "good.gguf", layers=3)
    assert read_gguf_info(good).block_count == 3
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "llama")
    for k, v in (("block_count", 12), ("embedding_length", 64), ("context_length", 512), ("attention.head_count", 4)):
        w.add_uint32(f"llama.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float32))
    for i in (0, 2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_gguf_error(tmp_path / "cut.gguf", "block_count is 12, but the file has no tensors for layer "
                                             "1, 3, 4, 5, 6, 7, 8, 9 and 2 more")


@pytest.mark.parametrize("field, value, says", [
    ("block_count", 10_000_000, "llama.cpp loads 1 to 512 layers"),
    ("block_count", 0, "llama.cpp loads 1 to 512 layers"),
    ("embedding_length", 0, "a model needs more than 0"),
    ("context_length", 0, "a model needs more than 0"),
])
def test_files_llama_cpp_can_never_load_are_refused(tmp_path, field, value, says):
    from gguf import GGUFWriter

    path = tmp_path / "bad.gguf"
    w = GGUFWriter(str(path), "llama")
    fields = {"block_count": 2, "embedding_length": 64, "context_length": 256, "attention.head_count": 4}
    fields[field] = value
    for k, v in fields.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=says):
        read_gguf_info(path)
