"""The options several commands take: how the grammar adds them (load options, sampling, a
synthetic model's shape), and how a command reads them back from the parsed words."""

from __future__ import annotations

import argparse

LOAD_OPTIONS = ("num_ctx", "num_gpu", "num_parallel", "num_batch", "num_ubatch", "num_thread", "cache_type_k",
                "cache_type_v", "flash_attn")
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed", "num_predict")
# An answer in a cell or a terminal ends here unless asked for more: a small model that never
# says "stop" would otherwise write until its context is full.
DEFAULT_NUM_PREDICT = 256


def _model_options(p: argparse.ArgumentParser, sampling: bool = True, keep_alive: bool = True) -> None:
    """The load options (and, with ``sampling``, a request's); ``keep_alive`` for the commands
    that load the model (not estimate or plot, which load nothing of their own)."""
    g = p.add_argument_group("load options (changing one reloads the model)")
    g.add_argument("--num-ctx", type=int, help="context per request, in tokens")
    g.add_argument("--num-gpu", type=int,
                   help="layers on the devices, GPUs or RPC workers (0 = CPU only; default: llama.cpp decides)")
    g.add_argument("--num-parallel", type=int, help="parallel request slots")
    g.add_argument("--num-batch", type=int, help="logical batch size")
    g.add_argument("--num-ubatch", type=int, help="physical batch size (the compute buffer grows with it)")
    g.add_argument("--num-thread", type=int, help="CPU threads")
    from ..load_options import KV_CACHE_TYPES as kv_types

    g.add_argument("--cache-type-k", choices=kv_types, help="the KV cache's type for keys (default f16)")
    g.add_argument("--cache-type-v", choices=kv_types,
                   help="for values (default f16; a quantised one needs flash attention)")
    g.add_argument("--flash-attn", choices=("on", "off", "auto"), help="flash attention (default: llama.cpp decides)")
    if keep_alive:
        p.add_argument("--keep-alive", help="how long the model stays loaded when idle: 300 (seconds), 10m, 1h30m; "
                                            "-1 for ever, 0 to unload it once answered (a new value never reloads it)")
    if sampling:
        s = p.add_argument_group("sampling (never reloads)")
        s.add_argument("--system", help="system prompt")
        s.add_argument("--temperature", type=float, help="randomness (0: always the likeliest token)")
        s.add_argument("--top-k", type=int, help="choose among the k likeliest tokens")
        s.add_argument("--top-p", type=float, help="choose among the likeliest tokens that make up this probability")
        s.add_argument("--seed", type=int, help="the random seed (the same seed, prompt and options: the same text)")
        s.add_argument("--num-predict", type=int,
                       help=f"most tokens to generate (default {DEFAULT_NUM_PREDICT}, or the model's Modelfile "
                            "num_predict; -1: until the model stops or the context is full)")
        s.add_argument("--stop", action="append", help="stop sequence (repeatable)")
        s.add_argument("--format", choices=("json",), help="constrain the answer to JSON")
        s.add_argument("--raw", action="store_true", help="plain text, no Markdown rendering (and no chat template)")
        s.add_argument("--stats", action="store_true", help="print tokens, tokens/s, load time and placement")


def _options(args) -> dict:
    opts = {k: getattr(args, k) for k in LOAD_OPTIONS + SAMPLING_OPTIONS if getattr(args, k, None) is not None}
    if getattr(args, "stop", None):
        opts["stop"] = args.stop
    return opts


def _shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--embd", type=int, help="embedding width")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="key/value heads (GQA when fewer than heads)")
    p.add_argument("--ff", type=int, help="feed-forward width")
    p.add_argument("--vocab", type=int, help="vocabulary size")
    p.add_argument("--ctx", type=int, help="training context length")
    p.add_argument("--type", choices=("f32", "f16", "q8_0", "q4_0"), help="weight type")
    p.add_argument("--seed", type=int, help="random seed (same seed, same bytes)")


SHAPE_FIELDS = ("layers", "embd", "heads", "kv_heads", "ff", "vocab", "ctx", "type", "seed")
SYNTH_FIELDS = SHAPE_FIELDS + ("template", "fim", "arch")
