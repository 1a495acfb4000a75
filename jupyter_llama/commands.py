"""One grammar for ``%llama WORDS`` and ``jupyter-llama WORDS``, and the commands behind it.

The parser and the command functions are shared; only the front end differs. A front end
implements :class:`Frontend` (how to print, stream, show progress, and which manager to
talk to): the CLI prints to the terminal, the magic updates display handles in a cell.
Commands raise :class:`CommandError` for anything the user can fix; the CLI turns it into
an exit status and a one-line message, the magic into a ``UsageError``.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from .models.names import plainly_a_path, same_model

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A failure to report in one line; ``code`` is the CLI's exit status."""

    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


def close_matches(word: str, choices) -> list[str]:
    """The few of ``choices`` that ``word`` looks like a misspelling of (none when none is close)."""
    return difflib.get_close_matches(word, [str(c) for c in choices], n=3, cutoff=0.6)


def _did_you_mean(matches: list[str]) -> str:
    return matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: raise, so the magic can show them too
        raise CommandError(f"{self.prog}: {message}", EXIT_USAGE)

    def _check_value(self, action, value):
        """A choice that is not one (a command's name, an option's value): the close ones are
        offered instead of the whole list, when there are close ones."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            matches = close_matches(value, action.choices) if isinstance(value, str) and action.choices else []
            if not matches:
                raise
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (did you mean "
                                                 f"{_did_you_mean(matches)}?)") from None

    def parse_args(self, args=None, namespace=None):
        """As argparse's, with an unknown option's close known ones (``--temprature``: did you
        mean --temperature?) among those of the command it was given to."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            known = self._known_options(ns)
            close = [(w, m) for w in (e.split("=", 1)[0] for e in extras if e.startswith("--") and len(e) > 2)
                     for m in [close_matches(w, known)] if m]
            hint = ("" if not close else f" (did you mean {_did_you_mean(close[0][1])}?)" if len(close) == 1 else
                    " (did you mean " + "; ".join(f"{_did_you_mean(m)} for {w}" for w, m in close) + "?)")
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns

    def _known_options(self, ns) -> list[str]:
        """The long options that the command in ``ns`` (and the parsers above it) take."""
        known, parser = [], self
        while parser is not None:
            known += [o for o in parser._option_string_actions if o.startswith("--") and o != "--help"]
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            chosen = getattr(ns, sub.dest, None) if sub is not None else None
            parser = sub.choices.get(chosen) if chosen else None
        return known

    def exit(self, status=0, message=None):  # `--help` inside a magic must not exit the kernel
        if message:
            sys.stderr.write(message)
        raise _HelpShown(status)


class _HelpShown(Exception):
    def __init__(self, status: int):
        self.status = status


# ----------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """What ``r = %llama run ...`` gives back: the text, the numbers, and how the load went."""

    model: str
    text: str = ""
    stats: dict = field(default_factory=dict)  # Ollama's final-chunk numbers
    load_seconds: float = 0.0
    placement: str = ""  # "CPU", "GPU" or "37% GPU / 63% CPU"
    stopped: bool = False  # interrupted (Ctrl-C, a notebook's stop button): ``text`` is what came before

    # Set by the magic on a result it has just streamed into its cell: that cell's echo of the
    # result (``Out[n]: <RunResult ...>`` under an unassigned ``%llama run``) is left out, while
    # ``r = %llama run ...`` still gives ``r`` (see :meth:`_ipython_display_`).
    _shown_in_cell = False

    @property
    def tokens(self) -> int:
        return int(self.stats.get("eval_count") or 0)

    @property
    def tokens_per_second(self) -> float:
        ns = self.stats.get("eval_duration") or 0
        return self.tokens / (ns / 1e9) if ns else 0.0

    def stats_line(self) -> str:
        parts = [f"{self.tokens} tokens", f"{self.tokens_per_second:.1f} tokens/s"]
        prompt = self.stats.get("prompt_eval_count")
        if prompt:
            parts.append(f"prompt {prompt} tokens")
        parts.append(f"load {self.load_seconds:.2f}s" if self.loaded_now else "already loaded")
        if self.placement:
            parts.append(f"on {self.placement}")
        reason = self.stats.get("done_reason")
        if reason and reason != "stop":
            parts.append(f"stopped: {reason}")
        return f"{self.model}: " + ", ".join(parts)

    @property
    def loaded_now(self) -> bool:
        """Whether this answer waited for its model to load: the manager's load_duration is
        0 for a model that was ready (however long its health check took)."""
        return self.load_seconds > 0

    def __repr__(self) -> str:
        what = f"{len(self.text)} characters, stopped" if self.stopped else f"{self.tokens} tokens"
        return f"<RunResult {self.model}: {what}; .text, .stats, .load_seconds>"

    def _ipython_display_(self) -> None:
        """IPython's echo of the value (and ``display(r)``): nothing right after the magic
        streamed it into this very cell (the text is on the screen already), else its repr."""
        if self._shown_in_cell:
            return
        from IPython.display import display

        display({"text/plain": repr(self)}, raw=True)


class StreamStopped(Exception):
    """Raised by :meth:`Frontend.stream` when the user interrupted it (Ctrl-C, a notebook's stop
    button), once what had come was shown: ``text``."""

    def __init__(self, text: str):
        super().__init__("stopped")
        self.text = text


class Frontend:
    """What a command needs from the place it runs in. The CLI and the magic implement it."""

    namespace: dict | None = None  # for {name} in a cell's body (the notebook's variables; see fill_placeholders)
    mid_line = False  # streamed text is on the terminal's last line, which no line end has closed yet
    foreground = True  # a command may hold it until stopped (a shell may; a kernel must stay free: False)
    person_at_keyboard = False  # a person types at a terminal: `run` may ask for prompts and pull what is missing
    waits_aloud = False  # says so when an answer waits for its model to load (a shell; a notebook shows its cell busy)
    conversations: dict[str, list[dict]]

    def client(self):  # -> LlamaClient
        raise NotImplementedError

    def running_client(self):  # -> LlamaClient | None
        """The client of a manager that runs now; None where none does (nothing is started)."""
        return self.client()

    def has_manager(self, args=None) -> bool:
        """Whether a manager is known without starting one (starting the background one is not free)."""
        return bool(getattr(args, "url", None) or _manager_configured())

    def out(self, text: str) -> None:
        raise NotImplementedError

    def json(self, data: Any) -> None:
        self.out(json.dumps(data, indent=2, default=str))

    def note(self, text: str) -> None:
        """A side remark (loading..., took ...) that is not part of the answer."""
        self.out(text)

    def stream(self, chunks: Iterator[str], *, raw: bool) -> str:
        """Show text as it arrives; return the whole text (interrupted: raise StreamStopped
        with the text so far, once it is shown). Here: each piece written to standard output
        as it comes (a terminal's way)."""
        parts = []
        try:
            for piece in chunks:
                parts.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
                self.mid_line = True  # (an interruption now ends the line before it says so)
        except KeyboardInterrupt:
            if self.mid_line:
                sys.stdout.write("\n")
                sys.stdout.flush()
                self.mid_line = False
            raise StreamStopped("".join(parts)) from None
        sys.stdout.write("\n")
        self.mid_line = False
        return "".join(parts)

    def piped_input(self) -> str | None:
        """Text piped into the command (``echo hi | jupyter-llama run m``), or None."""
        return None

    def ask(self, prompt: str) -> str | None:
        """A line the person types after ``prompt``; None at the end of input (Ctrl-D)."""
        return None

    def progress(self, statuses: Iterator[dict]) -> dict:
        """Show pull progress; return the last status. Here: on standard error, one line
        rewritten in place on a terminal, else a line a file or stage (and each file's last)."""
        from .models.pull import render_progress

        last: dict = {}
        tty = sys.stderr.isatty()
        for st in statuses:
            last = st
            line = render_progress(st)
            if tty:
                sys.stderr.write("\r\033[K" + line)
            elif "completed" not in st or st.get("completed") == st.get("total"):
                sys.stderr.write(line + "\n")
            sys.stderr.flush()
        if tty:
            sys.stderr.write("\n")
        return last

    def pull(self, source: str, name: str | None) -> dict:
        """Pull through the manager, showing progress; return the last status."""
        return self.progress(self.client().pull(source, name, stream=True))

    def figure(self, fig, output: str | None = None, name: str = "plot") -> None:
        """Show a matplotlib figure, and write it to ``output`` (a PNG file) when given. Here:
        written as a PNG, to ``output`` or else to this user's ``jupyter-llama-NAME.png`` in
        the manager's state folder (the next figure of that name replaces it)."""
        self.write_figure(fig, output or _scratch_path(f"{name}.png"))

    def write_figure(self, fig, path: str) -> None:
        """Write a figure to ``path`` as a PNG, and say where."""
        fig.savefig(path, dpi=110)
        self.out(f"plot written to {path}")

    def widget(self, name: str, **kw):
        raise CommandError(f"`{name}` shows a widget: use it in a notebook (%llama {name})", EXIT_USAGE)


# ----------------------------------------------------------------------------- grammar

LOAD_OPTIONS = ("num_ctx", "num_gpu", "num_parallel", "num_batch", "num_ubatch", "num_thread", "cache_type_k",
                "cache_type_v", "flash_attn")
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed", "num_predict")
# An answer in a cell or a terminal ends here unless asked for more: a small model that never
# says "stop" would otherwise write until its context is full.
DEFAULT_NUM_PREDICT = 256


def _model_options(p: argparse.ArgumentParser, sampling: bool = True, keep_alive: bool = True) -> None:
    """The load options (and, with ``sampling``, a request's); ``keep_alive`` for the commands
    that load the model (not estimate or plot, which load nothing of their own)."""
    g = p.add_argument_group("load options (changing one reloads the model)")
    g.add_argument("--num-ctx", type=int, help="context per request, in tokens")
    g.add_argument("--num-gpu", type=int,
                   help="layers on the devices, GPUs or RPC workers (0 = CPU only; default: llama.cpp decides)")
    g.add_argument("--num-parallel", type=int, help="parallel request slots")
    g.add_argument("--num-batch", type=int, help="logical batch size")
    g.add_argument("--num-ubatch", type=int, help="physical batch size (the compute buffer grows with it)")
    g.add_argument("--num-thread", type=int, help="CPU threads")
    from .load_options import KV_CACHE_TYPES as kv_types

    g.add_argument("--cache-type-k", choices=kv_types, help="the KV cache's type for keys (default f16)")
    g.add_argument("--cache-type-v", choices=kv_types,
                   help="for values (default f16; a quantised one needs flash attention)")
    g.add_argument("--flash-attn", choices=("on", "off", "auto"), help="flash attention (default: llama.cpp decides)")
    if keep_alive:
        p.add_argument("--keep-alive", help="how long the model stays loaded when idle: 300 (seconds), 10m, 1h30m; "
                                            "-1 for ever, 0 to unload it once answered (a new value never reloads it)")
    if sampling:
        s = p.add_argument_group("sampling (never reloads)")
        s.add_argument("--system", help="system prompt")
        s.add_argument("--temperature", type=float, help="randomness (0: always the likeliest token)")
        s.add_argument("--top-k", type=int, help="choose among the k likeliest tokens")
        s.add_argument("--top-p", type=float, help="choose among the likeliest tokens that make up this probability")
        s.add_argument("--seed", type=int, help="the random seed (the same seed, prompt and options: the same text)")
        s.add_argument("--num-predict", type=int,
                       help=f"most tokens to generate (default {DEFAULT_NUM_PREDICT}, or the model's Modelfile "
                            "num_predict; -1: until the model stops or the context is full)")
        s.add_argument("--stop", action="append", help="stop sequence (repeatable)")
        s.add_argument("--format", choices=("json",), help="constrain the answer to JSON")
        s.add_argument("--raw", action="store_true", help="plain text, no Markdown rendering (and no chat template)")
        s.add_argument("--stats", action="store_true", help="print tokens, tokens/s, load time and placement")


def _at_least_one(text: str) -> int:
    """An argument that counts something: a whole number of 1 or more."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return n


def _options(args) -> dict:
    opts = {k: getattr(args, k) for k in LOAD_OPTIONS + SAMPLING_OPTIONS if getattr(args, k, None) is not None}
    if getattr(args, "stop", None):
        opts["stop"] = args.stop
    return opts


def _shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--embd", type=int, help="embedding width")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="key/value heads (GQA when fewer than heads)")
    p.add_argument("--ff", type=int, help="feed-forward width")
    p.add_argument("--vocab", type=int, help="vocabulary size")
    p.add_argument("--ctx", type=int, help="training context length")
    p.add_argument("--type", choices=("f32", "f16", "q8_0", "q4_0"), help="weight type")
    p.add_argument("--seed", type=int, help="random seed (same seed, same bytes)")


SHAPE_FIELDS = ("layers", "embd", "heads", "kv_heads", "ff", "vocab", "ctx", "type", "seed")
SYNTH_FIELDS = SHAPE_FIELDS + ("template", "fim", "arch")


@functools.lru_cache(maxsize=4)
def build_parser(prog: str = "jupyter-llama") -> argparse.ArgumentParser:
    """The grammar. ``prog`` is ``jupyter-llama`` for the CLI and ``%llama`` in a notebook.

    Built once per ``prog`` (a magic runs it on every call; parsing does not change it).
    """
    parser = _Parser(prog=prog,
                     description="Run and manage local llama.cpp models: Ollama's manager layer, in Jupyter.",
                     epilog="Other clients, unconfigured: in a kernel that a Jupyter server with this extension "
                            "started, OLLAMA_HOST and OLLAMA_API_KEY, OPENAI_BASE_URL and OPENAI_API_KEY, "
                            "ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY point at that server (unless you set them), so "
                            "ollama.chat(...), openai.OpenAI(), anthropic.Anthropic(), langchain's Ollama and OpenAI "
                            "classes and %%ai ollama:MODEL work as they are.")
    parser.set_defaults(prog=prog)  # (`help COMMAND` prints the usage as this front end spells it)
    parser.add_argument("--url", help="the manager's API URL (default: JUPYTER_LLAMA_URL, else a running Jupyter "
                                      "server of yours with the extension, else your background manager)")
    parser.add_argument("--token", help="its token (default: JUPYTER_LLAMA_TOKEN or the server's runtime file)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name, func, help, **kw):
        p = sub.add_parser(name, help=help, description=help, **kw)
        p.set_defaults(func=func)
        return p

    p = add("run", cmd_run, "generate text from a prompt (streamed)")
    p.add_argument("model")
    p.add_argument("prompt", nargs="*", help="the prompt (in a %%llama cell: the cell body)")
    _model_options(p)

    p = add("chat", cmd_chat, "one turn of a conversation, remembered by name (by a notebook's kernel; from a "
                              "shell, between commands)")
    p.add_argument("model")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--conversation", default="default", help="which conversation (default: default)")
    p.add_argument("--reset", action="store_true", help="forget the conversation first")
    _model_options(p)

    p = add("load", cmd_load, "load a model without generating (empty prompt)")
    p.add_argument("model")
    _model_options(p, sampling=False)

    p = add("stop", cmd_stop, "unload a model now")
    p.add_argument("model")

    p = add("status", cmd_status, "which manager commands use, where it was found, and what it has loaded")
    p.add_argument("--stop", action="store_true", help="stop your background manager (and its models)")
    p.add_argument("--json", action="store_true")

    p = add("ps", cmd_ps, "loaded models: memory, placement, context, expiry")
    p.add_argument("--json", action="store_true")

    p = add("log", cmd_log, "a loaded model's llama-server log: devices, layers, buffers, errors")
    p.add_argument("model")
    p.add_argument("--lines", "-n", type=int, default=40, help="how many of the last lines (default 40)")
    p.add_argument("--match", "-m", help="only lines containing this text (e.g. 'buffer size' or 'offloaded')")
    p.add_argument("--json", action="store_true")

    p = add("list", cmd_list, "models in the registry")
    p.add_argument("--json", action="store_true")

    p = add("show", cmd_show, "one model's metadata, files and parameters")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")

    p = add("pull", cmd_pull, "download a model: a registry name (llama3.2:1b, from JUPYTER_LLAMA_REGISTRY, "
                              "default Ollama's), hf.co/OWNER/REPO[:QUANT] or an http(s) URL")
    p.add_argument("source")
    p.add_argument("--name", help="name to register it under")

    p = add("create", cmd_create, "register a local GGUF file under a name, or make a model from a Modelfile")
    p.add_argument("name")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--from", dest="from_file", metavar="FILE", help="a GGUF file")
    g.add_argument("--file", "-f", dest="modelfile", metavar="MODELFILE",
                   help="an Ollama Modelfile (FROM, PARAMETER, SYSTEM, TEMPLATE, MESSAGE, LICENSE); "
                        "default: ./Modelfile when neither is given")

    p = add("synth", cmd_synth, "make a synthetic llama GGUF: register it as NAME, write it to --output, or both")
    p.add_argument("name", nargs="?")
    p.add_argument("--output", "-o", help="write the file here instead of registering it")
    p.add_argument("--projector", action="store_true",
                   help="also make a multimodal projector for it (a vision model; with --output, FILE-mmproj.gguf)")
    p.add_argument("--template", choices=("chatml", "tools"),
                   help="its chat template: chatml (default), or tools (tool calls and reasoning, wired so that "
                        "the model really calls a tool it is offered)")
    p.add_argument("--fim", action="store_true", default=None,
                   help="give it fill-in-the-middle tokens (generate with suffix, llama-server's /infill)")
    p.add_argument("--arch", choices=("llama", "qwen3", "gemma3", "qwen3moe", "lfm2", "deepseek2"),
                   help="its architecture family (default llama): qwen3, gemma3 (sliding window), qwen3moe "
                        "(experts), lfm2 (recurrent state), deepseek2 (compressed KV cache)")
    _shape_options(p)

    p = add("cp", cmd_cp, "copy a model to a new name (no bytes are copied)")
    p.add_argument("source")
    p.add_argument("destination")

    p = add("rm", cmd_rm, "remove models (a loaded one is unloaded first)")
    p.add_argument("models", nargs="+")

    p = add("prune", cmd_prune, "drop partial downloads no pull is working on (their resume is lost), "
                                "blobs no model uses (kept for an hour after they were written), "
                                "and left-over temporary files")
    p.add_argument("--json", action="store_true")

    p = add("estimate", cmd_estimate, "predict memory for a model (or GGUF file) under load options")
    p.add_argument("model")
    _model_options(p, sampling=False, keep_alive=False)
    p.add_argument("--json", action="store_true")

    p = add("explain", cmd_explain, "the manager's recent decisions (about MODEL), in words and numbers")
    p.add_argument("model", nargs="?")
    p.add_argument("--limit", type=_at_least_one, default=20, help="how many of the latest decisions (default 20)")
    p.add_argument("--json", action="store_true")

    p = add("devices", cmd_devices, "GPUs, host memory and the budgets in force")
    p.add_argument("--json", action="store_true")

    p = add("inspect", cmd_inspect, "a GGUF file's architecture, shape and tensors")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--tensors", action="store_true", help="also list every tensor and bytes per layer")

    eng = add("engine", None, "build or inspect the llama-server engine")
    esub = eng.add_subparsers(dest="engine_command", metavar="ACTION", parser_class=_Parser)
    eng.set_defaults(func=lambda args, fe: _usage(eng))
    b = esub.add_parser("build", help="build llama-server for this machine from the pinned llama.cpp source")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--cuda", action="store_true",
                   help="build the CUDA backend (with the system's CUDA toolkit, else NVIDIA's CUDA 13 wheels from "
                        "the package index, installed into the engine cache)")
    g.add_argument("--vulkan", action="store_true", help="build the Vulkan backend (needs libvulkan-dev, glslc)")
    b.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    b.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    b.add_argument("--toolkit", choices=("auto", "system", "wheels"), default="auto",
                   help="with --cuda: the CUDA toolkit to build with (default auto: a complete system toolkit "
                        "whose CUDA the driver runs, else the wheels)")
    b.add_argument("--cuda-arch", metavar="LIST",
                   help="with --cuda: GPU architectures to compile for, such as '86;90' (default: this machine's "
                        "GPUs; without one, 75;80;86;89;90;100;120; also JUPYTER_LLAMA_CUDA_ARCHS)")
    b.set_defaults(func=cmd_engine_build)
    s = esub.add_parser("status", help="which llama-server is used, its version and devices")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_engine_status)

    p = add("worker", cmd_worker, "run a llama.cpp RPC worker (ggml-rpc-server) in the foreground: its device "
                                  "becomes a device of the manager (JUPYTER_LLAMA_RPC_WORKERS=HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; ggml's RPC has "
                                                        "no authentication: beyond loopback, a private network only)")
    p.add_argument("--port", type=int, default=50052, help="port to listen on (default 50052)")
    p.add_argument("--threads", type=int, help="CPU threads for a CPU device (default: the worker's own, 1)")
    p.add_argument("--device", help="which of this machine's devices to serve, comma-separated (e.g. CUDA0); "
                                    "default: the first GPU, else the CPU")
    p.add_argument("--cache", action="store_true", help="keep a local file cache of tensors sent to the worker")

    p = add("plot", cmd_plot, "plot predicted against actual memory for a model")
    p.add_argument("model")
    p.add_argument("--output", "-o", metavar="FILE.png",
                   help="write the figure to this PNG file too (in a terminal: there, not to a temporary file)")
    _model_options(p, sampling=False, keep_alive=False)

    add("picker", lambda a, fe: fe.widget("picker"), "a widget to pick, estimate, load and run models")
    add("panel", lambda a, fe: fe.widget("panel"), "a live widget of loaded models, memory and decisions")

    p = add("serve", _serve_elsewhere, "run a lasting manager: a Jupyter server with only this extension "
                                       "(`jupyter-llama serve --help` for its options)")
    p.add_argument("rest", nargs=argparse.REMAINDER)

    p = add("help", cmd_help, "help on a command")
    p.add_argument("topic", nargs="?")
    parser._llama_sub = sub  # for `help COMMAND`
    return parser


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return EXIT_USAGE


def parse(words: Sequence[str] | str, prog: str = "jupyter-llama") -> argparse.Namespace:
    """Parse words (a list, or a line split like a shell would). Raises CommandError on bad usage."""
    if isinstance(words, str):
        try:
            words = shlex.split(words)
        except ValueError as e:
            raise CommandError(f"{prog}: cannot split the line: {e}", EXIT_USAGE) from None
    return build_parser(prog).parse_args(list(words))


def execute(args: argparse.Namespace, fe: Frontend, body: str | None = None):
    """Run the parsed command (``body``: a cell's text, the prompt of ``run`` and ``chat``);
    an error of the client's that the command did not put in its own words (finding or
    starting the server, mostly) becomes a CommandError with the client's sentence."""
    func = getattr(args, "func", None)
    if func is None:
        return _usage(build_parser())
    from .config import ConfigError

    try:
        return func(args, fe) if body is None else func(args, fe, body=body)
    except ConfigError as e:  # (a setting of this shell's: the background manager's, mostly)
        raise CommandError(str(e), EXIT_USAGE) from None
    except Exception as e:
        client = sys.modules.get("jupyter_llama.client")  # (only a command that used it can have its error)
        if client is not None and isinstance(e, client.LlamaError):
            # the server's sentence is what a person reads (as `ollama` prints it); the HTTP
            # status only picks the exit code
            raise CommandError(e.message, EXIT_USAGE if e.status == 400 else EXIT_FAIL) from None
        httpx = sys.modules.get("httpx")
        if httpx is not None and isinstance(e, httpx.TransportError):  # (the manager went away mid-command)
            raise CommandError(_transport_words(e, getattr(args, "prog", "jupyter-llama"))) from None
        raise


def _transport_words(e: Exception, prog: str) -> str:
    """One sentence for a connection to the manager that failed while a command used it (it
    closed, reset or timed out: the manager stopped, crashed or was killed), and what to do."""
    import httpx

    try:
        u = e.request.url  # type: ignore[attr-defined]
        where = f" at {u.scheme}://{u.netloc.decode()}"
    except (AttributeError, RuntimeError):  # (an error raised without its request)
        where = ""
    detail = str(e) or type(e).__name__
    try:
        from .background import state_dir

        log = f"the background manager's is {state_dir() / 'jupyter-llama-manager.log'}"
    except Exception:  # noqa: BLE001 - only a hint
        log = "the background manager's is in its state folder"
    todo = (f"`{prog} status` says whether it still runs, and its log what happened ({log}; a `jupyter-llama serve` "
            "or a JupyterLab prints its own in its terminal)")
    if isinstance(e, httpx.TimeoutException):
        return f"the manager{where} stopped answering ({detail}): {todo}"
    if isinstance(e, httpx.ConnectError):
        return f"cannot reach the manager{where} ({detail}): {todo}"
    return f"the manager{where} closed the connection before its answer was complete ({detail}): {todo}"


# ----------------------------------------------------------------------------- helpers

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def fill_placeholders(text: str, namespace: dict | None) -> str:
    """``{name}`` becomes ``str(namespace[name])`` when the name exists; anything else stays."""
    if not namespace:
        return text
    return _PLACEHOLDER.sub(lambda m: str(namespace[m.group(1)]) if m.group(1) in namespace else m.group(0), text)


def _prompt(args, fe: Frontend, body: str | None) -> str:
    """The prompt: a cell's body, its {name}s filled, or the line's words (the magic has
    filled a line's {name}s word by word, once it was split)."""
    return fill_placeholders(body.strip(), fe.namespace) if body is not None else " ".join(args.prompt)


class ModelMissing(CommandError):
    """The manager has no model of the name asked for (the message says what to do)."""


def _not_found(fe: Frontend, model: str, message: str) -> CommandError:
    """The manager's "not found" (with its own suggestions of close names), and what to do."""
    if plainly_a_path(model):  # meant as a file (the manager's message says where it looked)
        return ModelMissing(f"{message}. Give the file's path as the manager's machine sees it, or register it "
                            f"with `create NAME --from {model}`")
    return ModelMissing(f"{message}. `pull {model}` downloads it from Ollama's registry (or `pull SOURCE --name "
                        f"{model}` from another source), `synth {model}` makes a synthetic one, `list` shows what "
                        "exists")


def _call(fe: Frontend, func: Callable, *a, model: str | None = None, **kw):
    """Call the client; a model it does not find is said with what to do about it (its other
    errors are the command's sentence: see :func:`execute`)."""
    from .client import ModelNotFoundError

    try:
        return func(*a, **kw)
    except ModelNotFoundError as e:
        raise _not_found(fe, model or "", e.message) from None


def _loaded(ps: dict, model: str) -> dict | None:
    """The entry of ``ps`` (an /api/ps answer) that ``model`` names: by the name it was loaded
    under, or one of the others of the same file it has answered to."""
    return next((m for m in ps.get("models", [])
                 if any(same_model(n, model) for n in (m.get("name"), m.get("model"), *(m.get("also_as") or [])))),
                None)


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
    waiting = threading.Timer(LOADING_NOTE_AFTER, lambda: first[0] and fe.note(
        f"(no answer from {args.model} yet: it may be loading, or reading a long prompt; `jupyter-llama explain "
        f"{args.model}` says what the manager is doing)")) if fe.waits_aloud else None
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


# ----------------------------------------------------------------------------- commands


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
    from .client import LlamaError

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


def cmd_stop(args, fe: Frontend):
    from .client import ModelNotFoundError

    client = fe.client()
    loaded = _loaded(client.ps(), args.model) is not None
    try:
        client.unload(args.model)  # (a model known but not loaded: nothing happens, as with Ollama's)
    except ModelNotFoundError as e:  # (no advice to pull a model in order to stop it)
        close = re.search(r"\(did you mean [^)]*\)", e.message)
        raise CommandError(f'no model is named "{args.model}"{f" {close.group(0)}" if close else ""}: nothing to '
                           "stop. `ps` shows the loaded models, `list` the ones there are") from None
    fe.note(f"{args.model} unloaded" if loaded
            else f"{args.model} was not loaded: nothing to stop (`ps` shows what is)")
    return EXIT_OK


def _mib(n) -> str:
    from .memory.report import format_bytes

    return format_bytes(n or 0)


def cmd_status(args, fe: Frontend):
    if args.stop:
        from . import background

        pid = background.stop()
        fe.out(f"stopped the background manager (pid {pid})" if pid else "no background manager runs")
        return EXIT_OK
    from .client import api_url

    client = fe.running_client()  # (a look: it starts no manager)
    info = client.server if client is not None else None
    version = _call(fe, client.version) if client is not None else {}
    others = [p for p in _other_managers() if info is None or (p.pid != info.pid and api_url(p.url) != info.url)]
    data = {"url": info and info.url, "source": info and info.source, "pid": info and info.pid,
            "version": version.get("version"), "jupyter_llama": version.get("jupyter_llama"),
            "engine": version.get("engine"), "engine_error": version.get("engine_error"),
            "loaded": [m.get("name") for m in _call(fe, client.ps).get("models", [])] if client is not None else [],
            "others": [{"pid": p.pid, "url": p.url, "models": p.models} for p in others]}
    if args.json:
        fe.json(data)
        return EXIT_OK
    if info is None:
        fe.out("manager: none runs (JUPYTER_LLAMA_URL is not set, no Jupyter server of yours serves the extension, "
               "no background manager runs)\nA command that needs one (run, load, ps, ...) starts the background "
               "manager; `jupyter-llama serve` runs one in the foreground.")
    else:
        engine = data["engine"] or f"unavailable ({data['engine_error'] or 'not found'})"
        fe.out(f"manager: {info.url}\nfound:   {info.source}\nversion: jupyter-llama {data['jupyter_llama']} (Ollama's "
               f"API {data['version']}), engine {engine}\nloaded:  {', '.join(data['loaded']) or 'nothing'}")
    for p in others:  # they share this machine's memory and this user's budgets with it
        fe.out(f"also:    another manager of yours, {p.describe()}")
    return EXIT_OK


def _other_managers():
    """This user's managers on this machine, from what each publishes (memory.peers)."""
    from jupyter_core.paths import jupyter_runtime_dir

    from .memory.peers import PeerBoard

    return PeerBoard(jupyter_runtime_dir(), pid=-1).others()


def cmd_ps(args, fe: Frontend):
    from .memory.report import render_table

    data = _call(fe, fe.client().ps)
    if args.json:
        fe.json(data)
        return EXIT_OK
    rows = []
    for m in data.get("models", []):
        size, vram = m.get("size") or 0, m.get("size_vram") or 0
        where = "CPU" if not vram else "GPU" if vram >= size else f"{vram / size:.0%} GPU"
        layers = f"{m['layers_offloaded']}/{m['layers_total']}" if m.get("layers_total") else ""
        devices = ", ".join(f"{d} {_mib(n)}" for d, n in (m.get("by_device") or {}).items())
        name = m.get("name") + (f" (also {', '.join(m['also_as'])})" if m.get("also_as") else "")
        rows.append([name, _mib(size), where, layers, devices, m.get("context_length") or "",
                     _until(m.get("expires_at"))])
    if not rows:
        fe.out("no models loaded")
    else:
        fe.out(render_table(["NAME", "SIZE", "PROCESSOR", "LAYERS", "DEVICES", "CONTEXT", "UNTIL"], rows))
    return EXIT_OK


def cmd_log(args, fe: Frontend):
    from .client import ModelNotFoundError

    def fetch():
        try:
            return fe.client().log(args.model, args.lines, args.match)
        except ModelNotFoundError as e:  # not loaded: the server's sentence says what to do
            raise CommandError(e.message) from None

    data = _call(fe, fetch)
    if args.json:
        fe.json(data)
        return EXIT_OK
    lines = data.get("lines") or []
    shown = f"{len(lines)} line(s)" + (f" containing {args.match!r}" if args.match else "")
    fe.out(f"{data.get('model')} (pid {data.get('pid')}, {data.get('state')}): {shown} "
           f"of {data.get('lines_seen', 0)} its llama-server printed")
    if lines:
        fe.out("\n".join(lines))
    return EXIT_OK


def _until(stamp: str | None, now: float | None = None) -> str:
    """When a loaded model is unloaded (an RFC 3339 time from /api/ps), as ``ollama ps`` says
    it: "4 minutes from now", "About a minute from now", "Forever" (pinned: more than 20 years
    ahead), "Stopping..." (its time is past)."""
    if not stamp:
        return "Never"
    from datetime import datetime

    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return stamp
    ahead = when - (time.time() if now is None else now)
    if ahead < 0:
        return "Stopping..."
    if ahead > 20 * 365 * 86400:
        return "Forever"
    return f"{human_duration(ahead)} from now"


def human_duration(seconds: float) -> str:
    """A duration as Ollama words one (its format.humanDuration): "Less than a second",
    "1 second", "42 seconds", "About a minute", "4 minutes", "About an hour", "5 hours",
    "3 days", "2 weeks", "4 months", "3 years"."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = s // 60
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = int(seconds / 3600 + 0.5)  # (Go's math.Round: halves away from zero)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{hours // 24 // 365} years"


def cmd_list(args, fe: Frontend):
    from .memory.report import render_table

    data = _call(fe, fe.client().tags)
    if args.json:
        fe.json(data)
        return EXIT_OK
    rows = [[m["name"], (m.get("digest") or "")[:12], _mib(m.get("size")), (m.get("details") or {}).get(
        "quantization_level", ""), (m.get("modified_at") or "")[:19].replace("T", " ")] for m in data.get("models", [])]
    fe.out(render_table(["NAME", "ID", "SIZE", "QUANT", "MODIFIED"], rows) if rows else
           "no models yet: `pull`, `create NAME --from FILE.gguf` or `synth NAME` add one")
    return EXIT_OK


def cmd_show(args, fe: Frontend):
    data = _call(fe, fe.client().show, args.model, model=args.model)
    if args.json:
        fe.json(data)
        return EXIT_OK
    d = data.get("details") or {}
    info = data.get("model_info") or {}
    lines = [f"{'model:':<26}{args.model}",
             f"{'architecture:':<26}{d.get('family', '')}",
             f"{'parameters:':<26}{d.get('parameter_size', '')}",
             f"{'quantization:':<26}{d.get('quantization_level', '')}",
             f"{'format:':<26}{d.get('format', 'gguf')}"]
    for key in sorted(info):
        if key.endswith((".context_length", ".embedding_length", ".block_count", ".attention.head_count",
                         ".attention.head_count_kv")):
            lines.append(f"{key.split('.', 1)[1] + ':':<26}{info[key]}")
    if data.get("digest"):
        lines.append(f"{'digest:':<26}{data['digest']}")
    for f in data.get("files") or []:
        state = "" if f.get("present", True) else "  MISSING"
        which = f.get("digest", "")[:19] or f.get("path", "")  # (a file named by its path has no digest)
        lines.append(f"{'file:':<26}{f.get('role', '')} {which} {_mib(f.get('size'))}{state}")
    if "verified" in data:
        lines.append(f"{'verified:':<26}{data['verified']}")
    lines += _preset_lines(data.get("preset") or {}, data.get("parameters") or "")
    fe.out("\n".join(lines))
    return EXIT_OK


def _preset_lines(preset: dict, parameters: str) -> list[str]:
    """A model's preset for ``show``: its parameters (as Ollama prints them), system message,
    template, messages and licenses; multi-line texts indented under their heading."""
    def block(title: str, text: str) -> list[str]:
        rows = str(text).splitlines() or [""]
        return [f"{title + ':':<26}{rows[0]}"] + [" " * 26 + r for r in rows[1:]]

    out: list[str] = []
    if parameters:
        out += ["preset parameters:"] + ["  " + ln for ln in parameters.splitlines()]
    if preset.get("system"):
        out += block("system", preset["system"])
    if preset.get("template"):
        out += block("template", preset["template"])
    for m in preset.get("messages") or []:
        out += block(f"message ({m.get('role', '')})", m.get("content", ""))
    for lic in preset.get("license") or []:
        out += block("license", lic)
    return out


def cmd_pull(args, fe: Frontend):
    last = _call(fe, fe.pull, args.source, args.name)
    if last.get("status") != "success":
        raise CommandError(f"pull of {args.source} did not finish: {last}")
    return EXIT_OK


def cmd_create(args, fe: Frontend):
    import os

    from .models.gguf_info import GGUFError, read_gguf_info

    modelfile = getattr(args, "modelfile", None)
    if not args.from_file and not modelfile:
        if not os.path.isfile("Modelfile"):
            raise CommandError("create: give --from FILE.gguf or -f MODELFILE (there is no ./Modelfile)", EXIT_USAGE)
        modelfile = "Modelfile"
    if modelfile:
        return _create_from_modelfile(args.name, modelfile, fe)
    path = os.path.abspath(os.path.expanduser(args.from_file))
    try:
        read_gguf_info(path)  # a clear error before uploading anything
    except GGUFError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    client = fe.client()
    digest = _call(fe, client.create_blob, path)
    files = {os.path.basename(path): digest}
    proj = getattr(args, "projector", None)
    if proj:
        files[os.path.basename(proj)] = _call(fe, client.create_blob, proj)
    _call(fe, client.create, args.name, files=files)
    described = getattr(args, "described", None)  # (a synthetic model's files are gone by now)
    fe.note(f"created {args.name} {described or f'from {path}'} ({digest[:19]})"
            + (f" with the projector {proj}" if proj and not described else ""))
    return EXIT_OK


def _create_from_modelfile(name: str, modelfile: str, fe: Frontend) -> int:
    """``create NAME -f Modelfile``: read it (the core's parser), upload its FROM files, create."""
    import os

    from .api.modelfile import ModelfileError, read_modelfile

    try:
        mf = read_modelfile(os.path.expanduser(modelfile))
    except ModelfileError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    for w in mf.warnings:
        fe.note(f"warning: {w}")
    client = fe.client()
    files = {os.path.basename(f): _call(fe, client.create_blob, f) for f in mf.from_files} or None
    body = mf.create_body(name, files)
    body.pop("model")
    _call(fe, client.create, name, from_=body.pop("from", None), **body, model=mf.from_model)
    fe.note(f"created {name} from {mf.from_model or ', '.join(mf.from_files)}")
    return EXIT_OK


def cmd_synth(args, fe: Frontend):
    import os
    import tempfile

    from .models.synth import SynthShape, write_projector, write_synthetic

    overrides = {k: getattr(args, k) for k in SYNTH_FIELDS if getattr(args, k, None) is not None}
    if not args.name and not args.output:
        raise CommandError("synth: give a NAME to register, or --output FILE to write", EXIT_USAGE)
    def write(path: str) -> tuple[str, str | None]:
        out = write_synthetic(path, shape)
        proj = (write_projector(out.with_name(out.stem + "-mmproj.gguf"), shape.embd, seed=shape.seed)
                if args.projector else None)
        return str(out), (str(proj) if proj else None)

    try:
        shape = SynthShape(**overrides)
        if args.output:
            _check_output(args.output)
            path, proj = write(args.output)
            fe.note(f"wrote {path} ({os.path.getsize(path):,} bytes)" + (f" and {proj}" if proj else ""))
            if not args.name:
                return EXIT_OK
            return cmd_create(argparse.Namespace(name=args.name, from_file=path, projector=proj), fe)
        with tempfile.TemporaryDirectory(prefix="jupyter-llama-synth-") as tmp:
            path, proj = write(os.path.join(tmp, "synth.gguf"))
            described = (f"as a synthetic {shape.type} {shape.arch} of {shape.layers} layers, {shape.embd} wide, "
                         f"{os.path.getsize(path) / 2**20:.1f} MiB")
            return cmd_create(argparse.Namespace(name=args.name, from_file=path, projector=proj, described=described
                                                 + (", with a projector" if proj else "")), fe)
    except ValueError as e:
        raise CommandError(f"synth: {e}", EXIT_USAGE) from None
    except OSError as e:
        raise CommandError(f"synth: cannot write {args.output or e.filename}: {e.strerror or e}") from None


def _check_output(path: str, example: str = "model.gguf") -> None:
    """A file the user names for us to write: not a folder, in a folder that exists."""
    import os

    if os.path.isdir(path):
        raise CommandError(f"{path} is a folder: give the file to write, such as {os.path.join(path, example)}",
                           EXIT_USAGE)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CommandError(f"cannot write {path}: the folder {folder} does not exist (make it first)", EXIT_USAGE)


def _scratch_path(filename: str) -> str:
    """``jupyter-llama-FILENAME`` in this user's private folder (the background manager's state
    folder, as the shell's conversations use): where a figure goes that the user named no file for."""
    from .background import state_dir

    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(folder / f"jupyter-llama-{filename}")


def cmd_cp(args, fe: Frontend):
    _call(fe, fe.client().copy, args.source, args.destination, model=args.source)
    fe.note(f"copied {args.source} to {args.destination}")
    return EXIT_OK


def cmd_rm(args, fe: Frontend):
    for m in args.models:
        _call(fe, fe.client().delete, m, model=m)
        fe.note(f"deleted {m}")
    return EXIT_OK


def cmd_prune(args, fe: Frontend):
    data = _call(fe, fe.client().prune)
    if args.json:
        fe.json(data)
        return EXIT_OK
    what = {"partial": "partial download", "blob": "unused blob", "tmp": "left-over temporary file"}
    for r in data["removed"]:
        kind = what.get(r.get("kind"), "file")
        fe.out(f"removed {kind} {r['file']} ({_mib(r['bytes'])}{', from ' + r['url'] if r.get('url') else ''})")
    fe.out(f"freed {_mib(data['freed'])}" if data["removed"] else
           "nothing to drop: no partial download, unused blob or left-over file")
    return EXIT_OK


def _is_file(name: str) -> bool:
    import os

    return name.endswith(".gguf") and os.path.isfile(os.path.expanduser(name))


def cmd_estimate(args, fe: Frontend):
    from .memory.estimate import format_estimates
    from .memory.report import MemoryReport

    opts = {k: getattr(args, k) for k in LOAD_OPTIONS if getattr(args, k, None) is not None}
    if _is_file(args.model) and args.url is None and not _manager_configured():
        # A file needs no manager: predict here, without starting one.
        from .engine.binary import EngineBroken, EngineNotFound, find_engine
        from .load_options import LoadOptions, LoadOptionsError
        from .memory.devices import inventory
        from .memory.sources import estimate_all
        from .models.gguf_info import GGUFError, read_gguf_info

        try:
            info = read_gguf_info(args.model)
        except GGUFError as e:
            raise CommandError(str(e), EXIT_USAGE) from None
        try:
            engine = find_engine()
        except (EngineNotFound, EngineBroken):
            engine = None
        try:
            options = LoadOptions(**opts)
        except LoadOptionsError as e:  # (as the manager words it)
            raise CommandError(f"bad option: {e}", EXIT_USAGE) from None
        reports = estimate_all(info, options, [g.id for g in inventory().gpus], engine=engine,
                               model_path=args.model)
        data = {"model": args.model, "options": opts, "estimates": {k: v.to_dict() for k, v in reports.items()},
                "actual": None}
    else:
        data = _call(fe, fe.client().estimate, args.model, opts or None, model=args.model)
    if args.json:
        fe.json(data)
        return EXIT_OK
    reports = {k: MemoryReport.from_dict(v) for k, v in data["estimates"].items()}
    actual = MemoryReport.from_dict(data["actual"]) if data.get("actual") else None
    fe.out(format_estimates(reports, actual))
    fit = data.get("fit")
    if fit:  # the scheduler's own verdict, the one a load would act on
        fe.out(f"\nfit ({fit['estimator']}): {fit['verdict_words']}\n  {fit['text']}")
    elif data.get("actual") is None and data.get("loaded"):
        fe.out(f"\n{data['loaded']['name']} is loaded with other options: no actual figures for these")
    return EXIT_OK


def _manager_configured() -> bool:
    """JUPYTER_LLAMA_URL is set, or a running manager of this user is found (none is started)."""
    import os

    from .client import ServerNotFound, find_server

    if os.environ.get("JUPYTER_LLAMA_URL"):
        return True
    try:
        find_server(start=False)
    except ServerNotFound:
        return False
    return True


def describe_event(e: dict) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
    return f"{t}  {e.get('kind', ''):<9} {e.get('message', '')}"


def cmd_explain(args, fe: Frontend):
    events = _call(fe, fe.client().events, None, limit=max(args.limit, 1000) if args.model else args.limit)
    if args.model:  # `tiny` and `tiny:latest` are one model
        events = [e for e in events if same_model(e.get("model"), args.model)]
    if args.json:
        fe.json(events)
        return EXIT_OK
    if not events:
        fe.out(f"no decisions recorded{' about ' + args.model if args.model else ''} yet")
        return EXIT_OK
    fe.out("\n".join(describe_event(e) for e in events[-args.limit:]))
    return EXIT_OK


def cmd_devices(args, fe: Frontend):
    from .config import ConfigError
    from .memory.devices import format_inventory, inventory

    if fe.has_manager(args):  # the manager's devices and budgets, and what its models use
        data = _call(fe, fe.client().devices)
        if args.json:
            fe.json(data)
            return EXIT_OK
        used = ", ".join(f"{d} {_mib(n)}" for d, n in (data.get("usage") or {}).items()) or "nothing"
        fe.out(f"{data.get('text', '')}\nin use by loaded models: {used}")
        from .config import env

        mine, server = env("MEMORY_LIMIT"), fe.client().server
        if mine and not ((data.get("budgets") or {}).get("limits")) and not server.warning:
            # (a background manager's other settings were pointed out as it was found)
            fe.note(f"note: here JUPYTER_LLAMA_MEMORY_LIMIT is {mine}, but the manager at {server.url} was started "
                    "without it: a manager keeps the settings it started with; restart it with the variable set")
        return EXIT_OK
    try:
        inv = inventory()
    except ConfigError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if args.json:
        fe.json(inv.to_dict())
    else:
        fe.out(format_inventory(inv))
    return EXIT_OK


def cmd_inspect(args, fe: Frontend):
    from .models.gguf_info import GGUFError, format_info, read_gguf_info

    try:
        info = read_gguf_info(args.file)
    except GGUFError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if args.json:
        fe.json(info.to_dict(tensors=True))
    else:
        fe.out(format_info(info, tensors=args.tensors))
    return EXIT_OK


def cmd_engine_build(args, fe: Frontend):
    from .engine.binary import BuildError, build_engine

    backend = "cuda" if args.cuda else "vulkan" if args.vulkan else "cpu"
    try:
        if backend != "cuda" and (args.cuda_arch or args.toolkit != "auto"):
            raise CommandError("--toolkit and --cuda-arch go with --cuda", EXIT_USAGE)
        build_engine(backend, force=args.force, jobs=args.jobs, progress=fe.note, toolkit=args.toolkit,
                     archs=args.cuda_arch)
    except BuildError as e:
        raise CommandError(str(e)) from None
    return EXIT_OK


def cmd_engine_status(args, fe: Frontend):
    from .engine.binary import EngineBroken, EngineNotFound, engine_status

    try:
        data = engine_status()
    except (EngineNotFound, EngineBroken) as e:
        raise CommandError(str(e)) from None
    if args.json:
        fe.json(data)
        return EXIT_OK
    fe.out("\n".join([
        f"binary:   {data['path']}",
        f"source:   {data['source']}" + (f" ({data['backend']} build)" if data.get("backend") else ""),
        f"version:  {data['version'].removeprefix('version: ')}",
        f"fit tool: {data['fit_params'] or 'not found'}",
        f"worker:   {data.get('worker') or 'not built (jupyter-llama engine build --force adds ggml-rpc-server)'}",
        f"pinned:   {data['pinned_source']}",
        "devices:  " + ("\n          ".join(data["devices"]) if data["devices"] else "none (CPU only)"),
        *([f"why:      {data['reason']}"] if data.get("reason") else []),
        *(["builds:   " + "\n          ".join(("* " if b["in_use"] else "  ") + b["description"] + f"  {b['dir']}"
                                             for b in data["builds"])] if data.get("builds") else []),
    ]))
    return EXIT_OK


def cmd_worker(args, fe: Frontend):
    from .engine.binary import EngineBroken, EngineNotFound, find_engine
    from .engine.worker import WorkerError, run_worker

    if not fe.foreground:
        raise CommandError("worker runs in the foreground until it is stopped, which would hold this kernel: start "
                           "it from a shell with `jupyter-llama worker` (the same options), then set "
                           "JUPYTER_LLAMA_RPC_WORKERS for the manager", EXIT_USAGE)

    try:
        engine = find_engine()
    except (EngineNotFound, EngineBroken) as e:
        raise CommandError(str(e)) from None
    try:
        return run_worker(engine, host=args.host, port=args.port, threads=args.threads, device=args.device,
                          cache=args.cache, note=fe.note)
    except WorkerError as e:
        raise CommandError(str(e), EXIT_USAGE if e.usage else 1) from None


def cmd_plot(args, fe: Frontend):
    from .load_options import LoadOptions
    from .memory.report import MemoryReport
    from .plots import plot_memory

    opts = {k: getattr(args, k) for k in LOAD_OPTIONS if getattr(args, k, None) is not None}
    if args.output:
        _check_output(args.output, example=f"{_file_safe(args.model)}.png")
    data = _call(fe, fe.client().estimate, args.model, opts or None, model=args.model)
    reports = {k: MemoryReport.from_dict(v) for k, v in data["estimates"].items()}
    if data.get("actual"):
        reports["actual"] = MemoryReport.from_dict(data["actual"])
    fig = plot_memory(reports, model=args.model, options=LoadOptions(**opts))
    fe.figure(fig, output=args.output, name=f"plot-{_file_safe(args.model)}")
    return fig


def _file_safe(name: str) -> str:
    """A model's name (or a file's path: its file name) as part of a file name: ``tiny:latest``
    -> ``tiny-latest``."""
    import os

    base = os.path.basename(name.rstrip("/")) if "/" in name else name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.") or "model"


def _serve_elsewhere(args, fe: Frontend):
    raise CommandError("serve runs a server in the foreground: start it from a shell with `jupyter-llama serve`",
                       EXIT_USAGE)


def cmd_help(args, fe: Frontend):
    parser = build_parser(getattr(args, "prog", "jupyter-llama"))
    if args.topic:
        choices = parser._llama_sub.choices
        if args.topic not in choices:
            close = close_matches(args.topic, choices)
            raise CommandError(f"help: no command {args.topic!r}; " + (f"did you mean {_did_you_mean(close)}?" if close
                               else f"commands: {', '.join(choices)}"), EXIT_USAGE)
        fe.out(choices[args.topic].format_help())
    else:
        fe.out(parser.format_help())
    return EXIT_OK
