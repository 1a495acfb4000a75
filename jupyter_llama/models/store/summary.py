"""What the store reads of a GGUF file besides its bytes: a projector's summary (checked as
a model's is), the summary a manifest keeps of a model (so ``list`` and ``show`` never reopen
a blob), and a :class:`GGUFInfo` rebuilt from that summary."""

from __future__ import annotations

import os

from ..gguf_info import GGUFError, GGUFInfo
from .errors import InvalidGGUF


def _projector_summary(path: str) -> dict:
    """Validate a projector GGUF (architecture ``clip`` and friends) and summarise it.

    ``read_gguf_info`` wants an LLM's hyperparameters, which a projector does not have, so
    this parses only the header and the tensor table, with the same bounds checks.
    """
    from ..gguf_info import _check_magic, _field_value, _HeaderReader, _Truncated

    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise InvalidGGUF(path, e.strerror or str(e)) from None
    try:
        version = _check_magic(path, size)
        reader = _HeaderReader(path, size)
    except GGUFError as e:
        raise InvalidGGUF(e.path, e.reason) from None
    except _Truncated as e:
        raise InvalidGGUF(path, f"truncated: needs at least {e.needed} bytes, file has {e.size}") from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise InvalidGGUF(path, f"malformed GGUF: {e}") from None
    values = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            shown, _full = _field_value(f)
        except (ValueError, IndexError):
            continue
        if isinstance(shown, (int, float, str, bool)) or shown is None:
            values[key] = shown
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    n_tensors = len(reader.tensors)
    del reader
    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidGGUF(path, "missing required metadata general.architecture")
    if n_tensors == 0:
        raise InvalidGGUF(path, "no tensors: not a projector")
    keep = {k: v for k, v in values.items()
            if k.startswith(("general.", "clip.")) and not (isinstance(v, str) and len(v) > 512)}
    return {
        "file_size": size,
        "version": version,
        "architecture": arch,
        "projector_type": values.get("clip.projector_type"),
        "parameter_count": n_params,
        "tensor_count": n_tensors,
        "metadata": keep,
    }


def _info_from_dict(d: dict, path: str) -> GGUFInfo:
    """A GGUFInfo rebuilt from a manifest's cached summary (no tensor table)."""
    return GGUFInfo(
        path=path,
        file_size=d.get("file_size", 0),
        version=d.get("version", 3),
        architecture=d.get("architecture", "unknown"),
        name=d.get("name"),
        block_count=d.get("block_count", 0),
        embedding_length=d.get("embedding_length", 0),
        feed_forward_length=d.get("feed_forward_length"),
        head_count=d.get("head_count", 0),
        head_count_kv=d.get("head_count_kv", 0),
        key_length=d.get("key_length"),
        value_length=d.get("value_length"),
        context_length=d.get("context_length", 0),
        sliding_window=d.get("sliding_window"),
        swa_layers=d.get("swa_layers"),
        file_type=d.get("file_type"),
        parameter_count=d.get("parameter_count", 0),
        vocab_size=d.get("vocab_size", 0),
        tensors=[],
        metadata=dict(d.get("metadata") or {}),
    )


def info_summary(info: GGUFInfo) -> dict:
    """``info`` as a manifest keeps it: no tensor table, no path."""
    d = info.to_dict(tensors=False)
    d.pop("path", None)
    return d
