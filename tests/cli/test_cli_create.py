"""`jupyter-llama create NAME -f Modelfile` end to end: a subprocess against a real manager."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

OPTS = ["--num-ctx", "1024", "--num-parallel", "1", "--num-thread", "1"]


def cli(env, *args, cwd=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "jupyter_llama.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def prompt_tokens(stats: str) -> int:
    """The prompt token count `run --stats` prints ("..., prompt 23 tokens, ...")."""
    part = next(p for p in stats.split(", ") if p.startswith("prompt "))
    return int(part.split()[1])


def test_create_from_a_modelfile_then_show_and_run(manager, make_model, tmp_path):
    env = manager["env"]
    weights = tmp_path / "weights"
    weights.mkdir()
    gguf = make_model("cli-modelfile", layers=2, embd=64, heads=4, kv_heads=2, ctx=2048, seed=41)
    (weights / "base.gguf").write_bytes(gguf.read_bytes())
    (tmp_path / "Modelfile").write_text('''# a preset on a GGUF next to this file
FROM ./weights/base.gguf
PARAMETER num_ctx 1024
PARAMETER num_parallel 1
PARAMETER num_thread 1
PARAMETER stop "<|im_end|>"
SYSTEM """You are Mario.
Answer as Mario."""
message user Who are you?
MESSAGE assistant "It is me,
Mario!"
LICENSE MIT
''')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli(env, "create", "cli-mario", "-f", str(tmp_path / "Modelfile"), cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "created cli-mario" in (r.stdout + r.stderr)

    shown = cli(env, "show", "cli-mario")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "preset parameters:" in out and 'stop                           "<|im_end|>"' in out
    assert "system:                   You are Mario.\n                          Answer as Mario." in out
    assert "message (assistant):      It is me,\n                          Mario!" in out and "license:" in out
    data = json.loads(cli(env, "show", "cli-mario", "--json").stdout)
    assert data["system"] == "You are Mario.\nAnswer as Mario."
    assert data["messages"] == [{"role": "user", "content": "Who are you?"},
                                {"role": "assistant", "content": "It is me,\nMario!"}]

    # the preset reaches the child: the same prompt count as the bare model given the same turns
    base = cli(env, "create", "cli-base", "--from", str(weights / "base.gguf"))
    assert base.returncode == 0, base.stderr
    mario = cli(env, "run", "cli-mario", "Hello", "--num-predict", "1", "--stats")
    assert mario.returncode == 0, mario.stderr
    plain = cli(env, "run", "cli-base", "Hello", "--num-predict", "1", "--stats", *OPTS)
    assert prompt_tokens(mario.stderr) > prompt_tokens(plain.stderr)

    # the Modelfile `show` writes recreates the model (FROM the same weights, the same preset)
    (tmp_path / "Again").write_text(data["modelfile"])
    r = cli(env, "create", "cli-again", "-f", str(tmp_path / "Again"))
    assert r.returncode == 0, r.stderr
    again = json.loads(cli(env, "show", "cli-again", "--json").stdout)
    for key in ("system", "messages", "parameters", "license"):
        assert again[key] == data[key], key
    model_of = [f["digest"] for f in data["files"] if f["role"] == "model"]
    assert model_of == [f["digest"] for f in again["files"] if f["role"] == "model"]

    # FROM a model name: layered on cli-mario, the new values win
    (tmp_path / "Luigi").write_text("FROM cli-mario\nSYSTEM You are Luigi\nPARAMETER num_ctx 512\n")
    r = cli(env, "create", "cli-luigi", "-f", str(tmp_path / "Luigi"))
    assert r.returncode == 0, r.stderr
    luigi = json.loads(cli(env, "show", "cli-luigi", "--json").stdout)
    assert luigi["system"] == "You are Luigi" and luigi["messages"] == data["messages"]
    assert "num_ctx                        512" in luigi["parameters"] and "<|im_end|>" in luigi["parameters"]

    # without -f, ./Modelfile is read
    r = cli(env, "create", "cli-default", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("cli-mario", "cli-base", "cli-again", "cli-luigi", "cli-default"):
        assert cli(env, "rm", name).returncode == 0


@pytest.mark.parametrize("text, words", [
    ("FROM tiny\nFORM tiny\n", 'Modelfile line 2: unknown instruction "FORM" (did you mean FROM?)'),
    ("FROM tiny\nADAPTER ./lora.gguf\n", "Modelfile line 2: LoRA adapters (ADAPTER) are not supported"),
    ("FROM tiny\nPARAMETER top_k many\n", 'Modelfile line 2: PARAMETER top_k: "many" is not a whole number'),
    ('FROM tiny\nSYSTEM """never\nclosed\n', 'Modelfile line 2: the """ that opens SYSTEM here is never closed'),
    ("FROM ./nowhere.gguf\n", "Modelfile line 1: FROM ./nowhere.gguf: there is no such file"),
])
def test_a_bad_modelfile_is_a_usage_error_naming_the_line(manager, tmp_path, text, words):
    (tmp_path / "Modelfile").write_text(text)
    r = cli(manager["env"], "create", "cli-bad", "-f", str(tmp_path / "Modelfile"))
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_create_needs_a_source(manager, tmp_path):
    r = cli(manager["env"], "create", "cli-nothing", cwd=tmp_path)
    assert r.returncode == 2 and "give --from FILE.gguf or -f MODELFILE" in r.stderr
    r = cli(manager["env"], "create", "cli-nothing", "-f", str(tmp_path / "missing"))
    assert r.returncode == 2 and "there is no file" in r.stderr
