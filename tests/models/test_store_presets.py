"""Presets in the store: Ollama's media-type layers beside the weights, shared weights, merging."""

from __future__ import annotations

import json
import os

import pytest
from conftest import TINY

from jupyter_llama.models.preset import (
    LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    SYSTEM_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    Preset,
)
from jupyter_llama.models.store import MODEL_MEDIA_TYPE, BlobCorrupt, ModelStore
from jupyter_llama.models.synth import SynthShape, write_synthetic


@pytest.fixture
def store(tmp_path):
    s = ModelStore(tmp_path / "store")
    s.create("tiny", write_synthetic(tmp_path / "tiny.gguf", SynthShape(**TINY)))
    return s


def blobs(store: ModelStore) -> dict[str, int]:
    return {n: os.path.getsize(store.blobs_dir / n) for n in os.listdir(store.blobs_dir)}


def test_a_preset_is_stored_as_ollamas_layers_and_shares_the_weights(store):
    before = blobs(store)
    tiny = store.entry("tiny")
    mario = store.copy("tiny", "mario", preset=Preset(
        system="You are Mario", template="{{ .Prompt }}", parameters={"temperature": 0.5, "stop": ["###"]},
        messages=[{"role": "user", "content": "hi"}], license=["MIT"]))
    types = [ly["mediaType"] for ly in mario.layers]
    assert types == [MODEL_MEDIA_TYPE, TEMPLATE_MEDIA_TYPE, SYSTEM_MEDIA_TYPE, LICENSE_MEDIA_TYPE, PARAMS_MEDIA_TYPE,
                     MESSAGES_MEDIA_TYPE]
    assert mario.model_digest == tiny.model_digest and mario.digest != tiny.digest  # same weights, another model
    added = {n: size for n, size in blobs(store).items() if n not in before}
    assert len(added) == 5 and all(size < 100 for size in added.values())  # small preset blobs, no second GGUF
    # the blobs hold what Ollama keeps in them
    by_type = {ly["mediaType"]: store.blob_path(ly["digest"]).read_bytes() for ly in mario.layers[1:]}
    assert by_type[SYSTEM_MEDIA_TYPE] == b"You are Mario"
    assert json.loads(by_type[PARAMS_MEDIA_TYPE]) == {"temperature": 0.5, "stop": ["###"]}
    assert json.loads(by_type[MESSAGES_MEDIA_TYPE]) == [{"role": "user", "content": "hi"}]
    # read back, by show, and by a request's lookup; tiny has none and a path or unknown name none either
    assert store.preset("mario").system == "You are Mario"
    shown = store.show("mario")
    assert shown["preset"]["parameters"] == {"temperature": 0.5, "stop": ["###"]}
    assert [f["role"] for f in shown["files"]] == ["model", "template", "system", "license", "params", "messages"]
    assert not store.preset("tiny") and not store.preset_for("./x.gguf") and not store.preset_for("nope")
    assert store.resolve_sync("mario").path == store.resolve_sync("tiny").path  # one runner serves both names


def test_a_preset_on_a_preset_merges_as_ollama_does(store):
    store.copy("tiny", "mario", preset=Preset(system="You are Mario", template="T1",
                                              parameters={"temperature": 0.5, "stop": ["###"]},
                                              messages=[{"role": "user", "content": "a"}], license=["MIT"]))
    store.copy("mario", "luigi", preset=Preset(system="You are Luigi", parameters={"temperature": 0.9,
                                                                                    "num_ctx": 512},
                                               license=["MIT", "Apache-2.0"]))
    p = store.preset("luigi")
    assert p.system == "You are Luigi" and p.template == "T1"  # replaced; kept
    assert p.parameters == {"temperature": 0.9, "stop": ["###"], "num_ctx": 512}  # merged, the new value wins
    assert p.messages == [{"role": "user", "content": "a"}]  # kept: none given
    assert p.license == ["MIT", "Apache-2.0"]  # added up (the same text once)
    assert store.show("luigi")["details"]["parent_model"] == "tiny:latest"
    # removing the middle model leaves luigi whole; removing both frees only what nobody uses
    store.remove_sync("mario")
    assert store.preset("luigi").template == "T1" and store.resolve_sync("luigi")
    store.copy("tiny", "same", preset=Preset(system="x", template="x"))  # one blob for two layers
    assert store.preset("same").system == store.preset("same").template == "x"


def test_a_preset_can_come_with_an_imported_file_and_a_damaged_one_says_so(store, tmp_path):
    path = write_synthetic(tmp_path / "other.gguf", SynthShape(**dict(TINY, seed=9)))
    e = store.create("other", path, preset=Preset(parameters={"num_ctx": 128}))
    assert [ly["mediaType"] for ly in e.layers] == [MODEL_MEDIA_TYPE, PARAMS_MEDIA_TYPE]
    blob = store.blob_path(e.layers[1]["digest"])
    os.chmod(blob, 0o600)
    blob.write_bytes(b'{"num_ctx": 999}')  # not what its name says
    with pytest.raises(BlobCorrupt) as err:
        store.preset("other")
    assert "does not hold what its name says" in str(err.value) or "is damaged" in str(err.value)
    shown = store.show("other", verify=True)
    assert not shown["verify"]["ok"] and shown["preset"]["parameters"] == {}
