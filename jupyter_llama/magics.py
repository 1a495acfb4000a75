"""``%llama`` and ``%%llama``: the manager one cell away. Thin: the grammar and the commands
are :mod:`jupyter_llama.commands`, the same words the ``jupyter-llama`` CLI speaks.

Inside JupyterLab or Notebook the magic talks to the server extension (found through
``JUPYTER_LLAMA_URL``, which the extension exports to its kernels); anywhere else (plain
IPython, VS Code, a script) it uses a running Jupyter server of the user that serves the
extension, else the user's background manager, started on first use and shared.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, needs_local_scope, no_var_expand
from traitlets import Float, Unicode, observe

from . import background
from .client import URL_ENV
from .commands import EXIT_USAGE, CommandError, Frontend, RunResult, StreamStopped, _HelpShown, build_parser, execute
from .config import env, parse_duration


def _hard_breaks(text: str) -> str:
    """Markdown that keeps every line break of ``text`` (two trailing spaces), except inside
    fenced code blocks."""
    lines = text.split("\n")
    out, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(line)
        else:
            last = i == len(lines) - 1
            out.append(line if fenced or last or not line.strip() else line + "  ")
    return "\n".join(out)

class NotebookFrontend(Frontend):
    """Shows results in the running cell: streamed Markdown, tables as text, widgets, figures."""

    foreground = False  # (a command that runs until stopped would hold the kernel)

    def __init__(self, magics: "LlamaMagics", namespace: dict | None = None):
        self.magics = magics
        self.conversations = magics.conversations
        self.namespace = namespace

    def client(self):
        return self.magics.client()

    def running_client(self):
        return self.magics.client(start=False)

    def has_manager(self, args=None) -> bool:
        return True  # the magic always has one (the kernel's server, or the background manager)

    def out(self, text: str) -> None:
        print(text)

    def _prints(self) -> bool:
        """Terminal IPython: a display is printed, and each update of it printed again below
        (not replaced in place, as a notebook's frontend does): there, text streams as in a
        terminal, a figure is a PNG file, and a widget cannot be shown."""
        from IPython.core.displaypub import DisplayPublisher

        shell = self.magics.shell
        return shell is None or type(shell.display_pub) is DisplayPublisher

    def stream(self, chunks: Iterator[str], *, raw: bool) -> str:
        from IPython.display import display

        if self._prints():
            return super().stream(chunks, raw=raw)

        def render(text: str) -> dict:
            # A mimebundle, not IPython's Markdown(): that would read a chunk such as "/" or
            # "notes.md" as a file name to load.
            # Markdown joins single line breaks into one paragraph; a model's line breaks are
            # meant, so each becomes a hard break (outside code fences, where they already hold).
            return {"text/plain": text} if raw else {"text/markdown": _hard_breaks(text), "text/plain": text}

        parts: list[str] = []
        handle = None
        last = 0.0
        interval = self.magics.update_interval
        stopped = False
        try:
            for piece in chunks:
                parts.append(piece)
                now = time.monotonic()
                if handle is None:
                    handle = display(render("".join(parts)), display_id=True, raw=True)
                    last = now
                elif now - last >= interval:
                    handle.update(render("".join(parts)), raw=True)
                    last = now
        except KeyboardInterrupt:  # the stop button: what came stays on the screen, whole
            stopped = True
        text = "".join(parts)
        if handle is None:
            if text or not stopped:
                display(render(text), raw=True)
        else:
            handle.update(render(text), raw=True)
        if stopped:
            raise StreamStopped(text)
        return text

    def pull(self, source: str, name: str | None) -> dict:
        if self._prints():
            return super().pull(source, name)
        from .widgets import pull_progress

        return pull_progress(self.client(), source, name, raise_errors=True)

    def figure(self, fig, output: str | None = None, name: str = "plot") -> None:
        from IPython.display import display

        if self._prints():
            super().figure(fig, output, name)
            return
        display(fig)
        if output:
            self.write_figure(fig, output)

    def widget(self, name: str, **kw):
        from IPython.display import display

        if self._prints():
            raise CommandError(f"`%llama {name}` shows a widget, which needs a notebook (JupyterLab, Jupyter "
                               "Notebook, VS Code): terminal IPython can only print its text", EXIT_USAGE)

        from . import widgets

        if name == "picker":
            w = widgets.ModelPicker(self.client())
        elif name == "panel":
            w = widgets.RunningPanel(self.client())  # starts its live loop on the kernel's event loop
        else:  # pragma: no cover - the grammar only routes these two here
            raise CommandError(f"no widget {name!r}")
        display(w)
        return w


@magics_class
class LlamaMagics(Magics):
    """``%llama COMMAND ...`` (``%llama help`` lists the commands) and ``%%llama run|chat MODEL``."""

    default_model = Unicode("", help="model used by `%%llama run` / `%%llama chat` when none is named").tag(config=True)
    url = Unicode("", help="the manager's API URL (default: JUPYTER_LLAMA_URL, else a running Jupyter server of "
                           "yours with the extension, else your background manager)").tag(
        config=True)
    token = Unicode("", help="its token (default: JUPYTER_LLAMA_TOKEN or the server's runtime file)").tag(config=True)
    update_interval = Float(0.05, help="seconds between display updates while an answer streams").tag(config=True)

    def __init__(self, shell=None, **kw):
        super().__init__(shell=shell, **kw)
        self.conversations: dict[str, list[dict]] = {}
        self._client = None
        self.last: RunResult | None = None
        self.shown: list = []  # figures and widgets the magic displayed (the latest last)
        self._streamed: list[RunResult] = []  # results streamed into the running cell (not echoed there)
        if shell is not None:
            shell.events.register("post_run_cell", self._cell_done)

    def _cell_done(self, result=None) -> None:
        """After the cell (and its echo of a value): a result kept in a variable shows again."""
        for r in self._streamed:
            r._shown_in_cell = False
        self._streamed.clear()

    @observe("url", "token")
    def _forget_client(self, change) -> None:  # `%config LlamaMagics.url = ...` takes effect at once
        if self._client is not None:
            self._client.close()
        self._client = None

    def client(self, start: bool = True):
        """The client of this kernel's server, a running one of this user, else the background
        manager (started now unless ``start`` is False: then None when none runs)."""
        if self._client is None:
            from .client import LlamaClient, ServerNotFound

            try:
                self._client = LlamaClient(self.url or None, self.token or None, start=start)
            except ServerNotFound:
                if start:
                    raise
                return None
            if self._client.server.warning:
                print(f"note: {self._client.server.warning}")
        return self._client

    def _namespace(self, local_ns: dict | None) -> dict | None:
        """What ``{name}`` and ``$name`` may name: the notebook's variables, and those of the
        function the magic is called from (``local_ns``, which win), as IPython's expansion sees them."""
        if self.shell is None:
            return local_ns
        if local_ns is None or local_ns is self.shell.user_ns:
            return self.shell.user_ns
        return {**self.shell.user_ns, **local_ns}

    @staticmethod
    def _expand(word: str, namespace: dict | None) -> str:
        """A word of the line with IPython's expansion of a magic's line ({expression}, $name,
        from ``namespace``; a word it cannot expand stays as it is). IPython expands a line
        before the magic splits it, so that a value's quotes ended or broke the line's
        quoting: here each word is expanded once the line is split."""
        from IPython.utils.text import DollarFormatter

        if namespace is None or ("{" not in word and "$" not in word):
            return word
        try:
            return DollarFormatter().vformat(word, args=[], kwargs=namespace)
        except Exception:  # noqa: BLE001 - as IPython's var_expand: what does not expand stays
            return word

    @no_var_expand  # (IPython's expansion, done word by word once the line is split: see _expand)
    @needs_local_scope
    @line_cell_magic
    def llama(self, line: str = "", cell: str | None = None, local_ns: dict | None = None):
        """Run a jupyter-llama command; `%llama help` lists them, `%llama help run` explains one."""
        words = line.strip()
        if not words:
            words = "help"
        if cell is not None and words in ("run", "chat"):
            if not self.default_model:
                raise UsageError(f"%%llama {words} needs a model: `%%llama {words} MODEL`, the cell being the "
                                 "prompt (or set a default: `%config LlamaMagics.default_model = 'MODEL'`)")
            words = f"{words} {self.default_model}"
        try:
            namespace = self._namespace(local_ns)
            args = build_parser("%llama").parse_args([self._expand(w, namespace) for w in _split(words)])
        except CommandError as e:
            raise UsageError(str(e)) from None
        except _HelpShown:
            return None
        if cell is not None and cell.strip() and args.command not in ("run", "chat"):
            raise UsageError(f"%%llama {args.command or 'help'} takes no cell: only `%%llama run MODEL` and "
                             "`%%llama chat MODEL` do (the cell is the prompt); use `%llama` on one line")
        fe = NotebookFrontend(self, namespace)
        if args.url or args.token:  # `%llama --url U --token T ps`: this call only
            from .client import LlamaClient

            made: list = []  # (made by the command, so that a failure to find it is its sentence)

            def one_off():
                if not made:
                    made.append(LlamaClient(args.url or self.url or None, args.token or self.token or None))
                return made[0]

            # (a URL given: nothing is started, so `status` looks there too)
            fe.client = fe.running_client = one_off  # type: ignore[method-assign]
        try:
            result = execute(args, fe, body=cell if args.command in ("run", "chat") else None)
        except CommandError as e:
            raise UsageError(str(e)) from None
        except KeyboardInterrupt:  # (a stopped answer says so itself, and returns what came: see _generate)
            print("(stopped)")
            return None
        if isinstance(result, RunResult):
            self.last = result
            if not fe._prints():
                # `r = %llama run ...` keeps it; an unassigned one is not echoed as Out[n] below
                # the text it streamed (RunResult._ipython_display_; terminal IPython would still
                # print an empty "Out[n]:" there, so it keeps the repr)
                result._shown_in_cell = True
                self._streamed.append(result)
            return result
        if result is not None and not isinstance(result, int):
            self.shown.append(result)  # a figure or widget, already displayed: keep it, don't show it twice
            del self.shown[:-10]
        return None


def _split(words: str) -> list[str]:
    import shlex

    try:
        return shlex.split(words)
    except ValueError as e:
        raise UsageError(f"%llama: cannot split the line: {e}") from None


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(LlamaMagics)
    if not os.environ.get(URL_ENV):  # (under a Jupyter server with the extension, the server exported them)
        export_client_environment(ipython)


def export_client_environment(ipython) -> dict[str, str]:
    """In a kernel that no Jupyter server with the extension started (plain IPython, VS
    Code): point Ollama's, OpenAI's and Anthropic's clients at the manager ``%llama`` uses,
    as JupyterLab does for its kernels, setting only the variables the user has not set.
    With the background manager, the kernel also keeps it from exiting while it lives (a
    client made now holds its address). Returns what was set; says so in one line."""
    from .client import ServerNotFound, client_environment

    magics = ipython.find_magic("llama").__self__
    try:
        server = magics.client().server
    except ServerNotFound as e:
        print(f"note: no manager for Ollama/OpenAI clients in this kernel: {e}")
        return {}
    exported = {k: v for k, v in client_environment(server.url, server.token).items()
                if k != URL_ENV and not os.environ.get(k)}
    os.environ.update(exported)
    if exported:
        print(f"jupyter-llama: {server.source}; set {', '.join(sorted(exported))} for this kernel's clients")
    if server.source.startswith(background.SOURCE):
        threading.Thread(target=_keep_awake, args=(server.url, server.token), daemon=True,
                         name="jupyter-llama keep-awake").start()
    return exported


def _keep_awake(url: str, token: str | None) -> None:
    """Ask the background manager for its version now and then, so it does not exit for lack
    of requests while this kernel, whose clients know its address, lives."""
    import httpx

    idle = parse_duration(env("MANAGER_IDLE") or background.IDLE_DEFAULT, "JUPYTER_LLAMA_MANAGER_IDLE")
    while True:
        time.sleep(max(1.0, idle / 3))
        try:
            httpx.get(url + "api/version", headers={"Authorization": f"token {token}"} if token else {},
                      timeout=10, trust_env=False)
        except httpx.HTTPError:
            pass


def unload_ipython_extension(ipython) -> None:  # pragma: no cover - IPython rarely unloads
    pass
