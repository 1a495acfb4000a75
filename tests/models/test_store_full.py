"""A full disk under the store (issue 17 item 1): every write that runs out of space is one
error, :class:`~jupyter_llama.errors.StorageFull` (HTTP 507), with a sentence for a person, and
nothing half-written stays: no temporary file, no blob no manifest names (unless it was there
before), no empty manifest folder, no truncated manifest, no partial sidecar.

The store lives on a small tmpfs mounted for the test (the ``tmpfs`` fixture; skipped where
mounting is not permitted), filled up with a filler file; the GGUFs come from another
filesystem, so imports copy.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from jupyter_llama.errors import StorageFull
from jupyter_llama.models.preset import Preset
from jupyter_llama.models.pull import DiskFull
from jupyter_llama.models.store import ModelStore
from jupyter_llama.models.synth import SynthShape, write_synthetic

PAGE = 4096


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def assert_clean(store: ModelStore, blobs_before: set[str] = frozenset()):
    """Nothing half-written under the store."""
    if store.tmp_dir.exists():
        assert os.listdir(store.tmp_dir) == [], os.listdir(store.tmp_dir)
    leftovers = [str(p) for p in store.root.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers  # atomic writes' temporaries (manifests, sidecars)
    referenced = store._referenced()
    for p, _parts in store._iter_manifest_paths():
        json.loads(p.read_text())  # every manifest whole
    if store.manifests_dir.exists():
        for d, subdirs, files in os.walk(store.manifests_dir):
            if d != str(store.manifests_dir):
                assert subdirs or files, f"empty manifest folder {d}"
    blobs = {n[len("sha256-"):] for n in os.listdir(store.blobs_dir)} if store.blobs_dir.exists() else set()
    assert blobs <= referenced | set(blobs_before), f"blobs no manifest names: {blobs - referenced - set(blobs_before)}"
    if store.verified_dir.exists():
        for p in store.verified_dir.iterdir():
            json.loads(p.read_text())  # no partial sidecar
            assert p.name[len("sha256-"):-len(".json")] in blobs, f"sidecar of no blob: {p}"


def blob_names(store: ModelStore) -> set[str]:
    return {n[len("sha256-"):] for n in os.listdir(store.blobs_dir)} if store.blobs_dir.exists() else set()


@pytest.fixture
def fs(tmpfs):
    return tmpfs("8m")


@pytest.fixture
def big_gguf(gguf_dir):
    """3.5 MB, on the tests' own disk (not the tmpfs): a create copies it."""
    return write_synthetic(gguf_dir / "full-big.gguf",
                           SynthShape(layers=4, embd=128, heads=4, kv_heads=2, vocab=512, ctx=256, seed=61))


def test_the_error_is_one_fact_with_the_pulls():
    assert issubclass(DiskFull, StorageFull) and StorageFull.status == DiskFull.status == 507
    from jupyter_llama.models.store import StorageFull as FromStore

    assert FromStore is StorageFull


def test_create_larger_than_the_free_space(fs, big_gguf, ggufs, fill_disk):
    store = ModelStore(fs / "models")
    store.create("small", ggufs["a"])
    before = blob_names(store)
    filler = fill_disk(fs / "filler", leave=1 << 20)  # 1 MiB free, the model is 3.5 MB
    with pytest.raises(StorageFull) as ei:
        store.create("big", big_gguf)
    msg = str(ei.value)
    assert f"the disk holding the model store {store.root} is full" in msg, msg
    assert str(big_gguf) in msg and "needed 3.5 MB" in msg and "free" in msg and "jupyter-llama rm" in msg, msg
    assert "Errno" not in msg and "OSError" not in msg
    assert ei.value.needed == big_gguf.stat().st_size and ei.value.status == 507
    assert_clean(store, before)
    assert store.names() == ["small:latest"]
    # the same with a projector that does not fit after the model did: neither is kept
    filler.unlink()
    fill_disk(filler, leave=pages(big_gguf.stat().st_size) + (64 << 10))
    with pytest.raises(StorageFull):
        store.create("vision", ggufs["b"], projector=big_gguf)
    assert_clean(store, before)
    assert store.names() == ["small:latest"]
    # space freed: the same create works
    filler.unlink()
    e = store.create("big", big_gguf)
    assert e.model_digest in blob_names(store)
    assert store.resolve_sync("big").path == str(store.blob_path(e.model_digest))
    assert_clean(store)


def test_a_manifest_that_does_not_fit_takes_its_new_blob_with_it(fs, ggufs, fill_disk):
    """The blob lands (it fits to the page), then the manifest finds the disk full: the blob,
    named by no manifest, goes again (it used to stay, unnamed, taking the space)."""
    store = ModelStore(fs / "models")
    store.create("small", ggufs["a"])
    before = blob_names(store)
    size = os.path.getsize(ggufs["c"])
    fill_disk(fs / "filler", leave=pages(size))
    assert shutil.disk_usage(fs).free == pages(size)
    with pytest.raises(StorageFull, match="saving model c:latest"):
        store.create("c", ggufs["c"])
    assert_clean(store, before)
    assert blob_names(store) == before and store.names() == ["small:latest"]
    # a blob that was there before is kept when a new name for it does not fit
    (fs / "filler").unlink()
    fill_disk(fs / "filler")
    with pytest.raises(StorageFull):
        store.create_from_blobs("again", next(iter(before)))
    assert blob_names(store) == before and store.names() == ["small:latest"]
    assert store.resolve_sync("small").path == str(store.blob_path(next(iter(before))))
    assert_clean(store, before)
    (fs / "filler").unlink()
    store.create("c", ggufs["c"])
    assert sorted(store.names()) == ["c:latest", "small:latest"]
    assert_clean(store)


def test_copy_on_a_full_disk_leaves_no_folder(fs, ggufs, fill_disk):
    store = ModelStore(fs / "models")
    store.create("small", ggufs["a"])
    before = blob_names(store)
    filler = fill_disk(fs / "filler")
    assert shutil.disk_usage(fs).free == 0
    with pytest.raises(StorageFull, match="is full"):
        store.copy("small", "copied")
    assert not (store.manifests_dir / "local" / "library" / "copied").exists()
    with pytest.raises(StorageFull):
        store.copy("small", "someone/copied:v1")  # a new namespace too: no folder of it stays
    assert not (store.manifests_dir / "local" / "someone").exists()
    # a copy with a preset (create FROM a model, with a system prompt): its preset layer too
    with pytest.raises(StorageFull):
        store.copy("small", "sys", Preset(system="You are terse."))
    assert_clean(store, before)
    assert store.names() == ["small:latest"]
    filler.unlink()
    store.copy("small", "copied")
    store.copy("small", "sys", Preset(system="You are terse."))
    assert store.preset("sys").system == "You are terse."
    assert sorted(store.names()) == ["copied:latest", "small:latest", "sys:latest"]
    assert_clean(store)


def test_replacing_a_manifest_on_a_full_disk_keeps_the_old_one_whole(fs, ggufs, fill_disk):
    store = ModelStore(fs / "models")
    store.create("small", ggufs["a"])
    store.copy("small", "copied")
    old = (store.manifests_dir / "local/library/copied/latest").read_text()
    fill_disk(fs / "filler")
    with pytest.raises(StorageFull):
        store.copy("small", "copied", Preset(system="new"))
    assert (store.manifests_dir / "local/library/copied/latest").read_text() == old
    assert store.preset("copied").system == ""
    assert_clean(store)


def test_upload_and_synth_on_a_full_disk(fs, big_gguf, fill_disk):
    import hashlib

    store = ModelStore(fs / "models")
    data = big_gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    filler = fill_disk(fs / "filler", leave=1 << 20)
    with pytest.raises(StorageFull, match=r"receiving the upload of blob sha256:[0-9a-f]{12} \(3\.5 MB\)"):
        store.receive_blob(digest, (data[i:i + 65536] for i in range(0, len(data), 65536)), size=len(data))
    assert_clean(store)
    with pytest.raises(StorageFull, match="writing the synthetic model"):
        store.synth("made", SynthShape(layers=4, embd=256, heads=4, kv_heads=2, vocab=512, ctx=256))
    assert_clean(store)
    filler.unlink()
    store.receive_blob(digest, [data])
    assert store.has_blob(digest)
    store.create_from_blobs("uploaded", digest)
    assert_clean(store)
