"""``serve`` holds no more client connections than its descriptors allow: a flood of silent
connections past the descriptor limit leaves clients served and the log short, and while
every connection is busy a new one gets a 503 that says why, not a hang."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest

from jupyter_llama.engine.runner import free_port
from jupyter_llama.server.connections import room_for_connections

DESCRIPTORS = 200  # serve's own limit in these tests (soft and hard: it cannot raise it)
CAP = room_for_connections(DESCRIPTORS)
TOKEN = "cap-test-token"


@pytest.fixture
def small_serve(tmp_path):
    """``serve`` with a descriptor limit of DESCRIPTORS; yields (process, port, log path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_LLAMA_", "JPY_"))}
    home = tmp_path / "home"
    env.update(JUPYTER_LLAMA_MODELS=str(tmp_path / "models"), HOME=str(home),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_PLATFORM_DIRS="1")
    port = free_port()
    log_path = tmp_path / "serve.log"

    def limit_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))

    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "jupyter_llama.server.serve", "--port", str(port),
                              "--token", TOKEN, "--allow-root", "--no-browser"], env=env, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=limit_descriptors)
    try:
        deadline = time.monotonic() + 60
        while not _version_answers(port):
            assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield p, port, log_path
    finally:
        p.kill()
        p.wait(10)


def _version_answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/llama/api/version", headers={"Authorization": f"token {TOKEN}"},
                         timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _cap_lines(log_path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if "the most this manager holds" in line]


def test_silent_connections_past_the_descriptor_limit_leave_clients_served(small_serve):
    """Twice as many silent connections as serve has descriptors: each new one past the cap
    closes the longest idle one, so serve never runs out, a client is served throughout, and
    the cap is logged once (not once per connection, nor per failed accept)."""
    p, port, log_path = small_serve
    silent = []
    try:
        for _ in range(2 * DESCRIPTORS):
            silent.append(socket.create_connection(("127.0.0.1", port)))
            if len(silent) % 50 == 0:
                assert _version_answers(port)
        assert _version_answers(port)
        assert p.poll() is None
        assert len(_cap_lines(log_path)) == 1, log_path.read_text()[-3000:]
        assert "Too many open files" not in log_path.read_text()
        open_sockets = sum(1 for fd in os.listdir(f"/proc/{p.pid}/fd")
                           if os.readlink(f"/proc/{p.pid}/fd/{fd}").startswith("socket:"))
        assert open_sockets <= DESCRIPTORS
    finally:
        for s in silent:
            s.close()


def test_while_every_connection_is_busy_a_new_one_is_told_so_and_served_after(small_serve):
    """Connections that sent a request's head and are still sending its body are busy: none
    is closed for room. A new connection at the cap gets a 503 with a sentence, at once; once
    the busy ones end, clients are served again."""
    p, port, log_path = small_serve
    head = (b"POST /llama/api/blobs/sha256:" + b"0" * 64 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: token " + TOKEN.encode() + b"\r\nContent-Length: 1000000\r\n\r\n")
    busy = []
    try:
        for _ in range(CAP):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(head)
            busy.append(s)
        assert _version_answers(port) is False  # (it connects, is refused, and says so:)
        newcomer = socket.create_connection(("127.0.0.1", port))
        newcomer.settimeout(30)
        answer = b""
        while chunk := newcomer.recv(4096):
            answer += chunk
        newcomer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"JUPYTER_LLAMA_MAX_CONNECTIONS" in answer and b"try again" in answer
        for s in busy:
            s.close()
        busy.clear()
        deadline = time.monotonic() + 30
        while not _version_answers(port):
            assert time.monotonic() < deadline, "no client served after the busy connections closed"
            time.sleep(0.1)
        assert len(_cap_lines(log_path)) == 1
    finally:
        for s in busy:
            s.close()


@pytest.mark.parametrize("text", ["many", "0", "-3", "1.5"])
def test_a_cap_that_is_no_whole_number_is_a_sentence(monkeypatch, text):
    from jupyter_llama.config import ConfigError
    from jupyter_llama.server.connections import max_connections

    monkeypatch.setenv("JUPYTER_LLAMA_MAX_CONNECTIONS", text)
    with pytest.raises(ConfigError, match=r"JUPYTER_LLAMA_MAX_CONNECTIONS must be a whole number of at least 1 .*"
                                          + repr(text)):
        max_connections()


def test_the_cap_is_the_setting_or_what_the_descriptors_leave_room_for(monkeypatch):
    from jupyter_llama.server.connections import max_connections

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setenv("JUPYTER_LLAMA_MAX_CONNECTIONS", "10")
    assert max_connections() == 10
    monkeypatch.setenv("JUPYTER_LLAMA_MAX_CONNECTIONS", str(1 << 40))
    assert max_connections() == room_for_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft
