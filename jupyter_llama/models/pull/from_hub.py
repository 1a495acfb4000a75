"""Pulling from Hugging Face: the repo's listing (the Hub's tree API, paged), the GGUF chosen
from it by quantisation tag (:func:`choose_files`), and the files to fetch with the sha256 the
Hub states for them.

The Hub is ``HF_ENDPOINT`` (default https://huggingface.co); the token (``HF_TOKEN``, else the
one ``huggingface-cli login`` saved) is sent as a bearer token to it, and to nothing else.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from .download import Credentials
from .errors import PullError, RegistryUnreachable
from .http_client import Http
from .sources import RemoteFile, Source, quant_of

__all__ = ["DEFAULT_QUANT_ORDER", "PROJECTOR_PREFERENCE", "HubToken", "choose_files", "hub_plan"]

DEFAULT_QUANT_ORDER = ("Q4_K_M", "Q4_0", "Q8_0")
PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")
MAX_LISTING_BYTES = 64 << 20
MAX_LISTING_PAGES = 1000


class HubToken(Credentials):
    """The Hugging Face token, sent to the Hub only (the opener drops it on a redirect to
    another origin, such as the Hub's CDN)."""

    refused_hint = "; the repository may be gated or private: set HF_TOKEN to a token that can read it"

    def __init__(self, token: str | None):
        self.token = token

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


# ----------------------------------------------------------------------------- choosing files

def _is_projector(path: str) -> bool:
    return "mmproj" in path.rsplit("/", 1)[-1].lower()


def _split_part(path: str) -> tuple[int, int] | None:
    m = re.search(r"(?i)-(\d{5})-of-(\d{5})\.gguf$", path)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _matches_tag(path: str, tag: str) -> bool:
    stem = re.sub(r"(?i)\.gguf$", "", path)
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    return re.search(rf"(?i)(?:^|[^A-Za-z0-9]){re.escape(tag)}(?=$|[-./])", stem) is not None


def _describe_files(files: list[dict]) -> str:
    out = []
    for f in sorted(files, key=lambda f: f["path"]):
        q = quant_of(f["path"])
        out.append(f"{f['path']}" + (f" ({q})" if q else ""))
    return ", ".join(out)


def choose_files(entries: list[dict], quant: str | None, repo: str = "", file: str | None = None
                 ) -> tuple[dict, dict | None]:
    """Pick (model file, projector file or None) from a Hub tree listing.

    ``quant`` matches a tag in the file name, case-insensitively (``Q4_K_M`` matches
    ``model-Q4_K_M.gguf`` but not ``model-Q4_K_M_L.gguf``), or a whole file name. Without
    one: Q4_K_M, then Q4_0, then Q8_0, then the smallest GGUF. The projector is the f16
    ``mmproj*.gguf`` (or the only one).
    """
    files = [e for e in entries if e.get("type", "file") == "file" and str(e.get("path", "")).lower().endswith(".gguf")]
    models = [e for e in files if not _is_projector(e["path"])]
    projectors = [e for e in files if _is_projector(e["path"])]
    where = f" in {repo}" if repo else ""
    if file is not None:
        hit = next((e for e in files if e["path"] == file), None)
        if hit is None:
            raise PullError(f"no file {file!r}{where}; GGUF files there: {_describe_files(files) or 'none'}")
        chosen = hit
    else:
        if not models:
            raise PullError(f"no GGUF model file{where}" + (f" (only projectors: {_describe_files(projectors)})"
                                                            if projectors else ""))
        firsts = [e for e in models if (_split_part(e["path"]) or (1, 1))[0] == 1]
        if quant:
            exact = [e for e in models if e["path"].lower() == quant.lower()
                     or e["path"].rsplit("/", 1)[-1].lower() in (quant.lower(), quant.lower() + ".gguf")]
            hits = exact or [e for e in firsts if _matches_tag(e["path"], quant)]
            if not hits:
                raise PullError(f"no GGUF matching {quant!r}{where}; it has: {_describe_files(models)}")
            if len(hits) > 1:
                raise PullError(f"{quant!r} is ambiguous{where}: {_describe_files(hits)}; "
                                f"give the whole file name as the tag")
            chosen = hits[0]
        else:
            by_default: dict | None = None
            for q in DEFAULT_QUANT_ORDER:
                hits = [e for e in firsts if _matches_tag(e["path"], q)]
                if hits:
                    by_default = min(hits, key=lambda e: (_size_of(e), e["path"]))
                    break
            chosen = by_default if by_default is not None else min(firsts or models,
                                                                    key=lambda e: (_size_of(e), e["path"]))
    part = _split_part(chosen["path"])
    if part is not None:
        raise PullError(f"{chosen['path']} is one of {part[1]} parts of a split GGUF, which the store cannot hold "
                        f"yet; merge the parts with `llama-gguf-split --merge` and create the model from the result")
    projector: dict | None = None
    if file is None and projectors:
        if len(projectors) == 1:
            projector = projectors[0]
        else:
            def rank(e: dict) -> tuple[int, str]:
                stem = e["path"].rsplit("/", 1)[-1].lower()
                for i, p in enumerate(PROJECTOR_PREFERENCE):
                    if re.search(rf"(?:^|[^a-z0-9]){p}(?=$|[-._])", stem):
                        return (i, e["path"])
                return (len(PROJECTOR_PREFERENCE), e["path"])
            projector = min(projectors, key=rank)
    return chosen, projector


def _size_of(e: dict) -> int:
    lfs = e.get("lfs") or {}
    return int(lfs.get("size") or e.get("size") or 0)




# ----------------------------------------------------------------------------- the Hub's API


def _json(http: Http, url: str, what: str, endpoint: str, token: HubToken) -> tuple[object, str | None]:
    """The JSON document at ``url`` on the Hub, and the URL of its next page (a ``Link``
    header's ``rel="next"``) if any."""
    try:
        r = http.open(url, {**token.headers(), "Accept": "application/json"})
    except PullError:
        raise
    except OSError as e:
        raise RegistryUnreachable(f"cannot reach {endpoint} for {what}: {e}; check the network, or "
                                  "set HF_ENDPOINT to a Hugging Face mirror") from None
    try:
        body = r.read(MAX_LISTING_BYTES)
    except OSError as e:
        raise PullError(f"connection to {endpoint} broke while listing {what}: {e}") from None
    finally:
        r.close()
    if r.status in (401, 403):
        raise PullError(f"access to {what} denied (HTTP {r.status}); the repository may be gated or private: "
                        f"set HF_TOKEN to a token that can read it")
    if r.status == 404:
        raise PullError(f"{what} not found on {endpoint} (HTTP 404)")
    if r.status >= 400:
        raise PullError(f"listing {what} failed: HTTP {r.status} {r.reason}")
    try:
        data = json.loads(body)
    except ValueError:
        raise PullError(f"listing {what}: {endpoint} did not answer with JSON "
                        f"(Content-Type {r.content_type or 'none'})") from None
    link = r.header("Link") or ""
    m = re.search(r'<([^>]+)>\s*;\s*rel="?next"?', link)
    return data, (urllib.parse.urljoin(url, m.group(1)) if m else None)


def _tree(http: Http, src: Source, token: HubToken) -> list[dict]:
    """Every file of the repo at the source's revision (the tree API, all its pages)."""
    repo_id = src.repo_id
    repo = "/".join(urllib.parse.quote(p, safe="") for p in repo_id.split("/"))
    url: str | None = (f"{src.endpoint}/api/models/{repo}/tree/{urllib.parse.quote(src.revision, safe='')}"
                       f"?recursive=true")
    entries: list[dict] = []
    pages = 0
    while url:
        data, url = _json(http, url, f"repository {repo_id}", src.endpoint, token)
        if not isinstance(data, list):
            raise PullError(f"unexpected answer listing {repo_id}: expected a list of files")
        entries += [e for e in data if isinstance(e, dict) and isinstance(e.get("path"), str)]
        pages += 1
        if pages > MAX_LISTING_PAGES:
            raise PullError(f"listing {repo_id}: too many pages")
    return entries


def hub_plan(http: Http, src: Source, token: HubToken) -> tuple[list[RemoteFile], dict[str, Any]]:
    """The files to fetch for a Hugging Face source (the model, and its projector if the repo
    has one), and the record of where they came from that the model's manifest keeps."""
    repo_id = src.repo_id
    entries = _tree(http, src, token)
    model, projector = choose_files(entries, src.quant, repo_id, src.file)
    repo_q = "/".join(urllib.parse.quote(p, safe="") for p in repo_id.split("/"))
    rev_q = urllib.parse.quote(src.revision, safe="")

    def remote(e: dict, role: str) -> RemoteFile:
        lfs = e.get("lfs") or {}
        sha = lfs.get("oid") if isinstance(lfs.get("oid"), str) else None
        if sha and sha.startswith("sha256:"):
            sha = sha[7:]
        if sha and not re.fullmatch(r"[0-9a-f]{64}", sha):
            sha = None
        size = lfs.get("size", e.get("size"))
        url = f"{src.endpoint}/{repo_q}/resolve/{rev_q}/{urllib.parse.quote(e['path'])}"
        return RemoteFile(url=url, path=e["path"], role=role, size=int(size) if size is not None else None,
                          sha256=sha, auth=True, hf_repo=repo_id)

    files = [remote(model, "model")]
    record: dict[str, Any] = {"type": "hf", "repo": repo_id, "revision": src.revision, "file": model["path"],
                              "quant": src.quant or quant_of(model["path"]), "endpoint": src.endpoint,
                              "url": files[0].url}
    if src.file:
        record["quant"] = quant_of(src.file)
    if projector is not None:
        files.append(remote(projector, "projector"))
        record["projector_file"] = projector["path"]
    return files, record
