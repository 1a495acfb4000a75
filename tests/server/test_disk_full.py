"""A full disk under the server's model store (issue 17 item 1): create, upload and copy answer
507 with a sentence for a person (not a 500 with a Python repr), leave nothing half-written, and
the server goes on answering; once space is freed the same requests succeed.

The store is a small tmpfs mounted for the test (``models_dir`` is overridden to point into
it; the ``store`` fixture puts ``tiny`` and ``other`` there, 1.3 MB), filled with a filler file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from srvutil import OPTS

from jupyter_llama.models.synth import SynthShape, write_synthetic

pytestmark = pytest.mark.engine

BIG = dict(layers=4, embd=128, heads=4, kv_heads=2, vocab=512, ctx=256)  # 3.5 MB


@pytest.fixture
def fs(tmpfs):
    return tmpfs("16m")


@pytest.fixture
def models_dir(fs):
    return fs / "models"


@pytest.fixture
def big_gguf(tmp_path):
    """On the tests' own disk, not the tmpfs: creating a model from it copies it."""
    return write_synthetic(tmp_path / "big.gguf", SynthShape(seed=71, **BIG))


def assert_clean(store, blobs_before=frozenset()):
    """No temporary file, no blob no manifest names (beyond ``blobs_before``), no empty manifest
    folder, no truncated manifest, no partial sidecar."""
    assert os.listdir(store.tmp_dir) == [], os.listdir(store.tmp_dir)
    assert [p for p in store.root.rglob("*.tmp")] == []
    for p, _parts in store._iter_manifest_paths():
        json.loads(p.read_text())
    for d, subdirs, files in os.walk(store.manifests_dir):
        assert d == str(store.manifests_dir) or subdirs or files, f"empty manifest folder {d}"
    blobs = {n[len("sha256-"):] for n in os.listdir(store.blobs_dir)}
    stray = blobs - store._referenced() - set(blobs_before)
    assert not stray, f"blobs no manifest names: {stray}"
    for p in store.verified_dir.iterdir():
        json.loads(p.read_text())


def blob_names(store):
    return {n[len("sha256-"):] for n in os.listdir(store.blobs_dir)}


def assert_507(r, *words):
    assert r.status_code == 507, (r.status_code, r.text)
    msg = r.json()["error"]
    assert "is full" in msg or "too little free space" in msg, msg
    assert "Free some space" in msg and "Errno" not in msg and "Error(" not in msg and "internal error" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


@pytest.mark.llama_config(model_paths="*")
async def test_create_larger_than_the_free_space(http, ext, fs, big_gguf, fill_disk):
    store = ext.store
    before = blob_names(store)
    filler = fill_disk(fs / "filler", leave=1 << 20)  # 1 MiB free, the model is 3.5 MB
    r = await http.post("api/create", json={"model": "big", "from": str(big_gguf)})
    assert_507(r, str(big_gguf), "needed 3.5 MB")
    assert_clean(store, before)
    assert "big:latest" not in {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    filler.unlink()
    r = await http.post("api/create", json={"model": "big", "from": str(big_gguf), "stream": False})
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    assert "big:latest" in {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    assert_clean(store)


async def test_blob_upload_larger_than_the_free_space(http, ext, fs, fill_disk):
    store = ext.store
    data = os.urandom(8 << 20)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    filler = fill_disk(fs / "filler", leave=1 << 20)

    async def body():  # streamed in pieces, without a Content-Length: the disk fills up mid-way
        for i in range(0, len(data), 256 * 1024):
            yield data[i:i + 256 * 1024]

    r = await http.post(f"api/blobs/{digest}", content=body())
    assert_507(r, "receiving the upload of blob", "ran out of space")
    assert_clean(store)
    assert (await http.head(f"api/blobs/{digest}")).status_code == 404
    # with a Content-Length that cannot fit, it is refused before a byte is written; the answer
    # comes once the body is in (answered before, the connection was reset under the sender)
    r = await http.post(f"api/blobs/{digest}", content=data)
    assert_507(r, "too little free space", "needs 8.4 MB", "Nothing was written")
    assert_clean(store)
    # the server answers normally meanwhile: a model loads and generates
    r = await http.post("api/generate", json={"model": "tiny", "prompt": "Once", "raw": True, "stream": False,
                                              "options": dict(OPTS, num_predict=2)})
    assert r.status_code == 200 and r.json()["done"], r.text
    # space freed: the same uploads work
    filler.unlink()
    r = await http.post(f"api/blobs/{digest}", content=body())
    assert r.status_code == 201, r.text
    assert (await http.head(f"api/blobs/{digest}")).status_code == 200
    small = data[: 2 << 20]
    r = await http.post("api/blobs/sha256:" + hashlib.sha256(small).hexdigest(), content=small)
    assert r.status_code == 201, r.text
    assert os.listdir(store.tmp_dir) == []


async def test_copy_on_a_completely_full_disk(http, ext, fs, fill_disk):
    store = ext.store
    before = blob_names(store)
    filler = fill_disk(fs / "filler")
    assert shutil.disk_usage(fs).free == 0
    r = await http.post("api/copy", json={"source": "tiny", "destination": "copied"})
    assert_507(r, "copied")
    assert not (store.manifests_dir / "local" / "library" / "copied").exists()
    # create FROM a model with a system prompt: a copy with one new (preset) layer
    r = await http.post("api/create", json={"model": "terse", "from": "tiny", "system": "Be terse.",
                                            "stream": False})
    assert_507(r, "terse")
    assert not (store.manifests_dir / "local" / "library" / "terse").exists()
    assert_clean(store, before)
    names = {m["name"] for m in (await http.get("api/tags")).json()["models"]}
    assert names == {"tiny:latest", "other:latest"}
    filler.unlink()
    r = await http.post("api/copy", json={"source": "tiny", "destination": "copied"})
    assert r.status_code == 200, r.text
    r = await http.post("api/create", json={"model": "terse", "from": "tiny", "system": "Be terse.",
                                            "stream": False})
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    shown = (await http.post("api/show", json={"model": "terse"})).json()
    assert shown["system"] == "Be terse."
    assert_clean(store)
