"""GGUF metadata and tensor table, read without loading tensor data.

``read_gguf_info(path)`` memory-maps the file with the ``gguf`` package's
``GGUFReader`` and walks only the header: the key/value section and the tensor
table. Tensor data is never touched (the reader builds lazy views into the map).

The reader is a package, one seam a module: ``errors`` (:class:`GGUFError`), ``header``
(the binary format: the magic, and a fast bounds-checked reader of the key/value section and
the tensor table), ``info`` (:class:`GGUFInfo` and the facts derived from it), ``read``
(:func:`read_gguf_info`: a header's fields read into a GGUFInfo, architecture by
architecture), ``arrays`` (:func:`read_arrays`: the metadata's arrays whole) and ``text``
(:func:`format_info`). Each name below is importable from this package as it was from the one
module.
"""

from __future__ import annotations

from .arrays import read_arrays
from .errors import GGUFError
from .errors import _Truncated as _Truncated
from .header import GGUF_MAGIC as GGUF_MAGIC
from .header import SUPPORTED_VERSIONS as SUPPORTED_VERSIONS
from .header import _check_magic as _check_magic
from .header import _field_value as _field_value
from .header import _HeaderReader as _HeaderReader
from .info import GGUFInfo, TensorInfo
from .read import LLAMA_MAX_LAYERS as LLAMA_MAX_LAYERS
from .read import read_gguf_info
from .text import format_info

# Besides __all__, the names imported ``as`` themselves above are imported from here by the
# store (its summaries read the header alone) and the tests.
__all__ = [
    "GGUFError",
    "TensorInfo",
    "GGUFInfo",
    "read_gguf_info",
    "read_arrays",
    "format_info",
]
