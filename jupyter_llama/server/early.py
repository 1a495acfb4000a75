"""Stream requests sent to their child before their handler has run.

Between a client's request and the child's, the manager's Python (Tornado's request,
jupyter_server's checks, the body read, the options, the lease, the translation) takes about
a millisecond on two slow cores, and a stream's first token waits for all of it: the child is
idle meanwhile. llama-server's own router does the same work in C++ in a fraction of that.
Here the child is given the request as soon as the client's has been read, and the manager's
millisecond runs while the child reads the prompt, without deciding anything differently:

* :meth:`SendAhead.learn`: when a stream has been answered (status 200, one stream to the
  child) to a request that its head authenticated (a token the server checked, or a server
  that asks for none), the client's body and the child's request are compared. If the
  client's prompt (its ``prompt``, or its last message's ``content``) appears once in each,
  what surrounds it is a *recipe*: for a request with the same head (but its length and its
  cookies) and the same body around another prompt, the child's request is the same around
  that prompt, escaped as the child's request escapes it.
* :meth:`SendAhead.intake`: a request read whole that fits a recipe, whose runner is still the
  one a request would be given at once (:meth:`.Scheduler.serving_on`) and whose prompt is
  short enough that no cut to the context can change it, has its child's request sent now,
  on the connection the runner opened ahead (:class:`.http1.Ahead`), while the child has a
  slot free for it; what comes of its answer is held, unread.
* The request then goes through the handler as any other: authenticated, checked, leased,
  translated. When the stream request the handler makes is byte for byte the one sent,
  :func:`.http1.post` takes that connection and the answer begun on it; when it is not (a
  preset changed, a template that trims the prompt), or the handler ends without a stream
  (a model gone, a request refused), the one sent is closed, which makes the child drop it;
  a recipe that sent a request the handler did not make, or one for a request it refused as
  unauthenticated (a token no longer the server's), is never used or learned again.

So the manager decides and checks everything it did before, and a client only ever receives
the answer to the request its handler made; what changes is when the child has it. What the
child may be sent that the handler then does not make is a request of the shape it made for
an authenticated client before, which the child begins and drops. A head that carries a
cookie and no token (a browser's session, which can end) teaches nothing.
"""

from __future__ import annotations

import collections
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ..engine import http1

__all__ = ["SendAhead"]

_RECIPES_PER_HEAD = 4  # bodies of different shapes sent with one head (a route, a client)
_MOST_LEARNED = 65536  # bytes of a client's body, or of the child's, that a recipe is learned from
_REFUSED_KEPT = 1024  # recipes remembered as refused


@dataclass(eq=False)
class Recipe:
    """A client's request and the child request made for it, split around the prompt."""

    key: bytes  # the client's head without its Content-Length
    before: bytes  # the client's body up to the prompt's JSON string
    after: bytes  # ... and after it
    runner: weakref.ref  # the Runner it went to
    host: str
    port: int
    path: str
    headers: dict[str, str] | None
    child_before: bytes  # the child's body up to the prompt's escaped text
    child_after: bytes

    @property
    def ident(self) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        for part in (self.key, self.before, self.after, self.path.encode(), self.child_before, self.child_after):
            digest.update(len(part).to_bytes(8, "little") + part)
        return digest.digest()

    def prompt_in(self, body: bytes) -> str | None:
        """The prompt of ``body`` when it is this recipe's body around another prompt."""
        if (len(body) < len(self.before) + len(self.after) + 2 or not body.startswith(self.before)
                or not body.endswith(self.after)):
            return None
        literal = body[len(self.before):len(body) - len(self.after)]
        if literal[:1] != b'"' or literal[-1:] != b'"':
            return None
        try:
            text = json.loads(literal)  # (one JSON string, or it raises: '"a", "b": "c"' is not one)
        except ValueError:
            return None
        return text if isinstance(text, str) and text else None

    def child_body(self, text: str) -> bytes:
        return self.child_before + json.dumps(text)[1:-1].encode() + self.child_after


class _Intake(http1.Early):
    def __init__(self, key: bytes, body: bytes):
        super().__init__()
        self.key, self.body = key, body
        self.recipe: Recipe | None = None


def _key(head: bytes) -> bytes | None:
    """What of a request's head decides how it is answered: all of it but its length and, when
    it carries a token, its cookies (jupyter_server sets a login cookie, stamped afresh, on an
    answer to a request with a token, and clients with a cookie jar send it back); None for a
    head with a cookie and no token (a browser's session, which can end) or no length."""
    lines = head.split(b"\r\n")
    kept, cookie, token, length = [lines[0]], False, False, False
    for line in lines[1:]:
        name = line[:line.find(b":")].lower()
        if name == b"content-length":
            length = True
        elif name == b"cookie":
            cookie = True
        else:
            token = token or name == b"authorization"
            kept.append(line)
    if not length or (cookie and not token):
        return None
    return b"\r\n".join(kept)


def _prompt_of(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        return content if isinstance(content, str) else None
    return None


class SendAhead:
    """Recipes, learned from answered streams, and the requests sent ahead by them (see the
    module's docstring). ``serving(port, waiting)``: the runner on that port when a request for
    its model would be given it at once and (``waiting`` not None) a slot of its child is free
    with ``waiting`` requests sent ahead still on their way to it, else None (:meth:`.Scheduler.serving_on`): a child's
    HTTP threads (its slots and two more) are never all held by requests sent ahead."""

    def __init__(self, serving: Callable[[int, int | None], Any], heads: int = 64):
        self._serving = serving
        self._heads = heads
        self._recipes: dict[bytes, list[Recipe]] = {}  # by head; the most recently learned last
        # recipes that sent a request that was not the handler's, or for a request it refused
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._out: dict[int, set[_Intake]] = {}  # by port: requests with one sent ahead, until their handlers end
        self.sent = 0  # requests sent ahead
        self.taken = 0  # ... that were the handler's request
        self.missed = 0  # ... that were not
        self.learned = 0  # recipes learned

    def summary(self) -> str:
        """What it did, in a sentence (``serve`` logs it as it stops)."""
        return (f"send ahead: stream requests sent to their child before their handler ran: {self.sent:,} "
                f"({self.taken:,} taken by their handler, {self.missed:,} not its request and dropped); "
                f"recipes learned: {self.learned:,}")

    def intake(self, head: bytes, body: bytes) -> http1.Early | None:
        """What the server hands a POST read whole (its head without the blank line, its
        body): an :class:`.http1.Early` for its handler's streams, with the child's request
        sent ahead when a recipe fits; None for a request that can have no recipe."""
        if body[:1] != b"{":
            return None
        key = _key(head)
        if key is None:
            return None
        early = _Intake(key, body)
        for recipe in self._recipes.get(key, ()):
            text = recipe.prompt_in(body)
            if text is None:
                continue
            # (a request sent ahead holds a slot until its handler's stream takes it, and from
            # then on its lease does)
            waiting = sum(e.ahead is not None for e in self._out.get(recipe.port, ()))
            runner = self._serving(recipe.port, waiting)
            if runner is None or runner is not recipe.runner():
                break
            child_body = recipe.child_body(text)
            if not runner.fits_as_is(len(child_body)):  # (the escaped body is longer than the prompt in it)
                break
            ahead = runner.take_ahead() or http1.Ahead(recipe.port, recipe.host)
            ahead.send_ahead(http1.request_bytes(recipe.host, recipe.port, recipe.path, child_body, recipe.headers))
            early.ahead, early.recipe = ahead, recipe
            self._out.setdefault(recipe.port, set()).add(early)
            self.sent += 1
            break
        return early

    def end(self, early: http1.Early, status: int) -> None:
        """The request has been answered with ``status`` (0: the client left first): a request
        sent ahead and not taken is closed, a recipe that sent one the handler did not make,
        or one for a request it refused, is dropped for good, and a stream answered to a
        request its head authenticated teaches its recipe."""
        assert isinstance(early, _Intake)
        early.drop()
        early.ended = True
        recipe = early.recipe
        if recipe is not None:
            out = self._out.get(recipe.port)
            if out is not None:
                out.discard(early)
                if not out:
                    del self._out[recipe.port]
            if early.missed or status in (401, 403):
                self.missed += early.missed
                self._refuse(recipe)
            elif early.claimed:
                self.taken += 1
        if not early.claimed and early.trusted and status == 200 and len(early.streams) == 1:
            try:
                self.learn(early)
            except (ValueError, UnicodeError):  # (a body it cannot take apart teaches nothing)
                pass
        early.body, early.streams = b"", []  # (its context may outlive it, in a task or a timer it started)

    def _refuse(self, recipe: Recipe) -> None:
        self._refused[recipe.ident] = None
        while len(self._refused) > _REFUSED_KEPT:
            self._refused.popitem(last=False)
        recipes = self._recipes.get(recipe.key, [])
        if recipe in recipes:
            recipes.remove(recipe)

    def learn(self, early: _Intake) -> None:
        """A recipe from a stream answered (see the module's docstring), when its prompt shows
        once in the client's body and once in the child's."""
        host, port, path, headers, child = early.streams[0]
        if len(early.body) > _MOST_LEARNED or not child or len(child) > _MOST_LEARNED:
            return
        text = _prompt_of(json.loads(early.body))
        if not text:
            return
        body = early.body
        for literal in (json.dumps(text).encode(), json.dumps(text, ensure_ascii=False).encode()):
            if body.count(literal) == 1:
                break
        else:
            return
        escaped = json.dumps(text)[1:-1].encode()
        if child.count(escaped) != 1:
            return
        runner = self._serving(port, None)  # (whatever its slots hold now)
        if runner is None:
            return
        i, j = body.index(literal), child.index(escaped)
        recipe = Recipe(early.key, body[:i], body[i + len(literal):], weakref.ref(runner), host, port, path,
                        dict(headers) if headers else None, child[:j], child[j + len(escaped):])
        if recipe.ident in self._refused:
            return
        recipes = [r for r in self._recipes.pop(early.key, []) if (r.before, r.after) != (recipe.before, recipe.after)]
        self._recipes[early.key] = (recipes + [recipe])[-_RECIPES_PER_HEAD:]
        self.learned += 1
        while len(self._recipes) > self._heads:
            del self._recipes[next(iter(self._recipes))]
