"""What a pull fetches, from what the user typed: :func:`parse_source` sorts a source into an
Ollama registry name, a Hugging Face repo (or one file of it) or a plain http(s) URL, and
:func:`derive_name` says the name its model is filed under. No network here.

:class:`RemoteFile` is one file a source's plan fetches (see :mod:`.from_hub` and
:mod:`.from_registry`).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass

from .. import registry
from ..names import DEFAULT_TAG, InvalidName, ModelName, parse_name, plainly_a_path
from .errors import PullError

__all__ = ["DEFAULT_ENDPOINT", "Source", "RemoteFile", "parse_source", "derive_name", "quant_of"]

DEFAULT_ENDPOINT = "https://huggingface.co"

_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Source:
    """A pull source, parsed. ``kind`` says which fields are set: "registry" (``ref``; ``url`` is
    its manifest URL), "hf" (``repo``, and ``quant`` or ``file``) or "url" (``url``)."""

    kind: str  # "hf" | "url" | "registry"
    text: str
    url: str | None = None  # kind == "url"
    repo: str | None = None  # kind == "hf": OWNER/REPO
    quant: str | None = None  # the tag asked for, if any
    file: str | None = None  # an explicit file in the repo
    revision: str = "main"
    endpoint: str = DEFAULT_ENDPOINT
    ref: registry.RegistryRef | None = None  # kind == "registry"

    # What a kind always has, typed as such (a ValueError for a source of another kind).

    @property
    def registry_ref(self) -> registry.RegistryRef:
        """The registry name of a "registry" source."""
        if self.ref is None:
            raise ValueError(f"{self.text!r} is not a registry name")
        return self.ref

    @property
    def repo_id(self) -> str:
        """OWNER/REPO of a Hugging Face ("hf") source."""
        if self.repo is None:
            raise ValueError(f"{self.text!r} is not a Hugging Face repo")
        return self.repo

    @property
    def address(self) -> str:
        """The URL of a "url" source (a "registry" source's manifest URL)."""
        if self.url is None:
            raise ValueError(f"{self.text!r} has no URL")
        return self.url


def _endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _hf_source(text: str, rest: str, endpoint: str) -> Source:
    rest = rest.strip("/")
    segs = rest.split("/")
    quant = None
    file = None
    revision = "main"
    if len(segs) >= 5 and segs[2] in ("resolve", "blob"):
        revision = urllib.parse.unquote(segs[3])
        file = urllib.parse.unquote("/".join(segs[4:]))
        segs = segs[:2]
    if len(segs) != 2:
        raise PullError(f"not a Hugging Face model source: {text!r}; the form is hf.co/OWNER/REPO[:QUANT]")
    owner, repo = segs
    if ":" in repo:
        repo, quant = repo.split(":", 1)
        if not quant:
            raise PullError(f"empty quantisation tag after ':' in {text!r}")
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", quant):
            raise PullError(f"bad quantisation tag {quant!r} in {text!r}")
    for part in (owner, repo):
        if not _HF_PART.match(part) or ".." in part:
            raise PullError(f"bad Hugging Face repo id {owner}/{repo!r} in {text!r}: "
                            f"use letters, digits, '-', '_' and '.'")
    return Source("hf", text, repo=f"{owner}/{repo}", quant=quant, file=file, revision=revision, endpoint=endpoint)


def parse_source(text: str, endpoint: str | None = None, insecure: bool = False) -> Source:
    """Classify a pull source. Raises PullError for anything that is neither a URL nor a repo."""
    if not isinstance(text, str) or not text.strip():
        raise PullError("nothing to pull: give an http(s) URL or hf.co/OWNER/REPO[:QUANT]")
    t = text.strip()
    ep = _endpoint(endpoint)
    low = t.lower()
    if low.startswith("hf://"):
        return _hf_source(t, t[5:], ep)
    for prefix in ("hf.co/", "huggingface.co/"):
        if low.startswith(prefix):
            return _hf_source(t, t[len(prefix):], ep)
    if low.startswith(("http://", "https://")):
        u = urllib.parse.urlsplit(t)
        if not u.hostname:
            raise PullError(f"bad URL {t!r}: no host")
        host = u.hostname.lower()
        if host in ("huggingface.co", "www.huggingface.co", "hf.co"):
            return _hf_source(t, u.path, ep)
        if t.startswith(ep + "/") and ep != DEFAULT_ENDPOINT:
            # a file URL on a custom Hub endpoint: OWNER/REPO/resolve/REV/FILE
            segs = urllib.parse.urlsplit(t[len(ep):]).path.strip("/").split("/")
            if len(segs) >= 5 and segs[2] in ("resolve", "blob"):
                return _hf_source(t, "/".join(segs), ep)
        return Source("url", t, url=t, endpoint=ep)
    if "://" in t:
        raise PullError(f"cannot pull {t!r}: only http(s) URLs are fetched; give an http(s) URL of a GGUF file, "
                        f"a Hugging Face repo (hf.co/OWNER/REPO[:QUANT]) or a registry name such as llama3.2:1b")
    if plainly_a_path(t):
        raise PullError(f"{t!r} looks like a file on this machine, which is not pulled: register it with "
                        f"`create NAME --from {t}`")
    try:
        ref = registry.parse_registry_name(t, insecure=insecure)
    except InvalidName as e:
        raise PullError(f"cannot pull {t!r}: {e.reason}; give a registry name ([host/][namespace/]model[:tag], "
                        f"such as llama3.2:1b), a Hugging Face repo (hf.co/OWNER/REPO[:QUANT]) or an http(s) URL "
                        f"of a GGUF file") from None
    return Source("registry", t, url=ref.manifest_url, endpoint=ref.base, ref=ref)


_QUANT_TOKEN = re.compile(
    r"(?i)(?:^|[^A-Za-z0-9])((?:I?Q[1-8](?:_[A-Z0-9]+)*)|(?:B?F16)|F32|FP16|MXFP4(?:_MOE)?|TQ[12]_0)(?=$|[-.])")


def quant_of(path: str) -> str | None:
    stem = re.sub(r"(?i)(-\d{5}-of-\d{5})?\.gguf$", "", path.rsplit("/", 1)[-1])
    found = _QUANT_TOKEN.findall(stem)
    return found[-1].upper() if found else None


def sanitize_model(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
    s = re.sub(r"\.{2,}", ".", s)
    s = s.lstrip(".-")
    return s[:96].rstrip(".-")


def derive_name(src: Source | str, name: str | None = None) -> ModelName:
    """The name a pull files its model under (``name`` if given). No network."""
    if isinstance(src, str):
        src = parse_source(src)
    if name:
        return parse_name(name)
    if src.kind == "registry":
        return src.registry_ref.name
    if src.kind == "hf":
        owner, repo = src.repo_id.split("/")
        tag = src.quant
        if tag is None and src.file:
            tag = quant_of(src.file) or sanitize_model(re.sub(r"(?i)\.gguf$", "", src.file.rsplit("/", 1)[-1]))
        text = f"hf.co/{owner}/{repo}:{tag or DEFAULT_TAG}"
        try:
            return parse_name(text)
        except InvalidName as e:
            raise PullError(f"cannot file {src.text!r} as {text!r} ({e.reason}); give a name to pull it as") from None
    url = src.address
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    base = path.rstrip("/").rsplit("/", 1)[-1]
    base = re.sub(r"(?i)\.gguf$", "", base)
    model = sanitize_model(base)
    try:
        return parse_name(f"{model}:{DEFAULT_TAG}")
    except InvalidName:
        raise PullError(f"cannot make a model name from the URL {url!r}; give a name to pull it as") from None



@dataclass
class RemoteFile:
    url: str
    path: str  # name in the repo (or the URL's file name, or the registry layer's description)
    role: str  # "model" | "projector" | a preset part: "template", "system", "params", "license", "messages"
    size: int | None = None
    sha256: str | None = None
    auth: bool = False  # send the source's credentials: the HF token to the Hub, a registry's pull token to it
    media_type: str | None = None  # the manifest layer's (default: by role, model or projector)
    hf_repo: str | None = None  # a Hub file: OWNER/REPO, whose Hugging Face cache may already hold it

    @property
    def gguf(self) -> bool:
        return self.role in ("model", "projector")
