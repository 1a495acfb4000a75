"""Pulls by Ollama registry name (``pull llama3.2:1b``), against tests/models/registryserver.py."""

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest

from jupyter_llama.api import ollama as oa
from jupyter_llama.engine.runner import free_port
from jupyter_llama.errors import BadRequest
from jupyter_llama.models import pull as pull_mod
from jupyter_llama.models.names import same_model
from jupyter_llama.models.preset import (
    LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    SYSTEM_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
)
from jupyter_llama.models.pull import BadManifest, HashMismatch, NotInRegistry, PullError, RegistryUnreachable
from jupyter_llama.models.registry import parse_registry_name
from jupyter_llama.models.store import MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, ModelStore

TEMPLATE = "{{ if .System }}<<{{ .System }}>> {{ end }}{{ .Prompt }}"
SYSTEM = "You are a tiny test model."
PARAMS = {"temperature": 0.25, "stop": ["<|end|>", "<|user|>"], "num_ctx": 128}
LICENSE = "Test licence: do as you like."


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def publish(reg, ggufs, name="tiny", tag="1b", model="a", system=SYSTEM, params=PARAMS, extra=()):
    layers = [(MODEL_MEDIA_TYPE, ggufs[model]), (TEMPLATE_MEDIA_TYPE, TEMPLATE.encode()),
              (SYSTEM_MEDIA_TYPE, system.encode()), (LICENSE_MEDIA_TYPE, LICENSE.encode()),
              (PARAMS_MEDIA_TYPE, json.dumps(params).encode()), *extra]
    return reg.add_model(name, tag, layers)


def paths(reg, prefix):
    return [r for r in reg.requests if urlpath(r[1]).startswith(prefix)]


def urlpath(p):
    return p.split("?", 1)[0]


def assert_clean(store: ModelStore, partials_allowed: bool = False):
    for d in (store.blobs_dir, store.manifests_dir, store.tmp_dir):
        assert not d.exists() or not any(d.rglob("*")), list(d.rglob("*"))
    if not partials_allowed:
        left = list(store.partial_dir.iterdir()) if store.partial_dir.exists() else []
        assert not left, left
    assert not store.locks_dir.exists() or not list(store.locks_dir.glob("dl-*"))


# ----------------------------------------------------------------------------- names


def test_registry_names_and_where_they_are_fetched(monkeypatch):
    monkeypatch.delenv("JUPYTER_LLAMA_REGISTRY", raising=False)
    r = parse_registry_name("llama3.2:1b")
    assert r.name.full == "registry.ollama.ai/library/llama3.2:1b" and r.text == "llama3.2:1b"
    assert r.manifest_url == "https://registry.ollama.ai/v2/library/llama3.2/manifests/1b"
    assert r.blob_url("ab" * 32) == f"https://registry.ollama.ai/v2/library/llama3.2/blobs/sha256:{'ab' * 32}"
    assert parse_registry_name("llama3").manifest_url.endswith("/v2/library/llama3/manifests/latest")
    r = parse_registry_name("me/model:v2")
    assert r.name.full == "registry.ollama.ai/me/model:v2" and r.text == "me/model:v2"
    r = parse_registry_name("example.com:5000/team/m:q4")
    assert r.base == "https://example.com:5000" and r.name.full == "example.com:5000/team/m:q4"
    assert r.text == "example.com:5000/team/m:q4"
    # http only where it is configured: a name with that host uses the configured URL
    monkeypatch.setenv("JUPYTER_LLAMA_REGISTRY", "http://127.0.0.1:5999/")
    r = parse_registry_name("tiny")
    assert r.base == "http://127.0.0.1:5999" and r.name.full == "127.0.0.1:5999/library/tiny:latest"
    assert parse_registry_name("127.0.0.1:5999/library/tiny:v1").base == "http://127.0.0.1:5999"
    assert parse_registry_name("127.0.0.1:6000/library/tiny:v1").base == "https://127.0.0.1:6000"
    assert pull_mod.derive_name("tiny").full == "127.0.0.1:5999/library/tiny:latest"
    assert pull_mod.derive_name("tiny", "mine").display == "mine:latest"
    for bad, msg in [("local/library/tiny", "made on this machine"), ("a/b/c/d", "too many parts"),
                     ("~/m.gguf", "a file on this machine"), ("tiny:", "empty tag")]:
        with pytest.raises(PullError, match=msg):
            pull_mod.parse_source(bad)
    monkeypatch.setenv("JUPYTER_LLAMA_REGISTRY", "ftp://example.com")
    with pytest.raises(BadRequest, match="JUPYTER_LLAMA_REGISTRY must be the http"):
        pull_mod.parse_source("tiny")


# ----------------------------------------------------------------------------- pulls


def test_pull_by_name_end_to_end(registry, ggufs, store):
    manifest = publish(registry, ggufs)
    events = []
    e = pull_mod.pull("tiny:1b", progress=events.append, store=store)
    host = registry.host
    assert e.name.full == f"{host}/library/tiny:1b" and e.display == "tiny:1b"  # shown as Ollama shows it
    assert e.manifest_path == store.manifests_dir / host / "library" / "tiny" / "1b"
    assert [ly["digest"] for ly in e.layers] == [ly["digest"] for ly in manifest["layers"]]
    assert [ly["mediaType"] for ly in e.layers] == [ly["mediaType"] for ly in manifest["layers"]]
    assert e.model_digest == sha256(Path(ggufs["a"]).read_bytes())
    assert e.source["type"] == "registry" and e.source["name"] == "tiny:1b" and e.source["registry"] == registry.url
    assert e.source["config"]["digest"] == manifest["config"]["digest"]

    # the protocol: the manifest with the v2 Accept header, each blob through its redirect to the CDN
    (m,) = paths(registry, "/v2/library/tiny/manifests/")
    assert urlpath(m[1]) == "/v2/library/tiny/manifests/1b"
    assert "application/vnd.docker.distribution.manifest.v2+json" in m[2]["Accept"]
    for ly in manifest["layers"]:
        hexd = ly["digest"][7:]
        assert len([r for r in paths(registry, "/v2/library/tiny/blobs/") if hexd in r[1]]) == 1
        assert len([r for r in paths(registry, "/cdn/") if hexd in r[1]]) == 1
        assert registry.blob_sent(hexd) == ly["size"]
    assert registry.blob_sent(manifest["config"]["digest"][7:]) == 0  # the config blob is not needed

    # Ollama's progress statuses
    statuses = [ev["status"] for ev in events]
    assert statuses[0] == "pulling manifest" and statuses[-2:] == ["writing manifest", "success"]
    assert statuses.count("verifying sha256 digest") == len(manifest["layers"])
    for ly in manifest["layers"]:
        mine = [ev for ev in events if ev.get("digest") == ly["digest"] and "total" in ev]
        assert mine[0]["status"] == f"pulling {ly['digest'][7:19]}"
        assert mine[-1]["completed"] == mine[-1]["total"] == ly["size"]

    # the preset: show returns it (by the short name too), and requests get it
    shown = store.show("tiny:1b")
    assert shown["preset"]["template"] == TEMPLATE and shown["preset"]["system"] == SYSTEM
    assert shown["preset"]["parameters"] == PARAMS and shown["preset"]["license"] == [LICENSE]
    body = oa.show_body(shown)
    assert body["system"] == SYSTEM and body["template"] == TEMPLATE
    assert body["parameters"].split("\n")[0].split() == ["temperature", "0.25"]
    req = oa.parse_generate({"model": "tiny:1b", "prompt": "hi"}, preset=store.preset_for("tiny:1b"))
    assert req.default_system == SYSTEM and req.template is not None
    assert req.sampling["temperature"] == 0.25 and req.sampling["stop"] == PARAMS["stop"]
    assert req.options.num_ctx == 128
    ref = asyncio.run(store.resolve("tiny:1b"))
    assert ref.path == str(store.blob_path(e.model_digest)) and ref.name == e.display
    assert list(store.partial_dir.iterdir()) == [] and os.listdir(store.tmp_dir) == []
    assert "jupyter-llama pull tiny:1b" in e.repair_hint()


def test_a_bare_name_pulls_latest_and_finds_the_pulled_model(registry, ggufs, store):
    publish(registry, ggufs, tag="latest")
    e = pull_mod.pull("tiny", store=store)
    assert urlpath(paths(registry, "/v2/library/tiny/manifests/")[0][1]) == "/v2/library/tiny/manifests/latest"
    full = f"{registry.host}/library/tiny:latest"
    assert e.name.full == full and e.display == "tiny:latest"
    assert [x.display for x in store.list()] == ["tiny:latest"]
    for name in ("tiny", "tiny:latest", "library/tiny", "TINY", full):
        assert store.entry(name).manifest_path == e.manifest_path and store.entry(name).display == "tiny:latest"
    store.copy("tiny", "mine")  # a copy records its parent by the name that lasts: the full one
    assert store.entry("mine").source["from_model"] == full
    store.remove_sync("mine")
    assert same_model("tiny", full) and same_model(full, "TINY:latest")
    assert not same_model("tiny:v2", full) and not same_model("hf.co/x/tiny", full)
    # a model made here under the bare name (in another case) comes first; beside it, the pulled
    # one is shown by its full name, which still finds it
    store.create("Tiny", ggufs["b"])
    assert store.entry("tiny").manifest_path != e.manifest_path and store.entry("tiny").display == "Tiny:latest"
    assert store.entry(full).manifest_path == e.manifest_path and store.entry(full).display == full
    assert sorted(x.display for x in store.list()) == sorted(["Tiny:latest", full])
    assert asyncio.run(store.resolve(full)).name == full
    store.remove_sync("tiny")
    assert store.entry("tiny").manifest_path == e.manifest_path and store.entry("tiny").display == "tiny:latest"
    store.remove_sync("tiny")  # the bare name removes the pulled model when it is the only one
    assert store.list() == [] and os.listdir(store.blobs_dir) == []


def test_a_registry_that_hands_out_pull_tokens(registry, ggufs, store):
    """Docker's token protocol, anonymously: the 401's challenge names a token service, whose
    token goes with every request to the registry (the manifest and each blob)."""
    manifest = publish(registry, ggufs)
    registry.pull_tokens = True
    e = pull_mod.pull("tiny:1b", store=store, retries=1, backoff=0.01)
    assert e.model_digest == sha256(Path(ggufs["a"]).read_bytes()) and e.display == "tiny:1b"
    assert registry.token_requests == [{"service": "test-registry", "scope": "repository:library/tiny:pull"}]
    v2 = paths(registry, "/v2/")
    assert v2[0][2].get("Authorization") is None and v2[1:], v2  # asked first without a token
    assert all(r[2].get("Authorization") == "Bearer tok-1" for r in v2[1:])
    assert len(paths(registry, "/cdn/")) == len(manifest["layers"])  # (on the registry's own origin here, so
    # the token goes along; the opener drops it on a redirect to another origin, as for the Hub)

    # a token that expires part-way (after the manifest and one layer) is renewed, and the pull goes on
    store2 = ModelStore(store.root.parent / "store2")
    registry.tokens.clear(), registry.token_requests.clear()
    registry.token_uses = 2
    e2 = pull_mod.pull("tiny:1b", store=store2, retries=0)  # a renewal is not a failed try
    assert e2.digest == e.digest and len(registry.token_requests) >= 2

    # a registry that guards only its blobs gets its token asked for there
    registry.token_uses = None
    registry.tokens.clear(), registry.token_requests.clear()
    registry.guard_manifests = False
    e3 = pull_mod.pull("tiny:1b", store=ModelStore(store.root.parent / "store2b"), retries=0)
    assert e3.digest == e.digest and len(registry.token_requests) == 1
    registry.guard_manifests = True
    # a token a header cannot carry is not used
    registry.tokens.clear(), registry.token_requests.clear()
    registry.token_value = "bad\r\ntoken"
    with pytest.raises(PullError, match=r"refused tiny:1b \(HTTP 401") as bad:
        pull_mod.pull("tiny:1b", store=ModelStore(store.root.parent / "store2c"), retries=0)
    assert "bad" not in str(bad.value)
    registry.token_value = None

    # a token service that refuses: the registry's refusal, in words; one that fails: try again
    registry.token_status = 401
    registry.tokens.clear()
    with pytest.raises(PullError, match=r"refused tiny:1b \(HTTP 401.*anonymous pull token"):
        pull_mod.pull("tiny:1b", store=ModelStore(store.root.parent / "store3"), retries=0)
    registry.token_status = 503
    with pytest.raises(PullError, match=r"token service .* answered HTTP 503 .*try the pull again"):
        pull_mod.pull("tiny:1b", store=ModelStore(store.root.parent / "store4"), retries=0)


def test_a_token_service_is_asked_over_tls_when_the_registry_is():
    from jupyter_llama.models import registry as reg

    ch = reg.bearer_challenge('Bearer realm="https://auth.example/token",service="reg.example",'
                              'scope="repository:library/tiny:pull"')
    assert ch == {"realm": "https://auth.example/token", "service": "reg.example",
                  "scope": "repository:library/tiny:pull"}
    assert reg.token_url(ch) == "https://auth.example/token?service=reg.example&scope=repository%3Alibrary%2Ftiny%3Apull"
    assert reg.tls_kept(reg.token_url(ch), "https://reg.example")
    assert not reg.tls_kept("http://auth.example/token", "https://reg.example")
    assert not reg.tls_kept("ftp://auth.example/token", "http://127.0.0.1:1")
    assert reg.token_url({"realm": "http://127.0.0.1:1/token?x=1"}) == "http://127.0.0.1:1/token?x=1"
    assert reg.tls_kept("http://127.0.0.1:1/token?x=1", "http://127.0.0.1:1")
    assert reg.bearer_challenge('Basic realm="x"') is None and reg.bearer_challenge("Bearer") is None


async def test_a_loaded_pulled_model_is_listed_by_the_name_it_is_shown_by(registry, ggufs, store, engine):
    """ps names a loaded model as tags does: once the model made here under the bare name is
    gone, the pulled one, loaded by its full name, is shown (and listed) by the bare name."""
    from jupyter_llama.load_options import LoadOptions
    from jupyter_llama.scheduler import Scheduler, SchedulerSettings

    publish(registry, ggufs, tag="latest")
    full = pull_mod.pull("tiny", store=store).name.full
    store.create("tiny", ggufs["b"])
    sched = Scheduler(SchedulerSettings(binary=engine.path), resolver=store.resolve)
    try:
        lease = await sched.acquire(full, LoadOptions(num_ctx=256, num_parallel=1), keep_alive="5m")
        lease.release()
        assert [m["name"] for m in sched.ps()] == [full]
        store.create("tiny", ggufs["c"])  # the model made here changes: the pulled one, by its full name, stays
        assert await sched.name_changed("tiny") == [] and [m["name"] for m in sched.ps()] == [full]
        store.remove_sync("tiny")
        assert await sched.name_changed("tiny") == []  # the same file: kept, and shown as tags shows it
        assert [m["name"] for m in sched.ps()] == ["tiny:latest"] == [e.display for e in store.list()]
        store.create("tiny", ggufs["b"])  # a model made here takes the bare name: the full name again
        assert await sched.name_changed("tiny") == [] and [m["name"] for m in sched.ps()] == [full]
        store.remove_sync("tiny")
        store.remove_sync(full)  # and once its file is gone, so is the runner
        assert await sched.name_changed(full) == [full] and sched.ps() == []
        pull_mod.pull("tiny", store=store)  # loaded by the bare name, then a model made here takes it: retired
        lease = await sched.acquire("tiny", LoadOptions(num_ctx=256, num_parallel=1), keep_alive="5m")
        lease.release()
        assert [m["name"] for m in sched.ps()] == ["tiny:latest"]
        store.create("tiny", ggufs["b"])
        assert await sched.name_changed("tiny") == ["tiny:latest"] and sched.ps() == []
    finally:
        await sched.shutdown()


def test_a_dropped_connection_resumes_with_range(registry, ggufs, store):
    manifest = publish(registry, ggufs, model="big")
    model = manifest["layers"][0]
    hexd, size = model["digest"][7:], model["size"]
    f = registry.blob_file(hexd)
    half = size // 2
    f.drop_after, f.drop_times = half, 1
    with pytest.raises(PullError) as ei:
        pull_mod.pull("tiny:1b", retries=0, store=store)
    assert "partial download is kept" in str(ei.value) and "pull again to resume" in str(ei.value)
    partial = store.partial_dir / f"sha256-{hexd}.partial"
    assert partial.stat().st_size == half and store.list() == []
    sent = registry.blob_sent(hexd)
    e = pull_mod.pull("tiny:1b", store=store)
    assert registry.blob_sent(hexd) - sent == size - half
    last_blob, last_cdn = [r for r in registry.requests if hexd in r[1]][-2:]
    assert urlpath(last_blob[1]).startswith("/v2/") and urlpath(last_cdn[1]).startswith("/cdn/")
    assert last_cdn[2].get("Range") == f"bytes={half}-" and last_cdn[2].get("If-Range") == f.etag
    assert e.model_digest == hexd and store.blob_path(hexd).read_bytes() == Path(ggufs["big"]).read_bytes()
    assert not partial.exists()


def test_retries_pick_up_where_the_connection_dropped(registry, ggufs, store):
    manifest = publish(registry, ggufs, model="big")
    hexd = manifest["layers"][0]["digest"][7:]
    registry.blob_file(hexd).drop_after, registry.blob_file(hexd).drop_times = 700_000, 2
    pull_mod.pull("tiny:1b", retries=3, backoff=0.01, store=store)
    ranges = [r[2].get("Range") for r in paths(registry, "/cdn/") if hexd in r[1]]
    assert ranges == [None, "bytes=700000-", "bytes=1400000-"]
    assert registry.blob_sent(hexd) == manifest["layers"][0]["size"]  # every byte once


def test_a_digest_mismatch_is_discarded(registry, ggufs, store):
    manifest = publish(registry, ggufs)
    model = manifest["layers"][0]["digest"][7:]
    registry.corrupt(model)
    with pytest.raises(HashMismatch) as ei:
        pull_mod.pull("tiny:1b", store=store)
    assert ei.value.status == 502 and "sha256 mismatch" in str(ei.value) and "discarded" in str(ei.value)
    assert_clean(store)


def test_a_later_layer_failing_leaves_only_resumable_partials(registry, ggufs, store):
    """The model landed, then the params layer failed: the model goes back to partial/, whole,
    and the next pull finishes it without downloading it again."""
    manifest = publish(registry, ggufs)
    layers = manifest["layers"]
    params = layers[-1]
    assert params["mediaType"] == PARAMS_MEDIA_TYPE
    registry.corrupt(params["digest"][7:])
    with pytest.raises(HashMismatch):
        pull_mod.pull("tiny:1b", store=store)
    assert_clean(store, partials_allowed=True)
    kept = {p.name: p.stat().st_size for p in store.partial_dir.glob("*.partial")}
    assert kept == {f"sha256-{ly['digest'][7:]}.partial": ly["size"] for ly in layers[:-1]}
    sent = registry.total_blob_bytes_sent()
    registry.restore(params["digest"][7:])
    e = pull_mod.pull("tiny:1b", store=store)
    assert registry.total_blob_bytes_sent() - sent == params["size"]  # only the layer that failed
    assert [ly["digest"] for ly in e.layers] == [ly["digest"] for ly in layers]
    assert list(store.partial_dir.iterdir()) == []
    assert store.show("tiny:1b", verify=True)["verify"]["ok"]


def test_an_unknown_name_or_tag_is_a_404(registry, ggufs, store):
    publish(registry, ggufs)
    for name, shown in [("nosuch", "nosuch:latest"), ("tiny:9b", "tiny:9b"), ("someone/tiny:1b", "someone/tiny:1b")]:
        with pytest.raises(NotInRegistry) as ei:
            pull_mod.pull(name, store=store)
        assert ei.value.status == 404
        assert f'model "{shown}" not found in registry {registry.url}' in str(ei.value)
    assert registry.total_blob_bytes_sent() == 0
    assert_clean(store)


def test_pulling_again_downloads_only_what_is_missing(registry, ggufs, store):
    manifest = publish(registry, ggufs)
    first = pull_mod.pull("tiny:1b", store=store)
    sent = registry.total_blob_bytes_sent()
    events = []
    again = pull_mod.pull("tiny:1b", progress=events.append, store=store)
    assert registry.total_blob_bytes_sent() == sent, "nothing downloaded"
    assert len(paths(registry, "/v2/library/tiny/manifests/")) == 2, "the manifest is checked again"
    assert again.digest == first.digest and again.created_at == first.created_at
    for ly in manifest["layers"]:  # each layer still reported, complete
        assert any(ev.get("digest") == ly["digest"] and ev.get("completed") == ly["size"] for ev in events)
    # the tag now has another system prompt: only that layer is fetched, the old one is dropped
    old_system = manifest["layers"][2]["digest"][7:]
    newer = publish(registry, ggufs, system="You are a newer tiny model.")
    e = pull_mod.pull("tiny:1b", store=store)
    new_system = newer["layers"][2]["digest"][7:]
    assert registry.total_blob_bytes_sent() - sent == newer["layers"][2]["size"]
    assert store.show("tiny:1b")["preset"]["system"] == "You are a newer tiny model."
    assert e.model_digest == first.model_digest
    assert store.blob_path(new_system).exists() and not store.blob_path(old_system).exists()


@pytest.mark.parametrize("override,msg", [
    ((200, "application/vnd.docker.distribution.manifest.v1+prettyjws",
      json.dumps({"schemaVersion": 1, "name": "library/tiny", "fsLayers": []}).encode()), "not a v2 manifest"),
    ((200, "application/vnd.docker.distribution.manifest.list.v2+json",
      json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
                  "manifests": []}).encode()), "manifest list"),
    ((200, "text/html", b"<!doctype html><p>Sign in</p>"), "is not JSON"),
    ((200, "application/vnd.docker.distribution.manifest.v2+json",
      json.dumps({"schemaVersion": 2, "layers": [{"mediaType": MODEL_MEDIA_TYPE, "digest": "md5:x",
                                                  "size": 1}]}).encode()), "sha256:<64 hex> digest"),
])
def test_a_manifest_that_is_not_v2_is_refused(registry, ggufs, store, override, msg):
    publish(registry, ggufs)
    registry.manifest_override[("library/tiny", "1b")] = override
    with pytest.raises(BadManifest, match=msg) as ei:
        pull_mod.pull("tiny:1b", store=store)
    assert ei.value.status == 502 and f"the manifest of tiny:1b from {registry.url}" in str(ei.value)
    assert_clean(store)


def test_a_client_that_does_not_ask_for_v2_gets_no_v2(registry, ggufs):
    """The server's Accept check (what makes the header matter): without it, schema 1."""
    import urllib.request

    publish(registry, ggufs)
    with urllib.request.urlopen(f"{registry.url}/v2/library/tiny/manifests/1b") as r:
        assert json.loads(r.read())["schemaVersion"] == 1


def test_models_the_store_cannot_hold_are_refused_before_downloading(registry, ggufs, projectors, store):
    registry.add_model("lora", "latest", [(MODEL_MEDIA_TYPE, ggufs["a"]),
                                          ("application/vnd.ollama.image.adapter", ggufs["b"])])
    with pytest.raises(PullError, match="LoRA adapter layer"):
        pull_mod.pull("lora", store=store)
    registry.add_model("notmodel", "latest", [(TEMPLATE_MEDIA_TYPE, b"{{ .Prompt }}")])
    with pytest.raises(PullError, match="no GGUF model layer"):
        pull_mod.pull("notmodel", store=store)
    assert registry.total_blob_bytes_sent() == 0
    assert_clean(store)
    # a projector and messages come along; a layer of a type we do not know is skipped, and said so
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    registry.add_model("vision", "latest", [(MODEL_MEDIA_TYPE, ggufs["a"]), (PROJECTOR_MEDIA_TYPE, projectors["f16"]),
                                            (MESSAGES_MEDIA_TYPE, json.dumps(msgs).encode()),
                                            ("application/vnd.ollama.image.future", b"?")])
    events = []
    e = pull_mod.pull("vision", progress=events.append, store=store)
    assert e.projector_digest == hashlib.sha256(Path(projectors["f16"]).read_bytes()).hexdigest()
    assert store.preset("vision").messages == msgs
    assert e.source["skipped_layers"] == ["application/vnd.ollama.image.future"]
    assert any("skipping a layer of type application/vnd.ollama.image.future" in ev["status"] for ev in events)
    assert asyncio.run(store.resolve("vision")).mmproj == str(store.blob_path(e.projector_digest))


def test_a_params_layer_that_is_not_json_is_refused(registry, ggufs, store):
    registry.add_model("badparams", "latest", [(MODEL_MEDIA_TYPE, ggufs["a"]), (PARAMS_MEDIA_TYPE, b"temperature 1")])
    with pytest.raises(BadManifest,
                       match=r"badparams:latest \(params layer sha256:\w+\): the params layer is unreadable"):
        pull_mod.pull("badparams", store=store)
    assert not any(store.manifests_dir.rglob("*")) and not any(store.blobs_dir.iterdir())


def test_an_unreachable_registry(monkeypatch, store):
    monkeypatch.setenv("JUPYTER_LLAMA_REGISTRY", f"http://127.0.0.1:{free_port()}")  # nobody listens there
    with pytest.raises(RegistryUnreachable) as ei:
        pull_mod.pull("tiny", retries=1, backoff=0.01, store=store)
    assert ei.value.status == 502
    assert "cannot reach the registry http://127.0.0.1:" in str(ei.value) and "tried 2 times" in str(ei.value)
    assert_clean(store)


async def test_two_pulls_of_one_name_at_once_download_once(registry, ggufs, store):
    manifest = publish(registry, ggufs, model="big")
    model = manifest["layers"][0]
    registry.blob_file(model["digest"][7:]).rate = model["size"] / 1.0

    async def run():
        return [s async for s in pull_mod.pull_stream("tiny:1b", store=store)]

    a, b = await asyncio.gather(run(), run())
    assert a[-1] == b[-1] == {"status": "success"}
    assert registry.blob_sent(model["digest"][7:]) == model["size"]


def test_insecure_pulls_a_name_with_its_own_host_over_http(registry, ggufs, store, monkeypatch):
    """Ollama's pull option ``insecure``: a registry on a private network without TLS."""
    publish(registry, ggufs)
    monkeypatch.setenv("JUPYTER_LLAMA_REGISTRY", "https://registry.example.invalid")  # not the test registry
    name = f"{registry.host}/library/tiny:1b"
    assert parse_registry_name(name, insecure=True).base == f"http://{registry.host}"
    assert parse_registry_name(name).base == f"https://{registry.host}"
    with pytest.raises(PullError):
        pull_mod.pull(name, store=store, retries=0)  # TLS to a plain-http server
    e = pull_mod.pull(name, store=store, insecure=True)
    assert e.name.full == name and e.source["type"] == "registry"
