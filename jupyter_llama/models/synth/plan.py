"""The tensors of each family, in file order: which tensors a model of a shape has, their
numpy shapes, and what kind of weights each holds (which :mod:`.weights` fills in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .shape import SynthShape


_QUANTIZED_KINDS = frozenset({"embd", "output", "in", "out"})  # kinds stored in the shape's type

_Planned = tuple[str, tuple[int, ...], str]  # a tensor's name, numpy shape and kind (see _tensor_plan)


def _tensor_plan(s: SynthShape) -> list[_Planned]:
    """(name, numpy shape (..., rows, cols), kind) in file order. Kinds: ``embd``, ``output``,
    ``in`` (reads the residual or another activation), ``out`` (writes the residual: row 0
    and the channels' rows are zero), ``norm`` (ones, f32), ``post_norm`` (fours, f32),
    ``signs`` (a norm of random signs, element 0 positive, f32), ``f32`` (small random f32)."""
    E, V, F = s.embd, s.vocab, s.n_ff
    hd = s.head_dim
    q = s.heads * hd
    kv = s.kv_heads * hd
    plan: list[_Planned] = [("token_embd.weight", (V, E), "embd")]

    def attention(b: str, qk_norm: bool) -> list[_Planned]:
        out: list[_Planned] = [(b + "attn_q.weight", (q, E), "in"), (b + "attn_k.weight", (kv, E), "in"),
               (b + "attn_v.weight", (kv, E), "in"), (b + "attn_output.weight", (E, q), "out")]
        if qk_norm:
            out += [(b + "attn_k_norm.weight", (hd,), "norm"), (b + "attn_q_norm.weight", (hd,), "norm")]
        return out

    def ffn(b: str) -> list[_Planned]:
        return [(b + "ffn_gate.weight", (F, E), "in"), (b + "ffn_up.weight", (F, E), "in"),
                (b + "ffn_down.weight", (E, F), "out")]

    for i in range(s.layers):
        b = f"blk.{i}."
        if s.arch == "llama":
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, False),
                     (b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
        elif s.arch == "qwen3":
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, True),
                     (b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
        elif s.arch == "gemma3":
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, True),
                     (b + "post_attention_norm.weight", (E,), "post_norm"), (b + "ffn_norm.weight", (E,), "norm"),
                     *ffn(b), (b + "post_ffw_norm.weight", (E,), "post_norm")]
        elif s.arch == "qwen3moe":
            X, FX = s.n_experts, s.n_expert_ff
            plan += [(b + "attn_norm.weight", (E,), "norm"), *attention(b, True),
                     (b + "ffn_norm.weight", (E,), "norm"), (b + "ffn_gate_inp.weight", (X, E), "in"),
                     (b + "ffn_gate_exps.weight", (X, FX, E), "in"), (b + "ffn_up_exps.weight", (X, FX, E), "in"),
                     (b + "ffn_down_exps.weight", (X, E, FX), "out")]
        elif s.arch == "lfm2":
            plan += [(b + "attn_norm.weight", (E,), "norm")]
            if s.is_recurrent(i):
                plan += [(b + "shortconv.conv.weight", (E, _SHORTCONV_CACHE), "f32"),
                         (b + "shortconv.in_proj.weight", (3 * E, E), "in"),
                         (b + "shortconv.out_proj.weight", (E, E), "out")]
            else:
                plan += attention(b, True)
            plan += [(b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
        else:  # deepseek2 (MLA)
            R, C, QL = s.n_rope, s.n_kv_lora, s.n_q_lora
            nope = hd - R
            plan += [(b + "attn_norm.weight", (E,), "norm"),
                     (b + "attn_q_a_norm.weight", (QL,), "norm"), (b + "attn_kv_a_norm.weight", (C,), "norm"),
                     (b + "attn_q_a.weight", (QL, E), "in"), (b + "attn_q_b.weight", (s.heads * hd, QL), "in"),
                     (b + "attn_kv_a_mqa.weight", (C + R, E), "in"),
                     (b + "attn_k_b.weight", (s.heads, C, nope), "in"),
                     (b + "attn_v_b.weight", (s.heads, nope, C), "in"),
                     (b + "attn_output.weight", (E, s.heads * nope), "out"),
                     (b + "ffn_norm.weight", (E,), "norm"), *ffn(b)]
    plan += [("token_embd_norm.weight" if s.arch == "lfm2" else "output_norm.weight", (E,),
              "signs" if s.tied else "norm")]
    if not s.tied:
        plan += [("output.weight", (V, E), "output")]
    return plan


_SHORTCONV_CACHE = 3  # lfm2's convolution window (shortconv.l_cache)
