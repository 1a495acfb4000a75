'''Ollama's Modelfile: reading one into a create request, and writing one for ``show``.

The syntax (Ollama's docs/modelfile.md), as read here::

    # a comment (a line whose first non-blank character is #)
    FROM <model name | path to a GGUF file>      relative paths are from the Modelfile's folder
    PARAMETER <name> <value>                     repeatable; ``stop`` lines add up
    TEMPLATE <text>
    SYSTEM <text>
    MESSAGE <system|user|assistant> <text>       repeatable, in order
    LICENSE <text>                               repeatable
    ADAPTER <path>                               refused: LoRA adapters are not supported

Instructions are case-insensitive; a value is the rest of the line, or a quoted text that
may span lines: ``"..."`` or ``"""..."""`` (kept exactly as written between the quotes).
Every error names the line and says what to write instead (:class:`ModelfileError`, a
BadRequest). Parameters are typed as ``/api/create`` takes them (``api.options``).

This lives in ``api`` (not ``models``) because typing parameters needs the option table of
``api.options``, and ``api`` already depends on ``models``.
'''

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Iterable

from ..errors import BadRequest
from ..models.names import plainly_a_path
from .options import IGNORED_OPTIONS, format_parameter, parameter_from_text, parse_parameters

__all__ = ["ModelfileError", "Modelfile", "parse_modelfile", "read_modelfile", "write_modelfile", "quote"]

INSTRUCTIONS = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE", "ADAPTER")
_NOT_SUPPORTED = {
    "ADAPTER": "LoRA adapters (ADAPTER) are not supported: merge the adapter into the GGUF (llama.cpp's "
               "llama-export-lora) and give that file to FROM",
    "DRAFT": "draft models (DRAFT) are not supported",
    "RENDERER": "RENDERER is not supported: the model's own chat template, or a TEMPLATE, formats prompts",
    "PARSER": "PARSER is not supported: llama-server parses tool calls and thinking from the chat template",
}
_ROLES = ("system", "user", "assistant")
_WORD = re.compile(r"[A-Za-z]+")
_PARAM_NAME = re.compile(r"[A-Za-z0-9_]+")


class ModelfileError(BadRequest):
    """A Modelfile that cannot be read; the message names the line and what to change."""

    def __init__(self, message: str, line: int = 0):
        self.line = line
        super().__init__(f"Modelfile line {line}: {message}" if line else f"Modelfile: {message}")


@dataclass
class Modelfile:
    """A Modelfile read: where the weights come from, and the preset."""

    from_model: str | None = None  # a model name (FROM NAME)
    from_files: list[str] = field(default_factory=list)  # absolute GGUF paths (FROM FILE; two: model + mmproj)
    system: str = ""
    template: str = ""
    parameters: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def create_body(self, model: str, files: dict[str, str] | None = None) -> dict:
        """The ``/api/create`` body; ``files`` (file name -> digest) once ``from_files`` are uploaded."""
        body: dict = {"model": model}
        if self.from_files:
            if files is None:
                raise ValueError("upload from_files first and pass their digests")
            body["files"] = dict(files)
        else:
            body["from"] = self.from_model
        for key in ("system", "template", "parameters", "messages", "license"):
            value = getattr(self, key)
            if value:
                body[key] = value
        return body


# ----------------------------------------------------------------------------- reading


def _value(lines: list[str], i: int, start: int, what: str) -> tuple[str, int]:
    """The value that begins at column ``start`` of line ``i``: the rest of the line, or a
    quoted text that may run over several lines. Returns (value, index of its last line)."""
    first = lines[i][start:].lstrip(" \t")
    if not first.strip():
        raise ModelfileError(f"{what} needs a value after it", i + 1)
    for q in ('"""', '"'):
        if first.startswith(q):
            text = first[len(q):]
            j = i
            close = re.compile(re.escape(q) + '(?!")')  # the last quotes of a run: a text may end in "
            while True:
                hit = close.search(text)
                end = hit.start() if hit else -1
                if end >= 0:
                    rest = text[end + len(q):]
                    if rest.strip():
                        raise ModelfileError(f"text after the closing {q} of {what}: {rest.strip()[:40]}; "
                                             f"put it inside the quotes, or on a line of its own", j + 1)
                    return text[:end], j
                j += 1
                if j >= len(lines):
                    raise ModelfileError(f"the {q} that opens {what} here is never closed; end the text with {q}",
                                         i + 1)
                text += "\n" + lines[j]
    return first.strip(), i


def parse_modelfile(text: str, folder: str | os.PathLike | None = None) -> Modelfile:
    """Read Modelfile ``text``; relative FROM paths are resolved against ``folder`` (default: the
    working directory). ModelfileError, with the line, for anything it cannot take."""
    if text.startswith("\ufeff"):
        text = text[1:]
    base = os.path.abspath(os.fspath(folder)) if folder is not None else os.getcwd()
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    mf = Modelfile()
    froms: list[tuple[str, int]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        n = i + 1
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        indent = len(line) - len(line.lstrip(" \t"))
        m = _WORD.match(line, indent)
        word = m.group(0) if m else ""
        after = line[indent + len(word): indent + len(word) + 1]
        if not word or (after and after not in " \t"):
            shown = stripped.split()[0][:40]
            raise ModelfileError(f'"{shown}" is not an instruction; a Modelfile line starts with one of '
                                 f"{', '.join(INSTRUCTIONS)} (or # for a comment)", n)
        name = word.upper()
        if name in _NOT_SUPPORTED:
            raise ModelfileError(_NOT_SUPPORTED[name], n)
        if name == "REQUIRES":  # the least Ollama version the model needs: nothing to check here
            _, i = _value(lines, i, indent + len(word), name)
            i += 1
            continue
        if name not in INSTRUCTIONS:
            close = difflib.get_close_matches(name, INSTRUCTIONS, n=1, cutoff=0.6)
            hint = f' (did you mean {close[0]}?)' if close else ""
            raise ModelfileError(f'unknown instruction "{word}"{hint}; a Modelfile line starts with one of '
                                 f"{', '.join(INSTRUCTIONS)} (or # for a comment)", n)
        col = indent + len(word)
        if name in ("PARAMETER", "MESSAGE"):
            rest = line[col:]
            m2 = re.match(r"[ \t]+(\S+)", rest)
            if not m2:
                what = "a parameter name and a value (PARAMETER temperature 0.7)" if name == "PARAMETER" else \
                    "a role and a text (MESSAGE user Hello)"
                raise ModelfileError(f"{name} needs {what}", n)
            key = m2.group(1)
            col += m2.end()
            if name == "PARAMETER":
                if not _PARAM_NAME.fullmatch(key):
                    raise ModelfileError(f'"{key}" is not a parameter name', n)
                value, i = _value(lines, i, col, f"PARAMETER {key}")
                if key in IGNORED_OPTIONS:
                    mf.warnings.append(f"line {n}: the parameter {key} is no longer used; it is ignored")
                else:
                    try:
                        typed = parameter_from_text(key, value, where="PARAMETER")
                        parse_parameters({key: typed}, where="PARAMETER")  # its range, as requests are held to
                    except BadRequest as e:
                        raise ModelfileError(str(e), n) from None
                    if key == "stop":
                        mf.parameters.setdefault("stop", []).append(typed)
                    else:
                        mf.parameters[key] = typed
            else:
                role = key.lower()
                if role not in _ROLES:
                    raise ModelfileError(f'the role of a MESSAGE is system, user or assistant, not "{key}"', n)
                value, i = _value(lines, i, col, f"MESSAGE {key}")
                mf.messages.append({"role": role, "content": value})
        else:
            value, i = _value(lines, i, col, name)
            if name == "FROM":
                froms.append((value, n))
            elif name == "LICENSE":
                mf.license.append(value)
            else:
                setattr(mf, name.lower(), value)
        i += 1
    if not froms:
        raise ModelfileError("there is no FROM line; start with FROM and a model name or a GGUF file "
                             "(FROM ./model.gguf)")
    for value, n in froms:
        _add_from(mf, value, n, base)
    if mf.from_model and mf.from_files:
        raise ModelfileError("FROM names both a model and a file; use one model, or GGUF files (a model and "
                             "its projector)")
    if mf.from_model and sum(1 for v, _ in froms if not _is_file(v, base)) > 1:
        raise ModelfileError("more than one FROM names a model; keep one")
    if len(mf.from_files) > 2:
        raise ModelfileError("at most two FROM files: the model's GGUF and its multimodal projector (mmproj)")
    return mf


def _expand(value: str, base: str) -> str:
    return os.path.abspath(os.path.join(base, os.path.expanduser(value)))


def _is_file(value: str, base: str) -> bool:
    return os.path.isfile(_expand(value, base))


def _add_from(mf: Modelfile, value: str, n: int, base: str) -> None:
    path = _expand(value, base)
    if os.path.isdir(path) and (value.startswith((".", "/", "~")) or os.sep in value):
        raise ModelfileError(f"FROM {value} is a folder; give a GGUF file (safetensors folders are not supported)",
                             n)
    if os.path.isfile(path):
        mf.from_files.append(path)
        return
    if plainly_a_path(value):
        raise ModelfileError(f"FROM {value}: there is no such file ({path}); relative paths are read from the "
                             "Modelfile's folder", n)
    mf.from_model = value


def read_modelfile(path: str | os.PathLike) -> Modelfile:
    """Read the Modelfile at ``path`` (FROM paths relative to its folder)."""
    p = os.path.abspath(os.fspath(path))
    try:
        with open(p, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ModelfileError(f"there is no file {p}") from None
    except IsADirectoryError:
        raise ModelfileError(f"{p} is a folder; give the Modelfile's path") from None
    except UnicodeDecodeError:
        raise ModelfileError(f"{p} is not UTF-8 text") from None
    except OSError as e:
        raise ModelfileError(f"cannot read {p}: {e.strerror or e}") from None
    return parse_modelfile(text, os.path.dirname(p))


# ----------------------------------------------------------------------------- writing


def quote(value: str) -> str:
    """A value as a Modelfile writes it: bare when it is one plain line, else in triple quotes."""
    if value and "\n" not in value and value == value.strip() and not value.startswith('"'):
        return value
    if '"""' not in value:
        return f'"""{value}"""'
    return f'"{value}"'


def write_modelfile(from_lines: Iterable[str], system: str = "", template: str = "", parameters: dict | None = None,
                    messages: Iterable[dict] = (), license: Iterable[str] = (), header: Iterable[str] = ()) -> str:
    """A Modelfile that recreates a model: its FROM lines (the weights), then its preset."""
    out = list(header)
    out += [f"FROM {f}" for f in from_lines]
    if template:
        out.append(f"TEMPLATE {quote(template)}")
    if system:
        out.append(f"SYSTEM {quote(system)}")
    for name, value in (parameters or {}).items():
        for v in (value if isinstance(value, list) else [value]):
            out.append(f"PARAMETER {name} {quote(format_parameter(v, quoted=False))}")
    for m in messages:
        out.append(f"MESSAGE {m.get('role', '')} {quote(str(m.get('content', '')))}")
    for lic in license:
        out.append(f"LICENSE {quote(lic)}")
    return "\n".join(out) + "\n"
