"""serve's HTTP server (server/front.py) over a real Jupyter server's application and real
children: the API's requests on the lean connection, everything else on Tornado's, one
connection going from one to the other at a request boundary, and a client that leaves."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from srvutil import LONG, OPTS, wait_until

from jupyter_llama.engine import native
from jupyter_llama.engine.runner import free_port
from jupyter_llama.server.front import MAX_BODY, front_for

pytestmark = pytest.mark.engine


BASE = "/"  # the test server's base URL (set by the fixture: pytest-jupyter's is not "/")


@pytest.fixture
async def front(jp_serverapp, jp_base_url):
    """A FrontServer over the test server's application, on a port of its own: (server, port);
    its streams' tokens go through the relay below Python, as in serve."""
    global BASE
    BASE = jp_base_url
    native.library(wait=True)
    server = front_for(jp_serverapp)
    port = free_port()
    server.listen(port, "127.0.0.1")
    try:
        yield server, port
    finally:
        server.stop()
        await server.close_all_connections()


@pytest.fixture
def python_sends(front, monkeypatch) -> list[bytes]:
    """What Python sends on the server's side of the front's connections, a send at a time
    (the C relay's writes are not among them)."""
    port = front[1]
    sent: list[bytes] = []
    send = socket.socket.send

    def recorded(sock, data, *flags):
        if sock.family == socket.AF_INET and sock.getsockname()[1] == port:  # (not the loops' self-pipes)
            sent.append(bytes(data))
        return send(sock, data, *flags)

    monkeypatch.setattr(socket.socket, "send", recorded)
    return sent


def request(path: str, token: str, body: dict | None = None, extra: str = "", version: str = "HTTP/1.1",
            method: str | None = None) -> bytes:
    """A request for ``<base>llama/<path>`` (``/<path>`` for one of Jupyter's own), as bytes."""
    data = json.dumps(body).encode() if body is not None else b""
    method = method or ("POST" if body is not None else "GET")
    length = f"Content-Length: {len(data)}\r\n" if body is not None else ""
    where = BASE + path[1:] if path.startswith("/") else BASE + "llama/" + path
    return (f"{method} {where} {version}\r\nHost: 127.0.0.1\r\nAuthorization: token {token}\r\n"
            f"{length}{extra}\r\n").encode() + data


async def response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lower-case names), body (by length, chunks or close)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin1").rstrip("\r\n").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            body += await reader.readexactly(size + 2)
            body = body[:-2]
            if size == 0:
                break
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return int(status_line.split()[1]), headers, body


async def test_api_requests_are_answered_on_the_lean_connection(front, token, ext):
    server, port = front
    relayed = native.relayed_events
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}{BASE}llama/", trust_env=False, timeout=60,
                                 headers={"Authorization": f"token {token}"}) as c:
        assert (await c.get("api/version")).json()["version"]
        async with c.stream("POST", "api/generate", json={"model": "tiny", "prompt": "Once", "raw": True,
                                                          # long enough that a busy machine's child
                                                          # cannot make it all before the relay is tried
                                                          "options": dict(LONG, num_predict=1024, ignore_eos=True)}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            chunks = [json.loads(ln) async for ln in r.aiter_lines() if ln.strip()]
        assert chunks[-1]["done"] is True and chunks[-1]["eval_count"] == 1024 and len(chunks) == 1025
        assert all(c["model"] == "tiny" and c["created_at"].endswith("+00:00") for c in chunks)
        assert all(c["done"] is False and c["response"] for c in chunks[:-1]) and chunks[-1]["done_reason"] == "length"
        sse = await c.post("v1/chat/completions", json={"model": "tiny", "stream": True, "max_tokens": 3,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert sse.status_code == 200 and sse.text.rstrip().endswith("data: [DONE]")
        events = [json.loads(ln[6:]) for ln in sse.text.splitlines() if ln.startswith("data: {")]
        assert all(e["model"] == "tiny" for e in events) and sse.text.count("data: [DONE]") == 1
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        if native.library() is not None:  # (cc here): the tokens of both streams went below Python
            assert native.relayed_events > relayed
        # what a person gets wrong is still said in a sentence, on this connection too
        missing = await c.post("api/generate", json={"model": "no-such-model", "prompt": "x"})
        assert missing.status_code == 404 and "no-such-model" in missing.json()["error"]
        bad = await c.post("api/generate", content=b"{not json")
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]
    assert server.lean_requests == 5
    async with httpx.AsyncClient(trust_env=False) as c:  # no token: refused in words, as on Tornado's connection
        denied = await c.get(f"http://127.0.0.1:{port}{BASE}llama/api/tags")
    assert denied.status_code == 401 and denied.json()["error"] and server.lean_requests == 6
    await wait_until(lambda: not server._connections, timeout=5)  # each closed with its client


async def test_a_streams_last_line_goes_out_with_the_end_of_its_body(front, token, python_sends):
    """The last line (Ollama's done chunk, OpenAI's [DONE]) and the chunked body's end leave
    in one send, and Tornado's finish writes no empty one: the client is woken once at the
    end, not two or three times."""
    server, port = front
    sent = python_sends
    for path, body, end in (
            ("api/generate", {"model": "tiny", "prompt": "Once", "raw": True, "options": dict(OPTS, num_predict=3)},
             b'"done":true'),
            ("api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "options": dict(OPTS, num_predict=3)}, b'"done":true'),
            ("v1/chat/completions", {"model": "tiny", "stream": True, "max_tokens": 3,
                                     "messages": [{"role": "user", "content": "hi"}]}, b"data: [DONE]\n\n")):
        sent.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request(path, token, body))
        status, _, text = await response(reader)
        writer.close()
        assert status == 200 and end in text, (path, text[-200:])
        assert b"" not in sent, path
        assert text.count(end) == 1, path
        if not any(end in data for data in sent):
            # The relay below Python wrote it (an OpenAI stream's [DONE], a plain generate's done
            # line), with the body's end in the same send (tests/engine/test_native.py), and
            # Python wrote nothing after it.
            assert path in ("v1/chat/completions", "api/generate") and native.library() is not None, (path, sent[-3:])
            assert text.endswith(end) if path.startswith("v1/") else end in text.splitlines()[-1], path
            continue
        last = sent[-1]
        if b"\r\ncontent-length:" in sent[0].split(b"\r\n\r\n", 1)[0].lower():
            # The child's whole answer came in one read, before our head had gone: Tornado's
            # finish gave it a length, and head and body leave in one send (still one wake-up).
            assert len(sent) == 1, (path, sent)
        else:
            assert last.endswith(b"\r\n0\r\n\r\n") and end in last, (path, sent[-3:])
        assert end in last and not any(end in data for data in sent[:-1]), path  # (said once, in that send)


async def test_an_openai_streams_end_from_the_relay_below_python_leaves_the_connection_ready(front, token,
                                                                                            python_sends):
    """The relay below Python writes an OpenAI stream's [DONE] and its body's end; the
    handler's own end then writes nothing, and the same connection answers what comes next:
    another stream (by another name for the model, which the relay renames), then a request
    that is not a stream."""
    server, port = front
    relayed = native.relayed_events
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for name in ("tiny", "tiny:latest"):
            writer.write(request("v1/chat/completions", token, {
                "model": name, "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}))
            status, headers, body = await response(reader)
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            assert body.endswith(b"\n\ndata: [DONE]\n\n") and body.count(b"[DONE]") == 1
            events = [json.loads(ln[6:]) for ln in body.splitlines() if ln.startswith(b"data: {")]
            assert len(events) >= 64 and all(e["model"] == name for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        writer.write(request("api/version", token))
        status, _, body = await response(reader)
        assert status == 200 and "version" in json.loads(body) and server.lean_requests == 3
        if native.library() is not None:  # (cc here) the tokens and the ends were the relay's
            assert native.relayed_events >= relayed + 64 and not any(b"[DONE]" in d for d in python_sends)
    finally:
        writer.close()


async def test_a_connection_goes_on_to_tornado_at_a_request_boundary(front, token):
    """Two requests sent in one write (both ours), then one for Jupyter itself: Tornado's
    connection takes over with nothing of it read, and keeps the connection."""
    server, port = front
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request("api/version", token) + request("api/tags", token))
        status, _, body = await response(reader)
        assert status == 200 and "version" in json.loads(body)
        status, _, body = await response(reader)
        assert status == 200 and "models" in json.loads(body)
        assert server.lean_requests == 2
        writer.write(request("/api/status", token))
        status, _, body = await response(reader)
        assert status == 200 and "started" in json.loads(body)
        writer.write(request("api/version", token))  # the same connection, Tornado's now
        status, _, body = await response(reader)
        assert status == 200 and "version" in json.loads(body) and server.lean_requests == 2
    finally:
        writer.close()


async def test_requests_left_to_tornado_are_answered_by_it(front, token):
    server, port = front
    body = json.dumps({"model": "tiny", "prompt": "Once", "raw": True, "stream": False,
                       "options": dict(OPTS, num_predict=2)}).encode()
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    cases = {
        "chunked body": request("api/generate", token, method="POST", extra="Transfer-Encoding: chunked\r\n") + chunked,
        "HTTP/1.0": request("api/version", token, version="HTTP/1.0"),
        "outside llama/": request("/api/status", token),
        "HEAD": request("api/version", token, method="HEAD"),
    }
    for what, raw in cases.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(raw)
            if what == "HEAD":
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), what  # (Tornado's connection answers a HEAD)
                continue
            status, _, answer = await response(reader)
            assert status == 200, (what, answer)
            if what == "chunked body":
                assert json.loads(answer)["eval_count"] == 2
        finally:
            writer.close()
    assert server.lean_requests == 0

    # a header line that is not one: Tornado's 400
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request("api/version", token, extra="not a header\r\n"))
        status, _, _ = await response(reader)
        assert status == 400 and server.lean_requests == 0
    finally:
        writer.close()


async def test_a_body_that_comes_after_its_head_is_waited_for_on_the_lean_connection(front, token):
    """Clients (httpx among them) write a request's head and its body separately: a body
    not here yet when the head is looked at is read as it comes, and the connection stays
    lean; a client that leaves before sending all of it gets nothing, and nothing is run."""
    server, port = front
    body = {"model": "tiny", "prompt": "Once", "raw": True, "stream": False, "options": dict(OPTS, num_predict=2)}
    raw = request("api/generate", token, body)
    cut = raw.index(b"\r\n\r\n") + 4

    def waiting(got: int):  # the server holds the head and `got` bytes of the body
        return lambda: any(c._coming is not None and len(c._coming[1]) == got for c in server._connections)

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw[:cut])
        await wait_until(waiting(0), timeout=10)
        writer.write(raw[cut:cut + 5])
        await wait_until(waiting(5), timeout=10)
        writer.write(raw[cut + 5:] + request("api/version", token))  # the body's rest, and the next request
        status, _, answer = await response(reader)
        assert status == 200 and json.loads(answer)["eval_count"] == 2
        status, _, answer = await response(reader)
        assert status == 200 and "version" in json.loads(answer)
        assert server.lean_requests == 2
    finally:
        writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw[:cut + 5])
    await wait_until(waiting(5), timeout=10)
    writer.close()
    await wait_until(lambda: not server._connections, timeout=10)
    assert server.lean_requests == 2


async def test_a_large_body_is_read_whole_and_connection_close_is_kept(front, token):
    server, port = front
    prompt = "Once upon a time " * 6000  # ~100 KiB: more than the first look at a request takes
    body = {"model": "tiny", "prompt": prompt, "raw": True, "stream": False, "truncate": True,
            "options": dict(OPTS, num_predict=1)}
    raw = request("api/generate", token, body, extra="Connection: close\r\n")
    assert len(raw) < MAX_BODY
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        status, headers, answer = await response(reader)
        assert status == 200 and json.loads(answer)["done"] is True, answer[:300]
        assert headers.get("connection") == "close"
        assert await reader.read() == b""  # and it was closed after the answer
    finally:
        writer.close()
    assert server.lean_requests == 1


async def test_a_client_that_leaves_mid_stream_stops_the_generation(front, token, ext):
    server, port = front
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request("api/generate", token, {"model": "tiny", "prompt": "Once", "raw": True,
                                                 "options": dict(LONG, num_predict=100000, ignore_eos=True)}))
    await reader.readuntil(b"\r\n\r\n")
    for _ in range(3):  # three chunks of the stream
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        await reader.readexactly(size + 2)
    lo = next(lo for lo in ext.scheduler.loaded.values() if lo.name == "tiny:latest")
    assert lo.refcount == 1
    running = native.Run.make()  # (the relay below Python has the stream, if it is here: it hears the client leave)
    if running is not None:
        running.close()
        assert native._idle.count(running) == 1 and native._made > len(native._idle)
    writer.close()

    async def stopped():
        slots = await lo.runner.get("/slots")
        return lo.refcount == 0 and not any(s.get("is_processing") for s in slots)

    await wait_until(stopped, timeout=10)
    await wait_until(lambda: not server._connections, timeout=5)
    assert server.lean_requests == 1


async def test_closing_the_server_mid_stream_closes_a_connection_the_c_relay_writes_on(front, token, ext):
    """The server's shutdown closes every connection, one whose stream the relay below
    Python has too: it is stopped, gives the socket back, and the connection closes (the
    client sees the end, the slot stops); nothing is closed under it."""
    server, port = front
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request("api/generate", token, {"model": "tiny", "prompt": "Once", "raw": True,
                                                 "options": dict(LONG, num_predict=100000, ignore_eos=True)}))
    await reader.readuntil(b"\r\n\r\n")
    for _ in range(3):
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        await reader.readexactly(size + 2)
    busy = native._made - len(native._idle)
    await asyncio.wait_for(server.close_all_connections(), 10)
    assert not server._connections and native._made - len(native._idle) == busy - (native.library() is not None)
    rest = await asyncio.wait_for(reader.read(), 10)  # what was on its way, then the end
    assert not rest.endswith(b"0\r\n\r\n")  # (cut off, not finished)
    writer.close()
    lo = next(lo for lo in ext.scheduler.loaded.values() if lo.name == "tiny:latest")

    async def stopped():
        slots = await lo.runner.get("/slots")
        return lo.refcount == 0 and not any(s.get("is_processing") for s in slots)

    await wait_until(stopped, timeout=10)


async def test_a_handler_that_takes_its_body_as_it_comes_gets_it_on_the_lean_connection(jp_serverapp, jp_base_url,
                                                                                       token, models_dir):
    """A blob upload (a handler of Tornado's ``stream_request_body``) is Tornado's in serve;
    given to the lean connection all the same, it gets its body and answers as it would
    there (the connection waits for the handler's pace)."""
    import hashlib

    from jupyter_llama.server.front import FrontServer

    global BASE
    BASE = jp_base_url
    server = FrontServer(jp_serverapp.web_app, prefix=jp_base_url + "llama/")  # no blob prefix left out
    port = free_port()
    server.listen(port, "127.0.0.1")
    try:
        data = b"a small blob " * 1000
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}{BASE}llama/", trust_env=False, timeout=60,
                                     headers={"Authorization": f"token {token}"}) as c:
            r = await c.post(f"api/blobs/{digest}", content=data)
            assert r.status_code == 201, r.text
            assert server.lean_requests == 1
            wrong = await c.post(f"api/blobs/sha256:{'0' * 64}", content=data)
            assert wrong.status_code == 400 and "digest" in wrong.json()["error"]
            assert (await c.head(f"api/blobs/{digest}")).status_code == 200  # (HEAD: Tornado's)
        assert server.lean_requests == 2
    finally:
        server.stop()
        await server.close_all_connections()
