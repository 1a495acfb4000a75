"""llama.cpp RPC workers (``ggml-rpc-server``) as devices: endpoints, ids and a memory probe.

A worker serves one or more ggml devices over TCP; ``llama-server --rpc HOST:PORT,...``
uses each of its devices as a GPU. This module asks a worker what it has, speaking the
worker's own wire protocol (ggml-rpc, protocol 7 on the pinned llama.cpp b11434):

* a request is ``cmd (1 byte) | payload size (u64, little endian) | payload``; a reply is
  ``payload size (u64) | payload``;
* the first command on a connection must be HELLO (14) with a 24-byte capabilities block
  (all zero: plain TCP); the reply is ``major, minor, patch, pad`` and 24 bytes of the
  worker's capabilities;
* DEVICE_COUNT (15, empty payload) answers a u32; GET_DEVICE_MEMORY (11, payload u32
  device index) answers ``free, total`` as two u64.

Two facts of the worker shape everything the scheduler does with it (measured, and visible
in ``tools/rpc`` of llama.cpp): **a worker serves one client at a time** (it accepts the
next connection only when the current one closes), and a ``llama-server`` keeps its
connection for its whole life. So a worker in use by a child cannot be probed (a probe
would wait until that child exits: the probe gives up after ``timeout`` and reports the
worker as busy, never hangs), and two children can never share a worker. The scheduler
therefore gives each worker to at most one runner and probes only the free ones.

Device ids: ``rpc:HOST:PORT`` for a worker's first device, ``rpc:HOST:PORT/K`` for device
``K > 0`` of a worker started with several (``ggml-rpc-server -d A,B``). In llama-server's
log the devices are named ``RPC<n>`` with a global ``n`` and the endpoint as description,
while their buffers are labelled ``RPC<K>[HOST:PORT]`` with the index *within* the worker;
:func:`device_id` maps both to the same id.

ggml's RPC has no authentication and no encryption: anyone who can reach a worker's port
can run code on its device and read its memory. Bind workers to loopback or a private
network only.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from dataclasses import asdict, dataclass

from ..config import ConfigError

PROTO_MAJOR = 7
CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24
DEFAULT_PORT = 50052
PREFIX = "rpc:"

_ENDPOINT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})$")
_ID_RE = re.compile(r"^rpc:(?P<endpoint>.+?)(?:/(?P<index>\d+))?$", re.I)


class WorkerError(OSError):
    """A worker could not be asked; the message says what happened, for a person."""


def parse_endpoint(text: str, what: str = "RPC worker") -> str:
    """``HOST:PORT`` checked and normalised (host lower-cased); raises :class:`ConfigError`."""
    t = text.strip()
    if t.lower().startswith(PREFIX):
        t = t[len(PREFIX):]
    m = _ENDPOINT_RE.match(t)
    if not m or not 0 < int(m.group("port")) < 65536:
        raise ConfigError(f"{what}: {text.strip()!r} is not HOST:PORT (for example 127.0.0.1:{DEFAULT_PORT})")
    return f"{m.group('host').lower()}:{int(m.group('port'))}"


def parse_workers(text: str | None, what: str = "JUPYTER_LLAMA_RPC_WORKERS") -> tuple[str, ...]:
    """``"host:port,host:port"`` -> endpoints in the order given (llama.cpp's device order)."""
    if not text or not text.strip():
        return ()
    out: list[str] = []
    for item in text.split(","):
        if not item.strip():
            continue
        ep = parse_endpoint(item, what)
        if ep in out:
            raise ConfigError(f"{what}: {ep} is listed twice")
        out.append(ep)
    return tuple(out)


def device_id(endpoint: str, index: int = 0) -> str:
    return f"{PREFIX}{endpoint}" + (f"/{index}" if index else "")


def split_id(dev: str) -> tuple[str, int] | None:
    """``"rpc:127.0.0.1:50052/1"`` -> ``("127.0.0.1:50052", 1)``; None for other devices."""
    m = _ID_RE.match(dev)
    if not m:
        return None
    return m.group("endpoint").lower(), int(m.group("index") or 0)


def endpoint_of(dev: str) -> str:
    """The worker endpoint of ``dev``, which the caller knows to be an RPC device id."""
    parts = split_id(dev)
    assert parts is not None, dev
    return parts[0]


def is_rpc(dev: str) -> bool:
    return dev.lower().startswith(PREFIX)


# --------------------------------------------------------------------------- the probe

@dataclass
class WorkerDevice:
    id: str  # rpc:HOST:PORT[/K]
    endpoint: str
    index: int
    total: int  # bytes, as the worker reports them (a CPU worker reports its host's memory)
    free: int


@dataclass
class WorkerStatus:
    """What one probe of a worker found."""

    endpoint: str
    reachable: bool
    devices: list[WorkerDevice]
    error: str | None = None  # why it is not usable, in words
    version: str | None = None  # the worker's RPC protocol, "7.0.0"
    probed_at: float = 0.0
    seconds: float = 0.0  # how long the probe took

    def to_dict(self) -> dict:
        return asdict(self)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise WorkerError("the worker closed the connection")
        buf += chunk
    return bytes(buf)


def _call(sock: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != reply_size:
        raise WorkerError(f"unexpected reply ({size} bytes where {reply_size} were expected): "
                          "is this a ggml-rpc-server of llama.cpp b11434?")
    return _recv_exact(sock, size)


def probe(endpoint: str, timeout: float = 2.0) -> WorkerStatus:
    """Ask the worker at ``endpoint`` for its devices and their memory. Never raises.

    ``timeout`` bounds every step; a worker that accepts the connection but does not answer
    within it is reported as busy (it serves one client at a time) or wedged.
    """
    t0 = time.monotonic()
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")

    def result(ok: bool, devices=(), error=None, version=None) -> WorkerStatus:
        return WorkerStatus(endpoint, ok, list(devices), error, version, time.time(), time.monotonic() - t0)

    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return result(False, error=f"connection refused: no worker is listening on {endpoint}")
    except socket.timeout:
        return result(False, error=f"no answer from {endpoint} within {timeout:g}s (host down or port filtered)")
    except OSError as e:
        return result(False, error=f"cannot connect to {endpoint}: {e.strerror or e}")
    try:
        with sock:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = _call(sock, CMD_HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE)
            except socket.timeout:
                return result(False, error=f"{endpoint} accepts connections but did not answer within {timeout:g}s: "
                              "a worker serves one client at a time, so another llama-server is probably using it "
                              "(or the worker is stopped)")
            major, minor, patch = hello[0], hello[1], hello[2]
            version = f"{major}.{minor}.{patch}"
            if major != PROTO_MAJOR:
                return result(False, error=f"{endpoint} speaks RPC protocol {version}; this engine needs "
                              f"{PROTO_MAJOR}.x: run the worker from the same llama.cpp build "
                              "(jupyter-llama worker)", version=version)
            (count,) = struct.unpack("<I", _call(sock, CMD_DEVICE_COUNT, b"", 4))
            devices = []
            for k in range(count):
                free, total = struct.unpack("<QQ", _call(sock, CMD_GET_DEVICE_MEMORY, struct.pack("<I", k), 16))
                devices.append(WorkerDevice(device_id(endpoint, k), endpoint, k, int(total), int(free)))
            if not devices:
                return result(False, error=f"{endpoint} serves no device", version=version)
            return result(True, devices, version=version)
    except socket.timeout:
        return result(False, error=f"{endpoint} stopped answering in the middle of a probe ({timeout:g}s)")
    except (WorkerError, OSError) as e:
        return result(False, error=f"{endpoint}: {e}")


def listening(endpoint: str, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at ``endpoint`` (cheap; asks nothing)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False
