"""The child's protocol around its context: a prompt made with the model's own template,
tokens counted by the child, a prompt and a chat fitted to the context as Ollama fits them
(its first token and its end; the newest messages and the system ones), and embeddings.

:class:`ChildContext` is a part of :class:`~.runner.Runner`, on top of its requests
(:class:`~.child_requests.ChildRequests`).
"""

from __future__ import annotations

from ..errors import BadRequest, EngineError, RequestError
from .child_requests import ChildRequests


class ChildContext(ChildRequests):
    """What a runner asks its child about prompts and the context (a part of :class:`~.runner.Runner`)."""

    async def prompt(self, prompt: str, system: str = "", *, raw: bool = False, templated: bool = True,
                     history: list[dict] | None = None) -> str:
        """The text for ``/completion``: ``prompt`` as given (``raw``), or a system turn, the
        ``history`` turns (a model preset's messages) and the user turn through the model's own
        chat template (llama-server's ``/apply-template``); a model without a template gets
        their texts, a blank line apart."""
        if raw:
            return prompt
        history = list(history or [])
        if not templated:
            return "".join(t + "\n\n" for t in [system] + [m.get("content", "") for m in history] if t) + prompt
        messages = ([{"role": "system", "content": system}] if system else []) + history + [
            {"role": "user", "content": prompt}]
        res = await self.post("/apply-template", {"messages": messages})
        return res.get("prompt", prompt)

    async def _tokens_over(self, text: str, most: int) -> list[int] | None:
        """``text``'s tokens if there are more than ``most``, else None; text of no more than
        ``most`` bytes is not even tokenised (a token is at least one byte)."""
        if len(text.encode()) <= most:
            return None
        tokens = await self.tokenize(text)
        return tokens if len(tokens) > most else None

    def _prompt_room(self, reserve: int) -> tuple[int | None, int]:
        """(the request's context, the most prompt tokens that leave ``reserve`` of it, at most
        half of it, to generate in); (None, 0) while the context is not known."""
        n_ctx = self._request_ctx()
        if not n_ctx:
            return None, 0
        return n_ctx, max(1, n_ctx - max(0, min(reserve, n_ctx // 2))) - 1

    async def fit_to_context(self, prompt: str, reserve: int, truncate: bool = True,
                             context: list[int] | None = None) -> str | list:
        """``prompt`` as it fits a request's context with ``reserve`` tokens left to generate
        in: unchanged when it fits, else (as Ollama does) its first token and its end, as
        token ids; with ``truncate`` False, a 400 that says how long it is.

        ``context``: token ids that come before ``prompt`` (Ollama's ``context``, what an
        earlier answer gave), which ``prompt``'s tokens follow without a BOS of their own. The
        prompt is then ``[*context, prompt]``, a list the child's ``/completion`` reads as those
        ids and the text's tokens, when it fits without counting (its bytes and the ids are
        within the room: no tokenize before the answer starts); else the ids of both, cut as
        above when they do not fit."""
        n_ctx, most = self._prompt_room(reserve)
        if context:
            whole: str | list = [*context, prompt] if prompt else list(context)
            if not n_ctx or len(context) + len(prompt.encode()) <= most:
                return whole
            tokens = context + (await self.tokenize(prompt, add_special=False) if prompt else [])
            if len(tokens) <= most:
                return tokens
            what = "the context and the prompt are"
        else:
            if not n_ctx:
                return prompt
            over = await self._tokens_over(prompt, most)
            if over is None:
                return prompt
            tokens = over
            what = "the prompt is"
        if not truncate:
            raise BadRequest(f"{what} {len(tokens)} tokens, longer than the context of {self.name} "
                             f"({n_ctx} tokens, {n_ctx - most - 1} of them kept to generate in); shorten it, load "
                             "the model with a larger num_ctx, or allow truncate")
        return tokens[:1] + tokens[len(tokens) - (most - 1):] if most > 1 else tokens[:most]

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """``text``'s token ids as the child makes them (``/tokenize``; ``add_special``: with the
        model's BOS, as ``/completion`` tokenizes a text prompt). A small request on the child's
        HTTP thread: it may run beside a stream."""
        res = await self.post("/tokenize", {"content": text, "add_special": add_special})
        return list(res.get("tokens") or []) if isinstance(res, dict) else []

    async def prompt_tokens(self, prompt: str | list) -> list[int]:
        """The token ids the child makes of a ``/completion`` prompt as :meth:`fit_to_context`
        gives it (and llama-server reads it): a text, with the model's BOS; ids, as they are;
        ids then a text, the text's tokens without a BOS after them. (No loop over the ids:
        a context may be long, and this runs beside a stream.)"""
        if isinstance(prompt, str):
            return await self.tokenize(prompt, add_special=True)
        if prompt and isinstance(prompt[-1], str):
            ids = prompt[:-1]
            return ids + await self.tokenize(prompt[-1], add_special=not ids)
        return list(prompt)

    async def conversation_tokens(self, prompt: str | list, answer: str) -> list[int]:
        """The token ids of a ``/completion`` prompt (as :meth:`prompt_tokens` reads it)
        followed by the text of its answer, as Ollama counts a conversation (its ``context``:
        the prompt and the answer tokenized together): the text joins the prompt's text, or
        follows its ids."""
        if isinstance(prompt, str):
            return await self.prompt_tokens(prompt + answer)
        if prompt and isinstance(prompt[-1], str):
            return await self.prompt_tokens([*prompt[:-1], prompt[-1] + answer])
        return await self.prompt_tokens([*prompt, answer]) if answer else list(prompt)

    async def embed(self, inputs: list[str], truncate: bool = True) -> tuple[list, int]:
        """``/embedding`` for ``inputs``, in input order, and the number of prompt tokens they
        took. Each item is one vector when the model pools, or one vector per token when it
        does not (pooling ``none``); pooling and normalising are the API's business. An input
        longer than the context keeps its beginning (Ollama's ``truncate``), or with
        ``truncate`` False is a 400."""
        if not inputs:
            return [], 0
        # the longest input: the request's context, and the micro-batch, which takes an input whole
        n_ctx, n_batch = self._request_ctx(), self.parser.n_ubatch
        most = (min(n_ctx, n_batch) if n_ctx and n_batch else n_ctx or n_batch) or 0  # (0: neither is known)
        content: list = list(inputs)
        for i, text in enumerate(inputs if most else ()):
            over = await self._tokens_over(text, most)
            if over is None:
                continue
            if not truncate:
                what = (f"the context of {self.name} ({most})" if most == n_ctx else f"the batch of {self.name} "
                        f"({most}: an input is embedded in one batch, no longer than the context)")
                raise BadRequest(f"input {i} is {len(over)} tokens, longer than {what}; split it, load the model "
                                 f"with a larger {'num_ctx' if most == n_ctx else 'num_ctx or num_batch'}, or allow "
                                 "truncate")
            content[i] = over[:most]
        try:
            res = await self.post("/embedding", {"content": content})
        except RequestError as e:
            if "too large to process" not in str(e):
                raise
            raise BadRequest(f"an input to embed is longer than the micro-batch of {self.name} ({e}); split it, "
                             "or load the model with a larger num_ubatch (or leave it unset)") from None
        items = sorted(res if isinstance(res, list) else [res], key=lambda it: it.get("index", 0))
        vectors = [it.get("embedding") or [] for it in items]
        if vectors and vectors[0] and isinstance(vectors[0][0], list):  # per-token vectors: one per prompt token
            return vectors, sum(len(v) for v in vectors)
        tokens = 0
        for item in content:  # what was embedded: the text, or its tokens when it was cut
            if isinstance(item, list):
                tokens += len(item)
                continue
            try:
                tokens += len(await self.tokenize(item, add_special=False))
            except EngineError:
                break
        return vectors, tokens

    async def relay_chat(self, messages: list[dict], on_data, *, truncate: bool = True, **params) -> None:
        """:meth:`chat` through :meth:`relay_sse` (see :meth:`send_chat`)."""
        await self.send_chat({"messages": messages, **params}, on_data, truncate=truncate)

    async def send_chat(self, body: dict, on_data=None, *, truncate: bool = True):
        """``/v1/chat/completions`` with ``body``: its events' data to ``on_data`` (as
        :meth:`relay_sse` hands them), or without it the answer (:meth:`post`). A chat longer
        than the context (the child refuses it before it answers) is sent again with what
        :meth:`fit_chat` keeps, as Ollama does; with ``truncate`` False it is a 400 that says so."""
        async def send(b: dict):
            if on_data is None:
                return await self.post("/v1/chat/completions", b)
            return await self.relay_sse("/v1/chat/completions", b, on_data)

        try:
            return await send(body)
        except RequestError as e:
            if not e.context_exceeded:
                raise
            if not truncate:
                raise BadRequest(f"the chat is longer than the context of {self.name} ({e}); shorten it, load the "
                                 "model with a larger num_ctx, or allow truncate (which drops the oldest messages "
                                 "but the system ones)") from None
        return await send(await self.cut_chat(body))

    async def cut_chat(self, body: dict) -> dict:
        """A chat-completions ``body`` the child refused as longer than its context, with the
        messages :meth:`fit_chat` keeps (room left for the body's ``n_predict``, or OpenAI's
        ``max_tokens``/``max_completion_tokens``); a 400 when even that is too long."""
        messages = list(body.get("messages") or [])
        params = {k: v for k, v in body.items() if k != "messages"}
        n = next((params[k] for k in ("n_predict", "max_completion_tokens", "max_tokens") if k in params), None)
        reserve = reserve_for({"n_predict": n})
        kept = await self.fit_chat(messages, reserve, **params)
        if len(kept) == len(messages):
            n_ctx, most = self._prompt_room(reserve)
            size = ""
            if n_ctx:  # (how long, and how much room: the numbers that say how much to cut)
                prompt = (await self.post("/apply-template", {"messages": kept, **_template_params(params)})
                          ).get("prompt", "")
                size = (f" ({len(await self.tokenize(prompt)):,} tokens, where the context of {n_ctx:,} has room "
                        f"for {most:,} beside the answer)")
            raise BadRequest(f"the chat's last message and its system messages, which a cut chat keeps, are longer "
                             f"than the context of {self.name}{size}: shorten them, or load the model with a larger "
                             "num_ctx")
        return {**body, "messages": kept}

    async def fit_chat(self, messages: list[dict], reserve: int, **params) -> list[dict]:
        """What Ollama keeps of a chat longer than the context (its ``chatPrompt``): the
        newest messages that fit with ``reserve`` tokens left to generate in, never fewer than
        the last one (with the assistant turn whose tool calls it answers, for a tool
        result), and the system messages from before them. The prompt of each candidate is
        the model's template applied by the child (``/apply-template``, with the request's
        tools and template options), counted as :meth:`fit_to_context` counts."""
        _n_ctx, most = self._prompt_room(reserve)
        template = _template_params(params)
        starts = sorted({_turn_start(messages, i) for i in range(len(messages))})

        def kept(start: int) -> list[dict]:
            return [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]

        async def fits(start: int) -> bool:
            prompt = (await self.post("/apply-template", {"messages": kept(start), **template})).get("prompt", "")
            return await self._tokens_over(prompt, most) is None

        lo, hi = 0, len(starts) - 1  # the oldest start that fits, by bisection (fewer messages, fewer tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if await fits(starts[mid]):
                hi = mid
            else:
                lo = mid + 1
        return kept(starts[lo])


DEFAULT_RESERVE = 256  # tokens a prompt cut to the context leaves to generate in, when the request sets no limit


def reserve_for(params: dict) -> int:
    """Tokens a prompt cut to the context leaves to generate in: the request's ``n_predict``
    when it sets one, else :data:`DEFAULT_RESERVE`."""
    n = params.get("n_predict")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else DEFAULT_RESERVE


def _template_params(params: dict) -> dict:
    """What of a chat request's fields the model's template reads besides the messages."""
    return {k: params[k] for k in ("tools", "chat_template_kwargs", "tool_choice") if k in params}


def _turn_start(messages: list[dict], i: int) -> int:
    """Where a chat cut before message ``i`` may start: ``i``, or for a tool result, the
    assistant turn whose tool calls it answers (a result never loses its call)."""
    if not 0 < i < len(messages) or messages[i].get("role") != "tool":
        return i
    start = i
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    if start > 0 and messages[start - 1].get("role") == "assistant" and messages[start - 1].get("tool_calls"):
        return start - 1
    return i
