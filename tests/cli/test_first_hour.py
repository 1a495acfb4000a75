"""What a newcomer reads in a terminal, without a manager: a typo's "did you mean", `ps`'s
times as Ollama words them, a load note only when a load happened, and a quiet stop."""

from __future__ import annotations

import argparse
import time

import pytest

from jupyter_llama import commands
from jupyter_llama.cli import TerminalFrontend, run


@pytest.mark.parametrize("argv,said", [
    (["rnu"], "invalid choice: 'rnu' (did you mean run?)"),
    (["lsit"], "(did you mean list?)"),
    (["run", "tiny", "hi", "--temprature", "0.3"],
     "unrecognized arguments: --temprature 0.3 (did you mean --temperature?)"),
    (["run", "tiny", "hi", "--temprature=0.3", "--sed", "3"],
     "(did you mean --temperature for --temprature; --seed or --system for --sed?)"),
    (["ps", "--jsn"], "(did you mean --json?)"),
    (["engine", "build", "--cdua"], "(did you mean --cuda?)"),
    (["run", "tiny", "hi", "--format", "jsn"], "invalid choice: 'jsn' (did you mean json?)"),
    (["help", "rnu"], "help: no command 'rnu'; did you mean run?"),
])
def test_a_typo_is_answered_with_what_was_meant(argv, said, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "choose from" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_no_close_name_keeps_the_list_and_the_magic_says_the_same():
    assert run(["frobnicate"]) == 2
    with pytest.raises(commands.CommandError) as info:
        commands.parse("rnu tiny hi", prog="%llama")
    assert str(info.value) == "%llama: argument COMMAND: invalid choice: 'rnu' (did you mean run?)"
    with pytest.raises(commands.CommandError) as info:
        commands.parse("run tiny hi --zzzzzz")
    assert str(info.value) == "jupyter-llama: unrecognized arguments: --zzzzzz"  # (nothing close: no guess)


def test_ps_says_until_as_ollama_does():
    now = 1_800_000_000.0

    def until(seconds):
        from datetime import datetime, timezone

        return commands._until(datetime.fromtimestamp(now + seconds, timezone.utc).isoformat(), now=now)

    assert until(0.4) == "Less than a second from now"
    assert until(1) == "1 second from now"
    assert until(42) == "42 seconds from now"
    assert until(90) == "About a minute from now"
    assert until(4 * 60 + 30) == "4 minutes from now"
    assert until(65 * 60) == "About an hour from now"
    assert until(5 * 3600) == "5 hours from now"
    assert until(3 * 86400) == "3 days from now"
    assert until(100 * 365 * 86400) == "Forever"  # (pinned: keep_alive -1)
    assert until(-3) == "Stopping..."
    assert commands._until("2026-12-06T18:04:30.5+00:00", now=now) == "Stopping..."  # (past: being unloaded)


def _chunks(pieces, final=None, delay=0.0, interrupt_after=None):
    """What client.generate yields: pieces, then the final chunk (or a Ctrl-C after some)."""
    closed = []

    def gen():
        try:
            time.sleep(delay)
            for i, p in enumerate(pieces):
                if interrupt_after is not None and i == interrupt_after:
                    raise KeyboardInterrupt
                yield {"response": p, "done": False}
            yield {"response": "", "done": True, **(final or {})}
        finally:
            closed.append(True)

    return gen, closed


@pytest.fixture
def no_placement(monkeypatch):
    monkeypatch.setattr(commands.run, "_placement", lambda fe, model: "")  # (it asks a manager; there is none here)


def test_a_load_is_said_only_when_one_happened(no_placement, capsys):
    """The note was printed for any first token later than 1 s, above a stats line saying
    "already loaded": it now follows the manager's load_duration, which is 0 for a model that
    was ready (the scheduler's fast path and its health check alike)."""
    args = argparse.Namespace(model="gemma", raw=False, stats=False)
    fe = TerminalFrontend()
    gen, _ = _chunks(["Hi"], {"load_duration": 13_200_000_000, "eval_count": 1})
    commands._generate(args, fe, gen, lambda c: c.get("response", ""))
    assert "(gemma was loaded first: 13.2s)" in capsys.readouterr().err

    gen, _ = _chunks(["Hi"], {"load_duration": 0, "eval_count": 1}, delay=1.2)  # slow, but loaded already
    commands._generate(args, fe, gen, lambda c: c.get("response", ""))
    assert "loaded first" not in capsys.readouterr().err

    args.stats = True
    gen, _ = _chunks(["Hi"], {"load_duration": 0, "eval_count": 1})
    commands._generate(args, fe, gen, lambda c: c.get("response", ""))
    err = capsys.readouterr().err
    assert "already loaded" in err and "loaded first" not in err, err
    gen, _ = _chunks(["Hi"], {"load_duration": 13_200_000_000, "eval_count": 1})
    commands._generate(args, fe, gen, lambda c: c.get("response", ""))
    err = capsys.readouterr().err
    assert "load 13.20s" in err and "loaded first" not in err, err  # (said once, in the stats)


def test_ctrl_c_in_a_shell_keeps_the_text_and_says_stopped(no_placement, capsys):
    args = argparse.Namespace(model="tiny", raw=False, stats=True)
    gen, closed = _chunks(["Once", " upon", " a", " time"], interrupt_after=2)
    r = commands._generate(args, TerminalFrontend(), gen, lambda c: c.get("response", ""))
    out, err = capsys.readouterr()
    assert r.stopped and r.text == "Once upon" and closed
    assert out == "Once upon\n" and err == "(stopped)\n"  # (no stats: there are none for a stopped answer)
    assert "stopped" in repr(r)


def test_ctrl_c_between_two_chunks_closes_the_answer_too(no_placement, capsys):
    """Interrupted outside the read (while a piece is shown): the answer, left suspended, is
    closed all the same (its connection dropped, so that the manager stops generating)."""
    args = argparse.Namespace(model="tiny", raw=False, stats=False)
    gen, closed = _chunks(["Once", " upon", " a", " time"])

    def pick(chunk):
        if chunk["response"] == " a":
            raise KeyboardInterrupt
        return chunk["response"]

    r = commands._generate(args, TerminalFrontend(), gen, pick)
    assert r.stopped and r.text == "Once upon" and closed == [True]
    assert capsys.readouterr() == ("Once upon\n", "(stopped)\n")
