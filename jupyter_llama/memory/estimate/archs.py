"""The architectures the detailed estimate models, and those it was held against."""

# Architectures the detailed estimate models: llama's graph up to in-place operations (biases,
# scales, q/k norms, post-norms), and the families whose blocks :mod:`..computegraph` replays
# besides: mixture-of-experts feed-forwards (qwen3moe), short-convolution layers with a
# recurrent state (lfm2) and multi-head latent attention (deepseek2).
LLAMA_LIKE = frozenset({"llama", "mistral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "granite",
                        "qwen3moe", "lfm2", "deepseek2"})
# Those whose compute buffer was held against real children (bench/estimate_accuracy.py):
# the rest are assumed to follow llama's graph, and the estimate says so.
VERIFIED_ARCHS = frozenset({"llama", "qwen3", "gemma3", "qwen3moe", "lfm2", "deepseek2"})

MOE_ARCHS = frozenset({"qwen3moe"})  # mixture-of-experts families whose router and experts are replayed
