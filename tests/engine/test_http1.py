"""The child-stream reader (engine/http1.py) against HTTP/1.1 answers written byte by byte.

A local asyncio server sends exactly the bytes each test gives it, in the pieces given
(so chunk framing, SSE lines and JSON are cut at every awkward place), and records what
the client did (when it hung up). The same reader talks to the real llama-server in
test_runner.py and the server tests; here it meets the framings a child may produce.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from jupyter_llama.engine import http1
from jupyter_llama.errors import RequestError

pytestmark = pytest.mark.asyncio


class LocalServer:
    """An asyncio server on 127.0.0.1 (a free port, ``port``) for the life of an ``async with``,
    serving each client with ``_serve``."""

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        raise NotImplementedError


class Answer(LocalServer):
    """A one-shot HTTP server that writes ``pieces`` (with ``gap`` seconds between them) to
    the first client, then closes, unless ``hold`` keeps it open."""

    def __init__(self, pieces: list[bytes], gap: float = 0.0, hold: bool = False):
        self.pieces, self.gap, self.hold = pieces, gap, hold
        self.request = b""
        self.client_left = asyncio.Event()
        self.written = 0

    async def _serve(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                       if ln.lower().startswith(b"content-length")), 0)
        self.request = head + (await reader.readexactly(length) if length else b"")
        try:
            for p in self.pieces:
                writer.write(p)
                await writer.drain()
                self.written += 1
                if self.gap:
                    await asyncio.sleep(self.gap)
            if self.hold:
                await reader.read()  # until the client goes
        except (ConnectionError, OSError):
            pass
        finally:
            self.client_left.set()
            writer.close()


def chunked(body: bytes, sizes: list[int]) -> bytes:
    """``body`` in chunks of the given sizes (the rest in one), with the last-chunk marker."""
    out, i = b"", 0
    for n in sizes + [len(body)]:
        piece = body[i:i + n]
        if piece:
            out += b"%x\r\n%b\r\n" % (len(piece), piece)
        i += len(piece)
    return out + b"0\r\n\r\n"


def bytewise(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [{"content": "Once", "stop": False}, {"content": " upon\n", "stop": False},
          {"content": "", "stop": True, "timings": {"predicted_n": 2}}]
SSE = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


async def test_chunked_sse_cut_anywhere_gives_every_event_once():
    body = HEAD_CHUNKED + chunked(SSE, [3, 17, 1, 40, 2])
    for pieces in (bytewise(body), [body], [body[:50], body[50:51], body[51:]]):
        async with Answer(pieces) as srv:
            got = [ev async for ev in http1.sse_events(srv.port, "/completion", {"prompt": "x"}, "k")]
        assert got == EVENTS
    assert b"Authorization: Bearer k" in srv.request and json.loads(srv.request.split(b"\r\n\r\n", 1)[1]) == {
        "prompt": "x", "stream": True}


async def test_bodies_by_length_and_by_close_give_their_lines():
    lines = b'{"a":1}\n{"b":2}\n{"c":3}'
    by_length = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(lines), lines)
    by_close = b"HTTP/1.1 200 OK\r\n\r\n" + lines
    for answer in (by_length, by_close):
        async with Answer(bytewise(answer)) as srv:
            got = [ln async for ln in http1.post_lines(srv.port, "/x", b"{}")]
        assert got == [b'{"a":1}', b'{"b":2}', b'{"c":3}']


async def test_error_status_is_a_request_error_with_the_childs_message():
    body = b'{"error":{"code":400,"message":"the request exceeds the available context size","type":"x"}}'
    answer = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    async with Answer([answer[:30], answer[30:]]) as srv:
        with pytest.raises(RequestError) as e:
            [ev async for ev in http1.sse_events(srv.port, "/completion", {})]
    assert e.value.status == 400 and str(e.value) == "the request exceeds the available context size"


async def test_error_event_mid_stream_ends_it_after_the_events_before():
    sse = b'data: {"content":"a"}\n\ndata: {"error":{"code":500,"message":"decode failed"}}\n\n'
    async with Answer([HEAD_CHUNKED + chunked(sse, [5])], hold=True) as srv:
        got = []
        with pytest.raises(RequestError, match="decode failed"):
            async for ev in http1.sse_events(srv.port, "/completion", {}):
                got.append(ev)
        await asyncio.wait_for(srv.client_left.wait(), 5)
    assert got == [{"content": "a"}]


async def test_named_events_keep_their_names_and_an_error_event_ends_the_stream():
    """Anthropic's and the Responses API's streams name their events: each goes on with its
    event line (which may arrive in another read than its data), and an ``error`` event is a
    RequestError after the events before it."""
    sse = (b'event: message_start\ndata: {"type":"message_start"}\n\n: ping\n\n'
           b'data: {"type":"unnamed"}\n\nevent: content_block_delta\ndata: {"delta":"a"}\n\n'
           b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"it broke"}}\n\n')
    async with Answer(bytewise(HEAD_CHUNKED + chunked(sse, [7, 30, 1]))) as srv:
        got: list[bytes] = []
        with pytest.raises(RequestError, match="it broke"):
            await http1.relay_sse(srv.port, "/v1/messages", {}, "", got.extend, named=True)
    assert got == [b'event: message_start\ndata: {"type":"message_start"}', b'data: {"type":"unnamed"}',
                   b'event: content_block_delta\ndata: {"delta":"a"}']


async def test_the_childs_error_type_comes_with_its_error():
    body = (b'{"error":{"code":400,"message":"request (9 tokens) exceeds the available context size (8 tokens)",'
            b'"type":"exceed_context_size_error","n_prompt_tokens":9,"n_ctx":8}}')
    answer = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    async with Answer([answer]) as srv:
        with pytest.raises(RequestError) as e:
            await http1.relay_sse(srv.port, "/v1/chat/completions", {}, "", lambda batch: None)
    assert e.value.status == 400 and e.value.kind == "exceed_context_size_error" and e.value.context_exceeded


async def test_connection_lost_inside_a_chunk_is_a_transport_error():
    async with Answer([HEAD_CHUNKED + b"40\r\ndata: {\"content\":\"a\"}"]) as srv:
        with pytest.raises(ConnectionError):
            [ev async for ev in http1.sse_events(srv.port, "/completion", {})]


async def test_not_http_is_a_bad_response():
    async with Answer([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"]) as srv:
        with pytest.raises(http1.BadResponse):
            [ev async for ev in http1.sse_events(srv.port, "/completion", {})]


async def test_a_pending_sink_pauses_reading_until_it_resolves():
    """The relay's contract: a callback that returns an unresolved future is not called again
    until the future resolves, and nothing is lost meanwhile."""
    events = [b'data: {"n":%d}\n\n' % i for i in range(50)]
    async with Answer([HEAD_CHUNKED] + [chunked(e, [])[:-5] for e in events] + [b"0\r\n\r\n"], gap=0.001) as srv:
        loop = asyncio.get_running_loop()
        calls, gate = [], {"fut": None}

        def sink(batch):
            assert gate["fut"] is None or gate["fut"].done(), "called while its future was pending"
            calls.append(batch)
            if len(calls) == 1:
                gate["fut"] = loop.create_future()
                loop.call_later(0.2, gate["fut"].set_result, None)
                return gate["fut"]
            return None

        t0 = loop.time()
        await http1.relay_sse(srv.port, "/completion", {}, "", sink)
    got = [json.loads(d)["n"] for batch in calls for d in batch]
    assert got == list(range(50))
    assert loop.time() - t0 >= 0.2 and len(calls) >= 2


async def test_a_successful_head_reaches_the_sink_before_any_event_does():
    """What lets a relay send its own head while the child is still making its first token:
    the child's head alone is an empty batch, and the events follow only once the sink has
    had it (the server here waits for that). An error head, or a head that comes with its
    first events, gives no empty batch."""
    heard = asyncio.Event()

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        writer.write(HEAD_CHUNKED)
        await writer.drain()
        await asyncio.wait_for(heard.wait(), 5)
        writer.write(chunked(SSE, [7, 30]))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        batches = []

        def sink(batch):
            batches.append(batch)
            if not batch:
                heard.set()

        await http1.relay_sse(server.sockets[0].getsockname()[1], "/completion", {}, "", sink)
    finally:
        server.close()
        await server.wait_closed()
    assert batches[0] == [] and all(batches[1:])
    assert [json.loads(d)["content"] for b in batches for d in b] == ["Once", " upon\n", ""]

    async with Answer([HEAD_CHUNKED + chunked(SSE, [])]) as srv:  # head and events in one piece
        batches = []
        await http1.relay_sse(srv.port, "/completion", {}, "", batches.append)
    assert batches and all(batches)
    err = b'{"error":{"code":400,"message":"bad"}}'
    async with Answer([b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(err), err]) as srv:
        batches = []
        with pytest.raises(RequestError):
            await http1.relay_sse(srv.port, "/completion", {}, "", batches.append)
    assert batches == []
    async with Answer([HEAD_CHUNKED, chunked(SSE, [])]) as srv:  # an iterator hands on events only
        assert len([ev async for ev in http1.sse_events(srv.port, "/completion", {})]) == 3


async def test_cancelling_the_relay_hangs_up_at_once():
    """What stops llama-server generating for a client that left."""
    async with Answer([HEAD_CHUNKED] + [chunked(b'data: {"content":"x"}\n\n', [])[:-5]] * 10000, gap=0.001,
                      hold=True) as srv:
        seen = asyncio.Event()
        task = asyncio.ensure_future(http1.relay_sse(srv.port, "/completion", {}, "", lambda b: seen.set()))
        await asyncio.wait_for(seen.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(srv.client_left.wait(), 2)
    assert srv.written < 10000


async def test_request_json_gets_and_posts():
    body = b'{"status":"ok"}'
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\nContent-Type: application/json\r\n\r\n"
    async with Answer([head + body]) as srv:
        assert await http1.request_json(srv.port, "/health") == {"status": "ok"}
    assert srv.request.startswith(b"GET /health HTTP/1.1\r\n")
    async with Answer([b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 40\r\n\r\n"
                       b'{"error":{"code":503,"message":"Loading"}']) as srv:
        with pytest.raises(RequestError) as e:
            await http1.request_json(srv.port, "/health")
    assert e.value.status == 503
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in (b'{"prompt":', b'"hi"}\n', b""))
    async with Answer([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked]) as srv:
        assert await http1.request_json(srv.port, "/apply-template", {"messages": []}) == {"prompt": "hi"}
    assert srv.request.startswith(b"POST /apply-template HTTP/1.1\r\n")
    assert srv.request.endswith(b'\r\n\r\n{"messages": []}')
    # a long answer of one line (an embedding of many inputs), in many reads
    big = json.dumps({"embedding": [[i / 7 for i in range(2000)] for _ in range(50)]}).encode()
    pieces = [big[i:i + 65536] for i in range(0, len(big), 65536)]
    async with Answer([b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big), *pieces], gap=0.001) as srv:
        assert await http1.request_json(srv.port, "/embedding", {"content": ["x"] * 50}) == json.loads(big)
    assert len(pieces) > 20
    async with Answer([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"]) as srv:
        with pytest.raises(ValueError):
            await http1.request_json(srv.port, "/tokenize", {"content": "x"})


def _received_now(listener: socket.socket, conns: list[socket.socket]) -> bytes | None:
    """The request a client has already sent on a connection the listener has (None when no
    connection is made yet; the connection goes on ``conns``); nothing here waits."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return None
    conn.setblocking(False)
    conns.append(conn)
    try:
        return conn.recv(65536)
    except BlockingIOError:
        return b""


async def test_a_request_is_on_the_wire_before_the_event_loop_turns():
    """In a burst, a request waiting for a turn of the loop to connect waits behind every
    other request read in that turn; so the request is written in the step that gives it,
    and a callback queued just after that step finds it at the server already."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    conns: list[socket.socket] = []
    try:
        batches, seen = [], []
        task = loop.create_task(http1.relay_sse(port, "/completion", {"prompt": "x"}, "", batches.append))
        loop.call_soon(lambda: seen.append(_received_now(listener, conns)))  # runs after the task's first step
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen and seen[0] is not None, "no connection was made in the step that gave the request"
        request = seen[0]
        assert request.startswith(b"POST /completion HTTP/1.1\r\n")
        assert request.endswith(b'{"prompt": "x", "stream": true}')
        conn = conns[-1]
        conn.setblocking(True)
        conn.sendall(HEAD_CHUNKED + chunked(SSE, []))
        conn.close()
        await asyncio.wait_for(task, 5)
        assert [json.loads(d)["content"] for b in batches for d in b] == ["Once", " upon\n", ""]
    finally:
        for conn in conns:
            conn.close()
        listener.close()


async def test_a_refused_connection_is_the_callers_to_hear():
    """Nothing listening: the request fails with the refusal, and leaves no socket open."""
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(ConnectionRefusedError):
        await http1.relay_sse(port, "/completion", {}, "", lambda b: None)
