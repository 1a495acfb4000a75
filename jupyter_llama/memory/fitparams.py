"""llama.cpp's own memory projection, from ``llama-fit-params``, for the load llama-server makes.

``llama-fit-params`` (built beside ``llama-server``, :attr:`Engine.fit_params`) runs the same
``--fit`` code llama-server runs before it loads, and can print the memory of a placement:
it loads the model and creates its context *without allocating anything* (``no_alloc``) and
asks libllama how much each buffer would take (``llama_get_memory_breakdown``). So the
projection is made in two runs, as llama-server would place the load:

1. the fit (no ``--fit-print``): the same flags llama-server gets (:func:`fit_argv`: context,
   slots, batches, cache types, ``--rpc`` and the same ``--fit-target`` per device), and the
   tool prints the placement it chose, ``-c 2048 -ngl 7 -ts 2,5``. Skipped where llama-server
   does not fit (``-fit off``). Where --fit finds no placement, llama-server loads as asked,
   and so is the projection made;
2. the projection of that placement (``--fit-print on``, :func:`fit_params_argv`), one line
   per device and one for host memory (``common_fit_print``), and with ``--log-jsonl`` its
   memory breakdown, which also names the buffers of no device (``CPU_REPACK``)::

       RPC0 40 6 12
       Host 13 16 73
       {"type":"fit_memory_breakdown","data":{..."rows":[...{"kind":"buffer_type","name":"CPU_REPACK","model":40,...}]}}

   The figures are MiB, rounded down: model weights, context (KV cache and recurrent state)
   and compute buffer. The buffers of no device are host memory llama-server allocates
   (weights repacked for the CPU), so they count in the host's figures.

What it still counts differently from llama-server, which the report's notes say:

* it reserves its compute graph for a whole micro-batch of output rows (``n_ubatch``), where
  llama-server reserves one row per slot: its compute buffer on the device that holds the
  output layer can hold up to ``4 * n_vocab`` bytes a token of the micro-batch more (512 MiB
  for a 262k-token vocabulary at 512 tokens; :func:`logits_excess`);
* it leaves out the output buffer (logits of one row per slot, in host memory);
* with the model memory-mapped, llama-server's mapped buffer spans the file, so the weights
  the CPU repacks are in it as well as in ``CPU_REPACK``; the tool counts them once;
* its figures are whole MiB, rounded down;
* ``llama-fit-params`` has no ``-kvu``: with automatic slots llama-server uses 4 slots and one
  unified cache; without ``-np`` the tool assumes 1 slot, whose cache has the same cells.

Where these could move a device's figure by more than :data:`SHOWN_WITHIN` of it, the
projection is another load's, and it is not shown (:func:`withheld`).

Failures (no binary, a model it cannot load, a timeout, output it does not recognise) give
``None`` and a logged warning, never an exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..load_options import LoadOptions, memory_args
from ..procs import child_environment
from .report import COMPUTE, HOST, KV, LLAMA_CPP, WEIGHTS, MemoryReport, MiB, device_of_backend, format_bytes
from .rpc import device_id

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0

# The most that what the tool counts differently from llama-server, and its rounding, may
# move a device's figure, as a share of it, for the projection to be shown as this load's.
SHOWN_WITHIN = 0.05

# "<device> <model MiB> <context MiB> <compute MiB>", device "Host" for host memory
_LINE_RE = re.compile(r"^\s*(?P<dev>[A-Za-z][\w.\-]*)\s+(?P<model>\d+)\s+(?P<context>\d+)\s+(?P<compute>\d+)\s*$")
# The placement the fit chose: "-c 2048 -ngl 7 -ts 2,5 -ot \"...\""
_FITTED_RE = re.compile(r'^-c (?P<c>\d+) -ngl (?P<ngl>-?\d+)(?: -ts (?P<ts>[\d,]+))?(?: -ot "(?P<ot>[^"]*)")?\s*$')

NOTE = ("llama.cpp's own projection (llama-fit-params) of the placement its --fit chooses with the same targets. "
        "It counts differently from llama-server: its compute buffer holds the logits of a whole micro-batch "
        "(llama-server reserves one row per slot), it leaves out the output buffer, and its figures are whole MiB, "
        "rounded down; the weights the CPU repacks (CPU_REPACK), which its per-device figures leave out, are taken "
        "from its memory breakdown")


def target_args(options: LoadOptions) -> list[str]:
    """``--fit-target`` as llama-server gets it (automatic placement only)."""
    if options.fit_target_mib is not None and options.gpu_automatic and options.fit is not False:
        return ["--fit-target", ",".join(str(x) for x in options.fit_target_mib)]
    return []


def fit_argv(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions) -> list[str] | None:
    """The ``llama-fit-params`` command line that fits ``options`` as llama-server would
    (None: llama-server does not fit, ``-fit off``)."""
    if options.fit is False:
        return None
    return [str(binary), "--model", str(Path(model)), *memory_args(options), *target_args(options)]


def fit_params_argv(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions,
                    fitted: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``llama-fit-params --fit-print`` command line for what llama-server gets for
    ``options``, with ``fitted`` (the placement the fit chose, :func:`parse_fitted`) last, so
    that it takes the place of what it sets."""
    return [str(binary), "--model", str(Path(model)), "--fit-print", "on", "--log-jsonl", *memory_args(options),
            *fitted]


def parse_fitted(text: str) -> list[str] | None:
    """The placement a fit printed, as flags (``["-c", "2048", "-ngl", "7", "-ts", "2,5"]``),
    or None when it printed none."""
    for line in reversed(text.splitlines()):
        m = _FITTED_RE.match(line.strip())
        if m:
            out = ["-c", m.group("c"), "-ngl", m.group("ngl")]
            if m.group("ts"):
                out += ["-ts", m.group("ts")]
            if m.group("ot"):
                out += ["-ot", m.group("ot")]
            return out
    return None


_RPC_NAME_RE = re.compile(r"^RPC(\d+)$", re.IGNORECASE)


def parse_fit_print(text: str, rpc: tuple[str, ...] | list[str] = ()) -> MemoryReport | None:
    """:func:`parse_projection`'s report alone."""
    return parse_projection(text, rpc)[0]


def parse_projection(text: str, rpc: tuple[str, ...] | list[str] = ()) -> tuple[MemoryReport | None, list[dict]]:
    """(report, the rows of its breakdown for buffers of no device). The per-device lines of
    ``--fit-print on`` output as a MemoryReport (source ``llama.cpp``), or None when there are
    none. Log lines mixed in are ignored, except the memory breakdown (``--log-jsonl``), whose
    buffers of no device (``CPU_REPACK``: weights repacked for the CPU) count in host memory.
    The tool names RPC devices by number alone (``RPC0``): with ``rpc``, the ``--rpc`` endpoints
    in their order, the K-th is the worker at ``rpc[K]`` (a worker of one device each, as
    ``jupyter-llama worker`` serves), as everything else names it."""
    rep = MemoryReport(LLAMA_CPP)
    found = False
    extra: list[dict] = []
    for line in text.splitlines():
        if line.startswith("{") and '"fit_memory_breakdown"' in line:
            try:
                rows = json.loads(line).get("data", {}).get("rows", [])
            except (ValueError, AttributeError):
                rows = []
            extra = [r for r in rows if isinstance(r, dict) and r.get("kind") == "buffer_type"]
            continue
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
        return None, []
    for row in extra:
        for comp, key in ((WEIGHTS, "model"), (KV, "context"), (COMPUTE, "compute")):
            n = row.get(key)
            if isinstance(n, int) and n > 0:
                rep.set(HOST, comp, rep.get(HOST, comp) + n * MiB)
    rep.warnings.append(NOTE)
    return rep, extra


def placement_of(report: MemoryReport, options: LoadOptions, fitted: list[str] | tuple[str, ...] = ()
                 ) -> tuple[list[str], LoadOptions, list[float] | None]:
    """(accelerators in llama.cpp's order, the options with the fitted ``-ngl``, the fitted
    ``-ts``): the placement the projection was made for. llama.cpp puts the ``--rpc`` workers
    first, then local GPUs."""
    workers = [device_id(ep) for ep in options.rpc or ()]
    gpus = workers + sorted(d for d in report.devices if d != HOST and d not in workers)
    flags = dict(zip(fitted[::2], fitted[1::2], strict=False))
    ngl = int(flags["-ngl"]) if "-ngl" in flags else options.num_gpu
    split = [float(x) for x in flags["-ts"].split(",")] if "-ts" in flags else None
    if split is not None and len(split) != len(gpus):
        split = None
    return gpus, options.replace(num_gpu=None if ngl is None or ngl < 0 else ngl), split


def logits_excess(info, options: LoadOptions, gpus: list[str] | tuple[str, ...] = (),
                  split: list[float] | None = None) -> tuple[str, int, int]:
    """(device, bytes, rows): how much larger the tool's compute buffer is than llama-server's
    on the device that holds the output layer, for the logits of the micro-batch rows
    llama-server does not reserve. llama-server reserves ``n_outputs_max`` rows (one per slot,
    or the whole batch for an embedding load); the tool a whole micro-batch. A compute buffer
    is the peak of its part of the graph, so the logits raise it only where they outweigh the
    peak elsewhere in that part: for the models the detailed estimate replays, both reserves
    of that device's part are replayed (:func:`.estimate.compute_bytes`); for others, the
    logits themselves, ``4 * n_vocab`` bytes a row, are taken. ``gpus``/``split``: the
    placement (:func:`placement_of`)."""
    from . import estimate
    from .computegraph import CPU_ALIGNMENT, GPU_ALIGNMENT

    plan = estimate.plan_context(info, options)
    devices, out_dev = estimate.layer_devices(info, options, list(gpus), split) if gpus else ([HOST], HOST)
    t = min(plan.n_ctx, plan.n_ubatch)
    rows = max(0, t - min(t, plan.n_outputs_max))
    if not rows:
        return out_dev, 0, 0
    bound = 4 * int(info.vocab_size) * rows
    if info.architecture not in estimate.LLAMA_LIKE:
        return out_dev, bound, rows
    try:
        part: dict = {}
        copies = 1
        if out_dev != HOST:
            host = frozenset(il for il, d in enumerate(devices) if d == HOST)
            part = dict(layers=frozenset(il for il, d in enumerate(devices) if d == out_dev), output=True,
                        embed=False, host=host)
            offloaded = sum(d != HOST for d in devices) + 1
            if estimate.pipeline_parallel(len(gpus), offloaded, info.block_count + 1):
                copies = estimate.PIPELINE_COPIES
        align = CPU_ALIGNMENT if out_dev == HOST or out_dev.startswith("rpc:") else GPU_ALIGNMENT
        tool = dataclasses.replace(plan, n_outputs_max=max(plan.n_outputs_max, plan.n_batch))
        extra = (estimate.compute_bytes(info, tool, align, copies, **part)
                 - estimate.compute_bytes(info, plan, align, copies, **part))
        return out_dev, max(0, extra), rows
    except Exception:  # (a header the replay cannot take: the logits themselves)
        return out_dev, bound, rows


def withheld(report: MemoryReport, info, options: LoadOptions, extra: list[dict] | tuple = (),
             fitted: list[str] | tuple[str, ...] = ()) -> str | None:
    """Why the projection cannot be shown as this load's (None: it can, and the note on
    ``report`` then says what it still counts differently).

    Per device, what it is known to count differently from llama-server, and its rounding,
    may move its figure by at most :data:`SHOWN_WITHIN` of it: the logits of a whole
    micro-batch in the compute buffer of the device with the output layer
    (:func:`logits_excess`), the output buffer it leaves out of the host, weights the CPU
    repacks (``extra``, its breakdown's ``CPU_REPACK``) where the model is memory-mapped
    (llama-server's mapped buffer spans the file from the first to the last tensor it keeps
    on the host, so it can hold some or all of their original place; the tool counts them
    once), and up to 1 MiB a figure rounded down (three a device, and one more for each
    buffer of no device). Where they go opposite ways, the worse end counts."""
    from .estimate import output_bytes, plan_context

    gpus, placed, split = placement_of(report, options, fitted)
    out_dev, logits, rows = logits_excess(info, placed, gpus, split)
    missing = output_bytes(info, plan_context(info, options))
    mapped = sum(int(r.get("model") or 0) for r in extra if str(r.get("name", "")).upper().startswith("CPU")) * MiB \
        if options.use_mmap is not False else 0
    for dev in report.by_device():
        figure = report.total(device=dev)
        rounding = (3 + (len(extra) if dev == HOST else 0)) * MiB
        more = logits if dev == out_dev else 0
        less = missing if dev == HOST else 0
        twice = mapped if dev == HOST else 0  # (at most: the mapping spans what llama-server keeps on the host)
        if max(abs(more - less), abs(more - less - twice)) + rounding <= SHOWN_WITHIN * figure:
            continue
        if more and more >= rounding:
            return (f"llama-fit-params reserves its graph for {rows} more output rows than llama-server (which "
                    f"reserves one per slot): {format_bytes(more)} of its {format_bytes(figure)} on {dev} is the "
                    "logits and the last layer's work for them")
        if twice and twice >= rounding:
            return (f"llama-server maps the model file, so its host weights can hold the {format_bytes(twice)} the "
                    f"CPU repacks twice (mapped and repacked); the tool counts them once, in its "
                    f"{format_bytes(figure)} on {dev}")
        if less and less >= rounding:
            return (f"it leaves out the output buffer, {format_bytes(less)} of llama-server's memory on {dev}, where "
                    f"its figure is {format_bytes(figure)}")
        return (f"its figures are whole MiB, rounded down: too coarse for the {format_bytes(figure)} it gives "
                f"on {dev}")
    if logits >= MiB:  # (less is below what its whole MiB say)
        report.warnings.append(f"its compute figure on {out_dev} includes {format_bytes(logits)} for {rows} output "
                               "rows (their logits, and the last layer's work for them) that llama-server does not "
                               "reserve")
    if mapped >= MiB:
        report.warnings.append(f"llama-server's mapping of the model file can also hold (some of) the "
                               f"{format_bytes(mapped)} of weights the CPU repacks, which this counts once")
    return None


@dataclass
class FitParamsResult:
    """What one projection gave: the report (None on failure, or where it is withheld), and
    why not. ``argv`` is the projection's command line, ``fitted`` the placement the fit
    chose (empty where llama-server loads as asked)."""

    report: MemoryReport | None
    argv: list[str]
    error: str | None = None
    returncode: int | None = None
    stderr_tail: list[str] = field(default_factory=list)
    fitted: list[str] = field(default_factory=list)
    withheld: bool = False  # it ran, but describes another load (see :func:`withheld`)
    projection: MemoryReport | None = None  # what it printed, shown or not


@dataclass
class _Ran:
    rc: int | None
    out: str = ""
    err: str = ""
    error: str | None = None  # could not run, or did not finish


def _failed(argv: list[str], ran: _Ran) -> FitParamsResult:
    tail = [ln for ln in ran.err.splitlines() if ln.strip()][-10:]
    if ran.error:
        return FitParamsResult(None, argv, ran.error, ran.rc, tail)
    why = next((ln for ln in reversed(tail) if "error" in ln.lower() or "failed" in ln.lower()), None)
    error = f"llama-fit-params exited with code {ran.rc}" + (f": {why.strip()}" if why else "")
    return FitParamsResult(None, argv, error, ran.rc, tail)


def _fitted(ran: _Ran) -> tuple[list[str], str | None]:
    """The placement of a fit run, and a note where it found none (llama-server then loads as asked)."""
    fitted = parse_fitted(ran.out) if ran.rc == 0 else None
    if fitted is None:
        return [], ("llama.cpp's --fit found no placement within the targets; these figures are for the load as "
                    "asked, as llama-server then starts it")
    return fitted, None


def _finish(argv: list[str], ran: _Ran, options: LoadOptions, model, fitted: list[str], note: str | None,
            info=None) -> FitParamsResult:
    if ran.error or ran.rc != 0:
        return _failed(argv, ran)
    tail = [ln for ln in ran.err.splitlines() if ln.strip()][-10:]
    rep, extra = parse_projection(ran.out, options.rpc or ())
    if rep is None:
        return FitParamsResult(None, argv, "llama-fit-params printed no memory figures", ran.rc, tail, fitted)
    if note:
        rep.warnings.append(note)
    if info is None:
        try:
            from ..models.gguf_info import read_gguf_info

            info = read_gguf_info(model)
        except Exception:  # (the tool read it; without its header the logits cannot be weighed)
            info = None
    if info is not None:
        reason = withheld(rep, info, options, extra, fitted)
        if reason:
            return FitParamsResult(None, argv, reason, ran.rc, tail, fitted, withheld=True, projection=rep)
    return FitParamsResult(rep, argv, None, ran.rc, tail, fitted, projection=rep)


def _run(argv: list[str], timeout: float) -> _Ran:
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", env=child_environment(), start_new_session=True)
    except OSError as e:
        return _Ran(None, error=f"cannot run {argv[0]}: {e.strerror or e}")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        return _Ran(None, error=f"llama-fit-params did not finish within {timeout:.0f}s")
    except BaseException:
        if proc.poll() is None:
            _kill_group(proc.pid)
        proc.communicate()
        raise
    return _Ran(proc.returncode, out, err)


async def _run_async(argv: list[str], timeout: float) -> _Ran:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=child_environment(), start_new_session=True)
    except OSError as e:
        return _Ran(None, error=f"cannot run {argv[0]}: {e.strerror or e}")
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        _kill(proc)
        await proc.wait()
        return _Ran(None, error=f"llama-fit-params did not finish within {timeout:.0f}s")
    except BaseException:
        _kill(proc)
        await proc.wait()
        raise
    return _Ran(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def run_fit_params(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions,
                   timeout: float = DEFAULT_TIMEOUT, info=None) -> FitParamsResult:
    """Fit as llama-server would, then project that placement (blocking; ``info``: the
    model's header, read from ``model`` when not given). Never raises."""
    fitted: list[str] = []
    note: str | None = None
    argv = fit_argv(binary, model, options)
    if argv is not None:
        ran = _run(argv, timeout)
        if ran.error:
            return _failed(argv, ran)
        fitted, note = _fitted(ran)
    argv = fit_params_argv(binary, model, options, fitted)
    return _finish(argv, _run(argv, timeout), options, model, fitted, note, info)


async def run_fit_params_async(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions,
                               timeout: float = DEFAULT_TIMEOUT, info=None) -> FitParamsResult:
    """:func:`run_fit_params` on the event loop (the child is killed on timeout or
    cancellation). Never raises, except the cancellation itself."""
    fitted: list[str] = []
    note: str | None = None
    argv = fit_argv(binary, model, options)
    if argv is not None:
        ran = await _run_async(argv, timeout)
        if ran.error:
            return _failed(argv, ran)
        fitted, note = _fitted(ran)
    argv = fit_params_argv(binary, model, options, fitted)
    ran = await _run_async(argv, timeout)
    return await asyncio.to_thread(_finish, argv, ran, options, model, fitted, note, info)


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
    """llama.cpp's projection for this load, or None (logged: a warning where it failed, a
    note where it describes another load, :func:`withheld`)."""
    if not binary:
        log.warning("no llama-fit-params beside the engine; llama.cpp's projection is unavailable")
        return None
    res = run_fit_params(binary, model, options, timeout)
    log_result(res)
    return res.report


async def project_async(binary: str | os.PathLike | None, model: str | os.PathLike, options: LoadOptions,
                        timeout: float = DEFAULT_TIMEOUT) -> MemoryReport | None:
    """:func:`project` without blocking the event loop."""
    if not binary:
        log.warning("no llama-fit-params beside the engine; llama.cpp's projection is unavailable")
        return None
    res = await run_fit_params_async(binary, model, options, timeout)
    log_result(res)
    return res.report


def log_result(res: FitParamsResult) -> None:
    """Log what a projection gave where it gave no report: a note where it is withheld, a
    warning where it failed."""
    if res.withheld:
        log.info("llama.cpp's projection is not shown: %s", res.error)
    elif res.report is None:
        log.warning("llama.cpp's projection is unavailable: %s", res.error)
