"""Ollama's prompt templates (Go ``text/template``), the part of the language they use.

A Modelfile's ``TEMPLATE`` is a Go template over Ollama's values: ``.System``, ``.Prompt``,
``.Response``, ``.Messages`` (each with ``.Role``, ``.Content`` ...), ``.Tools``, ``.Think``.
llama-server only runs the GGUF's own Jinja chat template, so a preset template is rendered
here, into the prompt text, and that text goes to llama-server's ``/completion``.

This is our own interpreter of the subset real Modelfile templates use: text and actions
with ``{{-``/``-}}`` trimming, comments, fields and variables (``.Role``, ``$.System``,
``$i``), ``:=``/``=``, ``if``/``else if``/``else``, ``range`` (with ``$i, $m :=``, ``else``,
``break``, ``continue``), ``with``, pipes and parentheses, literals, and the functions
``and or not eq ne lt le gt ge len index slice print printf println json currentDate
yesterdayDate``. Anything else (``define``/``template``/``block``, other functions, method
calls) raises :class:`TemplateUnsupported` when the template is parsed, so a caller can
fall back to the model's own chat template instead of producing a wrong prompt; text that
is not a template at all raises :class:`TemplateSyntaxError` (a BadRequest).

How a conversation becomes values follows Ollama: consecutive messages of one role are
joined (blank line between), all system texts make ``.System``; a template that mentions
``.Messages`` is run once over them; one that does not is run once per exchange with
``.System``/``.Prompt``/``.Response``, the last run cut off after its ``.Response`` (the
answer goes there); a template naming neither gets ``{{ .Response }}`` appended.

Pure functions, no I/O.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..errors import BadRequest

__all__ = ["GoTemplate", "TemplateSyntaxError", "TemplateUnsupported", "TemplateError", "collate"]


class TemplateSyntaxError(BadRequest):
    """The text is not a Go template (an unclosed action, an ``end`` without a block ...)."""


class TemplateUnsupported(Exception):
    """A valid-looking template that uses a feature this interpreter does not run."""


class TemplateError(BadRequest):
    """Running the template failed (an index out of range, a bad printf ...)."""


FUNCTIONS = {"and", "or", "not", "eq", "ne", "lt", "le", "gt", "ge", "len", "index", "slice", "print", "printf",
             "println", "json", "currentDate", "yesterdayDate"}
_KEYWORDS = {"if", "else", "end", "range", "with", "break", "continue"}
_UNSUPPORTED = {"define", "template", "block"}


# ----------------------------------------------------------------------------- lexing

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\]|\\.)*')
  | (?P<decl>:=)
  | (?P<assign>=)
  | (?P<lp>\() | (?P<rp>\)) | (?P<pipe>\|) | (?P<comma>,)
  | (?P<var>\$[A-Za-z0-9_]*)(?P<varchain>(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+)
  | (?P<num>[+-]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?))
  | (?P<dot>\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
""", re.VERBOSE | re.DOTALL)


@dataclass
class _Tok:
    kind: str
    text: str
    pos: int
    chain: tuple[str, ...] = ()  # for fields, variables, and a field chain right after ")"


def _tokens(body: str, where: int) -> list[_Tok]:
    out: list[_Tok] = []
    i = 0
    while i < len(body):
        m = _TOKEN.match(body, i)
        if m is None:
            raise TemplateSyntaxError(f"template: unexpected {body[i]!s} in action at character {where + i}")
        kind = m.lastgroup
        assert kind is not None  # every alternative of _TOKEN is a named group
        if kind == "varchain":
            kind = "var"
        text = m.group(0)
        if kind == "var":
            name = m.group("var")
            chain = tuple(x for x in (m.group("varchain") or "").split(".") if x)
            out.append(_Tok("var", name, where + i, chain))
        elif kind == "field":
            chain = tuple(x for x in text.split(".") if x)
            if out and out[-1].kind == "rp" and out[-1].pos + 1 == where + i:
                out[-1].chain = chain  # (pipeline).Field
            else:
                out.append(_Tok("field", text, where + i, chain))
        elif kind != "ws":
            out.append(_Tok(kind, text, where + i))
        i = m.end()
    return out


@dataclass
class _Action:
    tokens: list[_Tok]
    pos: int
    line: int


def _split(src: str) -> list[str | _Action]:
    """Text pieces and actions, trim markers applied, comments dropped."""
    items: list[str | _Action] = []
    i = 0
    trim_next = False
    while True:
        j = src.find("{{", i)
        text = src[i:] if j < 0 else src[i:j]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if j < 0:
            if text:
                items.append(text)
            return items
        k = j + 2
        trim_left = src.startswith("- ", k) or src.startswith("-\t", k) or src.startswith("-\n", k) \
            or src.startswith("-\r", k)
        if trim_left:
            text = text.rstrip(" \t\r\n")
            k += 1
        if text:
            items.append(text)
        # find the closing braces, past strings and comments
        p = k
        while p < len(src) and src[p] in " \t\r\n":
            p += 1
        comment = src.startswith("/*", p)
        if comment:
            e = src.find("*/", p + 2)
            if e < 0:
                raise TemplateSyntaxError(f"template: unclosed comment (line {src.count(chr(10), 0, j) + 1})")
            p = e + 2
        end = None
        q = p
        while q < len(src):
            c = src[q]
            if c in "\"'`":
                close = src.find(c, q + 1) if c == "`" else _string_end(src, q)
                if close < 0:
                    break
                q = close + 1
                continue
            if src.startswith("}}", q):
                end = q
                break
            q += 1
        if end is None:
            raise TemplateSyntaxError(f"template: unclosed action (line {src.count(chr(10), 0, j) + 1}): "
                                      "every {{ needs its }}")
        body = src[p:end]
        # " -}}": a space, then the dash, then the braces (so {{ 3-}} is not a trim)
        trim_right = body.endswith("-") and (len(body) >= 2 and body[-2] in " \t\r\n" or comment and body == "-")
        if trim_right:
            body = body[:-1]
        if comment:
            if body.strip(" \t\r\n"):
                raise TemplateSyntaxError(f"template: text after a comment in one action "
                                          f"(line {src.count(chr(10), 0, j) + 1})")
        else:
            line = src.count("\n", 0, j) + 1
            toks = _tokens(body, k)
            if not toks:
                raise TemplateSyntaxError(f"template: empty action {{{{}}}} (line {line})")
            items.append(_Action(toks, j, line))
        trim_next = trim_right
        i = end + 2


def _string_end(src: str, q: int) -> int:
    c = src[q]
    r = q + 1
    while r < len(src):
        if src[r] == "\\":
            r += 2
            continue
        if src[r] == c:
            return r
        if src[r] == "\n":
            return -1
        r += 1
    return -1


# ----------------------------------------------------------------------------- tree


@dataclass
class _Pipe:
    decl: list[str]  # variables declared or assigned
    assign: bool  # "=" (assign to existing) rather than ":="
    cmds: list[list[Any]]  # each command: a list of operands (first may be a function name)


@dataclass
class _Output:
    pipe: _Pipe


@dataclass
class _If:
    branches: list[tuple[_Pipe, list]]
    other: list | None = None


@dataclass
class _Range:
    pipe: _Pipe
    body: list
    other: list | None = None


@dataclass
class _With:
    pipe: _Pipe
    body: list
    other: list | None = None


@dataclass
class _Loop:
    word: str  # break | continue


# operands
@dataclass
class _Field:
    chain: tuple[str, ...]


@dataclass
class _Var:
    name: str
    chain: tuple[str, ...]


@dataclass
class _Lit:
    value: Any


@dataclass
class _Func:
    name: str


@dataclass
class _Sub:
    pipe: _Pipe
    chain: tuple[str, ...] = ()


class _Parser:
    def __init__(self, items: list):
        self.items = items
        self.i = 0
        self.loops = 0

    def fail(self, act: _Action, msg: str) -> NoReturn:
        raise TemplateSyntaxError(f"template (line {act.line}): {msg}")

    def parse_list(self, stop: tuple[str, ...]) -> tuple[list, _Action | None]:
        nodes: list = []
        while self.i < len(self.items):
            it = self.items[self.i]
            self.i += 1
            if isinstance(it, str):
                nodes.append(it)
                continue
            first = it.tokens[0]
            word = first.text if first.kind == "ident" else ""
            if word in ("end", "else"):
                if word not in stop:
                    self.fail(it, f"unexpected {{{{ {word} }}}}")
                return nodes, it
            if word in _UNSUPPORTED:
                raise TemplateUnsupported(f"{{{{ {word} }}}} (line {it.line})")
            if word == "if":
                nodes.append(self.parse_if(it, it.tokens[1:]))
            elif word in ("range", "with"):
                pipe = self.pipe(it, it.tokens[1:], allow_decl=True)
                if word == "range":
                    self.loops += 1
                body, term = self.parse_list(("end", "else"))
                if word == "range":
                    self.loops -= 1
                other = None
                if term is None:
                    self.fail(it, f"{{{{ {word} }}}} has no {{{{ end }}}}")
                if term.tokens[0].text == "else":
                    if len(term.tokens) > 1:
                        raise TemplateUnsupported(f"{{{{ else {term.tokens[1].text} }}}} after {word} "
                                                  f"(line {term.line})")
                    other, term = self.parse_list(("end",))
                    if term is None:
                        self.fail(it, f"{{{{ {word} }}}} has no {{{{ end }}}}")
                self.end_only(term)
                nodes.append((_Range if word == "range" else _With)(pipe, body, other))
            elif word in ("break", "continue"):
                if not self.loops:
                    self.fail(it, f"{{{{ {word} }}}} outside a range")
                nodes.append(_Loop(word))
            else:
                nodes.append(_Output(self.pipe(it, it.tokens, allow_decl=True)))
        return nodes, None

    def end_only(self, term: _Action) -> None:
        if len(term.tokens) > 1:
            self.fail(term, "{{ end }} takes nothing after it")

    def parse_if(self, it: _Action, toks: list[_Tok]) -> _If:
        node = _If([])
        cond = self.pipe(it, toks, allow_decl=True)
        while True:
            body, term = self.parse_list(("end", "else"))
            node.branches.append((cond, body))
            if term is None:
                self.fail(it, "{{ if }} has no {{ end }}")
            if term.tokens[0].text == "end":
                self.end_only(term)
                return node
            rest = term.tokens[1:]
            if rest and rest[0].kind == "ident" and rest[0].text == "if":
                cond = self.pipe(term, rest[1:], allow_decl=True)
                continue
            if rest:
                raise TemplateUnsupported(f"{{{{ else {rest[0].text} }}}} (line {term.line})")
            other, term = self.parse_list(("end",))
            if term is None:
                self.fail(it, "{{ if }} has no {{ end }}")
            self.end_only(term)
            node.other = other
            return node

    def pipe(self, it: _Action, toks: list[_Tok], allow_decl: bool = False) -> _Pipe:
        if not toks:
            self.fail(it, "missing value")
        decl: list[str] = []
        assign = False
        # $a := ..., $a, $b := ..., $a = ...
        k = 0
        names = []
        while k < len(toks) and toks[k].kind == "var" and not toks[k].chain:
            names.append(toks[k].text)
            if k + 1 < len(toks) and toks[k + 1].kind == "comma":
                k += 2
                continue
            break
        if names and k + 1 < len(toks) and toks[k + 1].kind in ("decl", "assign"):
            if not allow_decl:
                self.fail(it, "a declaration is not allowed here")
            decl, assign = names, toks[k + 1].kind == "assign"
            toks = toks[k + 2:]
            if not toks:
                self.fail(it, "missing value after :=")
        cmds: list[list[Any]] = [[]]
        j = 0
        while j < len(toks):
            t = toks[j]
            if t.kind == "pipe":
                if not cmds[-1]:
                    self.fail(it, "missing command before |")
                cmds.append([])
            elif t.kind == "lp":
                # find the matching ")"
                depth, e = 1, j + 1
                while e < len(toks) and depth:
                    depth += {"lp": 1, "rp": -1}.get(toks[e].kind, 0)
                    e += 1
                if depth:
                    self.fail(it, "unclosed (")
                inner = self.pipe(it, toks[j + 1:e - 1])
                cmds[-1].append(_Sub(inner, toks[e - 1].chain))
                j = e
                continue
            elif t.kind == "rp":
                self.fail(it, "unexpected )")
            elif t.kind in ("decl", "assign", "comma"):
                self.fail(it, f"unexpected {t.text}")
            else:
                cmds[-1].append(self.operand(it, t))
            j += 1
        if not cmds[-1]:
            self.fail(it, "missing command after |")
        for n, cmd in enumerate(cmds):
            head = cmd[0]
            if not isinstance(head, _Func) and len(cmd) > 1:
                raise TemplateUnsupported(f"a method call or value with arguments (line {it.line})")
            if n and not isinstance(head, _Func):
                raise TemplateUnsupported(f"piping into a value that is not a function (line {it.line})")
        return _Pipe(decl, assign, cmds)

    def operand(self, it: _Action, t: _Tok):
        if t.kind == "field":
            return _Field(t.chain)
        if t.kind == "var":
            return _Var(t.text, t.chain)
        if t.kind == "dot":
            return _Field(())
        if t.kind == "str":
            return _Lit(_go_string(t.text, it))
        if t.kind == "raw":
            return _Lit(t.text[1:-1])
        if t.kind == "char":
            raise TemplateUnsupported(f"character constants (line {it.line})")
        if t.kind == "num":
            text = t.text
            try:
                if re.fullmatch(r"[+-]?0[xX][0-9a-fA-F]+", text):
                    return _Lit(int(text, 16))
                if re.fullmatch(r"[+-]?\d+", text):
                    return _Lit(int(text))
                return _Lit(float(text))
            except ValueError:
                self.fail(it, f"bad number {text}")
        if t.kind == "ident":
            if t.text in ("true", "false"):
                return _Lit(t.text == "true")
            if t.text == "nil":
                return _Lit(None)
            if t.text in FUNCTIONS:
                return _Func(t.text)
            if t.text in _KEYWORDS or t.text in _UNSUPPORTED:
                self.fail(it, f"{t.text} cannot be used here")
            raise TemplateUnsupported(f'the function "{t.text}" (line {it.line})')
        self.fail(it, f"unexpected {t.text}")


def _go_string(text: str, it: _Action) -> str:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return text[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    except (UnicodeDecodeError, UnicodeEncodeError):
        raise TemplateSyntaxError(f"template (line {it.line}): bad string {text}") from None


# ----------------------------------------------------------------------------- running


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def _truth(v) -> bool:
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return v != 0
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    return True


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        t = repr(v)
        return t[:-2] if t.endswith(".0") else t
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{_text(v[k])}" for k in sorted(v)) + "]"
    return str(v)


def _field(v, name: str):
    if isinstance(v, dict):
        return v.get(name)
    return None


def _printf(fmt: str, *args) -> str:
    out = []
    it = iter(args)
    i = 0
    while i < len(fmt):
        c = fmt[i]
        if c != "%" or i + 1 >= len(fmt):
            out.append(c)
            i += 1
            continue
        verb = fmt[i + 1]
        i += 2
        if verb == "%":
            out.append("%")
            continue
        try:
            a = next(it)
        except StopIteration:
            out.append(f"%!{verb}(MISSING)")
            continue
        if verb in "sv":
            out.append(_text(a))
        elif verb == "d":
            out.append(str(int(a)))
        elif verb == "q":
            out.append(json.dumps(_text(a)))
        elif verb == "f":
            out.append(f"{float(a):f}")
        else:
            raise TemplateUnsupported(f"printf verb %{verb}")
    return "".join(out)


def _call(name: str, args: list):
    try:
        if name == "not":
            return not _truth(args[0])
        if name in ("eq", "ne"):
            hit = any(args[0] == b for b in args[1:])
            return hit if name == "eq" else not hit
        if name in ("lt", "le", "gt", "ge"):
            a, b = args
            return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[name]
        if name == "len":
            return len(args[0]) if args[0] is not None else 0
        if name == "index":
            v = args[0]
            for k in args[1:]:
                v = v[k]
            return v
        if name == "slice":
            v = args[0]
            if len(args) == 1:
                return v
            lo = args[1]
            hi = args[2] if len(args) > 2 else len(v)
            if not 0 <= lo <= hi <= len(v):
                raise IndexError(f"slice bounds out of range [{lo}:{hi}] with length {len(v)}")
            return v[lo:hi]
        if name == "print":
            out = []
            for n, a in enumerate(args):  # Go: a space between operands when neither is a string
                if n and not isinstance(a, str) and not isinstance(args[n - 1], str):
                    out.append(" ")
                out.append(_text(a))
            return "".join(out)
        if name == "println":
            return " ".join(_text(a) for a in args) + "\n"
        if name == "printf":
            return _printf(str(args[0]), *args[1:])
        if name == "json":
            return json.dumps(args[0], separators=(",", ":"), ensure_ascii=False)
        if name == "currentDate":
            return _dt.date.today().isoformat()
        if name == "yesterdayDate":
            return (_dt.date.today() - _dt.timedelta(days=1)).isoformat()
    except TemplateUnsupported:
        raise
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise TemplateError(f"the template's {name} failed: {e}") from None
    raise TemplateUnsupported(f'the function "{name}"')  # pragma: no cover - parse refuses it first


class _Run:
    def __init__(self, root: Any) -> None:
        self.out: list[str] = []
        self.root = root
        self.scopes: list[dict] = [{"$": root}]

    def var(self, name: str):
        for s in reversed(self.scopes):
            if name in s:
                return s[name]
        raise TemplateError(f"the template uses the variable {name} before setting it")

    def chain(self, v, chain):
        for name in chain:
            v = _field(v, name)
        return v

    def operand(self, op, dot, final=None):
        if isinstance(op, _Field):
            return self.chain(dot, op.chain)
        if isinstance(op, _Var):
            return self.chain(self.var(op.name), op.chain)
        if isinstance(op, _Lit):
            return op.value
        if isinstance(op, _Sub):
            return self.chain(self.pipe(op.pipe, dot), op.chain)
        raise TemplateError("a function name used as a value")  # pragma: no cover

    def command(self, cmd, dot, piped=None, has_piped=False):
        head = cmd[0]
        if isinstance(head, _Func):
            if head.name in ("and", "or"):
                ops = list(cmd[1:])
                vals = [lambda o=o: self.operand(o, dot) for o in ops]
                if has_piped:
                    vals.append(lambda: piped)
                if not vals:
                    raise TemplateError(f"{head.name} needs at least one value")
                v = None
                for f in vals:
                    v = f()
                    if _truth(v) != (head.name == "and"):
                        return v
                return v
            args = [self.operand(o, dot) for o in cmd[1:]]
            if has_piped:
                args.append(piped)
            return _call(head.name, args)
        return self.operand(head, dot)

    def pipe(self, p: _Pipe, dot):
        v = None
        for n, cmd in enumerate(p.cmds):
            v = self.command(cmd, dot, v, has_piped=n > 0)
        if p.decl:
            if p.assign:
                for name in p.decl:
                    for s in reversed(self.scopes):
                        if name in s:
                            s[name] = v
                            break
                    else:
                        raise TemplateError(f"the template assigns {name} before declaring it")
            else:
                self.scopes[-1][p.decl[-1]] = v
        return v

    def nodes(self, nodes: list, dot) -> None:
        for n in nodes:
            if isinstance(n, str):
                self.out.append(n)
            elif isinstance(n, _Output):
                v = self.pipe(n.pipe, dot)
                if not n.pipe.decl:
                    self.out.append(_text(v))
            elif isinstance(n, _If):
                self.run_if(n, dot)
            elif isinstance(n, _Range):
                self.run_range(n, dot)
            elif isinstance(n, _With):
                self.scopes.append({})
                try:
                    v = self.pipe(n.pipe, dot)
                    if _truth(v):
                        self.nodes(n.body, v)
                    elif n.other is not None:
                        self.nodes(n.other, dot)
                finally:
                    self.scopes.pop()
            elif isinstance(n, _Loop):
                raise _Break() if n.word == "break" else _Continue()

    def run_if(self, n: _If, dot) -> None:
        self.scopes.append({})
        try:
            for cond, body in n.branches:
                if _truth(self.pipe(cond, dot)):
                    self.nodes(body, dot)
                    return
            if n.other is not None:
                self.nodes(n.other, dot)
        finally:
            self.scopes.pop()

    def run_range(self, n: _Range, dot) -> None:
        p = n.pipe
        inner = _Pipe([], False, p.cmds)
        self.scopes.append({})
        try:
            v = self.pipe(inner, dot)
            if v is None:
                items: list = []
            elif isinstance(v, dict):
                items = [(k, v[k]) for k in sorted(v)]
            elif isinstance(v, (list, tuple, str)):
                items = list(enumerate(v))
            elif isinstance(v, int) and not isinstance(v, bool):
                items = [(i, i) for i in range(v)]
            else:
                raise TemplateError(f"range over {_text(v)}, which is not a list")
            if not items:
                if n.other is not None:
                    self.nodes(n.other, dot)
                return
            for k, x in items:
                scope = {}
                if len(p.decl) == 1:
                    scope[p.decl[0]] = x
                elif len(p.decl) >= 2:
                    scope[p.decl[0]], scope[p.decl[1]] = k, x
                self.scopes.append(scope)
                try:
                    self.nodes(n.body, x)
                except _Continue:
                    pass
                except _Break:
                    break
                finally:
                    self.scopes.pop()
        finally:
            self.scopes.pop()


# ----------------------------------------------------------------------------- the template


def _pipe_fields(p: _Pipe):
    for cmd in p.cmds:
        for op in cmd:
            if isinstance(op, (_Field, _Var)):
                yield op
            elif isinstance(op, _Sub):
                yield from _pipe_fields(op.pipe)


def _walk(nodes: list):
    for n in nodes:
        yield n
        if isinstance(n, _If):
            for _, body in n.branches:
                yield from _walk(body)
            if n.other:
                yield from _walk(n.other)
        elif isinstance(n, (_Range, _With)):
            yield from _walk(n.body)
            if n.other:
                yield from _walk(n.other)


def _pipes(nodes: list):
    for n in _walk(nodes):
        if isinstance(n, _Output):
            yield n.pipe
        elif isinstance(n, _If):
            yield from (c for c, _ in n.branches)
        elif isinstance(n, (_Range, _With)):
            yield n.pipe


def _prints_response(n) -> bool:
    """An action printing a value whose field chain names Response (where Ollama cuts)."""
    return isinstance(n, _Output) and any(
        isinstance(op, _Field) and "Response" in op.chain for cmd in n.pipe.cmds for op in cmd)


def _cut(nodes: list, state: list[bool]) -> list:
    """The nodes up to and including the first action that prints ``.Response``, in the order
    they are written (Ollama's cut of the last exchange: the answer follows it)."""
    out: list = []
    for n in nodes:
        if state[0]:
            break
        if isinstance(n, _If):
            branches = [(c, _cut(body, state)) for c, body in n.branches]
            other = _cut(n.other, state) if n.other is not None else None
            out.append(_If(branches, other))
        elif isinstance(n, (_Range, _With)):
            body = _cut(n.body, state)
            other = _cut(n.other, state) if n.other is not None else None
            out.append(type(n)(n.pipe, body, other))
        else:
            out.append(n)
            if _prints_response(n):
                state[0] = True
    return out


def collate(messages: list[dict]) -> tuple[str, list[dict]]:
    """Ollama's collation: consecutive messages of one role joined by a blank line (tool
    results kept apart), and all system texts joined the same way."""
    system: list[str] = []
    out: list[dict] = []
    for m in messages:
        role = m.get("role", "")
        content = m.get("content", "") or ""
        if not isinstance(content, str):  # OpenAI content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role == "system":
            system.append(content)
        if out and out[-1]["role"] == role and role != "tool":
            out[-1]["content"] += "\n\n" + content
        else:
            out.append(dict(m, role=role, content=content))
    return "\n\n".join(system), out


def _for_template(m: dict) -> dict:
    """A message as Ollama's templates see it (Go field names)."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = (c or {}).get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append({"ID": c.get("id", ""), "Function": {"Name": fn.get("name", ""), "Arguments": args}})
    return {"Role": m.get("role", ""), "Content": m.get("content", ""), "Thinking": m.get("reasoning_content", ""),
            "ToolCalls": calls, "ToolName": m.get("name", ""), "Images": []}


@dataclass
class GoTemplate:
    """A parsed template; ``GoTemplate.parse(text)`` raises TemplateSyntaxError or TemplateUnsupported."""

    source: str
    nodes: list = field(repr=False, default_factory=list)
    names: frozenset = frozenset()  # every field name it mentions, lowercased

    @classmethod
    def parse(cls, text: str) -> "GoTemplate":
        parser = _Parser(_split(text))
        nodes, _ = parser.parse_list(())
        names: set[str] = set()
        for p in _pipes(nodes):
            for op in _pipe_fields(p):
                names.update(x.lower() for x in op.chain)
        if "messages" not in names and "response" not in names:
            nodes = nodes + [_Output(_Pipe([], False, [[_Field(("Response",))]]))]
        return cls(text, nodes, frozenset(names))

    @property
    def uses_messages(self) -> bool:
        return "messages" in self.names

    def execute(self, values: dict, nodes: list | None = None) -> str:
        run = _Run(values)
        try:
            run.nodes(self.nodes if nodes is None else nodes, values)
        except (_Break, _Continue):  # pragma: no cover - the parser refuses them outside a range
            pass
        return "".join(run.out)

    def render(self, messages: list[dict], tools: list | None = None, think: bool = False) -> str:
        """The prompt for a conversation (OpenAI-shaped messages: role, content, ...), the way
        Ollama runs a template; the model's answer continues it."""
        system, msgs = collate(messages)
        base = {"Think": think, "ThinkLevel": "", "IsThinkSet": False, "Suffix": ""}
        if self.uses_messages:
            return self.execute(dict(base, System=system, Messages=[_for_template(m) for m in msgs],
                                     Tools=list(tools or []), Response=""))
        out: list[str] = []
        cur = {"System": "", "Prompt": "", "Response": ""}

        def flush() -> None:
            out.append(self.execute(dict(base, **cur)))
            cur.update(System="", Prompt="", Response="")

        for m in msgs:
            role = m["role"]
            if role == "system":
                if cur["Prompt"] or cur["Response"]:
                    flush()
                cur["System"] = m["content"]
            elif role == "user":
                if cur["Response"]:
                    flush()
                cur["Prompt"] = m["content"]
            elif role == "assistant":
                cur["Response"] = m["content"]
        out.append(self.execute(dict(base, **cur), _cut(self.nodes, [False])))
        return "".join(out)
