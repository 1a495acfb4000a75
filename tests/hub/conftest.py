"""A real JupyterHub with configurable-http-proxy and jupyter-llama as its managed service,
one per test module (see hubutil.py); its tests skip, saying why, without JupyterHub or the proxy."""

from __future__ import annotations

import pytest
from hubutil import missing, start_hub

# The Hub's users, and the service's settings for them (c.LlamaHub).
USERS = ["alice", "bob", "carol", "dave", "erin", "admin"]
GROUPS = {"staff": ["carol"]}
SERVICE_CONFIG = {
    "admin_users": ["admin"],
    "quotas": {
        "default": {"concurrent": 8, "models": 1},
        "groups": {"staff": {"models": 3}},
        "users": {"dave": {"per_minute": 3}, "erin": {"concurrent": 1}},
    },
}


@pytest.fixture(scope="module")
def hub(engine, make_model, tmp_path_factory):
    """The Hub, its users and groups, and a shared model ``tiny`` in the service's library
    (a skip, saying what is missing, without JupyterHub or configurable-http-proxy)."""
    from jupyter_llama.models.store import ModelStore

    why = missing()
    if why is not None:
        pytest.skip(why)

    root = tmp_path_factory.mktemp("hub")
    models = root / "models"
    store = ModelStore(models)
    store.create("tiny", str(make_model("hub-tiny", layers=2, embd=64, heads=4, kv_heads=2, ctx=2048, seed=3)))
    store.create("other", str(make_model("hub-other", layers=2, embd=64, heads=4, kv_heads=2, ctx=2048, seed=4)))
    h = start_hub(root, engine_path=engine.path, models_dir=models, service_config=SERVICE_CONFIG,
                  service_env={"JUPYTER_LLAMA_NUM_PARALLEL": "1"})
    try:
        h.add_users(USERS, GROUPS)
        yield h
    finally:
        h.stop()
