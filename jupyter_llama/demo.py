"""Register the demo models `make lab` promises: `python -m jupyter_llama.demo`.

* ``demo``: a small synthetic llama model (made here, offline, in a second);
* ``stories``: the real tiny trained stories260K, when ``../shared/models`` has it.
Already registered models are left as they are.
"""

from __future__ import annotations

from pathlib import Path

from .models.store import ModelStore

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.gguf"


def main() -> None:
    store = ModelStore()
    if not store.exists("demo"):
        store.synth("demo", layers=4, embd=256, heads=4, kv_heads=2, ctx=4096, seed=7)
    if STORIES.is_file() and not store.exists("stories"):
        store.create("stories", STORIES)
    names = ", ".join(e.display for e in store.list())
    print(f"demo models in {store.root}: {names}")
    print('try in a notebook:  %load_ext jupyter_llama   then   %llama run demo "Hello"')


if __name__ == "__main__":
    main()
