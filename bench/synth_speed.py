"""How fast the synthetic-model maker writes a ~100 MB GGUF (goal: under 5 s), per weight type,
and how fast gguf_info reads metadata back against the stock `gguf.GGUFReader`.

Baselines, side by side: writing the same number of random bytes with numpy (the floor any
writer pays for generating and storing that much data), and the stock reader on the same
file, here with a 100,000-token vocabulary (where walking every array element is the cost).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jupyter_llama.models.synth import SynthShape, write_synthetic

SHAPES = {
    "f16": SynthShape(layers=8, embd=1024, heads=8, kv_heads=4, type="f16"),
    "q8_0": SynthShape(layers=14, embd=1024, heads=8, kv_heads=4, type="q8_0"),
    "q4_0": SynthShape(layers=26, embd=1024, heads=8, kv_heads=4, type="q4_0"),
    "f32": SynthShape(layers=4, embd=1024, heads=8, kv_heads=4, type="f32"),
}


def main() -> int:
    print(f"{'type':<6}{'size MB':>10}{'ours s':>9}{'numpy floor s':>15}{'ratio':>8}{'goal':>10}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in SHAPES.items():
            path = Path(tmp) / f"{name}.gguf"
            t0 = time.perf_counter()
            write_synthetic(path, shape)
            ours = time.perf_counter() - t0
            size = path.stat().st_size
            path.unlink()
            t0 = time.perf_counter()
            rng = np.random.default_rng(0)
            with open(Path(tmp) / "floor.bin", "wb") as f:
                f.write(rng.bytes(size))
            floor = time.perf_counter() - t0
            os.unlink(Path(tmp) / "floor.bin")
            ok &= ours < 5.0
            print(f"{name:<6}{size / 1e6:>10.1f}{ours:>9.2f}{floor:>15.2f}{ours / floor:>8.2f}{'< 5 s':>10}")
        vocab = Path(tmp) / "vocab.gguf"
        write_synthetic(vocab, SynthShape(layers=2, embd=64, vocab=100_000))
        import gguf

        from jupyter_llama.models.gguf_info import read_gguf_info

        t0 = time.perf_counter()
        read_gguf_info(vocab)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        gguf.GGUFReader(str(vocab))
        stock = time.perf_counter() - t0
        print(f"\nmetadata read, 100k-token vocabulary: gguf_info {ours * 1000:.1f} ms, stock GGUFReader "
              f"{stock * 1000:.1f} ms, ratio {stock / ours:.0f}x faster")
    print("all goals met" if ok else "goal missed: a ~100 MB model took 5 s or more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
