"""Resolving: a name (or, where allowed, a GGUF file's path) to the :class:`ModelRef` the
scheduler loads, every blob checked first; and ``show``, everything about a model.

A blob's size is compared each time (cheap); it is rehashed only when its size, mtime or
inode changed since its last good hash. A blob that is damaged or missing is
:class:`BlobCorrupt`, whose message names the command that repairs it. A name whose files
a delete or create took meanwhile is looked up again.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os

from ...errors import ModelNotFound
from ..gguf_info import GGUFError, GGUFInfo, read_gguf_info
from ..names import InvalidName, ModelName, parse_name, plainly_a_path, refuse_control_characters
from ..preset import Preset
from ..ref import ModelRef, model_details, parameter_size
from .blobs import BlobStore
from .errors import BlobCorrupt, InvalidGGUF, StoreBusy, StoreError
from .layout import normalize_digest
from .manifests import MODEL_MEDIA_TYPE, ModelEntry, _role
from .presets import Presets
from .summary import _info_from_dict, info_summary


class Resolving(BlobStore, Presets):
    """resolve, resolve_sync and show (a part of ModelStore; an instance is the scheduler's
    resolver)."""

    _info_cache: dict[str, tuple[tuple, GGUFInfo]]  # path -> ((size, mtime, inode), its GGUFInfo)

    def _ref_from_entry(self, e: ModelEntry, cheap: bool = False) -> ModelRef:
        mpath = str(self.blob_path(e.model_digest))
        info = None
        if not cheap:
            info = self._read_info(mpath)
        if info is None:
            info = _info_from_dict(e.info, mpath)
        pdig = e.projector_digest
        return ModelRef(name=e.display, path=mpath, info=info,
                        mmproj=str(self.blob_path(pdig)) if pdig else None, digest=e.digest,
                        projector_family=e.projector_family)

    def _read_info(self, path: str) -> GGUFInfo:
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._cache_lock:
            hit = self._info_cache.get(path)
        if hit and hit[0] == stamp:
            return hit[1]
        info = read_gguf_info(path)
        with self._cache_lock:
            if len(self._info_cache) > 64:
                self._info_cache.clear()
            self._info_cache[path] = (stamp, info)
        return info

    def _resolve_path(self, text: str) -> ModelRef | None:
        if not self.allow_paths or not self._looks_like_path(text):
            return None
        if not self.may_read_path(os.path.abspath(os.path.expanduser(text))):
            if plainly_a_path(text):
                self.server_file(text)  # raises, saying why
            return None  # a name such as "owner/model" that is not in the store: not found
        path = os.path.abspath(os.path.expanduser(text))
        if not os.path.isfile(path):
            return None
        try:
            info = self._read_info(path)
        except GGUFError as e:
            raise InvalidGGUF(e.path, e.reason) from None
        return ModelRef(name=text, path=path, info=info)

    def resolve_sync(self, name: str) -> ModelRef:
        """Name (or, with ``allow_paths``, a path to a .gguf file) -> ModelRef, blobs checked."""
        refuse_control_characters(str(name))  # (a 400, before strip() could drop one or a path holds it)
        text = str(name).strip()
        try:
            mname = parse_name(text)
        except InvalidName:
            ref = self._resolve_path(text)
            if ref is not None:
                return ref
            missing = self._missing_file(text)
            if missing is not None:
                raise ModelNotFound(text, missing_file=missing) from None
            raise
        for _attempt in range(3):
            e = self._lookup(mname)
            if e is None:
                ref = self._resolve_path(text)
                if ref is not None:
                    return ref
                raise self._not_found(text, mname)
            try:
                return self._checked_ref(e)
            except BlobCorrupt:
                # a delete or a create that re-pointed the name meanwhile took the blob: look again
                now = self._lookup(mname)
                if now is not None and (now.manifest_path, now.digest) == (e.manifest_path, e.digest):
                    raise
        raise StoreBusy(f'model "{text}" was changed by other operations (a create, copy or delete) while it was '
                        "being looked up, again and again; try again")

    def _checked_ref(self, e: ModelEntry) -> ModelRef:
        """``e``'s ModelRef, its blobs checked (BlobCorrupt, with the repair, for one that is
        damaged or missing)."""
        for ly in e.layers:
            hexd = normalize_digest(ly["digest"])
            problem = self.check_blob(hexd, int(ly["size"]))
            if problem:
                role = _role(ly["mediaType"])
                raise BlobCorrupt(
                    f'model "{e.display}": the {role} file (blob sha256:{hexd[:12]}) is damaged: {problem}. '
                    f"To repair it, {e.repair_hint()}.",
                    digest=hexd, problem=problem)
        try:
            return self._ref_from_entry(e)
        except GGUFError as err:
            raise BlobCorrupt(f'model "{e.display}": {err.reason}. To repair it, {e.repair_hint()}.',
                              digest=e.model_digest, problem=err.reason) from None
        except FileNotFoundError:
            raise BlobCorrupt(f'model "{e.display}": the model file (blob sha256:{e.model_digest[:12]}) is '
                              f"missing. To repair it, {e.repair_hint()}.",
                              digest=e.model_digest, problem="the blob file is missing") from None

    async def resolve(self, name: str) -> ModelRef:
        """The scheduler's resolver: file I/O and any rehash run in a worker thread."""
        return await asyncio.to_thread(self.resolve_sync, name)

    __call__ = resolve

    def show(self, name: str | ModelName, verify: bool = False) -> dict:
        """Everything about a model: metadata, parameters, quantisation, files, sizes, digests.

        With ``verify`` every blob is rehashed and ``verify`` reports ``{"ok", "problems"}``.
        A path to a GGUF file (where paths are allowed) shows that file, as ``run`` loads it.
        """
        try:
            e = self.entry(name)
        except InvalidName:  # (no store name: a path, resolved as a load resolves it)
            if not self.allow_paths or not self._looks_like_path(str(name)):
                raise
            return self._show_file(self.resolve_sync(str(name)), verify)
        except ModelNotFound:
            # a name that can also be a path ("owner/model"): a file there, or not found. (Not
            # resolve_sync: a create racing with this could make it a store model meanwhile,
            # which would then be shown as a file.)
            ref = self._resolve_path(str(name).strip())  # (None where paths are not allowed)
            if ref is None:
                raise
            return self._show_file(ref, verify)
        info = e.info
        files = []
        problems = []
        for ly in e.layers:
            hexd = normalize_digest(ly["digest"])
            role = _role(ly["mediaType"])
            path = self.blob_path(hexd)
            rec = {"role": role, "media_type": ly["mediaType"], "digest": f"sha256:{hexd}",
                   "size": int(ly["size"]), "path": str(path), "present": path.exists()}
            if verify:
                problem = self.check_blob(hexd, int(ly["size"]), full=True)
                rec["ok"] = problem is None
                if problem:
                    rec["problem"] = problem
                    problems.append(f"{role} blob sha256:{hexd[:12]}: {problem}")
            files.append(rec)
        try:
            preset = self._read_preset(e.layers, e.display).to_dict()
        except StoreError as err:  # BlobCorrupt too: show what can be shown, and say what is wrong
            preset = Preset().to_dict()
            problems.append(str(err))
        out = {
            "name": e.display,
            "model": e.name.full,
            "digest": e.digest,
            "size": e.size,
            "created_at": e.created_at,
            "modified_at": e.modified_at,
            "details": e.details,
            "architecture": info.get("architecture"),
            "parameters": info.get("parameter_count"),
            "parameter_size": e.details["parameter_size"],
            "quantization": info.get("quantization"),
            "context_length": info.get("context_length"),
            "files": files,
            "source": e.source,
            "info": info,
            "model_info": dict(info.get("metadata") or {}),
            "template": (info.get("metadata") or {}).get("tokenizer.chat_template", ""),
            "projector_info": e.manifest.get("projector_info"),
            "preset": preset,  # system, template (Ollama's), parameters, messages, license
        }
        if verify:
            out["verify"] = {"ok": not problems, "problems": problems,
                             "repair": e.repair_hint() if problems else None}
        return out

    def _show_file(self, ref: ModelRef, verify: bool) -> dict:
        """:meth:`show` of a GGUF file named by its path: what the file says of itself. It has
        no digest, preset or source in the store, so ``verify`` has nothing to hash it
        against: reading its header and tensor table (done to name it) is its check."""
        try:
            st = os.stat(ref.path)
        except FileNotFoundError:  # (removed since it was resolved)
            raise ModelNotFound(ref.name, missing_file=ref.path) from None
        when = _dt.datetime.fromtimestamp(st.st_mtime, _dt.timezone.utc).isoformat()
        info = info_summary(ref.info)
        out = {
            "name": ref.name, "model": ref.path, "digest": "", "size": st.st_size,
            "created_at": when, "modified_at": when, "details": model_details(info),
            "architecture": info.get("architecture"), "parameters": info.get("parameter_count"),
            "parameter_size": parameter_size(int(info.get("parameter_count") or 0)),
            "quantization": info.get("quantization"), "context_length": info.get("context_length"),
            "files": [{"role": "model", "media_type": MODEL_MEDIA_TYPE, "digest": "", "size": st.st_size,
                       "path": ref.path, "present": True}],
            "source": {"type": "file", "path": ref.path}, "info": info,
            "model_info": dict(info.get("metadata") or {}),
            "template": (info.get("metadata") or {}).get("tokenizer.chat_template", ""),
            "projector_info": None, "preset": Preset().to_dict(),
        }
        if verify:
            out["verify"] = {"ok": True, "problems": [], "repair": None,
                             "note": "a file named by its path has no digest to check its bytes against"}
        return out
