"""``jupyter-llama serve``: a Jupyter server with only this extension, for clients outside
JupyterLab (the CLI, VS Code, Ollama and OpenAI clients).

    jupyter-llama serve [--ip 127.0.0.1] [--port N] [--token T] [--no-browser] [--allow-root]

It is a jupyter_server ``ServerApp`` (same auth, same config files, same runtime file that
``jupyter_llama.client`` reads) with ``jupyter_llama`` enabled, other extensions left out, and none of
jupyter_server's own services but the login (:func:`manager_server_app`): its token opens
this API and nothing else. Ollama clients point at ``http://<ip>:<port>/llama`` with the header
``Authorization: token <token>``; OpenAI clients at ``http://<ip>:<port>/llama/v1`` with
the token as API key. Ctrl-C and SIGTERM stop every model runner before the server exits.

Run by a JupyterHub (a managed service), or beside one with the Hub's service variables set
(an external service), it is one manager for every user of the Hub (:mod:`jupyter_llama.hub`,
docs/hub.md): where it listens and its URL prefix come from the Hub's ``JUPYTERHUB_SERVICE_URL``
and ``JUPYTERHUB_SERVICE_PREFIX``, every request is authenticated with the Hub (users send
their own Hub tokens; the server has no token of its own), and ``--config FILE`` holds the
admin's ``c.LlamaHub`` settings (quotas, admins). ``--hub``/``--no-hub`` override the guess.
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import signal
import socket
import sys
from datetime import datetime, timezone
from typing import Sequence

from .._version import __version__
from ..config import ConfigError
from ..errors import JupyterLlamaError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jupyter-llama serve",
                                description="Serve the jupyter-llama API (Ollama- and OpenAI-compatible) "
                                            "from a Jupyter server with only this extension.")
    p.add_argument("--ip", default=None,
                   help="address to listen on "
                        "(default 127.0.0.1; as a Hub service, the host of JUPYTERHUB_SERVICE_URL)")
    p.add_argument("--port", type=_port, default=None,
                   help="port (default: jupyter_server's, 8888, or the next free; 0: any free one)")
    p.add_argument("--token", default=None,
                   help="the token clients must send (default: a random one, printed at start; '' disables auth "
                        "only if the server also allows it)")
    p.add_argument("--base-url", default=None, help="URL prefix (default /)")
    p.add_argument("--no-browser", action="store_true",
                   help="do not open a browser (the default: there is no page to show, only an API)")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARN, ERROR or CRITICAL")
    p.add_argument("--allow-root", action="store_true",
                   help="allow running as root (jupyter_server refuses by default)")
    p.add_argument("--exit-when-idle", type=_seconds, default=None, metavar="SECONDS",
                   help="exit once no model is loaded and no request has come for this long (the background "
                        "manager's way of going away by itself)")
    hub = p.add_mutually_exclusive_group()
    hub.add_argument("--hub", dest="hub", action="store_true", default=None,
                     help="run as a JupyterHub service (the default when the Hub's service variables are set: "
                          "JUPYTERHUB_API_TOKEN, JUPYTERHUB_API_URL, JUPYTERHUB_SERVICE_PREFIX; docs/hub.md)")
    hub.add_argument("--no-hub", dest="hub", action="store_false",
                     help="do not run as a JupyterHub service, whatever the environment says")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a Jupyter config file (Python or JSON) for this server: c.LlamaExtension and, as a Hub "
                        "service, c.LlamaHub (quotas, admins)")
    return p


def hub_mode(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs as a JupyterHub service: ``--hub``/``--no-hub``, else the environment's say."""
    from ..hub import service_environment

    return service_environment() if args.hub is None else bool(args.hub)


def hub_argv() -> list[str]:
    """The ServerApp command line of a JupyterHub service: where to listen and the URL prefix
    from the Hub's variables (as the Hub's own single-user servers read them), the Hub's
    authentication, and the proxy's headers trusted (requests come through it)."""
    from urllib.parse import urlsplit

    argv = ["--ServerApp.identity_provider_class=jupyter_llama.hub.identity.HubIdentityProvider",
            f"--ServerApp.base_url={os.environ.get('JUPYTERHUB_SERVICE_PREFIX') or '/'}",
            "--ServerApp.allow_remote_access=True", "--ServerApp.trust_xheaders=True", "--ServerApp.port_retries=0"]
    url = urlsplit(os.environ.get("JUPYTERHUB_SERVICE_URL") or "")
    if url.hostname:
        argv.append(f"--ServerApp.ip={url.hostname}")
    if url.port:
        argv.append(f"--ServerApp.port={url.port}")
    return argv


def _port(text: str) -> int:
    """A ``--port``: 0 (any free port) to 65535 (Tornado took 70000 as 4464, and said 70000)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535; 0 takes any free one)")
    return port


def _seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return v


def server_argv(args: argparse.Namespace) -> list[str]:
    """The ServerApp command line for parsed ``serve`` arguments (config files still apply below it)."""
    hub = hub_mode(args)
    argv = ["--ServerApp.open_browser=False", "--ServerApp.answer_yes=True"]
    argv += hub_argv() if hub else [
        f"--ServerApp.ip={args.ip or '127.0.0.1'}",
        "--ServerApp.identity_provider_class=jupyter_llama.server.identity.ApiTokenIdentityProvider"]
    argv += [
            # the extension is all this server serves: one that cannot start (a setting it cannot
            # read) stops it, with its sentence, rather than leaving a server that answers 404
            "--ServerApp.reraise_server_extension_failures=True"]
    if hub and args.ip:  # (given: it wins over the Hub's)
        argv.append(f"--ServerApp.ip={args.ip}")
    if args.config:
        argv.append(f"--config={args.config}")
    if args.port is not None:
        argv.append(f"--ServerApp.port={args.port}")
    if args.token is not None and not hub:
        argv.append(f"--IdentityProvider.token={args.token}")
    if args.base_url:
        argv.append(f"--ServerApp.base_url={args.base_url}")
    if args.log_level:
        argv.append(f"--ServerApp.log_level={args.log_level}")
    if args.allow_root:
        argv.append("--ServerApp.allow_root=True")
    return argv


def manager_server_app():
    """The ServerApp class ``serve`` runs: jupyter_server's, serving only this extension's
    API and the login a browser needs. The token ``serve`` hands to Ollama, OpenAI and
    Anthropic clients is the server's: on a whole ServerApp it would also read and write
    files (``/api/contents``, ``/files``) and start kernels, that is, run code as this user.
    Here it opens nothing else: no contents, files, kernels, sessions, terminals,
    nbconvert, config or shutdown routes (jupyter_server's ``default_services``, which it
    documents for a subclass to narrow, and the contents manager's ``files_handler_class``)."""
    from jupyter_server.serverapp import ServerApp
    from traitlets import default

    from .connections import ConnectionCap, max_connections

    class LlamaServeApp(ServerApp):
        default_services = ("auth",)
        is_llama_manager = True  # (a manager, never a relay to another: LlamaExtension.shared_url)

        @default("no_browser_open_file")
        def _no_open_file(self) -> bool:  # (no page to open: no jpserver-*-open.html, which holds the token)
            return True

        def init_configurables(self) -> None:
            super().init_configurables()
            self.contents_manager.files_handler_class = None  # no /files/ route

        def init_httpserver(self) -> None:
            super().init_httpserver()
            # A connection has this long to send each request's head, and a kept-alive one that
            # sends nothing closes after as long (Tornado's default for both, an hour, let
            # thousands of silent connections hold a manager's descriptors). Bodies, an upload's
            # included, and streamed answers are not timed.
            self.http_server.conn_params.header_timeout = header_timeout()
            # At most so many client connections, below the descriptor limit (see connections.py).
            self.http_server.request_callback = ConnectionCap(self.web_app, max_connections(), self.log)

    return LlamaServeApp


HEADER_TIMEOUT_DEFAULT = "10s"


def header_timeout() -> float:
    """``JUPYTER_LLAMA_HEADER_TIMEOUT`` in seconds (default 10s): how long ``serve`` waits for a
    request's head, and keeps an idle connection. ConfigError for a value that is no
    duration, or not above 0."""
    from ..config import env, parse_duration

    seconds = parse_duration(env("HEADER_TIMEOUT") or HEADER_TIMEOUT_DEFAULT, "JUPYTER_LLAMA_HEADER_TIMEOUT")
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"JUPYTER_LLAMA_HEADER_TIMEOUT must be a duration above 0 (such as 10s), got "
                          f"{env('HEADER_TIMEOUT')!r}")
    return seconds


def make_server(argv: Sequence[str] | None = None, *, args: argparse.Namespace | None = None):
    """An initialised (not yet started) ServerApp running only this extension (``args``: the
    ``serve`` arguments already parsed, else ``argv``'s)."""
    args = args or build_parser().parse_args(list(argv) if argv is not None else None)
    app = manager_server_app().instance(jpserver_extensions={"jupyter_llama": True})
    app.initialize(argv=server_argv(args), find_extensions=False, starter_extension="jupyter_llama")
    ext = _extension(app)
    skip_unshown_records(app.log, logging.getLogger("tornado"), *([ext.log] if ext is not None else []))
    log_only_what_shows(app)
    return app


def log_only_what_shows(app) -> None:
    """jupyter_server's access log (``log_request``) formats every request's line, then hands
    it to a logger at debug level for an answer under 300 (and 304): in ``serve``, at its
    usual level, a line never shown, whose formatting is a good part of a short request's
    CPU. Here such an answer only records its Prometheus metric (when the server records
    them), as that function would; every other answer, and every one at ``--log-level
    DEBUG``, goes through it as before."""
    from functools import partial

    from jupyter_server.log import log_request
    from jupyter_server.prometheus.log_functions import prometheus_log_method

    settings = app.web_app.settings
    full = settings.get("log_function")
    if not (isinstance(full, partial) and full.func is log_request):
        return  # not jupyter_server's (someone's own): theirs to run
    record = full.keywords.get("record_prometheus_metrics", True)

    def log_function(handler) -> None:
        status = handler.get_status()
        if status < 300 or status == 304:
            try:
                logger = handler.log
            except AttributeError:
                logger = logging.getLogger("tornado.access")
            if not logger.isEnabledFor(logging.DEBUG):
                if record:
                    prometheus_log_method(handler)
                return
        full(handler)

    settings["log_function"] = log_function


def skip_unshown_records(*loggers: logging.Logger) -> None:
    """Raise each logger's level to the lowest its handlers show, so that a record none of
    them would show is never made.

    traitlets leaves an application's logger at DEBUG and puts its ``log_level`` on the
    handler; jupyter_server then makes a debug record on every API request (the token check
    accepted, the access log line) that the handler drops: two records a request, one of them
    before a stream's first token. This server's loggers and their handlers are its own, so
    their levels can agree. ``--log-level DEBUG`` still shows everything."""
    for logger in loggers:
        levels: list[int] = []
        node: logging.Logger | None = logger
        while node is not None:  # the handlers its records reach
            levels += [h.level for h in node.handlers]
            node = node.parent if node.propagate else None
        if levels and min(levels) > logger.level:
            logger.setLevel(min(levels))


def use_fast_loop() -> str:
    """Run this server on uvloop's event loop when it is installed, unless
    ``JUPYTER_LLAMA_EVENT_LOOP=asyncio``; returns the loop's name (logged at start).

    Every token a client receives costs one read and one write in the event loop; uvloop's
    loop is written in C and takes about a quarter less CPU per token and per request than
    asyncio's (bench/api_overhead.py). Only ``serve`` does this (and so the embedded
    manager of plain kernels): inside JupyterLab the loop is jupyter_server's to choose.
    """
    import asyncio

    from ..config import env_choice

    if env_choice("EVENT_LOOP", EVENT_LOOPS) == "asyncio":
        return "asyncio"
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop(uvloop.new_event_loop())  # tornado's IOLoop.current() wraps it
    return "uvloop"


EVENT_LOOPS = ("uvloop", "asyncio")  # JUPYTER_LLAMA_EVENT_LOOP


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until it is stopped; returns the exit status."""
    from ..config import env_choice
    from .connections import max_connections

    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:  # (serve's own settings: one it cannot read is said, not ignored)
        env_choice("EVENT_LOOP", EVENT_LOOPS)
        header_timeout()
        max_connections()
    except ConfigError as e:
        print(f"jupyter-llama serve: {e}", file=sys.stderr)
        return 2
    hub = hub_mode(args)
    if hub:
        from ..hub import SERVICE_VARIABLES, hub_missing, service_environment

        problem = hub_missing()
        if problem is None and not service_environment({**os.environ, "JUPYTERHUB_USER": ""}):
            problem = ("--hub needs the Hub's service variables: " + ", ".join(SERVICE_VARIABLES) +
                       " (the Hub sets them for a service it runs; docs/hub.md says what an external one needs)")
        if problem is None and args.token is not None:
            problem = "--token has no use as a Hub service: every user sends their own Hub token"
        if problem is not None:
            print(f"jupyter-llama serve: {problem}", file=sys.stderr)
            return 2
    loop_name = use_fast_loop()
    try:
        app = make_server(args=args)
    except (ConfigError, JupyterLlamaError) as e:  # (a setting the extension cannot read, mostly)
        print(f"jupyter-llama serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # (the server binds its socket as it is made: an address this machine does not have)
        if not isinstance(e, socket.gaierror) and e.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.EACCES):
            raise
        advices: dict[int | None, str] = {
            errno.EADDRINUSE: "give another --port (0 takes any free one)",
            errno.EACCES: "a port below 1024 needs privileges: give another --port"}
        advice = advices.get(
            e.errno, "give --ip an address of this machine (127.0.0.1, the default, for this machine alone; "
                     "0.0.0.0 for every interface)")
        print(f"jupyter-llama serve: cannot listen on {args.ip or 'the address asked for'}"
              f"{f' port {args.port}' if args.port else ''}: "
              f"{getattr(e, 'strerror', None) or e}; {advice}", file=sys.stderr)
        return 1
    if hasattr(os, "geteuid") and os.geteuid() == 0 and not app.allow_root:
        # (jupyter_server would say so only once started, after our lines saying where it serves)
        print("jupyter-llama serve: this is the root user, and Jupyter servers refuse to run as root unless "
              "told to: add --allow-root (or run as another user)", file=sys.stderr)
        return 1
    # Stop cleanly on Ctrl-C whether or not a terminal is attached (jupyter_server asks for
    # confirmation only on a tty; without one Python's default would skip the extension's
    # clean-up and rely on the children's parent-death signal alone).
    signal.signal(signal.SIGINT, lambda sig, frame: _stop_on_signal(app, sig))
    url = app.connection_url.rstrip("/") + "/llama"
    token = app.identity_provider.token
    app.log.info("jupyter-llama %s serving %s (event loop: %s)", __version__, url, loop_name)
    if hub:
        app.log.info("  as the JupyterHub service %s: users send their own Hub API tokens (kernels of servers the "
                     "Hub starts have one in JUPYTER_LLAMA_TOKEN with jupyter_llama.hub.spawner's settings)",
                     os.environ.get("JUPYTERHUB_SERVICE_NAME") or os.environ.get("JUPYTERHUB_SERVICE_PREFIX"))
        return _run(app, args)
    # A token made for this run is shown, so that a person can use it; one given to us
    # (--token, JUPYTER_TOKEN) is the user's secret and stays out of the log.
    shown = token if getattr(app.identity_provider, "token_generated", False) else "<your token>"
    key = shown if token else ""
    # (each line's variables as the clients read them from the environment, ready to copy)
    app.log.info("  Ollama clients: OLLAMA_HOST=%s OLLAMA_API_KEY=%s (or the header 'Authorization: token %s')",
                 url, key, key)
    app.log.info("  OpenAI clients: OPENAI_BASE_URL=%s/v1 OPENAI_API_KEY=%s", url, key)
    app.log.info("  Anthropic clients: ANTHROPIC_BASE_URL=%s ANTHROPIC_API_KEY=%s", url, key)
    return _run(app, args)


def _run(app, args: argparse.Namespace) -> int:
    """Start the server and serve until it stops; every child stopped however it ends."""
    if args.exit_when_idle is not None:
        _exit_when_idle(app, args.exit_when_idle)
    # What is built by now (jupyter_server, Tornado, the extension: ~200,000 objects) lives as
    # long as the process. Frozen out of the garbage collector, it is not walked again by every
    # full collection, each of which would stall the streams then running (bench/PERFORMANCE.md).
    gc.collect()
    gc.freeze()
    try:
        app.start()
    finally:
        # If the loop ended without the normal clean-up (an exception), stop the children now.
        ext = _extension(app)
        if ext is not None and ext.scheduler is not None:
            ext.scheduler.kill_now()
    return 0


def _stop_on_signal(app, sig: int) -> None:
    app.log.info("jupyter-llama: %s received, stopping", signal.Signals(sig).name)
    app.stop(from_signal=True)


def _exit_when_idle(app, seconds: float) -> None:
    """Stop the server once nothing is loaded, nothing is in flight, and the last request is
    ``seconds`` old (a loaded model keeps it: its keep_alive is a promise to the user)."""
    from tornado.ioloop import PeriodicCallback

    seconds = max(1.0, seconds)  # at least long enough for the starter's first request

    def check() -> None:
        ext = _extension(app)
        if ext is None or ext.busy or (ext.scheduler is not None and ext.scheduler.loaded):
            return
        idle = (datetime.now(timezone.utc) - app.web_app.last_activity()).total_seconds()
        if idle >= seconds:
            timer.stop()
            app.log.info("jupyter-llama: nothing loaded and no request for %.0fs: exiting", idle)
            app.stop()

    timer = PeriodicCallback(check, max(200.0, min(5000.0, seconds * 250.0)))
    timer.start()


def _extension(app):
    try:
        point = app.extension_manager.extension_points["jupyter_llama"]
    except (AttributeError, KeyError):
        return None
    return point.app


if __name__ == "__main__":
    sys.exit(main())
