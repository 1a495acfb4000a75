"""A resolved model: the name the user gave and the files behind it (shared by the
registry, the scheduler and the server; it depends only on the GGUF metadata type)."""

from __future__ import annotations

from dataclasses import dataclass

from .gguf_info import GGUFInfo


@dataclass
class ModelRef:
    """A resolved model: the name the user gave and the files behind it."""

    name: str
    path: str
    info: GGUFInfo
    mmproj: str | None = None
    digest: str | None = None

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
