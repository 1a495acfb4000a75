"""CUDA for the engine build: what GPU and driver this machine has, and a toolkit to compile for it.

Most machines with an NVIDIA GPU in a notebook server have the driver but no CUDA toolkit.
NVIDIA publishes the toolkit's parts on PyPI as wheels, and for CUDA 13 those wheels hold the
whole compiler (``nvcc``, ``cicc``, ``ptxas``, ``nvlink``, ``fatbinary``) beside the runtime,
cuBLAS and the CCCL headers, all under one ``nvidia/cu13/`` folder. (The CUDA 12 wheels hold
only ``ptxas`` and libNVVM, not ``nvcc``, so they cannot build llama.cpp.) This module:

* :func:`probe_gpus` asks NVML which driver, CUDA version and GPUs (with their compute
  capability) this machine has; nothing raises when there is no driver;
* :func:`system_toolkit` finds an installed toolkit (``CUDA_HOME``, ``CUDA_PATH``, ``nvcc`` on
  ``PATH``, ``/usr/local/cuda``) and says what it lacks, if anything;
* :func:`wheel_toolkit` installs the pinned wheels into a private prefix under the engine
  cache with pip and arranges them as the layout CMake's ``FindCUDAToolkit`` expects, with a
  driver stub library to link against (the real ``libcuda.so.1`` comes with the driver at run
  time, and only there);
* :func:`choose_toolkit` decides between the two and says why;
* :func:`cuda_archs` picks the GPU architectures to compile for: this machine's GPUs, else a
  documented default list, else what the user set.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .. import config

Progress = Callable[[str], None]

# NVIDIA's CUDA 13.0 wheels, pinned. 13.0 is the oldest CUDA 13: its binaries run on every
# driver of the R580 series and newer (CUDA's minor-version compatibility), and a newer 13.x
# toolkit would add nothing llama.cpp b11434 uses.
CUDA_VERSION = "13.0"
CUDA_WHEELS = (
    ("nvidia-cuda-nvcc", "13.0.88"),     # nvcc, ptxas, nvlink, fatbinary, cudafe++
    ("nvidia-nvvm", "13.0.88"),          # cicc and libNVVM, nvcc's device front end
    ("nvidia-cuda-crt", "13.0.88"),      # nvcc's crt/ headers
    ("nvidia-cuda-runtime", "13.0.96"),  # cudart and the runtime headers
    ("nvidia-cuda-cccl", "13.0.85"),     # CUB, Thrust, libcu++ headers
    ("nvidia-cublas", "13.0.2.14"),      # cuBLAS and cuBLASLt
    ("nvidia-cuda-nvrtc", "13.0.88"),    # loaded by cuBLASLt for some kernels
)
WHEEL_SUBDIR = "nvidia/cu13"
# CUDA 13 builds for Turing (7.5) and newer only.
MIN_COMPUTE = (7, 5)
# Compiled for when no GPU is here to ask (and JUPYTER_LLAMA_CUDA_ARCHS is not set): real
# machine code for Turing, Ampere (A100; RTX 30), Ada (RTX 40, L4, L40), Hopper (H100, H200),
# Blackwell (B200; RTX 50), and Ampere's PTX so that a newer GPU can still run it (the driver
# compiles PTX at start). Each architecture adds minutes to the build: a GPU machine builds
# for its own GPUs only.
DEFAULT_ARCHS = ("75-real", "80", "86-real", "89-real", "90-real", "100-real", "120-real")
# The runtime libraries a CUDA build of llama.cpp loads; linked beside the binaries.
RUNTIME_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13",
                "libnvrtc-builtins.so.13.0")


class CudaError(RuntimeError):
    """No way to build for CUDA here; the message says why and what to do."""


@dataclass
class Gpu:
    index: int
    name: str
    compute: tuple[int, int]
    memory_total: int


@dataclass
class GpuProbe:
    """What NVML says about this machine: empty ``gpus`` and an ``error`` where it has none."""

    driver: str = ""
    cuda: tuple[int, int] | None = None  # the newest CUDA the driver runs, e.g. (13, 0)
    gpus: list[Gpu] = field(default_factory=list)
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def probe_gpus() -> GpuProbe:
    """Driver, CUDA version and GPUs from NVML (``pynvml``); never raises."""
    try:
        import pynvml
    except Exception as exc:  # a broken install
        return GpuProbe(error=f"pynvml is not importable ({exc})")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no libnvidia-ml.so.1: no driver
        return GpuProbe(error=f"no NVIDIA driver here (NVML: {exc})")
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        v = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else str(name), (int(major), int(minor)),
                            int(pynvml.nvmlDeviceGetMemoryInfo(h).total)))
        return GpuProbe(driver=driver, cuda=(v // 1000, v % 1000 // 10), gpus=gpus)
    except Exception as exc:
        return GpuProbe(error=f"NVML failed ({exc})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def cuda_archs(probe: GpuProbe | None = None, setting: str | None = None) -> tuple[list[str], str]:
    """The CMake ``CUDA_ARCHITECTURES`` to build and where they came from.

    ``setting`` (or ``JUPYTER_LLAMA_CUDA_ARCHS``) is a list such as ``"86;90"`` or
    ``"89-real,90-real"``; else this machine's GPUs, each as real machine code; else
    :data:`DEFAULT_ARCHS`.
    """
    setting = setting or config.env("CUDA_ARCHS")
    if setting:
        archs = [a.strip() for a in re.split(r"[;,\s]+", setting) if a.strip()]
        bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?(-real|-virtual)?", a)]
        if bad or not archs:
            raise CudaError(f"CUDA architectures {setting!r} are not understood: give compute capabilities "
                            "without the dot, separated by ';' or ',', such as '86;90' (8.6 and 9.0), "
                            "optionally with -real or -virtual")
        low = [a for a in archs if int(leading(r"\d+", a)) < MIN_COMPUTE[0] * 10 + MIN_COMPUTE[1]]
        if low:
            raise CudaError(f"CUDA {CUDA_VERSION} cannot build for {', '.join(low)}: it supports compute "
                            f"capability {MIN_COMPUTE[0]}.{MIN_COMPUTE[1]} (Turing) and newer")
        return archs, "set by you"
    probe = probe if probe is not None else probe_gpus()
    if probe.gpus:
        caps = sorted({g.compute for g in probe.gpus})
        old = [g for g in probe.gpus if g.compute < MIN_COMPUTE]
        if len(old) == len(probe.gpus):
            raise CudaError(f"{old[0].name} has compute capability {old[0].compute[0]}.{old[0].compute[1]}; "
                            f"CUDA {CUDA_VERSION} builds for {MIN_COMPUTE[0]}.{MIN_COMPUTE[1]} and newer only. "
                            "Use the CPU engine, or a CUDA 12 toolkit installed on the system")
        names = ", ".join(sorted({g.name for g in probe.gpus if g.compute >= MIN_COMPUTE}))
        return [f"{a}{b}-real" for a, b in caps if (a, b) >= MIN_COMPUTE], f"this machine's GPUs ({names})"
    return list(DEFAULT_ARCHS), "the default list (no GPU to ask here)"


# ----------------------------------------------------------------------------- toolkits


@dataclass
class Toolkit:
    root: str  # holds bin/nvcc, include/, lib64/ (or targets/<arch>/...)
    nvcc: str
    version: str  # "13.0.88"
    source: str  # "system" or "wheels"
    lib_dir: str  # where cudart (and cuBLAS, unless cublas_dir says otherwise) live
    driver_stub: str | None = None  # a libcuda.so to link against where the toolkit has none
    cublas_dir: str | None = None  # pip-installed cuBLAS (``.../nvidia/cu13``) for a toolkit without it

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    def to_dict(self) -> dict:
        return asdict(self)


def toolkit_root() -> Path:
    return config.cache_dir() / "engine" / "toolkits"


def _nvcc_version(nvcc: str) -> str | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else None


def leading(pattern: str, text: str) -> str:
    """The start of ``text`` that ``pattern`` matches; the caller has checked that it does."""
    m = re.match(pattern, text)
    assert m is not None, (pattern, text)
    return m.group()


def _first(root: Path, *relative: str) -> Path | None:
    return next((root / r for r in relative if (root / r).exists()), None)


def _arch_dir() -> str:
    return {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}.get(os.uname().machine, os.uname().machine + "-linux")


def system_toolkit() -> tuple[Toolkit | None, str]:
    """An installed CUDA toolkit that can build llama.cpp, or None and why not."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    seen, problems = set(), []
    for nvcc in candidates:
        if not nvcc.is_file():
            continue
        version = _nvcc_version(str(nvcc))
        if version is None:
            problems.append(f"{nvcc} does not answer --version")
            continue
        # nvcc on PATH may be a wrapper script: ask nvcc itself where its toolkit is (its TOP).
        root = _toolkit_top(str(nvcc)) or nvcc.resolve().parent.parent
        if root in seen:
            continue
        seen.add(root)
        include = _first(root, "include", f"targets/{_arch_dir()}/include")
        libdir = _first(root, "lib64", "lib", f"targets/{_arch_dir()}/lib")
        if include is None or libdir is None or not (include / "cuda_runtime.h").is_file():
            problems.append(f"the CUDA {version} toolkit at {root} has no runtime headers or libraries")
            continue
        cublas_dir = None
        if not (include / "cublas_v2.h").is_file() or not any(libdir.glob("libcublas.so*")):
            # NVIDIA's cuBLAS wheel installed in this Python (PyTorch brings it) completes it.
            cublas_dir = next((d for d in python_cuda_dirs(int(version.split(".")[0]))
                               if (d / "include" / "cublas_v2.h").is_file() and any((d / "lib").glob("libcublas.so*"))),
                              None)
            if cublas_dir is None:
                problems.append(f"the CUDA {version} toolkit at {root} lacks cuBLAS, and this Python has no "
                                f"nvidia-cublas wheel for CUDA {version.split('.')[0]}")
                continue
        return Toolkit(root=str(root), nvcc=str(nvcc), version=version, source="system", lib_dir=str(libdir),
                       cublas_dir=str(cublas_dir) if cublas_dir else None), ""
    return None, "; ".join(problems) or "no nvcc on PATH, in CUDA_HOME or in /usr/local/cuda"


def python_cuda_dirs(major: int) -> list[Path]:
    """``nvidia/cu<major>`` folders of NVIDIA wheels installed in this Python's site-packages."""
    import site

    places = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    out: list[Path] = []
    for place in places:
        d = Path(place) / "nvidia" / f"cu{major}"
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def _toolkit_top(nvcc: str) -> Path | None:
    """The toolkit folder nvcc works from (``#$ TOP=...`` in its dry run)."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
    return Path(m.group(1).strip()).resolve() if m else None


def _driver_library() -> str | None:
    """The driver's ``libcuda.so`` if one is installed (a toolkit links against it)."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/local/nvidia/lib64"):
        p = Path(d) / "libcuda.so"
        if p.exists():
            return str(p)
    return None


def _wheel_key() -> str:
    return hashlib.sha256(repr(CUDA_WHEELS).encode()).hexdigest()[:8]


def wheel_toolkit(progress: Progress = print) -> Toolkit:
    """NVIDIA's pinned CUDA wheels, installed with pip into the engine cache and arranged as a toolkit.

    ``JUPYTER_LLAMA_CUDA_WHEELS`` may name a folder holding the same wheel files (a machine
    without network); pip then installs from there only.
    """
    from filelock import FileLock

    base = toolkit_root()
    base.mkdir(parents=True, exist_ok=True)
    prefix = base / f"cuda-{CUDA_VERSION}-{_wheel_key()}"
    root = prefix / WHEEL_SUBDIR
    stamp = prefix / "toolkit.json"
    with FileLock(str(base / f".{prefix.name}.lock")):
        if not stamp.is_file():
            if prefix.exists():
                shutil.rmtree(prefix)  # an install that did not finish
            _pip_install(prefix, progress)
            _arrange(root, progress)
            stamp.write_text(json.dumps({"cuda": CUDA_VERSION, "wheels": dict(CUDA_WHEELS),
                                         "nvcc": _nvcc_version(str(root / "bin" / "nvcc"))}, indent=2))
    version = json.loads(stamp.read_text()).get("nvcc") or CUDA_VERSION
    return Toolkit(root=str(root), nvcc=str(root / "bin" / "nvcc"), version=version, source="wheels",
                   lib_dir=str(root / "lib"), driver_stub=str(root / "lib" / "stubs" / "libcuda.so"))


def _pip_install(prefix: Path, progress: Progress) -> None:
    specs = [f"{name}=={version}" for name, version in CUDA_WHEELS]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
           "--target", str(prefix), *specs]
    local = config.env("CUDA_WHEELS")
    if local:
        if not Path(local).is_dir():
            raise CudaError(f"JUPYTER_LLAMA_CUDA_WHEELS={local!r} is not a folder")
        cmd[4:4] = ["--no-index", "--find-links", local]
    progress(f"installing NVIDIA's CUDA {CUDA_VERSION} wheels from "
             f"{'the folder ' + local if local else 'the package index'} into {prefix} "
             "(about 650 MB to download, 1.1 GB on disk; once per machine)")
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
        hint = ("" if local else ". Without network, download these wheels elsewhere (`pip download --no-deps "
                + " ".join(specs) + "`) and set JUPYTER_LLAMA_CUDA_WHEELS to their folder")
        raise CudaError("pip could not install the CUDA wheels: " + " | ".join(lines[-3:]) + hint)


def _arrange(root: Path, progress: Progress) -> None:
    """Give the wheels' ``nvidia/cu13`` folder the layout nvcc and FindCUDAToolkit expect."""
    if not (root / "bin" / "nvcc").is_file():
        raise CudaError(f"the CUDA wheels did not provide {root / 'bin' / 'nvcc'}")
    lib = root / "lib"
    (root / "lib64").symlink_to("lib")
    # nvcc.profile looks for headers and libraries under targets/<arch>/, as in NVIDIA's installer.
    targets = root / "targets" / _arch_dir()
    targets.mkdir(parents=True)
    (targets / "include").symlink_to("../../include")
    (targets / "lib").symlink_to("../../lib")
    # The wheels ship only versioned libraries; a linker asks for the unversioned names.
    for versioned in lib.glob("lib*.so.*"):
        plain = lib / (versioned.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(versioned.name)
    progress("making a libcuda.so stub to link against (the driver's own is used at run time)")
    make_driver_stub(root / "include" / "cuda.h", lib / "stubs")


def make_driver_stub(cuda_h: Path, dest: Path) -> Path:
    """A ``libcuda.so`` (soname ``libcuda.so.1``) that defines every driver function ``cuda.h``
    names, each returning CUDA_ERROR_STUB_LIBRARY: enough to link against, never loaded at run
    time (the binaries' run path does not include it; the driver's library is found instead)."""
    text = cuda_h.read_text(errors="replace")
    names = set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", text))
    names |= set(re.findall(r"^\s*#\s*define\s+cu[A-Z]\w*\s+(cu[A-Z]\w*)\s*$", text, re.M))
    functions = sorted(n for n in names if not n.endswith("_t"))
    if len(functions) < 100:
        raise CudaError(f"{cuda_h} names only {len(functions)} driver functions; it is not CUDA's cuda.h")
    dest.mkdir(parents=True, exist_ok=True)
    src = dest / "libcuda_stub.c"
    src.write_text("/* Generated by jupyter-llama from cuda.h: link-time stand-in for the driver. */\n"
                   + "".join(f"int {n}(void) {{ return 34; }}\n" for n in functions))
    out = dest / "libcuda.so"
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise CudaError("no C compiler to make the libcuda.so stub with (install build-essential)")
    proc = subprocess.run([cc, "-shared", "-fPIC", "-fno-builtin", "-w", "-Wl,-soname,libcuda.so.1", "-o", str(out),
                           str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CudaError(f"could not compile the libcuda.so stub: {proc.stderr.strip()[-300:]}")
    return out


@dataclass
class ToolkitChoice:
    toolkit: Toolkit
    reason: str
    probe: GpuProbe


def choose_toolkit(which: str = "auto", progress: Progress = print, probe: GpuProbe | None = None) -> ToolkitChoice:
    """The toolkit to build with: ``"system"``, ``"wheels"`` or ``"auto"`` (a complete system
    toolkit whose CUDA the driver runs, else the wheels)."""
    if which not in ("auto", "system", "wheels"):
        raise CudaError(f"unknown toolkit {which!r}: choose auto, system or wheels")
    probe = probe if probe is not None else probe_gpus()
    driver_cuda = probe.cuda
    if which in ("auto", "system"):
        tk, why_not = system_toolkit()
        if tk is not None and driver_cuda and tk.major > driver_cuda[0]:
            why_not = (f"the system toolkit is CUDA {tk.version}, newer than the driver's CUDA "
                       f"{driver_cuda[0]}.{driver_cuda[1]}")
            tk = None
        if tk is not None:
            libdir = Path(tk.lib_dir)
            if not (libdir / "stubs" / "libcuda.so").exists() and not _driver_library():
                # neither the toolkit's stub nor the driver's library to link against: make one
                include = _first(Path(tk.root), "include", f"targets/{_arch_dir()}/include")
                assert include is not None  # a toolkit is found by its headers
                tk.driver_stub = str(make_driver_stub(include / "cuda.h",
                                                      toolkit_root() / f"driver-stub-{tk.version}"))
            return ToolkitChoice(tk, f"the system's CUDA {tk.version} toolkit at {tk.root}", probe)
        if which == "system":
            raise CudaError(f"no usable system CUDA toolkit: {why_not}. Leave --toolkit out to use NVIDIA's wheels")
        progress(f"no usable system CUDA toolkit ({why_not}); using NVIDIA's CUDA {CUDA_VERSION} wheels")
    if driver_cuda and driver_cuda < (13, 0):
        raise CudaError(
            f"the NVIDIA driver {probe.driver} runs CUDA {driver_cuda[0]}.{driver_cuda[1]}, and the CUDA "
            f"{CUDA_VERSION} wheels need a driver of the R580 series or newer (CUDA 13). Update the driver, or "
            "install a CUDA 12 toolkit (Debian: apt-get install nvidia-cuda-toolkit; NVIDIA's CUDA 12 wheels "
            "on PyPI carry no nvcc) and run the build again")
    tk = wheel_toolkit(progress)
    driver = (f"driver {probe.driver}, CUDA {driver_cuda[0]}.{driver_cuda[1]}" if driver_cuda
              else "no driver here to ask")
    return ToolkitChoice(tk, f"NVIDIA's CUDA {tk.version} wheels ({driver})", probe)
