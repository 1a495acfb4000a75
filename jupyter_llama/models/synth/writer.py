"""Writing a synthetic model's GGUF file: its metadata (the family's hyperparameters and the
tokenizer) and its tensors, atomically."""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, Keys, LlamaFileType

from .plan import _QUANTIZED_KINDS, _SHORTCONV_CACHE, _tensor_plan
from .shape import SynthShape
from .vocab import BOS_ID, CHAT_TEMPLATE, EOS_ID, FIM_TOKENS, TOOLS_TEMPLATE, UNK_ID, _vocabulary
from .weights import _make_tensor, _nbytes

_GGML_TYPE = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}
_FILE_TYPE = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
}


def write_synthetic(path: os.PathLike | str, shape: SynthShape | None = None, **overrides) -> Path:
    """Write a synthetic llama GGUF to ``path`` atomically; return the path."""
    s = shape if shape is not None else SynthShape()
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(SynthShape)}
        if unknown:
            raise ValueError(f"unknown shape field(s): {', '.join(sorted(unknown))}")
        s = dataclasses.replace(s, **overrides)
    else:
        s = dataclasses.replace(s)  # validates a shape mutated after construction
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    # a unique name beside the target (same filesystem, so the rename is atomic);
    # created by the writer with the usual umask-derived permissions
    tmp = str(out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        _write(tmp, s)
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return out


def _write(tmp: str, s: SynthShape) -> None:
    w = GGUFWriter(tmp, s.arch)
    name = f"synthetic-{s.arch}-{s.layers}x{s.embd}-{s.type}-seed{s.seed}"
    w.add_name(name)
    w.add_description(f"Synthetic random-weight {s.arch} model written by jupyter_llama.models.synth")
    w.add_file_type(int(_FILE_TYPE[s.type]))
    if s.type in ("q8_0", "q4_0"):
        w.add_quantization_version(2)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.embd)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.heads)
    if s.arch == "lfm2":  # no KV heads in a recurrent layer: that is how llama.cpp tells them apart
        w.add_head_count_kv([0 if s.is_recurrent(il) else s.kv_heads for il in range(s.layers)])
        w.add_shortconv_l_cache(_SHORTCONV_CACHE)
    elif s.arch == "deepseek2":  # one compressed row per token, shared by every head
        w.add_head_count_kv(1)
    else:
        w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(s.n_rope)
    if s.arch == "deepseek2":
        # What the cache holds per token (the compressed KV and the rotary key), and the head
        # sizes once decompressed.
        w.add_key_length(s.n_kv_lora + s.n_rope)
        w.add_value_length(s.n_kv_lora)
        w.add_key_length_mla(s.head_dim)
        w.add_value_length_mla(s.head_dim - s.n_rope)
        w.add_q_lora_rank(s.n_q_lora)
        w.add_kv_lora_rank(s.n_kv_lora)
        w.add_leading_dense_block_count(s.layers)
        w.add_expert_feed_forward_length(s.n_ff)
        w.add_expert_shared_count(0)
    elif s.head_dim != s.embd // s.heads:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.window:
        w.add_sliding_window(s.window)
        w.add_sliding_window_pattern(s.swa_layers())
    if s.n_experts:
        w.add_expert_count(s.n_experts)
        w.add_expert_used_count(s.n_experts_used)
        w.add_expert_feed_forward_length(s.n_expert_ff)
    w.add_vocab_size(s.vocab)

    tokens, scores, types = _vocabulary(s.vocab, s.extra_tokens, newline=s.tied)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if s.template == "tools":
        # no space before the text after a control token: the generation prompt, tokenized,
        # must read back as written (llama-server feeds it to the tool-call grammar)
        w.add_add_space_prefix(False)
    if s.fim:
        for key, text in zip((Keys.Tokenizer.FIM_PRE_ID, Keys.Tokenizer.FIM_SUF_ID, Keys.Tokenizer.FIM_MID_ID),
                             FIM_TOKENS, strict=True):
            w.add_uint32(key, s.token_id(text))
    w.add_chat_template(TOOLS_TEMPLATE if s.template == "tools" else CHAT_TEMPLATE)

    plan = _tensor_plan(s)
    for tname, tshape, kind in plan:
        if kind not in _QUANTIZED_KINDS:
            w.add_tensor_info(tname, tshape, np.dtype(np.float32), _nbytes(tshape, "f32"))
        else:
            w.add_tensor_info(
                tname, tshape, np.dtype(np.float32), _nbytes(tshape, s.type), raw_dtype=_GGML_TYPE[s.type]
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (_tname, tshape, kind) in enumerate(plan):
        w.write_tensor_data(_make_tensor(s, index, tshape, kind))
    w.close()
