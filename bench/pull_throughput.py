"""Pull and import speed of the model store, side by side with the obvious baselines.

* Pull: a ~500 MB synthetic Q8_0 GGUF served by a local HTTP server (the test suite's
  Hugging Face look-alike, ``tests/models/hfserver.py``, which sends files with
  ``sendfile``), fetched alternately by ``models.pull.pull`` (hash while downloading, check
  the GGUF header, land the blob, write the manifest) and by ``curl -s -o`` of the same
  URL (``os.sync()`` before each, so no transfer pays for the last one's writeback).
  Printed: MB/s of each, median over the rounds, and the ratio ours/curl
  (goal >= 0.9). Both the plain-URL path and the Hugging Face path (tree listing, redirect,
  LFS sha256 check) are measured.
* Import: ``ModelStore.create`` of a ~1 GB GGUF by hard link (hashes the file once) and by
  copy (hashes while copying), next to a plain ``shutil.copyfile`` of the same file.

Every big file lives in one temporary directory that is removed at the end.

Usage: ``.venv/bin/python bench/pull_throughput.py [--rounds N] [--pull-mb 500] [--import-mb 1000]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "models"))

from hfserver import HFServer  # noqa: E402

from jupyter_llama.models.pull import pull  # noqa: E402
from jupyter_llama.models.store import ModelStore  # noqa: E402
from jupyter_llama.models.synth import SynthShape, write_synthetic  # noqa: E402

MB = 1e6


def shape_for(megabytes: float) -> SynthShape:
    """A Q8_0 llama shape of about ``megabytes`` (one layer of 1536 wide is ~26.7 MB)."""
    per_layer = 26.7
    layers = max(1, round(megabytes / per_layer))
    return SynthShape(layers=layers, embd=1536, heads=12, kv_heads=4, ff=4096, vocab=512, ctx=2048,
                      type="q8_0", seed=7)



def bench_pull(work: Path, rounds: int, megabytes: float) -> dict:
    src = work / "pull-src.gguf"
    t = time.perf_counter()
    write_synthetic(src, shape_for(megabytes))
    size = src.stat().st_size
    print(f"pull: synthetic model {size / MB:.0f} MB written in {time.perf_counter() - t:.1f}s")
    curl = shutil.which("curl")
    if curl is None:
        print("pull: curl not found; skipping the pull comparison")
        return {}
    env_before = os.environ.get("HF_ENDPOINT")
    results: dict[str, list[float]] = {"curl": [], "url": [], "hf": []}
    with HFServer() as srv:
        os.environ["HF_ENDPOINT"] = srv.url
        srv.add_file("model-Q8_0.gguf", src)
        srv.add_repo("bench/model-GGUF", {"model-Q8_0.gguf": src})
        url = srv.file_url("model-Q8_0.gguf")
        try:
            for r in range(rounds):
                out = work / "curl.out"
                os.sync()  # start each transfer with no dirty pages from the last one
                t = time.perf_counter()
                subprocess.run([curl, "-s", "-o", str(out), url], check=True)
                results["curl"].append(size / (time.perf_counter() - t) / MB)
                assert out.stat().st_size == size
                out.unlink()

                store = ModelStore(work / f"store-url-{r}")
                os.sync()
                t = time.perf_counter()
                pull(url, name="bench", store=store)
                results["url"].append(size / (time.perf_counter() - t) / MB)
                shutil.rmtree(store.root)

                store = ModelStore(work / f"store-hf-{r}")
                os.sync()
                t = time.perf_counter()
                pull("hf.co/bench/model-GGUF:Q8_0", store=store)
                results["hf"].append(size / (time.perf_counter() - t) / MB)
                shutil.rmtree(store.root)
                print(f"  round {r + 1}: curl {results['curl'][-1]:.0f} MB/s, pull(url) {results['url'][-1]:.0f} MB/s, "
                      f"pull(hf) {results['hf'][-1]:.0f} MB/s")
        finally:
            if env_before is None:
                os.environ.pop("HF_ENDPOINT", None)
            else:
                os.environ["HF_ENDPOINT"] = env_before
    src.unlink()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"pull: median curl {med['curl']:.0f} MB/s, pull(url) {med['url']:.0f} MB/s, pull(hf) {med['hf']:.0f} MB/s")
    paired = {k: statistics.median(a / c for a, c in zip(results[k], results["curl"], strict=True))
              for k in ("url", "hf")}
    print(f"pull: ratio of medians pull(url)/curl = {med['url'] / med['curl']:.2f}, "
          f"pull(hf)/curl = {med['hf'] / med['curl']:.2f}; median of per-round ratios {paired['url']:.2f}, "
          f"{paired['hf']:.2f} (goal >= 0.9)")
    return med


def bench_import(work: Path, megabytes: float) -> dict:
    src = work / "import-src.gguf"
    t = time.perf_counter()
    write_synthetic(src, shape_for(megabytes))
    size = src.stat().st_size
    print(f"import: synthetic model {size / MB:.0f} MB written in {time.perf_counter() - t:.1f}s")
    times = {}

    store = ModelStore(work / "store-import")
    os.sync()
    t = time.perf_counter()
    e = store.create("linked", src, link="hardlink")
    times["hardlink"] = time.perf_counter() - t
    assert e.source["import"]["model"] == "hardlink"
    shutil.rmtree(store.root)

    store = ModelStore(work / "store-import")
    os.sync()
    t = time.perf_counter()
    e = store.create("copied", src, link="copy")
    times["copy"] = time.perf_counter() - t
    assert e.source["import"]["model"] == "copy"
    shutil.rmtree(store.root)

    dst = work / "plain-copy.gguf"
    os.sync()
    t = time.perf_counter()
    shutil.copyfile(src, dst)
    times["shutil.copyfile"] = time.perf_counter() - t
    dst.unlink()
    src.unlink()
    for k, v in times.items():
        print(f"import: {k:<16} {v:6.2f}s  ({size / v / MB:.0f} MB/s)")
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pull-mb", type=float, default=500)
    ap.add_argument("--import-mb", type=float, default=1000)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="jupyter-llama-bench-"))
    try:
        bench_pull(work, args.rounds, args.pull_mb)
        bench_import(work, args.import_mb)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
