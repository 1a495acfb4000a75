"""A resolved model: the name the user gave and the files behind it (shared by the
registry, the scheduler and the server; it depends only on the GGUF metadata type), and
Ollama's ``details`` of a model, the one object tags, show and ps answer for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the type only: numpy and gguf stay unloaded for what needs no GGUF read)
    from .gguf_info import GGUFInfo


@dataclass
class ModelRef:
    """A resolved model: the name the user gave and the files behind it."""

    name: str
    path: str
    info: GGUFInfo
    mmproj: str | None = None
    digest: str | None = None
    projector_family: str | None = None  # the projector among the model's families (ModelEntry.projector_family)

    @property
    def key(self) -> str:
        """What a runner is for: the model file, as in Ollama, and its projector. Two names for
        the same file share a runner; the same file with and without a projector does not (a
        child started without ``--mmproj`` cannot read images)."""
        return self.path if not self.mmproj else f"{self.path}+{self.mmproj}"

    @property
    def has_chat_template(self) -> bool:
        """Whether the GGUF carries a chat template (``tokenizer.chat_template``)."""
        return bool((getattr(self.info, "metadata", None) or {}).get("tokenizer.chat_template"))


def model_details(info, parent: str = "", projector: str | None = None) -> dict:
    """Ollama's ``details`` object of a model whose GGUF summary is ``info`` (a GGUFInfo, or
    its dict form as a manifest keeps it), with ``projector`` (the projector's architecture)
    among its families: what tags, show and ps all answer."""
    def get(key: str):
        return info.get(key) if isinstance(info, dict) else getattr(info, key, None)

    arch = get("architecture") or "unknown"
    return {
        "parent_model": parent,
        "format": "gguf",
        "family": arch,
        "families": [arch] + ([projector] if projector else []),
        "parameter_size": parameter_size(int(get("parameter_count") or 0)),
        "quantization_level": get("quantization") or get("file_type") or "unknown",
    }


def parameter_size(n: int) -> str:
    """Ollama-style parameter count: ``8.0B``, ``135M``, ``260K``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.0f}{suffix}" if v >= 100 else f"{v:.1f}{suffix}"
    return str(int(n))
