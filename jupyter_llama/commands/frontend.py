"""What a command and the place it runs in share: :class:`Frontend` (how to print, stream,
show progress, and which manager to talk to), what a command gives back (:class:`RunResult`),
and how it fails (:class:`CommandError` and the exit statuses)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A failure to report in one line; ``code`` is the CLI's exit status."""

    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


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
    waits_aloud = False  # says so when an answer waits for its model to load (a shell; a notebook shows its cell busy)
    conversations: dict[str, list[dict]]

    @property
    def person_at_keyboard(self) -> bool:
        """A person types at a terminal: ``run`` may ask for prompts and pull what is missing."""
        return False

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
        from ..models.pull import render_progress

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


def _manager_configured() -> bool:
    """JUPYTER_LLAMA_URL is set, or a running manager of this user is found (none is started)."""
    import os

    from ..client import ServerNotFound, find_server

    if os.environ.get("JUPYTER_LLAMA_URL"):
        return True
    try:
        find_server(start=False)
    except ServerNotFound:
        return False
    return True


def _scratch_path(filename: str) -> str:
    """``jupyter-llama-FILENAME`` in this user's private folder (the background manager's state
    folder, as the shell's conversations use): where a figure goes that the user named no file for."""
    from ..background import state_dir

    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(folder / f"jupyter-llama-{filename}")
