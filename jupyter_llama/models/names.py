"""Model names: Ollama's grammar, ``[host/][namespace/]model[:tag]``.

``parse_name("tiny")`` gives ``local/library/tiny:latest``; its short form (what ``list``
shows, and what Ollama would show) is ``tiny:latest``. ``hf.co/owner/repo:Q4_K_M`` keeps
every part and shows in full.

Defaults: host ``local``, namespace ``library``, tag ``latest``. Ollama's default host is
``registry.ollama.ai``; ours is ``local`` because a bare name given to create, synth or copy
is a model made on this machine, and a manifest filed under ``registry.ollama.ai`` would
claim a provenance it does not have. A model pulled from Ollama's registry (``pull
llama3.2:1b``) is filed under the registry's host, as Ollama files it
(``registry.ollama.ai/library/llama3.2:1b``), and a bare name finds it when no model of that
name was made here (:func:`registry_host`; the store looks there second, and
:func:`same_model` counts both spellings as one model). It is then shown by that bare name,
``llama3.2:1b``, as Ollama shows it (:func:`without_registry`); only beside a model made here
under the same name does it show its host. The namespace stays ``library`` so that
``library/tiny`` and ``tiny`` are one model, as in Ollama.

The grammar (each part ASCII):

* host: letters, digits, ``_``, ``-``, ``.``, ``:`` (a port); at most 350 characters;
* namespace: letters, digits, ``_``, ``-``; at most 80;
* model: letters, digits, ``_``, ``-``, ``.``; at most 96 (a Hugging Face repo name's limit);
* tag: letters, digits, ``_``, ``-``, ``.``; at most 80.

Every part starts with a letter, a digit or ``_``, and none contains ``..``. Names compare
case-insensitively (``Tiny`` and ``tiny`` are one model), as in Ollama; the case given
first is the one shown. Since the parts become directory names in the store, anything
else (path separators, ``..``, control characters, empty or over-long parts) is refused
with a message that says what is wrong. A control character (C0, DEL, C1) is refused even
where a file's path may stand for a name (:func:`refuse_control_characters`, called by
:func:`parse_name` and :func:`plainly_a_path`): such a text is neither, and a NUL in a path
would reach the file system as ``ValueError: embedded null byte``, a 500.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from .. import config
from ..errors import BadRequest

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TAG",
    "DEFAULT_REGISTRY",
    "registry_url",
    "registry_host",
    "also_registry",
    "without_registry",
    "plainly_a_path",
    "InvalidName",
    "ControlCharacterInName",
    "refuse_control_characters",
    "ModelName",
    "parse_name",
    "is_valid_name",
]

DEFAULT_HOST = "local"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
DEFAULT_REGISTRY = "https://registry.ollama.ai"  # JUPYTER_LLAMA_REGISTRY overrides it

_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_ALLOWED = {
    "host": _ALNUM | frozenset("-.:"),
    "namespace": _ALNUM | frozenset("-"),
    "model": _ALNUM | frozenset("-."),
    "tag": _ALNUM | frozenset("-."),
}
_ALLOWED_TEXT = {
    "host": "letters, digits, '_', '-', '.' and ':'",
    "namespace": "letters, digits, '_' and '-'",
    "model": "letters, digits, '_', '-' and '.'",
    "tag": "letters, digits, '_', '-' and '.'",
}
MAX_LENGTH = {"host": 350, "namespace": 80, "model": 96, "tag": 80}


class InvalidName(BadRequest, ValueError):
    """A model name outside the grammar; the message says which part and why (HTTP 400)."""

    def __init__(self, text: str, reason: str):
        self.text = text
        self.reason = reason
        super().__init__(f"invalid model name {text!r}: {reason}")


def _control_character(text: str) -> tuple[int, str] | None:
    """(position from 1, character) of the first control character (C0, DEL, C1) in ``text``."""
    for i, ch in enumerate(text, 1):
        if ch < " " or "\x7f" <= ch <= "\x9f":
            return i, ch
    return None


class ControlCharacterInName(InvalidName):
    """A name (or path) with a control character in it: neither a model name nor a file a
    request may name (a path cannot hold a NUL at all). Its message echoes no part of the
    name, since the character itself would be lost or garble a log line or a terminal."""

    def __init__(self, text: str, position: int, ch: str):
        self.position = position
        self.character = ch
        self.text = text
        self.reason = (f"it has a control character (U+{ord(ch):04X}) at character {position}; a model name "
                       f"may hold only letters, digits, '_', '-' and '.', with '/' between its parts and ':' "
                       f"before its tag ([host/][namespace/]model[:tag], such as llama3.2:1b), and a file's "
                       f"path may hold no control character either")
        super(InvalidName, self).__init__(f"invalid model name: {self.reason}")  # (no repr of the name)


def refuse_control_characters(text: str) -> None:
    """:class:`ControlCharacterInName` (a 400) when ``text`` holds a control character: C0
    (U+0000 to U+001F), DEL or C1. Space, tab and line ends around the text are allowed, as
    every name is read stripped of them. Names and paths both pass here first (through
    :func:`parse_name` and :func:`plainly_a_path`), so no route can carry such a text to
    the file system."""
    found = _control_character(text.strip(" \t\r\n"))
    if found is not None:
        position = found[0] + (len(text) - len(text.lstrip(" \t\r\n")))
        raise ControlCharacterInName(text, position, found[1])


@dataclass(frozen=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """Short form, as Ollama shows it: ``tiny:latest``, ``me/tiny:v1``, ``hf.co/o/r:Q4_K_M``."""
        if self.host.lower() == DEFAULT_HOST:
            if self.namespace.lower() == DEFAULT_NAMESPACE:
                return f"{self.model}:{self.tag}"
            return f"{self.namespace}/{self.model}:{self.tag}"
        return self.full

    @property
    def full(self) -> str:
        """Every part: ``local/library/tiny:latest``."""
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def key(self) -> str:
        """The comparison key: the full form, case-folded."""
        return self.full.casefold()

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """(host, namespace, model, tag): the manifest's path under ``manifests/``."""
        return (self.host, self.namespace, self.model, self.tag)

    def with_tag(self, tag: str) -> "ModelName":
        _check_part(self.full, "tag", tag)
        return ModelName(self.host, self.namespace, self.model, tag)

    def __str__(self) -> str:
        return self.display

    def __eq__(self, other) -> bool:
        if isinstance(other, ModelName):
            return self.key == other.key
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.key)


def _describe(ch: str) -> str:
    if ch == "/":
        return "'/'"
    if ch == "\\":
        return "'\\' (a path separator)"
    if not ch.isprintable() and ch != " ":
        return f"a control character (U+{ord(ch):04X})"
    if ch.isspace():
        return f"whitespace (U+{ord(ch):04X})"
    return repr(ch)


def _check_part(text: str, kind: str, part: str) -> None:
    if part == "":
        where = {"tag": "an empty tag after ':'"}.get(kind, f"an empty {kind}")
        raise InvalidName(text, f"{where} (leading, trailing or doubled '/' or ':'?)")
    limit = MAX_LENGTH[kind]
    if len(part) > limit:
        raise InvalidName(text, f"{kind} is too long ({len(part)} characters, at most {limit})")
    if ".." in part:
        raise InvalidName(text, f"{kind} {part!r} contains '..'")
    allowed = _ALLOWED[kind]
    for ch in part:
        if ch not in allowed:
            if kind == "namespace" and ch == ".":
                raise InvalidName(
                    text,
                    f"namespace {part!r} cannot contain '.'; a name with a host has three parts, "
                    f"host/namespace/model (e.g. hf.co/OWNER/REPO)",
                )
            raise InvalidName(text, f"{kind} {part!r} contains {_describe(ch)}; use {_ALLOWED_TEXT[kind]}")
    if part[0] not in _ALNUM:
        raise InvalidName(text, f"{kind} {part!r} must start with a letter, a digit or '_'")


def parse_name(text: str, default_tag: str = DEFAULT_TAG) -> ModelName:
    """Parse ``[host/][namespace/]model[:tag]``; raises :class:`InvalidName` with the reason."""
    if not isinstance(text, str):
        raise InvalidName(repr(text), "a model name must be a string")
    raw = text
    refuse_control_characters(raw)
    text = text.strip()
    if not text:
        raise InvalidName(raw, "the name is empty")
    if len(text) > sum(MAX_LENGTH.values()) + 3:
        raise InvalidName(raw[:64] + "...", f"the name is too long ({len(text)} characters)")
    for ch in text:
        if not ch.isprintable() or (ch.isspace() and ch != " "):
            raise InvalidName(raw, f"contains {_describe(ch)}")
        if ch == " ":
            raise InvalidName(raw, "contains a space")
    if "://" in text:
        raise InvalidName(raw, "this is a URL, not a model name; download it with pull")
    if "\\" in text:
        raise InvalidName(raw, "contains '\\' (a path separator); parts are separated by '/'")
    if "@" in text:
        raise InvalidName(raw, "'@' (digest references) is not supported; use name:tag")

    colon, slash = text.rfind(":"), text.rfind("/")
    if colon > slash:
        rest, tag = text[:colon], text[colon + 1:]
    else:
        rest, tag = text, default_tag
    if rest == "":
        raise InvalidName(raw, "an empty model name before ':'")
    parts = rest.split("/")
    if len(parts) > 3:
        raise InvalidName(raw, f"too many parts ({len(parts)}); the form is [host/][namespace/]model[:tag]")
    if any(p == "" for p in parts):
        raise InvalidName(raw, "an empty part (leading, trailing or doubled '/')")
    if len(parts) == 1:
        host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
    elif len(parts) == 2:
        host, (namespace, model) = DEFAULT_HOST, parts
    else:
        host, namespace, model = parts
    if ":" in namespace or ":" in model:
        raise InvalidName(raw, "':' may appear only before the tag (or in a host's port)")
    _check_part(raw, "host", host)
    _check_part(raw, "namespace", namespace)
    _check_part(raw, "model", model)
    _check_part(raw, "tag", tag)
    return ModelName(host, namespace, model, tag)


def registry_url() -> str:
    """The Ollama-protocol registry that names without a host are pulled from:
    ``JUPYTER_LLAMA_REGISTRY``, default ``https://registry.ollama.ai`` (no trailing ``/``).
    An ``http://`` registry is used only when it is configured here (tests, a local mirror).
    BadRequest, in words, for a value that is not an http(s) URL with a host."""
    text = (config.env("REGISTRY") or DEFAULT_REGISTRY).strip().rstrip("/")
    u = urllib.parse.urlsplit(text)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or u.username:
        raise BadRequest(f"JUPYTER_LLAMA_REGISTRY must be the http(s) URL of a registry, such as "
                         f"{DEFAULT_REGISTRY}, not {text!r}")
    return text


def registry_host(url: str | None = None) -> str:
    """The host part of a registry URL (default :func:`registry_url`) as a model name spells
    it: ``registry.ollama.ai``, ``127.0.0.1:5000``. BadRequest when no name could hold it."""
    url = url if url is not None else registry_url()
    host = urllib.parse.urlsplit(url).netloc.lower()
    try:
        _check_part(host, "host", host)
    except InvalidName:
        raise BadRequest(f"the registry {url} has a host ({host!r}) that a model name cannot hold; "
                         f"give it by a name made of letters, digits, '-', '.' and a ':port'") from None
    if host == DEFAULT_HOST:
        raise BadRequest(f"the registry {url} has the host {DEFAULT_HOST!r}, which names models made on "
                         f"this machine; give the registry by another name")
    return host


def _registry_host_or_none() -> str | None:
    try:
        return registry_host()
    except BadRequest:
        return None


def also_registry(name: ModelName) -> ModelName | None:
    """The registry's spelling of a name without a host (``tiny`` ->
    ``registry.ollama.ai/library/tiny:latest``), which it also names when no model of that
    name was made here; None for a name with a host of its own."""
    if name.host.lower() != DEFAULT_HOST:
        return None
    host = _registry_host_or_none()
    return ModelName(host, name.namespace, name.model, name.tag) if host else None


def without_registry(name: ModelName) -> ModelName | None:
    """The other way round: the name without a host that finds a model pulled from the
    registry (``registry.ollama.ai/library/tiny:latest`` -> ``tiny:latest``) when no model
    made here has it, and so the name it is shown by then, as Ollama shows it; None for a
    name of another host (a model of another registry, or of one configured before)."""
    host = _registry_host_or_none()
    if host is None or name.host.lower() != host:
        return None
    return ModelName(DEFAULT_HOST, name.namespace, name.model, name.tag)


def plainly_a_path(text: str) -> bool:
    """Whether ``text`` can only be a file on this machine, never a model name: an absolute or
    relative path, or a ``.gguf`` file name. A text with a control character is neither a
    name nor a path, and is refused here (:class:`ControlCharacterInName`, a 400), before
    any caller that tells names from paths hands it to the file system."""
    refuse_control_characters(text)
    return text.startswith(("/", "./", "../", "~")) or text.lower().endswith(".gguf")


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two names name the same model, as the registry resolves them: ``tiny``,
    ``tiny:latest``, ``TINY:Latest`` and ``local/library/tiny:latest`` all do, and so does
    ``registry.ollama.ai/library/tiny:latest`` (a pull of ``tiny``; see :func:`also_registry`).
    The one place names are compared (the panel's TypeScript mirrors it in ``sameModel``). A
    text that is not a valid name equals only itself, case-folded."""
    if not a or not b:
        return False
    try:
        na, nb = parse_name(a), parse_name(b)
    except InvalidName:
        return a.casefold() == b.casefold()
    if na.key == nb.key:
        return True
    if (na.host.lower() == DEFAULT_HOST) == (nb.host.lower() == DEFAULT_HOST):
        return False
    bare, other = (na, nb) if na.host.lower() == DEFAULT_HOST else (nb, na)
    alias = also_registry(bare)
    return alias is not None and alias.key == other.key


def is_valid_name(text: str) -> bool:
    try:
        parse_name(text)
    except InvalidName:
        return False
    return True
