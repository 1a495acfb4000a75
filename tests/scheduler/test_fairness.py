"""The rules of a shared manager (scheduler/fairness.py) on tables: no process, no loop."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jupyter_llama.config import ConfigError
from jupyter_llama.scheduler.fairness import (
    Holding,
    Who,
    concurrent_refusal,
    fair_eviction_order,
    load_refusal,
    over_share,
    parse_quotas,
    private_namespace,
    private_owner,
    quota_for,
    rate_refusal,
    round_robin,
)

GiB = 1 << 30

TABLE = parse_quotas({
    "default": {"memory": "2GiB", "models": 1, "concurrent": 2, "per_minute": 10},
    "groups": {"staff": {"memory": {"cuda:0": "8GiB"}, "models": 3, "per_minute": None},
               "ta": {"models": 2, "concurrent": 6}},
    "users": {"carol": {"concurrent": 1, "memory": None}},
})


@pytest.mark.parametrize("who, models, concurrent, per_minute, memory", [
    (Who("alice"), 1, 2, 10, {"*": 2 * GiB}),
    # the most generous group wins, limit by limit; "no limit" (None) is the most generous
    (Who("bob", ("staff", "ta")), 3, 6, None, {"*": 2 * GiB, "cuda:0": 8 * GiB}),
    (Who("dan", ("ta",)), 2, 6, 10, {"*": 2 * GiB}),
    # a group the table does not name changes nothing
    (Who("eve", ("physics",)), 1, 2, 10, {"*": 2 * GiB}),
    # the person's own entry wins over everything; memory null there: no memory limit
    (Who("carol", ("staff",)), 3, 1, None, {}),
])
def test_quota_for(who, models, concurrent, per_minute, memory):
    q = quota_for(who, TABLE)
    assert (q.models, q.concurrent, q.per_minute, dict(q.memory)) == (models, concurrent, per_minute, memory)


def test_quota_sources_are_named():
    q = quota_for(Who("bob", ("staff", "ta")), TABLE)
    assert q.source["models"] == "group staff" and q.source["concurrent"] == "group ta"
    assert q.memory_source("cuda:0") == "group staff" and q.memory_source("cpu") == "default"


@pytest.mark.parametrize("raw, words", [
    ({"default": {"memroy": "1G"}}, "unknown quota 'memroy'"),
    ({"users": {"a": {"models": 0}}}, "quotas.users['a'].models: expected a whole number above 0"),
    ({"users": {"a": {"models": True}}}, "whole number above 0"),
    ({"default": {"memory": "lots"}}, "quotas.default.memory"),
    ({"groups": ["staff"]}, "quotas.groups: expected a mapping"),
    ({"everyone": {}}, "unknown key 'everyone'"),
    ("4GiB", "expected a mapping"),
])
def test_bad_quotas_are_said(raw, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        parse_quotas(raw)


def test_no_quotas():
    assert parse_quotas(None).empty and parse_quotas({}).empty
    q = quota_for(Who("x"), parse_quotas(None))
    assert q.models is q.concurrent is q.per_minute is None and not q.memory


@pytest.mark.parametrize("recent, now, refused", [
    ([], 100.0, False),
    ([float(t) for t in range(91, 100)], 100.0, False),   # 9 in the last minute: the 10th goes
    ([float(t) for t in range(90, 100)], 100.0, True),    # 10 already
    ([float(t) for t in range(30, 40)], 100.0, False),    # all older than a minute
])
def test_rate(recent, now, refused):
    words = rate_refusal(Who("alice"), recent, now, quota_for(Who("alice"), TABLE))
    assert (words is not None) == refused
    if refused:
        assert "quota 'per_minute' (default)" in words and "10" in words and "try again in" in words


def test_concurrent():
    q = quota_for(Who("alice"), TABLE)
    assert concurrent_refusal(Who("alice"), 1, q) is None
    words = concurrent_refusal(Who("alice"), 2, q)
    assert "quota 'concurrent' (default)" in words and "(2)" in words
    assert concurrent_refusal(Who("bob", ("staff",)), 100, quota_for(Who("bob", ("staff",)), parse_quotas(
        {"default": {"concurrent": None}}))) is None


@pytest.mark.parametrize("who, need, held, held_models, refused_for", [
    (Who("alice"), {"cpu": GiB}, {}, 0, None),
    (Who("alice"), {"cpu": GiB}, {}, 1, "'models'"),                   # one loaded already: the default's 1
    (Who("alice"), {"cpu": 3 * GiB}, {}, 0, "'memory' on cpu"),         # past 2 GiB on any device
    (Who("bob", ("staff",)), {"cuda:0": 7 * GiB, "cpu": GiB}, {"cuda:0": 0}, 0, None),
    (Who("bob", ("staff",)), {"cuda:0": 5 * GiB}, {"cuda:0": 4 * GiB}, 1, "'memory' on cuda:0 (group staff)"),
    (Who("carol", ("staff",)), {"cpu": 100 * GiB}, {}, 0, None),        # no memory limit of her own
])
def test_load(who, need, held, held_models, refused_for):
    words = load_refusal(who, "tiny", need, held, held_models, quota_for(who, TABLE))
    if refused_for is None:
        assert words is None
    else:
        assert refused_for in words and "cannot load tiny for " + who.name in words


def test_round_robin_serves_each_person_in_turn():
    """One person's many waiting requests do not hold back another's first."""
    waiting = {"alice": 50, "bob": 1, "carol": 2}
    ring: tuple[str, ...] = ("alice", "bob", "carol")
    order = []
    while True:
        who, ring = round_robin(ring, waiting)
        if who is None:
            break
        order.append(who)
        waiting[who] -= 1
    assert order[:5] == ["alice", "bob", "carol", "alice", "carol"]
    assert order[5:] == ["alice"] * 48
    assert round_robin((), {}) == (None, ())


@pytest.mark.parametrize("user, namespace", [
    ("alice", "alice"),
    ("Alice_2", "Alice_2"),
    ("library", None),  # a shared namespace's name: hashed
    ("a.b@example.org", None),
    ("-x", None),
])
def test_private_namespace(user, namespace):
    ns = private_namespace(user)
    if namespace is not None:
        assert ns == namespace
    else:
        assert ns != user and ns.count("-") >= 1
        assert private_namespace(user) == ns  # the same every time
    assert private_owner("local", ns, ()) == ns


def test_private_namespace_avoids_shared_ones():
    assert private_namespace("course", shared=("course",)) != "course"
    assert private_namespace("a.b") != private_namespace("a-b")


@pytest.mark.parametrize("host, ns, shared, owner", [
    ("local", "library", (), None),
    ("local", "alice", (), "alice"),
    ("local", "course", ("course",), None),
    ("LOCAL", "Course", ("course",), None),
    ("registry.ollama.ai", "library", (), None),
    ("hf.co", "alice", (), None),  # pulled from a registry: shared
])
def test_private_owner(host, ns, shared, owner):
    assert private_owner(host, ns, shared) == owner


@dataclass(frozen=True)
class Snap:
    key: str
    refcount: int = 0
    pinned: bool = False


def test_fair_eviction_order():
    order = [Snap("a"), Snap("b"), Snap("c", refcount=1), Snap("d", pinned=True)]
    holdings = {"a": Holding("a", "alice", False), "b": Holding("b", "bob", False),
                "c": Holding("c", "bob", True), "d": Holding("d", "bob", False)}
    # bob holds more than an equal share: his idle model goes before alice's, a busy one after
    # every idle one, and a pinned one stays last
    assert [s.key for s in fair_eviction_order(order, holdings, {"bob"})] == ["b", "a", "c", "d"]
    assert [s.key for s in fair_eviction_order(order, holdings, set())] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("held, over", [
    ({}, set()),
    ({"alice": 10}, set()),
    ({"alice": 10, "bob": 10}, set()),
    ({"alice": 30, "bob": 10}, {"alice"}),
    ({"alice": 30, "bob": 10, "carol": 0}, {"alice"}),
])
def test_over_share(held, over):
    assert over_share(held) == over
