"""Manifests: the names of the store. One JSON document per name lists the name's layers
(the model GGUF, an optional projector, the preset parts) and keeps a summary of the model,
when it was made and where it came from.

:class:`ModelEntry` is one manifest as read; :class:`Manifests` reads them (a name in any
case, a name without a host also finding the model pulled from the registry under it),
writes and deletes them under ``manifests.lock``, and says what a name not found may have
meant.
"""

from __future__ import annotations

import builtins
import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ...errors import BadRequest, ModelNotFound
from ..names import InvalidName, ModelName, also_registry, parse_name, without_registry
from ..preset import PRESET_MEDIA_TYPES
from ..ref import model_details
from .access import PathAccess
from .errors import StoreError
from .layout import _listing, _now, _unlink, atomic_write_json, normalize_digest
from .locks import StoreLocks

MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
MANIFEST_MEDIA_TYPE = "application/vnd.jupyter-llama.manifest.v1+json"


def _role(media_type: str) -> str:
    """What a layer is, in a word: model, projector, or a preset part (system, template ...)."""
    if media_type == MODEL_MEDIA_TYPE:
        return "model"
    if media_type == PROJECTOR_MEDIA_TYPE:
        return "projector"
    return PRESET_MEDIA_TYPES.get(media_type, media_type)


@dataclass
class ModelEntry:
    """One named model as its manifest describes it (no blob is opened)."""

    name: ModelName
    manifest: dict
    manifest_path: Path
    shown: str | None = None  # the name it is shown by, when not its own short form (see Store._entry)

    @property
    def display(self) -> str:
        return self.shown or self.name.display

    @property
    def layers(self) -> list[dict]:
        return list(self.manifest.get("layers") or [])

    def _layer(self, media_type: str) -> dict | None:
        return next((ly for ly in self.layers if ly.get("mediaType") == media_type), None)

    @property
    def model_layer(self) -> dict:
        ly = self._layer(MODEL_MEDIA_TYPE)
        if ly is None:
            raise StoreError(f"manifest {self.manifest_path} has no model layer")
        return ly

    @property
    def projector_layer(self) -> dict | None:
        return self._layer(PROJECTOR_MEDIA_TYPE)

    @property
    def model_digest(self) -> str:
        return normalize_digest(self.model_layer["digest"])

    @property
    def projector_digest(self) -> str | None:
        ly = self.projector_layer
        return normalize_digest(ly["digest"]) if ly else None

    @property
    def digest(self) -> str:
        """The model's identity (hex): sha256 of its layer list, as stable as Ollama's manifest digest."""
        canon = json.dumps([{"mediaType": ly["mediaType"], "digest": ly["digest"], "size": ly["size"]}
                            for ly in self.layers], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    @property
    def size(self) -> int:
        return sum(int(ly.get("size", 0)) for ly in self.layers)

    @property
    def info(self) -> dict:
        return dict(self.manifest.get("info") or {})

    @property
    def source(self) -> dict:
        return dict(self.manifest.get("source") or {})

    @property
    def created_at(self) -> str:
        return self.manifest.get("created_at", "")

    @property
    def modified_at(self) -> str:
        return self.manifest.get("modified_at", "")

    @property
    def details(self) -> dict:
        """Ollama's ``details`` object."""
        return model_details(self.info, self.source.get("from_model", ""), self.projector_family)

    @property
    def projector_family(self) -> str | None:
        """The projector's architecture (``clip`` when its manifest does not say), None without one."""
        if not self.projector_layer:
            return None
        return (self.manifest.get("projector_info") or {}).get("architecture") or "clip"

    def repair_hint(self) -> str:
        """The command that puts this model's bytes back."""
        src = self.source
        kind = src.get("type")
        if kind == "hf":
            tag = src.get("quant")
            text = f"hf.co/{src.get('repo')}" + (f":{tag}" if tag else "")
            return f"pull it again: `jupyter-llama pull {text}` (or `%llama pull {text}`)"
        if kind == "url":
            return f"pull it again: `jupyter-llama pull {src.get('url')}`"
        if kind == "registry":
            return f"pull it again: `jupyter-llama pull {src.get('name')}` (or `%llama pull {src.get('name')}`)"
        if kind == "synth":
            return "make it again with the store's synth (same shape and seed give the same bytes)"
        path = src.get("path")
        if path:
            return f"create it again from its file: `jupyter-llama create {self.display} {path}`"
        return "pull or create it again"

    def to_api(self) -> dict:
        """One element of Ollama's ``GET /api/tags`` ``models`` list."""
        return {
            "name": self.display,
            "model": self.display,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
        }


class Manifests(StoreLocks, PathAccess):
    """Names to entries, and manifests written and deleted (a part of ModelStore)."""

    @staticmethod
    def _name(name: str | ModelName) -> ModelName:
        return name if isinstance(name, ModelName) else parse_name(name)

    def _iter_manifest_paths(self) -> Iterator[tuple[Path, tuple[str, str, str, str]]]:
        """Every manifest file, in sorted order. A delete running meanwhile removes files and
        the folders it empties (under the manifests lock, which readers do not take): a folder
        or file gone before it is read was a manifest deleted, and is passed over."""
        for host in _listing(self.manifests_dir, dirs=True):
            for ns in _listing(host.path, dirs=True):
                for model in _listing(ns.path, dirs=True):
                    for tag in _listing(model.path, dirs=False):
                        yield Path(tag.path), (host.name, ns.name, model.name, tag.name)

    def _load_entry(self, path: Path, parts: tuple[str, ...]) -> ModelEntry | None:
        try:
            with open(path, encoding="utf-8") as fh:
                manifest = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
            return None
        try:
            for ly in manifest["layers"]:
                normalize_digest(ly["digest"])
                int(ly["size"])
        except (KeyError, TypeError, ValueError, BadRequest):
            return None
        return self._entry(ModelName(*parts), manifest, path)

    def _entry(self, name: ModelName, manifest: dict, path: Path) -> ModelEntry:
        """The entry of ``name``'s manifest. A model pulled from the registry shows the name
        without a host that finds it (``tiny:latest`` for ``registry.ollama.ai/library/tiny:latest``),
        as Ollama shows it, unless a model made here has that name (see ``names.without_registry``)."""
        bare = without_registry(name)
        shown = bare.display if bare is not None and self._find(bare) is None else None  # as _lookup finds it
        return ModelEntry(name, manifest, path, shown)

    def _manifest_file(self, name: ModelName) -> Path | None:
        """The manifest file of ``name`` in any case (``Tiny`` was created, ``tiny`` is asked
        for): the path as asked when it is there (on a file system that ignores case, always),
        else the first, in sorted order, whose folders and file name match it case-folded;
        None when there is none."""
        path = self._manifest_path(name)
        if path.is_file():
            return path
        return self._casefolded(self.manifests_dir, [part.casefold() for part in name.parts])

    def _casefolded(self, d: Path, parts: list[str]) -> Path | None:
        """Under ``d``, the first path (folders sorted by name, and each tried in turn) whose
        remaining parts are ``parts`` case-folded, the last one a file."""
        last = len(parts) == 1
        try:
            found = sorted((e for e in os.scandir(d) if not e.name.startswith(".") and e.name.casefold() == parts[0]
                            and (e.is_file() if last else e.is_dir())), key=lambda e: e.name)
        except OSError:
            return None
        for e in found:
            hit = Path(e.path) if last else self._casefolded(Path(e.path), parts[1:])
            if hit is not None:
                return hit
        return None

    def _lookup(self, name: ModelName) -> ModelEntry | None:
        """The model a request for ``name`` means: :meth:`_find`, and for a name without a host
        (``llama3.2:1b``) that no model made here has, the one pulled under it from the
        registry (``registry.ollama.ai/library/llama3.2:1b``; see ``names.also_registry``)."""
        self.check_root()
        e = self._find(name)
        if e is None:
            alias = also_registry(name)
            if alias is not None:
                e = self._find(alias)
        return e

    def _find(self, name: ModelName) -> ModelEntry | None:
        path = self._manifest_file(name)
        if path is None:
            return None
        return self._load_entry(path, tuple(path.relative_to(self.manifests_dir).parts))

    def _referenced(self, skip: Path | None = None) -> set[str]:
        """The blobs some manifest uses (but ``skip``, a manifest's path)."""
        refs: set[str] = set()
        for p, parts in self._iter_manifest_paths():
            if skip is not None and p == skip:
                continue
            e = self._load_entry(p, parts)
            if e is None:
                # an unreadable manifest may still reference blobs: be conservative
                try:
                    text = p.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                refs.update(re.findall(r"sha256[:-]([0-9a-f]{64})", text))
                continue
            for ly in e.layers:
                refs.add(normalize_digest(ly["digest"]))
        return refs

    def _write_manifest(self, name: ModelName, manifest: dict) -> tuple[ModelEntry, set[str]]:
        """Write (replace) a manifest; return the entry and the digests the old one used."""
        path = self._manifest_path(name)
        old_digests: set[str] = set()
        with self.lock("manifests"):
            old = self._find(name)
            now = _now()
            manifest["created_at"] = now
            if old is not None:
                old_digests = {normalize_digest(ly["digest"]) for ly in old.layers}
                manifest["created_at"] = old.created_at or now  # when the name first appeared
            manifest["modified_at"] = now
            try:
                atomic_write_json(path, manifest)
            except BaseException:
                # a folder made for this manifest (a copy to a new name on a full disk) goes again
                d = path.parent
                while d != self.manifests_dir and self.manifests_dir in d.parents and not d.exists():
                    d = d.parent
                self._prune_empty_dirs(d)
                raise
            if old is not None and old.manifest_path != path:
                _unlink(old.manifest_path)  # same name, other case
                self._prune_empty_dirs(old.manifest_path.parent)
        return self._entry(name, manifest, path), old_digests

    def _prune_empty_dirs(self, d: Path) -> None:
        base = self.manifests_dir.resolve()
        d = d.resolve()
        while d != base and base in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def _not_found(self, text: str, mname: ModelName | None = None) -> ModelNotFound:
        """The ModelNotFound for ``text``: about the file, when it can only name a missing one
        (see :meth:`_missing_file`), else with the models it may have meant."""
        missing = self._missing_file(text)
        if missing is not None:
            return ModelNotFound(text, missing_file=missing)
        try:
            entries = self.list()
        except OSError:
            entries = []
        shown = [e.display for e in entries]

        def bare(name: str) -> str:
            # compared without the default tag: every NAME:latest shares ":latest", which alone
            # passes difflib's cutoff (any unknown name would "mean" every model)
            name = name.casefold()
            return name[:-len(":latest")] if name.endswith(":latest") else name

        pool: dict[str, str] = {}
        for e in entries:
            pool[bare(e.display)] = e.display
            pool.setdefault(e.name.model.casefold(), e.display)
            pool.setdefault(f"{e.name.namespace}/{e.name.model}".casefold(), e.display)
        probes = [bare(text)]
        if mname is not None:
            probes += [bare(mname.display), mname.model.casefold()]
        close: list[str] = []
        for probe in probes:
            for m in difflib.get_close_matches(probe, list(pool), n=5, cutoff=0.6):
                if pool[m] not in close:
                    close.append(pool[m])
        hint = ""
        if close:
            hint = "did you mean " + ", ".join(f'"{c}"' for c in close[:3]) + "?"
        elif not shown:
            hint = "the store is empty"
        return ModelNotFound(text, hint)

    def entry(self, name: str | ModelName) -> ModelEntry:
        """The manifest behind ``name``; ModelNotFound (with suggestions) if there is none."""
        mname = self._name(name)
        e = self._lookup(mname)
        if e is None:
            raise self._not_found(str(name), mname)
        return e

    def exists(self, name: str | ModelName) -> bool:
        try:
            return self._lookup(self._name(name)) is not None
        except InvalidName:
            return False

    def names(self) -> list[str]:
        return [e.display for e in self.list()]

    def list(self) -> builtins.list[ModelEntry]:  # (in this class, a bare ``list`` is this method)
        """Every model, by name; reads manifests only."""
        self.check_root()
        out = []
        for p, parts in self._iter_manifest_paths():
            e = self._load_entry(p, parts)
            if e is not None:
                out.append(e)
        return sorted(out, key=lambda e: e.display.casefold())
