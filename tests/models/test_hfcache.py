"""A GGUF already in the Hugging Face cache is linked into the store, not downloaded again.

The cache is built here as ``huggingface_hub`` writes it (data, not a mock):
``hub/models--OWNER--REPO/blobs/<etag>``, ``snapshots/<rev>/<file>`` symlinks into it,
``refs/main``.
"""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from jupyter_llama.models import hfcache
from jupyter_llama.models import pull as pull_mod
from jupyter_llama.models.pull import PullError
from jupyter_llama.models.store import ModelStore

REPO = "owner/tiny-GGUF"
REV = "0123456789abcdef0123456789abcdef01234567"


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_file(home: Path, repo: str, rpath: str, src, blob_name: str | None = None, rev: str = REV) -> Path:
    """Put ``src`` into the cache under ``home`` as huggingface_hub does; the blob's path."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(rev)
    blob = root / "blobs" / (blob_name or sha256(src))
    shutil.copyfile(src, blob)
    link = root / "snapshots" / rev / rpath
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return blob


def file_requests(srv, repo, rpath):
    fid = srv.repos[repo].files[rpath]
    return [r for r in srv.requests if r[1].startswith("/files/") and fid in r[1]]


@pytest.fixture
def repo(hf, ggufs, projectors):
    hf.add_repo(REPO, {"tiny-Q8_0.gguf": ggufs["q8"], "tiny-Q4_K_M.gguf": ggufs["q4"],
                       "mmproj-tiny-f16.gguf": projectors["f16"]})
    return hf


def test_a_cached_file_is_linked_and_not_downloaded(repo, ggufs, projectors, tmp_path):
    home = Path(os.environ["HF_HOME"])
    blob = cache_file(home, REPO, "tiny-Q8_0.gguf", ggufs["q8"])
    store = ModelStore(tmp_path / "store")
    events = []
    e = pull_mod.pull(f"hf.co/{REPO}:Q8_0", progress=events.append, store=store)
    assert e.model_digest == sha256(ggufs["q8"])
    assert repo.repo_sent(REPO, "tiny-Q8_0.gguf") == 0 and file_requests(repo, REPO, "tiny-Q8_0.gguf") == []
    assert not [r for r in repo.requests if "/resolve/" in r[1] and "tiny-Q8_0" in r[1]]
    assert os.stat(store.blob_path(e.model_digest)).st_ino == os.stat(blob).st_ino  # a hard link, no copy
    assert blob.read_bytes() == Path(ggufs["q8"]).read_bytes()  # the cache is left as it was
    # the projector was not in the cache: downloaded as usual
    assert repo.repo_sent(REPO, "mmproj-tiny-f16.gguf") == os.path.getsize(projectors["f16"])
    assert any("from the Hugging Face cache" in ev["status"] for ev in events)
    done = [ev for ev in events if ev.get("digest") == f"sha256:{e.model_digest}" and "completed" in ev]
    assert done[-1]["completed"] == done[-1]["total"] == os.path.getsize(ggufs["q8"])
    assert store.show(e.display, verify=True)["verify"]["ok"]
    assert list(store.partial_dir.iterdir()) == [] and os.listdir(store.tmp_dir) == []


def test_a_cached_file_is_found_under_another_blob_name_and_in_another_repo(repo, ggufs, tmp_path):
    home = Path(os.environ["HF_HOME"])
    cache_file(home, REPO, "tiny-Q8_0.gguf", ggufs["q8"], blob_name="not-a-sha256-etag")  # found by its snapshot
    cache_file(home, "someone/fork-GGUF", "renamed.gguf", ggufs["q4"])  # same bytes, another repo
    store = ModelStore(tmp_path / "store")
    pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    pull_mod.pull(f"hf.co/{REPO}:Q4_K_M", store=store)
    assert repo.repo_sent(REPO, "tiny-Q8_0.gguf") == 0 and repo.repo_sent(REPO, "tiny-Q4_K_M.gguf") == 0


def test_a_cached_file_with_other_bytes_is_not_used(repo, ggufs, tmp_path):
    home = Path(os.environ["HF_HOME"])
    wrong = tmp_path / "wrong.gguf"
    data = bytearray(Path(ggufs["q8"]).read_bytes())
    data[-1] ^= 0xFF
    wrong.write_bytes(bytes(data))
    blob = cache_file(home, REPO, "tiny-Q8_0.gguf", wrong, blob_name=sha256(ggufs["q8"]))  # named right, not so
    store = ModelStore(tmp_path / "store")
    events = []
    e = pull_mod.pull(f"hf.co/{REPO}:Q8_0", progress=events.append, store=store)
    assert repo.repo_sent(REPO, "tiny-Q8_0.gguf") == os.path.getsize(ggufs["q8"])
    assert store.blob_path(e.model_digest).read_bytes() == Path(ggufs["q8"]).read_bytes()
    assert os.stat(store.blob_path(e.model_digest)).st_ino != os.stat(blob).st_ino
    assert blob.read_bytes() == bytes(data)
    assert any("its sha256 differs" in ev["status"] for ev in events)


def test_hub_cache_location_follows_huggingface_hubs_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hfcache.hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hfcache.hub_cache() == tmp_path / "elsewhere"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hfcache.hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"


def test_the_token_huggingface_cli_login_saved_is_used(repo, tmp_path):
    repo.require_token = "hf_from_login"
    store = ModelStore(tmp_path / "store")
    with pytest.raises(PullError, match="gated or private"):
        pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store)
    home = Path(os.environ["HF_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "token").write_text("hf_from_login\n")
    assert pull_mod.pull(f"hf.co/{REPO}:Q8_0", store=store).display.endswith(":Q8_0")
