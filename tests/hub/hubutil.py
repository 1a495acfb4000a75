"""A real JupyterHub, its configurable-http-proxy, and `jupyter-llama serve` as its managed
service, started by the suite (tests/hub, bench/hub_fairness.py).

Needs JupyterHub's Python package (the ``test`` extra) and configurable-http-proxy (npm:
``make hub-deps`` installs it in tests/hub/node_modules; one on PATH does too); the tests
skip, saying which is missing, without them. The Hub listens on loopback ports only and its
users are made through its REST API by the suite's own service token (no system users, no
user servers unless a test starts them). Everything started is stopped by its process id.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SERVICE = "llama"


def chp_path() -> str | None:
    """configurable-http-proxy: tests/hub/node_modules (``make hub-deps``), else PATH."""
    local = HERE / "node_modules" / ".bin" / "configurable-http-proxy"
    if local.exists() and shutil.which("node"):
        return str(local)
    return shutil.which("configurable-http-proxy")


def missing() -> str | None:
    """Why a Hub cannot be started here, or None."""
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return "JupyterHub is not installed (pip install jupyterhub; the `test` extra has it)"
    if chp_path() is None:
        return ("configurable-http-proxy is not installed (`make hub-deps` puts it in tests/hub/node_modules; it "
                "needs Node.js and npm)")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hub:
    """A running Hub with the jupyter-llama service (see :func:`start_hub`)."""

    def __init__(self, root: Path, port: int, suite_token: str, proc: subprocess.Popen, log: Path):
        self.root, self.port, self.suite_token, self.proc, self.log = root, port, suite_token, proc, log
        self.url = f"http://127.0.0.1:{port}"
        self.service_url = f"{self.url}/services/{SERVICE}/llama/"
        self.tokens: dict[str, str] = {}

    def api(self, method: str, path: str, body=None, token: str | None = None) -> httpx.Response:
        """A request to the Hub's REST API (``/hub/api/...``), as the suite by default."""
        return httpx.request(method, f"{self.url}/hub/api/{path.lstrip('/')}", json=body, timeout=30,
                             headers={"Authorization": f"token {token or self.suite_token}"}, trust_env=False)

    def add_users(self, names, groups: dict[str, list[str]] | None = None) -> None:
        r = self.api("POST", "users", {"usernames": list(names)})
        assert r.status_code in (201, 409), r.text
        for group, members in (groups or {}).items():
            r = self.api("POST", f"groups/{group}", {"users": members})
            if r.status_code == 409:
                r = self.api("POST", f"groups/{group}/users", {"users": members})
            assert r.status_code in (200, 201), r.text

    def token(self, user: str, scopes: list[str] | None = None) -> str:
        """An API token of ``user``, made through the Hub's REST API (as a user's token page does)."""
        if scopes is None and user in self.tokens:
            return self.tokens[user]
        body = {"note": "jupyter-llama tests", **({"scopes": scopes} if scopes is not None else {})}
        r = self.api("POST", f"users/{user}/tokens", body)
        assert r.status_code == 201, r.text
        tok = r.json()["token"]
        if scopes is None:
            self.tokens[user] = tok
        return tok

    def client(self, user: str | None, **kw) -> httpx.Client:
        """An HTTP client of the service's API (through the Hub's proxy) with ``user``'s token."""
        headers = {"Authorization": f"token {self.token(user)}"} if user else {}
        return httpx.Client(base_url=self.service_url, headers=headers, timeout=kw.pop("timeout", 120),
                            trust_env=False, **kw)

    def start_server(self, user: str, timeout: float = 180.0) -> None:
        """Have the Hub start ``user``'s own Jupyter server (its spawner) and wait until it is ready."""
        r = self.api("POST", f"users/{user}/server")
        assert r.status_code in (201, 202), r.text
        self._wait_server(user, lambda server: bool(server and server.get("ready")), timeout,
                          f"{user}'s server did not start")

    def stop_server(self, user: str, timeout: float = 120.0) -> None:
        """Have the Hub stop ``user``'s server, and wait until the Hub says it is gone."""
        r = self.api("DELETE", f"users/{user}/server")
        assert r.status_code in (202, 204, 400), r.text  # (400: it was not running)
        self._wait_server(user, lambda server: not server, timeout, f"{user}'s server did not stop")

    def _wait_server(self, user: str, done, timeout: float, failure: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.api("GET", f"users/{user}").json()
            if done((model.get("servers") or {}).get("")):
                return
            time.sleep(0.5)
        raise AssertionError(f"{failure} in {timeout:.0f}s:\n{self.read_log()[-4000:]}")

    def read_log(self) -> str:
        """The Hub's log, which has its service's and its proxy's lines too."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """Stop the Hub (it stops its service and its proxy), then anything of theirs left, by pid."""
        import psutil  # type: ignore[import-untyped]  # (psutil ships no types; types-psutil is not installed)

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        # The proxy, by the pid file the Hub writes in its folder: a Hub that crashed at start
        # (its service failed) leaves its proxy behind, no longer its child.
        pid_file = self.root / "jupyterhub-proxy.pid"
        try:
            proxy = psutil.Process(int(pid_file.read_text().strip()))
            if "configurable-http-proxy" in " ".join(proxy.cmdline()) and proxy not in kids:
                kids.append(proxy)
        except (OSError, ValueError, psutil.Error):
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        gone, alive = psutil.wait_procs(kids, timeout=30)
        for p in alive:  # (the service stops its own children; what is left gets no second chance)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)


def start_hub(root: Path, *, engine_path: str, models_dir: Path, hub_config: str = "",
              service_config: dict | None = None, service_env: dict | None = None, timeout: float = 120.0) -> Hub:
    """Start JupyterHub in ``root`` with configurable-http-proxy and ``jupyter-llama serve`` as its
    managed service ``llama`` (its store ``models_dir``, its ``c.LlamaHub`` settings
    ``service_config``); users get the service's access scope through the Hub's ``user`` role.
    ``hub_config``: more lines for jupyterhub_config.py."""
    root.mkdir(parents=True, exist_ok=True)
    port, api_port, hub_port, svc_port = free_port(), free_port(), free_port(), free_port()
    suite_token = secrets.token_hex(16)
    (root / "llama_config.json").write_text(json.dumps({"LlamaHub": service_config or {}}))
    env = {"JUPYTER_LLAMA_MODELS": str(models_dir), "JUPYTER_LLAMA_SERVER": engine_path,
           "JUPYTER_LLAMA_KEEP_ALIVE": "5m", "JUPYTER_RUNTIME_DIR": str(root / "service-runtime"),
           "PATH": os.environ.get("PATH", ""), **(service_env or {})}
    serve = [sys.executable, "-m", "jupyter_llama.server.serve", "--config", str(root / "llama_config.json")]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        serve.append("--allow-root")
    (root / "jupyterhub_config.py").write_text(f"""
c = get_config()  # noqa
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.command = [{chp_path()!r}]
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.should_start = True
c.JupyterHub.db_url = "sqlite:///{root / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = {str(root / 'jupyterhub_cookie_secret')!r}
c.JupyterHub.pid_file = {str(root / 'jupyterhub.pid')!r}
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {{"admin"}}
c.JupyterHub.cleanup_servers = True
c.JupyterHub.services = [
    {{"name": "{SERVICE}", "url": "http://127.0.0.1:{svc_port}", "command": {serve!r},
      "environment": {env!r}, "oauth_no_confirm": True}},
    {{"name": "suite", "api_token": {suite_token!r}}},
]
# users' servers: run as this user (no system users), from this environment, pointed at the
# service by the package's own spawner settings (jupyter_llama.hub.spawner)
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {str(root / 'homes' / '{username}')!r}
c.Spawner.cmd = [{str(Path(sys.executable).parent / 'jupyterhub-singleuser')!r}]
c.Spawner.args = {(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])!r}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
from jupyter_llama.hub.spawner import configure
configure(c, url="http://127.0.0.1:{port}/services/{SERVICE}/")
c.JupyterHub.load_roles = [
    {{"name": "user", "scopes": ["self", "access:services!service={SERVICE}"]}},
    {{"name": "suite", "scopes": ["admin:users", "admin:groups", "tokens", "admin:servers", "access:servers",
                                  "access:services"], "services": ["suite"]}},
]
""" + hub_config)
    log = root / "hub.log"
    out = open(log, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(root / "jupyterhub_config.py")],
                            cwd=root, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")})
    out.close()
    hub = Hub(root, port, suite_token, proc, log)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterHub exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
            try:
                r = httpx.get(hub.service_url, timeout=5, trust_env=False)
                if r.status_code == 200 and "jupyter-llama is running" in r.text:
                    return hub
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterHub or its service did not answer in {timeout:.0f}s:\n"
                                   f"{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.25)
    except BaseException:
        hub.stop()
        raise
