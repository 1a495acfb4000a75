"""Deterministic synthetic GGUF models of the architecture families Ollama users run.

``write_synthetic(path, SynthShape(...))`` writes a small (or not so small) model with
random weights that llama.cpp's ``llama-server`` loads and answers with text. Same
shape and seed, same bytes.

Families (``SynthShape.arch``; :data:`FAMILIES` has a small shape of each):

* ``llama``: the default; attention (grouped-query) and a gated feed-forward.
* ``qwen3``: llama plus RMS norms on Q and K per head, and a head size (``key_length``)
  unlike ``embd / heads`` (by default twice it, as in Qwen3).
* ``gemma3``: sliding-window attention on most layers (``sliding_window``; every sixth layer
  and the last keep the whole context), a head size unlike ``embd / heads``, norms after
  attention and after the feed-forward, and the output layer tied to the token embedding
  (no ``output.weight``).
* ``qwen3moe``: qwen3's attention, and a mixture of ``experts`` feed-forward experts per
  layer of which a router picks ``experts_used`` per token (``ffn_*_exps`` tensors,
  ``expert_ff`` wide).
* ``lfm2``: a hybrid recurrent model: most layers are short convolutions that keep a small
  recurrent state per sequence (``shortconv``, a window of 3) instead of a KV cache; every
  third layer is attention.
* ``deepseek2``: DeepSeek's multi-head latent attention (MLA): keys and values are cached
  compressed, one ``kv_lora_rank + rope_dim`` row per token whatever the number of heads,
  and expanded per head by ``attn_k_b`` / ``attn_v_b``; queries go through a low-rank
  ``q_lora_rank`` projection.

How it stays usable with random weights
---------------------------------------
* Vocabulary: a SentencePiece ("llama") vocabulary: ``<unk>``, ``<s>``, ``</s>``, the
  ChatML control tokens ``<|im_start|>``/``<|im_end|>``, the 256 byte-fallback tokens
  ``<0x00>``..``<0xFF>`` (any input text tokenizes), then plain ASCII pieces (``▁``, the
  printable characters, common words, syllables) with decreasing scores.
* Random weights would sample random tokens, and a lone byte token such as ``<0xE3>``
  decodes to half a UTF-8 character; control tokens end the reply or render as nothing.
  So the weights carry a fixed "channel": element 0 of every token embedding is a
  constant, no layer ever writes to element 0 (row 0 of ``attn_output`` and
  ``ffn_down`` is zero), so after the final norm element 0 is a large positive value
  for every position, and the output row of every control and byte token has a large
  negative weight there. Those tokens sit hundreds of logits below the plain pieces
  and are never sampled; the model only ever emits whole ASCII pieces (valid UTF-8).
  Generation ends at ``n_predict``/``max_tokens`` or the context size, not at EOS.
* With a tied output layer (gemma3) the token embedding is also the output layer, so the
  channel is carried by the sign of element 0: plain pieces have ``+sqrt(E)``, control and byte
  tokens ``-sqrt(E)``. A prompt that ends in a plain piece then never samples a control or
  byte token; so that chat prompts (which end in a newline) do too, such a vocabulary has a
  plain ``"\n"`` piece, and the newline is never a byte token.
* ``tokenizer.chat_template`` is a small ChatML template, so ``/v1/chat/completions``
  works; ``<|im_end|>`` is recognised by llama.cpp as an end-of-generation token.
* ``template="tools"``: a ChatML template that also renders tools, tool calls (Hermes
  style: ``<tool_call>`` + JSON ``{"name", "arguments"}``), tool results and reasoning
  (``<think>``, opened by the generation prompt when ``enable_thinking`` is true), which
  llama.cpp's chat parser reads back as ``tool_calls`` and ``reasoning_content``. Random
  weights never choose a tool, so the model is made to: the template ends its generation
  prompt with a control token ``<|tool_turn|>`` when tools are offered (and thinking is
  off), and more residual elements that no layer writes (like element 0) hard-wire a few
  next tokens (see ``_channels``): after ``<|tool_turn|>`` the single token
  ``<tool_call>``, after ``}`` a ``<``, after ``>`` the end of the turn. So, offered
  tools, it opens a call; llama-server's tool grammar writes the JSON (a tool whose
  arguments are enums is called the same way every time), closes it and the turn ends:
  one call. Float types only (the channels need exact weights).
* ``fim=True``: fill-in-the-middle tokens (``<|fim_prefix|>``, ``<|fim_suffix|>``,
  ``<|fim_middle|>``, named in the metadata), so llama-server's ``/infill`` answers.

Speed: weights are produced straight from raw PCG64 output with bit masks (no normal
sampling, no float quantisation): float types get random mantissas and signs under a
fixed exponent; Q8_0/Q4_0 get random quants under a valid f16 scale per block.

The maker is a package, one seam a module: ``shape`` (:class:`SynthShape`, its checks,
:data:`FAMILIES`), ``vocab`` (the tokens and the chat templates), ``plan`` (each family's
tensors), ``weights`` (their values, channels included), ``writer``
(:func:`write_synthetic`: the GGUF file) and ``projector`` (:func:`write_projector`). Each
name below is importable from this package as it was from the one module.
"""

from __future__ import annotations

from ...seams import forward_settings
from . import plan, projector, shape, vocab, weights, writer
from .projector import write_projector as write_projector
from .shape import ARCHS, FAMILIES, TEMPLATES, TYPES, SynthShape
from .shape import TIED as TIED
from .vocab import _BYTE_BASE as _BYTE_BASE
from .vocab import _FIRST_PIECE as _FIRST_PIECE
from .vocab import CHAT_TEMPLATE, MIN_VOCAB, TOOLS_TEMPLATE, special_token_ids
from .vocab import FIM_TOKENS as FIM_TOKENS
from .vocab import TOOL_CALL as TOOL_CALL
from .vocab import TOOL_TURN as TOOL_TURN
from .weights import _make_tensor as _make_tensor
from .writer import write_synthetic

# Besides __all__, the names imported ``as`` themselves above are imported from here by the
# store, the CLI and the tests.
__all__ = ["SynthShape", "write_synthetic", "MIN_VOCAB", "TYPES", "TEMPLATES", "CHAT_TEMPLATE", "TOOLS_TEMPLATE",
           "ARCHS", "FAMILIES", "special_token_ids"]

# (a test that sets one of this package's names, ``synth._make_tensor``, sets it where the seams use
# it: see seams.py)
forward_settings(__name__, (plan, projector, shape, vocab, weights, writer))
