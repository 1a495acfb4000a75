"""``read_arrays``: every array of a GGUF file's metadata, whole, read straight from the
key/value section."""

from __future__ import annotations

import os
import struct

from gguf import GGUFValueType

from .errors import GGUFError, _Truncated
from .header import _check_magic
from .info import _json_value

# element type -> (struct code, size); strings and nested arrays are read one by one
_SCALARS = {GGUFValueType.UINT8: ("B", 1), GGUFValueType.INT8: ("b", 1), GGUFValueType.UINT16: ("H", 2),
            GGUFValueType.INT16: ("h", 2), GGUFValueType.UINT32: ("I", 4), GGUFValueType.INT32: ("i", 4),
            GGUFValueType.FLOAT32: ("f", 4), GGUFValueType.BOOL: ("?", 1), GGUFValueType.UINT64: ("Q", 8),
            GGUFValueType.INT64: ("q", 8), GGUFValueType.FLOAT64: ("d", 8)}


def read_arrays(path: os.PathLike | str) -> dict[str, list]:
    """Every array of a GGUF file's metadata, whole (the tokenizer's tokens, merges and
    scores among them: hundreds of thousands of items in a real model), by key. This is
    what Ollama's ``show`` with ``verbose`` gives; :func:`read_gguf_info` skips long string
    arrays, which nothing else needs. Only the key/value section is read. GGUFError for a
    file that is not a readable GGUF."""
    import mmap

    p = str(path)
    try:
        size = os.path.getsize(p)
        version = _check_magic(p, size)
        fh = open(p, "rb")
    except OSError as e:
        raise GGUFError(p, e.strerror or str(e)) from None
    with fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        order = "<" if struct.unpack_from("<I", buf, 4)[0] == version else ">"
        count = "Q" if version >= 3 else "I"
        count_size = struct.calcsize(count)
        pos = 8 + 2 * count_size  # magic, version, tensor count, key/value count

        def take(fmt: str, n: int = 1):
            nonlocal pos
            width = struct.calcsize(order + fmt) * n
            if pos + width > size:
                raise _Truncated(pos + width, size, "metadata")
            out = struct.unpack_from(f"{order}{n}{fmt}", buf, pos)
            pos += width
            return out

        def text() -> str:
            nonlocal pos
            (n,) = take(count)
            if pos + n > size:
                raise _Truncated(pos + n, size, "metadata")
            s = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
            pos += n
            return s

        def value(kind: int):
            kind = GGUFValueType(kind)
            if kind == GGUFValueType.STRING:
                return text()
            if kind == GGUFValueType.ARRAY:
                (sub,) = take("I")
                (n,) = take(count)
                sub = GGUFValueType(sub)
                if sub in _SCALARS:
                    items = list(take(_SCALARS[sub][0], n)) if n else []
                    return [_json_value(x) for x in items] if sub in (GGUFValueType.FLOAT32,
                                                                     GGUFValueType.FLOAT64) else items
                return [value(sub) for _ in range(n)]
            return take(_SCALARS[kind][0])[0]

        (n_kv,) = struct.unpack_from(order + count, buf, 8 + count_size)
        arrays: dict[str, list] = {}
        try:
            for _ in range(n_kv):
                key = text()
                (kind,) = take("I")
                v = value(kind)
                if isinstance(v, list):
                    arrays[key] = v
        except _Truncated as e:
            raise GGUFError(p, f"truncated: {e.phase} needs at least {e.needed:,} bytes, file has {e.size:,}") from None
        except (ValueError, KeyError, struct.error) as e:
            raise GGUFError(p, f"malformed GGUF metadata: {e}") from None
    return arrays
