import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jupyter_llama.engine.runner import free_port
from jupyter_llama.models import pull as pull_mod
from jupyter_llama.models.names import InvalidName
from jupyter_llama.models.pull import (
    DiskFull,
    HashMismatch,
    NotAModel,
    PullError,
    RegistryUnreachable,
    choose_files,
    derive_name,
    parse_source,
    pull_stream,
    render_progress,
)
from jupyter_llama.models.store import BlobCorrupt, ModelStore

REPO = "owner/tiny-GGUF"


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_requests(srv, fid: str) -> list[tuple[str, str, dict]]:
    return [r for r in srv.requests if r[1].startswith("/files/") and fid in r[1]]


@pytest.fixture
def repo(hf, ggufs, projectors, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# tiny\n")
    hf.add_repo(REPO, {
        "README.md": readme,
        "tiny-Q4_K_M.gguf": ggufs["q4"],
        "tiny-Q8_0.gguf": ggufs["q8"],
        "tiny-F32.gguf": ggufs["a"],
        "mmproj-tiny-f16.gguf": projectors["f16"],
        "mmproj-tiny-q8_0.gguf": projectors["q8"],
    })
    hf.add_repo("owner/big-GGUF", {"big-F32.gguf": ggufs["big"]})
    return hf


# ----------------------------------------------------------------------------- sources and names


@pytest.mark.parametrize("text,repo,quant,file", [
    ("hf.co/o/r", "o/r", None, None),
    ("hf.co/o/r:Q4_K_M", "o/r", "Q4_K_M", None),
    ("hf://o/r:q8_0", "o/r", "q8_0", None),
    ("huggingface.co/o/r.v2", "o/r.v2", None, None),
    ("https://huggingface.co/o/r", "o/r", None, None),
    ("https://huggingface.co/o/r/resolve/main/x-Q4_K_M.gguf", "o/r", None, "x-Q4_K_M.gguf"),
    ("https://huggingface.co/o/r/blob/main/sub/x.gguf", "o/r", None, "sub/x.gguf"),
])
def test_parse_hf_sources(text, repo, quant, file):
    s = parse_source(text, endpoint="http://127.0.0.1:1")
    assert (s.kind, s.repo, s.quant, s.file) == ("hf", repo, quant, file)
    assert s.endpoint == "http://127.0.0.1:1"


def test_parse_other_sources(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    s = parse_source("https://example.com/models/m.gguf")
    assert s.kind == "url" and s.url == "https://example.com/models/m.gguf"
    assert parse_source("hf.co/o/r").endpoint == "https://huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/mirror/")
    s = parse_source("http://127.0.0.1:9/mirror/o/r/resolve/main/f.gguf")
    assert (s.kind, s.repo, s.file, s.endpoint) == ("hf", "o/r", "f.gguf", "http://127.0.0.1:9/mirror")
    assert parse_source("http://127.0.0.1:9/mirror/files/f.gguf").kind == "url"
    for bad, msg in [("./llama3.gguf", "a file on this machine"), ("ftp://x/y.gguf", "cannot pull"),
                     ("hf.co/o", "OWNER/REPO"), ("hf.co/o/r:", "empty quantisation"), ("hf.co/o/../r", "OWNER/REPO"),
                     ("", "nothing to pull"), ("hf.co/o/r:Q4 K", "bad quantisation")]:
        with pytest.raises(PullError, match=msg):
            parse_source(bad)


def test_derive_name():
    assert derive_name("hf.co/o/r").display == "hf.co/o/r:latest"
    assert derive_name("hf.co/o/r:Q4_K_M").display == "hf.co/o/r:Q4_K_M"
    assert derive_name("https://huggingface.co/o/r/resolve/main/r-Q8_0.gguf").display == "hf.co/o/r:Q8_0"
    assert derive_name("https://example.com/p/TinyLlama-1.1B.Q4_K_M.gguf").display == "TinyLlama-1.1B.Q4_K_M:latest"
    assert derive_name("https://example.com/p/a%20b(c).gguf").display == "a-b-c:latest"
    assert derive_name("https://example.com/x.gguf", "mine:v1").display == "mine:v1"
    with pytest.raises(InvalidName):
        derive_name("https://example.com/x.gguf", "../mine")
    with pytest.raises(PullError, match="give a name"):
        derive_name("https://example.com/")
    with pytest.raises(PullError, match="give a name"):
        derive_name("hf.co/my.org/r")  # a namespace cannot hold '.'


def _files(*names, sizes=None):
    sizes = sizes or {}
    return [{"type": "file", "path": n, "size": sizes.get(n, 100), "lfs": {"oid": "0" * 64, "size": sizes.get(n, 100)}}
            for n in names]


def test_choose_files():
    listing = _files("README.md", "m-Q2_K.gguf", "m-Q4_0.gguf", "m-Q4_K_M.gguf", "m-Q4_K_M_L.gguf", "m-Q8_0.gguf",
                     "mmproj-m-bf16.gguf", "mmproj-m-f16.gguf", "mmproj-m-q8_0.gguf")
    model, proj = choose_files(listing, None)
    assert model["path"] == "m-Q4_K_M.gguf" and proj["path"] == "mmproj-m-f16.gguf"
    assert choose_files(listing, "q8_0")[0]["path"] == "m-Q8_0.gguf"
    assert choose_files(listing, "Q4_K_M_L")[0]["path"] == "m-Q4_K_M_L.gguf"
    assert choose_files(listing, "m-Q2_K.gguf")[0]["path"] == "m-Q2_K.gguf"
    with pytest.raises(PullError) as ei:
        choose_files(listing, "Q5_K_M", "o/r")
    assert "no GGUF matching 'Q5_K_M' in o/r" in str(ei.value) and "m-Q8_0.gguf (Q8_0)" in str(ei.value)
    # default order: Q4_K_M, then Q4_0, then Q8_0, then the smallest
    assert choose_files(_files("a-Q8_0.gguf", "a-Q4_0.gguf"), None)[0]["path"] == "a-Q4_0.gguf"
    assert choose_files(_files("a-Q8_0.gguf", "a-F16.gguf"), None)[0]["path"] == "a-Q8_0.gguf"
    small = _files("a-F16.gguf", "a-Q6_K.gguf", sizes={"a-F16.gguf": 300, "a-Q6_K.gguf": 200})
    assert choose_files(small, None)[0]["path"] == "a-Q6_K.gguf"
    with pytest.raises(PullError, match="ambiguous"):
        choose_files(_files("a-Q4_0.gguf", "b-Q4_0.gguf"), "Q4_0")
    with pytest.raises(PullError, match="split GGUF"):
        choose_files(_files("a-Q4_0-00001-of-00002.gguf", "a-Q4_0-00002-of-00002.gguf"), "Q4_0")
    with pytest.raises(PullError, match="no GGUF model file"):
        choose_files(_files("README.md", "mmproj-f16.gguf"), None)
    model, proj = choose_files(_files("x.gguf", "mmproj-x-q8_0.gguf"), None)
    assert proj["path"] == "mmproj-x-q8_0.gguf"  # the only one
    assert choose_files(_files("x.gguf"), None)[1] is None


def test_progress_printer_rewrites_one_line_per_status():
    out = []
    p = pull_mod.ProgressPrinter(write=out.append, width=4)
    p({"status": "pulling manifest"})
    p({"status": "pulling abc", "total": 100, "completed": 50})
    p({"status": "pulling abc", "total": 100, "completed": 100})
    p({"status": "success"})
    text = "".join(out)
    assert text.startswith("pulling manifest\npulling abc  50% ▕██  ▏")
    assert "\r\x1b[Kpulling abc 100% ▕████▏" in text and text.endswith("\nsuccess\n")


def test_render_progress():
    line = render_progress({"status": "pulling 3f2a1b9c8d7e", "digest": "sha256:3f", "total": 500_000_000,
                            "completed": 210_000_000}, width=10)
    assert line.startswith("pulling 3f2a1b9c8d7e  42% ▕████      ▏ 210.0 MB/500.0 MB")
    assert render_progress({"status": "success"}) == "success"
    assert render_progress({"error": "boom"}) == "error: boom"
    assert "MB/s" in render_progress({"status": "x", "total": 10**9, "completed": 10**8}, rate=5e7)
    assert render_progress({"status": "pulling a.gguf", "completed": 2000}) == "pulling a.gguf 2.0 KB"


# ----------------------------------------------------------------------------- pulls


def test_pull_hf_repo_default_quant_with_projector(repo, ggufs, projectors, tmp_path):
    store = ModelStore(tmp_path / "store")
    events = []
    e = pull_mod.pull(f"hf.co/{REPO}", progress=events.append, store=store)
    assert e.display == f"hf.co/{REPO}:latest"
    assert e.model_digest == sha256(ggufs["q4"])  # tiny-Q4_K_M.gguf
    assert e.projector_digest == sha256(projectors["f16"])
    assert e.source["type"] == "hf" and e.source["file"] == "tiny-Q4_K_M.gguf"
    assert e.source["projector_file"] == "mmproj-tiny-f16.gguf" and e.source["quant"] == "Q4_K_M"
    statuses = [ev["status"] for ev in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-2:] == ["writing manifest", "success"]
    assert statuses.count("verifying sha256 digest") == 2
    for path in (ggufs["q4"], projectors["f16"]):
        d = sha256(path)
        mine = [ev for ev in events if ev.get("digest") == f"sha256:{d}" and "total" in ev]
        assert mine and mine[0]["status"] == f"pulling {d[:12]}"
        assert mine[-1]["completed"] == mine[-1]["total"] == os.path.getsize(path)
    ref = asyncio.run(store.resolve(f"hf.co/{REPO}"))
    assert ref.mmproj == str(store.blob_path(sha256(projectors["f16"])))
    assert repo.repo_sent(REPO, "tiny-Q8_0.gguf") == 0
    assert list(store.partial_dir.iterdir()) == []
    assert os.listdir(store.tmp_dir) == []


def test_pull_by_tag_case_insensitive_and_by_url_forms(repo, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    e = pull_mod.pull(f"hf.co/{REPO}:q8_0", store=store)
    assert e.display == f"hf.co/{REPO}:q8_0" and e.model_digest == sha256(ggufs["q8"])
    e = pull_mod.pull(f"https://huggingface.co/{REPO}", name="viaurl", store=store)
    assert e.model_digest == sha256(ggufs["q4"])
    e = pull_mod.pull(f"https://huggingface.co/{REPO}/resolve/main/tiny-F32.gguf", store=store)
    assert e.display == f"hf.co/{REPO}:F32" and e.projector_digest is None
    with pytest.raises(PullError) as ei:
        pull_mod.pull(f"hf.co/{REPO}:Q5_K_M", store=store)
    assert "tiny-Q4_K_M.gguf (Q4_K_M)" in str(ei.value)
    with pytest.raises(PullError, match="not found"):
        pull_mod.pull("hf.co/owner/missing-GGUF", store=store)


def test_pull_listing_is_paged(repo, tmp_path):
    repo.page_size = 2
    e = pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=ModelStore(tmp_path / "store"))
    assert e.display.endswith(":Q8_0")
    assert sum(1 for r in repo.requests if "/tree/main" in r[1]) >= 3


def test_token_goes_to_the_hub_only(repo, ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    store = ModelStore(tmp_path / "store")
    pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    api = [r for r in repo.requests if "/api/models/" in r[1]]
    assert api and all(r[2].get("Authorization") == "Bearer hf_secret" for r in api)
    repo.requests.clear()
    repo.add_file("plain", ggufs["b"])
    pull_mod.pull(repo.file_url("plain"), store=store)
    assert repo.requests and all("Authorization" not in r[2] for r in repo.requests)


def test_gated_repo_needs_the_token(repo, tmp_path, monkeypatch):
    repo.require_token = "hf_good"
    store = ModelStore(tmp_path / "store")
    with pytest.raises(PullError, match="gated or private: set HF_TOKEN"):
        pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    assert pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store).display.endswith(":Q8_0")


def test_pull_plain_url_and_reuse(hf, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    hf.add_file("tiny-model.gguf", ggufs["b"])
    events = []
    e = pull_mod.pull(hf.file_url("tiny-model.gguf"), progress=events.append, store=store)
    assert e.display == "tiny-model:latest"
    assert e.model_digest == sha256(ggufs["b"])
    assert e.source == {"type": "url", "url": hf.file_url("tiny-model.gguf")}
    assert any(ev["status"] == "pulling tiny-model.gguf" and ev.get("completed") == os.path.getsize(ggufs["b"])
               for ev in events)
    sent = hf.sent("tiny-model.gguf")
    assert sent == os.path.getsize(ggufs["b"])
    # unchanged on the server: not fetched again
    pull_mod.pull(hf.file_url("tiny-model.gguf"), name="again", store=store)
    assert hf.sent("tiny-model.gguf") == sent
    assert len(os.listdir(store.blobs_dir)) == 1


async def test_pull_stream_is_an_async_generator(repo, tmp_path):
    store = ModelStore(tmp_path / "store")
    seen = [s async for s in pull_stream(f"hf.co/{REPO}:F32", store=store)]
    assert seen[0] == {"status": "pulling manifest"} and seen[-1] == {"status": "success"}
    entry = await pull_mod.apull(f"hf.co/{REPO}:F32", name="again", store=store)
    assert entry.display == "again:latest"


def test_pulling_again_repairs_a_corrupt_blob(repo, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    e = pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    blob = store.blob_path(e.model_digest)
    data = bytearray(blob.read_bytes())
    data[-10] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(BlobCorrupt) as ei:
        asyncio.run(store.resolve(e.display))
    assert f"jupyter-llama pull hf.co/{REPO}:Q8_0" in str(ei.value)
    assert store.show(e.display, verify=True)["verify"]["ok"] is False
    before = repo.repo_sent(REPO, "tiny-Q8_0.gguf")
    pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    assert repo.repo_sent(REPO, "tiny-Q8_0.gguf") == before + os.path.getsize(ggufs["q8"])
    asyncio.run(store.resolve(e.display))


# ----------------------------------------------------------------------------- resume, retry, dedupe


def test_interrupted_pull_resumes_with_range(repo, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    f = repo.repo_file("owner/big-GGUF", "big-F32.gguf")
    half = f.size // 2
    f.drop_after, f.drop_times = half, 1
    with pytest.raises(PullError) as ei:
        pull_mod.pull("hf.co/owner/big-GGUF", retries=0, store=store)
    msg = str(ei.value)
    assert "partial download is kept" in msg and "pull again to resume" in msg
    partial = store.partial_dir / f"sha256-{f.sha256}.partial"
    assert partial.stat().st_size == half
    assert not store.blob_path(f.sha256).exists() and store.list() == []
    sent_before = repo.repo_sent("owner/big-GGUF", "big-F32.gguf")
    events = []
    e = pull_mod.pull("hf.co/owner/big-GGUF", progress=events.append, store=store)
    assert repo.repo_sent("owner/big-GGUF", "big-F32.gguf") - sent_before == f.size - half
    fid = repo.repos["owner/big-GGUF"].files["big-F32.gguf"]
    assert file_requests(repo, fid)[-1][2].get("Range") == f"bytes={half}-"
    assert file_requests(repo, fid)[-1][2].get("If-Range") == f.etag
    assert e.model_digest == f.sha256 and store.blob_path(f.sha256).read_bytes() == Path(ggufs["big"]).read_bytes()
    progress = [ev["completed"] for ev in events if ev.get("digest") == f"sha256:{f.sha256}" and "completed" in ev]
    assert progress[0] == half and progress[-1] == f.size
    assert not partial.exists()


def test_resume_after_the_file_changed_upstream_starts_again(hf, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    hf.add_file("m.gguf", ggufs["big"], drop_after=400_000, drop_times=1)
    with pytest.raises(PullError, match="partial download is kept"):
        pull_mod.pull(hf.file_url("m.gguf"), retries=0, store=store)
    new = hf.add_file("m.gguf", ggufs["c"])  # same URL, other bytes, other ETag
    e = pull_mod.pull(hf.file_url("m.gguf"), store=store)
    assert e.model_digest == new.sha256
    last = file_requests(hf, "m.gguf")[-1][2]
    assert last.get("Range") == "bytes=400000-" and last.get("If-Range") != new.etag
    assert store.blob_path(new.sha256).read_bytes() == Path(ggufs["c"]).read_bytes()
    assert list(store.partial_dir.glob("*.partial")) == []


def test_dropped_connection_is_retried_with_range(hf, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    f = hf.add_file("big.gguf", ggufs["big"], drop_after=600_000, drop_times=2)
    e = pull_mod.pull(hf.file_url("big.gguf"), retries=3, backoff=0.01, store=store)
    assert e.model_digest == f.sha256
    ranges = [r[2].get("Range") for r in file_requests(hf, "big.gguf")]
    assert ranges == [None, "bytes=600000-", "bytes=1200000-"]
    assert hf.sent("big.gguf") == f.size  # every byte once


def test_retries_exhausted_keep_the_partial(hf, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    hf.add_file("big.gguf", ggufs["big"], drop_after=500_000, drop_times=10)
    with pytest.raises(PullError) as ei:
        pull_mod.pull(hf.file_url("big.gguf"), retries=2, backoff=0.01, store=store)
    assert "tried 3 times" in str(ei.value) and "partial download is kept" in str(ei.value)
    assert [p.stat().st_size for p in store.partial_dir.glob("*.partial")] == [1_500_000]
    hf.files["big.gguf"].drop_times = 0
    pull_mod.pull(hf.file_url("big.gguf"), store=store)
    assert hf.sent("big.gguf") == hf.files["big.gguf"].size


async def test_two_concurrent_pulls_download_once(repo, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    f = repo.repo_file("owner/big-GGUF", "big-F32.gguf")
    f.rate = f.size / 1.0  # about a second

    async def run(name):
        return [s async for s in pull_stream("hf.co/owner/big-GGUF", name, store=store)]

    a, b = await asyncio.gather(run("one"), run("two"))
    assert repo.repo_sent("owner/big-GGUF", "big-F32.gguf") == f.size
    for seen in (a, b):
        assert seen[-1] == {"status": "success"}
        done = [s for s in seen if s.get("digest") == f"sha256:{f.sha256}" and "completed" in s]
        assert done[-1]["completed"] == f.size
    assert {e.display for e in store.list()} == {"one:latest", "two:latest"}
    assert len(os.listdir(store.blobs_dir)) == 1


def test_pulls_in_two_processes_download_once(repo, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    f = repo.repo_file("owner/big-GGUF", "big-F32.gguf")
    f.rate = f.size / 2.5
    code = (
        "import sys\n"
        "from jupyter_llama.models.pull import pull\n"
        "from jupyter_llama.models.store import ModelStore\n"
        f"pull('hf.co/owner/big-GGUF', name='other', store=ModelStore({str(store.root)!r}))\n"
        "print('ok')\n"
    )
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("e", pull_mod.pull("hf.co/owner/big-GGUF", name="here", store=store)))
    t.start()
    deadline = time.monotonic() + 10
    while repo.repo_sent("owner/big-GGUF", "big-F32.gguf") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                          timeout=60)
    t.join(30)
    assert proc.returncode == 0, proc.stderr
    assert result["e"].model_digest == f.sha256
    assert repo.repo_sent("owner/big-GGUF", "big-F32.gguf") == f.size
    assert {e.display for e in store.list()} == {"here:latest", "other:latest"}


async def test_closing_the_stream_cancels_and_keeps_the_partial(repo, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    f = repo.repo_file("owner/big-GGUF", "big-F32.gguf")
    f.rate = f.size / 3.0
    async with contextlib.aclosing(pull_stream("hf.co/owner/big-GGUF", store=store)) as stream:
        async for s in stream:
            if s.get("completed", 0) > 200_000:
                break
    partial = store.partial_dir / f"sha256-{f.sha256}.partial"
    kept = partial.stat().st_size
    assert 0 < kept < f.size
    await asyncio.sleep(0.3)
    assert partial.stat().st_size == kept  # the worker stopped
    f.rate = None
    await pull_mod.apull("hf.co/owner/big-GGUF", store=store)
    fid = repo.repos["owner/big-GGUF"].files["big-F32.gguf"]
    assert file_requests(repo, fid)[-1][2].get("Range") == f"bytes={kept}-"
    assert store.blob_path(f.sha256).read_bytes() == Path(ggufs["big"]).read_bytes()


# ----------------------------------------------------------------------------- bad inputs


def _assert_clean(store: ModelStore):
    """Nothing left behind by a failed pull: no blob, manifest, temporary or partial file, and
    no lock file (issue 17 item 10: every failed pull used to leave one in locks/ for good)."""
    for d in (store.blobs_dir, store.manifests_dir, store.tmp_dir):
        assert not d.exists() or not any(d.rglob("*")), list(d.rglob("*"))
    assert not store.partial_dir.exists() or not list(store.partial_dir.iterdir()), list(store.partial_dir.iterdir())
    assert not store.locks_dir.exists() or not list(store.locks_dir.glob("dl-*")), list(store.locks_dir.iterdir())


def test_hash_mismatch_discards_the_download(repo, tmp_path):
    store = ModelStore(tmp_path / "store")
    repo.repo_file(REPO, "tiny-Q8_0.gguf").lfs_oid = "0" * 64
    with pytest.raises(HashMismatch) as ei:
        pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    assert "sha256 mismatch" in str(ei.value) and "discarded" in str(ei.value)
    _assert_clean(store)


@pytest.mark.parametrize("route,exc,msg", [
    ("/html", NotAModel, "returned an HTML page"),
    ("/missing", PullError, r"not found \(HTTP 404"),
    ("/loop", PullError, "too many redirects"),
    ("/text", NotAModel, "is not a GGUF file"),
])
def test_bad_urls(hf, tmp_path, route, exc, msg):
    store = ModelStore(tmp_path / "store")
    with pytest.raises(exc, match=msg):
        pull_mod.pull(hf.url + route, name="bad", store=store)
    _assert_clean(store)


def test_a_hugging_face_that_cannot_be_reached_is_a_502_with_advice(monkeypatch, tmp_path):
    """No network (a closed port here): not the client's mistake (it was a 400, so the CLI
    exited as misuse), and the way round it is said."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    store = ModelStore(tmp_path / "store")
    with pytest.raises(RegistryUnreachable) as ei:
        pull_mod.pull("hf.co/o/r", store=store)
    assert ei.value.status == 502 and "cannot reach http://127.0.0.1:9" in str(ei.value)
    assert "check the network, or set HF_ENDPOINT to a Hugging Face mirror" in str(ei.value)
    _assert_clean(store)


def test_truncated_gguf_body_is_refused(hf, tmp_path, ggufs):
    store = ModelStore(tmp_path / "store")
    short = tmp_path / "short.gguf"
    short.write_bytes(Path(ggufs["a"]).read_bytes()[:3000])
    hf.add_file("short.gguf", short)
    with pytest.raises(NotAModel, match="truncated"):
        pull_mod.pull(hf.file_url("short.gguf"), store=store)
    _assert_clean(store)


def test_disk_too_small(repo, hf, ggufs, tmp_path, monkeypatch):
    store = ModelStore(tmp_path / "store")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(DiskFull, match="not enough disk space"):
        pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    assert repo.repo_sent(REPO, "tiny-Q8_0.gguf") == 0  # refused before downloading
    hf.add_file("plain.gguf", ggufs["b"])  # size known only from Content-Length
    with pytest.raises(DiskFull):
        pull_mod.pull(hf.file_url("plain.gguf"), store=store)
    _assert_clean(store)


def test_disk_filling_up_during_the_download(hf, ggufs, tmp_path, monkeypatch):
    import errno

    class Full:
        def __init__(self, fh):
            self.fh, self.written = fh, 0

        def write(self, data):
            if self.written > 700_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.fh.write(data)

    real_init = pull_mod._Sink.__init__
    monkeypatch.setattr(pull_mod._Sink, "__init__", lambda self, fh, *a, **k: real_init(self, Full(fh), *a, **k))
    hf.add_file("big.gguf", ggufs["big"])
    store = ModelStore(tmp_path / "store")
    with pytest.raises(DiskFull, match=r"disk filled up.*the [\d.]+ [KM]B written were removed again"):
        pull_mod.pull(hf.file_url("big.gguf"), retries=3, backoff=0.01, store=store)
    assert len(file_requests(hf, "big.gguf")) == 1  # not retried
    assert not store.blob_path(hf.files["big.gguf"].sha256).exists() and store.list() == []
    _assert_clean(store)  # what it wrote is freed: a full disk is not kept full by a partial


def test_the_space_check_asks_for_what_the_download_needs(repo, tmp_path, monkeypatch):
    """A 1.2 MB pull was refused with 29 MB free (it asked for the size plus 64 MiB)."""
    store = ModelStore(tmp_path / "store")
    f = repo.repo_file(REPO, "tiny-Q8_0.gguf")
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(10**12, 10**12 - f.size - (3 << 20), f.size + (3 << 20)))
    e = pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    assert e.model_digest == f.sha256


def test_prune_drops_partial_downloads_but_not_one_in_progress(repo, tmp_path):
    store = ModelStore(tmp_path / "store")
    f = repo.repo_file("owner/big-GGUF", "big-F32.gguf")
    f.drop_after, f.drop_times = f.size // 2, 1
    with pytest.raises(PullError, match="partial download is kept"):
        pull_mod.pull("hf.co/owner/big-GGUF", retries=0, store=store)
    partial = store.partial_dir / f"sha256-{f.sha256}.partial"
    assert partial.stat().st_size == f.size // 2
    assert not list(store.locks_dir.glob("dl-*"))  # the partial is kept, its lock file is not
    busy = store.partial_dir / "sha256-busy.partial"
    busy.write_bytes(b"GGUF" + b"\0" * 100)
    with store.removable_lock("dl-sha256-busy"):  # a pull is writing this one
        removed = store.prune_partials()
    assert [(r["file"], r["bytes"]) for r in removed] == [(str(partial), f.size // 2)]
    assert "big-F32.gguf" in removed[0]["url"]
    assert not partial.exists() and not partial.with_suffix(".json").exists() and busy.exists()
    assert [r["file"] for r in store.prune_partials()] == [str(busy)] and not busy.exists()
    _assert_clean(store)


def test_a_removable_lock_is_exclusive_and_leaves_no_file(tmp_path):
    import threading

    from filelock import Timeout

    store = ModelStore(tmp_path / "store")
    a, b = store.removable_lock("dl-x"), store.removable_lock("dl-x")
    a.acquire()
    with pytest.raises(Timeout):
        b.acquire(timeout=0.05)
    got = threading.Event()
    t = threading.Thread(target=lambda: (b.acquire(), got.set()))
    t.start()
    assert not got.wait(0.2)  # b waits while a holds it
    a.release()  # removes the file b was waiting on: b must lock the file at the path, not the old one
    t.join(10)
    assert got.is_set() and (store.locks_dir / "dl-x.lock").exists()
    c = store.removable_lock("dl-x")
    with pytest.raises(Timeout):
        c.acquire(timeout=0.05)  # b really holds the lock at the path
    b.release()
    assert not (store.locks_dir / "dl-x.lock").exists()
    c.acquire(timeout=1)
    c.release()


def test_connection_refused(tmp_path):
    port = free_port()  # nobody listens there
    store = ModelStore(tmp_path / "store")
    with pytest.raises(PullError, match="Nothing was kept"):
        pull_mod.pull(f"http://127.0.0.1:{port}/m.gguf", retries=1, backoff=0.01, store=store)
    _assert_clean(store)


def test_a_host_that_never_answers_is_said_to_be_retried(tmp_path):
    """A host that takes the connection and says nothing: each timeout is a status (the
    client would otherwise wait out every try in silence), then the error."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    store = ModelStore(tmp_path / "store")
    said: list[str] = []
    try:
        with pytest.raises(PullError, match=r"failed after 0 bytes: timed out \(tried 2 times\)"):
            pull_mod.pull(f"http://127.0.0.1:{silent.getsockname()[1]}/m.gguf", None,
                          lambda d: said.append(d["status"]), retries=1, backoff=0.01, timeout=0.3, store=store)
    finally:
        silent.close()
    assert said == ["pulling manifest", "download of m.gguf: timed out; trying again (try 2 of 2)"]
    _assert_clean(store)


def test_bad_name_is_refused_before_any_request(repo, tmp_path):
    with pytest.raises(InvalidName):
        pull_mod.pull(f"hf.co/{REPO}", name="no/such/thing/here", store=ModelStore(tmp_path / "store"))
    assert repo.requests == []


def test_a_pulled_model_can_be_removed(repo, tmp_path):
    store = ModelStore(tmp_path / "store")
    pull_mod.pull(f"hf.co/{REPO}", store=store)
    asyncio.run(store.remove(f"hf.co/{REPO}"))
    assert os.listdir(store.blobs_dir) == [] and store.list() == []


def test_a_url_pull_does_not_replace_a_model_of_the_same_name_from_elsewhere(hf, ggufs, tmp_path):
    store = ModelStore(tmp_path / "store")
    hf.add_file("tiny-model.gguf", ggufs["b"])
    store.create("tiny-model", ggufs["a"])  # registered from a local file, under the name the URL would make
    with pytest.raises(PullError, match=r"a model named tiny-model:latest already exists .*--name"):
        pull_mod.pull(hf.file_url("tiny-model.gguf"), store=store)
    assert store.resolve_sync("tiny-model").path.endswith(sha256(ggufs["a"])), "untouched"
    pulled = pull_mod.pull(hf.file_url("tiny-model.gguf"), name="tiny-remote", store=store)
    assert pulled.display == "tiny-remote:latest"
    store.remove_sync("tiny-model")
    pull_mod.pull(hf.file_url("tiny-model.gguf"), store=store)
    assert pull_mod.pull(hf.file_url("tiny-model.gguf"), store=store).display == "tiny-model:latest", \
        "the same URL again under the name it made: an update"
