"""What the commands share: a command's prompt (a cell's body with its ``{name}``s filled),
calls to the client with a missing model said in words of what to do, the loaded model a
name means, sizes in words, and a file the user names for a command to write."""

from __future__ import annotations

import re
from typing import Callable

from ..models.names import plainly_a_path, same_model
from .frontend import EXIT_USAGE, CommandError, Frontend

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def fill_placeholders(text: str, namespace: dict | None) -> str:
    """``{name}`` becomes ``str(namespace[name])`` when the name exists; anything else stays."""
    if not namespace:
        return text
    return _PLACEHOLDER.sub(lambda m: str(namespace[m.group(1)]) if m.group(1) in namespace else m.group(0), text)


def _prompt(args, fe: Frontend, body: str | None) -> str:
    """The prompt: a cell's body, its {name}s filled, or the line's words (the magic has
    filled a line's {name}s word by word, once it was split)."""
    return fill_placeholders(body.strip(), fe.namespace) if body is not None else " ".join(args.prompt)


class ModelMissing(CommandError):
    """The manager has no model of the name asked for (the message says what to do)."""


def _not_found(fe: Frontend, model: str, message: str) -> CommandError:
    """The manager's "not found" (with its own suggestions of close names), and what to do."""
    if plainly_a_path(model):  # meant as a file (the manager's message says where it looked)
        return ModelMissing(f"{message}. Give the file's path as the manager's machine sees it, or register it "
                            f"with `create NAME --from {model}`")
    return ModelMissing(f"{message}. `pull {model}` downloads it from Ollama's registry (or `pull SOURCE --name "
                        f"{model}` from another source), `synth {model}` makes a synthetic one, `list` shows what "
                        "exists")


def _call(fe: Frontend, func: Callable, *a, model: str | None = None, **kw):
    """Call the client; a model it does not find is said with what to do about it (its other
    errors are the command's sentence: see :func:`execute`)."""
    from ..client import ModelNotFoundError

    try:
        return func(*a, **kw)
    except ModelNotFoundError as e:
        raise _not_found(fe, model or "", e.message) from None


def _loaded(ps: dict, model: str) -> dict | None:
    """The entry of ``ps`` (an /api/ps answer) that ``model`` names: by the name it was loaded
    under, or one of the others of the same file it has answered to."""
    return next((m for m in ps.get("models", [])
                 if any(same_model(n, model) for n in (m.get("name"), m.get("model"), *(m.get("also_as") or [])))),
                None)


def _mib(n) -> str:
    from ..memory.report import format_bytes

    return format_bytes(n or 0)


def _check_output(path: str, example: str = "model.gguf") -> None:
    """A file the user names for us to write: not a folder, in a folder that exists."""
    import os

    if os.path.isdir(path):
        raise CommandError(f"{path} is a folder: give the file to write, such as {os.path.join(path, example)}",
                           EXIT_USAGE)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CommandError(f"cannot write {path}: the folder {folder} does not exist (make it first)", EXIT_USAGE)
