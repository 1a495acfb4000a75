import asyncio
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from jupyter_llama.models import store as store_mod
from jupyter_llama.models.gguf_info import GGUFError
from jupyter_llama.models.names import InvalidName
from jupyter_llama.models.store import (
    MODEL_MEDIA_TYPE,
    PROJECTOR_MEDIA_TYPE,
    BlobCorrupt,
    InvalidGGUF,
    ModelStore,
    StoreError,
    default_root,
)
from jupyter_llama.models.synth import SynthShape
from jupyter_llama.scheduler import BadRequest, ModelNotFound, ModelRef


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def blobs(store: ModelStore) -> list[str]:
    return sorted(os.listdir(store.blobs_dir)) if store.blobs_dir.exists() else []


def manifests(store: ModelStore) -> list[str]:
    return sorted(str(p.relative_to(store.manifests_dir)) for p in store.manifests_dir.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- root


def test_root_from_env_argument_and_jupyter_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_LLAMA_MODELS", str(tmp_path / "env"))
    assert ModelStore().root == tmp_path / "env"
    assert ModelStore(tmp_path / "arg").root == tmp_path / "arg"
    monkeypatch.delenv("JUPYTER_LLAMA_MODELS")
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jdata"))
    assert default_root() == tmp_path / "jdata" / "llama" / "models"


# ----------------------------------------------------------------------------- create


def test_create_hard_links_and_records_the_manifest(store, ggufs):
    events = []
    e = store.create("tiny", ggufs["a"], progress=events.append)
    digest = sha256(ggufs["a"])
    blob = store.blob_path(digest)
    assert blob.exists()
    assert os.stat(blob).st_ino == os.stat(ggufs["a"]).st_ino  # same filesystem: a hard link
    assert blobs(store) == [f"sha256-{digest}"]
    assert manifests(store) == ["local/library/tiny/latest"]
    m = json.loads((store.manifests_dir / "local/library/tiny/latest").read_text())
    assert m["layers"] == [{"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{digest}", "size": blob.stat().st_size}]
    assert m["info"]["architecture"] == "llama" and m["info"]["block_count"] == 2
    assert "tensors" not in m["info"]
    assert m["source"]["type"] == "file" and m["source"]["path"] == str(ggufs["a"])
    assert m["source"]["import"] == {"model": "hardlink"}
    assert m["created_at"] and m["modified_at"]
    assert e.display == "tiny:latest" and e.model_digest == digest
    statuses = [ev["status"] for ev in events]
    assert statuses[0] == "parsing GGUF"
    assert "hashing model" in statuses
    assert statuses[-3:] == [f"creating new layer sha256:{digest}", "writing manifest", "success"]
    hashing = [ev for ev in events if ev["status"] == "hashing model"]
    assert hashing[-1]["completed"] == hashing[-1]["total"] == blob.stat().st_size
    assert os.listdir(store.tmp_dir) == []


def test_create_copy_path(store, ggufs):
    events = []
    store.create("tiny", ggufs["a"], link="copy", progress=events.append)
    blob = store.blob_path(sha256(ggufs["a"]))
    assert os.stat(blob).st_ino != os.stat(ggufs["a"]).st_ino
    assert blob.read_bytes() == Path(ggufs["a"]).read_bytes()
    assert any(ev["status"] == "copying model" for ev in events)
    assert store.entry("tiny").source["import"] == {"model": "copy"}


@pytest.mark.parametrize("link", ["auto", "copy"])
def test_reimporting_the_same_bytes_stores_one_blob(store, ggufs, tmp_path, link):
    twin = tmp_path / "twin.gguf"
    shutil.copyfile(ggufs["a"], twin)  # same bytes, another file
    events = []
    store.create("one", ggufs["a"], link=link)
    store.create("two", twin, link=link, progress=events.append)
    store.create("one", ggufs["a"], link=link)  # again, same name
    assert len(blobs(store)) == 1
    assert f"using existing layer sha256:{sha256(twin)}" in [ev["status"] for ev in events]
    assert [e.display for e in store.list()] == ["one:latest", "two:latest"]
    assert os.listdir(store.tmp_dir) == []


@pytest.mark.parametrize("broken", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_copy_falls_back_when_the_kernel_cannot(store, ggufs, monkeypatch, broken):
    import errno

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    for name in broken:
        monkeypatch.setattr(os, name, refuse)
    e = store.create("tiny", ggufs["big"], link="copy")
    assert store.blob_path(e.model_digest).read_bytes() == Path(ggufs["big"]).read_bytes()
    assert e.model_digest == sha256(ggufs["big"])


def test_create_across_filesystems_copies(ggufs, tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem to import from")
    src_dir = Path(tempfile.mkdtemp(dir=shm))
    try:
        src = src_dir / "x.gguf"
        shutil.copyfile(ggufs["b"], src)
        store = ModelStore(tmp_path / "store")
        e = store.create("x", src)
        assert e.source["import"] == {"model": "copy"}
        assert store.blob_path(e.model_digest).read_bytes() == src.read_bytes()
        with pytest.raises(StoreError, match="another filesystem"):
            store.create("y", src, link="hardlink")
    finally:
        shutil.rmtree(src_dir)


def test_create_refuses_non_gguf_and_bad_names(store, tmp_path, ggufs):
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello, not a model\n" * 10)
    with pytest.raises(InvalidGGUF) as ei:
        store.create("junk", junk)
    assert isinstance(ei.value, GGUFError) and isinstance(ei.value, BadRequest)
    assert "not a GGUF file" in str(ei.value)
    with pytest.raises(InvalidGGUF, match="no such file"):
        store.create("missing", tmp_path / "missing.gguf")
    with pytest.raises(InvalidName):
        store.create("../escape", ggufs["a"])
    with pytest.raises(InvalidGGUF, match="not a GGUF"):
        store.create("tiny", ggufs["a"], projector=junk)
    with pytest.raises(BadRequest, match="link must be"):
        store.create("tiny", ggufs["a"], link="symlink")
    assert blobs(store) == [] and manifests(store) == []
    assert not store.tmp_dir.exists() or os.listdir(store.tmp_dir) == []


def test_create_with_projector_resolves_to_mmproj(store, ggufs, projectors):
    e = store.create("vision", ggufs["a"], projector=projectors["f16"])
    assert [ly["mediaType"] for ly in e.layers] == [MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE]
    assert e.details["families"] == ["llama", "clip"]
    assert e.manifest["projector_info"]["projector_type"] == "mlp"
    ref = asyncio.run(store.resolve("vision"))
    assert ref.mmproj == str(store.blob_path(sha256(projectors["f16"])))
    assert ref.path == str(store.blob_path(sha256(ggufs["a"])))
    files = store.show("vision")["files"]
    assert [f["role"] for f in files] == ["model", "projector"]


def test_synth_registers_a_synthetic_model(store):
    e = store.synth("syn", SynthShape(layers=3, embd=64, heads=4, kv_heads=2, vocab=512, ctx=128, seed=9))
    assert e.info["block_count"] == 3
    assert e.source["type"] == "synth" and e.source["shape"]["seed"] == 9
    assert os.listdir(store.tmp_dir) == []
    # same shape again: same bytes, one blob
    store.synth("syn2", SynthShape(layers=3, embd=64, heads=4, kv_heads=2, vocab=512, ctx=128, seed=9))
    assert len(blobs(store)) == 1
    ref = asyncio.run(store.resolve("syn"))
    assert ref.info.block_count == 3 and ref.info.tensors


def test_concurrent_creates_of_one_file(store, ggufs):
    errors = []

    def work(i):
        try:
            store.create(f"m{i}", ggufs["c"], link="copy" if i % 2 else "auto")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(blobs(store)) == 1
    assert len(store.list()) == 6
    assert os.listdir(store.tmp_dir) == []


def test_receive_blob_and_create_from_blobs(store, ggufs):
    data = Path(ggufs["b"]).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(BadRequest, match="digest mismatch"):
        store.receive_blob("sha256:" + "0" * 64, [data])
    store.receive_blob(f"sha256:{digest}", [data[:1000], data[1000:]])
    assert store.has_blob(digest)
    e = store.create_from_blobs("up", f"sha256:{digest}")
    assert e.model_digest == digest
    with pytest.raises(BadRequest, match="upload it first"):
        store.create_from_blobs("up2", "sha256:" + "1" * 64)
    with pytest.raises(BadRequest, match="invalid digest"):
        store.has_blob("sha256:xyz")


# ----------------------------------------------------------------------------- list, show, copy, remove


def test_list_reads_manifests_only(store, ggufs, monkeypatch):
    store.create("tiny", ggufs["a"])
    store.create("hf.co/owner/repo:Q8_0", ggufs["q8"])

    def boom(*a, **k):
        raise AssertionError("list must not open blobs")

    monkeypatch.setattr(store_mod, "read_gguf_info", boom)
    monkeypatch.setattr(store_mod, "hash_file", boom)
    entries = store.list()
    assert [e.display for e in entries] == ["hf.co/owner/repo:Q8_0", "tiny:latest"]
    api = entries[1].to_api()
    assert set(api) == {"name", "model", "modified_at", "size", "digest", "details"}
    assert api["size"] == os.path.getsize(ggufs["a"])
    assert api["details"]["format"] == "gguf" and api["details"]["family"] == "llama"
    assert api["details"]["quantization_level"] == "F32"
    assert entries[0].details["quantization_level"] == "Q8_0"
    assert store.show("tiny")["name"] == "tiny:latest"


def test_show(store, ggufs):
    store.create("tiny", ggufs["q4"])
    s = store.show("tiny", verify=True)
    assert s["name"] == "tiny:latest" and s["model"] == "local/library/tiny:latest"
    assert s["quantization"] == "Q4_0" and s["architecture"] == "llama"
    assert s["parameters"] > 0 and s["parameter_size"].endswith("K")
    assert s["size"] == os.path.getsize(ggufs["q4"])
    assert s["files"][0]["digest"] == f"sha256:{sha256(ggufs['q4'])}" and s["files"][0]["ok"] is True
    assert s["verify"] == {"ok": True, "problems": [], "repair": None}
    assert "im_start" in s["template"]
    assert s["model_info"]["general.architecture"] == "llama"
    assert "verify" not in store.show("tiny")
    with pytest.raises(ModelNotFound):
        store.show("nope")


def test_copy_and_remove_keep_shared_blobs(store, ggufs):
    store.create("tiny", ggufs["a"])
    c = store.copy("tiny", "me/tiny-copy:v2")
    assert c.display == "me/tiny-copy:v2" and c.source["from_model"] == "tiny:latest"
    assert c.digest == store.entry("tiny").digest
    assert len(blobs(store)) == 1
    removed = asyncio.run(store.remove("tiny"))
    assert removed == []
    assert len(blobs(store)) == 1
    assert asyncio.run(store.resolve("me/tiny-copy:v2")).path == str(store.blob_path(sha256(ggufs["a"])))
    removed = asyncio.run(store.remove("me/tiny-copy:v2"))
    assert removed == [sha256(ggufs["a"])]
    assert blobs(store) == [] and manifests(store) == []
    assert list(store.manifests_dir.iterdir()) == []  # empty directories pruned too
    assert not list(store.verified_dir.iterdir())
    # no lock file of a blob outlives its use (a soak found one per deleted blob)
    assert [p.name for p in store.locks_dir.iterdir()] in ([], ["manifests.lock"])
    with pytest.raises(ModelNotFound):
        store.copy("gone", "x")
    with pytest.raises(ModelNotFound):
        asyncio.run(store.remove("gone"))


def test_remove_calls_before_remove_first(store, ggufs, projectors):
    store.create("vision", ggufs["a"], projector=projectors["f16"])
    seen: list[ModelRef] = []

    async def unload(ref):
        assert store.blob_path(sha256(ggufs["a"])).exists()  # nothing deleted yet
        seen.append(ref)

    asyncio.run(store.remove("vision", before_remove=unload))
    assert len(seen) == 1
    assert seen[0].name == "vision:latest"
    assert seen[0].path == str(store.blob_path(sha256(ggufs["a"])))
    assert seen[0].mmproj == str(store.blob_path(sha256(projectors["f16"])))
    assert seen[0].info.architecture == "llama"
    assert blobs(store) == []

    store.create("busy", ggufs["a"])

    async def refuse(ref):
        raise RuntimeError("model is busy")

    with pytest.raises(RuntimeError, match="busy"):
        asyncio.run(store.remove("busy", before_remove=refuse))
    assert store.exists("busy") and len(blobs(store)) == 1


def test_overwriting_a_name_collects_its_old_blob(store, ggufs):
    store.create("tiny", ggufs["a"])
    store.create("tiny", ggufs["b"])
    assert blobs(store) == [f"sha256-{sha256(ggufs['b'])}"]
    first = store.entry("tiny").created_at
    store.create("TINY", ggufs["c"])  # same name, other case: replaces it
    assert manifests(store) == ["local/library/TINY/latest"]
    assert store.entry("tiny").created_at == first
    assert blobs(store) == [f"sha256-{sha256(ggufs['c'])}"]


def test_a_name_is_found_in_any_case_when_folders_differ_only_in_case(store, ggufs):
    """Case-folded, a name may match more than one folder at a level (``Me`` and ``me``); each
    is tried in turn, so a model under the second one is still found."""
    store.create("Me/tiny", ggufs["a"])
    store.create("me/other", ggufs["b"])
    for asked in ("me/other", "ME/other", "Me/Other:LATEST"):
        assert store.entry(asked).manifest_path == store.manifests_dir / "local/me/other/latest"
    store.create("ME/OTHER", ggufs["c"])  # the same model by another case: replaced, not a second one
    assert manifests(store) == ["local/ME/OTHER/latest", "local/Me/tiny/latest"]
    store.create("Library/foo", ggufs["a"])
    store.create("Tiny", ggufs["b"])  # beside it, in the namespace spelled "library"
    assert store.entry("tiny").display == "Tiny:latest" and store.entry("library/FOO").display == "foo:latest"


def test_prune_removes_orphans(store, ggufs):
    store.create("tiny", ggufs["a"])
    orphan = store.blob_path("ab" * 32)
    orphan.write_bytes(b"x")
    assert store.prune() == []  # just written: an upload that a create will name (store.PRUNE_GRACE)
    assert store.prune(grace=0) == ["ab" * 32]
    assert blobs(store) == [f"sha256-{sha256(ggufs['a'])}"]


# ----------------------------------------------------------------------------- resolve


async def test_resolve_is_a_scheduler_resolver(store, ggufs):
    store.create("tiny", ggufs["a"])
    ref = await store("tiny")  # the store itself is a Resolver
    assert isinstance(ref, ModelRef)
    assert ref.name == "tiny:latest" and ref.digest == store.entry("tiny").digest
    assert ref.info.tensors and ref.info.path == ref.path
    assert (await store.resolve("Tiny:LATEST")).path == ref.path
    assert (await store.resolve("library/tiny")).path == ref.path


async def test_resolve_unknown_suggests_close_names(store, ggufs):
    store.create("tinyllama", ggufs["a"])
    store.create("me/phi-mini", ggufs["b"])
    with pytest.raises(ModelNotFound) as ei:
        await store.resolve("tinylama")
    msg = str(ei.value)
    assert msg.startswith('model "tinylama" not found, try pulling it first')
    assert 'did you mean "tinyllama:latest"' in msg
    assert ei.value.status == 404
    with pytest.raises(ModelNotFound, match='did you mean "me/phi-mini:latest"'):
        await store.resolve("phi-mini")
    with pytest.raises(ModelNotFound) as ei:
        await store.resolve("completely-different")
    assert "did you mean" not in str(ei.value)
    with pytest.raises(ModelNotFound, match="store is empty"):
        await ModelStore(store.root.parent / "empty").resolve("x")
    with pytest.raises(InvalidName):
        await store.resolve("bad name")


async def test_resolve_accepts_gguf_paths(store, ggufs, tmp_path, monkeypatch):
    ref = await store.resolve(str(ggufs["a"]))
    assert ref.path == str(ggufs["a"]) and ref.mmproj is None
    monkeypatch.chdir(Path(ggufs["a"]).parent)
    ref = await store.resolve("./a.gguf")
    assert ref.path == str(ggufs["a"])
    with pytest.raises(ModelNotFound, match=r'^model "./nope.gguf" not found: no such file /\S+/nope.gguf$'):
        await store.resolve("./nope.gguf")  # (a path: no advice to pull it)
    with pytest.raises(ModelNotFound, match=r'^model "gone/nope.gguf" not found: no such file /\S+/gone/nope.gguf$'):
        await store.resolve("gone/nope.gguf")  # (a valid name too, but a .gguf one is a file)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"<html>")
    with pytest.raises(BadRequest, match="not a GGUF"):
        await store.resolve(str(junk))
    closed = ModelStore(store.root, allow_paths=False)
    with pytest.raises((ModelNotFound, InvalidName)):
        await closed.resolve(str(ggufs["a"]))


# ----------------------------------------------------------------------------- integrity


def _flip_byte(path: Path, offset: int = -100, keep_mtime: bool = False) -> None:
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset, os.SEEK_END)
        b = fh.read(1)
        fh.seek(offset, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


async def test_corrupted_blob_is_reported_and_refused(store, ggufs):
    store.create("tiny", ggufs["a"], link="copy")
    blob = store.blob_path(sha256(ggufs["a"]))
    _flip_byte(blob)
    s = store.show("tiny", verify=True)
    assert s["verify"]["ok"] is False
    assert "hash" in s["verify"]["problems"][0]
    assert "create it again" in s["verify"]["repair"]
    with pytest.raises(BlobCorrupt) as ei:
        await store.resolve("tiny")
    assert "damaged" in str(ei.value) and f"jupyter-llama create tiny:latest {ggufs['a']}" in str(ei.value)
    # creating it again repairs the blob in place
    store.create("tiny", ggufs["a"], link="copy")
    assert (await store.resolve("tiny")).path == str(blob)
    assert store.show("tiny", verify=True)["verify"]["ok"] is True


async def test_size_mismatch_and_missing_blob_are_cheap_to_detect(store, ggufs, monkeypatch):
    store.create("tiny", ggufs["a"], link="copy")
    blob = store.blob_path(sha256(ggufs["a"]))
    with open(blob, "r+b") as fh:
        fh.truncate(1000)

    def boom(*a, **k):
        raise AssertionError("a size mismatch needs no hashing")

    monkeypatch.setattr(store_mod, "hash_file", boom)
    with pytest.raises(BlobCorrupt, match="the blob is 1,000 bytes"):
        await store.resolve("tiny")
    blob.unlink()
    with pytest.raises(BlobCorrupt, match="missing"):
        await store.resolve("tiny")


async def test_full_hash_runs_once_per_change(store, ggufs, monkeypatch):
    store.create("tiny", ggufs["a"], link="copy")
    calls = []
    real = store_mod.hash_file

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(store_mod, "hash_file", counting)
    await store.resolve("tiny")
    await store.resolve("tiny")
    assert calls == []  # verified when it was imported
    blob = store.blob_path(sha256(ggufs["a"]))
    st = os.stat(blob)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # touched: rehash once
    await store.resolve("tiny")
    await store.resolve("tiny")
    assert len(calls) == 1


async def test_edited_hard_linked_source_is_caught(store, tmp_path, ggufs):
    src = tmp_path / "mine.gguf"
    shutil.copyfile(ggufs["a"], src)
    e = store.create("mine", src)
    assert e.source["import"] == {"model": "hardlink"}
    _flip_byte(src)  # the user edits their file in place: the blob is the same inode
    with pytest.raises(BlobCorrupt, match="create it again"):
        await store.resolve("mine")
    # importing the edited file again gives a new blob; the stale one goes
    store.create("mine", src)
    assert blobs(store) == [f"sha256-{sha256(src)}"]
    await store.resolve("mine")


def test_the_store_is_private_whatever_the_umask(tmp_path, make_model):
    """Issue 17 item 11: folders 0700, manifests 0600 (they carry source URLs)."""
    import stat

    from jupyter_llama.models.store import ModelStore

    old = os.umask(0o022)
    try:
        store = ModelStore(tmp_path / "store")
        store.ensure_dirs()
        entry = store.create("private", make_model("private", layers=1, embd=32))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700
    for d in (store.blobs_dir, store.manifests_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.manifest_path.stat().st_mode) == 0o600
