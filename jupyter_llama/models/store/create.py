"""Making models: a GGUF file imported under a name, uploaded blobs named, a synthetic
model written, a model given a second name; each with a preset when one is given.

Every way ends in :meth:`Creating._commit`: temporary files land as blobs and the manifest
is written while the locks of all its blobs are held, so no prune or delete can take a blob
between its landing and its naming. What a failed commit landed, and what the name's old
manifest used and the new one does not, go again at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from pathlib import Path
from typing import Mapping

from ...errors import BadRequest
from ..gguf_info import GGUFError, read_gguf_info
from ..names import ModelName
from ..preset import Preset
from .blobs import BlobStore, Progress
from .errors import BlobMissing, InvalidGGUF, StoreError
from .layout import _unlink, normalize_digest
from .manifests import MANIFEST_MEDIA_TYPE, MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, ModelEntry
from .presets import Presets
from .prune import Pruning
from .summary import _projector_summary, info_summary


class Creating(BlobStore, Presets, Pruning):
    """create, create_from_files, create_from_blobs, synth and copy (a part of ModelStore)."""

    def _commit(self, name: ModelName, layers: list[dict], info: dict, source: dict,
                projector_info: dict | None = None, land: dict[str, Path] | None = None,
                progress: Progress | None = None, preset: Preset | None = None) -> ModelEntry:
        """Land temporary files (``land``: hex -> tmp path) and write the manifest, blob locks held.
        With a ``preset``, it is merged onto the preset ``layers`` already carry (see models.preset)."""
        if preset:
            with self._space(f"writing the preset layers of {name.display}"):
                layers, extra = self._with_preset(layers, preset)
            try:
                return self._commit(name, layers, info, source, projector_info, {**(land or {}), **extra}, progress)
            finally:
                for t in extra.values():
                    _unlink(t)
        hexes = [normalize_digest(ly["digest"]) for ly in layers]
        land = land or {}
        # before the locks: a check that must hash does it here, not under them
        for ly, hexd in zip(layers, hexes, strict=True):
            if hexd not in land:
                self._check_layer(name, ly, hexd)
        new_blobs: set[str] = set()  # landed here and not there before: removed again if this fails
        try:
            with self._space(f"saving model {name.display} (its files and manifest)"):
                entry, old = self._commit_locked(name, layers, hexes, info, source, projector_info, land,
                                                 progress, new_blobs)
        except BaseException:
            if new_blobs:
                with contextlib.suppress(OSError, StoreError):
                    self.prune(new_blobs)  # no manifest names them now (prune checks that again)
            raise
        stale = old - set(hexes)
        if stale:  # the manifest is written: this is done, and what is left here a later prune takes
            with contextlib.suppress(OSError, StoreError):
                self.prune(stale)
        return entry

    def _check_layer(self, name: ModelName, ly: dict, hexd: str) -> None:
        problem = self.check_blob(hexd, int(ly["size"]))
        if problem:
            raise BlobMissing(f"blob sha256:{hexd[:12]} for {name.display}: {problem}; it may have been removed "
                              "meanwhile (a delete of the model it came from): try again")

    def _commit_locked(self, name: ModelName, layers: list[dict], hexes: list[str], info: dict, source: dict,
                       projector_info: dict | None, land: dict[str, Path], progress: Progress | None,
                       new_blobs: set[str]) -> tuple[ModelEntry, set[str]]:
        """:meth:`_commit`'s work under the blob locks; adds to ``new_blobs`` each blob it lands
        that was not in the store before."""
        with self._blob_locks(hexes):
            landed: set[str] = set()
            for ly, hexd in zip(layers, hexes, strict=True):
                if hexd in landed:  # the same bytes twice (a template that is also the system text)
                    continue
                if hexd in land:
                    landed.add(hexd)
                    existed = self.blob_path(hexd).exists()
                    self.land_blob(land[hexd], hexd)
                    if not existed:
                        new_blobs.add(hexd)
                    if progress:
                        word = "using existing layer" if existed else "creating new layer"
                        progress({"status": f"{word} sha256:{hexd}"})
                else:
                    self._check_layer(name, ly, hexd)
            if progress:
                progress({"status": "writing manifest"})
            manifest = {
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA_TYPE,
                "name": name.full,
                "layers": [dict(ly) for ly in layers],
                "info": info,
                "source": source,
            }
            if projector_info is not None:
                manifest["projector_info"] = projector_info
            return self._write_manifest(name, manifest)

    def create(self, name: str | ModelName, from_file: os.PathLike | str, projector: os.PathLike | str | None = None,
               progress: Progress | None = None, *, link: str = "auto", source: dict | None = None,
               preset: Preset | None = None) -> ModelEntry:
        """Import a GGUF (and an optional projector GGUF) under ``name`` (with a ``preset``, if given).

        The file is validated first (``InvalidGGUF``, a GGUFError, for anything else). It is
        hard-linked into the store when it is on the same filesystem (``link="auto"``),
        else copied while hashing; ``link="copy"`` or ``"hardlink"`` forces one way.
        ``progress`` receives Ollama-style status dicts.
        """
        mname = self._name(name)
        emit = progress or (lambda d: None)
        emit({"status": "parsing GGUF"})
        src = os.path.abspath(os.path.expanduser(str(from_file)))
        try:
            info = read_gguf_info(src)
        except GGUFError as e:
            raise InvalidGGUF(e.path, e.reason) from None
        proj_src = None
        proj_info = None
        if projector is not None:
            proj_src = os.path.abspath(os.path.expanduser(str(projector)))
            proj_info = _projector_summary(proj_src)
        self.ensure_dirs()
        land: dict[str, Path] = {}
        try:
            hexd, size, how, tmp = self._import_file(src, link, progress, "model")
            land[hexd] = tmp
            layers = [{"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{hexd}", "size": size}]
            hows = {"model": how}
            if proj_src is not None:
                phex, psize, phow, ptmp = self._import_file(proj_src, link, progress, "projector")
                if phex in land:  # the same file twice
                    _unlink(ptmp)
                else:
                    land[phex] = ptmp
                layers.append({"mediaType": PROJECTOR_MEDIA_TYPE, "digest": f"sha256:{phex}", "size": psize})
                hows["projector"] = phow
            src_rec = dict(source) if source else {"type": "file", "path": src}
            if proj_src is not None and not source:
                src_rec["projector_path"] = proj_src
            src_rec.setdefault("import", hows)
            entry = self._commit(mname, layers, info_summary(info), src_rec, proj_info, land, progress, preset)
        finally:
            for t in land.values():
                _unlink(t)
        emit({"status": "success"})
        return entry

    def create_from_files(self, name: str | ModelName, files: Mapping[str, str],
                          preset: Preset | None = None) -> ModelEntry:
        """Name uploaded blobs by Ollama's ``files`` map (file name -> digest): one GGUF is the
        model; with two, the other must be the multimodal projector (told by its name, or by
        not being a language model). ``preset``: what the model carries besides its weights."""
        digests = {}
        for fname, digest in files.items():
            hexd = normalize_digest(digest)
            if not self.has_blob(hexd):
                raise BadRequest(f"files: {fname} (sha256:{hexd}) has not been uploaded; POST it to api/blobs first")
            digests[fname] = hexd
        if len(digests) == 1:
            return self.create_from_blobs(name, next(iter(digests.values())), preset=preset)

        def is_projector(fname: str, hexd: str) -> bool:
            if "mmproj" in fname.lower() or "projector" in fname.lower():
                return True
            try:
                info = read_gguf_info(self.blob_path(hexd))
            except GGUFError:
                return True  # not a language model: the projector, if anything
            return info.architecture in ("clip", "mllama_vision")

        proj = [f for f, d in digests.items() if is_projector(f, d)]
        if len(digests) != 2 or len(proj) != 1:
            raise BadRequest("files: give one GGUF (the model), or two: the model and its multimodal projector "
                             "(mmproj); could not tell which is which")
        model = next(d for f, d in digests.items() if f != proj[0])
        return self.create_from_blobs(name, model, digests[proj[0]], preset=preset)

    def create_from_blobs(self, name: str | ModelName, model_digest: str, projector_digest: str | None = None,
                          source: dict | None = None, preset: Preset | None = None) -> ModelEntry:
        """Name blobs already in the store (``POST /api/create`` after ``POST /api/blobs``)."""
        mname = self._name(name)
        hexd = normalize_digest(model_digest)
        path = self.blob_path(hexd)
        if not path.exists():
            raise BadRequest(f"blob sha256:{hexd} is not in the store; upload it first")
        try:
            info = read_gguf_info(path)
        except GGUFError as e:
            raise InvalidGGUF(e.path, e.reason) from None
        layers = [{"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{hexd}", "size": path.stat().st_size}]
        proj_info = None
        if projector_digest:
            phex = normalize_digest(projector_digest)
            ppath = self.blob_path(phex)
            if not ppath.exists():
                raise BadRequest(f"blob sha256:{phex} is not in the store; upload it first")
            proj_info = _projector_summary(str(ppath))
            layers.append({"mediaType": PROJECTOR_MEDIA_TYPE, "digest": f"sha256:{phex}", "size": ppath.stat().st_size})
        return self._commit(mname, layers, info_summary(info), source or {"type": "blobs"}, proj_info,
                            preset=preset)

    def synth(self, name: str | ModelName, shape=None, progress: Progress | None = None, *, projector: bool = False,
              **overrides) -> ModelEntry:
        """Register a synthetic model (``models.synth``) of ``shape`` under ``name``; with
        ``projector``, a synthetic multimodal projector for it too (a vision model)."""
        from ..synth import SynthShape, write_projector, write_synthetic

        mname = self._name(name)
        s = shape if shape is not None else SynthShape()
        if overrides:
            s = dataclasses.replace(s, **overrides)
        self.ensure_dirs()
        stem = self.tmp_dir / f"synth-{os.getpid()}-{secrets.token_hex(6)}"
        tmp, proj = stem.with_suffix(".gguf"), stem.with_name(stem.name + "-mmproj.gguf")
        try:
            with self._space(f"writing the synthetic model {mname.display}", short_writes=True):
                write_synthetic(tmp, s)
                if projector:
                    write_projector(proj, s.embd, seed=s.seed)
            return self.create(mname, tmp, projector=proj if projector else None, progress=progress, link="auto",
                               source={"type": "synth", "shape": dataclasses.asdict(s), "projector": projector})
        finally:
            _unlink(tmp)
            _unlink(proj)

    def copy(self, src: str | ModelName, dst: str | ModelName, preset: Preset | None = None) -> ModelEntry:
        """Give model ``src`` a second name (no bytes copied); an existing ``dst`` is replaced.
        With a ``preset``, the new name carries ``src``'s preset merged with it (Ollama's create
        ``from`` a model): the weights are shared, only the small preset layers are new."""
        sname, dname = self._name(src), self._name(dst)
        for attempt in range(3):
            entry = self._lookup(sname)
            if entry is None:
                raise self._not_found(str(src), sname)
            if preset is None and sname == dname:  # (a create FROM itself, with a preset, changes it: that is fine)
                raise BadRequest(f'"{src}" and "{dst}" are the same model, {entry.display} (names ignore case): '
                                 "give the copy a name of its own")
            source = dict(entry.source)
            source.setdefault("from_model", entry.name.full if entry.shown else entry.display)  # (a name that lasts)
            try:
                return self._commit(dname, entry.layers, entry.info, source, entry.manifest.get("projector_info"),
                                    preset=preset)
            except BlobMissing:
                # ``src`` was deleted or re-pointed meanwhile, taking its files: copy what it names now
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover
