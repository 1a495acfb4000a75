"""Incremental reader of a llama-server child's log.

The child is started with ``--log-verbosity 4 --no-log-prefix --no-log-timestamps`` (see
``launch.LOG_ARGS``): at that verbosity libllama prints, among much else, one line per buffer
it allocates. :class:`LogParser` is fed the log one line at a time as it arrives and keeps
what the manager needs: the memory actually allocated per device and component (as a
:class:`~jupyter_llama.memory.report.MemoryReport` with source ``"actual"``), how many layers
went to the GPU, the free memory llama.cpp saw per device, the decisions of ``--fit``, the
context size really used, readiness, and error / out-of-memory markers for error messages.

Lines are recognised by their message text, never by a prefix before it, so a log written
with or without level letters and timestamps parses the same. The formats are those of
llama.cpp's ``src/`` (``load_tensors``, ``llama_kv_cache``, ``llama_context``), ``common/fit.cpp``
and ``tools/server`` (REFERENCE section 2):

* ``load_tensors:   CPU_Mapped model buffer size =     1.12 MiB``
* ``llama_kv_cache:        CPU KV buffer size =     1.25 MiB`` (one per cache and backend);
  its summary ``llama_kv_cache: size =    1.25 MiB (  2048 cells, ...)`` restates the buffers
  and is only recorded for cross-checking, never added.
* ``llama_memory_recurrent:      CUDA0 RS buffer size =   113.25 MiB``
* ``sched_reserve:        CPU compute buffer size =     3.65 MiB`` (anchored on ``=``: the
  warning ``compute buffer size of X MiB, does not match expectation`` is not a figure)
* ``llama_context:        CPU  output buffer size =     0.01 MiB``

A later line for the same (component, backend, kind) replaces an earlier one. The *kind* tells
apart the caches of one model that share a backend: the non-SWA and SWA caches of an
interleaved-SWA model (announced by ``creating non-SWA KV cache`` / ``creating     SWA KV
cache``), LoRA adapters, and so on. Model buffers printed in one run of consecutive lines are
summed per backend (a split GGUF maps one ``CPU_Mapped`` buffer per file); a later run
replaces the earlier one's figures. Everything measured before ``fitting params to free memory
took`` (the end of ``--fit``) is dropped: at higher verbosity the fit probes print projected
buffers before the real load prints the real ones.

Out-of-memory markers are matched case-insensitively (REFERENCE lists them; the Vulkan
``ErrorOutOfDeviceMemory`` spelling is added). The warning ``compute buffer allocation failed,
retrying without pipeline parallelism`` is recoverable: the failure lines just before it
(``cudaMalloc failed``, ``failed to allocate CUDA0 buffer``, ``graph_reserve: failed to allocate
compute buffers``) are withdrawn from :attr:`LogParser.errors` / :attr:`LogParser.oom` and kept
as :attr:`LogParser.warnings`.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

from jupyter_llama.memory import rpc
from jupyter_llama.memory.report import ACTUAL, COMPUTE, KV, OUTPUT, RS, WEIGHTS, MemoryReport, MiB, device_of_backend

__all__ = ["FitDecision", "LogParser", "KVSummary", "OOM_MARKERS", "ERROR_MARKERS", "RECOVERABLE_MARKERS"]

# REFERENCE section 2, plus the Vulkan spellings that the listed ones miss
# ("ErrorOutOfDeviceMemory" contains neither "out of device memory" nor "erroroutofmemory").
OOM_MARKERS = (
    "out of memory",
    "out of device memory",
    "cudamalloc failed",
    "hipmalloc failed",
    "failed to allocate",
    "allocation failed",
    "not enough memory",
    "insufficient memory",
    "vk_error_out_of_device_memory",
    "erroroutofmemory",
    "erroroutofdevicememory",
    "erroroutofhostmemory",
    "device memory allocation of size",
    # A buffer that could not be allocated, passed on unchecked (clip.cpp's projector weights
    # on a full device): ggml asserts on it and aborts. The allocator's own "failed to
    # allocate" line goes through llama-server's logger, whose thread writes it later, and the
    # abort can come first (ggml_abort writes to stderr itself): then this line is all there is.
    "ggml_assert(buffer) failed",
)
ERROR_MARKERS = (
    "error:",
    "error loading model",
    "ggml_assert",
    "failed to load model",
    "exiting due to model loading error",
    "failed to create context",  # common_init / server: context creation failed (cause on an earlier line)
    "failed to initialize the context",
)
# Error lines that only say *that* loading failed, not why: when these are all there is,
# last_error_lines() shows the raw lines leading up to them instead.
_GENERIC_ERRORS = ("exiting due to", "failed to create context", "failed to create_context",
                   "failed to load model", "cleaning up before exit")
# Warnings after which llama.cpp retries; the failure lines just before them are not fatal.
RECOVERABLE_MARKERS = (
    "compute buffer allocation failed, retrying without pipeline parallelism",
)
# How far back (in lines) a recoverable warning reaches to withdraw the failures it recovers.
_RECOVER_WINDOW = 12

_NUM = r"(-?\d+(?:\.\d+)?)"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# "<backend> <what> buffer size = <n> MiB"; the backend is the token just before.
_BUF_RE = re.compile(
    r"(?:^|\s)(?P<backend>[A-Za-z][\w.\-]*(?:\[[^\]\s]+\])?)\s+(?P<what>model|KV|RS|compute|output|LoRA|DSV4 \w+ state)"
    r" buffer size\s*=\s*" + _NUM + r"\s*MiB", re.I)
_KV_SUMMARY_RE = re.compile(
    r"\bsize\s*=\s*" + _NUM + r"\s*MiB\s*\(\s*(\d+)\s+cells,\s*(\d+)\s+layers,\s*(\d+)\s*/\s*(\d+)\s+seqs\)")
_KV_KIND_RE = re.compile(r"creating\s+(non-SWA|SWA|indexer)\s+KV cache", re.I)
_OFFLOADED_RE = re.compile(r"\boffloaded\s+(\d+)\s*/\s*(\d+)\s+layers to GPU")
_FREE_RE = re.compile(r"\busing device\s+(\S+)\s+\((.*?)\)(?:\s+\(([^()]*)\))?\s+-\s+(\d+)\s+MiB free")
_PARAM_RE = re.compile(
    r"(?:^|:\s+)(n_ctx|n_ctx_seq|n_seq_max|n_batch|n_ubatch|flash_attn|kv_unified)\s*=\s*(\S+)\s*$")
_BUILD_RE = re.compile(r"\bbuild:?\s+(\d+)\s+\(([^)\s]+)\)")
_READY_RE = re.compile(r"\bmodel loaded\s*$|starting the main loop")
_LISTEN_RE = re.compile(r"\blistening on\s+(\S+)")
_FIT_FUNC_RE = re.compile(r"\b\w*(?:params_fit|fit_params)\w*\s*:")
_FIT_DEV_RE = re.compile(
    r"-\s+(?P<dev>[A-Za-z][\w.\-]*)(?:\s+\((?P<desc>.*?)\))?\s*:\s+(?P<layers>\d+)\s+layers"
    r"(?:\s+\(\s*(?P<over>\d+)\s+overflowing\))?,\s+(?P<used>-?\d+)\s+MiB used,\s+(?P<free>-?\d+)\s+MiB free")
# multi-device projection: "- CUDA0 (NVIDIA H200): 143167 total, 158000 used, -16000 free vs. target of 1024"
_FIT_PROJ_RE = re.compile(
    r"-\s+(?P<dev>[A-Za-z][\w.\-]*)(?:\s+\((?P<desc>.*?)\))?\s*:\s+(?P<total>\d+)\s+total,\s+(?P<used>-?\d+)\s+used,"
    r"\s+(?P<free>-?\d+)\s+free vs\. target")
# llama_model_load_from_file's device list: "  - RPC0 : 127.0.0.1:50061 (24105 MiB, 24105 MiB free)"
_DEVICE_INFO_RE = re.compile(r"^\s*-\s+(?P<dev>[A-Za-z][\w.\-]*)\s+:\s+(?P<desc>.+?)\s+\((?P<total>\d+)\s+MiB,"
                             r"\s+(?P<free>\d+)\s+MiB free\)\s*$")
_RPC_NAME_RE = re.compile(r"^RPC\d+$")
_ENDPOINT_RE = re.compile(r"^[\w.\-\[\]:]+:\d+$")
_FIT_CTX_RE = re.compile(r"context size reduced from\s+(\d+)\s+to\s+(\d+)")
_FIT_CTX_USER_RE = re.compile(r"context size set by user to\s+(\d+)")
_FIT_DONE_RE = re.compile(r"fitting params to free memory took")
_FA_RESOLVED_RE = re.compile(r"Flash Attention (enabled|not supported, set to disabled)")

_COMPONENT_OF = {"model": WEIGHTS, "kv": KV, "rs": RS, "compute": COMPUTE, "output": OUTPUT, "lora": WEIGHTS}

# Cheap pre-filter: a line with none of these cannot carry anything this parser reads.
_KEYWORDS = ("buffer size", "MiB", "offloaded", "n_ctx", "n_seq_max", "n_batch", "n_ubatch", "flash_attn",
             "kv_unified", "KV cache", "fit", "Flash Attention", "build", "model loaded", "main loop", "listening on",
             "llama_context")
# One search per line for each list: a child logs ~30 lines per request at verbosity 4, and
# most of them match nothing. (The markers are lower case and searched for in the lowered
# line: an IGNORECASE alternation costs several times as much.)
_KEYWORD_RE = re.compile("|".join(map(re.escape, _KEYWORDS)))
_ALERTS = (*RECOVERABLE_MARKERS, "does not match expectation", *OOM_MARKERS, *ERROR_MARKERS)
_ALERT_RE = re.compile("|".join(map(re.escape, _ALERTS)))


def _mib_to_bytes(text: str) -> int:
    return int(round(float(text) * MiB))


@dataclass
class FitDecision:
    """One line of llama.cpp's ``--fit`` logic, with the figures it states when it states them."""

    text: str
    device: str | None = None  # canonical id, e.g. "cuda:0"
    layers: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None  # projected free after the fit; may be negative
    overflowing: int | None = None  # MoE layers partly in host memory
    ctx_from: int | None = None
    ctx_to: int | None = None


@dataclass
class KVSummary:
    """The ``llama_kv_cache: size = ...`` line: restates that cache's buffers (not added again)."""

    kind: str
    bytes: int
    cells: int
    layers: int
    seqs: int
    seqs_max: int


@dataclass
class _Entry:
    lineno: int
    text: str


class LogParser:
    """Reads a llama-server log line by line; see the module docstring for what it keeps."""

    def __init__(self, max_lines: int = 2000, max_errors: int = 500):
        self.max_lines = max_lines
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.n_lines = 0  # lines fed in total (the deque keeps the last max_lines)

        self.layers_offloaded: int | None = None
        self.layers_total: int | None = None
        self.free_memory: dict[str, int] = {}
        self.device_names: dict[str, str] = {}
        self._rpc_names: dict[str, str] = {}  # "RPC1" -> "rpc:127.0.0.1:50062" (global name -> our id)
        self.fit: list[FitDecision] = []
        self.fit_ok: bool | None = None  # "successfully fit" / "failed to fit" when --fit ran

        self.n_ctx: int | None = None
        self.n_ctx_seq: int | None = None
        self.n_seq: int | None = None
        self.n_batch: int | None = None
        self.n_ubatch: int | None = None
        self.flash_attn: str | None = None  # as configured: "auto", "enabled", "disabled"
        self.flash_attn_enabled: bool | None = None  # as resolved (auto resolves on a later line)
        self.kv_unified: bool | None = None

        self.ready = False
        self.listening: str | None = None
        self.build: str | None = None  # build number, e.g. "11434"
        self.build_commit: str | None = None

        self.kv_summaries: list[KVSummary] = []
        self.warnings: list[str] = []  # recovered failures, teardown mismatches
        self._errors: deque[_Entry] = deque(maxlen=max_errors)
        self._ooms: deque[_Entry] = deque(maxlen=max_errors)

        # (component, backend, kind) -> bytes; later lines replace earlier ones.
        self._mem: dict[tuple[str, str, str], int] = {}
        self._kv_kind = ""
        self._weights_run: dict[tuple[str, str], int] | None = None  # the current run of model-buffer lines
        self._last_mem_lineno = 0

    # ------------------------------------------------------------------ feeding

    def feed_text(self, text: str) -> None:
        """Feed many lines at once (a trailing partial line counts as a line)."""
        for line in text.splitlines():
            self._feed_one(line)

    def feed(self, line: str) -> None:
        """Feed one line of the log, with or without its trailing newline."""
        if "\n" in line.rstrip("\r\n"):
            self.feed_text(line)
            return
        self._feed_one(line.rstrip("\r\n"))

    def feed_lines(self, lines: list[str]) -> None:
        """Feed the complete lines of one read (without their line ends). While the child
        serves, they are per-request chatter: one search of the whole block for failure
        markers stands in for one search per line (each line is kept all the same)."""
        if self.ready and self.listening:
            block = "\n".join(lines)
            low = block.lower()  # (over a block, a search per marker is cheaper than the alternation)
            if "\x1b" not in block and "\r" not in block and not any(k in low for k in _ALERTS):
                self.lines.extend(lines)
                self.n_lines += len(lines)
                return
        for line in lines:
            self.feed(line)

    def _feed_one(self, line: str) -> None:
        if "\x1b" in line:
            line = _ANSI_RE.sub("", line)
        self.lines.append(line)
        self.n_lines += 1
        lineno = self.n_lines

        low = line.lower()
        if _ALERT_RE.search(low):
            self._check_errors(line, low, lineno)
        if self.ready and self.listening:
            # Serving: what follows is per-request chatter (slots, prompt cache, timings), ~30
            # lines a request. The figures were all printed before this point; only failures
            # (checked above) still count.
            return

        if not _KEYWORD_RE.search(line):
            if self._weights_run is not None and line.strip():
                self._weights_run = None
            return

        m = _BUF_RE.search(line)
        if m:
            self._buffer_line(m, lineno)
            return
        if self._weights_run is not None and line.strip():
            self._weights_run = None

        if "KV cache" in line:
            m = _KV_KIND_RE.search(line)
            if m:
                self._kv_kind = {"non-swa": "base", "swa": "swa", "indexer": "indexer"}[m.group(1).lower()]
                return
        if "llama_context" in line and "constructing llama_context" in line:
            self._kv_kind = ""
            return
        if "cells," in line:
            m = _KV_SUMMARY_RE.search(line)
            if m:
                self.kv_summaries.append(KVSummary(self._kv_kind, _mib_to_bytes(m.group(1)), int(m.group(2)),
                                                   int(m.group(3)), int(m.group(4)), int(m.group(5))))
                return
        if "offloaded" in line:
            m = _OFFLOADED_RE.search(line)
            if m:
                self.layers_offloaded, self.layers_total = int(m.group(1)), int(m.group(2))
                return
        if "MiB free" in line and "using device" in line:
            m = _FREE_RE.search(line)
            if m:
                dev = self.device_of(m.group(1), m.group(2))
                self.device_names[dev] = m.group(2)
                self.free_memory[dev] = int(m.group(4)) * MiB
                return
        if "MiB free)" in line:
            m = _DEVICE_INFO_RE.match(line)
            if m:
                dev = self.device_of(m.group("dev"), m.group("desc"))
                self.device_names.setdefault(dev, m.group("desc"))
                self.free_memory.setdefault(dev, int(m.group("free")) * MiB)
                return
        if "fit" in line and _FIT_FUNC_RE.search(line):
            self._fit_line(line)
            return
        if "=" in line:
            m = _PARAM_RE.search(line)
            if m:
                self._param(m.group(1), m.group(2))
                return
        if "Flash Attention" in line:
            m = _FA_RESOLVED_RE.search(line)
            if m:
                self.flash_attn_enabled = m.group(1) == "enabled"
                return
        if "build" in line and self.build is None:
            m = _BUILD_RE.search(line)
            if m:
                self.build, self.build_commit = m.group(1), m.group(2)
                return
        if "listening on" in line:
            m = _LISTEN_RE.search(line)
            if m:
                self.listening = m.group(1)
        if not self.ready and _READY_RE.search(line) and not self.failed:
            self.ready = True

    # ------------------------------------------------------------------ pieces

    def device_of(self, name: str, description: str | None = None) -> str:
        """Our id for a device as llama.cpp names it in device lists and fit lines.

        RPC devices are named ``RPC<n>`` with ``n`` counting over *all* workers and the
        endpoint as description; their buffers say ``RPC<k>[endpoint]`` with ``k`` counting
        within one worker. The first time a global name appears (llama.cpp lists devices in
        order before anything else) it is given the next index of its endpoint.
        """
        if _RPC_NAME_RE.match(name):
            known = self._rpc_names.get(name)
            if known:
                return known
            desc = (description or "").strip()
            if _ENDPOINT_RE.match(desc):
                endpoint = desc.lower()
                index = sum(1 for v in self._rpc_names.values() if rpc.endpoint_of(v) == endpoint)
                dev = rpc.device_id(endpoint, index)
                self._rpc_names[name] = dev
                return dev
        return device_of_backend(name)

    def _buffer_line(self, m: re.Match, lineno: int) -> None:
        backend = m.group("backend")
        what = m.group("what")
        nbytes = _mib_to_bytes(m.group(3))
        self._last_mem_lineno = lineno
        wl = what.lower()
        if wl.startswith("dsv4"):
            component, kind = KV, "dsv4-" + what.split()[1].lower()
        else:
            component = _COMPONENT_OF[wl]
            kind = {"kv": self._kv_kind, "lora": "lora"}.get(wl, "")
        if component == WEIGHTS and kind == "":
            if self._weights_run is None:
                self._weights_run = {}
            key = (backend, kind)
            self._weights_run[key] = self._weights_run.get(key, 0) + nbytes
            self._mem[(WEIGHTS, backend, kind)] = self._weights_run[key]
            return
        self._weights_run = None
        self._mem[(component, backend, kind)] = nbytes

    def _param(self, name: str, value: str) -> None:
        if name == "flash_attn":
            self.flash_attn = value
            if value in ("enabled", "disabled"):
                self.flash_attn_enabled = value == "enabled"
        elif name == "kv_unified":
            self.kv_unified = value.lower() in ("true", "1", "yes", "on")
        else:
            try:
                n = int(value)
            except ValueError:
                return
            if name == "n_ctx":
                self.n_ctx = n
            elif name == "n_ctx_seq":
                self.n_ctx_seq = n
            elif name == "n_seq_max":
                self.n_seq = n
            elif name == "n_batch":
                self.n_batch = n
            elif name == "n_ubatch":
                self.n_ubatch = n

    def _fit_line(self, line: str) -> None:
        text = line.strip()
        dec = FitDecision(text)
        m = _FIT_DEV_RE.search(line)
        if m:
            dec.device = self.device_of(m.group("dev"), m.group("desc"))
            dec.layers = int(m.group("layers"))
            dec.overflowing = int(m.group("over")) if m.group("over") is not None else None
            dec.used_bytes = int(m.group("used")) * MiB
            dec.free_bytes = int(m.group("free")) * MiB
        else:
            m = _FIT_PROJ_RE.search(line)
            if m:
                dec.device = self.device_of(m.group("dev"), m.group("desc"))
                dec.used_bytes = int(m.group("used")) * MiB
                dec.free_bytes = int(m.group("free")) * MiB
        m = _FIT_CTX_RE.search(line)
        if m:
            dec.ctx_from, dec.ctx_to = int(m.group(1)), int(m.group(2))
        else:
            m = _FIT_CTX_USER_RE.search(line)
            if m:
                dec.ctx_to = int(m.group(1))
        low = line.lower()
        if "successfully fit params" in low:
            self.fit_ok = True
        elif "failed to fit params" in low or "error while trying to fit params" in low:
            self.fit_ok = False
        self.fit.append(dec)
        if _FIT_DONE_RE.search(line):
            # Anything measured before this line was a projection of --fit; the real load follows.
            self._mem.clear()
            self._weights_run = None
            self._kv_kind = ""

    def _check_errors(self, line: str, low: str, lineno: int) -> None:
        if any(k in low for k in RECOVERABLE_MARKERS):
            self._recover(line, lineno)
            return
        if "does not match expectation" in low:
            self.warnings.append(line.strip())
            return
        is_oom = any(k in low for k in OOM_MARKERS)
        if is_oom:
            self._ooms.append(_Entry(lineno, line.strip()))
        if is_oom or any(k in low for k in ERROR_MARKERS):
            self._errors.append(_Entry(lineno, line.strip()))

    def _recover(self, line: str, lineno: int) -> None:
        """A warning after which llama.cpp retries: withdraw the failure lines that led to it."""
        start = max(self._last_mem_lineno, lineno - _RECOVER_WINDOW)
        recovered = [e.text for e in self._errors if e.lineno > start]
        for q in (self._errors, self._ooms):
            kept = [e for e in q if e.lineno <= start]
            q.clear()
            q.extend(kept)
        self.warnings.extend(recovered)
        self.warnings.append(line.strip())

    # ------------------------------------------------------------------ results

    @property
    def errors(self) -> list[str]:
        """Lines carrying an error or out-of-memory marker (recovered ones excluded)."""
        return [e.text for e in self._errors]

    @property
    def oom_lines(self) -> list[str]:
        return [e.text for e in self._ooms]

    @property
    def oom(self) -> bool:
        """Whether any (non-recovered) out-of-memory marker was seen."""
        return bool(self._ooms)

    @property
    def failed(self) -> bool:
        """Whether the child reported a fatal loading error ("exiting due to ...", "failed to load model")."""
        return any("exiting due to" in e.text.lower() or "failed to load model" in e.text.lower()
                   for e in self._errors)

    @property
    def buffers(self) -> dict[tuple[str, str, str], int]:
        """The raw figures: (component, backend, kind) -> bytes, as last stated by the log."""
        return dict(self._mem)

    def kv_summary_bytes(self) -> int:
        """Sum of the latest summary line per cache kind (the buffers restated, for cross-checks)."""
        latest: dict[str, int] = {}
        for s in self.kv_summaries:
            latest[s.kind] = s.bytes
        return sum(latest.values())

    def report(self) -> MemoryReport:
        """What llama.cpp actually allocated, per canonical device and component."""
        rep = MemoryReport(ACTUAL, layers_offloaded=self.layers_offloaded, layers_total=self.layers_total,
                           n_ctx=self.n_ctx, warnings=list(self.warnings))
        for (component, backend, _kind), nbytes in self._mem.items():
            rep.add(device_of_backend(backend), component, nbytes)
        if rep.layers_total is not None and self._mem and rep.gpu_total == 0:
            # A build with the RPC backend prints "offloaded N/M layers to GPU" even when no
            # device is used (the layers went to the CPU backend): report it as a plain CPU
            # build's log reads, with no offload figures at all.
            rep.layers_offloaded = rep.layers_total = None
        return rep

    def last_error_lines(self, n: int = 10) -> list[str]:
        """The last ``n`` error lines, else the last ``n`` raw lines (for error messages).

        When the only error lines are generic ("failed to create context", "exiting due to
        model loading error"), the cause is on an unmarked line before them, so the raw lines
        are returned instead.
        """
        errs = self.errors
        if any(not any(g in e.lower() for g in _GENERIC_ERRORS) for e in errs):
            return errs[-n:]
        return [ln for ln in list(self.lines)[-n:] if ln.strip()]
