"""``jupyter-llama``: the command line. Thin: the grammar and the commands live in
:mod:`jupyter_llama.commands`, shared with the ``%llama`` magic.

Exit codes: 0 success, 1 failure (the operation could not be done), 2 usage or bad input.
"""

from __future__ import annotations

import sys
from typing import Sequence

from .commands import EXIT_USAGE, CommandError, Frontend, _HelpShown, build_parser, execute


class TerminalFrontend(Frontend):
    """Prints to the terminal; talks to the manager ``find_server`` finds (starting the background one)."""

    def __init__(self, url: str | None = None, token: str | None = None):
        self.url, self.token = url, token
        self.namespace = None
        self.conversations = {}
        self._client = None

    def client(self):
        if self._client is None:
            from .client import LlamaClient

            # JUPYTER_LLAMA_URL, a running Jupyter server of this user, else the background
            # manager (started now if need be; it stays, so the next command finds it warm)
            self._client = LlamaClient(self.url, self.token)
        return self._client

    def out(self, text: str) -> None:
        print(text, flush=True)

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def run(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["serve"]:  # its own options, passed to the Jupyter server
        from .server.serve import main as serve_main

        return serve_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except _HelpShown as h:
        return h.status
    if getattr(args, "func", None) is None:
        build_parser().print_help(sys.stderr)
        return EXIT_USAGE
    fe = TerminalFrontend(args.url, args.token)
    try:
        result = execute(args, fe)
        return result if isinstance(result, int) else 0
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if fe._client is not None:
            fe._client.close()


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
