"""llama.cpp's own memory projection, from ``llama-fit-params --fit-print on``.

``llama-fit-params`` (built beside ``llama-server``, :attr:`Engine.fit_params`) loads the model
and creates its context *without allocating anything* (``no_alloc``), asks libllama how much
each buffer would take (``llama_get_memory_breakdown``), and with ``--fit-print on`` prints one
line per device and one for host memory (``common_fit_print`` in ``common/fit.cpp``)::

    CUDA0 3904 512 304
    Host 281 0 24

The figures are MiB, rounded down: model weights, context (KV cache and recurrent state) and
compute buffer. They do not include the output buffer. We give them the same options flags
llama-server would get (:func:`fit_params_argv`); two differences remain, both llama.cpp's:

* ``llama-fit-params`` has no ``-kvu``. With automatic slots llama-server uses 4 slots and one
  unified cache; without ``-np`` the tool assumes 1 slot, whose cache has the same cells.
* The tool reserves its compute graph for ``n_batch`` output rows where llama-server reserves
  one per slot, so for large vocabularies its compute figure includes up to
  ``4 * n_vocab * n_ubatch`` bytes of logits that llama-server never allocates.

Failures (no binary, a model it cannot load, a timeout, output it does not recognise) give
``None`` and a logged warning, never an exception.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..load_options import LoadOptions, memory_args
from ..procs import child_environment
from .report import COMPUTE, HOST, KV, LLAMA_CPP, WEIGHTS, MemoryReport, MiB, device_of_backend
from .rpc import device_id

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0

# "<device> <model MiB> <context MiB> <compute MiB>", device "Host" for host memory
_LINE_RE = re.compile(r"^\s*(?P<dev>[A-Za-z][\w.\-]*)\s+(?P<model>\d+)\s+(?P<context>\d+)\s+(?P<compute>\d+)\s*$")


def fit_params_argv(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions) -> list[str]:
    """The ``llama-fit-params`` command line mirroring what llama-server gets for ``options``."""
    return [str(binary), "--model", str(Path(model)), "--fit-print", "on", *memory_args(options)]


_RPC_NAME_RE = re.compile(r"^RPC(\d+)$", re.IGNORECASE)


def parse_fit_print(text: str, rpc: tuple[str, ...] | list[str] = ()) -> MemoryReport | None:
    """The per-device lines of ``--fit-print on`` output as a MemoryReport (source
    ``llama.cpp``), or None when there are none. Log lines mixed in are ignored. The tool
    names RPC devices by number alone (``RPC0``): with ``rpc``, the ``--rpc`` endpoints in
    their order, the K-th is the worker at ``rpc[K]`` (a worker of one device each, as
    ``jupyter-llama worker`` serves), as everything else names it."""
    rep = MemoryReport(LLAMA_CPP)
    found = False
    for line in text.splitlines():
        m = _LINE_RE.match(line)
        if not m:
            continue
        name = m.group("dev")
        numbered = _RPC_NAME_RE.match(name)
        if numbered and int(numbered.group(1)) < len(rpc):
            dev = device_id(rpc[int(numbered.group(1))])
        else:
            dev = HOST if name.lower() == "host" else device_of_backend(name)
        found = True
        rep.set(dev, WEIGHTS, rep.get(dev, WEIGHTS) + int(m.group("model")) * MiB)
        rep.set(dev, KV, rep.get(dev, KV) + int(m.group("context")) * MiB)
        rep.set(dev, COMPUTE, rep.get(dev, COMPUTE) + int(m.group("compute")) * MiB)
    if not found:
        return None
    rep.warnings.append("llama-fit-params rounds each figure down to whole MiB and leaves out the output buffer")
    return rep


@dataclass
class FitParamsResult:
    """What one run gave: the report (None on failure), and why not."""

    report: MemoryReport | None
    argv: list[str]
    error: str | None = None
    returncode: int | None = None
    stderr_tail: list[str] = field(default_factory=list)


def _finish(argv: list[str], rc: int | None, out: str, err: str, rpc=()) -> FitParamsResult:
    tail = [ln for ln in err.splitlines() if ln.strip()][-10:]
    if rc != 0:
        why = next((ln for ln in reversed(tail) if "error" in ln.lower() or "failed" in ln.lower()), None)
        return FitParamsResult(None, argv, f"llama-fit-params exited with code {rc}" + (f": {why.strip()}" if why else ""),
                               rc, tail)
    rep = parse_fit_print(out, rpc)
    if rep is None:
        return FitParamsResult(None, argv, "llama-fit-params printed no memory figures", rc, tail)
    return FitParamsResult(rep, argv, None, rc, tail)


def run_fit_params(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions,
                   timeout: float = DEFAULT_TIMEOUT) -> FitParamsResult:
    """Run the tool and parse it (blocking). Never raises."""
    try:
        argv = fit_params_argv(binary, model, options)
    except Exception as e:  # pragma: no cover - defensive
        return FitParamsResult(None, [], f"cannot build the command line: {e}")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", env=child_environment(), start_new_session=True)
    except OSError as e:
        return FitParamsResult(None, argv, f"cannot run {argv[0]}: {e.strerror or e}")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        return FitParamsResult(None, argv, f"llama-fit-params did not finish within {timeout:.0f}s")
    except BaseException:
        if proc.poll() is None:
            _kill_group(proc.pid)
        proc.communicate()
        raise
    return _finish(argv, proc.returncode, out, err, options.rpc or ())


async def run_fit_params_async(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions,
                               timeout: float = DEFAULT_TIMEOUT) -> FitParamsResult:
    """:func:`run_fit_params` on the event loop (the child is killed on timeout or
    cancellation). Never raises, except the cancellation itself."""
    try:
        argv = fit_params_argv(binary, model, options)
    except Exception as e:  # pragma: no cover - defensive
        return FitParamsResult(None, [], f"cannot build the command line: {e}")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=child_environment(), start_new_session=True)
    except OSError as e:
        return FitParamsResult(None, argv, f"cannot run {argv[0]}: {e.strerror or e}")
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        _kill(proc)
        await proc.wait()
        return FitParamsResult(None, argv, f"llama-fit-params did not finish within {timeout:.0f}s")
    except BaseException:
        _kill(proc)
        await proc.wait()
        raise
    return _finish(argv, proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                   options.rpc or ())


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        _kill_group(proc.pid)


def _kill_group(pid: int) -> None:
    """SIGKILL the tool and anything it started (it runs in a session of its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def project(binary: str | os.PathLike | None, model: str | os.PathLike, options: LoadOptions,
            timeout: float = DEFAULT_TIMEOUT) -> MemoryReport | None:
    """llama.cpp's projection for this load, or None (with a logged warning)."""
    if not binary:
        log.warning("no llama-fit-params beside the engine; llama.cpp's projection is unavailable")
        return None
    res = run_fit_params(binary, model, options, timeout)
    if res.report is None:
        log.warning("llama.cpp's projection is unavailable: %s", res.error)
    return res.report


async def project_async(binary: str | os.PathLike | None, model: str | os.PathLike, options: LoadOptions,
                        timeout: float = DEFAULT_TIMEOUT) -> MemoryReport | None:
    """:func:`project` without blocking the event loop."""
    if not binary:
        log.warning("no llama-fit-params beside the engine; llama.cpp's projection is unavailable")
        return None
    res = await run_fit_params_async(binary, model, options, timeout)
    if res.report is None:
        log.warning("llama.cpp's projection is unavailable: %s", res.error)
    return res.report
