"""The Jupyter server extension: ``LlamaExtension``, mounted at ``<base_url>llama/``.

It owns one :class:`~jupyter_llama.scheduler.Scheduler` (and so every llama-server child)
and one :class:`~jupyter_llama.models.store.ModelStore`. Every setting is a traitlet
(``c.LlamaExtension.<name>``) whose default comes from the ``JUPYTER_LLAMA_<NAME>``
environment variable, so admins can use either.

Lifecycle:

* ``initialize_settings`` (server start-up, before the event loop runs) builds the store
  and the scheduler; nothing there needs the loop (the scheduler is passive until asked).
* once the loop runs (a callback ``initialize_settings`` queues on it), ``ensure_started``
  exports ``JUPYTER_LLAMA_URL`` into ``os.environ`` so kernels started from now on inherit
  it, and starts the activity ticker. A server whose loop was already running (test
  harnesses) gets the same on its first request at the latest.
* ``stop_extension`` (server shutdown, which jupyter_server also runs on SIGTERM and on
  SIGINT once confirmed) stops every child and waits for them.

Idle culling: JupyterHub's culler and ``shutdown_no_activity_timeout`` read the server's
``last_activity()``, the latest of the ``*_last_activity`` settings and of
``settings["last_activity_times"]``. While requests are in flight (generation, pulls,
uploads) this extension stamps ``last_activity_times["jupyter_llama"]`` every
``activity_interval`` seconds, and ``current_activity()`` reports them. A loaded model
with no request does not count: an idle server with a model in memory can be culled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import traitlets
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.utils import url_path_join
from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import Float, Type, Undefined, Unicode, default, validate

from .. import config
from .._version import __version__
from ..client import client_environment
from ..config import ConfigError
from ..errors import JupyterLlamaError
from ..private import UntrustedFile, trusted_folder
from ..scheduler import Scheduler, SchedulerSettings

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

URL_ENV = "JUPYTER_LLAMA_URL"
ACTIVITY_KEY = "jupyter_llama"


class EngineUnavailable(JupyterLlamaError):
    """No usable llama-server; the message says how to get one."""

    status = 503


class CachedResolver:
    """The store's resolver, and the model's preset (:meth:`preset`), with a cache in front,
    so a request for a loaded model does not pay a worker-thread hop and manifest reads before
    its first token. One look-up gives both: the resolution and the preset of one manifest.

    A hit is used only while the files behind it are unchanged: the manifest, the model blob
    and the projector are ``stat``-ed (size, mtime, inode) on every call, which is the same
    test after which the store itself skips rehashing. A hit older than ``ttl`` seconds is
    still answered at once, and looked up again behind it (so what the stamps cannot see, a
    manifest made elsewhere that takes precedence over the one found, say, reaches the next
    request): a notebook's requests, seconds apart, never wait for the lookup. ``forget()``
    drops everything (after our own create, copy, pull and delete).
    """

    def __init__(self, store, ttl: float = 5.0):
        self.store = store
        self.ttl = ttl
        self._cache: dict[str, tuple[float, tuple, tuple]] = {}  # name -> (when, (ref, preset), stamps)
        self._generation = 0  # forget() moves it on: a look-up begun before it does not store its answer
        self._refreshing: dict[str, asyncio.Task] = {}  # name -> its look-up behind an answer (_look_again)

    @staticmethod
    def _stamps(paths) -> tuple:
        out = []
        for p in paths:
            st = os.stat(p)
            out.append((p, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(out)

    def _resolve_with_stamps(self, name: str):
        """((the resolution, the preset), the stamps to keep them by, or None not to keep them)."""
        manifest: str | None  # (None: not a named model)
        try:  # the manifest's stamp before the read: a change while it is read is not kept
            manifest = str(self.store.entry(name).manifest_path)
            before = self._stamps([manifest])
        except (JupyterLlamaError, ValueError, OSError):
            manifest = before = None
        ref = self.store.resolve_sync(name)
        found = (ref, self.store.preset_for(name))
        if manifest is None:
            return found, None  # a GGUF path, not a named model: who may read it is decided per request
        try:
            stamps = self._stamps([manifest, ref.path] + ([ref.mmproj] if ref.mmproj else []))
        except OSError:
            return found, None
        return found, (stamps if stamps[:1] == before else None)

    async def __call__(self, name: str):
        return (await self._cached(name))[0]

    async def preset(self, name: str):
        """``store.preset_for(name)``: what a request for ``name`` starts from. A name that does
        not resolve (a typo) gets an empty one: resolving it later says what is wrong."""
        try:
            return (await self._cached(name))[1]
        except (JupyterLlamaError, ValueError, OSError):
            return await asyncio.to_thread(self.store.preset_for, name)

    async def _cached(self, name: str) -> tuple:
        hit = self._cache.get(name)
        if hit is not None:
            at, value, stamps = hit
            try:
                unchanged = self._stamps(p for p, *_ in stamps) == stamps
            except OSError:
                unchanged = False
            if unchanged:
                if time.monotonic() - at >= self.ttl:
                    self._look_again(name)
                return value
            self._cache.pop(name, None)
        generation = self._generation
        value, stamps = await asyncio.to_thread(self._resolve_with_stamps, name)
        self._keep(name, value, stamps, generation)
        return value

    def _keep(self, name: str, value, stamps, generation: int) -> None:
        if generation != self._generation:
            return
        if stamps is None:
            self._cache.pop(name, None)
            return
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[name] = (time.monotonic(), value, stamps)

    def _look_again(self, name: str) -> None:
        if name in self._refreshing:
            return
        generation = self._generation

        async def again() -> None:
            try:
                value, stamps = await asyncio.to_thread(self._resolve_with_stamps, name)
            except Exception:  # noqa: BLE001 - it no longer resolves: the next request looks it up and says why
                if generation == self._generation:
                    self._cache.pop(name, None)
            else:
                self._keep(name, value, stamps, generation)

        task = self._refreshing[name] = asyncio.get_running_loop().create_task(again())
        task.add_done_callback(lambda _: self._refreshing.pop(name, None))  # (one at a time per name)

    def forget(self) -> None:
        self._generation += 1
        self._cache.clear()

    async def close(self) -> None:
        """Forget everything and end the look-ups under way (the server is stopping)."""
        self.forget()
        tasks = list(self._refreshing.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def path_folders(setting: str) -> list[str] | None:
    """``model_paths`` as the store takes it: None for '*' (anywhere), else the folders."""
    setting = setting.strip()
    return None if setting == "*" else [p.strip() for p in setting.split(os.pathsep) if p.strip()]


class _FromEnv:
    """Traits whose default is read from ``JUPYTER_LLAMA_<NAME>`` when the extension is made
    (so a variable set after import still counts), else a fallback; ``--help-all`` says so.
    Configuration (``c.LlamaExtension.keep_alive = ...``, the command line) wins over both."""

    class _Mixin:
        default_value: Any  # (Undefined here: the trait's default is made when asked, below)

        def __init__(self, env: str, fallback, parse, **kw):
            super().__init__(**kw)
            self.env_name, self.fallback, self.parse = env, fallback, parse
            self.default_value = Undefined  # use make_dynamic_default

        def make_dynamic_default(self):
            value = config.env(self.env_name)
            return self.parse(self.fallback if value is None else value, config.ENV_PREFIX + self.env_name)

        def default_value_repr(self) -> str:
            return f"${config.ENV_PREFIX}{self.env_name}, else {self.fallback!r}"

    # Named as the traits they extend, which is what --help-all prints for them.
    class Unicode(_Mixin, traitlets.Unicode):
        pass

    class Int(_Mixin, traitlets.Int):
        pass

    class Bool(_Mixin, traitlets.Bool):
        pass

    @classmethod
    def text(cls, env: str, fallback: str, **kw):
        return cls.Unicode(env, fallback, lambda v, what: str(v), **kw)

    @classmethod
    def integer(cls, env: str, fallback: int, **kw):
        return cls.Int(env, fallback, config.parse_int, **kw)

    @classmethod
    def boolean(cls, env: str, fallback: bool, **kw):
        return cls.Bool(env, fallback, config.parse_bool, **kw)

    @classmethod
    def size(cls, env: str, fallback: str, **kw):
        return cls.Int(env, fallback, config.parse_size, **kw)


class LlamaExtension(ExtensionApp):
    """Ollama's manager layer over llama.cpp's llama-server, as a Jupyter server extension."""

    name = "jupyter_llama"
    description = __doc__.splitlines()[0] if __doc__ else ""
    extension_url = "/llama/api/version"
    load_other_extensions = True

    # ------------------------------------------------------------------ settings

    keep_alive = _FromEnv.text(
        "KEEP_ALIVE", "5m",
        help="How long an idle model stays loaded: seconds, or a duration such as '5m', '1h30m'; "
             "negative keeps it forever; 0 unloads at once. A request's own keep_alive overrides it.",
    ).tag(config=True)

    max_loaded_models = _FromEnv.integer(
        "MAX_LOADED_MODELS", 0, help="Most models loaded at once; 0 means 3 x max(number of GPUs, 1).",
    ).tag(config=True)

    num_parallel = _FromEnv.integer(
        "NUM_PARALLEL", 0,
        help="Request slots per loaded model (llama-server -np); 0 leaves it to llama-server (automatic).",
    ).tag(config=True)

    max_queue = _FromEnv.integer(
        "MAX_QUEUE", 512, help="Most requests waiting for a model to load; past it requests fail at once with 503.",
    ).tag(config=True)

    load_timeout = _FromEnv.text(
        "LOAD_TIMEOUT", "5m",
        help="How long a loading model may stay silent (no log output, no health answer) before the "
             "load fails, as a duration ('5m'; -1 for never).",
    ).tag(config=True)

    memory_limit = _FromEnv.text(
        "MEMORY_LIMIT", "",
        help="Memory budget for all loaded models together: a size for every device ('8GiB') or per "
             "device ('cuda:0=20GiB,rpc:gpu-box:50052=10GiB,cpu=6GiB'); empty means no budget.",
    ).tag(config=True)

    gpu_overhead = _FromEnv.text(
        "GPU_OVERHEAD", "", help="Memory kept free on every GPU (a size such as '512MiB').",
    ).tag(config=True)

    rpc_workers = _FromEnv.text(
        "RPC_WORKERS", "",
        help="llama.cpp RPC workers (`jupyter-llama worker` / ggml-rpc-server) to use as devices, as "
             "'HOST:PORT,HOST:PORT' in the order llama.cpp should number them; each is the device "
             "rpc:HOST:PORT in budgets and listings.",
    ).tag(config=True)

    models_dir = _FromEnv.text(
        "MODELS", "", help="The model registry's directory (empty: <jupyter data dir>/llama/models).",
    ).tag(config=True)

    model_paths = _FromEnv.text(
        "MODEL_PATHS", "",
        help="Where HTTP clients may name a GGUF file by its path instead of a model name: folders "
             "separated by ':' ('*' for anywhere). Empty (the default): nowhere. This user's own CLI, "
             "magics and widgets on this machine may always name their files (they prove who they are "
             "with a key file only this user can read).",
    ).tag(config=True)

    server_binary = _FromEnv.text(
        "SERVER", "",
        help="Path of the llama-server binary (empty: the project's own cached build, else llama-server on PATH).",
    ).tag(config=True)

    fit_estimator = _FromEnv.text(
        "FIT_ESTIMATOR", "detailed",
        help="Which memory prediction decides whether a model fits: 'detailed' or 'coarse' (Ollama's).",
    ).tag(config=True)

    @validate("fit_estimator")
    def _check_fit_estimator(self, proposal):
        if proposal["value"] not in ("detailed", "coarse"):
            raise ConfigError(f"LlamaExtension.fit_estimator must be 'detailed' or 'coarse', got {proposal['value']!r}")
        return proposal["value"]

    evict_pinned = _FromEnv.boolean(
        "EVICT_PINNED", False,
        help="Whether pinned models (negative keep_alive) may be evicted when nothing else makes room.",
    ).tag(config=True)

    max_request_size = _FromEnv.size(
        "MAX_REQUEST_SIZE", "64MiB", help="Largest JSON request body accepted, in bytes (larger ones get 413).",
    ).tag(config=True)

    max_upload_size = _FromEnv.size(
        "MAX_UPLOAD_SIZE", "256GiB", help="Largest blob upload (POST api/blobs/sha256:...) accepted, in bytes.",
    ).tag(config=True)

    activity_interval = Float(
        10.0,
        help="Seconds between activity stamps while requests are in flight (what JupyterHub's idle "
             "culler reads).",
    ).tag(config=True)

    scheduler_class = Type(
        default_value=Scheduler,
        klass=Scheduler,
        help="The scheduler class (a subclass of jupyter_llama.scheduler.Scheduler).",
    ).tag(config=True)

    # ------------------------------------------------------------------ state

    scheduler: Scheduler | None = None
    store = None
    resolver: CachedResolver | None = None
    engine = None
    engine_error: str | None = None
    _active = 0
    _started = False
    _activity_pc: PeriodicCallback | None = None
    _previous_url_env: str | None = None
    _exported: dict[str, str] = {}
    _scheduler_lock: asyncio.Lock | None = None
    _engine_checked_at = 0.0

    def scheduler_settings(self, binary: str) -> SchedulerSettings:
        """The SchedulerSettings these traits describe, parsed and validated once, by the
        scheduler's own parser; messages name the trait and the variable it defaults from."""
        values = {k: getattr(self, k) for k in SchedulerSettings.SETTABLE}
        try:
            return SchedulerSettings.from_values(
                values, lambda k: f"LlamaExtension.{k} ({config.ENV_PREFIX}{k.upper()})", binary=binary,
                # this user's managers on this machine see each other here (memory.peers)
                peers_dir=str(self._server.runtime_dir),
                # a scheduler made once the server listens (an engine found later) knows it at once
                manager_url=self.url if self._started else "")
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"LlamaExtension settings: {e}") from None

    shared_url = Unicode(
        help="A shared jupyter-llama manager this server defers to (a JupyterHub service's API URL): its "
             "llama/ routes relay there with the user's token (JUPYTER_LLAMA_TOKEN, else JUPYTERHUB_API_TOKEN), "
             "and no model runs here. Default: JUPYTER_LLAMA_URL in a JupyterHub user's server (JUPYTERHUB_USER "
             "set), which jupyter_llama.hub.spawner sets; else empty (this server is its own manager).",
    ).tag(config=True)

    @default("shared_url")
    def _shared_url_from_hub(self) -> str:
        if getattr(self.serverapp, "is_llama_manager", False):  # `serve` is a manager: it defers to none
            return ""
        if os.environ.get("JUPYTERHUB_USER") and os.environ.get(URL_ENV):
            return os.environ[URL_ENV]
        return ""

    # ------------------------------------------------------------------ server hooks

    def initialize_settings(self) -> None:
        from ..models.store import ModelStore

        if self.shared_url:  # a Hub user's server: the shared manager is theirs (jupyter_llama.hub.relay)
            self.log.info("jupyter-llama %s: no manager here; llama/ relays to the shared one at %s", __version__,
                          self.shared_url)
            return

        self.store = ModelStore(self.models_dir or None, path_folders=path_folders(self.model_paths))
        for name in ("max_request_size", "max_upload_size"):  # (every request, or upload, would be too large)
            if getattr(self, name) < 1:
                raise ConfigError(f"LlamaExtension.{name} ({config.ENV_PREFIX}{name.upper()}) must be a size above "
                                  f"0, got {getattr(self, name)}")
        unusable = self.store.usable_root()
        if unusable:  # (every request would fail, some of them as a 500 or as a full disk)
            raise ConfigError(f"LlamaExtension.models_dir ({config.ENV_PREFIX}MODELS): {unusable}; point it at a "
                              "folder this user can write (empty: <jupyter data dir>/llama/models)")
        self.resolver = CachedResolver(self.store)
        self._scheduler_lock = None
        self.scheduler = None
        self.hub = self._hub_settings()
        self._find_engine_and_build()
        # once the server listens (its URL is known) and its loop runs: export the URL for kernels
        IOLoop.current().add_callback(self.ensure_started)
        (self.log.info if self.engine else self.log.warning)(
            "jupyter-llama %s: models in %s; engine %s", __version__, self.store.root,
            self.engine.path if self.engine else f"unavailable ({self.engine_error}): no model can load until it is")

    def _find_engine_and_build(self) -> None:
        from ..engine.binary import EngineBroken, EngineNotFound, find_engine

        self._engine_checked_at = time.monotonic()
        try:
            self.engine = find_engine(self.server_binary or None)
        except (EngineNotFound, EngineBroken) as e:
            self.engine, self.engine_error = None, str(e)
            return
        self.engine_error = None
        settings = self.scheduler_settings(self.engine.path)
        self.scheduler = self.scheduler_class(settings, resolver=self.resolver)
        if self.hub is not None:  # one manager for a Hub's users: their quotas, their turns
            self.scheduler.share(self.hub.quota_table)

    # A JupyterHub service's settings (jupyter_llama.hub.settings.LlamaHub), when this server
    # runs as one (`jupyter-llama serve` with the Hub's identity provider); else None.
    hub = None

    def _hub_settings(self):
        if not getattr(getattr(self.serverapp, "identity_provider", None), "hub_service", False):
            return None
        from ..hub.settings import LlamaHub

        return LlamaHub(parent=self)

    def initialize_handlers(self) -> None:
        if self.shared_url:
            from ..hub.relay import relay_handlers

            self.handlers.extend(relay_handlers())
            return
        from .handlers import default_handlers

        self.handlers.extend(default_handlers())

    def ensure_started(self) -> None:
        """Export the URL and start the activity ticker (once; needs the running loop)."""
        if self._started:
            return
        self._started = True
        self.export_url()
        if self.hub is None:  # (a Hub's users are not this machine's user: no file path is theirs to name)
            self._write_local_key()
        if self.scheduler is not None:
            self.scheduler.announce(self.url)  # known once the server listens
        self._activity_pc = PeriodicCallback(self._tick_activity, max(0.05, self.activity_interval) * 1000)
        self._activity_pc.start()

    local_key: str | None = None
    local_key_file: str | None = None

    def _write_local_key(self) -> None:
        """A secret in a file only this user can read (in Jupyter's runtime folder, 0600): a
        client that sends it back runs as this user on this machine (see store.local_caller)."""
        import secrets

        folder = self._server.runtime_dir
        path = os.path.join(folder, f"jupyter-llama-local-{os.getpid()}-{secrets.token_hex(4)}.key")
        key = secrets.token_urlsafe(32)
        try:
            trusted_folder(folder)  # (made 0700 when missing; one others could write to is not used)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key)
        except (OSError, UntrustedFile) as e:
            self.log.warning("jupyter-llama: no local key file (%s): file paths are refused for every client", e)
            return
        self.local_key, self.local_key_file = key, path

    def is_local_caller(self, sent: str | None) -> bool:
        import hmac

        return bool(sent and self.local_key and hmac.compare_digest(sent, self.local_key))

    @property
    def _server(self) -> ServerApp:
        """The Jupyter server this extension runs in; AttributeError before it is linked to one."""
        if self.serverapp is None:
            raise AttributeError("the jupyter-llama extension is not linked to a Jupyter server yet")
        return self.serverapp

    @property
    def url(self) -> str:
        """This extension's root URL (non-secret): server URL + base_url + ``llama/``."""
        return url_path_join(self._server.connection_url, "llama/")

    def export_url(self) -> None:
        """Export where this API is for the kernels the server starts (they inherit its
        environment): ``JUPYTER_LLAMA_URL`` always; and, unless the user set them, the
        variables Ollama's and OpenAI's clients read, so ``ollama.chat(...)``,
        ``openai.OpenAI()``, langchain and ``%%ai`` work in a cell with no configuration."""
        self._previous_url_env = os.environ.get(URL_ENV)
        os.environ[URL_ENV] = self.url
        token = getattr(getattr(self.serverapp, "identity_provider", None), "token", "") or ""
        defaults = client_environment(self.url, token)
        del defaults[URL_ENV]  # (set above, whatever was there)
        self._exported = {k: v for k, v in defaults.items() if not os.environ.get(k)}
        os.environ.update(self._exported)
        self.log.info("jupyter-llama API at %s (exported for kernels as %s%s)", self.url, URL_ENV,
                      "".join(f", {k}" for k in self._exported))

    async def get_scheduler(self) -> Scheduler:
        """The scheduler; when no engine was found at start-up, look again (it may be built since)."""
        if self.scheduler is not None:
            return self.scheduler
        if self._scheduler_lock is None:
            self._scheduler_lock = asyncio.Lock()
        async with self._scheduler_lock:
            # look again at most every 10 s (finding one runs `llama-server --version`)
            if self.scheduler is None and time.monotonic() - self._engine_checked_at > 10:
                await asyncio.to_thread(self._find_engine_and_build)
        if self.scheduler is None:
            raise EngineUnavailable(self.engine_error or "no llama-server available")
        return self.scheduler

    async def stop_extension(self) -> None:
        """Stop every llama-server child (jupyter_server calls this on shutdown, SIGTERM included)."""
        if self.store is not None:
            self.store.stop_waiting()  # (a request waiting for a store lock gives up now, not in LOCK_WAIT)
        if self._activity_pc is not None:
            self._activity_pc.stop()
            self._activity_pc = None
        if self.scheduler is not None:
            self.log.info("jupyter-llama: stopping %d model runner(s)", len(self.scheduler.live()))
            await self.scheduler.shutdown()
        if self.resolver is not None:
            await self.resolver.close()
        if self._started and os.environ.get(URL_ENV) == self.url:
            if self._previous_url_env is None:
                os.environ.pop(URL_ENV, None)
            else:
                os.environ[URL_ENV] = self._previous_url_env
        for k, v in self._exported.items():  # what we set, if nobody changed it since
            if os.environ.get(k) == v:
                os.environ.pop(k, None)
        self._exported = {}
        if self.local_key_file:
            with contextlib.suppress(OSError):
                os.unlink(self.local_key_file)
            self.local_key = self.local_key_file = None
        self._started = False

    # ------------------------------------------------------------------ activity

    @property
    def busy(self) -> int:
        """Requests doing work now: handler requests plus leases held on runners."""
        return self._active + (self.scheduler.in_flight if self.scheduler is not None else 0)

    def current_activity(self):
        """What jupyter_server's ``shutdown_no_activity`` asks each extension; None when idle."""
        if self.busy:
            return {"requests": self._active,
                    "in_flight": self.scheduler.in_flight if self.scheduler is not None else 0}
        return None

    def stamp_activity(self) -> None:
        try:
            times = self._server.web_app.settings.setdefault("last_activity_times", {})
        except AttributeError:  # no web app (yet)
            return
        times[ACTIVITY_KEY] = datetime.now(timezone.utc)

    def _tick_activity(self) -> None:
        if self.busy:
            self.stamp_activity()

    def store_changed(self) -> None:
        """Our own handlers changed the registry: resolve names afresh."""
        if self.resolver is not None:
            self.resolver.forget()

    async def name_changed(self, name: str) -> None:
        """A handler created, copied over or deleted ``name``: resolve afresh, and retire the
        runners loaded under it from what it named before."""
        self.store_changed()
        if self.scheduler is not None:
            await self.scheduler.name_changed(name)

    @contextlib.contextmanager
    def work(self):
        """Count a request as activity for as long as it runs."""
        self._active += 1
        self.stamp_activity()
        try:
            yield
        finally:
            self._active -= 1
            self.stamp_activity()
