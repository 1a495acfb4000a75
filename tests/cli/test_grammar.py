"""The one grammar shared by `%llama` and `jupyter-llama`."""

from __future__ import annotations

import pytest

from jupyter_llama.commands import CommandError, RunResult, _options, fill_placeholders, parse


def test_model_names_with_hosts_namespaces_and_tags():
    a = parse("run hf.co/owner/repo:Q4_K_M 'tell me' a story")
    assert a.model == "hf.co/owner/repo:Q4_K_M" and a.prompt == ["tell me", "a", "story"]
    assert parse(["show", "library/tiny:latest"]).model == "library/tiny:latest"
    assert parse("pull hf.co/TheBloke/x-GGUF:Q8_0 --name x").source == "hf.co/TheBloke/x-GGUF:Q8_0"


def test_load_and_sampling_options():
    a = parse("run tiny hi --num-ctx 4096 --num-gpu 0 --num-parallel 2 --temperature 0.2 --top-k 5 --top-p 0.9 "
              "--seed 7 --num-predict 12 --stop END --stop STOP --keep-alive 10m --system 'be brief' --format json "
              "--raw --stats")
    assert _options(a) == {"num_ctx": 4096, "num_gpu": 0, "num_parallel": 2, "temperature": 0.2, "top_k": 5,
                           "top_p": 0.9, "seed": 7, "num_predict": 12, "stop": ["END", "STOP"]}
    assert a.keep_alive == "10m" and a.system == "be brief" and a.format == "json" and a.raw and a.stats


def test_same_words_in_both_front_ends():
    cli = parse("ps --json", prog="jupyter-llama")
    magic = parse("ps --json", prog="%llama")
    assert (cli.prog, magic.prog) == ("jupyter-llama", "%llama")  # (how `help COMMAND` spells the usage)
    assert {k: v for k, v in vars(cli).items() if k != "prog"} == {k: v for k, v in vars(magic).items() if k != "prog"}


@pytest.mark.parametrize("line,fragment", [
    ("", "COMMAND"),
    ("run", "required"),
    ("frobnicate", "invalid choice"),
    ("run tiny hi --num-ctx lots", "invalid int value"),
    ("run tiny hi --format yaml", "invalid choice"),
    ("estimate tiny --cache-type-k q9", "invalid choice"),
    ("run tiny 'unclosed", "cannot split"),
])
def test_usage_errors_say_what_was_wrong(line, fragment):
    with pytest.raises(CommandError) as info:
        args = parse(line)
        if getattr(args, "func", None) is None:
            raise CommandError("COMMAND missing", 2)
    assert info.value.code == 2 and fragment in str(info.value)


def test_placeholders_fill_from_the_namespace_and_leave_the_rest():
    ns = {"topic": "owls", "n": 3}
    assert fill_placeholders("write {n} lines on {topic}", ns) == "write 3 lines on owls"
    assert fill_placeholders("keep {unknown} and {0} and {{x}}", ns) == "keep {unknown} and {0} and {{x}}"
    assert fill_placeholders("json: {\"a\": 1}", ns) == "json: {\"a\": 1}"
    assert fill_placeholders("{topic}", None) == "{topic}"


def test_run_result_numbers():
    r = RunResult("tiny", "hello", {"eval_count": 20, "eval_duration": 2_000_000_000, "prompt_eval_count": 4,
                                    "done_reason": "length"}, load_seconds=0.5, placement="CPU")
    assert r.tokens == 20 and r.tokens_per_second == 10.0
    line = r.stats_line()
    assert "20 tokens" in line and "10.0 tokens/s" in line and "load 0.50s" in line and "on CPU" in line
    assert "stopped: length" in line and "tiny" in repr(r)


def test_a_shell_is_told_when_an_answer_waits_for_its_model_to_load(monkeypatch, capsys):
    """Nothing on the screen while a model loads looked like a hang (a worker that stopped
    answering kept `run` silent until the load timed out): after LOADING_NOTE_AFTER the shell
    is told once; an answer that comes sooner is not preceded by it."""
    import argparse
    import time

    from jupyter_llama import commands
    from jupyter_llama.cli import TerminalFrontend

    monkeypatch.setattr(commands.run, "LOADING_NOTE_AFTER", 0.05)
    args = argparse.Namespace(model="slow", raw=False, stats=False)

    def chunks(delay):
        def gen():
            time.sleep(delay)
            yield {"response": "Once", "done": False}
            yield {"response": "", "done": True, "eval_count": 1}
        return gen

    monkeypatch.setattr(commands.run, "_placement", lambda fe, model: "")  # (it asks a manager; there is none here)
    fe = TerminalFrontend()
    result = commands._generate(args, fe, chunks(0.4), lambda c: c.get("response", ""))
    err = capsys.readouterr().err
    assert result.text == "Once" and err.count("(no answer from slow yet: it may be loading") == 1, err
    commands._generate(args, fe, chunks(0.0), lambda c: c.get("response", ""))
    time.sleep(0.2)
    assert "no answer from slow" not in capsys.readouterr().err
