"""The token relay below Python (engine/relay.c through engine/native.py), on real sockets:
what it writes is what the Python relay writes, it hands back at the first chunk it does not
relay with every byte of it, and it stops for a client that left, a child that ended, a stop,
and a client that does not read. (Through serve's front and a real child:
tests/server/test_front.py.)"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import socket

import pytest

from jupyter_llama.api import ollama as oa
from jupyter_llama.engine import http1, native

lib = native.library(wait=True)


@pytest.fixture(autouse=True)
def relay_built():
    """Every test here needs the library. Where there is none they skip, but not under `make
    test`, which builds the engine with this machine's compilers: a relay.c that no longer
    compiles must fail the suite, not skip the tests that would have said so."""
    if lib is None:
        if os.environ.get("JUPYTER_LLAMA_REQUIRE_ENGINE") == "1" and os.environ.get("JUPYTER_LLAMA_RELAY") != "python":
            pytest.fail(f"no relay below Python, but `make test` requires it: {native.status()}")
        pytest.skip(f"no relay below Python here: {native.status()}")

STAMP = re.compile(rb'"created_at":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00"')


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def completion_event(text: str, stop: bool = False) -> bytes:
    return json.dumps({"index": 0, "content": text, "tokens": [17, 4], "stop": stop, "id_slot": 0},
                      separators=(",", ":"), ensure_ascii=False).encode()


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        out += data[:size]
        data = data[size + 2:]
    return out


def drain(sock: socket.socket) -> bytes:
    """What a non-blocking socket has now."""
    out = b""
    while True:
        try:
            part = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        if not part:
            return out
        out += part


class Pair:
    """The child's side (we write to ``child``), the client's (we read ``client``), and the
    two ends the relay gets."""

    def __init__(self):
        self.child, self.src = socket.socketpair()
        self.dst, self.client = socket.socketpair()
        for s in (self.child, self.src, self.dst, self.client):
            s.setblocking(False)

    def read_client(self) -> bytes:
        return drain(self.client)

    def close(self) -> None:
        for s in (self.child, self.src, self.dst, self.client):
            s.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def start(pair: Pair, spec) -> tuple[native.Run, asyncio.Future]:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    run = native.Run.make()
    run.start(pair.src.fileno(), pair.dst.fileno(), spec, fut.set_result)
    return run, fut


async def test_tokens_are_written_as_the_python_relay_writes_them_and_the_rest_handed_back(pair):
    tr = oa.GenerateTranslator("tiny:latest", 0.0, 0.0)
    before = datetime.datetime.now(datetime.timezone.utc)
    texts = [" the", "é\"quoted\"\\", "\n", "日本", "\u2028"]
    events = [completion_event(t) for t in texts]
    last = chunk(b"data: " + completion_event("", stop=True) + b"\n\n") + b"0\r\n\r\n"
    wire = b"".join(chunk(b"data: " + e + b"\n\n") for e in events) + last
    run, fut = start(pair, native.template(*tr.native_template()))
    tokens = wire[:-len(last)]
    for i in range(0, len(tokens), 7):  # in pieces that cut lines, size lines and CRLFs
        pair.child.send(tokens[i:i + 7])
        await asyncio.sleep(0.002)
    pair.child.send(last)
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.leftover() == last  # the last event and the end, every byte, for Python
    assert run.state.events == len(texts) and run.unsent() == b""
    run.close()
    got = dechunk(pair.read_client())
    want = b"".join(tr.lines(e) for e in events)
    assert STAMP.sub(b"", got) == STAMP.sub(b"", want) and len(STAMP.findall(got)) == len(texts)
    for line in got.splitlines():
        stamped = datetime.datetime.fromisoformat(json.loads(line)["created_at"])
        assert before <= stamped <= datetime.datetime.now(datetime.timezone.utc)  # the time it was written


def last_event(stop_type: str = "limit", **timings) -> bytes:
    """The child's last /completion event of a stream, as llama-server writes it (its fields,
    and their order, from a real one), with ``timings`` in place of its own."""
    t = {"cache_n": 2, "prompt_n": 4, "prompt_ms": 0.557, "prompt_per_token_ms": 0.13925,
         "prompt_per_second": 7181.328545780969, "predicted_n": 3, "predicted_ms": 0.469,
         "predicted_per_token_ms": 0.2345, "predicted_per_second": 4264.392324093817, **timings}
    event = {"index": 0, "content": "", "tokens": [], "id_slot": 3, "stop": True, "model": "t.gguf",
             "tokens_predicted": 3, "tokens_evaluated": 4,
             "generation_settings": {"seed": 4294967295, "temperature": 0.0, "stop": [], "n_predict": 3,
                                     "dry_sequence_breakers": ["\n", ":", "\"", "*"], "lora": []},
             "prompt": '<s> say "stop_type":"word" and "timings":{"prompt_n":9}', "has_new_line": False,
             "truncated": False, "stop_type": stop_type, "stopping_word": "", "tokens_cached": 6,
             "timings": {k: v for k, v in t.items() if v is not None}}
    return json.dumps(event, separators=(",", ":")).encode()


@pytest.mark.parametrize("stop_type,timings", [("limit", {}), ("eos", {}), ("word", {"prompt_ms": 12, "cache_n": 0}),
                                               ("limit", {"predicted_ms": 1234.5678901, "prompt_ms": 3.3e-05})])
async def test_with_a_done_pattern_it_writes_the_last_line_as_python_does_and_ends_the_answer(pair, stop_type, timings):
    """An Ollama stream's last line, the child's stop type and timings as Ollama's reason,
    counts and durations, goes out from the relay with the body's end; the child's own end
    is left to Python (as test_with_an_end... for OpenAI's [DONE])."""
    tr = oa.GenerateTranslator("tiny:latest", 0.0, 1.5)
    python_side = oa.GenerateTranslator("tiny:latest", 0.0, 1.5)
    tr.started = python_side.started = asyncio.get_running_loop().time()  # (time.monotonic, both)
    text = chunk(b"data: " + completion_event(" the") + b"\n\n")
    last = last_event(stop_type, **timings)
    pair.child.send(text + chunk(b"data: " + last + b"\n\n") + b"0\r\n\r\n")
    run, fut = start(pair, native.template(*tr.native_template(), done=tr.native_done()))
    assert await asyncio.wait_for(fut, 10) == native.FINISHED
    assert run.leftover() == b"0\r\n\r\n" and run.state.events == 1 and run.unsent() == b""
    run.close()
    got = pair.read_client()
    assert got.endswith(b"\r\n0\r\n\r\n") and got.count(b"\r\n0\r\n\r\n") == 1  # the body's end, once
    lines = dechunk(got).splitlines(keepends=True)
    want = python_side.lines(completion_event(" the")) + python_side.lines(last)
    assert len(lines) == 2 and lines[-1].endswith(b"}\n")
    ours, theirs = json.loads(lines[-1]), json.loads(want.splitlines()[-1])
    assert 0 < ours.pop("total_duration") <= theirs.pop("total_duration")  # (written before Python's)
    assert list(ours) == list(theirs)  # the same keys, in the same order
    def spelled(line: bytes) -> bytes:  # (byte for byte, but for the two clocks)
        return re.sub(rb'"total_duration":\d+', b"", STAMP.sub(b"", line))

    assert spelled(lines[-1]) == spelled(want.splitlines(keepends=True)[-1])
    assert ours["done_reason"] == ("length" if stop_type == "limit" else "stop") and ours["load_duration"] == 1_500_000_000


@pytest.mark.parametrize("last", [last_event(predicted_ms=None), last_event(cache_n=None),
                                  completion_event("", stop=True), last_event().replace(b'"stop_type":"limit",', b""),
                                  last_event().replace(b'"content":""', b'"content":"!"')])
async def test_a_last_event_that_says_less_than_the_last_line_needs_goes_back(pair, last):
    """No timings, or not all of them, no stop type, or text in the last event: that event
    and the end are Python's, which writes the line from what there is."""
    tr = oa.GenerateTranslator("tiny:latest", 0.0, 0.0)
    rest = chunk(b"data: " + last + b"\n\n") + b"0\r\n\r\n"
    pair.child.send(chunk(b"data: " + completion_event("a") + b"\n\n") + rest)
    run, fut = start(pair, native.template(*tr.native_template(), done=tr.native_done()))
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.leftover() == rest and run.state.events == 1
    run.close()


def test_only_a_plain_generate_answer_has_its_last_line_written_below_python():
    """A chat's last line puts its message after the stats, and an answer with ``context``
    completes its last line after the relay: those stay Python's."""
    assert oa.GenerateTranslator("m", 0.0, 0.0).native_done() is not None
    assert oa.TemplatedChatTranslator("m", 0.0, 0.0).native_done() is None
    assert oa.ContextGenerateTranslator("m", 0.0, 0.0).native_done() is None
    assert oa.ChatTranslator("m", 0.0, 0.0).native_done() is None


async def test_an_event_it_does_not_write_goes_back_before_any_of_its_chunk(pair):
    tr = oa.ChatTranslator("tiny:latest", 0.0, 0.0)
    text = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "hi"}}], "created": 1}
    think = {"choices": [{"finish_reason": None, "index": 0, "delta": {"reasoning_content": "hm"}}], "created": 1}
    fast = b"data: " + json.dumps(text, separators=(",", ":")).encode() + b"\n\n"
    slow = b"data: " + json.dumps(think, separators=(",", ":")).encode() + b"\n\n"
    rest = chunk(fast + slow) + chunk(fast)  # a chunk of two events, one of them not a token of text
    pair.child.send(chunk(fast) + rest)
    run, fut = start(pair, native.template(*tr.native_template()))
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.leftover() == rest and run.state.events == 1
    run.close()
    assert dechunk(pair.read_client()).count(b"\n") == 1


@pytest.mark.parametrize("event", [b"data: [DONE]\n\n", b'data: {"error":{"code":500,"message":"x"}}\n\n',
                                   b"data:{}\n\n", b"event: ping\n\n", b'data: {"a":1}'])
async def test_server_sent_events_pass_on_with_the_model_renamed_until_one_is_not_a_token(pair, event):
    ev = b'data: {"choices":[],"model":"tiny:latest","note":"model tiny:latest"}\n\n'
    pair.child.send(chunk(ev) * 2 + chunk(event))
    run, fut = start(pair, native.sse(b'"model":"tiny:latest"', b'"model":"tiny"'))
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.leftover() == chunk(event) and run.state.events == 2
    run.close()
    assert dechunk(pair.read_client()) == 2 * b'data: {"choices":[],"model":"tiny","note":"model tiny:latest"}\n\n'


async def test_with_an_end_it_writes_the_answers_end_for_the_childs_done_and_leaves_the_childs_end(pair):
    """An OpenAI stream's end, [DONE] and the body's last chunk, goes out from the relay in
    the send that carries its last events; the child's own end is left to Python."""
    ev = b'data: {"choices":[{"delta":{"content":"a"}}],"model":"tiny:latest"}\n\n'
    usage = b'data: {"choices":[],"usage":{"completion_tokens":2},"model":"tiny:latest"}\n\n'
    pair.child.send(chunk(ev) + chunk(ev + usage) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    run, fut = start(pair, native.sse(b'"model":"tiny:latest"', b'"model":"tiny"', end=b"data: [DONE]\n\n"))
    assert await asyncio.wait_for(fut, 10) == native.FINISHED
    assert run.leftover() == b"0\r\n\r\n" and run.state.events == 3 and run.unsent() == b""
    run.close()
    got = pair.read_client()
    renamed = ev.replace(b"tiny:latest", b"tiny")
    assert dechunk(got) == renamed * 2 + usage.replace(b"tiny:latest", b"tiny") + b"data: [DONE]\n\n"
    assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and got.count(b"\r\n0\r\n\r\n") == 1


@pytest.mark.parametrize("after", [b"data: [DONE]\n\ndata: {}\n\n", b"data: [DONE]\n\n: more\n\n"])
async def test_a_done_with_more_after_it_in_its_chunk_goes_back_whole(pair, after):
    ev = b'data: {"n":1}\n\n'
    pair.child.send(chunk(ev) + chunk(after))
    run, fut = start(pair, native.sse(end=b"data: [DONE]\n\n"))
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.leftover() == chunk(after) and run.state.events == 1
    run.close()
    assert pair.read_client() == chunk(ev)


async def test_an_end_behind_more_than_the_relays_buffer_goes_out_whole_after_every_event(pair):
    """More events than the relay's buffer holds, for a client with a small socket buffer
    that reads slowly, then [DONE]: the relay waits for the client again and again, and the
    end still goes out whole, after every event."""
    pair.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ev = b'data: {"t":"' + b"x" * 900 + b'"}\n\n'
    n = native.OUT_BUFFER // len(ev) + 40
    wire = chunk(ev) * n + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    run, fut = start(pair, native.sse(end=b"data: [DONE]\n\n"))
    got, sent = b"", 0
    while not fut.done():
        if sent < len(wire):
            try:
                sent += pair.child.send(wire[sent:sent + 65536])
            except BlockingIOError:
                pass
        got += pair.read_client()
        await asyncio.sleep(0.001)
    # (the child's own end is left to Python: what of it the relay's last read brought, if any)
    assert fut.result() == native.FINISHED and b"0\r\n\r\n".startswith(run.leftover()) and run.state.events == n
    run.close()
    got += pair.read_client()
    assert dechunk(got) == ev * n + b"data: [DONE]\n\n" and got.endswith(b"\r\n0\r\n\r\n")


async def test_told_to_stop_while_the_end_waits_for_the_client_it_is_still_the_end(pair):
    """The answer's end is in the relay's last batch, which the client has not all taken, when
    the connection tells it to stop: it stops with FINISHED, and what the client has not
    taken (the end among it) comes back as unsent, never to be followed by a second end."""
    pair.dst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    ev = b'data: {"t":"' + b"x" * 900 + b'"}\n\n'
    n = 40  # (about 37 KiB: one batch of the relay's, more than the sockets between it and the client hold)
    pair.child.sendall(chunk(ev) * n + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    run, fut = start(pair, native.sse(end=b"data: [DONE]\n\n"))
    await asyncio.sleep(0.1)  # (the relay has sent what the sockets take, and waits for the client)
    assert not fut.done()
    run.stop()
    assert await asyncio.wait_for(fut, 10) == native.FINISHED
    unsent = run.unsent()
    assert unsent.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and b"0\r\n\r\n".startswith(run.leftover())
    run.close()
    assert dechunk(pair.read_client() + unsent) == ev * n + b"data: [DONE]\n\n"


async def test_it_stops_for_a_client_that_left_a_child_that_ended_and_a_stop(pair):
    run, fut = start(pair, native.sse())
    pair.client.close()
    assert await asyncio.wait_for(fut, 10) == native.CLIENT_GONE
    run.close()
    pair.client = socket.socket()  # (closed by the fixture)

    p = Pair()
    try:
        run, fut = start(p, native.sse())
        p.child.send(b"1e\r\ndata: {")  # half a chunk, then the child is gone
        p.child.close()
        assert await asyncio.wait_for(fut, 10) == native.CHILD_ENDED
        assert run.leftover() == b"1e\r\ndata: {"
        run.close()
        p.child = socket.socket()
    finally:
        p.close()

    p = Pair()
    try:
        run, fut = start(p, native.sse())
        await asyncio.sleep(0.05)
        run.stop()
        assert await asyncio.wait_for(fut, 10) == native.STOPPED
        run.close()
        run, fut = start(p, native.sse())  # the same thread, and its stop is not left over
        p.child.send(chunk(b'data: {"n":1}\n\n'))
        await asyncio.sleep(0.05)
        assert not fut.done()
        p.child.send(chunk(b"data: [DONE]\n\n"))
        assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK and run.state.events == 1
        run.close()
    finally:
        p.close()


async def test_a_client_that_does_not_read_holds_the_relay_and_loses_nothing(pair):
    pair.dst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pair.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ev = b'data: {"choices":[],"pad":"' + b"x" * 900 + b'"}\n\n'
    run, fut = start(pair, native.sse())
    pair.child.setblocking(True)
    pair.child.sendall(chunk(ev) * 40)  # 36 KiB: more than the client's socket takes
    await asyncio.sleep(0.2)
    assert not fut.done()  # waiting for the client to take what it wrote
    run.stop()
    assert await asyncio.wait_for(fut, 10) == native.STOPPED
    assert run.unsent()
    body = dechunk(pair.read_client() + run.unsent()) + dechunk(run.leftover())
    assert body == ev * 40
    run.close()


async def test_a_chunk_larger_than_its_buffer_is_handed_back_whole(pair):
    big = chunk(b'data: {"pad":"' + b"y" * native.READ_BUFFER + b'"}\n\n')
    run, fut = start(pair, native.sse())
    pair.child.setblocking(True)
    pair.child.sendall(big[:native.READ_BUFFER])
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    left = run.leftover()
    assert left and run.state.events == 0
    pair.src.setblocking(True)
    pair.src.settimeout(1)
    rest = b""
    while len(left) + len(rest) < native.READ_BUFFER:  # what it did not read is still the socket's
        rest += pair.src.recv(1 << 20)
    assert left + rest == big[:native.READ_BUFFER] and pair.read_client() == b""
    run.close()


async def test_streams_share_the_relay_and_one_client_that_does_not_read_holds_up_no_other():
    """One thread relays every stream: while one client takes nothing, the others' tokens go
    on, each stream's bytes on its own socket, and the one held loses nothing."""
    pairs = [Pair() for _ in range(4)]
    try:
        held = pairs[0]
        held.dst.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        held.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        pad = b'data: {"choices":[],"pad":"' + b"x" * 900 + b'"}\n\n'
        runs = [start(p, native.sse()) for p in pairs]
        held.child.setblocking(True)
        held.child.sendall(chunk(pad) * 40)  # more than its client's socket takes
        for k, p in enumerate(pairs[1:], 1):
            for i in range(20):
                p.child.send(chunk(b'data: {"stream":%d,"n":%d}\n\n' % (k, i)))
                await asyncio.sleep(0)
            p.child.send(chunk(b"data: [DONE]\n\n"))
        for k, (p, (run, fut)) in enumerate(zip(pairs[1:], runs[1:]), 1):
            assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
            assert run.state.events == 20 and run.leftover() == chunk(b"data: [DONE]\n\n")
            run.close()
            assert dechunk(p.read_client()) == b"".join(b'data: {"stream":%d,"n":%d}\n\n' % (k, i) for i in range(20))
        run, fut = runs[0]
        assert not fut.done()  # still waiting for its client
        run.stop()
        assert await asyncio.wait_for(fut, 10) == native.STOPPED
        # (what it had read and not relayed, then what it had not read yet, still the socket's)
        assert dechunk(held.read_client() + run.unsent()) + dechunk(run.leftover() + drain(held.src)) == pad * 40
        run.close()
    finally:
        for p in pairs:
            p.close()


async def test_a_stream_whose_sockets_cannot_be_watched_goes_back_to_python_and_its_run_is_not_reused(pair, tmp_path):
    """epoll refuses a regular file: the run says GIVE_BACK with nothing read, and is kept
    out of the pool (the hub may still have been about to look at it); the next run works."""
    with open(tmp_path / "f", "wb") as f:
        run = native.Run.make()
        fut = asyncio.get_running_loop().create_future()
        run.start(f.fileno(), pair.dst.fileno(), native.sse(), fut.set_result)
        assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
        assert run.leftover() == b"" and run.unsent() == b"" and run.state.events == 0
        run.close()
    assert run not in native._idle and run in native._spoilt
    again, fut = start(pair, native.sse())
    assert again is not run
    pair.child.send(chunk(b'data: {"n":1}\n\n') + chunk(b"data: [DONE]\n\n"))
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK and again.state.events == 1
    again.close()


def _listening() -> socket.socket:
    """A child's listening socket, for http1 to connect to (the test plays the child)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    return listener


async def _child_for(listener) -> tuple[socket.socket, bytes]:
    """The child's side of the connection http1 makes, once its stream's request is in."""
    loop = asyncio.get_running_loop()
    conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 10)
    request = b""
    while not request.endswith(b'"stream": true}'):
        request += await asyncio.wait_for(loop.sock_recv(conn, 65536), 10)
    return conn, request


async def test_a_child_stream_is_lent_once_its_head_is_in_and_every_token_is_the_relays(pair):
    """http1's side of the hand-over: the stream goes below Python as soon as the child's
    head is in, while the child makes its first token, so the first token is written by the
    relay like every other; what is not a token (here [DONE], then the body's end) comes back
    to Python, and the request ends there."""
    loop = asyncio.get_running_loop()
    listener = _listening()
    lent, taken, in_python = asyncio.Event(), [], []

    def lend(stop):
        lent.set()
        return pair.dst.fileno()  # (the client's side: the relay writes there, the test reads pair.client)

    def on_data(batch):
        in_python.append(batch)

    on_data.native = native.Target(native.sse(), lend, lambda *back: taken.append(back))
    task = loop.create_task(http1.relay_sse(listener.getsockname()[1], "/v1/chat/completions", {"n": 1}, "",
                                            on_data))
    conn = None
    try:
        conn, _ = await _child_for(listener)
        await loop.sock_sendall(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                      b"Transfer-Encoding: chunked\r\n\r\n")
        await asyncio.wait_for(lent.wait(), 10)  # (no token has been sent yet)
        assert in_python == [[]]  # the head, which sends ours
        events = [b'{"choices":[{"delta":{"content":"%d"}}]}' % i for i in range(3)]
        await loop.sock_sendall(conn, b"".join(chunk(b"data: " + e + b"\n\n") for e in events)
                                + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await asyncio.wait_for(task, 10)
        assert dechunk(pair.read_client()) == b"".join(b"data: " + e + b"\n\n" for e in events)
        assert in_python == [[]] and taken == [(b"", False, False, None)]
    finally:
        task.cancel()
        listener.close()
        if conn is not None:
            conn.close()


OURS = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
CHILD_HEAD = b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def start_before_head(pair: Pair, spec, ours: bytes = OURS) -> tuple[native.Run, asyncio.Future]:
    fut = asyncio.get_running_loop().create_future()
    run = native.Run.make()
    run.start(pair.src.fileno(), pair.dst.fileno(), spec, fut.set_result, ours)
    return run, fut


async def test_started_before_the_childs_head_it_reads_that_head_and_sends_ours(pair):
    """The child's head, in pieces: once it is all in, ours goes to the client (as Python
    would send it, before the first token), and nothing of the child's; then the tokens."""
    run, fut = start_before_head(pair, native.sse(b'"model":"a"', b'"model":"b"'))
    for i in range(0, len(CHILD_HEAD) - 1, 9):
        pair.child.send(CHILD_HEAD[i:min(i + 9, len(CHILD_HEAD) - 1)])
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.02)
    assert pair.read_client() == b""  # (the child's head is not all in: nothing of ours yet)
    pair.child.send(CHILD_HEAD[-1:])
    got = b""
    while len(got) < len(OURS):
        await asyncio.sleep(0.002)
        got += pair.read_client()
    assert got == OURS
    events = [b'{"n":%d,"model":"a"}' % i for i in range(3)]
    pair.child.send(b"".join(chunk(b"data: " + e + b"\n\n") for e in events) + chunk(b"data: [DONE]\n\n"))
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.state.head == native.HEAD_SENT and run.state.events == 3
    assert run.leftover() == chunk(b"data: [DONE]\n\n") and run.unsent() == b""
    run.close()
    got = pair.read_client()
    assert dechunk(got) == b"".join(b"data: " + e.replace(b'"a"', b'"b"') + b"\n\n" for e in events)


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n",  # (a whole answer, not a stream)
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
])
async def test_a_childs_head_it_does_not_go_on_from_goes_back_unread_and_ours_unsent(pair, head):
    """An error's status, a body of its own length, anything but a 200 with chunked framing:
    every byte the child sent goes back to Python as it came, and nothing of ours has gone."""
    run, fut = start_before_head(pair, native.sse())
    body = b'{"error":"nope"}\n'
    pair.child.send(head + body)
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.leftover() == head + body and run.unsent() == b""
    assert run.state.head == native.HEAD_UNREAD and run.state.events == 0
    run.close()
    assert pair.read_client() == b""


async def test_a_first_chunk_it_does_not_write_goes_back_after_the_childs_head_and_ours(pair):
    """The child's head is a stream's, but its first event is not a token (an error event):
    ours has gone (HEAD_SENT), and the relay stops at that chunk, for Python."""
    run, fut = start_before_head(pair, native.sse())
    rest = chunk(b'data: {"error":{"message":"boom"}}\n\n') + b"0\r\n\r\n"
    pair.child.send(CHILD_HEAD + rest)
    assert await asyncio.wait_for(fut, 10) == native.GIVE_BACK
    assert run.state.head == native.HEAD_SENT and run.leftover() == rest and run.unsent() == b""
    run.close()
    assert pair.read_client() == OURS


async def test_a_child_that_ends_or_a_client_that_leaves_before_the_head_leaves_it_unread(pair):
    run, fut = start_before_head(pair, native.sse())
    pair.child.send(CHILD_HEAD[:20])
    pair.child.shutdown(socket.SHUT_WR)
    assert await asyncio.wait_for(fut, 10) == native.CHILD_ENDED
    assert run.leftover() == CHILD_HEAD[:20] and run.state.head == native.HEAD_UNREAD
    run.close()
    other = Pair()
    try:
        run, fut = start_before_head(other, native.sse())
        other.client.close()
        assert await asyncio.wait_for(fut, 10) == native.CLIENT_GONE and run.state.head == native.HEAD_UNREAD
        run.close()
    finally:
        other.close()


@pytest.mark.parametrize("answer", ["stream", "error"])
async def test_a_child_stream_is_lent_before_its_head_where_the_connection_can_hold_ours(pair, answer):
    """http1's side of lend_before_head: the stream goes below Python once its request is
    sent; a stream's head and tokens never pass through Python (the relay sends our head,
    HEAD_SENT); an error's head comes back unread (HEAD_UNREAD), and Python reads
    it as ever: the request fails with the child's message, and nothing went to the client."""
    loop = asyncio.get_running_loop()
    listener = _listening()
    lent, taken, in_python = asyncio.Event(), [], []

    def lend_before_head(stop):
        lent.set()
        return pair.dst.fileno(), OURS

    def on_data(batch):
        in_python.append(batch)

    on_data.native = native.Target(native.sse(), lambda stop: None, lambda *back: taken.append(back),
                                   lend_before_head)
    task = loop.create_task(http1.relay_sse(listener.getsockname()[1], "/v1/chat/completions", {"n": 1}, "",
                                            on_data))
    conn = None
    try:
        conn, _ = await _child_for(listener)
        await asyncio.wait_for(lent.wait(), 10)  # (before the child's head)
        if answer == "error":
            body = b'{"error":{"code":400,"message":"the prompt is too long","type":"invalid_request_error"}}'
            await loop.sock_sendall(conn, b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                                          b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            with pytest.raises(http1.RequestError, match="the prompt is too long"):
                await asyncio.wait_for(task, 10)
            assert taken == [(b"", False, False, native.HEAD_UNREAD)] and in_python == []
            assert pair.read_client() == b""
            return
        events = [b'{"choices":[{"delta":{"content":"%d"}}]}' % i for i in range(3)]
        await loop.sock_sendall(conn, CHILD_HEAD + b"".join(chunk(b"data: " + e + b"\n\n") for e in events)
                                + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await asyncio.wait_for(task, 10)
        got = pair.read_client()
        assert got.startswith(OURS) and dechunk(got[len(OURS):]) == b"".join(b"data: " + e + b"\n\n" for e in events)
        assert taken == [(b"", False, False, native.HEAD_SENT)]
        assert in_python == [[]]  # (the answer's beginning, told once the relay has given the stream back)
    finally:
        task.cancel()
        listener.close()
        if conn is not None:
            conn.close()
