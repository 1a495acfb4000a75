"""Ollama's registry protocol, the parts that need no network: names, URLs and manifests.

What ``ollama pull llama3.2:1b`` does (REFERENCE.md, section 10); :mod:`.pull` does the
transfers with the same machinery as its other sources (resume, retries, digests, dedupe).

* A name is ``[host/][namespace/]model[:tag]``. Without a host it comes from the configured
  registry (``JUPYTER_LLAMA_REGISTRY``, default ``https://registry.ollama.ai``; see
  :func:`.names.registry_url`), namespace ``library``, tag ``latest``. A name with a host is
  fetched from ``https://HOST``, or from the configured URL when it is that registry's host
  (so an ``http://`` registry is reached only when it is configured).
* The model is filed under the registry's host, as Ollama files it: ``llama3.2:1b`` becomes
  ``registry.ollama.ai/library/llama3.2:1b`` (``manifests/registry.ollama.ai/library/llama3.2/1b``).
* ``GET BASE/v2/NAMESPACE/MODEL/manifests/TAG`` with ``Accept:`` :data:`MANIFEST_V2` answers
  ``{schemaVersion: 2, mediaType, config: {mediaType, digest, size}, layers: [...]}``; each
  layer is a blob at ``BASE/v2/NAMESPACE/MODEL/blobs/sha256:HEX`` (the registry redirects to
  a content server), whose sha256 must be its digest.
* Layers by media type: the GGUF (``application/vnd.ollama.image.model``), a multimodal
  projector (``.projector``), and the preset (``.template``, ``.system``, ``.params``,
  ``.license``, ``.messages``: see :mod:`.preset`), which the store keeps as the same layers.
  A LoRA ``.adapter`` is refused (the store cannot apply one); a layer of a media type we do
  not know is skipped and named in the model's source record. The config blob is not
  fetched: everything it says is in the GGUF; its digest is recorded.
* A registry that hands out pull tokens (Docker's token protocol: Docker Hub, GHCR, Harbor,
  a distribution registry with token auth) answers the first request with a 401 and
  ``WWW-Authenticate: Bearer realm="URL",service="...",scope="repository:NS/MODEL:pull"``;
  ``GET URL?service=...&scope=...`` answers ``{"token": "..."}`` (or ``access_token``), sent
  back as ``Authorization: Bearer`` to the registry, never across a redirect to its content
  server. Asked without credentials (:func:`bearer_challenge`, :func:`token_url`): a public
  model's anonymous token; a private model's login (Ollama's signed keys) is not done. A
  registry reached over TLS has its token service reached over TLS too (:func:`tls_kept`).
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from dataclasses import dataclass, field

from ..errors import BadRequest
from .names import DEFAULT_HOST, DEFAULT_NAMESPACE, InvalidName, ModelName, parse_name, registry_host, registry_url
from .preset import MAX_LAYER_BYTES, PRESET_MEDIA_TYPES
from .store import MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE

__all__ = [
    "bearer_challenge",
    "token_url",
    "tls_kept",
    "MANIFEST_V2",
    "ADAPTER_MEDIA_TYPE",
    "MAX_MANIFEST_BYTES",
    "ManifestError",
    "UnsupportedModel",
    "RegistryRef",
    "ManifestLayer",
    "Manifest",
    "parse_registry_name",
    "parse_manifest",
]

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"  # the same shape, under OCI's name
MANIFEST_LISTS = ("application/vnd.docker.distribution.manifest.list.v2+json",
                  "application/vnd.oci.image.index.v1+json")
ADAPTER_MEDIA_TYPE = "application/vnd.ollama.image.adapter"
MAX_MANIFEST_BYTES = 4 << 20  # a real one is well under 4 KiB
_ROLES = {MODEL_MEDIA_TYPE: "model", PROJECTOR_MEDIA_TYPE: "projector", **PRESET_MEDIA_TYPES}
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


class ManifestError(ValueError):
    """The registry answered with something that is not a usable v2 manifest."""


class UnsupportedModel(ValueError):
    """A well-formed manifest for a model the store cannot hold (an adapter, no GGUF ...)."""


@dataclass(frozen=True)
class RegistryRef:
    """A model in a registry: the name it is filed under here, and where to fetch it."""

    name: ModelName  # host = the registry's host
    base: str  # scheme://host[:port][/prefix], no trailing '/'

    def _path(self) -> str:
        return f"{urllib.parse.quote(self.name.namespace, safe='')}/{urllib.parse.quote(self.name.model, safe='')}"

    @property
    def manifest_url(self) -> str:
        return f"{self.base}/v2/{self._path()}/manifests/{urllib.parse.quote(self.name.tag, safe='')}"

    def blob_url(self, hexd: str) -> str:
        return f"{self.base}/v2/{self._path()}/blobs/sha256:{hexd}"

    @property
    def text(self) -> str:
        """How a person names it: ``llama3.2:1b`` for the configured registry's library,
        else with every part that differs from the defaults."""
        n = self.name
        short = f"{n.model}:{n.tag}" if n.namespace.lower() == DEFAULT_NAMESPACE else f"{n.namespace}/{n.model}:{n.tag}"
        try:
            here = registry_host()
        except BadRequest:
            here = None
        return short if n.host.lower() == here else n.full


def parse_registry_name(text: str, registry: str | None = None, insecure: bool = False) -> RegistryRef:
    """``[host/][namespace/]model[:tag]`` -> where to fetch it and what to file it as.

    ``registry``: the configured registry URL (default :func:`.names.registry_url`).
    ``insecure`` (Ollama's pull option): a name with a host of its own is fetched over plain
    http (a registry on a private network without TLS); without it, https.
    InvalidName (HTTP 400) for a name outside the grammar, or one naming this machine.
    """
    base = (registry or registry_url()).rstrip("/")
    t = text.strip()
    colon, slash = t.rfind(":"), t.rfind("/")
    rest = t[:colon] if colon > slash else t
    explicit_host = rest.count("/") == 2
    name = parse_name(t)
    if explicit_host:
        if name.host.lower() == DEFAULT_HOST:
            raise InvalidName(text, f"the host {DEFAULT_HOST!r} names models made on this machine; "
                                    "there is nothing to pull from it")
        if name.host.lower() != registry_host(base):
            base = f"{'http' if insecure else 'https'}://{name.host.lower()}"
        return RegistryRef(name, base)
    return RegistryRef(ModelName(registry_host(base), name.namespace, name.model, name.tag), base)


@dataclass
class ManifestLayer:
    media_type: str
    hexd: str
    size: int
    role: str  # model, projector, template, system, params, license, messages


@dataclass
class Manifest:
    layers: list[ManifestLayer]  # the ones the store keeps, in the manifest's order
    digest: str  # sha256 hex of the manifest's bytes (the registry's Docker-Content-Digest)
    config: dict | None = None  # {mediaType, digest, size}
    skipped: list[str] = field(default_factory=list)  # media types of layers not kept


def parse_manifest(body: bytes, content_type: str = "", what: str = "the manifest") -> Manifest:
    """The layers of a v2 manifest. ManifestError when it is not one (schema 1, a manifest
    list, HTML, a layer without a sha256 digest ...); UnsupportedModel when it is one but of
    a model the store cannot hold."""
    ct = (content_type or "").split(";")[0].strip().lower()
    try:
        doc = json.loads(body)
    except ValueError:
        shown = f"Content-Type {ct}" if ct else "no Content-Type"
        raise ManifestError(f"{what} is not JSON ({shown}): the registry did not answer with a v2 manifest") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{what} is not a JSON object, so not a v2 manifest")
    media = doc.get("mediaType") or ct
    if media in MANIFEST_LISTS:
        raise ManifestError(f"{what} is a manifest list ({media}), not a v2 manifest of one model")
    version = doc.get("schemaVersion")
    if version != 2 or not isinstance(doc.get("layers"), list):
        raise ManifestError(f"{what} is not a v2 manifest (schemaVersion {version!r}"
                            + ("" if isinstance(doc.get("layers"), list) else ", no layers list") + ")")
    if doc.get("mediaType") and doc["mediaType"] not in (MANIFEST_V2, OCI_MANIFEST):
        raise ManifestError(f"{what} has media type {doc['mediaType']!r}, not {MANIFEST_V2}")
    kept: list[ManifestLayer] = []
    skipped: list[str] = []
    for i, ly in enumerate(doc["layers"]):
        if not isinstance(ly, dict):
            raise ManifestError(f"{what}: layer {i} is not an object")
        mt, dg, size = ly.get("mediaType"), ly.get("digest"), ly.get("size")
        m = _DIGEST.match(dg) if isinstance(dg, str) else None
        if not isinstance(mt, str) or not mt or m is None or isinstance(size, bool) or not isinstance(size, int) \
                or size < 0:
            raise ManifestError(f"{what}: layer {i} lacks a media type, a sha256:<64 hex> digest or a size "
                                f"({json.dumps(ly)[:160]})")
        if mt == ADAPTER_MEDIA_TYPE:
            raise UnsupportedModel(f"{what} has a LoRA adapter layer, which jupyter-llama cannot apply; "
                                   "merge the adapter into the GGUF (llama.cpp's llama-export-lora) and create "
                                   "the model from that file")
        role = _ROLES.get(mt)
        if role is None:
            skipped.append(mt)
            continue
        if role in PRESET_MEDIA_TYPES.values() and size > MAX_LAYER_BYTES:
            raise ManifestError(f"{what}: its {role} layer is {size:,} bytes, more than a preset layer may be")
        kept.append(ManifestLayer(mt, m.group(1), size, role))
    models = [ly for ly in kept if ly.role == "model"]
    if not models:
        kinds = ", ".join(sorted({ly.media_type for ly in kept} | set(skipped))) or "none"
        raise UnsupportedModel(f"{what} has no GGUF model layer ({MODEL_MEDIA_TYPE}); its layers: {kinds}")
    if len(models) > 1:
        raise UnsupportedModel(f"{what} has {len(models)} model layers; the store holds a model of one GGUF file")
    if sum(ly.role == "projector" for ly in kept) > 1:
        raise UnsupportedModel(f"{what} has more than one projector layer; the store holds one projector per model")
    config = doc.get("config")
    if isinstance(config, dict):
        config = {k: config[k] for k in ("mediaType", "digest", "size") if k in config}
    else:
        config = None
    return Manifest(kept, hashlib.sha256(body).hexdigest(), config, skipped)


def bearer_challenge(header: str | None) -> dict[str, str] | None:
    """The parameters of a ``WWW-Authenticate: Bearer realm="...", service="...", scope="..."``
    challenge (names lower-cased); None for a missing header, another scheme, or no realm."""
    if not header:
        return None
    scheme, _, rest = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    params = {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)\s*=\s*"([^"]*)"', rest)}
    return params if params.get("realm") else None


def tls_kept(url: str, base: str) -> bool:
    """Whether ``url`` (a token service, first named or redirected to) may serve the registry
    at ``base``: https always; plain http only when the registry itself is reached over http
    (a registry configured here, or pulled from with ``insecure``)."""
    scheme = urllib.parse.urlsplit(url).scheme
    return scheme == "https" or (scheme == "http" and urllib.parse.urlsplit(base).scheme == "http")


def token_url(challenge: dict[str, str]) -> str:
    """Where to ask for a pull token: the challenge's realm with its service and scope."""
    realm = urllib.parse.urlsplit(challenge["realm"])
    query = urllib.parse.parse_qsl(realm.query, keep_blank_values=True)
    query += [(k, challenge[k]) for k in ("service", "scope") if challenge.get(k)]
    return urllib.parse.urlunsplit((realm.scheme, realm.netloc, realm.path, urllib.parse.urlencode(query), ""))
