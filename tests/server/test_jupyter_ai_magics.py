"""jupyter-ai's ``%%ai`` magic (package ``jupyter-ai-magics``) in a real kernel that the Jupyter
server running this extension starts (``POST /api/kernels``), with no configuration: the
kernel finds this server through the variables the extension exports (OLLAMA_HOST and
OLLAMA_API_KEY, OPENAI_BASE_URL and OPENAI_API_KEY). The test watches the requests the server
receives (tornado's ``log_function``) and replays the kernel's own request to check the cell's
answer is this server's.

The kernel runs in its own environment, ``.venv-jupyter-ai`` (``make test`` makes it from
``jupyter-ai-kernel.txt``), as a user's kernel with jupyter-ai would: the 2.x line pins
``langchain<0.4`` (langchain-ollama and langchain-openai 0.3.x), while this suite's own clients
are the current ones. Without that environment the test skips, saying how to make it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from srvutil import OPTS

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
AI_PYTHON = ROOT / ".venv-jupyter-ai" / "bin" / "python"
KERNEL = "jupyter-ai-2"

# No spaces inside the JSON: %%ai splits its line on single spaces.
CASES = {
    "ollama": ("langchain_ollama", "api/chat",
               {"num_predict": 4, "temperature": 0, "num_ctx": OPTS["num_ctx"], "num_thread": OPTS["num_thread"]}),
    "openai-chat-custom": ("langchain_openai", "v1/chat/completions", {"max_tokens": 4, "temperature": 0}),
}


def _kernel_can_import(module: str) -> bool:
    """Whether the kernel's environment has ``module``."""
    return subprocess.run([str(AI_PYTHON), "-c", f"import {module}"], capture_output=True).returncode == 0


async def _run(kc, code: str, timeout: float = 120) -> tuple[dict, list[dict]]:
    outputs: list[dict] = []

    def hook(msg):
        if msg["msg_type"] in ("stream", "execute_result", "display_data", "error"):
            outputs.append({"type": msg["msg_type"], **msg["content"]})

    reply = await kc.execute_interactive(code, output_hook=hook, timeout=timeout, allow_stdin=False)
    return reply["content"], outputs


@pytest.fixture
def ai_kernelspec(jp_data_dir):
    """The kernelspec of the jupyter-ai environment, where this server's kernel specs are."""
    if not AI_PYTHON.exists() or not _kernel_can_import("jupyter_ai_magics"):
        pytest.skip(f"no jupyter-ai kernel environment at {AI_PYTHON.parent.parent} (make it with `make ai-kernel`; "
                    "`make test` tries to)")
    spec = jp_data_dir / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(AI_PYTHON), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (jupyter-ai 2.x)", "language": "python",
        # pytest-jupyter hands its kernels the test's sys.path; a user's kernel has its own
        "env": {"PYTHONPATH": ""}}))
    return KERNEL


@pytest.fixture
async def server_kernel(jp_serverapp, jp_fetch, http, ai_kernelspec):
    """A kernel the server starts, as JupyterLab's "new notebook" does, and a client to it."""
    await http.get("api/version")  # the extension has started and exported its variables
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": ai_kernelspec}))
    kid = json.loads(r.body)["id"]
    km = jp_serverapp.kernel_manager.get_kernel(kid)
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=120)
        yield kc
    finally:
        kc.stop_channels()
        await jp_serverapp.kernel_manager.shutdown_kernel(kid, now=True)


@pytest.mark.parametrize("provider", list(CASES))
async def test_ai_magic_works_unconfigured_in_a_kernel_the_server_starts(provider, server_kernel, jp_serverapp,
                                                                           ext, token, http, monkeypatch):
    module, route, params = CASES[provider]
    assert _kernel_can_import(module), f"{module} is missing from {AI_PYTHON.parent.parent}: `make ai-kernel`"
    seen: list[tuple[str, str, int, str, bytes]] = []
    log = jp_serverapp.web_app.settings["log_function"]

    def watch(handler):
        req = handler.request
        seen.append((req.method, req.path, handler.get_status(), req.headers.get("Authorization", ""), req.body))
        log(handler)

    monkeypatch.setitem(jp_serverapp.web_app.settings, "log_function", watch)

    # the kernel has no setting of its own: what it has, it inherited from the server
    content, out = await _run(server_kernel, "import os; print(os.environ.get('OLLAMA_HOST'), "
                                             "os.environ.get('OPENAI_BASE_URL'))")
    assert content["status"] == "ok", out
    assert out[0]["text"].split() == [ext.url.rstrip("/"), os.environ["OPENAI_BASE_URL"]]

    content, out = await _run(server_kernel, "%load_ext jupyter_ai_magics")
    assert content["status"] == "ok", out

    cell = f"%%ai {provider}:tiny -f text -m {json.dumps(params, separators=(',', ':'))}\nOnce upon a time"
    content, out = await _run(server_kernel, cell)
    assert content["status"] == "ok", out
    results = [o for o in out if o["type"] == "execute_result"]
    assert results, f"no answer: {out}"
    answer = results[0]["data"]["text/plain"]
    print(f"{cell!r} -> {answer!r}")
    # not "Cannot determine model provider" (the provider did not load: see the warnings in its log)
    assert results[0]["metadata"].get("jupyter_ai") == {"provider_id": provider, "model_id": "tiny"}, answer

    # the server got the request, with the exported token, and answered it
    ours = [s for s in seen if s[0] == "POST" and s[1].endswith("/llama/" + route)]
    assert len(ours) == 1, [s[:3] for s in seen]
    _, _, status, auth, body = ours[0]
    assert status == 200 and auth == f"Bearer {token}"
    sent = json.loads(body)
    assert sent["model"] == "tiny"
    assert any("Once upon a time" in str(m.get("content")) for m in sent["messages"])
    events = (await http.get("api/events", params={"model": "tiny"})).json()["events"]
    assert [e["kind"] for e in events if e["kind"] in ("load", "loaded")] == ["load", "loaded"]

    # the same request again, straight to the server: the same (greedy) answer, 4 tokens long
    sent["stream"] = False
    sent.pop("stream_options", None)
    again = (await http.post(route, json=sent)).json()
    if route == "api/chat":
        assert again["eval_count"] == 4 and again["done_reason"] == "length"
        assert again["message"]["content"] == answer
    else:
        assert again["usage"]["completion_tokens"] == 4 and again["choices"][0]["finish_reason"] == "length"
        assert again["choices"][0]["message"]["content"] == answer
