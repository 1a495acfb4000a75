"""The OpenAPI description (server/openapi.json, served at ``GET /llama/api/openapi.json``):
valid OpenAPI 3.1, naming every route of ``default_handlers()``, and true of the real server,
which a schema-driven fuzz (schemathesis) checks: no 5xx beyond the ones the design answers
(501 not supported, 503 queue full, 507 does not fit), no status the description does not
list, no body that does not validate (each NDJSON line of a stream too), and no error that
reads like a Python traceback instead of a sentence.

The fuzz runs against a real Jupyter server with real llama-server children (conftest.py).
It calls the server with ``requests`` from a worker thread while the server runs on the
test's event loop. Model names are drawn from ``tiny``, ``tiny:latest`` and ``other`` as
often as not, so requests really load and generate, and otherwise are the fuzz's own.
Generation is bounded (a few tokens, one thread per child) so the run takes a few minutes
on 2 cores; it is deterministic (hypothesis' derandomize) unless
``JUPYTER_LLAMA_FUZZ_RANDOM=1``, and ``JUPYTER_LLAMA_FUZZ_EXAMPLES=N`` sets how many cases
each operation gets in each mode (positive and negative).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from urllib.parse import quote

import httpx
import pytest

from jupyter_llama.server.handlers import UnknownRouteHandler, default_handlers

pytestmark = pytest.mark.engine

METHODS = ("get", "head", "post", "put", "delete", "patch")


def spec_file() -> dict:
    from importlib.resources import files

    return json.loads(files("jupyter_llama.server").joinpath("openapi.json").read_text(encoding="utf-8"))


def route_paths(pattern: str) -> list[str]:
    """The OpenAPI paths a route pattern of default_handlers() serves (``/llama`` left off):
    a named group of literal alternatives stands for each of them, any other for ``{name}``."""
    assert pattern.startswith("/llama")
    pattern = pattern[len("/llama"):]
    if pattern in ("/?", ""):
        return ["/"]
    pattern = pattern.replace("\\.", ".")
    groups = list(re.finditer(r"\(\?P<(\w+)>([^)]*)\)", pattern))
    out = [""]
    pos = 0
    for g in groups:
        literal = pattern[pos:g.start()]
        alts = g.group(2).split("|") if re.fullmatch(r"[\w/|]+", g.group(2)) else ["{" + g.group(1) + "}"]
        out = [o + literal + a for o in out for a in alts]
        pos = g.end()
    return [o + pattern[pos:] for o in out]


def handler_methods(cls) -> set[str]:
    """The HTTP methods a handler class answers itself (not tornado's 405)."""
    from tornado.web import RequestHandler

    return {m for m in METHODS if getattr(cls, m) is not getattr(RequestHandler, m)}


def test_description_is_valid_openapi_and_names_every_route():
    from openapi_spec_validator import validate

    spec = spec_file()
    validate(spec)  # OpenAPI 3.1, every $ref resolved
    assert spec["openapi"].startswith("3.1")
    missing = []
    for pattern, cls, *_ in default_handlers():
        if cls is UnknownRouteHandler:
            continue
        for path in route_paths(pattern):
            item = spec["paths"].get(path)
            for method in sorted(handler_methods(cls)):
                if item is None or method not in item:
                    missing.append(f"{method.upper()} {path} ({cls.__name__})")
    assert not missing, "routes with no description in server/openapi.json: " + ", ".join(missing)
    described = {(p, m) for p, item in spec["paths"].items() for m in item if m in METHODS}
    served = {(p, m) for pattern, cls, *_ in default_handlers() if cls is not UnknownRouteHandler
              for p in route_paths(pattern) for m in handler_methods(cls)}
    assert described <= served, f"described but not served: {sorted(described - served)}"
    # every operation says what an unauthenticated request gets; the root alone answers anyone
    # (as Ollama's root does: it says only that the server runs), and says so
    for path, item in spec["paths"].items():
        for method, o in item.items():
            if path == "/":
                assert "401" not in o["responses"] and o["security"] == [], (method, path)
                continue
            assert "401" in o["responses"], (method, path)


async def test_description_is_served(http, llama_url, jp_base_url):
    import schemathesis

    r = await http.get("api/openapi.json")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    spec = r.json()
    assert spec["paths"] == spec_file()["paths"]
    assert spec["servers"][0]["variables"]["base_url"]["default"] == jp_base_url
    schema = schemathesis.openapi.from_dict(spec)  # schemathesis reads it too
    assert len([o for o in schema.get_all_operations() if o.ok()]) >= 30
    async with httpx.AsyncClient(base_url=llama_url + "/", trust_env=False) as c:
        r = await c.get("api/openapi.json")  # authenticated like every route
        assert r.status_code == 401 and "Authorization: Bearer TOKEN" in r.json()["error"]
    # the live event feed (which the fuzz leaves out: it never ends) answers as described
    events = spec["paths"]["/api/events"]["get"]["responses"]["200"]["content"]
    async with http.stream("GET", "api/events", params={"stream": "1"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0] in events
        assert r.headers["content-type"].startswith("application/x-ndjson")


async def test_what_the_fuzz_found_is_answered_as_described(http):
    """Each was a 500 before the fuzz found it (the POSTs on /v1/models with a Python repr)."""
    spec = spec_file()
    # a KV cache type whose blocks do not divide tiny's attention heads (16): llama-server exits
    # while loading; the request's options are at fault, so a 400 that says which and what to use
    r = await http.post("api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                              "options": {"cache_type_k": "q5_0", "num_thread": 1}})
    assert r.status_code == 400, r.text
    assert "cache_type_k q5_0" in r.json()["error"] and "f16" in r.json()["error"]
    r = await http.post("v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}],
                                                     "kv_cache_type": "q4_0"})
    assert r.status_code != 500, r.text  # (not a load option on OpenAI's routes: nothing to refuse)
    # a chat message whose tool call has no type: llama-server's own 500 is the client's mistake
    r = await http.post("v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2,
        "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
                     {"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert "Missing tool call type" in r.json()["error"]["message"]
    # load options llama-server refuses at start (a C int overflowed, more slots than LLAMA_MAX_SEQ):
    # each a 400 that names the option
    for opts, word in (({"num_gpu": 362872480993551}, "num_gpu"), ({"num_parallel": 300}, "num_parallel")):
        r = await http.post("api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                  "options": dict(opts, num_thread=1, num_predict=2)})
        assert r.status_code == 400 and word in r.json()["error"], r.text
    r = await http.post("api/embed",  # (a micro-batch below the slots is raised to them, as Ollama serves it)
                        json={"model": "tiny", "input": "hi", "options": {"num_ubatch": 2, "num_thread": 1}})
    assert r.status_code == 200, r.text
    r = await http.post("api/embed", json={"model": "tiny", "input": "hi " * 64, "truncate": False,
                                           "options": {"num_ubatch": 2, "num_parallel": 1, "num_thread": 1}})
    # (one slot: it loads, and says the input is longer than its batch; truncated, as by default,
    # the input is cut to it)
    assert r.status_code == 400 and "longer than the batch" in r.json()["error"], r.text
    # POST on a GET-only route: 405, in the route's own error shape
    for path in ("v1/models", "v1/models/tiny"):
        r = await http.post(path, json={"model": "tiny"})
        assert r.status_code == 405, r.text
        said = r.json()["error"]["message"]  # (the path as sent, under the server's base URL)
        assert said.startswith("POST is not a method of /") and said.endswith(f"/llama/{path}: use GET"), r.text
        assert r.headers["Allow"] == "GET"
    assert "post" not in spec["paths"]["/v1/models"]


# ----------------------------------------------------------------------------- fuzz

MODELS = ("tiny", "tiny:latest", "other")
MAX_TOKENS = 8
LOOPBACK = "http://127.0.0.1:9/"  # where pulls go: a closed port on this machine
KEEP_ALIVE = ("30s", "0", "-1", 0, -1, 1e308, "nan", "inf", "-0", "1e400", "9999999999h", "1h30m", "250ms")
TEMPLATES = ("{{ .Prompt }}", "{{ .System }} {{ .Prompt }}", "{{", "}}", "{{ .Prompt", "{{ end }}", "{{ if }}",
             "{{ range .Messages }}{{ .Content }}{{ end }}", "{{ range .Messages }}", "{{ .Nope.Deeper }}",
             "{{ if .System }}{{ .System }}{{ else }}x{{ end }}", "{{ template \"x\" }}", "{{ $x := 1 }}{{ $x }}",
             "{{ .Messages | len }}", "{{ index .Messages 99 }}", "{{ slice .Prompt 5 1 }}", "{{- -}}",
             "{{ range $i, $m := .Messages }}{{ $i }}{{ end }}", "{{ json .Messages }}", "{{ .Prompt.Foo }}")
ALLOWED_5XX = {501, 503, 507}  # not supported, queue full, does not fit: answers by design
# what an error message for a person must not look like
NOT_A_SENTENCE = re.compile(r"internal error|Traceback|object at 0x|<class '|\b[A-Z]\w*(Error|Exception)\(")


def content_type(r) -> str:
    """A schemathesis Response's Content-Type (its headers are lists)."""
    value = r.headers.get("content-type") or r.headers.get("Content-Type") or [""]
    return value[0] if isinstance(value, list) else value


def shown(body) -> str:
    """A request body for a report (none: -)."""
    if isinstance(body, bytes):
        return repr(body[:200])
    if not isinstance(body, (dict, list, str, int, float, bool, type(None))):
        return "-"
    return json.dumps(body, default=repr)[:600]


def _fuzz(spec: dict, llama_url: str, token: str) -> tuple[list[str], int]:
    """Every operation, positive and negative cases; returns (failures, requests made)."""
    import hypothesis
    import jsonschema
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    examples = int(os.environ.get("JUPYTER_LLAMA_FUZZ_EXAMPLES", "8"))
    schema = schemathesis.openapi.from_dict(spec)
    session = requests.Session()
    session.trust_env = False
    auth = {"Authorization": f"token {token}"}
    failures: list[str] = []
    made = 0
    keep = {m: f"fuzz-keep-{m}" for m in ("tiny", "other")}
    log_path = os.environ.get("JUPYTER_LLAMA_FUZZ_LOG")  # one JSON line per request, to see what it did
    log = open(log_path, "w") if log_path else None

    def post(path: str, body: dict) -> requests.Response:
        return session.post(f"{llama_url}/{path}", json=body, headers=auth, timeout=120)

    for name, backup in keep.items():  # what the store's two models are, to put back after delete/copy/create
        assert post("api/copy", {"source": name, "destination": backup}).status_code == 200

    def restore() -> None:
        for name, backup in keep.items():
            r = post("api/copy", {"source": backup, "destination": name})
            assert r.status_code == 200, r.text

    def line_schema(operation, status: int, media: str) -> dict | None:
        resp = spec["paths"][operation.path][operation.method.lower()]["responses"].get(str(status), {})
        if "$ref" in resp:
            resp = spec["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
        sch = resp.get("content", {}).get(media, {}).get("schema")
        return None if sch is None else {**sch, "components": spec["components"]}

    def bounded(case, draw) -> None:
        """Real model names as often as not; a few tokens, one thread; no endless stream."""
        path, body = case.operation.path, case.body
        if path == "/api/events" and str(case.query.get("stream", "")).lower() in ("1", "true", "yes"):
            case.query["stream"] = "0"  # the live feed never ends; its first lines are tested elsewhere
        if path == "/v1/models/{model}" and draw(st.booleans()):
            case.path_parameters["model"] = draw(st.sampled_from(MODELS))
        if path == "/api/log" and draw(st.booleans()):
            case.query["model"] = draw(st.sampled_from(MODELS))
        if not isinstance(body, dict):
            return
        if path == "/api/pull":  # never off this machine: a closed port on the loopback
            for key in ("model", "name"):
                if isinstance(body.get(key), str):
                    body[key] = LOOPBACK + quote(body[key][:40]) + ".gguf"
            return
        for key in ("model", "source", "destination", "from"):
            if key in body and draw(st.booleans()):
                body[key] = draw(st.sampled_from(MODELS))
        # the rest of a body the fuzz makes is mostly refused early; half the time a plain one
        # of its parts gets through to a load and a generation
        if "messages" in body and draw(st.booleans()):
            body["messages"] = [{"role": "user", "content": draw(st.text(max_size=30))}]
        if path == "/api/create" and draw(st.booleans()):  # a create that can succeed: from a model in the store
            for key in ("files", "quantize", "adapters", "parameters", "messages"):
                body.pop(key, None)
            body["from"] = draw(st.sampled_from(MODELS))
            body["model"] = draw(st.sampled_from(("fuzz-made", "fuzz/made:v1", "tiny")))
        if path == "/v1/responses" and draw(st.booleans()):
            body["input"] = draw(st.text(max_size=30))
        if "keep_alive" in body and draw(st.booleans()):
            body["keep_alive"] = draw(st.sampled_from(KEEP_ALIVE))
        if "template" in body and draw(st.booleans()):
            body["template"] = draw(st.sampled_from(TEMPLATES) | st.text(alphabet="{}. $|()-ifendrangeP", max_size=30))
        if path.startswith("/api/"):
            opts = body.setdefault("options", {})
            if isinstance(opts, dict):
                opts.setdefault("num_thread", 1)
                n = opts.get("num_predict")
                if n is None or (isinstance(n, int) and not isinstance(n, bool) and (n < 0 or n > MAX_TOKENS)):
                    opts["num_predict"] = MAX_TOKENS
        else:
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                n = body.get(key)
                if isinstance(n, int) and not isinstance(n, bool) and n > MAX_TOKENS:
                    body[key] = MAX_TOKENS
            if "max_output_tokens" not in body and path == "/v1/responses":
                body["max_output_tokens"] = MAX_TOKENS
            elif "max_tokens" not in body and "max_completion_tokens" not in body and path != "/v1/responses":
                body["max_tokens"] = MAX_TOKENS

    def check(case, r) -> list[str]:
        out = []
        status, media = r.status_code, content_type(r).split(";")[0].strip()
        if status >= 500 and status not in ALLOWED_5XX:
            out.append(f"server error {status}")
        try:
            case.validate_response(r, checks=[status_code_conformance, content_type_conformance,
                                              response_schema_conformance])
        except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - schemathesis' failures, reported as text
            parts = e.exceptions if isinstance(e, BaseExceptionGroup) else [e]
            out += [f"{type(p).__name__}: {p}" for p in parts]
        text = r.content.decode("utf-8", "replace")
        if status >= 400 and NOT_A_SENTENCE.search(text):
            out.append("the error is not a sentence for a person")
        if media == "application/x-ndjson" and status == 200:
            sch = line_schema(case.operation, status, media)
            lines = [ln for ln in text.splitlines() if ln.strip()]
            for i, ln in enumerate(lines):
                try:
                    obj = json.loads(ln)
                    jsonschema.validate(obj, sch, cls=jsonschema.Draft202012Validator)
                except (ValueError, jsonschema.ValidationError) as e:
                    out.append(f"NDJSON line {i} does not validate: {str(e)[:300]}")
                    break
                if isinstance(obj, dict) and "error" in obj:
                    if i != len(lines) - 1:
                        out.append(f"NDJSON error on line {i} is not the last line")
                    if NOT_A_SENTENCE.search(str(obj["error"])):
                        out.append("the stream's error is not a sentence for a person")
        if media == "text/event-stream" and status == 200 and NOT_A_SENTENCE.search(text):
            out.append("the stream's error is not a sentence for a person")
        return out

    def fuzz(operation, mode) -> None:
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  derandomize=os.environ.get("JUPYTER_LLAMA_FUZZ_RANDOM") != "1",
                  suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
        @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
        def one(case, data):
            nonlocal made
            bounded(case, data.draw)
            # nothing that llama-server might fetch (an image_url): no traffic off this machine
            sent = json.dumps(case.body, default=str)
            hypothesis.assume(all(sent.startswith(LOOPBACK, m.end() - 7) for m in re.finditer("://", sent)))
            try:
                r = case.call(base_url=llama_url, session=session, headers=auth, timeout=120)
            except Exception as e:  # noqa: BLE001 - a hang or a dropped connection is a finding too
                failures.append(f"{case.method} {case.formatted_path}: {type(e).__name__}: {e}\n"
                                f"  body: {shown(case.body)}")
                return
            made += 1
            found = check(case, r)
            if log is not None:
                log.write(json.dumps({"op": f"{case.method} {case.operation.path}", "mode": mode.value,
                                      "status": r.status_code, "query": case.query, "path": case.path_parameters,
                                      "body": case.body if isinstance(case.body, (dict, list)) else shown(case.body),
                                      "answer": r.content[:3000].decode("utf-8", "replace"), "found": found},
                                     default=repr) + "\n")
            if found:
                failures.append(f"{case.method} {case.formatted_path} ({mode.value}) -> {r.status_code} "
                                f"{content_type(r)}\n  query: {case.query}\n  body: {shown(case.body)}\n"
                                f"  answer: {r.content[:400]!r}\n  " + "\n  ".join(f[:1200] for f in found))
            if case.operation.path in ("/api/delete", "/api/copy", "/api/create"):
                restore()

        one()

    operations = [o.ok() for o in schema.get_all_operations()]
    operations.sort(key=lambda o: o.path == "/api/delete")  # deletes last (the store is put back anyway)
    try:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and operation.path == "/":
                    continue  # the root takes nothing, not even the token: there is no wrong request to make
                fuzz(operation, mode)
    finally:
        if log is not None:
            log.close()
    return failures, made


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.llama_config(max_loaded_models=2)
async def test_fuzz_against_the_description(http, llama_url, token):
    spec = (await http.get("api/openapi.json")).json()
    failures, made = await asyncio.to_thread(_fuzz, spec, llama_url, token)
    assert made >= 200, f"only {made} requests were made"
    assert not failures, f"{len(failures)} of {made} requests broke the description:\n\n" + "\n\n".join(failures[:40])
