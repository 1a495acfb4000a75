"""Model names that are file paths (issue 17 item 11).

An HTTP client of the server may not name files on the server's disk: `{"model": "/etc/passwd"}`
used to answer "not a GGUF file (magic b'root')", telling that the file exists and how it
starts. Now such a name is refused before the file is looked at, unless the admin allows its
folder (`LlamaExtension.model_paths`). The user's own CLI, magics and widgets on this machine
still name their files: the server's 400 names a key file only that user can read, and
jupyter-llama's client sends its key back.
"""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
from srvutil import OPTS, TINY

from jupyter_llama.models.store import LOCAL_KEY_FILE_HEADER, LOCAL_KEY_HEADER

pytestmark = pytest.mark.engine


async def test_http_clients_cannot_probe_or_load_server_files(http, make_model):
    model = make_model("paths-tiny", **TINY)
    answers = {}
    for name in ("/etc/passwd", "/no/such/file.gguf", str(model), "~/x.gguf", "../x.gguf"):
        r = await http.post("api/generate", json={"model": name, "prompt": "hi", "stream": False})
        assert r.status_code == 400, (name, r.text)
        message = r.json()["error"]
        assert "HTTP clients may not name files on the server by their path" in message
        answers[name] = message.replace(name, "NAME")
        assert not any(w in answers[name] for w in ("magic", "root", "no such file", "GGUF file (")), message
    assert len(set(answers.values())) == 1  # the same answer whether or not the file exists
    for route, body in (("api/embed", {"model": "/etc/passwd", "input": "x"}),
                        ("api/create", {"model": "stolen", "from": "/etc/passwd"}),
                        ("v1/chat/completions",
                         {"model": "/etc/passwd", "messages": [{"role": "user", "content": "x"}]}),
                        ("api/show", {"model": "/etc/passwd"})):
        r = await http.post(route, json=body)
        assert r.status_code == 400 and "file path" in r.text, (route, r.status_code, r.text)
        assert "magic" not in r.text and "GGUF file (" not in r.text
    # a name that merely has a slash in it is not taken for a path: it is just not in the store
    r = await http.post("api/show", json={"model": "someone/model"})
    assert r.status_code == 404 and "file path" not in r.text


async def test_the_users_own_client_proves_itself_and_names_its_files(http, llama_url, token, make_model, ext):
    from jupyter_llama.client import AsyncLlamaClient, LlamaClient

    model = str(make_model("paths-own", **TINY))
    r = await http.post("api/generate", json={"model": model, "stream": False})
    key_file = r.headers[LOCAL_KEY_FILE_HEADER]
    st = os.stat(key_file)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert os.path.basename(key_file).startswith("jupyter-llama-local-")

    c = LlamaClient(llama_url, token)
    try:
        out = await asyncio.to_thread(c.generate, model, "Once upon a time", stream=False,
                                      options=dict(OPTS, num_predict=3))
        assert out["done"] and out["eval_count"] == 3
        streamed = await asyncio.to_thread(lambda: list(c.generate(model, "Once", options=dict(OPTS, num_predict=2))))
        assert streamed[-1]["done"]
        assert LOCAL_KEY_HEADER in c._http.headers
        # what run loads by its path, show shows by its path (it used to say "invalid model name")
        shown = await asyncio.to_thread(c.show, model)
        assert shown["details"]["family"] == "llama" and shown["model_info"]["llama.block_count"] == TINY["layers"]
        assert shown["files"] == [{"role": "model", "media_type": "application/vnd.ollama.image.model", "digest": "",
                                   "size": os.path.getsize(model), "path": model, "present": True}]
        assert "FROM " + model in shown["modelfile"] and shown["name"] == model
    finally:
        c.close()
    async with AsyncLlamaClient(llama_url, token) as ac:
        chunks = [ch async for ch in ac.generate(model, "Once", options=dict(OPTS, num_predict=2))]
        assert chunks[-1]["done"]
    # a wrong key is not a proof
    r = await http.post("api/show", json={"model": model}, headers={LOCAL_KEY_HEADER: "guess"})
    assert r.status_code == 400


async def test_an_allowed_folder_opens_paths_inside_it_only(http, make_model, ext, tmp_path):
    from jupyter_llama.models.store import ModelStore
    from jupyter_llama.server.app import path_folders

    inside = make_model("paths-inside", **TINY)
    # what model_paths=<that folder> makes (the folders are fixed when the server starts)
    ext.store.path_folders = ModelStore(ext.store.root, path_folders=path_folders(str(inside.parent))).path_folders
    r = await http.post("api/generate", json={"model": str(inside), "prompt": "Once", "stream": False,
                                              "options": dict(OPTS, num_predict=2)})
    assert r.status_code == 200 and r.json()["eval_count"] == 2
    r = await http.post("api/show", json={"model": str(inside)})
    assert r.status_code == 200 and r.json()["files"][0]["path"] == str(inside)
    gone = inside.parent / "gone.gguf"  # a file that is not there is said as such, with no advice to pull it
    r = await http.post("api/show", json={"model": str(gone)})
    assert r.status_code == 404 and r.json()["error"] == f'model "{gone}" not found: no such file {gone}'
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(inside.read_bytes())
    r = await http.post("api/generate", json={"model": str(outside), "stream": False})
    assert r.status_code == 400 and f"only files under {os.path.realpath(inside.parent)}" in r.json()["error"]
    link = inside.parent / "link-out.gguf"  # a link inside that points outside is outside
    link.symlink_to(outside)
    try:
        r = await http.post("api/generate", json={"model": str(link), "stream": False})
        assert r.status_code == 400 and "only files under" in r.text
    finally:
        link.unlink()


def test_the_setting_is_parsed_into_folders(tmp_path, monkeypatch):
    from jupyter_llama.server.app import LlamaExtension, path_folders

    monkeypatch.setenv("JUPYTER_LLAMA_MODEL_PATHS", f"{tmp_path}{os.pathsep}/srv/models ")
    assert path_folders(LlamaExtension().model_paths) == [str(tmp_path), "/srv/models"]
    assert path_folders("*") is None and path_folders("") == []
