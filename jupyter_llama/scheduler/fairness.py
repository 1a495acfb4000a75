"""Sharing one manager between many users: who asked, their quotas, whose turn it is.

Pure functions and plain values, as :mod:`.policy` is for fitting: no event loop, no
process, no Jupyter. The loop (:mod:`.users`, :mod:`.loop`) keeps the counters and the
queues and asks these functions what to do; ``tests/scheduler/test_fairness.py`` tries
every rule on tables in a moment.

* :class:`Who`: the person behind a request (a JupyterHub user: name, groups, admin).
* :class:`Quota` and :class:`QuotaTable`: the limits the admin sets per user, per group and
  by default (memory on each device, loaded models, requests at once, requests a minute),
  read by :func:`parse_quotas` from the service's configuration; :func:`quota_for` is the
  quota that applies to one person.
* The refusals: :func:`rate_refusal`, :func:`concurrent_refusal` (a 429 each) and
  :func:`load_refusal` (a 507), each None when the request is within its quota, else the
  sentence that names the quota.
* :func:`round_robin`: whose waiting request goes next, so that one person's many queued
  requests do not delay another's first.
* :func:`private_owner` and :func:`private_namespace`: which models are a person's own
  (``local/<their namespace>/...``) and so hidden from everyone else but the admins.
* :func:`fair_eviction_order`: the eviction order, with a rule for sharing on top: among
  idle models, those of people over their share (:func:`over_share`) go first.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..config import ConfigError, parse_size
from ..memory.report import format_bytes

__all__ = [
    "Who", "Quota", "QuotaTable",
    "parse_quotas", "quota_for", "rate_refusal", "concurrent_refusal", "load_refusal",
    "round_robin", "private_namespace", "private_owner", "fair_eviction_order", "over_share", "Holding",
    "ANY_DEVICE",
    "RATE_WINDOW_S",
]

ANY_DEVICE = "*"  # a memory quota's key that applies on every device without one of its own
RATE_WINDOW_S = 60.0  # "requests a minute" counts the requests of the last so many seconds


@dataclass(frozen=True)
class Who:
    """The person behind a request. ``admin``: sees and may stop everything, and edits the
    shared library."""

    name: str
    groups: tuple[str, ...] = ()
    admin: bool = False


@dataclass(frozen=True)
class Quota:
    """Limits for one person; None is no limit. ``memory``: bytes per device (``cuda:0``,
    ``cpu``, ``rpc:HOST:PORT``, or ``*`` for any device not named); ``models``: models loaded
    by their requests at once; ``concurrent``: their requests in flight (running or waiting)
    at once; ``per_minute``: requests in the last minute. ``source`` says where each limit
    came from (``user alice``, ``group students``, ``default``), for the refusal's sentence."""

    memory: Mapping[str, int] = field(default_factory=dict)
    models: int | None = None
    concurrent: int | None = None
    per_minute: int | None = None
    source: Mapping[str, str] = field(default_factory=dict)

    def memory_on(self, device: str) -> int | None:
        if device in self.memory:
            return self.memory[device]
        return self.memory.get(ANY_DEVICE)

    def memory_source(self, device: str) -> str:
        return self.source.get("memory:" + (device if device in self.memory else ANY_DEVICE), "")

    def to_dict(self) -> dict:
        return {"memory": dict(self.memory), "models": self.models, "concurrent": self.concurrent,
                "per_minute": self.per_minute}


@dataclass(frozen=True)
class QuotaTable:
    """The admin's quotas: one entry per user, per group, and a default (entries are
    partial: a field an entry leaves out is taken from the next rule, see :func:`quota_for`)."""

    default: Mapping[str, Any] = field(default_factory=dict)
    groups: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    users: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.default or self.groups or self.users)


_FIELDS = ("memory", "models", "concurrent", "per_minute")


def _entry(raw: Any, where: str) -> dict:
    """One quota entry, parsed: sizes in bytes, counts as whole numbers above 0 (None: no limit)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {', '.join(_FIELDS)}, got {raw!r}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown quota {', '.join(map(repr, unknown))}; the quotas are "
                          f"{', '.join(_FIELDS)}")
    out: dict[str, Any] = {}
    for key in _FIELDS:
        if key not in raw:
            continue
        value = raw[key]
        if key == "memory":
            if value is None:
                out[key] = {}
            elif isinstance(value, Mapping):
                out[key] = {str(d).strip(): parse_size(v, f"{where}.memory[{d!r}]") for d, v in value.items()}
            else:
                out[key] = {ANY_DEVICE: parse_size(value, f"{where}.memory")}
            continue
        if value is None:
            out[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit() \
                or int(value) < 1:
            raise ConfigError(f"{where}.{key}: expected a whole number above 0 (or null for no limit), got {value!r}")
        out[key] = int(value)
    return out


def parse_quotas(raw: Mapping | None) -> QuotaTable:
    """The admin's quotas from the service's configuration, as::

        {"default": {"memory": "4GiB", "models": 1, "concurrent": 4, "per_minute": 60},
         "groups": {"staff": {"memory": {"cuda:0": "20GiB", "cpu": "8GiB"}, "models": 3}},
         "users": {"alice": {"per_minute": null}}}

    A size is a number of bytes or a string such as ``"8GiB"``; ``memory`` a size for every
    device or one per device. ConfigError, naming the entry, for anything else."""
    if not raw:
        return QuotaTable()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"quotas: expected a mapping with default, groups and users, got {raw!r}")
    unknown = sorted(set(raw) - {"default", "groups", "users"})
    if unknown:
        raise ConfigError(f"quotas: unknown key {', '.join(map(repr, unknown))}; use default, groups and users")
    tables = {}
    for part in ("groups", "users"):
        section = raw.get(part) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"quotas.{part}: expected a mapping of names to quotas, got {section!r}")
        tables[part] = {str(k): _entry(v, f"quotas.{part}[{k!r}]") for k, v in section.items()}
    return QuotaTable(_entry(raw.get("default"), "quotas.default"), tables["groups"], tables["users"])


def _more(a, b):
    """The more generous of two limits (None, no limit, is the most)."""
    if a is None or b is None:
        return None
    return max(a, b)


def quota_for(who: Who, table: QuotaTable) -> Quota:
    """The quota that applies to ``who``: each limit from the person's own entry if it names
    it; else the most generous of their groups' entries that name it; else the default's;
    else none. Memory is decided device by device the same way."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    own = table.users.get(who.name, {})
    groups = [(g, table.groups[g]) for g in who.groups if g in table.groups]
    for key in ("models", "concurrent", "per_minute"):
        if key in own:
            values[key], source[key] = own[key], f"user {who.name}"
            continue
        named = [(g, e[key]) for g, e in groups if key in e]
        if named:
            best = named[0]
            for g, v in named[1:]:
                if _more(best[1], v) != best[1]:
                    best = (g, v)
            values[key], source[key] = best[1], f"group {best[0]}"
            continue
        if key in table.default:
            values[key], source[key] = table.default[key], "default"
    memory: dict[str, int] = {}
    devices = set(own.get("memory", {})) | {d for _, e in groups for d in e.get("memory", {})} \
        | set(table.default.get("memory", {}))
    for dev in sorted(devices):
        if dev in own.get("memory", {}):
            memory[dev], source["memory:" + dev] = own["memory"][dev], f"user {who.name}"
            continue
        named = [(g, e["memory"][dev]) for g, e in groups if dev in e.get("memory", {})]
        if named:
            g, v = max(named, key=lambda gv: gv[1])
            memory[dev], source["memory:" + dev] = v, f"group {g}"
            continue
        if dev in table.default.get("memory", {}):
            memory[dev], source["memory:" + dev] = table.default["memory"][dev], "default"
    if "memory" in own and not own["memory"]:  # the person's own entry says: no memory limit
        memory = {}
    return Quota(memory, values.get("models"), values.get("concurrent"), values.get("per_minute"), source)


def _from(quota: Quota, key: str) -> str:
    where = quota.source.get(key)
    return f" ({where})" if where else ""


def rate_refusal(who: Who, recent: Sequence[float], now: float, quota: Quota) -> str | None:
    """None when one more request now keeps ``who`` within their requests a minute
    (``recent``: the times of their earlier requests), else the 429's sentence."""
    if quota.per_minute is None:
        return None
    in_window = [t for t in recent if now - t < RATE_WINDOW_S]
    if len(in_window) < quota.per_minute:
        return None
    wait = max(1, math.ceil(RATE_WINDOW_S - (now - min(in_window))))
    return (f"{who.name} has sent {len(in_window)} requests in the last minute, the most the quota "
            f"'per_minute'{_from(quota, 'per_minute')} allows ({quota.per_minute}); try again in {wait}s")


def concurrent_refusal(who: Who, in_flight: int, quota: Quota) -> str | None:
    """None when one more request keeps ``who`` within their requests at once, else the 429's sentence."""
    if quota.concurrent is None or in_flight < quota.concurrent:
        return None
    return (f"{who.name} has {in_flight} requests running or waiting, the most the quota "
            f"'concurrent'{_from(quota, 'concurrent')} allows at once ({quota.concurrent}); wait for one to "
            "finish and send it again")


def load_refusal(who: Who, model: str, need: Mapping[str, int], held: Mapping[str, int], held_models: int,
                 quota: Quota) -> str | None:
    """None when loading ``model`` (``need``: bytes per device) keeps ``who`` within their
    memory and loaded-model quotas (``held``: bytes per device of the models their requests
    loaded, ``held_models``: how many), else the 507's sentence."""
    if quota.models is not None and held_models >= quota.models:
        return (f"cannot load {model} for {who.name}: {held_models} model(s) loaded by {who.name}'s requests "
                f"already, the most the quota 'models'{_from(quota, 'models')} allows ({quota.models}); unload "
                "one (keep_alive 0) or use a model that is loaded")
    for dev, n in sorted(need.items()):
        limit = quota.memory_on(dev)
        if limit is None or n <= 0:
            continue
        have = held.get(dev, 0)
        if have + n > limit:
            where = quota.memory_source(dev)
            return (f"cannot load {model} for {who.name}: it needs {format_bytes(n)} on {dev}, and {who.name}'s "
                    f"models hold {format_bytes(have)} there, past the quota 'memory' on {dev}"
                    f"{f' ({where})' if where else ''} of {format_bytes(limit)}; unload a model, or load it with "
                    "a smaller context")
    return None


def round_robin(ring: Sequence[str], waiting: Mapping[str, int]) -> tuple[str | None, tuple[str, ...]]:
    """Whose request goes next: the first person in ``ring`` (people with requests waiting,
    in the order of their turns) who has one waiting; they move to the end of the ring if
    they have more. Returns (that person or None, the ring after). A person who joins the
    queue is added at the end of the ring by the caller."""
    ring = [u for u in ring if waiting.get(u, 0) > 0]
    if not ring:
        return None, ()
    first = ring.pop(0)
    if waiting[first] > 1:
        ring.append(first)
    return first, tuple(ring)


_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,79}$")
LOCAL_HOST = "local"


def private_namespace(user: str, shared: Iterable[str] = ()) -> str:
    """The namespace of ``user``'s own models (``alice/mymodel``): their name when it is a valid
    namespace and not a shared one (``library``, the admin's ``shared``), else its letters and
    digits with a short hash of the whole name (a name such as ``a.b@example.org`` becomes
    ``a-b-example-org-1c2d3e4f``), so that two people never share one."""
    taken = {"library"} | {s.lower() for s in shared}
    if _NAMESPACE_RE.match(user) and user.lower() not in taken:
        return user
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", user).strip("-")[:60] or "user"
    if not re.match(r"[A-Za-z0-9_]", slug):
        slug = "u" + slug
    return f"{slug}-{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def private_owner(host: str, namespace: str, shared: Iterable[str]) -> str | None:
    """The namespace that owns a model named ``host/namespace/...``, or None for a shared one:
    models made on this machine (host ``local``) in a namespace that is not one of the
    admin's ``shared`` namespaces (``library``, the bare names, always is) belong to the user
    of that namespace; models pulled from a registry are shared."""
    if host.lower() != LOCAL_HOST:
        return None
    ns = namespace.lower()
    if ns == "library" or ns in {s.lower() for s in shared}:
        return None
    return namespace


@dataclass(frozen=True)
class Holding:
    """What the fairness rule needs to know of a loaded model: whose request loaded it and
    whether anyone holds it now."""

    key: str
    owner: str | None  # who loaded it (None: no user, as in a single-user manager)
    busy: bool


def fair_eviction_order(order: Sequence[Any], holdings: Mapping[str, Holding],
                        over_share: Iterable[str]) -> list[Any]:
    """The eviction order ``order`` (snapshots with ``key``, from :func:`.policy.eviction_order`)
    with one rule on top for a shared manager: an idle model goes before a busy one whoever
    owns it, and among the idle ones (and among the busy ones) those loaded by people over
    their share (``over_share``) go first. Otherwise the order is kept (a stable sort)."""
    over = set(over_share)

    def rank(s) -> tuple[int, int, int]:
        h = holdings.get(s.key)
        busy = bool(h and h.busy) or getattr(s, "refcount", 0) > 0
        owner_over = bool(h and h.owner is not None and h.owner in over)
        return (1 if getattr(s, "pinned", False) else 0, 1 if busy else 0, 0 if owner_over else 1)

    return sorted(order, key=rank)


def over_share(held: Mapping[str, int]) -> set[str]:
    """The people who hold more than an equal share of what the people holding models hold
    together (``held``: bytes per person)."""
    holders = {u: n for u, n in held.items() if n > 0}
    if len(holders) < 2:
        return set()
    share = sum(holders.values()) / len(holders)
    return {u for u, n in holders.items() if n > share}
