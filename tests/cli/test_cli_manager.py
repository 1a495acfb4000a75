"""Every manager subcommand as a subprocess against a real `jupyter-llama serve` (the background
manager's: tests/cli/test_background.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def cli(env, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", "jupyter_llama.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_lifecycle_through_the_cli(manager, tmp_path):
    env = manager["env"]
    r = cli(env, "synth", "tiny", "--layers", "2", "--embd", "64", "--ctx", "1024")
    assert r.returncode == 0, r.stderr
    listed = json.loads(cli(env, "list", "--json").stdout)
    assert "tiny:latest" in [m["name"] for m in listed["models"]]
    assert "tiny:latest" in cli(env, "list").stdout

    shown = cli(env, "show", "tiny")
    assert shown.returncode == 0 and "llama" in shown.stdout and "block_count" in shown.stdout
    assert json.loads(cli(env, "show", "tiny", "--json").stdout)["details"]["family"] == "llama"
    file = tmp_path / "tiny-file.gguf"  # a file is shown by its path, as run loads it
    assert cli(env, "synth", "-o", str(file), "--layers", "2", "--embd", "64").returncode == 0
    shown = cli(env, "show", str(file))
    assert shown.returncode == 0 and f"file:                     model {file} " in shown.stdout, shown.stderr

    run = cli(env, "run", "tiny", "Once upon a time", "--num-predict", "8", "--stats")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "8 tokens" in run.stderr and "on CPU" in run.stderr

    def loaded():  # the manager is shared with other tests: look at our models only
        return {m["name"] for m in json.loads(cli(env, "ps", "--json").stdout)["models"]} & {"tiny:latest",
                                                                                            "tiny2:latest"}

    assert loaded() == {"tiny:latest"}
    assert "tiny:latest" in cli(env, "ps").stdout

    log = cli(env, "log", "tiny", "--match", "KV buffer size")
    assert log.returncode == 0, log.stderr
    first, *lines = log.stdout.splitlines()
    assert first.startswith("tiny:latest (pid ") and "containing 'KV buffer size'" in first
    assert lines and all("KV buffer size" in ln for ln in lines)

    explained = cli(env, "explain", "tiny:latest")
    assert explained.returncode == 0 and "loaded" in explained.stdout and "fit" in explained.stdout
    assert json.loads(cli(env, "explain", "--json").stdout)

    est = cli(env, "estimate", "tiny", "--num-ctx", "512")
    assert est.returncode == 0, est.stderr
    assert "coarse" in est.stdout and "detailed" in est.stdout
    assert "\nfit (detailed+10%): fits\n" in est.stdout, est.stdout  # the scheduler's verdict, as a load would act

    # a plot is a PNG: where it is asked for, else this user's one for that model, replaced each time
    png = tmp_path / "memory.png"
    plotted = cli(env, "plot", "tiny", "-o", str(png))
    assert plotted.returncode == 0 and f"plot written to {png}" in plotted.stdout, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    firsts = [cli(env, "plot", "tiny:latest").stdout.strip() for _ in range(2)]
    scratch = firsts[0].removeprefix("plot written to ")
    assert firsts[1] == firsts[0] and scratch.endswith(f"{os.sep}jupyter-llama-plot-tiny-latest.png"), firsts
    assert os.path.isfile(scratch) and not os.stat(os.path.dirname(scratch)).st_mode & 0o077  # (this user's alone)
    for where, said in ((tmp_path, f"is a folder: give the file to write, such as {tmp_path / 'tiny.png'}"),
                        (tmp_path / "no" / "m.png", f"the folder {tmp_path / 'no'} does not exist")):
        bad = cli(env, "plot", "tiny", "--output", str(where))
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr

    assert cli(env, "stop", "tiny").returncode == 0
    assert loaded() == set()
    assert cli(env, "load", "tiny", "--num-ctx", "256", "--keep-alive", "5s").returncode == 0

    assert cli(env, "cp", "tiny", "tiny2").returncode == 0
    # the same file under its second name is served by the loaded runner, and ps says so
    assert cli(env, "run", "tiny2", "Once", "--num-predict", "2", "--num-ctx", "256").returncode == 0
    assert loaded() == {"tiny:latest"}
    assert "tiny:latest (also tiny2:latest)" in cli(env, "ps").stdout
    assert cli(env, "rm", "tiny").returncode == 0  # loaded: unloaded first
    names = {m["name"] for m in json.loads(cli(env, "list", "--json").stdout)["models"]}
    assert "tiny2:latest" in names and "tiny:latest" not in names
    assert loaded() == set()


def test_errors_and_exit_codes(manager, tmp_path):
    env = manager["env"]
    missing = cli(env, "run", "nosuchmodel", "hi")
    assert missing.returncode == 1
    assert 'model "nosuchmodel" not found' in missing.stderr and "pull" in missing.stderr
    assert "Traceback" not in missing.stderr
    for path in ("./nofile.gguf", str(tmp_path / "nofile.gguf")):  # meant as a file: said as one
        missing = cli(env, "run", path, "hi")
        assert missing.returncode == 1 and f'model "{path}" not found: no such file /' in missing.stderr, missing.stderr
        assert "nofile.gguf. Give the file's path as the manager's machine sees it" in missing.stderr
        assert "synth" not in missing.stderr and "pulling" not in missing.stderr
    bad = cli(env, "run", "tiny2", "hi", "--keep-alive", "soon")
    assert bad.returncode in (1, 2) and "keep_alive" in bad.stderr
    idle = cli(env, "log", "nosuchmodel")
    assert idle.returncode == 1
    assert 'model "nosuchmodel" is not loaded' in idle.stderr and "Traceback" not in idle.stderr
    usage = cli(env, "run")
    assert usage.returncode == 2
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("not a model")
    created = cli(env, "create", "x", "--from", str(notgguf))
    assert created.returncode == 2 and "not a GGUF" in created.stderr
    assert cli(env, "help", "run").returncode == 0


def test_a_reader_that_stops_early_ends_the_command_quietly(manager):
    """`jupyter-llama run ... | head`: the rest goes nowhere (it was a BrokenPipeError traceback)."""
    import shlex

    env = manager["env"]
    assert cli(env, "synth", "pipe-tiny", "--layers", "2", "--embd", "64").returncode == 0
    cmd = f"{shlex.quote(sys.executable)} -m jupyter_llama.cli run pipe-tiny Once --num-predict 400"
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd} | head -c 1 >/dev/null; echo status=$?"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert "status=0" in r.stdout and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, (r.stdout,
                                                                                                      r.stderr)


def test_devices_points_out_a_budget_the_manager_was_not_started_with(manager):
    """A budget exported here after the manager started looked ignored ("memory budgets: none")."""
    r = cli(dict(manager["env"], JUPYTER_LLAMA_MEMORY_LIMIT="1GiB"), "devices")
    assert r.returncode == 0 and "memory budgets: none" in r.stdout
    assert (f"note: here JUPYTER_LLAMA_MEMORY_LIMIT is 1GiB, but the manager at {manager['url']}") in r.stderr, \
        r.stderr
    assert "note:" not in cli(manager["env"], "devices").stderr


def test_estimate_of_a_file_needs_no_manager(tiny_model):
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_LLAMA_URL",)}
    r = cli(env, "estimate", str(tiny_model), "--num-ctx", "1024", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {"coarse", "detailed"} <= set(data["estimates"])
    # options llama.cpp would refuse are a sentence here too (they were a traceback)
    for bad, said in ((["--num-ctx", "8"], "num_ctx 8 is too small"),
                      (["--cache-type-v", "q8_0", "--flash-attn", "off"], "cache_type_v q8_0 needs flash attention")):
        r = cli(env, "estimate", str(tiny_model), *bad)
        assert r.returncode == 2 and r.stderr.startswith(f"error: bad option: {said}"), r.stderr


def test_prune_drops_partial_downloads(manager):
    """`jupyter-llama prune` through the manager's api/prune (issue 17 item 10)."""
    env = manager["env"]
    partial = manager["models"] / "partial"
    partial.mkdir(exist_ok=True)
    (partial / "url-cli-prune.partial").write_bytes(b"GGUF" + b"\0" * 4096)
    (partial / "url-cli-prune.json").write_text(json.dumps({"url": "http://example.invalid/m.gguf"}))
    r = cli(env, "prune")
    assert r.returncode == 0, r.stderr
    assert "removed partial download " in r.stdout and "freed 4.0 KiB" in r.stdout
    assert "url-cli-prune.partial (4.0 KiB, from http://example.invalid/m.gguf)" in r.stdout
    assert not (partial / "url-cli-prune.partial").exists() and not (partial / "url-cli-prune.json").exists()
    again = json.loads(cli(env, "prune", "--json").stdout)
    assert again == {"removed": [], "freed": 0}
    assert "nothing to drop: no partial download, unused blob or left-over file" in cli(env, "prune").stdout


def test_a_shells_conversation_lasts_from_one_command_to_the_next(manager, tmp_path):
    """`chat --conversation NAME` from a shell: each command is a process of its own, so the
    turns are kept in a file of the user's (they were forgotten at each exit, though the help
    said the conversation was remembered)."""
    env = dict(manager["env"], JUPYTER_LLAMA_MANAGER_DIR=str(tmp_path / "state"))
    saved = tmp_path / "state" / "jupyter-llama-conversations.json"
    assert cli(env, "synth", "chatty", "--layers", "1", "--embd", "64").returncode == 0
    for text in ("Hello, I am Ada.", "Who am I?"):
        r = cli(env, "chat", "chatty", text, "--conversation", "c1", "--num-predict", "3", "--num-ctx", "256")
        assert r.returncode == 0, r.stderr
    turns = json.loads(saved.read_text())["c1"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    assert [t["content"] for t in turns[::2]] == ["Hello, I am Ada.", "Who am I?"]
    assert oct(saved.stat().st_mode & 0o777) == "0o600"
    other = [{"role": "user", "content": "from another shell"}]  # written meanwhile: kept, not overwritten
    saved.write_text(json.dumps(dict(json.loads(saved.read_text()), c2=other)))
    r = cli(env, "chat", "chatty", "--conversation", "c1", "--reset")
    assert r.returncode == 0 and "conversation 'c1' forgotten" in r.stderr, r.stderr
    assert json.loads(saved.read_text()) == {"c1": [], "c2": other}
    r = cli(env, "stop", "chatty")  # loaded by the chat above
    assert r.returncode == 0 and r.stderr.strip() == "chatty unloaded", r.stderr
    r = cli(env, "stop", "chatty")
    assert r.returncode == 0 and "chatty was not loaded: nothing to stop" in r.stderr, r.stderr
    r = cli(env, "stop", "nosuchmodel")
    assert r.returncode == 1 and r.stderr.startswith('error: no model is named "nosuchmodel"'), r.stderr
    assert "nothing to stop. `ps` shows the loaded models, `list` the ones there are" in r.stderr, r.stderr
    assert "synth" not in r.stderr and "pulling" not in r.stderr, r.stderr
    assert cli(env, "rm", "chatty").returncode == 0


def test_a_chat_with_a_model_that_has_no_chat_template_is_told_what_it_gets(manager, gemma_model):
    """Gemma 3 270M is a base model with no chat template: `chat` says, before its answer, that
    each message goes as it is, and that `run` continues a text; `run` says nothing of it."""
    env = manager["env"]
    assert cli(env, "create", "nb-gemma-chat", "--from", str(gemma_model)).returncode == 0
    try:
        r = cli(env, "chat", "nb-gemma-chat", "The capital of Germany is", "--num-predict", "4")
        assert r.returncode == 0, r.stderr
        assert "note: nb-gemma-chat has no chat template" in r.stderr and "`run nb-gemma-chat TEXT`" in r.stderr
        assert "<|im_" not in r.stdout
        r = cli(env, "run", "nb-gemma-chat", "The capital of Germany is", "--num-predict", "4")
        assert r.returncode == 0 and "no chat template" not in r.stderr
    finally:
        cli(env, "stop", "nb-gemma-chat")
        cli(env, "rm", "nb-gemma-chat")
