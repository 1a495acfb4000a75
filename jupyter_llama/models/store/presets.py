"""Presets: what a model carries besides its weights (system text, template, parameters,
messages, licenses), each part a small layer of its own (see ``models.preset``). Read whole
from their blobs, checked against their digests and kept in memory (content-addressed, so a
layer read once never changes); a new preset is written to temporary files that land with
the manifest that names them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from pathlib import Path
from typing import Iterable

from ..names import InvalidName, ModelName, parse_name
from ..preset import MAX_LAYER_BYTES, PRESET_MEDIA_TYPES, Preset, PresetError
from .errors import BlobCorrupt, StoreBusy, StoreError
from .layout import _unlink, normalize_digest
from .manifests import Manifests


class Presets(Manifests):
    """A model's preset read, and merged with a new one (a part of ModelStore)."""

    _preset_cache: dict[str, bytes]  # layer hex -> its bytes (made by ModelStore.__init__)
    _cache_lock: threading.Lock  # guards the caches of GGUF summaries and preset layers

    def _layer_bytes(self, ly: dict) -> bytes:
        """A small (preset) layer's blob, read whole; BlobCorrupt when missing or not its size."""
        hexd = normalize_digest(ly["digest"])
        size = int(ly.get("size", 0))
        with self._cache_lock:
            hit = self._preset_cache.get(hexd)
        if hit is not None:
            return hit
        if size > MAX_LAYER_BYTES:
            part = PRESET_MEDIA_TYPES.get(str(ly.get("mediaType")), "preset")
            raise BlobCorrupt(f"the {part} layer sha256:{hexd[:12]} "
                              f"is {size:,} bytes, more than a preset layer may be", digest=hexd, problem="too large")
        try:
            data = self.blob_path(hexd).read_bytes()
        except OSError as e:
            raise BlobCorrupt(f"the preset layer sha256:{hexd[:12]} cannot be read: {e.strerror or e}",
                              digest=hexd, problem="missing") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != hexd:
            raise BlobCorrupt(f"the preset layer sha256:{hexd[:12]} does not hold what its name says",
                              digest=hexd, problem="damaged")
        with self._cache_lock:
            if len(self._preset_cache) > 256:
                self._preset_cache.clear()
            self._preset_cache[hexd] = data  # content-addressed: it can never change
        return data

    def _read_preset(self, layers: Iterable[dict], display: str = "") -> Preset:
        try:
            return Preset.from_layers(layers, self._layer_bytes)
        except PresetError as e:
            raise StoreError(f'model "{display}": {e}; create it again') from None

    def preset(self, name: str | ModelName) -> Preset:
        """The preset (system, template, parameters, messages, licenses) of model ``name``."""
        e = self.entry(name)
        return self._read_preset(e.layers, e.display)

    def preset_for(self, name: str) -> Preset:
        """The preset a request for ``name`` gets: the model's, or an empty one for a name that
        is no model in the store (a GGUF path, a typo: resolving it says what is wrong)."""
        try:
            mname = parse_name(str(name).strip())
        except InvalidName:
            return Preset()
        for _attempt in range(3):
            e = self._lookup(mname)
            if e is None:
                return Preset()
            try:
                return self._read_preset(e.layers, e.display)
            except StoreError:
                # a delete or a create that re-pointed the name meanwhile took a layer: look again
                now = self._lookup(mname)
                if now is not None and (now.manifest_path, now.digest) == (e.manifest_path, e.digest):
                    raise
        raise StoreBusy(f'model "{name}" was changed by other operations (a create, copy or delete) while its '
                        "preset was being read, again and again; try again")

    def _with_preset(self, layers: list[dict], preset: Preset) -> tuple[list[dict], dict[str, Path]]:
        """``layers`` with their preset merged with ``preset``: the weights' layers as they were,
        then one new layer per preset part, written to temporary files (hex -> path) to land."""
        merged = self._read_preset(layers).merged(preset)
        out = [dict(ly) for ly in layers if ly.get("mediaType") not in PRESET_MEDIA_TYPES]
        land: dict[str, Path] = {}
        self.ensure_dirs()
        try:
            for media_type, data in merged.payloads():
                hexd = hashlib.sha256(data).hexdigest()
                out.append({"mediaType": media_type, "digest": f"sha256:{hexd}", "size": len(data)})
                if hexd not in land:
                    tmp = self.tmp_dir / f"preset-{os.getpid()}-{secrets.token_hex(6)}"
                    land[hexd] = tmp  # before writing: a write cut short is removed with the rest
                    tmp.write_bytes(data)
        except BaseException:
            for t in land.values():
                _unlink(t)
            raise
        return out, land
