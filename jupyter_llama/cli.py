"""``jupyter-llama``: the command line. Thin: parse words, call the core, print.

Exit codes: 0 success, 1 failure (the operation could not be done), 2 usage or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A failure to report in one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line and exit 2, like argparse, but raisable
        raise CommandError(f"{self.prog}: {message}", EXIT_USAGE)


def _print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


# ----------------------------------------------------------------------------- commands


def cmd_engine_build(args) -> int:
    from .engine.binary import BuildError, build_engine

    backend = "cuda" if args.cuda else "vulkan" if args.vulkan else "cpu"
    try:
        build_engine(backend, force=args.force, jobs=args.jobs, progress=lambda m: print(m, flush=True))
    except BuildError as e:
        raise CommandError(str(e)) from None
    return EXIT_OK


def cmd_engine_status(args) -> int:
    from .engine.binary import EngineBroken, EngineNotFound, engine_status

    try:
        data = engine_status()
    except (EngineNotFound, EngineBroken) as e:
        raise CommandError(str(e)) from None
    if args.json:
        _print_json(data)
        return EXIT_OK
    print(f"binary:   {data['path']}")
    print(f"source:   {data['source']}" + (f" ({data['backend']} build)" if data.get("backend") else ""))
    print(f"version:  {data['version'].removeprefix('version: ')}")
    print(f"fit tool: {data['fit_params'] or 'not found'}")
    print(f"pinned:   {data['pinned_source']}")
    print("devices:  " + ("\n          ".join(data["devices"]) if data["devices"] else "none (CPU only)"))
    return EXIT_OK


def cmd_inspect(args) -> int:
    from .models.gguf_info import GGUFError, format_info, read_gguf_info

    try:
        info = read_gguf_info(args.file)
    except GGUFError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if args.json:
        _print_json(info.to_dict(tensors=True))
    else:
        print(format_info(info, tensors=args.tensors))
    return EXIT_OK


def cmd_synth(args) -> int:
    from .models.synth import SynthShape, write_synthetic

    fields = ("layers", "embd", "heads", "kv_heads", "ff", "vocab", "ctx", "type", "seed")
    overrides = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    try:
        path = write_synthetic(args.output, SynthShape(**overrides))
    except ValueError as e:
        raise CommandError(f"synth: {e}", EXIT_USAGE) from None
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return EXIT_OK


def cmd_devices(args) -> int:
    from .config import ConfigError
    from .memory.devices import format_inventory, inventory

    try:
        inv = inventory()
    except ConfigError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if args.json:
        _print_json(inv.to_dict())
    else:
        print(format_inventory(inv))
    return EXIT_OK


# ----------------------------------------------------------------------------- grammar


def add_shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--embd", type=int, help="embedding width")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--kv-heads", dest="kv_heads", type=int, help="key/value heads (GQA when fewer than heads)")
    p.add_argument("--ff", type=int, help="feed-forward width")
    p.add_argument("--vocab", type=int, help="vocabulary size")
    p.add_argument("--ctx", type=int, help="training context length")
    p.add_argument("--type", choices=("f32", "f16", "q8_0", "q4_0"), help="weight type")
    p.add_argument("--seed", type=int, help="random seed (same seed, same bytes)")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def build_parser(prog: str = "jupyter-llama") -> argparse.ArgumentParser:
    """The one grammar shared by the CLI and the ``%llama`` magic."""
    parser = _Parser(prog=prog, description="Run and manage local llama.cpp models (Ollama's manager layer for Jupyter).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    eng = sub.add_parser("engine", help="build or inspect the llama-server engine")
    esub = eng.add_subparsers(dest="engine_command", metavar="ACTION", parser_class=_Parser)
    eng.set_defaults(func=lambda _args: _usage(eng))
    b = esub.add_parser("build", help="build llama-server for this machine from the pinned llama.cpp source")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--cuda", action="store_true", help="build the CUDA backend (needs nvcc)")
    g.add_argument("--vulkan", action="store_true", help="build the Vulkan backend (needs libvulkan-dev, glslc)")
    b.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    b.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    b.set_defaults(func=cmd_engine_build)
    s = esub.add_parser("status", help="which llama-server is used, its version and devices")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_engine_status)

    i = sub.add_parser("inspect", help="show a GGUF file's architecture, shape and tensors")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    i.add_argument("--tensors", action="store_true", help="also list every tensor and bytes per layer")
    i.set_defaults(func=cmd_inspect)

    sy = sub.add_parser("synth", help="write a synthetic llama-architecture GGUF of a chosen shape")
    sy.add_argument("--output", "-o", required=True, help="file to write")
    add_shape_options(sy)
    sy.set_defaults(func=cmd_synth)

    d = sub.add_parser("devices", help="GPUs, host memory and the budgets in force")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)
    return parser


def run(argv: Sequence[str], out: Callable[[str], None] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
        func = getattr(args, "func", None)
        if func is None:
            return _usage(parser)
        return func(args)
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
