"""The GGUF binary format, up to the tensor data: the magic and version, and a reader of the
key/value section and the tensor table that never touches tensor data.

The stock reader (the ``gguf`` package's ``GGUFReader``) parses every element of every array
one by one, which takes seconds on a real vocabulary (150k tokens plus as many merges).
:class:`_HeaderReader` keeps the stock parsing but reads numeric arrays in one step and skips
long string arrays (their contents are never needed here), and checks every read against the
end of the file so that a short file is reported as truncated rather than failing somewhere
inside numpy.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import GGUFError, _Truncated

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# String arrays up to this length are decoded (general.tags, languages, ...);
# longer ones (tokenizer tokens, merges) are skipped and only counted.
_MAX_DECODED_STRING_ARRAY = 256
# Numeric arrays up to this length are kept for lookups (per-layer hparams).
_MAX_KEPT_NUMERIC_ARRAY = 65536


class _HeaderReader(GGUFReader):
    """GGUFReader with bounds-checked reads and one-step array parsing."""

    def __init__(self, path: str, size: int):
        self._size = size
        self.phase = "header"
        super().__init__(path, "r")

    def _build_tensors(self, start_offs, fields):
        self.phase = "tensor data"
        # Report the whole extent the table claims, not just the first tensor past the end.
        end = 0
        for f in fields:
            _nl, _name, _nd, dims, raw_dtype, offset = f.parts
            try:
                block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                continue
            n = int(np.prod(dims.astype(np.uint64))) if len(dims) else 1
            end = max(end, int(start_offs) + int(offset[0]) + n * tsize // block)
        if end > self._size:
            raise _Truncated(end, self._size, self.phase)
        return super()._build_tensors(start_offs, fields)

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if count < 0 or offset < 0 or end > self._size:
            raise _Truncated(end, self._size, self.phase)
        return super()._get(offset, dtype, count, override_order)

    def _struct_prefix(self) -> str:
        file_little = (sys.byteorder == "little") == (self.byte_order == "I")
        return "<" if file_little else ">"

    def _get_field_parts(self, orig_offs, raw_type):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n = int(alen[0])
        offs = orig_offs + 12
        try:
            itype = GGUFValueType(int(raw_itype[0]))
        except ValueError:
            raise ValueError(f"unknown array element type {int(raw_itype[0])}") from None
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            arr = self._get(offs, nptype, n)
            return 12 + int(arr.nbytes), [raw_itype, alen, arr], [2], [GGUFValueType.ARRAY, itype]
        if itype == GGUFValueType.STRING and (n == 0 or n > _MAX_DECODED_STRING_ARRAY):
            # Skip the strings: 8-byte length then the bytes, n times.
            if offs + 8 * n > self._size:
                raise _Truncated(offs + 8 * n, self._size, self.phase)
            buf = memoryview(self.data)
            unpack = struct.Struct(self._struct_prefix() + "Q").unpack_from
            size = self._size
            p = offs
            for _ in range(n):
                if p + 8 > size:
                    raise _Truncated(p + 8, size, self.phase)
                p += 8 + unpack(buf, p)[0]
            if p > size:
                raise _Truncated(p, size, self.phase)
            return p - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]
        return super()._get_field_parts(orig_offs, raw_type)


def _type_name(t: GGUFValueType) -> str:
    return t.name.lower()


def _field_value(f) -> tuple[Any, Any]:
    """(value for the metadata dict, full value for lookups or None)."""
    types = f.types
    if not types:
        return None, None
    main = types[0]
    if main == GGUFValueType.STRING:
        s = bytes(f.parts[-1]).decode("utf-8", "replace")
        return s, s
    if main == GGUFValueType.ARRAY:
        # a key/value field's parts: key length, key bytes, value type, then the
        # value's own parts (element type, length, elements...)
        sub = types[1] if len(types) > 1 else None
        n = int(f.parts[4][0])
        summary = f"[array of {n} {_type_name(sub) if sub is not None else 'unknown'}]"
        full = None
        nested = len(types) > 2
        if sub is not None and not nested and sub != GGUFValueType.STRING and len(f.parts) > 5:
            arr = f.parts[5]
            if n <= _MAX_KEPT_NUMERIC_ARRAY:
                full = arr.tolist()
            else:
                full = n
        elif sub == GGUFValueType.STRING and f.data:
            full = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
        return summary, (full if full is not None else n)
    v = f.parts[-1][0].item()
    return v, v


def _check_magic(path: str, size: int) -> int:
    """Return the version, or raise GGUFError for a bad magic, short header or bad version."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    if size == 0:
        raise GGUFError(path, "empty file (0 bytes)")
    magic = head[:4]
    if magic != GGUF_MAGIC[: len(magic)]:
        shown = (f'"{magic.decode()}"' if magic.isascii() and magic.decode().isprintable()
                 else " ".join(f"{b:02x}" for b in magic))
        raise GGUFError(path, f'not a GGUF file (it begins {shown}, where a GGUF file begins "GGUF")')
    if len(head) < 24:
        raise GGUFError(path, f"truncated: GGUF header needs 24 bytes, file has {size}")
    (version,) = struct.unpack("<I", head[4:8])
    if version & 0xFFFF == 0:  # written for the other byte order
        (version,) = struct.unpack(">I", head[4:8])
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(path, f"unsupported GGUF version {version}")
    return version
