"""The server's cache in front of the store's resolver and presets (``app.CachedResolver``),
with a real store on disk: what it answers at once, what makes it look again, and that a
look-up begun before ``forget()`` does not bring back what was forgotten."""

from __future__ import annotations

import asyncio

import pytest
from srvutil import OTHER, TINY

from jupyter_llama.models.preset import Preset
from jupyter_llama.models.store import ModelNotFound, ModelStore
from jupyter_llama.server.app import CachedResolver


async def settle(cache: CachedResolver) -> None:
    await asyncio.gather(*list(cache._refreshing.values()))


async def test_a_hit_is_answered_at_once_and_looked_up_again_behind_it(tmp_path, make_model, monkeypatch):
    store = ModelStore(tmp_path / "models")
    store.create("tiny", make_model("cache-tiny", **TINY), preset=Preset(system="first"))
    cache = CachedResolver(store, ttl=0.0)  # every hit is past its time: each one is looked up again behind it
    looks = []
    real = store.resolve_sync
    monkeypatch.setattr(store, "resolve_sync", lambda name: looks.append(name) or real(name))

    ref = await cache("tiny")
    assert looks == ["tiny"]
    again = await cache("tiny")
    assert again is ref  # the kept answer, at once
    await settle(cache)
    assert looks == ["tiny", "tiny"]  # and a look-up behind it, which replaced it
    assert (await cache("tiny")) is not ref and (await cache("tiny")).path == ref.path
    await settle(cache)

    assert (await cache.preset("tiny")).system == "first"
    # another process replaces the model (a new manifest): its stamps differ, so the next
    # request waits for the new answer rather than take the old one
    store.create("tiny", make_model("cache-other", **OTHER), preset=Preset(system="second"))
    new = await cache("tiny")
    assert new.path != ref.path
    assert (await cache.preset("tiny")).system == "second"
    await settle(cache)


async def test_forget_is_not_undone_by_a_look_up_that_was_under_way(tmp_path, make_model):
    store = ModelStore(tmp_path / "models")
    store.create("tiny", make_model("cache-tiny", **TINY))
    cache = CachedResolver(store, ttl=0.0)
    await cache("tiny")
    await cache("tiny")  # starts a look-up behind the answer
    assert cache._refreshing
    cache.forget()
    await settle(cache)
    assert cache._cache == {}  # what the look-up found was not kept: it began before forget()
    store.remove_sync("tiny")
    with pytest.raises(ModelNotFound, match="tiny"):  # the store's own words, looked up anew
        await cache("tiny")


async def test_close_ends_the_look_ups_under_way(tmp_path, make_model):
    """The server stopping ends the cache's look-ups behind answers (none outlives the loop)."""
    store = ModelStore(tmp_path / "models")
    store.create("tiny", make_model("cache-tiny", **TINY))
    cache = CachedResolver(store, ttl=0.0)
    await cache("tiny")
    await cache("tiny")
    pending = list(cache._refreshing.values())
    assert pending
    await cache.close()
    assert all(t.done() for t in pending) and not cache._refreshing and cache._cache == {}
