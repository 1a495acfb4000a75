"""Pulling by name from an Ollama registry (see :mod:`..registry` for the names, the manifest's
shape and Docker's token protocol): the manifest, fetched with the v2 ``Accept`` header and
checked, its layers as the files to fetch, and the anonymous pull token a registry may ask for.

The registry is ``JUPYTER_LLAMA_REGISTRY`` (default https://registry.ollama.ai).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .. import registry
from ..names import DEFAULT_REGISTRY
from .download import Credentials, Transfer
from .errors import BadManifest, NotInRegistry, PullError, RegistryUnreachable
from .http_client import Dropped, Response, origin
from .sources import RemoteFile

__all__ = ["RegistryAuth", "registry_manifest", "registry_plan"]

_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")  # RFC 6750's token characters
MAX_TOKEN_CHARS = 8192
MAX_TOKEN_ANSWER = 1 << 16


class RegistryAuth(Credentials):
    """The pull token a registry handed out (none until its 401 names a token service), sent to
    that registry only (the opener drops it on a redirect to another origin)."""

    refused_hint = "; the registry refused its own pull token"

    def __init__(self, transfer: Transfer, ref: registry.RegistryRef):
        self.transfer = transfer
        self.ref = ref
        self.token: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def renew(self, refusal: Response) -> bool:
        """A 401 from the registry itself (its token expired, or it guards only its blobs):
        ask its token service again."""
        return origin(refusal.url) == origin(self.ref.base) and self.login(refusal.header("WWW-Authenticate"))

    def login(self, challenge: str | None) -> bool:
        """Ask the token service a registry's 401 names (Docker's token protocol, see
        :mod:`..registry`) for a pull token, without credentials; True when it gave one. A
        realm a registry over TLS names over plain http is refused in words."""
        ref = self.ref
        ch = registry.bearer_challenge(challenge)
        if ch is None:
            return False
        url = registry.token_url(ch)
        if not registry.tls_kept(url, ref.base):
            raise PullError(f"the registry {ref.base} sends clients for a token to {ch['realm']}, which is not "
                            f"https: refused (a token service must use TLS when the registry does)")
        try:
            r = self.transfer.http.open(url, {"Accept": "application/json"})
            try:
                body = r.read(MAX_TOKEN_ANSWER)
            finally:
                r.close()
        except PullError:
            raise
        except OSError as e:
            raise RegistryUnreachable(f"cannot reach {ch['realm']} for a pull token of {ref.text}: "
                                      f"{getattr(e, 'strerror', None) or e}; try the pull again") from None
        if not registry.tls_kept(r.url, ref.base):
            raise PullError(f"the token service {ch['realm']} redirected to {origin(r.url)[0]}://: refused (a "
                            f"token service must use TLS when the registry does)")
        if r.status >= 500 or r.status == 429:
            raise RegistryUnreachable(f"the token service {ch['realm']} of {ref.base} answered HTTP {r.status} "
                                      f"{r.reason}; try the pull again")
        if r.status != 200:
            return False  # refused: the registry's own refusal says the rest
        try:
            doc = json.loads(body)
        except ValueError:
            return False
        token = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or not _TOKEN.match(token):
            return False  # none, or not a token a header can carry
        self.token = token
        return True


def registry_manifest(transfer: Transfer, auth: RegistryAuth) -> registry.Manifest:
    """Fetch and check the manifest (retrying a dropped connection or a 5xx as downloads do)."""
    ref = auth.ref
    what = f"the manifest of {ref.text} from {ref.base}"
    attempts = 0
    while True:
        transfer.check_cancel()
        try:
            r = transfer.http.open(ref.manifest_url, {"Accept": registry.MANIFEST_V2, **auth.headers()})
            try:
                body = r.read(registry.MAX_MANIFEST_BYTES + 1) if r.status == 200 else r.read(4096)
            finally:
                r.close()
            if r.status >= 500 or r.status == 429:
                raise Dropped(f"HTTP {r.status} {r.reason}")
            break
        except PullError:
            raise
        except BaseException as e:
            why = getattr(e, "strerror", None) or str(e) or type(e).__name__

            def give_up(n: int, why: str = why) -> RegistryUnreachable:
                return RegistryUnreachable(
                    f"cannot reach the registry {ref.base} for {ref.text}: {why} (tried {n} "
                    f"time{'s' if n > 1 else ''}); check the network, or set JUPYTER_LLAMA_REGISTRY "
                    f"to a registry this machine can reach")

            attempts = transfer.try_again(e, attempts + 1, give_up)
    if r.status in (404, 410):
        hint = " (the models and their tags are listed at https://ollama.com/library)" \
            if ref.base == DEFAULT_REGISTRY else ""
        raise NotInRegistry(f'model "{ref.text}" not found in registry {ref.base}: no such model or tag{hint}')
    if r.status == 401 and auth.token is None and auth.login(r.header("WWW-Authenticate")):
        return registry_manifest(transfer, auth)  # again, with the token it handed out
    if r.status in (401, 403):
        raise PullError(f'the registry {ref.base} refused {ref.text} (HTTP {r.status} {r.reason}): it may be '
                        f"private; jupyter-llama pulls models that need no login (or an anonymous pull token)")
    if r.status != 200:
        snippet = " ".join(body[:200].decode("utf-8", "replace").split())
        raise BadManifest(f"{what}: HTTP {r.status} {r.reason}" + (f": {snippet}" if snippet else ""))
    if len(body) > registry.MAX_MANIFEST_BYTES:
        raise BadManifest(f"{what} is larger than {registry.MAX_MANIFEST_BYTES:,} bytes: not a model's manifest")
    try:
        return registry.parse_manifest(body, r.content_type, what)
    except registry.ManifestError as e:
        raise BadManifest(str(e)) from None
    except registry.UnsupportedModel as e:
        raise PullError(str(e)) from None


def registry_plan(transfer: Transfer, auth: RegistryAuth) -> tuple[list[RemoteFile], dict[str, Any]]:
    """The layers to fetch for a registry name, and the record of where they came from that the
    model's manifest keeps."""
    ref = auth.ref
    manifest = registry_manifest(transfer, auth)
    files = [RemoteFile(url=ref.blob_url(ly.hexd), path=f"{ref.text} ({ly.role} layer sha256:{ly.hexd[:12]})",
                        role=ly.role, size=ly.size, sha256=ly.hexd, media_type=ly.media_type, auth=True)
             for ly in manifest.layers]
    record: dict[str, Any] = {"type": "registry", "registry": ref.base, "name": ref.text,
                              "manifest_digest": f"sha256:{manifest.digest}", "url": ref.manifest_url}
    if manifest.config:
        record["config"] = manifest.config
    if manifest.skipped:
        record["skipped_layers"] = manifest.skipped
    return files, record
