"""The commands that ask a model for text: ``run``, ``chat`` (and a terminal's conversation),
and ``load``. An answer is streamed as it comes (:func:`_generate`); a model that is missing
is pulled first when a person at a terminal asked for it by a registry name."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from ..models.names import plainly_a_path
from .frontend import EXIT_OK, EXIT_USAGE, CommandError, Frontend, RunResult, StreamStopped
from .helpers import ModelMissing, _call, _loaded, _prompt
from .options import DEFAULT_NUM_PREDICT, _options


def _placement(fe: Frontend, model: str) -> str:
    try:
        m = _loaded(fe.client().ps(), model)
    except Exception:  # noqa: BLE001 - the placement is a courtesy
        m = None
    if m is None:
        return ""
    size, vram = m.get("size") or 0, m.get("size_vram") or 0
    if not size or not vram:
        return "CPU"
    if vram >= size:
        return "GPU"
    return f"{vram / size:.0%} GPU / {1 - vram / size:.0%} CPU"


LOADING_NOTE_AFTER = 3.0  # seconds without a first chunk before a shell is told the model is loading


def _generate(args, fe: Frontend, chunks_of: Callable[[], Iterator[dict]], pick: Callable[[dict], str]) -> RunResult:
    """Stream an answer. Interrupted (Ctrl-C, a notebook's stop button): the connection is
    closed (the manager stops generating), "(stopped)" is said, and the result holds the text
    that came. A model loaded for this answer is said once it is done (the final chunk's
    load_duration: how long the manager took to get the model ready for it)."""
    import threading

    result = RunResult(model=args.model)
    last: dict = {}
    first = [True]
    # A shell that shows nothing while a model loads looks hung (a slow disk, a worker that
    # stopped answering: until LOAD_TIMEOUT): it is told once, if the load takes a while.
    def say_loading() -> None:
        if first[0]:
            fe.note(f"(no answer from {args.model} yet: it may be loading, or reading a long prompt; `jupyter-llama "
                    f"explain {args.model}` says what the manager is doing)")

    waiting = threading.Timer(LOADING_NOTE_AFTER, say_loading) if fe.waits_aloud else None
    if waiting is not None:
        waiting.daemon = True
        waiting.start()
    chunks = chunks_of()

    def texts():
        nonlocal last
        for chunk in chunks:
            if first[0]:
                first[0] = False
                if waiting is not None:
                    waiting.cancel()
            last = chunk
            piece = pick(chunk)
            if piece:
                yield piece

    pieces = texts()
    try:
        result.text = _call(fe, fe.stream, pieces, raw=bool(getattr(args, "raw", False)), model=args.model)
    except StreamStopped as s:
        result.text, result.stopped = s.text, True
    finally:
        if waiting is not None:
            waiting.cancel()
        pieces.close()
        close = getattr(chunks, "close", None)  # (the response, unread: its connection is dropped, which the
        if close is not None:                   # manager takes as the client gone, and stops generating)
            close()
    if result.stopped:
        fe.note("(stopped)")
        return result
    result.stats = {k: v for k, v in last.items() if k not in ("response", "message", "context")}
    result.load_seconds = (result.stats.get("load_duration") or 0) / 1e9
    result.placement = _placement(fe, args.model)
    if getattr(args, "stats", False):
        fe.note(result.stats_line())  # (it says "load 13.20s", or "already loaded")
    elif result.loaded_now:
        fe.note(f"({args.model} was loaded first: {result.load_seconds:.1f}s)")
    return result


def _length_default(args) -> dict | None:
    """Our length limit, sent as a default: a Modelfile's num_predict (a preset) wins over it."""
    return {"num_predict": DEFAULT_NUM_PREDICT} if getattr(args, "num_predict", None) is None else None


def cmd_run(args, fe: Frontend, body: str | None = None) -> RunResult:
    prompt = _prompt(args, fe, body)
    if not prompt.strip() and body is None:  # (`echo hi | jupyter-llama run m`, as `ollama run` reads it)
        prompt = fe.piped_input() or ""
    if not prompt.strip():
        if fe.person_at_keyboard and body is None:
            return _pulled_if_missing(args, fe, lambda: _conversation(args, fe))
        raise CommandError("run: give a prompt (after the model name, or as the cell body of %%llama run)",
                           EXIT_USAGE)
    client = fe.client()
    kw = dict(options=_options(args) or None, keep_alive=args.keep_alive, system=args.system,
              raw=True if args.raw else None, format=args.format, default_options=_length_default(args))
    return _pulled_if_missing(args, fe, lambda: _generate(
        args, fe, lambda: client.generate(args.model, prompt, stream=True, **kw), lambda c: c.get("response", "")))


def _pulled_if_missing(args, fe: Frontend, attempt: Callable[[], RunResult]) -> RunResult:
    """``attempt()``; when its model is missing and a person at a terminal asked for it by a
    registry name, pull it first (what ``ollama run`` does), then try once more. A script,
    a pipe or a notebook is told how to pull instead: a download of gigabytes is not
    started for a typing mistake nobody watches."""
    try:
        return attempt()
    except ModelMissing:
        if not fe.person_at_keyboard or plainly_a_path(args.model):
            raise
    fe.note(f"{args.model} is not here: pulling it (Ctrl-C stops)")
    last = _call(fe, fe.pull, args.model, None)
    if last.get("status") != "success":
        raise CommandError(f"pull of {args.model} did not finish: {last}")
    return attempt()


def _say_if_no_chat_template(fe: Frontend, client, model: str) -> None:
    """A chat with a model that has no chat template gets only each message's text, as
    Ollama's default template gives it: no roles, no earlier answers. Said before it starts,
    with what suits such a model (a base model continues text)."""
    from ..client import LlamaError

    try:
        shown = client.show(model)
    except LlamaError:  # (a missing model is said by the chat itself, which may pull it)
        return
    if isinstance(shown, dict) and shown.get("has_chat_template") is False:
        fe.note(f"note: {model} has no chat template, so a chat with it gets each message's text as it is (Ollama's "
                f"default template): no roles, no earlier answers. It is a base model: `run {model} TEXT` "
                "continues a text")


def _conversation(args, fe: Frontend) -> RunResult:
    """``run MODEL`` with no prompt at a terminal: a conversation, a line at a time, as
    ``ollama run`` holds one. Ctrl-C stops an answer; ``/bye`` or Ctrl-D ends; ``/clear``
    forgets what was said. Returns the last answer."""
    client = fe.client()
    _call(fe, client.load, args.model, options=_options(args) or None, keep_alive=args.keep_alive, model=args.model)
    _say_if_no_chat_template(fe, client, args.model)
    fe.note(f"{args.model}: type a message (/bye or Ctrl-D to end, /clear to forget what was said, "
            "Ctrl-C stops an answer)")
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    result = RunResult(args.model)
    while True:
        try:
            line = fe.ask(">>> ")
        except KeyboardInterrupt:
            fe.note("\n(/bye or Ctrl-D ends the conversation)")
            continue
        if line is None or line.strip() == "/bye":
            return RunResult(args.model, result.text)  # (an answer stopped on the way sets no exit status)
        if line.strip() == "/clear":
            del history[int(bool(args.system)):]
            fe.note("(forgotten)")
            continue
        if not line.strip():
            continue
        messages = history + [{"role": "user", "content": line}]
        result = _chat_turn(args, fe, client, messages)
        history = messages + [{"role": "assistant", "content": result.text}]


def cmd_chat(args, fe: Frontend, body: str | None = None) -> RunResult:
    convo = fe.conversations.setdefault(args.conversation, [])
    if args.reset:
        convo.clear()
    prompt = _prompt(args, fe, body)
    if not prompt.strip():
        if args.reset:
            fe.note(f"conversation {args.conversation!r} forgotten")
            return RunResult(args.model)
        raise CommandError("chat: give a message (after the model name, or as the cell body of %%llama chat)",
                           EXIT_USAGE)
    messages = ([{"role": "system", "content": args.system}] if args.system and not convo else []) + convo + [
        {"role": "user", "content": prompt}]
    client = fe.client()
    _say_if_no_chat_template(fe, client, args.model)
    result = _pulled_if_missing(args, fe, lambda: _chat_turn(args, fe, client, messages))
    convo[:] = messages + [{"role": "assistant", "content": result.text}]
    return result


def _chat_turn(args, fe: Frontend, client, messages: list[dict]) -> RunResult:
    """One answer to ``messages``, streamed as ``chat`` and a terminal's conversation show it."""
    return _generate(args, fe, lambda: client.chat(args.model, messages, stream=True, options=_options(args) or None,
                                                   keep_alive=args.keep_alive, format=args.format,
                                                   default_options=_length_default(args)),
                     lambda c: (c.get("message") or {}).get("content", ""))


def cmd_load(args, fe: Frontend):
    t0 = time.monotonic()
    _call(fe, fe.client().load, args.model, options=_options(args) or None, keep_alive=args.keep_alive,
          model=args.model)
    fe.note(f"{args.model} loaded in {time.monotonic() - t0:.2f}s" + (f" ({_placement(fe, args.model)})"
                                                                       if _placement(fe, args.model) else ""))
    return EXIT_OK
