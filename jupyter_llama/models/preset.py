"""A model's preset: what Ollama's Modelfile adds to the weights (``SYSTEM``, ``TEMPLATE``,
``PARAMETER``, ``MESSAGE``, ``LICENSE``), kept as manifest layers with Ollama's media types.

Each part is one small content-addressed blob, as Ollama stores it, so a manifest stays
compatible with Ollama's (and with a registry pull that brings such layers):

    application/vnd.ollama.image.template   the prompt template, text
    application/vnd.ollama.image.system     the default system message, text
    application/vnd.ollama.image.license    one license text per layer (there may be several)
    application/vnd.ollama.image.params     the parameters, a JSON object (``stop`` a list)
    application/vnd.ollama.image.messages   the messages, a JSON list of {role, content}

Layering a preset on a model that has one merges them as Ollama's create does: a new
template, system or message list replaces the old one, licenses add up, and parameters
merge name by name (the new value wins).

This module checks shapes only; the API layer checks parameter names and kinds
(``api.options.parse_parameters``) before a preset reaches the store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable

__all__ = [
    "SYSTEM_MEDIA_TYPE",
    "TEMPLATE_MEDIA_TYPE",
    "PARAMS_MEDIA_TYPE",
    "LICENSE_MEDIA_TYPE",
    "MESSAGES_MEDIA_TYPE",
    "PRESET_MEDIA_TYPES",
    "Preset",
]

SYSTEM_MEDIA_TYPE = "application/vnd.ollama.image.system"
TEMPLATE_MEDIA_TYPE = "application/vnd.ollama.image.template"
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
LICENSE_MEDIA_TYPE = "application/vnd.ollama.image.license"
MESSAGES_MEDIA_TYPE = "application/vnd.ollama.image.messages"
# media type -> the role ``show`` gives the layer
PRESET_MEDIA_TYPES = {
    TEMPLATE_MEDIA_TYPE: "template",
    SYSTEM_MEDIA_TYPE: "system",
    LICENSE_MEDIA_TYPE: "license",
    PARAMS_MEDIA_TYPE: "params",
    MESSAGES_MEDIA_TYPE: "messages",
}
MAX_LAYER_BYTES = 16 << 20  # far more than any real template, system prompt or license


class PresetError(ValueError):
    """A preset layer's blob does not hold what its media type says."""


@dataclass
class Preset:
    """What a model carries besides its weights. Empty values mean "not set"."""

    system: str = ""
    template: str = ""
    parameters: dict = field(default_factory=dict)  # Ollama option name -> value (``stop``: a list)
    messages: list[dict] = field(default_factory=list)  # [{"role", "content"}]
    license: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.system or self.template or self.parameters or self.messages or self.license)

    def merged(self, new: "Preset") -> "Preset":
        """This preset with ``new`` layered on top (Ollama's create from a model)."""
        params = dict(self.parameters)
        params.update(new.parameters)
        licenses = list(self.license) + [t for t in new.license if t not in self.license]
        return Preset(system=new.system or self.system, template=new.template or self.template,
                      parameters=params, messages=[dict(m) for m in (new.messages or self.messages)],
                      license=licenses)

    def to_dict(self) -> dict:
        return {"system": self.system, "template": self.template, "parameters": dict(self.parameters),
                "messages": [dict(m) for m in self.messages], "license": list(self.license)}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Preset":
        d = d or {}
        lic = d.get("license") or []
        return cls(system=d.get("system") or "", template=d.get("template") or "",
                   parameters=dict(d.get("parameters") or {}),
                   messages=[dict(m) for m in d.get("messages") or []],
                   license=[lic] if isinstance(lic, str) else list(lic))

    def payloads(self) -> list[tuple[str, bytes]]:
        """(media type, blob bytes) per layer, in the order Ollama writes them."""
        out: list[tuple[str, bytes]] = []
        if self.template:
            out.append((TEMPLATE_MEDIA_TYPE, self.template.encode()))
        if self.system:
            out.append((SYSTEM_MEDIA_TYPE, self.system.encode()))
        out += [(LICENSE_MEDIA_TYPE, t.encode()) for t in self.license if t]
        if self.parameters:
            out.append((PARAMS_MEDIA_TYPE, json.dumps(self.parameters, ensure_ascii=False).encode()))
        if self.messages:
            msgs = [{"role": m.get("role", ""), "content": m.get("content", "")} for m in self.messages]
            out.append((MESSAGES_MEDIA_TYPE, json.dumps(msgs, ensure_ascii=False).encode()))
        return out

    @classmethod
    def from_layers(cls, layers: Iterable[dict], read: Callable[[dict], bytes]) -> "Preset":
        """The preset a manifest's layers hold; ``read(layer)`` gives a layer's blob bytes."""
        p = cls()
        for ly in layers:
            mt = ly.get("mediaType")
            if mt not in PRESET_MEDIA_TYPES:
                continue
            data = read(ly)
            try:
                if mt == TEMPLATE_MEDIA_TYPE:
                    p.template = data.decode()
                elif mt == SYSTEM_MEDIA_TYPE:
                    p.system = data.decode()
                elif mt == LICENSE_MEDIA_TYPE:
                    p.license.append(data.decode())
                elif mt == PARAMS_MEDIA_TYPE:
                    params = json.loads(data)
                    if not isinstance(params, dict):
                        raise PresetError("the parameters layer is not a JSON object")
                    p.parameters.update(params)
                elif mt == MESSAGES_MEDIA_TYPE:
                    msgs = json.loads(data)
                    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                        raise PresetError("the messages layer is not a JSON list of messages")
                    p.messages = [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
                                  for m in msgs]
            except (UnicodeDecodeError, ValueError) as e:
                if isinstance(e, PresetError):
                    raise
                raise PresetError(f"the {PRESET_MEDIA_TYPES[mt]} layer is unreadable: {e}") from None
        return p
