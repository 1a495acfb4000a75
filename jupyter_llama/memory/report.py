"""One memory type for every source: predictions and what llama.cpp actually allocated.

A :class:`MemoryReport` is a table of bytes indexed by (device, component). Devices use
canonical ids: ``"cpu"`` for host memory, ``"cuda:0"``, ``"vulkan:0"``, ``"rocm:0"``,
``"metal:0"`` for accelerators, ``"rpc:HOST:PORT"`` for llama.cpp RPC workers. Components are
the kinds of buffer llama.cpp allocates.
Estimators, the log parser, plots, ``ps`` and the scheduler all speak this type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from .rpc import device_id

WEIGHTS = "weights"
KV = "kv"
COMPUTE = "compute"
OUTPUT = "output"
RS = "rs"  # recurrent state (Mamba-style models)
OTHER = "other"  # batch surcharge and anything a source cannot attribute
COMPONENTS = (WEIGHTS, KV, COMPUTE, OUTPUT, RS, OTHER)

HOST = "cpu"

# Sources, in the order plots and tables show them.
COARSE = "coarse"
DETAILED = "detailed"
LLAMA_CPP = "llama.cpp"
ACTUAL = "actual"
SOURCES = (COARSE, DETAILED, LLAMA_CPP, ACTUAL)

MiB = 1024 * 1024
GiB = 1024 * MiB

_BACKEND_RE = re.compile(r"^(CUDA|ROCm|HIP|Vulkan|Metal|MTL|SYCL|MUSA|CANN|OpenCL)(\d*)(?:_(\w+))?$", re.I)
_RPC_BUFFER_RE = re.compile(r"^RPC(\d*)\[([^\]]+)\]")
_CANONICAL = {"mtl": "metal", "cuda": "cuda", "rocm": "rocm", "hip": "rocm", "vulkan": "vulkan", "metal": "metal",
              "sycl": "sycl", "musa": "musa", "cann": "cann", "opencl": "opencl"}


def device_of_backend(name: str) -> str:
    """Map a llama.cpp buffer-type name to the device whose memory it uses.

    ``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``BLAS`` and any ``*_Host`` buffer live in host
    memory; ``CUDA0`` and ``CUDA0_Mapped`` live on ``cuda:0``; ``RPC<K>[HOST:PORT]`` lives on
    device ``K`` of the RPC worker at ``HOST:PORT`` (``rpc:HOST:PORT``, or ``rpc:HOST:PORT/K``
    for ``K > 0``): ``K`` counts within that worker, so the endpoint decides, never the prefix.
    """
    name = name.strip()
    if not name:
        return HOST
    m = _RPC_BUFFER_RE.match(name)
    if m:
        return device_id(m.group(2).lower(), int(m.group(1) or 0))
    upper = name.upper()
    if upper.startswith("CPU") or upper == "BLAS" or upper.endswith("_HOST") or upper.startswith("AMX"):
        return HOST
    m = _BACKEND_RE.match(name)
    if not m:
        return HOST if upper.startswith("CPU") else name.lower()
    kind = _CANONICAL[m.group(1).lower()]
    index = int(m.group(2)) if m.group(2) else 0
    return f"{kind}:{index}"


def is_gpu(device: str) -> bool:
    return device != HOST


def format_pct(value: float, decimals: int = 0) -> str:
    """A signed percentage, with no "-0%" or "+0%" when it rounds to nothing."""
    text = f"{value:+.{decimals}f}"
    if float(text) == 0:
        return f"{0:.{decimals}f}%"
    return text + "%"


def format_bytes(n: float) -> str:
    """Human-readable size: 1536 -> '1.5 KiB', 3 * GiB -> '3.00 GiB'."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{sign}{n / 1024:.1f} KiB"
    return f"{sign}{int(n)} B"


@dataclass
class MemoryReport:
    """Bytes per (device, component) from one source, plus what that source knows besides."""

    source: str
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    layers_offloaded: int | None = None  # N of "offloaded N/M layers"
    layers_total: int | None = None  # M (blocks + output layer)
    n_ctx: int | None = None  # context the source assumed or the child reported
    warnings: list[str] = field(default_factory=list)

    def add(self, device: str, component: str, nbytes: int | float) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"unknown memory component {component!r}; expected one of {COMPONENTS}")
        key = (device, component)
        self.bytes[key] = self.bytes.get(key, 0) + int(round(nbytes))

    def set(self, device: str, component: str, nbytes: int | float) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"unknown memory component {component!r}; expected one of {COMPONENTS}")
        self.bytes[(device, component)] = int(round(nbytes))

    def get(self, device: str, component: str) -> int:
        return self.bytes.get((device, component), 0)

    @property
    def devices(self) -> list[str]:
        """Devices with any bytes, host first, then accelerators in name order."""
        devs = {d for (d, _), v in self.bytes.items() if v}
        return sorted(devs, key=lambda d: (d != HOST, d))

    def total(self, device: str | None = None, component: str | None = None) -> int:
        return sum(v for (d, c), v in self.bytes.items()
                   if (device is None or d == device) and (component is None or c == component))

    def by_device(self) -> dict[str, int]:
        return {d: self.total(device=d) for d in self.devices}

    def by_component(self) -> dict[str, int]:
        return {c: self.total(component=c) for c in COMPONENTS if self.total(component=c)}

    @property
    def gpu_total(self) -> int:
        return sum(v for (d, _), v in self.bytes.items() if is_gpu(d))

    @property
    def host_total(self) -> int:
        return self.total(device=HOST)

    def scaled(self, factor: float, source: str | None = None) -> "MemoryReport":
        out = MemoryReport(source or self.source, layers_offloaded=self.layers_offloaded,
                           layers_total=self.layers_total, n_ctx=self.n_ctx, warnings=list(self.warnings))
        for k, v in self.bytes.items():
            out.bytes[k] = int(round(v * factor))
        return out

    def to_dict(self) -> dict:
        """JSON-ready form: ``{"source", "devices": {dev: {component: bytes}}, "total", ...}``."""
        devices: dict[str, dict[str, int]] = {}
        for (d, c), v in sorted(self.bytes.items()):
            devices.setdefault(d, {})[c] = v
        return {
            "source": self.source,
            "devices": devices,
            "total": self.total(),
            "layers_offloaded": self.layers_offloaded,
            "layers_total": self.layers_total,
            "n_ctx": self.n_ctx,
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryReport":
        rep = cls(data["source"], layers_offloaded=data.get("layers_offloaded"),
                  layers_total=data.get("layers_total"), n_ctx=data.get("n_ctx"),
                  warnings=list(data.get("warnings", [])))
        for d, comps in data.get("devices", {}).items():
            for c, v in comps.items():
                rep.set(d, c, v)
        return rep

    def table(self) -> str:
        """A small text table: one row per device, one column per component, in MiB."""
        comps = [c for c in COMPONENTS if self.total(component=c)] or [WEIGHTS]
        header = ["device", *comps, "total"]
        rows = [[d, *(f"{self.get(d, c) / MiB:.2f}" for c in comps), f"{self.total(device=d) / MiB:.2f}"]
                for d in self.devices]
        rows.append(["all", *(f"{self.total(component=c) / MiB:.2f}" for c in comps), f"{self.total() / MiB:.2f}"])
        return render_table(header, rows, title=f"{self.source} (MiB)")


def render_table(header: list[str], rows: Iterable[list], title: str | None = None) -> str:
    """Plain aligned text table (first column left, the rest right-aligned)."""
    rows = [[str(x) for x in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def fmt(cells):
        pairs = enumerate(zip(cells, widths, strict=False))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    lines = [title] if title else []
    lines.append(fmt([str(h) for h in header]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)
