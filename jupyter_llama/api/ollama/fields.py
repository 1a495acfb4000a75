"""A request's JSON body and its fields.

:func:`parse_body` decodes a body, refusing what no later step could take: a JSON value
other than an object, NaN or Infinity, nesting deeper than :data:`MAX_JSON_DEPTH`, or half
of a UTF-16 surrogate pair. The readers of one field (:func:`model_name` and the private
ones for booleans and strings) raise :class:`~jupyter_llama.errors.BadRequest` saying what
is wrong with it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ...config import json_kind, shown
from ...errors import BadRequest


def parse_body(raw: bytes | str | None) -> dict:
    """A request body as a JSON object; BadRequest for anything else."""
    if raw is None or (isinstance(raw, (bytes, str)) and not raw.strip()):
        raise BadRequest("missing request body: expected a JSON object")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON in request body: {e}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_kind(data)}")
    _check_depth(data)
    if _SURROGATE_ESCAPE.search(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")):
        _check_surrogates(data)
    return data


# Half of a UTF-16 pair without its other half: a high escape (\uD800-\uDBFF) not followed
# by a low one, a low one (\uDC00-\uDFFF) not after a high one, or such a half written as
# UTF-8 bytes (ED A0-BF ..), which json.loads also lets through. It leaves a lone half in a
# string, which no UTF-8 encoder (ours, the child's) takes. Only a body with one is looked
# through (a whole pair, an emoji from a client that escapes non-ASCII, is not).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                               rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_surrogates(data: Any) -> None:
    """BadRequest naming where a string of ``data`` holds an unpaired UTF-16 surrogate."""
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        value, where = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            at = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
            for text, what in ((key, f"a name in {where or 'the body'}"), (item, f"the text of {at}")):
                found = _SURROGATE.search(text) if isinstance(text, str) else None
                if found is not None:
                    raise BadRequest(f"{what} holds \\u{ord(found.group()):04x}, half of a UTF-16 surrogate pair "
                                     "without its other half, which is not a character: send valid Unicode (a "
                                     "\\ud800-\\udbff escape must be followed by a \\udc00-\\udfff one)")
            if isinstance(item, (dict, list)):
                todo.append((item, at))


MAX_JSON_DEPTH = 64  # far more than any request needs; deeper would recurse in every later step


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _check_depth(data: Any) -> None:
    todo = [(data, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        if isinstance(value, dict):
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)


def model_name(body: dict, key: str = "model") -> str:
    name = body.get(key)
    if name is None and key == "model":
        name = body.get("name")  # Ollama's older field name
    if not isinstance(name, str) or not name.strip():
        raise BadRequest(f"{key} is required" if name is None or name == "" else
                         f"{key} must be a string, got {shown(name)}")
    return name.strip()


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {shown(v)}")
    return v


def _str(body: dict, key: str, default: str = "") -> str:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise BadRequest(f"{key} must be a string, got {json_kind(v)}")
    return v
