"""``jupyter-llama``: the command line. Thin: the grammar and the commands live in
:mod:`jupyter_llama.commands`, shared with the ``%llama`` magic.

Exit codes: 0 success, 1 failure (the operation could not be done), 2 usage or bad input.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Sequence

from .commands import EXIT_USAGE, CommandError, Frontend, RunResult, _HelpShown, build_parser, execute

if TYPE_CHECKING:
    from .client import LlamaClient

EXIT_INTERRUPTED = 130  # (128 + SIGINT, as a shell reports a command that Ctrl-C stopped)


class TerminalFrontend(Frontend):
    """Prints to the terminal; talks to the manager ``find_server`` finds (starting the background one)."""

    waits_aloud = True

    @property
    def person_at_keyboard(self) -> bool:
        return sys.stdin.isatty() and sys.stdout.isatty()

    def piped_input(self) -> str | None:
        """Standard input when it is a pipe or a file (never a terminal, nor /dev/null)."""
        import stat

        try:
            mode = os.fstat(sys.stdin.fileno()).st_mode
        except (OSError, ValueError, AttributeError):
            return None
        return sys.stdin.read() if stat.S_ISFIFO(mode) or stat.S_ISREG(mode) else None

    def ask(self, prompt: str) -> str | None:
        try:
            return input(prompt)
        except EOFError:
            print(flush=True)
            return None

    def __init__(self, url: str | None = None, token: str | None = None):
        self.url, self.token = url, token
        self.namespace = None
        self._conversations: dict[str, list[dict]] | None = None
        self._client: LlamaClient | None = None

    # A shell's conversations outlive each command (`chat --conversation NAME`), in a file of
    # this user's beside the background manager's state (a notebook's live in its kernel).
    @staticmethod
    def _conversations_file():
        from .background import state_dir

        return state_dir() / "jupyter-llama-conversations.json"

    @property
    def conversations(self) -> dict[str, list[dict]]:
        if self._conversations is None:
            import json

            try:
                data = json.loads(self._conversations_file().read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
            self._conversations = data if isinstance(data, dict) else {}
        return self._conversations

    @conversations.setter
    def conversations(self, value: dict[str, list[dict]]) -> None:
        self._conversations = value

    def save_conversations(self, touched: str | None) -> None:
        """Write conversation ``touched`` back, when a command has changed it: into the file
        as it is now (another shell may have written another meanwhile), under a lock,
        atomically, readable by this user only."""
        if self._conversations is None or touched is None or touched not in self._conversations:
            return
        import json

        from filelock import FileLock

        path = self._conversations_file()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with FileLock(str(path) + ".lock", timeout=30):
            try:
                now = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                now = {}
            now = now if isinstance(now, dict) else {}
            now[touched] = self._conversations[touched]
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(now, fh)
            os.replace(tmp, path)

    def client(self, start: bool = True):
        """JUPYTER_LLAMA_URL's manager, a running Jupyter server of this user, else the
        background manager: started now if need be (it stays, so the next command finds it
        warm), unless ``start`` is False (then None when none runs)."""
        if self._client is None:
            from .client import LlamaClient, ServerNotFound

            try:
                self._client = LlamaClient(self.url, self.token, start=start)
            except ServerNotFound:
                if start:
                    raise
                return None
            if self._client.server.warning:
                self.note(f"note: {self._client.server.warning}")
        return self._client

    def running_client(self):
        return self.client(start=False)

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
        if isinstance(result, RunResult) and result.stopped:  # (its partial text shown, and "(stopped)")
            return EXIT_INTERRUPTED
        return result if isinstance(result, int) else 0
    except CommandError as e:
        if fe.mid_line:  # (an answer cut short: the error goes on a line of its own)
            print(flush=True)
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        if fe.mid_line:
            print(flush=True)
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # (`... | head`: the reader has all it wanted; what was left to print goes nowhere)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        try:
            fe.save_conversations(args.conversation if args.command == "chat" else None)
        except (OSError, TimeoutError) as e:
            print(f"warning: the conversation could not be kept for the next command: {e}", file=sys.stderr)
        if fe._client is not None:
            fe._client.close()


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
