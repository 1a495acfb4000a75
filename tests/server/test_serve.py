"""``jupyter-llama serve`` as a real process: it serves, and no llama-server outlives it,
whether it is stopped (SIGTERM, SIGINT) or killed (SIGKILL: the children's parent-death signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from srvutil import OPTS, TINY, is_alive, llama_children

from jupyter_llama.engine.runner import free_port

pytestmark = pytest.mark.engine




def _serve_env(tmp_path, engine) -> dict[str, str]:
    """This environment without our settings, with a home, a store and Jupyter's folders of its own."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("JUPYTER_LLAMA_", "JPY_")):
            del env[k]
    home = tmp_path / "home"
    env.update(JUPYTER_LLAMA_MODELS=str(tmp_path / "models"), JUPYTER_LLAMA_SERVER=engine.path, HOME=str(home),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_PLATFORM_DIRS="1")
    return env


@pytest.fixture
def serve(tmp_path, engine, make_model):
    """Start ``python -m jupyter_llama.server.serve``; yields (process, base url, token)."""
    from jupyter_llama.models.store import ModelStore

    ModelStore(tmp_path / "models").create("tiny", make_model("serve-tiny", **TINY))
    env = _serve_env(tmp_path, engine)
    port, token = free_port(), "serve-test-token"
    procs = []

    def start():
        log = open(tmp_path / "serve.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(port),
                              "--token", token, "--allow-root", "--no-browser"],
                             env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(p)
        url = f"http://127.0.0.1:{port}/llama/"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert p.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "api/version", headers={"Authorization": f"token {token}"},
                             timeout=1, trust_env=False).status_code == 200:
                    return p, url, token
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("serve did not answer within 60s:\n" + (tmp_path / "serve.log").read_text())

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in llama_children(p.pid):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if is_alive(pid)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_no_child_outlives_the_server(serve, sig, tmp_path):
    proc, url, token = serve()
    h = {"Authorization": f"token {token}"}
    with httpx.Client(base_url=url, headers=h, trust_env=False, timeout=60) as c:
        r = c.post("api/generate", json={"model": "tiny", "prompt": "Once", "raw": True, "stream": False,
                                         "options": dict(OPTS, num_predict=3)})
        assert r.status_code == 200 and r.json()["eval_count"] == 3
        pid = c.get("api/ps").json()["models"][0]["pid"]
        for prompt in ("Once", "Twice"):
            with c.stream("POST", "api/generate", json={"model": "tiny", "prompt": prompt, "raw": True,
                                                        "options": dict(OPTS, num_predict=3)}) as r:
                assert r.status_code == 200 and json.loads(list(r.iter_lines())[-1])["eval_count"] == 3
    assert is_alive(pid) and pid in llama_children(proc.pid)
    proc.send_signal(sig)
    assert proc.wait(30) is not None
    assert _wait_gone([pid]) == [], f"llama-server {pid} outlived the server ({sig.name})"
    assert llama_children(proc.pid) == []
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "Authorization: token <your token>" in log
    # each API's variables, ready to copy (the token given to serve shown as a placeholder)
    port = url.split(":")[2].split("/")[0]
    for line in (f":{port}/llama OLLAMA_API_KEY=<your token>", f":{port}/llama/v1 OPENAI_API_KEY=<your token>",
                 f":{port}/llama ANTHROPIC_API_KEY=<your token>", "ANTHROPIC_BASE_URL=http", "OLLAMA_HOST=http"):
        assert line in log, log
    assert token not in log, "a token given to serve (--token) is the user's secret: never logged"


def test_api_clients_and_browsers_both_authenticate(serve, tmp_path):
    """serve's identity provider: a request with the token in its Authorization header is the
    API user at once (no login cookie minted for it); a wrong token is still the 401 with a
    sentence; a browser that logged in with ?token= keeps its cookie session, and a POST on
    that cookie alone still needs the XSRF token."""
    _, url, token = serve()
    with httpx.Client(trust_env=False, timeout=10) as c:
        for scheme in ("token", "Bearer", "bearer"):
            r = c.get(url + "api/tags", headers={"Authorization": f"{scheme} {token}"})
            assert r.status_code == 200 and "models" in r.json()
            assert "set-cookie" not in r.headers
        r = c.post(url + "api/show", json={"model": "tiny"}, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["details"]["format"] == "gguf"

        r = c.get(url + "api/tags", headers={"Authorization": "Bearer not-the-token"})
        assert r.status_code == 401 and "token" in r.json()["error"].lower()
        assert r.headers["www-authenticate"].startswith("Bearer")

    with httpx.Client(trust_env=False, timeout=10) as browser:
        r = browser.get(url + "api/tags", params={"token": token})
        assert r.status_code == 200 and r.headers.get("set-cookie")  # the login cookie, as in any Jupyter server
        r = browser.get(url + "api/tags")  # the cookie alone
        assert r.status_code == 200 and "models" in r.json()
        r = browser.post(url + "api/show", json={"model": "tiny"})
        assert r.status_code in (401, 403), r.text  # a cookie without the XSRF token does not write
        browser.cookies.set("_xsrf", "0123456789abcdef")  # the double submit a page's script makes
        r = browser.post(url + "api/show", json={"model": "tiny"}, headers={"X-XSRFToken": "0123456789abcdef"})
        assert r.status_code == 200, r.text


_LEVELS = """
import logging, sys
from jupyter_llama.server.serve import make_server
app = make_server(["--log-level", sys.argv[1], "--port", "0", "--allow-root"])
app.log.warning("a warning still shows")
app.log.debug("a debug line shows only at DEBUG")
print([logging.getLogger(n).isEnabledFor(logging.DEBUG) for n in (app.log.name, "tornado.access")])
"""


@pytest.mark.parametrize("level, debug", [("WARN", False), ("DEBUG", True)])
def test_serve_makes_no_log_record_its_handlers_would_drop(level, debug, tmp_path):
    """jupyter_server makes two debug records per API request (one before a stream's first
    token) that a handler at WARN drops; serve's loggers are raised to what their handlers
    show, so such records are not made, and at DEBUG they all still show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_LLAMA_", "JPY_"))}
    home = tmp_path / "home"
    env.update(HOME=str(home), JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_LLAMA_MODELS=str(tmp_path / "models"))
    out = subprocess.run([sys.executable, "-c", _LEVELS, level], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str([debug, debug])
    assert "a warning still shows" in out.stderr
    assert ("a debug line shows only at DEBUG" in out.stderr) is debug


def test_the_access_log_shows_what_it_showed_and_every_request_is_still_counted(serve, tmp_path):
    """serve formats an access line only when it shows (log_only_what_shows): at the usual
    level a 404 is still a warning line and a 200 is not a line, and both are counted in
    jupyter_server's Prometheus metrics."""
    _, url, token = serve()
    auth = {"Authorization": f"token {token}"}
    with httpx.Client(trust_env=False, timeout=10, headers=auth) as c:
        assert c.get(url + "api/tags").status_code == 200
        assert c.post(url + "api/show", json={"model": "no-such-model"}).status_code == 404
        metrics = c.get(url.replace("/llama/", "/metrics")).text
    log = (tmp_path / "serve.log").read_text()
    assert "404 POST /llama/api/show" in log
    assert "200 GET /llama/api/tags" not in log
    counted = [ln for ln in metrics.splitlines() if ln.startswith("http_request_duration_seconds_count")]
    assert any('handler="jupyter_llama.server.handlers.TagsHandler"' in ln and 'status_code="200"' in ln
               and not ln.endswith(" 0.0") for ln in counted), counted
    assert any('handler="jupyter_llama.server.handlers.ShowHandler"' in ln and 'status_code="404"' in ln
               for ln in counted), counted


def test_a_setting_the_extension_cannot_read_stops_serve_with_its_sentence(tmp_path, engine):
    """Not a server that answers every API request with 404 (the extension failed to load),
    which a client starting the background manager waited a minute on: serve exits, status
    1, and says which setting is wrong and how to write it."""
    env = dict(_serve_env(tmp_path, engine), JUPYTER_LLAMA_KEEP_ALIVE="banana")
    done = subprocess.run([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(free_port()),
                           "--allow-root", "--no-browser"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert ('jupyter-llama serve: LlamaExtension settings: LlamaExtension.keep_alive (JUPYTER_LLAMA_KEEP_ALIVE): '
            '"banana" is not a duration') in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr.split("jupyter-llama serve:")[1]
    # a models folder that cannot be one: said at start (serve started, then `list` said "no models yet",
    # and a synth or create was a 500 "internal error")
    (tmp_path / "afile").write_text("")
    env = dict(_serve_env(tmp_path, engine), JUPYTER_LLAMA_MODELS=str(tmp_path / "afile"))
    done = subprocess.run([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(free_port()),
                           "--allow-root", "--no-browser"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (f"jupyter-llama serve: LlamaExtension.models_dir (JUPYTER_LLAMA_MODELS): "
            f"{tmp_path / 'afile'} is a file, not a folder") in done.stderr, done.stderr[-2000:]
    # a default context it cannot read: said at start, not by every load
    env = dict(_serve_env(tmp_path, engine), JUPYTER_LLAMA_CONTEXT_LENGTH="lots")
    done = subprocess.run([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(free_port()),
                           "--allow-root", "--no-browser"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "JUPYTER_LLAMA_CONTEXT_LENGTH" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr.split("jupyter-llama serve:")[1]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="what root is told (CI runs as root)")
def test_root_without_allow_root_is_told_before_it_is_told_where_it_serves(tmp_path, engine):
    """jupyter_server refuses root only once started, after serve had said where it served."""
    done = subprocess.run([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(free_port()),
                           "--no-browser"], env=_serve_env(tmp_path, engine), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.rstrip().endswith("jupyter-llama serve: this is the root user, and Jupyter servers refuse to "
                                         "run as root unless told to: add --allow-root (or run as another user)")
    assert "serving http" not in done.stderr


def test_an_address_or_port_serve_cannot_listen_on_is_a_sentence(tmp_path, engine):
    """--port -1 and --ip 999.1.1.1 were tracebacks (socket.gaierror); --port 70000 listened on
    4464 while every line, the runtime file and the kernels' variables said 70000."""
    env = _serve_env(tmp_path, engine)

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "jupyter_llama.server.serve", "--allow-root", "--no-browser",
                               *args], env=env, capture_output=True, text=True, timeout=120)

    for args, status, said in (
            (["--port=-1"], 2, "argument --port: -1 is not a port number (0-65535; 0 takes any free one)"),
            (["--port", "70000"], 2, "argument --port: 70000 is not a port number"),
            (["--exit-when-idle", "-5"], 2, "argument --exit-when-idle: '-5' is not a number of seconds above 0"),
            (["--ip", "999.1.1.1", "--port", str(free_port())], 1, "jupyter-llama serve: cannot listen on 999.1.1.1")):
        done = serve(*args)
        assert done.returncode == status and said in done.stderr, (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_word_serve_does_not_know_for_how_it_serves_is_said(tmp_path, engine):
    """JUPYTER_LLAMA_EVENT_LOOP names one of a few event loops, JUPYTER_LLAMA_HEADER_TIMEOUT a
    duration; anything else is said at start, not taken as the default without a word."""
    for name, value, said in (("EVENT_LOOP", "turbo", "'turbo' is not one of uvloop, asyncio (unset: uvloop)"),
                              ("HEADER_TIMEOUT", "soon", '"soon" is not a duration; use seconds (300), or units like '
                                                         "'10m', '1h30m', '-1' for forever")):
        env = dict(_serve_env(tmp_path, engine), **{f"JUPYTER_LLAMA_{name}": value})
        done = subprocess.run([sys.executable, "-m", "jupyter_llama.server.serve", "--allow-root", "--no-browser",
                               "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.strip() == f"jupyter-llama serve: JUPYTER_LLAMA_{name}: {said}", \
            done.stderr[-2000:]


@pytest.fixture
def credentials_in_env(monkeypatch):
    """Credentials of other services in the environment serve starts with (before ``serve``)."""
    secrets = {"HF_TOKEN": "hf-secret-value", "OPENAI_API_KEY": "sk-secret-value",
               "AWS_SECRET_ACCESS_KEY": "aws-secret-value", "SOME_SERVICE_PASSWORD": "pw-secret-value"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    return secrets


def test_serves_key_opens_only_its_api_and_no_child_gets_a_credential(credentials_in_env, serve, tmp_path):
    """The token serve hands to Ollama and OpenAI clients opens this extension's API and
    nothing of jupyter_server's own (no files, no kernels, no sessions, no shutdown); serve
    writes no open-in-browser file (it would hold the token); a model's child has its own key
    and none of the manager's, nor any other credential of the environment."""
    _, url, token = serve()
    root = url[: -len("llama/")]
    with httpx.Client(trust_env=False, timeout=60, headers={"Authorization": f"token {token}"}) as c:
        for path in ("api/contents", "api/contents/README.md", "files/README.md", "api/kernels", "api/kernelspecs",
                     "api/sessions", "api/terminals", "api/config/notebook", "api/nbconvert", "api/status"):
            r = c.get(root + path)
            assert r.status_code == 404, (path, r.status_code, r.text[:300])
        r = c.post(root + "api/shutdown")
        assert r.status_code in (404, 405), r.text[:300]
        r = c.post(url + "api/generate", json={"model": "tiny", "prompt": "Once", "raw": True, "stream": False,
                                               "options": dict(OPTS, num_predict=2)})
        assert r.status_code == 200 and r.json()["eval_count"] == 2
        pid = c.get(url + "api/ps").json()["models"][0]["pid"]
    runtime = tmp_path / "home" / "runtime"
    assert list(runtime.glob("jpserver-*.json")), "the runtime file the CLI finds serve by is still written"
    assert not list(runtime.glob("jpserver-*-open.html"))
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read()
    names = {e.split(b"=", 1)[0].decode() for e in environ.split(b"\0") if b"=" in e}
    assert "LLAMA_API_KEY" in names
    for name in ("JUPYTER_TOKEN", "JUPYTER_LLAMA_TOKEN", "OLLAMA_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
                 *credentials_in_env):
        assert name not in names, name
    for value in (token, *credentials_in_env.values()):
        assert value.encode() not in environ


@pytest.fixture
def short_header_timeout(monkeypatch):
    """serve started with a one-second header timeout (before ``serve``)."""
    monkeypatch.setenv("JUPYTER_LLAMA_HEADER_TIMEOUT", "1s")


def test_silent_and_slow_connections_are_closed_while_clients_are_served(short_header_timeout, serve):
    """A connection that sends no request head, or sends it a byte at a time and never ends
    it (a slowloris), is closed once the header timeout passes (Tornado's default was an
    hour); a client that sends its request is served meanwhile, and after."""
    import socket

    _, url, token = serve()
    port = int(url.split(":")[2].split("/")[0])
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    slow = socket.create_connection(("127.0.0.1", port))
    try:
        slow.sendall(b"GET /llama/api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        with httpx.Client(trust_env=False, timeout=30, headers={"Authorization": f"token {token}"}) as c:
            assert c.get(url + "api/version").status_code == 200
            for s in silent + [slow]:
                s.settimeout(30)  # (an upper bound far above the setting; the default would hold for an hour)
                try:
                    while True:
                        slow.sendall(b"X")  # (a header line that never ends)
                        if s.recv(1024) == b"":
                            break
                except (ConnectionResetError, BrokenPipeError):
                    pass
            assert c.get(url + "api/version").status_code == 200
    finally:
        for s in silent + [slow]:
            s.close()
