"""What memory the manager may plan with: host RAM, NVIDIA GPUs and the user's budgets.

* :func:`list_gpus` asks NVML (the ``pynvml`` module from nvidia-ml-py) for every visible
  NVIDIA GPU. No library, no driver, no GPU or any NVML error gives ``[]``; it never raises.
* :func:`read_host_memory` reads ``/proc/meminfo`` and caps it by the memory cgroup (v2 or
  v1) the process lives in, so a container or JupyterHub limit is what the scheduler sees.
* :class:`Budgets` holds ``JUPYTER_LLAMA_MEMORY_LIMIT`` (what all of the manager's runners
  together may use per device) and ``JUPYTER_LLAMA_GPU_OVERHEAD`` (bytes kept free on every
  GPU, like Ollama's ``OLLAMA_GPU_OVERHEAD``).
* :func:`inventory` puts the three together; :meth:`DeviceState.usable` is the figure the
  scheduler plans with before it subtracts what its own runners already use.

Device ids are the canonical ones of :mod:`jupyter_llama.memory.report`: ``"cpu"`` and
``"cuda:0"``, ``"cuda:1"``, ... GPUs are numbered as CUDA numbers them for a child started
from this environment: ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) picks and orders them;
without it the NVML order (PCI bus order) is used, which matches CUDA unless
``CUDA_DEVICE_ORDER`` is left at its default on a machine with mixed GPU models.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Collection, Mapping

from ..config import ENV_PREFIX, ConfigError, parse_size
from . import rpc
from .report import HOST, format_bytes, render_table

MEMORY_LIMIT_VAR = ENV_PREFIX + "MEMORY_LIMIT"
GPU_OVERHEAD_VAR = ENV_PREFIX + "GPU_OVERHEAD"
RPC_WORKERS_VAR = ENV_PREFIX + "RPC_WORKERS"

ALL_DEVICES = "*"
ALL_GPUS = "gpu"

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number
# (9223372036854771712); anything this large is no limit at all.
_CGROUP_UNLIMITED = 1 << 60


class HostMemoryError(OSError):
    """``/proc/meminfo`` exists but cannot be understood; the message names the file."""


# --------------------------------------------------------------------------- GPUs

@dataclass
class GPU:
    index: int  # CUDA ordinal as a child started from this environment sees it
    id: str  # "cuda:0"
    name: str
    uuid: str
    total: int  # bytes
    free: int
    used: int


# Why the last list_gpus() call found nothing (for `jupyter-llama devices`); None after success.
last_gpu_error: str | None = None


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _visible_selection(environ: Mapping[str, str]) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries, or None when it is unset.

    CUDA stops at the first entry it cannot understand, so the list stops there too;
    an empty value hides every GPU.
    """
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    out: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            break
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            out.append(entry)
        else:
            break
    return out


_nvml_library_missing: object = None  # the pynvml module that could not find its library


def list_gpus(environ: Mapping[str, str] | None = None) -> list[GPU]:
    """NVIDIA GPUs with their memory, via NVML; ``[]`` when there are none or NVML fails.

    ``environ`` (default ``os.environ``) supplies ``CUDA_VISIBLE_DEVICES``. Never raises.
    """
    global last_gpu_error
    environ = os.environ if environ is None else environ
    try:
        import pynvml  # lazily: importing this module must work without the library
    except Exception as exc:  # ImportError, or a broken install
        last_gpu_error = f"pynvml is not importable ({exc})"
        return []
    global _nvml_library_missing
    if _nvml_library_missing is pynvml:  # no libnvidia-ml: it will not appear while we run; don't retry
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError: no driver, no libnvidia-ml, no device
        last_gpu_error = f"NVML could not start ({exc})"
        missing = getattr(pynvml, "NVMLError_LibraryNotFound", None)
        if missing is not None and isinstance(exc, missing):
            _nvml_library_missing = pynvml
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = []  # (handle, uuid) in CUDA order
        all_handles = []  # in NVML order
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            all_handles.append((h, _text(pynvml.nvmlDeviceGetUUID(h))))
        selection = _visible_selection(environ)
        if selection is None:
            handles = all_handles
        else:
            for entry in selection:
                if entry.isdigit():
                    i = int(entry)
                    if i >= len(all_handles):
                        break  # CUDA ignores this entry and everything after it
                    handles.append(all_handles[i])
                elif entry.startswith("MIG-"):
                    h = pynvml.nvmlDeviceGetHandleByUUID(entry)
                    handles.append((h, _text(pynvml.nvmlDeviceGetUUID(h))))
                else:  # "GPU-<uuid prefix>"
                    matches = [hu for hu in all_handles if hu[1].startswith(entry)]
                    if len(matches) != 1:
                        break
                    handles.append(matches[0])
        gpus = []
        for n, (h, uuid) in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GPU(index=n, id=f"cuda:{n}", name=_text(pynvml.nvmlDeviceGetName(h)), uuid=uuid,
                            total=int(mem.total), free=int(mem.free), used=int(mem.used)))
        last_gpu_error = None if gpus else "NVML reports no visible GPU"
        return gpus
    except Exception as exc:
        last_gpu_error = f"NVML query failed ({exc})"
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# --------------------------------------------------------------------------- host memory

@dataclass
class HostMemory:
    total: int  # bytes, already capped by the cgroup limit
    available: int  # bytes, already capped by limit - usage
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None


def _read(path: Path) -> str | None:
    # os.read, not open(): the files are small and made by the kernel as they are read, and a
    # file object costs more than the read (a scheduler's fit reads six of them per decision)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks).decode()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


_MEMINFO_LINE = re.compile(r"^(MemTotal|MemAvailable|MemFree|Buffers|Cached):[ \t]*(\d+)[ \t]*(\w*)", re.M)


def _parse_meminfo(text: str, path: Path) -> tuple[int, int]:
    values = {key: int(number) * 1024 if unit.lower() == "kb" else int(number)
              for key, number, unit in _MEMINFO_LINE.findall(text)}
    total = values.get("MemTotal")
    if not total or total <= 0:
        raise HostMemoryError(f"{path}: no usable MemTotal line; cannot tell how much host memory there is")
    available = values.get("MemAvailable")
    if available is None:  # kernels before 3.14: estimate as free + reclaimable caches
        parts = [values.get(k) for k in ("MemFree", "Buffers", "Cached")]
        if parts[0] is None:
            raise HostMemoryError(f"{path}: neither MemAvailable nor MemFree is readable")
        available = sum(p or 0 for p in parts)
    return total, max(0, min(available, total))


def _sysconf_memory() -> tuple[int, int] | None:
    """Total and available host memory where there is no /proc (macOS, BSD)."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None
    if total <= 0:
        return None
    try:
        return total, min(total, os.sysconf("SC_AVPHYS_PAGES") * page)
    except (ValueError, OSError):
        pass
    try:  # macOS: free + inactive + speculative + purgeable pages can be had at once
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return total, total
    m = re.search(r"page size of (\d+) bytes", out)
    vm_page = int(m.group(1)) if m else page
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        m = re.search(rf"^{key}:\s+(\d+)", out, re.M)
        if m:
            pages += int(m.group(1))
    return total, (min(total, pages * vm_page) if pages else total)


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and v1 memory-controller path from /proc/self/cgroup."""
    text = _read(root / "proc/self/cgroup")
    v2 = v1 = None
    for line in (text or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _candidate_dirs(base: Path, rel: str | None) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the mount point, deepest first.

    The effective limit is the smallest along that chain. When the path does not exist under
    the mount (a v1 container without a cgroup namespace shows the host's path), only the
    mount point itself is used.
    """
    dirs: list[Path] = []
    if rel:
        parts = [p for p in rel.strip("/").split("/") if p and p not in (".", "..")]
        if parts and (base.joinpath(*parts)).is_dir():
            for i in range(len(parts), 0, -1):
                dirs.append(base.joinpath(*parts[:i]))
    dirs.append(base)
    return dirs


def _inactive_file(stat_path: Path, keys: tuple[str, ...]) -> int:
    text = _read(stat_path) or ""
    for key in keys:
        m = re.search(rf"^{key}\s+(\d+)\s*$", text, re.M)
        if m:
            return int(m.group(1))
    return 0


def _cgroup_limit(root: Path) -> tuple[int, int | None, int] | None:
    """(limit, usage, reclaimable) of the tightest memory cgroup limit, or None without one."""
    v2_rel, v1_rel = _cgroup_paths(root)
    best: tuple[int, int | None, int] | None = None

    v2_base = root / "sys/fs/cgroup"
    for d in _candidate_dirs(v2_base, v2_rel):
        raw = _read(d / "memory.max")
        if raw is None:
            continue
        raw = raw.strip()
        if raw == "max":
            continue
        try:
            limit = int(raw)
        except ValueError:
            continue
        if limit >= _CGROUP_UNLIMITED:
            continue
        if best is None or limit < best[0]:
            best = (limit, _read_int(d / "memory.current"), _inactive_file(d / "memory.stat", ("inactive_file",)))
    if best is not None:
        return best

    v1_base = root / "sys/fs/cgroup/memory"
    for d in _candidate_dirs(v1_base, v1_rel):
        cap = _read_int(d / "memory.limit_in_bytes")
        if cap is None or cap >= _CGROUP_UNLIMITED:
            continue
        if best is None or cap < best[0]:
            best = (cap, _read_int(d / "memory.usage_in_bytes"),
                    _inactive_file(d / "memory.stat", ("total_inactive_file", "inactive_file")))
    return best


def read_host_memory(root: str | Path = "/") -> HostMemory:
    """Host memory under ``root`` (``/`` normally; a fake tree in tests), capped by the cgroup.

    ``total`` and ``available`` come from ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``;
    free + buffers + cached on kernels without ``MemAvailable``). When a memory cgroup limit
    is set (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, the smallest along this
    process's cgroup and its ancestors), ``total = min(total, limit)`` and
    ``available = min(available, limit - usage)``, where usage leaves out the cgroup's
    inactive file cache (``inactive_file`` in ``memory.stat``), which the kernel reclaims
    before it kills anything. A missing ``/proc/meminfo`` on the real root (macOS) falls back
    to ``sysconf``; an unreadable one raises :class:`HostMemoryError`.
    """
    root = Path(root)
    path = root / "proc/meminfo"
    text = _read(path)
    if text is None:
        fallback = _sysconf_memory() if root == Path("/") else None
        if fallback is None:
            raise HostMemoryError(f"{path}: cannot be read; cannot tell how much host memory there is")
        total, available = fallback
    else:
        total, available = _parse_meminfo(text, path)

    found = _cgroup_limit(root)
    if found is None:
        return HostMemory(total=total, available=available)
    limit, usage, reclaimable = found
    total = min(total, limit)
    if usage is not None:
        working_set = max(0, usage - reclaimable)
        available = min(available, max(0, limit - working_set))
    available = min(available, total)
    return HostMemory(total=total, available=available, cgroup_limit=limit, cgroup_usage=usage)


# --------------------------------------------------------------------------- budgets

_DEVICE_RE = re.compile(r"^(cuda|vulkan|rocm|metal):?(\d+)$")
_LIMIT_HELP = ("write one size for every device (8GiB) or device=size pairs separated by commas "
               "(cuda:0=20GiB,cpu=6GiB); devices are cpu, gpu (every GPU and RPC worker), cuda:N, vulkan:N, "
               "rocm:N, metal:N, rpc:HOST:PORT")


def _normalise_device(name: str) -> str | None:
    n = name.strip().lower()
    if n in (HOST, ALL_GPUS, ALL_DEVICES):
        return n
    m = _DEVICE_RE.match(n)
    if m:
        return f"{m.group(1)}:{int(m.group(2))}"
    if rpc.is_rpc(n):
        parts = rpc.split_id(n)
        if parts is None:
            return None
        try:
            return rpc.device_id(rpc.parse_endpoint(parts[0]), parts[1])
        except ConfigError:
            return None
    return None


def parse_memory_limit(text: str | None, what: str = MEMORY_LIMIT_VAR) -> dict[str, int]:
    """Budgets from ``"8GiB"`` (every device: key ``"*"``) or ``"cuda:0=20GiB,cpu=6GiB"``.

    ``gpu=...`` gives every GPU the same budget (key ``"gpu"``); ``CUDA0`` is read as
    ``cuda:0``. Empty or None gives ``{}``. Errors name ``what`` and say what to write.
    """
    if text is None or not str(text).strip():
        return {}
    text = str(text).strip()
    if "=" not in text:
        if "," in text:
            raise ConfigError(f"{what}: {text!r} lists several sizes without devices; {_LIMIT_HELP}")
        return {ALL_DEVICES: parse_size(text, what)}
    out: dict[str, int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, size = item.partition("=")
        if not sep or not name.strip() or not size.strip():
            raise ConfigError(f"{what}: {item!r} is not device=size; {_LIMIT_HELP}")
        device = _normalise_device(name)
        if device is None:
            raise ConfigError(f"{what}: unknown device {name.strip()!r}; {_LIMIT_HELP}")
        if device in out:
            raise ConfigError(f"{what}: {device} is given more than once in {text!r}")
        out[device] = parse_size(size.strip(), f"{what} ({device})")
    if not out:
        raise ConfigError(f"{what}: {text!r} names no device; {_LIMIT_HELP}")
    return out


def _limit_label(key: str) -> str:
    return {ALL_DEVICES: "every device", ALL_GPUS: "every GPU"}.get(key, key)


@dataclass
class Budgets:
    """What the manager (all of its runners together) may use per device."""

    limits: dict[str, int] = field(default_factory=dict)  # device id, "gpu" or "*" -> bytes
    gpu_overhead: int = 0  # bytes kept free on every GPU
    limits_source: str = ""  # where limits came from, e.g. "JUPYTER_LLAMA_MEMORY_LIMIT"
    overhead_source: str = ""

    def limit_for(self, device: str) -> int | None:
        """The budget for ``device``: its own entry, else ``gpu`` (for GPUs), else ``*``."""
        if device in self.limits:
            return self.limits[device]
        if device != HOST and ALL_GPUS in self.limits:
            return self.limits[ALL_GPUS]
        return self.limits.get(ALL_DEVICES)

    def describe(self) -> str:
        def order(k: str):
            return ({ALL_DEVICES: 0, HOST: 1, ALL_GPUS: 2}.get(k, 3), k)

        if self.limits:
            ordered = sorted(self.limits.items(), key=lambda kv: order(kv[0]))
            parts = ", ".join(f"{_limit_label(k)} {format_bytes(v)}" for k, v in ordered)
            limits = f"memory budgets: {parts}" + (f" (from {self.limits_source})" if self.limits_source else "")
        else:
            limits = f"memory budgets: none (set {MEMORY_LIMIT_VAR}, e.g. 8GiB or cuda:0=20GiB,cpu=6GiB)"
        if self.gpu_overhead:
            overhead = f"GPU overhead: {format_bytes(self.gpu_overhead)} kept free per GPU" + (
                f" (from {self.overhead_source})" if self.overhead_source else "")
        else:
            overhead = "GPU overhead: none"
        return f"{limits}; {overhead}"

    def to_dict(self) -> dict:
        return {"limits": dict(self.limits), "gpu_overhead": self.gpu_overhead,
                "limits_source": self.limits_source, "overhead_source": self.overhead_source}


def budgets_from(limit_text: str | None, overhead_text: str | None, limit_source: str = MEMORY_LIMIT_VAR,
                 overhead_source: str = GPU_OVERHEAD_VAR) -> Budgets:
    """Budgets from a memory-limit text and a GPU-overhead size; the sources name the setting
    they came from (an environment variable or a LlamaExtension trait) in messages."""
    limits = parse_memory_limit(limit_text or None, limit_source)
    overhead = parse_size(overhead_text.strip(), overhead_source) if overhead_text and overhead_text.strip() else 0
    return Budgets(limits=limits, gpu_overhead=overhead,
                   limits_source=limit_source if limits else "",
                   overhead_source=overhead_source if overhead else "")


def budgets_from_env(environ: Mapping[str, str] | None = None) -> Budgets:
    """Budgets from ``JUPYTER_LLAMA_MEMORY_LIMIT`` and ``JUPYTER_LLAMA_GPU_OVERHEAD``."""
    environ = os.environ if environ is None else environ
    return budgets_from(environ.get(MEMORY_LIMIT_VAR), environ.get(GPU_OVERHEAD_VAR))


# --------------------------------------------------------------------------- inventory

@dataclass
class DeviceState:
    """One row of the inventory the scheduler uses."""

    id: str
    name: str
    total: int
    free: int  # GPUs: what the driver reports free; cpu: available host memory
    budget: int | None
    overhead: int = 0  # kept free on GPUs (JUPYTER_LLAMA_GPU_OVERHEAD)
    kind: str = "gpu"  # "host", "gpu" or "rpc"
    reachable: bool = True  # RPC workers: whether the last probe got an answer
    error: str | None = None  # RPC workers: why not, in words
    held_by: str | None = None  # RPC workers: the model whose runner holds the worker's connection

    @property
    def usable(self) -> int:
        """What the manager may plan with here, before subtracting its own runners."""
        if not self.reachable:
            return 0
        room = self.free - (self.overhead if self.id != HOST else 0)
        if self.budget is not None:
            room = min(room, self.budget)
        return max(0, room)

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "kind": self.kind, "total": self.total, "free": self.free,
                "budget": self.budget, "overhead": self.overhead, "usable": self.usable,
                "reachable": self.reachable, "error": self.error, "held_by": self.held_by}


@dataclass
class Inventory:
    host: HostMemory
    gpus: list[GPU]
    budgets: Budgets
    gpu_error: str | None = None  # why no GPU was found, when none was
    workers: list[rpc.WorkerStatus] = field(default_factory=list)  # RPC workers, in the configured order
    held: dict[str, str] = field(default_factory=dict)  # worker endpoint -> model holding it (not probed)

    def devices(self) -> list[DeviceState]:
        """Host memory first, then the accelerators in llama.cpp's device order."""
        name = "host memory" + (" (cgroup limit)" if self.host.cgroup_limit is not None
                                and self.host.cgroup_limit <= self.host.total else "")
        rows = [DeviceState(HOST, name, self.host.total, self.host.available, self.budgets.limit_for(HOST),
                            kind="host")]
        return rows + self.accelerators(include_unusable=True)

    def accelerators(self, include_unusable: bool = False) -> list[DeviceState]:
        """Devices a child can offload layers to, in the order llama.cpp numbers them: RPC
        workers first (llama.cpp puts them at the front of its device list), then local GPUs.

        Without ``include_unusable``, workers that are unreachable or held by a runner are
        left out: a worker serves one client at a time.
        """
        rows: list[DeviceState] = []
        for w in self.workers:
            holder = self.held.get(w.endpoint)
            if w.devices:
                for d in w.devices:
                    label = f"RPC worker {w.endpoint}" + (f" device {d.index}" if d.index else "")
                    rows.append(DeviceState(d.id, label,
                                            d.total, d.free, self.budgets.limit_for(d.id), kind="rpc",
                                            reachable=w.reachable, error=w.error, held_by=holder))
            else:
                rows.append(DeviceState(rpc.device_id(w.endpoint), f"RPC worker {w.endpoint}", 0, 0,
                                        self.budgets.limit_for(rpc.device_id(w.endpoint)), kind="rpc",
                                        reachable=False, error=w.error, held_by=holder))
        if not include_unusable:
            rows = [r for r in rows if r.reachable and r.held_by is None]
        for g in self.gpus:
            rows.append(DeviceState(g.id, g.name, g.total, g.free, self.budgets.limit_for(g.id),
                                    overhead=self.budgets.gpu_overhead))
        return rows

    def device(self, id: str) -> DeviceState | None:
        for d in self.devices():
            if d.id == id:
                return d
        return None

    def unknown_budget_devices(self) -> list[str]:
        """Devices named in the budgets that this machine does not have."""
        known = {d.id for d in self.devices()}
        return sorted(k for k in self.budgets.limits if k not in known and k not in (ALL_DEVICES, ALL_GPUS))

    def to_dict(self) -> dict:
        return {"host": asdict(self.host), "gpus": [asdict(g) for g in self.gpus],
                "workers": [w.to_dict() for w in self.workers], "held": dict(self.held),
                "budgets": self.budgets.to_dict(), "gpu_error": self.gpu_error,
                "devices": [d.to_dict() for d in self.devices()]}


def workers_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``JUPYTER_LLAMA_RPC_WORKERS`` (``host:port,host:port``) as endpoints."""
    environ = os.environ if environ is None else environ
    return rpc.parse_workers(environ.get(RPC_WORKERS_VAR), RPC_WORKERS_VAR)


def probe_workers(endpoints, skip: Collection[str] = (),
                  known: Mapping[str, rpc.WorkerStatus] | None = None, timeout: float = 2.0) -> list[rpc.WorkerStatus]:
    """Probe every worker not in ``skip``, in parallel threads (each probe is bounded by
    ``timeout``). A skipped worker (one a runner holds would answer only after it exits) is
    not asked: its last known status from ``known`` stands in, or an empty one."""
    import concurrent.futures

    known = known or {}
    todo = [ep for ep in endpoints if ep not in skip]
    found: dict[str, rpc.WorkerStatus] = {}
    if todo:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            for st in pool.map(lambda ep: rpc.probe(ep, timeout), todo):
                found[st.endpoint] = st
    out = []
    for ep in endpoints:
        if ep in found:
            out.append(found[ep])
        else:
            last = known.get(ep)
            out.append(rpc.WorkerStatus(ep, True, list(last.devices) if last else [], None,
                                        last.version if last else None, last.probed_at if last else 0.0))
    return out


def inventory(environ: Mapping[str, str] | None = None, root: str | Path = "/",
              workers: tuple[str, ...] | None = None) -> Inventory:
    """Host memory, GPUs, RPC workers and budgets as they are now (``environ`` defaults to
    ``os.environ``; ``workers`` to ``JUPYTER_LLAMA_RPC_WORKERS``)."""
    environ = os.environ if environ is None else environ
    budgets = budgets_from_env(environ)
    host = read_host_memory(root)
    gpus = list_gpus(environ)
    endpoints = workers_from_env(environ) if workers is None else workers
    return Inventory(host=host, gpus=gpus, budgets=budgets, gpu_error=None if gpus else last_gpu_error,
                     workers=probe_workers(endpoints))


def format_inventory(inv: Inventory) -> str:
    """The table ``jupyter-llama devices`` prints, with the budgets in force underneath."""
    rows = []
    notes = []
    for d in inv.devices():
        if d.kind == "rpc" and d.held_by:
            state = f"in use by {d.held_by}"
        elif d.kind == "rpc" and not d.reachable:
            state = "unreachable"
            notes.append(f"{d.id}: {d.error}")
        else:
            state = "ok"
        known = d.total > 0 or d.kind != "rpc"
        rows.append([d.id, d.name, format_bytes(d.total) if known else "?", format_bytes(d.free) if known else "?",
                     format_bytes(d.budget) if d.budget is not None else "-",
                     format_bytes(d.usable) if not d.held_by else "-", state])
    lines = [render_table(["device", "name", "total", "free", "budget", "usable", "state"], rows)]
    lines += notes
    if inv.host.cgroup_limit is not None:
        usage = format_bytes(inv.host.cgroup_usage) if inv.host.cgroup_usage is not None else "unknown"
        lines.append(f"host memory: cgroup limit {format_bytes(inv.host.cgroup_limit)}, cgroup usage {usage}")
    if not inv.gpus:
        lines.append("GPUs: none found" + (f" ({inv.gpu_error})" if inv.gpu_error else ""))
    lines.append(inv.budgets.describe())
    unknown = inv.unknown_budget_devices()
    if unknown:
        lines.append(f"note: {MEMORY_LIMIT_VAR} names {', '.join(unknown)}, which this machine does not have")
    return "\n".join(lines)
