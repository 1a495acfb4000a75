"""What ``huggingface_hub`` left on this machine: its download cache and its login token.

We read them; we never write them, and we do not need ``huggingface_hub`` installed.

The cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub``) holds, per repo::

    models--OWNER--REPO/blobs/<etag>                  the files' bytes
    models--OWNER--REPO/snapshots/<revision>/<path>   symlinks into blobs/
    models--OWNER--REPO/refs/<branch>                 the revision a branch pointed at

A file stored with Git LFS (every GGUF of any size) has the LFS object's sha256 as its
etag, so its blob is named by the same sha256 the Hub's tree listing states; other files
are named by another etag. :func:`cached_copies` offers, for a file we are about to pull,
the cached files that may hold its bytes; the caller hashes one before it trusts it.

The token is ``HF_TOKEN`` (or the older ``HUGGING_FACE_HUB_TOKEN``), else the file
``huggingface-cli login`` writes (``HF_TOKEN_PATH``, else ``HF_HOME/token``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

__all__ = ["hf_home", "hub_cache", "hf_token", "cached_copies"]

_HEX = re.compile(r"^[0-9a-f]{64}$")


def hf_home() -> Path:
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expanduser(home))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface"


def hub_cache() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expanduser(explicit)) if explicit else hf_home() / "hub"


def hf_token() -> str | None:
    """The token ``huggingface_hub`` would send, or None."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = (os.environ.get(var) or "").strip()
        if value:
            return value
    path = os.environ.get("HF_TOKEN_PATH") or str(hf_home() / "token")
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            value = fh.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None


def _repo_dir(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def cached_copies(repo: str, path: str, sha256: str, size: int | None = None) -> Iterator[Path]:
    """Cached files that may hold ``repo``'s file ``path`` (sha256 ``sha256``, ``size`` bytes),
    most likely first: the blob named by that sha256 in this repo's cache, then in any other
    repo's (a fork, a re-upload), then whatever a snapshot of this repo has at ``path``. Only
    regular files of the right size are offered; each path is offered once."""
    if not _HEX.match(sha256 or ""):
        return
    cache = hub_cache()
    if not cache.is_dir():
        return
    seen: set[str] = set()

    def offer(p: Path) -> Path | None:
        try:
            real = os.path.realpath(p)
            st = os.stat(real)
        except OSError:
            return None
        if real in seen or not os.path.isfile(real) or (size is not None and st.st_size != size):
            return None
        seen.add(real)
        return Path(real)

    mine = _repo_dir(cache, repo)
    hit = offer(mine / "blobs" / sha256)
    if hit:
        yield hit
    try:
        others = sorted(e.path for e in os.scandir(cache) if e.name.startswith("models--") and e.path != str(mine))
    except OSError:
        others = []
    for other in others:
        hit = offer(Path(other) / "blobs" / sha256)
        if hit:
            yield hit
    snapshots = mine / "snapshots"
    try:
        revisions = sorted(os.scandir(snapshots), key=lambda e: e.name)
    except OSError:
        revisions = []
    rel = Path(*[p for p in path.split("/") if p not in ("", ".", "..")])
    for rev in revisions:
        hit = offer(Path(rev.path) / rel)
        if hit:
            yield hit
