"""The store under operations that race on one name, its locks, and what ``prune`` reclaims.

Real threads on a real store in a temporary folder: creates, copies, deletes, resolves,
uploads and prunes of the same few names at once must each end as done, as a 404 (the name
went away) or as a 409 (try again), and leave a store whose every manifest names blobs
that are there, with no lock held and no lock file or temporary file left behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from jupyter_llama.models import store as store_mod
from jupyter_llama.models.preset import Preset
from jupyter_llama.models.store import BlobMissing, ModelStore, StoreBusy
from jupyter_llama.scheduler import ModelNotFound

NAMES = ["m", "ns/m", "m:v2", "other/x:y"]


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def blob_names(store: ModelStore) -> set[str]:
    return {n[len("sha256-"):] for n in os.listdir(store.blobs_dir)} if store.blobs_dir.exists() else set()


def referenced(store: ModelStore) -> set[str]:
    return {ly["digest"].split(":", 1)[1] for e in store.list() for ly in e.layers}


def assert_consistent(store: ModelStore) -> None:
    """Every manifest names blobs that are there and resolves; no lock file, no temporary
    file, no half-written manifest is left; a prune leaves exactly the blobs named."""
    for e in store.list():
        for ly in e.layers:
            assert store.blob_path(ly["digest"]).is_file(), f"{e.display} names a missing blob {ly['digest']}"
        ref = store.resolve_sync(e.display)
        assert os.path.isfile(ref.path)
    assert [p.name for p in store.locks_dir.iterdir()] in ([], ["manifests.lock"])
    assert os.listdir(store.tmp_dir) == []
    hidden = [p for p in store.manifests_dir.rglob(".*")]
    assert hidden == []  # a manifest is written whole or not at all
    store.prune(grace=0)  # what a race left unnamed (a delete's prune that found the blob busy)
    assert blob_names(store) == referenced(store)


def run_threads(work, n: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_create_copy_delete_and_resolve_racing_on_one_name(store, ggufs):
    """The campaign's race (issue 58): many threads create, copy, delete, resolve, show and
    prune the same names for a while. Each operation succeeds, or answers 404 or 409."""
    sources = [ggufs["a"], ggufs["b"], ggufs["c"]]
    expected: list[tuple[str, str, int]] = []
    unexpected: list[tuple[str, BaseException]] = []
    counts = {"done": 0}
    until = time.monotonic() + 4.0  # how long the race runs (nothing here waits on it)
    lock = threading.Lock()

    def work(i: int) -> None:
        rnd = random.Random(i)
        while time.monotonic() < until:
            op = rnd.choice(["create", "create", "copy", "from", "remove", "remove_async", "resolve", "show",
                             "list", "prune", "prune_all", "weights_stay"])
            a, b = rnd.sample(NAMES, 2)
            try:
                if op == "create":
                    store.create(a, rnd.choice(sources), link=rnd.choice(["auto", "copy"]))
                elif op == "copy":
                    store.copy(a, b)
                elif op == "from":  # a model made FROM another: shared weights, its own preset layers
                    store.copy(a, b, preset=Preset(system=f"you are number {rnd.randint(1, 3)}"))
                elif op == "remove":
                    store.remove_sync(a)
                elif op == "remove_async":
                    asyncio.run(store.remove(a))
                elif op == "resolve":  # (a blob in the store; a delete racing with it may remove it just after)
                    assert os.path.dirname(store.resolve_sync(a).path) == str(store.blobs_dir)
                elif op == "show":
                    store.show(a)
                elif op == "list":
                    store.list()
                elif op == "prune":
                    store.prune_partials()
                elif op == "prune_all":
                    store.prune(grace=0)
                else:
                    store.weights_stay(a)
                with lock:
                    counts["done"] += 1
            except (ModelNotFound, BlobMissing, StoreBusy) as e:
                with lock:
                    expected.append((op, type(e).__name__, e.status))
            except Exception as e:  # noqa: BLE001 - every other error is a failure of the test
                with lock:
                    unexpected.append((op, e))

    errors = run_threads(work, 8)
    assert errors == []
    assert unexpected == [], "\n".join(f"{op}: " + "".join(traceback.format_exception(e)) for op, e in unexpected[:3])
    assert {status for _op, _kind, status in expected} <= {404, 409}
    assert counts["done"] > 0
    assert_consistent(store)


def test_uploads_named_by_a_create_survive_prunes_running_meanwhile(store, ggufs):
    """Ollama's create: upload the blob, then name it. A prune between the two (with the
    default grace) must not take the blob; a delete of a model using the same bytes neither."""
    data = {k: Path(ggufs[k]).read_bytes() for k in ("a", "b")}
    unexpected: list[BaseException] = []
    until = time.monotonic() + 3.0

    def work(i: int) -> None:
        rnd = random.Random(100 + i)
        while time.monotonic() < until:
            k = rnd.choice(["a", "b"])
            name = rnd.choice(NAMES)
            try:
                if i % 3 == 0:
                    store.prune_partials()
                elif i % 3 == 1:
                    digest = hashlib.sha256(data[k]).hexdigest()
                    store.receive_blob(f"sha256:{digest}", [data[k]])
                    store.create_from_files(name, {f"{k}.gguf": f"sha256:{digest}"})
                else:
                    store.remove_sync(name)
            except (ModelNotFound, StoreBusy):
                pass
            except Exception as e:  # noqa: BLE001
                unexpected.append(e)

    errors = run_threads(work, 6)
    assert errors == [] and unexpected == [], (errors + unexpected)[:3]
    assert_consistent(store)


# ----------------------------------------------------------------------------- locks


def test_every_lock_is_released_even_when_one_release_finds_its_descriptor_gone(store):
    """What left a blob lock held forever: one lock of several could not be released
    (EBADF: its descriptor had been closed behind its back), the error stopped the loop,
    and the locks after it stayed held, with waiters polling for them."""
    hexes = ["a" * 64, "b" * 64, "c" * 64]
    with store._blob_locks(hexes) as held:
        os.close(held.locks[-1]._fd)  # released first (reverse order): it fails to, silently
    for h in hexes:
        lk = store._blob_lock(h)
        lk.acquire(timeout=0)  # free now
        lk.release()
    assert list(store.locks_dir.iterdir()) == []


def test_a_release_never_closes_a_descriptor_that_is_not_its_own(store, tmp_path):
    lk = store._blob_lock("d" * 64)
    lk.acquire(timeout=0)
    os.close(lk._fd)
    other = os.open(tmp_path / "someone-elses", os.O_RDWR | os.O_CREAT)  # likely the same number
    try:
        lk.release()
        lk.release()  # twice: nothing
        os.fstat(other)  # still open: not closed by the lock
    finally:
        os.close(other)


def test_a_lock_held_too_long_is_a_409_that_says_so_and_changes_nothing(store, ggufs, monkeypatch):
    monkeypatch.setattr(store_mod, "LOCK_WAIT", 0.3)
    store.create("tiny", ggufs["a"])
    hexd = sha256(ggufs["a"])
    with store._blob_lock(hexd):  # another operation holds the blob
        with pytest.raises(StoreBusy, match=r"blob sha256:[0-9a-f]{12}.*try again") as e:
            store.copy("tiny", "copy")
        assert e.value.status == 409
        assert store.remove_sync("tiny") == []  # the name goes; its busy blob stays, for a later prune
    assert not store.exists("copy") and not store.exists("tiny")
    with store.lock("manifests"):  # another operation is writing a manifest
        with pytest.raises(StoreBusy, match="the list of models"):
            store.create("tiny", ggufs["b"])
    assert store.list() == []
    store.prune(grace=0)
    assert blob_names(store) == set()
    assert [p.name for p in store.locks_dir.iterdir()] in ([], ["manifests.lock"])
    assert os.listdir(store.tmp_dir) == []


def test_stop_waiting_ends_a_wait_at_once(store, ggufs):
    """A server that is stopping ends its store's lock waits (its worker threads must end)."""
    outcome: list[BaseException | None] = []
    started = threading.Event()

    def create() -> None:
        started.set()
        try:
            store.create("tiny", ggufs["a"])
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    with store.lock("manifests"):
        t = threading.Thread(target=create)
        t.start()
        started.wait()
        store.stop_waiting()
        t.join(20)  # (a bound for a broken build, far above LOCK_WAIT's use here: none)
        assert not t.is_alive()
    assert isinstance(outcome[0], StoreBusy) and "stopping" in str(outcome[0])
    assert store.list() == [] and blob_names(store) == set() and os.listdir(store.tmp_dir) == []


# ----------------------------------------------------------------------------- prune


def test_prune_takes_unused_old_blobs_and_keeps_young_used_and_busy_ones(store, ggufs, monkeypatch):
    store.create("used", ggufs["a"])
    young = Path(ggufs["b"]).read_bytes()
    young_hex = hashlib.sha256(young).hexdigest()
    store.receive_blob(f"sha256:{young_hex}", [young])  # uploaded, its create not sent yet
    assert store.prune_partials() == []  # young: kept (PRUNE_GRACE)
    assert store.has_blob(young_hex)

    monkeypatch.setattr(store_mod, "PRUNE_GRACE", 0)  # as if the grace had passed
    busy = Path(ggufs["c"]).read_bytes()
    busy_hex = hashlib.sha256(busy).hexdigest()
    store.receive_blob(f"sha256:{busy_hex}", [busy])
    with store._blob_lock(busy_hex):  # being named by a create right now
        removed = store.prune_partials()
    assert removed == [{"kind": "blob", "file": str(store.blob_path(young_hex)), "digest": f"sha256:{young_hex}",
                        "size": len(young), "bytes": len(young)}]
    assert blob_names(store) == {sha256(ggufs["a"]), busy_hex}  # the used one and the busy one
    assert store.resolve_sync("used").path == str(store.blob_path(sha256(ggufs["a"])))
    assert [r["digest"] for r in store.prune_partials()] == [f"sha256:{busy_hex}"]
    assert blob_names(store) == {sha256(ggufs["a"])}
    assert [p.name for p in store.locks_dir.iterdir()] in ([], ["manifests.lock"])


def test_prune_of_a_hard_linked_blob_says_it_freed_nothing(store, ggufs, tmp_path, monkeypatch):
    src = tmp_path / "mine.gguf"
    src.write_bytes(Path(ggufs["a"]).read_bytes())
    store.create("linked", src, link="hardlink")
    store.remove_sync("linked")  # (its blob is removed with it: only the user's file is left)
    assert blob_names(store) == set() and src.exists()
    hexd = sha256(src)
    os.link(src, store.blob_path(hexd))  # a blob no model names, sharing its bytes with a file outside
    monkeypatch.setattr(store_mod, "PRUNE_GRACE", 0)
    [rec] = store.prune_partials()
    assert rec["kind"] == "blob" and rec["size"] == src.stat().st_size and rec["bytes"] == 0
    assert src.exists()


def test_delete_takes_the_blobs_of_its_last_user_only(store, ggufs, projectors):
    store.create("vision", ggufs["a"], projector=projectors["f16"], preset=Preset(system="be brief"))
    store.copy("vision", "made-from", preset=Preset(system="be long"))  # same weights, other preset layers
    weights = {sha256(ggufs["a"]), sha256(projectors["f16"])}
    own = {h for h in referenced(store)} - weights
    assert store.weights_stay("vision") and store.weights_stay("made-from")

    removed = store.remove_sync("vision")  # one of two users of the weights
    assert weights <= blob_names(store)
    assert set(removed) == own - referenced(store)  # its own preset layer went with it
    assert blob_names(store) == referenced(store)

    assert not store.weights_stay("made-from")
    removed = store.remove_sync("made-from")  # the last user
    assert weights <= set(removed)
    assert blob_names(store) == set()
    assert [p.name for p in store.locks_dir.iterdir()] in ([], ["manifests.lock"])


def test_prune_takes_what_an_ended_process_left_in_tmp(store, monkeypatch):
    store.ensure_dirs()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # an ended process (its PID is free again)
    left = store.tmp_dir / f"upload-{gone.pid}-0123456789ab"
    left.write_bytes(b"x" * 1000)
    mine = store.tmp_dir / f"upload-{os.getpid()}-0123456789ab"  # this process is still writing it
    mine.write_bytes(b"y" * 10)
    assert store.prune_partials() == []  # young: kept
    monkeypatch.setattr(store_mod, "PRUNE_GRACE", 0)
    assert store.prune_partials() == [{"kind": "tmp", "file": str(left), "bytes": 1000}]
    assert not left.exists() and mine.exists()
    mine.unlink()


def test_a_delete_keeps_a_blob_just_uploaded_for_a_create_to_come(store, ggufs):
    """A client uploads the bytes of a model that another client then deletes: the upload's
    create, sent next, still finds its blob. Without an upload, a delete frees the bytes."""
    store.create("old", ggufs["a"])
    data = Path(ggufs["a"]).read_bytes()
    hexd = hashlib.sha256(data).hexdigest()
    store.receive_blob(f"sha256:{hexd}", [data])
    assert store.remove_sync("old") == []
    store.create_from_files("new", {"model.gguf": f"sha256:{hexd}"})
    assert store.resolve_sync("new").path == str(store.blob_path(hexd))
    store.create("plain", ggufs["b"])
    assert store.remove_sync("plain") == [sha256(ggufs["b"])]
    assert blob_names(store) == {hexd}
