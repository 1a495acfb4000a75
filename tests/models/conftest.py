"""Fixtures for the registry and pull tests: a store, small GGUFs, a local Hub server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from hfserver import HFServer  # noqa: E402
from registryserver import RegistryServer  # noqa: E402

from jupyter_llama.models.store import ModelStore  # noqa: E402
from jupyter_llama.models.synth import SynthShape, write_synthetic  # noqa: E402

TINY = dict(layers=2, embd=64, heads=4, kv_heads=2, vocab=512, ctx=256)


def write_projector(path: Path, seed: int = 0) -> Path:
    """A small projector-like GGUF (architecture ``clip``): loads as a projector, not as a model."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.embedding_length", 32)
    w.add_uint32("clip.vision.block_count", 1)
    w.add_tensor("mm.0.weight", rng.standard_normal((16, 32)).astype(np.float16))
    w.add_tensor("v.patch_embd.weight", rng.standard_normal((32, 8)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ggufs")


@pytest.fixture(scope="session")
def ggufs(gguf_dir):
    """Named small synthetic GGUFs (different seeds and types give different bytes)."""
    return {
        "a": write_synthetic(gguf_dir / "a.gguf", SynthShape(seed=1, **TINY)),
        "b": write_synthetic(gguf_dir / "b.gguf", SynthShape(seed=2, **TINY)),
        "c": write_synthetic(gguf_dir / "c.gguf", SynthShape(seed=3, **TINY)),
        "q8": write_synthetic(gguf_dir / "q8.gguf", SynthShape(seed=4, type="q8_0", **TINY)),
        "q4": write_synthetic(gguf_dir / "q4.gguf", SynthShape(seed=5, type="q4_0", **TINY)),
        # ~2.3 MB: big enough for drops, throttling and resume in the middle
        "big": write_synthetic(gguf_dir / "big.gguf",
                               SynthShape(layers=4, embd=256, heads=4, kv_heads=2, vocab=512, ctx=256, seed=6)),
    }


@pytest.fixture(scope="session")
def projectors(gguf_dir):
    return {
        "f16": write_projector(gguf_dir / "mmproj-f16.gguf", seed=1),
        "q8": write_projector(gguf_dir / "mmproj-q8.gguf", seed=2),
    }


@pytest.fixture
def store(tmp_path) -> ModelStore:
    return ModelStore(tmp_path / "store")


def _no_proxies_and_an_empty_hf_home(monkeypatch, home: Path) -> None:
    """No proxy settings, and a Hugging Face home of the test's own (no login token, an empty
    cache): what the user has in ~/.cache/huggingface must not change what a test sees."""
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))


@pytest.fixture
def hf(monkeypatch, tmp_path):
    """A local Hugging Face look-alike; HF_ENDPOINT points at it, HF_TOKEN is unset, HF_HOME
    is ``tmp_path/hf-home`` (empty until a test writes a cache there)."""
    with HFServer() as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        _no_proxies_and_an_empty_hf_home(monkeypatch, tmp_path / "hf-home")
        yield srv


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """A local Ollama registry look-alike; JUPYTER_LLAMA_REGISTRY points at it."""
    with RegistryServer(tmp_path / "registry-blobs") as srv:
        monkeypatch.setenv("JUPYTER_LLAMA_REGISTRY", srv.url)
        _no_proxies_and_an_empty_hf_home(monkeypatch, tmp_path / "hf-home")
        yield srv
