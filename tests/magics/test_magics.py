"""`%llama` on a bare InteractiveShell, against a real manager (a served one, and an embedded one)."""

from __future__ import annotations

import os

import pytest
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_llama.commands import RunResult
from jupyter_llama.magics import load_ipython_extension

pytestmark = [pytest.mark.engine, pytest.mark.slow]


class RecordingPublisher(DisplayPublisher):
    """IPython's own display machinery, keeping what was published (and whether as an update)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.published: list[dict] = []

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False):
        self.published.append({"data": data, "transient": transient or {}, "update": update})


@pytest.fixture
def shell(manager, monkeypatch):
    for k in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN"):
        monkeypatch.setenv(k, manager["env"][k])
    sh = InteractiveShell.instance()
    sh.display_pub = RecordingPublisher(shell=sh)
    sh.run_line_magic("load_ext", "jupyter_llama")
    magics = sh.magics_manager.registry["LlamaMagics"]
    magics._client = None  # find the manager from this test's environment
    magics.conversations.clear()
    sh.user_ns["topic"] = "a brave owl"
    yield sh
    if magics._client is not None:
        magics._client.close()
        magics._client = None


@pytest.fixture
def registered(shell):
    shell.run_line_magic("llama", "synth magic-tiny --layers 2 --embd 64 --ctx 2048")
    return "magic-tiny"


def test_run_streams_into_one_display_and_returns_a_result(shell, registered, capsys):
    pub = shell.display_pub
    pub.published.clear()
    # 0: every chunk updates the display, so the count does not depend on how fast the model is
    shell.run_line_magic("config", "LlamaMagics.update_interval = 0")
    r = shell.run_line_magic("llama", f"run {registered} 'Tell me about {{topic}}' --num-predict 60 --stats")
    shell.run_line_magic("config", "LlamaMagics.update_interval = 0.05")
    assert isinstance(r, RunResult) and r.text and r.tokens == 60
    ids = {p["transient"].get("display_id") for p in pub.published}
    assert len(ids) == 1 and None not in ids, "one display, updated in place"
    updates = [p for p in pub.published if p["update"]]
    assert len(updates) >= 2, f"it streams: {len(updates)} updates"
    assert pub.published[-1]["data"]["text/plain"] == r.text
    assert pub.published[-1]["data"]["text/markdown"].replace("  \n", "\n") == r.text
    assert "60 tokens" in capsys.readouterr().out


def test_raw_output_is_plain_text(shell, registered):
    pub = shell.display_pub
    pub.published.clear()
    r = shell.run_line_magic("llama", f"run {registered} Hello --num-predict 5 --raw")
    assert pub.published[-1]["data"] == {"text/plain": r.text}


def test_cell_form_takes_the_body_as_the_prompt_and_fills_names(shell, registered):
    r = shell.run_cell_magic("llama", f"run {registered} --num-predict 4", "Write about {topic}.\n{unknown} stays.")
    assert r.tokens == 4
    ev = shell.run_line_magic("llama", "explain --json")
    assert ev is None  # printed, not returned


def test_a_line_fills_names_after_splitting_so_their_quotes_stay(shell, registered):
    """IPython fills {name} in a magic's line before the magic splits it, so a value's quote
    ended the prompt's quoting ("cannot split the line: No closing quotation") or was lost;
    the line is now split first, then each word expanded as IPython would."""
    shell.user_ns["said"] = 'He said "hi" and it\'s fine'
    r = shell.run_line_magic("llama", f"run {registered} 'Summarise {{said}} now' --num-predict 2")
    assert r.tokens == 2
    shell.user_ns.update(which=registered, n=1)  # any word (a model's name, an option's value), as IPython expands
    r = shell.run_line_magic("llama", "run $which Hello --num-predict {n+2}")
    assert r.model == registered and r.tokens == 3
    # called from a function, its own variables too, before the notebook's (as IPython's expansion)
    shell.user_ns["k"] = 5
    out = shell.run_cell(f"def ask(k, what):\n    r = %llama run {registered} $what --num-predict {{k}}\n    return r\n"
                         "asked = ask(2, 'Hello')")
    assert out.success, out.error_in_exec
    assert shell.user_ns["asked"].tokens == 2 and shell.user_ns["asked"].model == registered


def test_chat_remembers_the_previous_turn(shell, registered):
    magics = shell.magics_manager.registry["LlamaMagics"]
    first = shell.run_cell_magic("llama", f"chat {registered} --conversation c1 --num-predict 4", "Hi, I am Ada.")
    second = shell.run_cell_magic("llama", f"chat {registered} --conversation c1 --num-predict 4", "Who am I?")
    convo = magics.conversations["c1"]
    assert [m["role"] for m in convo] == ["user", "assistant", "user", "assistant"]
    assert convo[0]["content"] == "Hi, I am Ada." and convo[1]["content"] == first.text
    assert convo[3]["content"] == second.text
    shell.run_line_magic("llama", f"chat {registered} --conversation c1 --reset")
    assert magics.conversations["c1"] == []


def test_default_model_from_config(shell, registered):
    magics = shell.magics_manager.registry["LlamaMagics"]
    magics.default_model = registered
    try:
        r = shell.run_cell_magic("llama", "run", "Hello")
        assert r.model == registered and r.text
    finally:
        magics.default_model = ""


def test_user_mistakes_are_usage_errors_with_advice(shell, registered):
    with pytest.raises(UsageError, match=r'^model "magic-tinny" not found, try pulling it first \(did you mean '
                                         r'"magic-tiny:latest"[^)]*\?\)\. '
                                         r'`pull magic-tinny` downloads it from Ollama' "'s registry"):
        shell.run_line_magic("llama", "run magic-tinny hi")
    with pytest.raises(UsageError, match="required"):
        shell.run_line_magic("llama", "run")
    with pytest.raises(UsageError, match="keep_alive"):
        shell.run_line_magic("llama", f"run {registered} hi --keep-alive soon")
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("llama", "frobnicate")
    # a cell's body is a prompt: a cell with no model, or for a command that takes none, says so
    with pytest.raises(UsageError, match=r"%%llama run needs a model: `%%llama run MODEL`, the cell being the prompt"):
        shell.run_cell_magic("llama", "run", "Hello")
    with pytest.raises(UsageError, match=r"%%llama ps takes no cell"):
        shell.run_cell_magic("llama", "ps", "Hello")
    with pytest.raises(UsageError, match=r"ftp://h:1 is not a jupyter-llama server's address"):
        shell.run_line_magic("llama", "--url ftp://h:1 ps")
    with pytest.raises(UsageError, match=r"ftp://h:1 is not a jupyter-llama server's address"):
        shell.run_line_magic("llama", "--url ftp://h:1 status")  # (status looks where it is told, too)
    with pytest.raises(UsageError, match=r"worker runs in the foreground until it is stopped, which would hold this "
                                         r"kernel: start it from a shell with `jupyter-llama worker`"):
        shell.run_line_magic("llama", "worker --port 1")


def test_listing_commands(shell, registered, capsys):
    shell.run_line_magic("llama", f"load {registered} --keep-alive 5s")
    capsys.readouterr()
    shell.run_line_magic("llama", "ps")
    assert "magic-tiny:latest" in capsys.readouterr().out
    shell.run_line_magic("llama", "list --json")
    assert '"magic-tiny:latest"' in capsys.readouterr().out
    shell.run_line_magic("llama", "devices")
    assert "cpu" in capsys.readouterr().out
    shell.run_line_magic("llama", f"stop {registered}")
    shell.run_line_magic("llama", "help")
    out = " ".join(capsys.readouterr().out.split())  # (argparse wraps the lines)
    assert "run" in out
    # it says how the other clients find the server with no configuration
    assert "OLLAMA_HOST" in out and "OPENAI_BASE_URL" in out and "%%ai ollama:MODEL" in out
    shell.run_line_magic("llama", "help run")  # (spelled as the magic is used, as its errors are)
    assert capsys.readouterr().out.startswith("usage: %llama run ")


def test_server_unreachable_says_how_to_start_one(monkeypatch):
    monkeypatch.setenv("JUPYTER_LLAMA_URL", "http://127.0.0.1:9/llama/")
    monkeypatch.setenv("JUPYTER_LLAMA_TOKEN", "x")
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "jupyter_llama")
    magics = sh.magics_manager.registry["LlamaMagics"]
    magics._client = None
    try:
        with pytest.raises(UsageError, match="jupyter-llama serve"):
            sh.run_line_magic("llama", "ps")
    finally:
        magics._client = None


def test_background_manager_in_plain_ipython(engine, tmp_path, monkeypatch):
    """No Jupyter server, no URL: the magic starts the user's background manager (and a
    LlamaClient() made afterwards, as the widgets make one, finds the same)."""
    from jupyter_llama import background
    from jupyter_llama.client import LlamaClient

    for k in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN", "JPY_PARENT_PID", "OLLAMA_HOST", "OLLAMA_API_KEY",
              "OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"):
        monkeypatch.setenv(k, "")  # (recorded, so restored after: %load_ext sets some of them)
        monkeypatch.delenv(k)
    monkeypatch.setenv("JUPYTER_LLAMA_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("JUPYTER_LLAMA_SERVER", engine.path)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("JUPYTER_LLAMA_MANAGER_DIR", str(tmp_path / "manager"))
    monkeypatch.setenv("OPENAI_API_KEY", "the user's own")  # a variable the user set is left alone
    sh = InteractiveShell.instance()
    sh.display_pub = RecordingPublisher(shell=sh)
    load_ipython_extension(sh)  # (what %load_ext calls; the shell is shared, and may have loaded it before)
    magics = sh.magics_manager.registry["LlamaMagics"]
    try:
        sh.run_line_magic("llama", "synth emb --layers 2 --embd 64")
        r = sh.run_line_magic("llama", "run emb Hello --num-predict 6")
        assert r.tokens == 6 and r.text
        info = magics.client().server
        assert info.url.startswith("http://127.0.0.1:") and info.source.startswith("background manager")
        with LlamaClient() as c:
            assert c.server.pid == info.pid
            assert [m["name"] for m in c.ps()["models"]] == ["emb:latest"]
        # Ollama's client, unconfigured, as in a JupyterLab kernel: %load_ext pointed it here
        assert os.environ["OLLAMA_HOST"] == info.url.rstrip("/") and os.environ["OLLAMA_API_KEY"] == info.token
        assert os.environ["OPENAI_API_KEY"] == "the user's own"
        ollama = pytest.importorskip("ollama")
        answer = ollama.Client().generate(model="emb", prompt="Hello", options={"num_predict": 3})
        assert answer.done and answer.eval_count == 3
    finally:
        if magics._client is not None:
            magics._client.close()
        magics._client = None
        background.stop()


def test_text_that_looks_like_a_path_is_shown_as_text(shell):
    from jupyter_llama.magics import NotebookFrontend

    fe = NotebookFrontend(shell.magics_manager.registry["LlamaMagics"])
    pub = shell.display_pub
    pub.published.clear()
    assert fe.stream(iter(["/", "etc", "/passwd"]), raw=False) == "/etc/passwd"
    assert pub.published[-1]["data"]["text/markdown"] == "/etc/passwd"


def test_markdown_keeps_the_models_line_breaks():
    from jupyter_llama.magics import _hard_breaks

    assert _hard_breaks("one\ntwo\n\nthree") == "one  \ntwo  \n\nthree"
    assert _hard_breaks("text\n```\ncode\nmore\n```\nend") == "text  \n```\ncode\nmore\n```\nend"
    assert _hard_breaks("/etc/passwd") == "/etc/passwd"


def test_run_stops_at_the_default_length_unless_asked(shell, registered):
    from jupyter_llama.commands import DEFAULT_NUM_PREDICT, build_parser

    r = shell.run_line_magic("llama", f"run {registered} 'Once upon a time'")
    assert r.tokens <= DEFAULT_NUM_PREDICT
    assert f"default {DEFAULT_NUM_PREDICT}" in build_parser()._llama_sub.choices["run"].format_help()


def test_create_from_a_modelfile_and_show_its_preset(shell, registered, tmp_path, capsys):
    (tmp_path / "Modelfile").write_text(f'FROM {registered}\nSYSTEM """You are Mario.\nOnly Mario."""\n'
                                        "PARAMETER temperature 0.25\nPARAMETER stop ###\n")
    shell.run_line_magic("llama", f"create magic-mario -f {tmp_path / 'Modelfile'}")
    capsys.readouterr()
    shell.run_line_magic("llama", "show magic-mario")
    out = capsys.readouterr().out
    assert "system:                   You are Mario.\n                          Only Mario." in out
    assert "temperature                    0.25" in out and 'stop                           "###"' in out
    (tmp_path / "Bad").write_text(f"FROM {registered}\nADAPTER ./lora.gguf\n")
    with pytest.raises(UsageError, match="Modelfile line 2: LoRA adapters"):
        shell.run_line_magic("llama", f"create magic-bad -f {tmp_path / 'Bad'}")
    shell.run_line_magic("llama", "rm magic-mario")


def test_terminal_ipython_streams_the_answer_once_and_names_what_it_cannot_show(manager, registered, tmp_path):
    """Terminal IPython prints a display, and each update of it again below: a streamed
    answer came out as one growing copy of itself after another. There it streams as the CLI
    does (each piece once); a plot is a PNG file; a widget is a sentence, not a repr."""
    import subprocess
    import sys

    script = tmp_path / "cells.ipy"
    script.write_text("%load_ext jupyter_llama\n"
                      "%config LlamaMagics.update_interval = 0\n"
                      f"r = %llama run {registered} 'Once upon a time' --num-predict 40\n"
                      "print('\\x02' + r.text + '\\x03')\n"
                      f"%llama plot {registered}\n"
                      f"%llama plot {registered} -o {tmp_path / 'mine.png'}\n"
                      "%llama panel\n")
    done = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--colors=nocolor", "--simple-prompt",
                           str(script)], env=manager["env"], capture_output=True, text=True, timeout=300)
    out = done.stdout
    text = out.split("\x02", 1)[1].split("\x03", 1)[0]  # (the result's text, printed between the markers)
    assert text.strip() and out.count(text.strip()) == 2, out  # streamed once, then the print of the result
    assert "plot written to " in out and ".png" in out and "<Figure" not in out, out
    assert f"plot written to {tmp_path / 'mine.png'}" in out and (tmp_path / "mine.png").stat().st_size > 0, out
    assert "`%llama panel` shows a widget, which needs a notebook" in out + done.stderr, out + done.stderr
    assert "RunningPanel(" not in out


def test_an_unassigned_run_is_not_echoed_and_an_assigned_one_is_kept(shell, registered):
    """Every unassigned `%llama run` echoed `Out[n]: <RunResult ...>` under its answer; `r =
    %llama run ...` (the README's way) still gives the result, which a later cell shows."""
    pub = shell.display_pub
    pub.published.clear()
    out = shell.run_cell(f"%llama run {registered} Hello --num-predict 3", store_history=True)
    assert out.success and isinstance(out.result, RunResult) and shell.user_ns["_"] is out.result
    assert pub.published and all(p["transient"].get("display_id") for p in pub.published)  # (the answer's only)
    assert not any("RunResult" in p["data"].get("text/plain", "") for p in pub.published)
    assert shell.run_cell(f"r = %llama run {registered} Hello --num-predict 3", store_history=True).success
    pub.published.clear()
    shell.run_cell("r", store_history=True)
    assert [p["data"]["text/plain"] for p in pub.published] == [repr(shell.user_ns["r"])]
    assert repr(shell.user_ns["r"]).startswith(f"<RunResult {registered}: 3 tokens")


def test_the_stop_button_keeps_the_text_and_says_stopped(shell, capsys):
    """The stop button (SIGINT to the kernel) printed a 159-line httpcore traceback: now the
    answer so far stays, one line says "(stopped)", `r` holds the text, and the manager,
    its connection closed, lets the model go."""
    import signal
    import threading
    import time

    shell.run_line_magic("llama", "synth magic-slow --layers 8 --embd 512 --vocab 32000 --ctx 8192 --type q8_0")
    shell.run_line_magic("llama", "load magic-slow --num-ctx 4096")
    magics = shell.magics_manager.registry["LlamaMagics"]
    pub = shell.display_pub
    pub.published.clear()
    capsys.readouterr()
    running = [True]

    def interrupt(signum, frame):  # (only while the cell runs: a late one must not stop the test session)
        if running[0]:
            raise KeyboardInterrupt

    def stop_button():
        deadline = time.monotonic() + 120
        while not pub.published and time.monotonic() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    old = signal.signal(signal.SIGINT, interrupt)
    pusher = threading.Thread(target=stop_button, daemon=True)
    try:
        pusher.start()
        out = shell.run_cell("r = %llama run magic-slow 'Once upon a time' --num-ctx 4096 --num-predict 3000 "
                             "--temperature 0", store_history=True)
    finally:
        running[0] = False
        pusher.join(timeout=130)
        signal.signal(signal.SIGINT, old)
    try:
        r = shell.user_ns.get("r")
        assert out.success, out.error_in_exec
        assert isinstance(r, RunResult) and r.stopped and r.text, r
        assert pub.published[-1]["data"]["text/plain"] == r.text  # the whole text so far, on the screen
        printed = capsys.readouterr()
        assert printed.out.endswith("(stopped)\n") and "Traceback" not in printed.out + printed.err, printed
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = next(m for m in magics.client().ps()["models"] if m["name"] == "magic-slow:latest")
            if not m["refcount"]:
                break
            time.sleep(0.2)
        assert m["refcount"] == 0, m  # (3000 tokens would take far longer)
    finally:
        shell.run_line_magic("llama", "rm magic-slow")
