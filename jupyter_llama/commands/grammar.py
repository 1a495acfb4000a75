"""The grammar: the parser of ``%llama WORDS`` and ``jupyter-llama WORDS`` (usage errors
raise :class:`CommandError`, with the close words when a word was misspelt), and
:func:`execute`, which runs the parsed command and puts a client's error in one sentence."""

from __future__ import annotations

import argparse
import difflib
import functools
import shlex
import sys
from typing import Sequence

from .engine import cmd_engine_build, cmd_engine_status, cmd_worker
from .frontend import EXIT_FAIL, EXIT_OK, EXIT_USAGE, CommandError, Frontend
from .manager import _serve_elsewhere, cmd_explain, cmd_log, cmd_ps, cmd_status, cmd_stop
from .memory import cmd_devices, cmd_estimate, cmd_plot
from .models import cmd_cp, cmd_create, cmd_inspect, cmd_list, cmd_prune, cmd_pull, cmd_rm, cmd_show, cmd_synth
from .options import _model_options, _shape_options
from .run import cmd_chat, cmd_load, cmd_run


def close_matches(word: str, choices) -> list[str]:
    """The few of ``choices`` that ``word`` looks like a misspelling of (none when none is close)."""
    return difflib.get_close_matches(word, [str(c) for c in choices], n=3, cutoff=0.6)


def _did_you_mean(matches: list[str]) -> str:
    return matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"


class _Parser(argparse.ArgumentParser):
    _llama_sub: argparse._SubParsersAction[_Parser]  # the top parser's commands (for `help COMMAND`)

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
        known: list[str] = []
        parser: argparse.ArgumentParser | None = self
        while parser is not None:
            known += [o for o in parser._option_string_actions if o.startswith("--") and o != "--help"]
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            chosen = getattr(ns, sub.dest, None) if sub is not None else None
            parser = sub.choices.get(chosen) if sub is not None and chosen else None
        return known

    def exit(self, status=0, message=None):  # `--help` inside a magic must not exit the kernel
        if message:
            sys.stderr.write(message)
        raise _HelpShown(status)


class _HelpShown(Exception):
    def __init__(self, status: int):
        self.status = status


def _at_least_one(text: str) -> int:
    """An argument that counts something: a whole number of 1 or more."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return n


@functools.lru_cache(maxsize=4)
def build_parser(prog: str = "jupyter-llama") -> _Parser:
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
    from ..config import ConfigError

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
        from ..background import state_dir

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
