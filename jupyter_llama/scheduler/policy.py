"""The scheduler's decisions, as pure functions over a snapshot.

Whether a model fits and on which devices, the room under each budget, where a load's
layers go, who an eviction takes and in what order, and the words each verdict is said in:
each is computed here from plain data (the device inventory, a :class:`LoadedSnapshot` of
each loaded model, the settings, the load's predictions) and returned as data. Nothing here
touches the event loop, a process, a file or the :class:`~.loop.Scheduler`, and nothing is
logged or emitted: the loop takes the snapshot, calls these and acts on the answer. So every
rule can be tried on a table of cases in a moment, without llama-server
(``tests/scheduler/test_policy.py``), and the tests on real children stay the judge of what
the loop then does.

The rules are Ollama's (shortest keep_alive first, idle before busy, the loaded-model cap,
the first model always gets to try) with budgets per device on top, which are the user's:
what the user's other managers hold there counts against them too.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from ..config import format_duration
from ..load_options import LoadOptions
from ..memory import devices as devmod
from ..memory import peers as peermod
from ..memory import rpc
from ..memory.devices import MEMORY_LIMIT_VAR
from ..memory.estimate import estimate_detailed, estimate_layer_counts, fit_layers
from ..memory.report import COARSE, COMPUTE, DETAILED, HOST, KV, OTHER, WEIGHTS, MemoryReport, MiB, format_bytes, is_gpu
from .settings import SAFETY_MARGIN_VAR, SchedulerSettings, format_margin
from .state import LoadedSnapshot, ModelState

# ----------------------------------------------------------------------------- room under budgets


def budget_room(device: devmod.DeviceState, used: Mapping[str, int], held: Mapping[str, int] | None) -> int | None:
    """Bytes of ``device``'s budget still open to this manager (None: the device has no
    budget; below 0: it is over by that much): the budget is the user's, so what the user's
    other managers hold there (``held``) comes off it, as well as what this manager's runners
    use (``used``). The planner leaves the rest of the device free, the fit check measures
    the need against it, and once a load's real size is known the budget is enforced by it."""
    if device.budget is None:
        return None
    return device.budget - (held or {}).get(device.id, 0) - used.get(device.id, 0)


def available(inv: devmod.Inventory, used: Mapping[str, int], peers: Mapping[str, int] | None = None,
              returned: Mapping[str, int] | None = None) -> dict[str, tuple[int, int | None]]:
    """Per device: (bytes we may still plan with, the budget if one is set). A budget is the
    user's: what their other managers hold (``peers``) counts against it too; free memory,
    read live, already has their models taken out. ``returned``: bytes that runners a dry
    run of evictions stops would give back to each device's free memory."""
    out = {}
    for d in inv.devices():
        free = d.free + (returned or {}).get(d.id, 0) - (d.overhead if is_gpu(d.id) else 0)
        room = budget_room(d, used, peers)
        out[d.id] = (max(0, min(free, d.total - used.get(d.id, 0) if room is None else room)), d.budget)
    return out


def max_loaded(settings: SchedulerSettings, n_accelerators: int) -> int:
    """The loaded-model cap: the setting, else 3 per accelerator (GPUs and RPC worker
    devices alike), at least 3."""
    return settings.max_loaded_models or 3 * max(n_accelerators, 1)


def fit_source(settings: SchedulerSettings, preds: Mapping[str, MemoryReport]) -> str:
    """The prediction that decides: the configured estimator, else the coarse one."""
    return settings.fit_estimator if settings.fit_estimator in preds else COARSE


def margin(settings: SchedulerSettings, source: str) -> float:
    """The safety margin the fit adds to ``source``: the detailed estimate's, none to the
    coarse one (Ollama's rule carries its own allowances)."""
    return settings.safety_margin if source == DETAILED else 0.0


def need(preds: Mapping[str, MemoryReport], source: str, safety_margin: float) -> MemoryReport:
    """What the fit measures against the room: the deciding estimate, with its margin (the
    detailed estimate only), named ``detailed+10%``."""
    rep = preds[source]
    if source == DETAILED and safety_margin:
        return rep.scaled(1 + safety_margin, source=f"{DETAILED}+{format_margin(safety_margin)}")
    return rep


# ----------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """Where a load goes: its options with the placement fields filled in (``rpc``, the
    workers it connects to; ``fit_target_mib``, the room llama.cpp's --fit leaves free on
    each accelerator), the accelerators' ids in llama.cpp's order, and the share of the
    offloaded layers each is expected to get (None: no accelerator). ``rooms``: with
    automatic placement, the bytes each accelerator may hold (what its budget leaves, or its
    free memory less what llama.cpp keeps free), by device id."""

    options: LoadOptions
    devices: tuple[str, ...]
    split: tuple[float, ...] | None
    rooms: Mapping[str, int] = field(default_factory=dict)


# Rounds of raising a --fit-target before the plan takes what it has (each round moves at
# least a layer off the device that was over, so a few suffice).
FIT_ROUNDS = 8


def fit_targets(info, options: LoadOptions, accel: Sequence[devmod.DeviceState],
                keeps: Sequence[int]) -> tuple[list[float], list[int]]:
    """The ``--fit-target`` per accelerator (bytes to keep free, whole MiB) with which
    llama.cpp's ``--fit`` keeps each of ``accel`` within its room (``free - keeps[i]``),
    and the split :func:`fit_layers` predicts --fit arrives at with them.

    llama.cpp's --fit fills the devices one at a time from the last, each as full as its
    target allows, measuring each candidate with the other devices as they stand. When the
    first device's share makes every layer offloaded, llama.cpp turns pipeline parallelism
    on (several copies of every graph input, larger compute buffers on every device), and
    the devices filled before it are not measured again: they end over their room by their
    growth. So the whole placement is predicted (the detailed estimate, pipeline included)
    and a device over its room gets that much more kept free, and the fit is predicted again:
    it then takes fewer layers, and either the rest still fit on the devices (the growth now
    has room) or a layer stays on the host and pipeline parallelism stays off."""
    ids = [d.id for d in accel]
    rooms = [d.free - k for d, k in zip(accel, keeps, strict=True)]
    targets = [(k + MiB - 1) // MiB * MiB for k in keeps]  # (llama.cpp takes whole MiB)
    weights: list[float] = []
    for _ in range(FIT_ROUNDS):
        rooms_now = [(i, max(0, d.free - t)) for i, d, t in zip(ids, accel, targets, strict=True)]
        weights = fit_layers(info, options, rooms_now,
                             free=[d.free for d in accel])
        rep = estimate_detailed(info, options.replace(num_gpu=None), ids, split=weights)
        over = [rep.total(device=i) - room for i, room in zip(ids, rooms, strict=True)]
        if all(x <= 0 for x in over):
            break
        targets = [t + (x + MiB - 1) // MiB * MiB if x > 0 else t for t, x in zip(targets, over, strict=True)]
    return weights, targets


def placement(info, options: LoadOptions, inv: devmod.Inventory, used: Mapping[str, int],
              held: Mapping[str, int] | None = None) -> Placement:
    """Where a load of the model ``info`` describes would go now (``used``: bytes per device
    this manager's runners hold; ``held``: what the user's other managers hold).

    The accelerators are the local GPUs and the RPC workers no runner holds. With automatic
    placement (``num_gpu`` unset) llama.cpp's ``--fit`` places the layers, keeping free on
    each accelerator its ``--fit-target``: everything beyond the room under the device's
    budget (at least llama.cpp's own 1 GiB, and a GPU's overhead), raised where --fit would
    otherwise leave the device over that room (:func:`fit_targets`). The split follows the
    layers :func:`fit_layers` expects llama.cpp to put there; a worker expected to get no
    layer is left out of ``--rpc``, free for another model. With ``num_gpu N`` llama.cpp
    splits the N layers by free memory, and so does the split. ``num_gpu 0`` uses no device."""
    accel = [] if options.num_gpu == 0 else inv.accelerators()
    split: list[float] | None = None
    margins: tuple[int, ...] | None = None
    rooms: dict[str, int] = {}
    if accel and options.gpu_automatic:
        keeps = []
        for d in accel:
            keep = max(1024 * MiB, d.overhead)
            room = budget_room(d, used, held)
            if room is not None:  # leave free everything beyond what is left of the budget here
                keep = max(keep, d.free - max(0, room))
            keeps.append(keep)
        # A worker expected to get no layer is left out, and llama.cpp then fits over the
        # others alone (with fewer devices, pipeline parallelism may stay off): fit again
        # without it until every worker left gets a layer.
        kept = list(range(len(accel)))
        weights: list[float] = []
        targets: list[int] = []
        while kept:
            weights, targets = fit_targets(info, options, [accel[i] for i in kept], [keeps[i] for i in kept])
            layers = estimate_layer_counts(info, options, [accel[i].id for i in kept], weights)
            empty = {i for i, n in zip(kept, layers, strict=True) if accel[i].kind == "rpc" and n == 0}
            if not empty:
                break
            kept = [i for i in kept if i not in empty]
        rooms = {accel[i].id: max(0, accel[i].free - keeps[i]) for i in kept}
        split = list(weights)
        margins = tuple(int(t // MiB) for t in targets)
        accel = [accel[i] for i in kept]
    elif accel:
        split = [float(max(d.free, 1)) for d in accel]
    workers = tuple(dict.fromkeys(rpc.endpoint_of(d.id) for d in accel if d.kind == "rpc"))
    options = options.replace(rpc=workers or None, fit_target_mib=margins if accel else None)
    return Placement(options, tuple(d.id for d in accel), tuple(split) if accel and split is not None else None,
                     rooms)


# ----------------------------------------------------------------------------- eviction order


def eviction_order(loaded: Iterable[LoadedSnapshot], key: str, evict_pinned: bool) -> list[LoadedSnapshot]:
    """Who an eviction for the model ``key`` takes, in order: shortest keep_alive first (ties
    by model path), idle before busy; pinned ones last, and only with ``evict_pinned``. Only
    ready models are candidates (a loading one is not yet anything to take back)."""
    candidates = [s for s in loaded if s.state == ModelState.READY and s.key != key]
    unpinned = sorted((s for s in candidates if not s.pinned), key=lambda s: (s.keep_alive, s.path))
    pinned = sorted((s for s in candidates if s.pinned), key=lambda s: s.path)
    order: list[LoadedSnapshot] = []
    for group in (unpinned, pinned if evict_pinned else []):
        order += [s for s in group if s.refcount == 0] + [s for s in group if s.refcount > 0]
    return order


def victim_rule(victim: LoadedSnapshot) -> str:
    """Why the eviction rule chose ``victim``, in words (the event's "chosen because ...")."""
    label = "pinned, " if victim.pinned else ""
    if victim.refcount == 0:
        return f"{label}idle, shortest keep_alive ({format_duration(victim.keep_alive)})"
    return (f"{label}shortest keep_alive ({format_duration(victim.keep_alive)}); busy, so it unloads "
            f"when its {victim.refcount} request(s) finish")


def choose_victim(loaded: Iterable[LoadedSnapshot], key: str,
                  evict_pinned: bool) -> tuple[LoadedSnapshot, str] | None:
    """The first of :func:`eviction_order` with :func:`victim_rule`'s words; None when no
    model may be evicted (see :func:`pinned_in_the_way` for why)."""
    order = eviction_order(loaded, key, evict_pinned)
    return (order[0], victim_rule(order[0])) if order else None


def pinned_in_the_way(loaded: Iterable[LoadedSnapshot], key: str) -> list[LoadedSnapshot]:
    """The ready pinned models other than ``key``, by path: those a refusal names."""
    return sorted((s for s in loaded if s.state == ModelState.READY and s.pinned and s.key != key),
                  key=lambda s: s.path)


def only_pinned_would_help(loaded: Sequence[LoadedSnapshot], key: str, short: Mapping[str, int],
                           evict_pinned: bool) -> list[LoadedSnapshot]:
    """Don't evict unpinned models for nothing: the pinned models to name when freeing every
    unpinned one still leaves a device ``short`` (bytes missing per device) and pinned models
    hold the rest; empty when evicting may go on."""
    if evict_pinned or not short:
        return []
    pinned = pinned_in_the_way(loaded, key)
    if not pinned:
        return []
    freeable: dict[str, int] = collections.defaultdict(int)
    for s in loaded:
        if s.state == ModelState.READY and not s.pinned and s.key != key:
            for dev, n in s.by_device.items():
                freeable[dev] += n
    if all(missing <= freeable.get(dev, 0) for dev, missing in short.items()):
        return []
    return pinned


# ----------------------------------------------------------------------------- the fit plan


@dataclass
class FitPlan:
    """Whether a model fits now, the one computation behind every verdict (the scheduler's
    own decision, ``/api/estimate``, the picker, the panel and ``%llama estimate``).

    ``devices`` maps each device the prediction uses to ``need`` (the deciding estimate, with
    its margin), ``estimate`` (the same before the margin), ``available`` (what may still be
    planned with there: free memory less GPU overhead, capped by the budget less what loaded
    models use), ``in_use``, ``budget``, ``checked`` (whether the verdict looks at it: every
    device does, unless the deciding estimate says nothing of where llama.cpp's --fit puts
    the layers), ``fitted`` (an accelerator under automatic placement: its need is the
    detailed estimate of the placement llama.cpp's --fit is predicted to reach, pipeline
    parallelism included, without a safety margin, since --fit measures each placement it
    tries on the device itself) and ``fits``. ``verdict`` is ``fits``, ``evict``
    (``evict`` names the models a load now would unload, in order), ``first`` (it may not
    fit but nothing else is loaded, so it gets to try), ``over_budget`` (alone it needs more
    than a budget: refused), ``peers`` (it fits the budget alone, but this user's other
    managers hold the rest of it: refused, naming them; ``peers`` lists them) or ``refuse``
    (nothing that may be evicted would make room). ``margin`` is the safety margin in
    ``need`` (0 for the coarse estimate); ``after`` is ``devices`` as the dry run of the
    eviction rule left them, with every model in ``evict`` gone (empty when it evicted none).
    """

    model: str
    fit_source: str  # the prediction that decides (the configured estimator, else coarse)
    estimator: str  # what it is called with its margin: "detailed+10%"
    devices: dict[str, dict]
    cap: int
    others: int
    verdict: str
    evict: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)  # other managers of this user holding budgeted memory
    margin: float = 0.0
    after: dict[str, dict] = field(default_factory=dict)
    layers: tuple[int, int] | None = None  # (offloaded, in all) as the detailed estimate places them

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    @property
    def short(self) -> dict[str, int]:
        """Bytes missing per checked device."""
        return {d: n["need"] - n["available"] for d, n in self.devices.items() if n["checked"] and not n["fits"]}

    @property
    def over_cap(self) -> bool:
        return self.others >= self.cap

    @property
    def verdict_words(self) -> str:
        """The verdict as every front end says it."""
        return {"fits": "fits", "evict": "fits after evicting " + ", ".join(self.evict),
                "first": "may not fit, but nothing else is loaded, so it gets to try",
                "over_budget": "does not fit: over the budget",
                "peers": "does not fit: your other jupyter-llama managers hold the rest of the budget",
                "refuse": "does not fit, and evicting would not make room"}[self.verdict]

    def words(self, only: Iterable[str] | None = None) -> str:
        keep = set(only) if only is not None else None
        return _fit_words({d: n for d, n in self.devices.items() if keep is None or d in keep}, self.estimator)

    def to_dict(self) -> dict:
        return {"model": self.model, "estimator": self.estimator, "verdict": self.verdict, "fits": self.fits,
                "verdict_words": self.verdict_words,
                "devices": self.devices, "cap": self.cap, "loaded": self.others, "over_cap": self.over_cap,
                "evict": list(self.evict), "workers": list(self.workers), "peers": list(self.peers),
                "margin": self.margin, "text": self.words()}


def fit_plan(model: str, key: str, placed: LoadOptions, preds: Mapping[str, MemoryReport], inv: devmod.Inventory,
             used: Mapping[str, int], loaded: Sequence[LoadedSnapshot], settings: SchedulerSettings,
             peers: Sequence[peermod.Peer] | None = None) -> FitPlan:
    """The :class:`FitPlan` for loading ``model`` (runner ``key``) as ``placed`` with
    ``preds``, given the devices, what this manager's runners use (``used``, the model's own
    runner not counted), the loaded models and this user's other managers (``peers``). It
    decides nothing and unloads nothing: the eviction it names is a dry run of the rule, in
    which each victim's bytes leave what loaded models use and come back to free memory."""
    source = fit_source(settings, preds)
    safety = margin(settings, source)
    base = preds[source]
    needed = need(preds, source, safety)
    cap = max_loaded(settings, len(inv.accelerators(include_unusable=True)))
    others = [s for s in loaded if s.state in (ModelState.READY, ModelState.LOADING) and s.key != key]
    # With automatic placement llama.cpp's --fit puts the layers on the accelerators; the
    # detailed estimate is made for the placement --fit is predicted to reach (see
    # :func:`placement`), so it is what each accelerator is checked by, as it is, without a
    # margin. Without a detailed estimate nothing says where --fit puts them: only the host
    # is checked then.
    placed_by_fit = DETAILED in preds if placed.fit_target_mib is not None else False
    fitted = {d for d in needed.devices if d != HOST} if placed_by_fit else set()
    if placed.fit_target_mib is not None and not placed_by_fit:
        checked = {HOST}
    else:
        checked = set(needed.devices)
    held = peermod.usage(list(peers or []))

    def rows(usage: Mapping[str, int], returned: Mapping[str, int] | None = None) -> dict[str, dict]:
        avail = available(inv, usage, held, returned)
        out = {}
        for d in needed.devices:
            if d in fitted:
                n = est = preds[DETAILED].total(device=d)
            else:
                n, est = needed.total(device=d), base.total(device=d)
            a = avail.get(d, (0, None))
            out[d] = {"need": n, "estimate": est, "available": a[0], "in_use": usage.get(d, 0),
                      "budget": a[1], "checked": d in checked, "fitted": d in fitted,
                      "fits": d not in checked or n <= a[0]}
        return out

    devices = rows(used)
    det = preds.get(DETAILED)
    layers = None
    if det is not None and det.layers_total and det.layers_offloaded is not None:
        layers = (det.layers_offloaded, det.layers_total)
    plan = FitPlan(model, source, needed.source, devices, cap, len(others), "fits",
                   workers=list(placed.rpc or ()), margin=safety, layers=layers)
    if not plan.short and not plan.over_cap:
        return plan
    if not others:
        over = any(n["checked"] and n["budget"] is not None and n["need"] > n["budget"] for n in devices.values())
        taken = [d for d in plan.short if devices[d]["budget"] is not None and held.get(d)]
        plan.verdict = "over_budget" if over else "peers" if taken else "first"
        plan.peers = [p.describe(taken[0]) for p in peers or [] if taken and p.by_device().get(taken[0])]
        return plan
    usage, count = dict(used), len(others)
    returned: collections.Counter[str] = collections.Counter()
    for victim in eviction_order(loaded, key, settings.evict_pinned):
        plan.evict.append(victim.name)
        for d, n in victim.by_device.items():
            usage[d] = max(0, usage.get(d, 0) - n)
            if not rpc.is_rpc(d):  # (a held worker is already counted as it was before it was taken)
                returned[d] += n
        count -= 1
        plan.after = rows(usage, returned)
        if all(n["fits"] for n in plan.after.values()) and count < cap:
            plan.verdict = "evict"
            return plan
    plan.verdict = "refuse"
    return plan


# ----------------------------------------------------------------------------- words


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _what_to_shrink(report: MemoryReport | None, device: str, estimator: str, offload: bool = True,
                    layers: tuple[int, int] | None = None) -> str:
    """Advice for a load over its budget, from the largest part of what it needs there;
    ``offload``: there are devices (GPUs, RPC workers) that layers could go to instead of the host;
    ``layers``: (offloaded, in all) where llama.cpp's --fit placed the layers and left some on
    the host because the devices' room holds no more (then more layers on devices is not the
    change that fits: more room there is)."""
    parts = {c: report.total(device=device, component=c) for c in (WEIGHTS, KV, COMPUTE, OTHER)} if report else {}
    if not parts or not any(parts.values()):
        return "load it with a smaller context (num_ctx) or a smaller quantisation"
    part, size = max(parts.items(), key=lambda kv: kv[1])
    share = f"{format_bytes(size)} of it is"
    if part == OTHER and estimator == COARSE:
        return (f"{share} the coarse estimate's allowance for large batches (Ollama's, for a batch of 1024 tokens or "
                "more; llama-server's default is 2048): load it with num_batch 512, which drops the allowance, or "
                "let the detailed estimate decide (JUPYTER_LLAMA_FIT_ESTIMATOR=detailed)")
    if part == COMPUTE:
        return f"{share} the compute buffer: load it with a smaller batch (num_batch, num_ubatch)"
    if part == KV:
        return (f"{share} the K/V cache: load it with a smaller context (num_ctx), fewer parallel requests "
                "(num_parallel) or a quantised cache (cache_type_k/cache_type_v q8_0)")
    if device == HOST and layers is not None and layers[0] < layers[1]:
        return (f"{share} weights: {layers[1] - layers[0]} of the {layers[1]} layers stay on the host, as the "
                f"devices' room holds {layers[0]} (llama.cpp's --fit fills each device within its budget and free "
                f"memory). Raise a device's budget ({MEMORY_LIMIT_VAR}) to take more layers there, or use a "
                "smaller quantisation of the model")
    if device == HOST:
        return f"{share} the weights: use a smaller quantisation of the model" + (
            ", or put more layers on devices (num_gpu)" if offload else ", or a smaller model")
    return f"{share} the weights: use a smaller quantisation of the model, or put fewer layers here (num_gpu)"


# How the need of an accelerator under automatic placement is said (see FitPlan's ``fitted``).
FITTED_WORDS = "detailed, as llama.cpp's --fit will place it; no safety margin: --fit measures what it places"


def _apart(row: Mapping) -> bool:
    """Whether ``row``'s need carries a margin to be said apart from its estimate."""
    return row.get("estimate") is not None and row["estimate"] != row["need"]


def _fit_words(numbers: Mapping[str, Mapping], source: str) -> str:
    """Each device's need and room in words. Where the need is more than the room and carries
    a safety margin, the estimate and the margin are said apart, so that the one is not
    taken for the other (a need short only by its margin is not a model too large)."""
    parts = []
    for d, n in numbers.items():
        budget = f", budget {format_bytes(n['budget'])}" if n.get("budget") is not None else ""
        short = n["need"] > n["available"]
        left = ("; not checked: llama.cpp's --fit places layers within that room by its own projection, which can "
                "be lower than this one (a budget is checked again once llama.cpp has allocated)"
                if n.get("checked") is False and short else "")
        if n.get("fitted"):
            what = FITTED_WORDS
        else:
            what = (f"{source}: {format_bytes(n['estimate'])} by the estimate, "
                    f"{format_bytes(n['need'] - n['estimate'])} its safety margin" if short and _apart(n) else source)
        parts.append(f"{d} needs {format_bytes(n['need'])} ({what}), {format_bytes(n['available'])} available "
                     f"({format_bytes(n['in_use'])} in use by loaded models{budget}){left}")
    return "; ".join(parts)


def need_words(plan: FitPlan, device: str, row: Mapping | None = None) -> str:
    """``needs 291.0 MiB on cpu (coarse estimate)``, or where the need carries a margin, the
    estimate and the margin apart: ``needs 291.0 MiB on cpu by the detailed estimate, 320.1
    MiB with its 10% safety margin (JUPYTER_LLAMA_SAFETY_MARGIN)``."""
    row = plan.devices[device] if row is None else row
    if row.get("fitted"):
        return f"needs {format_bytes(row['need'])} on {device} ({FITTED_WORDS})"
    if plan.margin and _apart(row):
        return (f"needs {format_bytes(row['estimate'])} on {device} by the {plan.fit_source} estimate, "
                f"{format_bytes(row['need'])} with its {format_margin(plan.margin)} safety margin "
                f"({SAFETY_MARGIN_VAR})")
    return f"needs {format_bytes(row['need'])} on {device} ({plan.estimator} estimate)"


def margin_that_fits(plan: FitPlan, rows: Mapping[str, Mapping], limit: str) -> int | None:
    """The largest whole-percent safety margin below the plan's with which every checked
    device short in ``rows`` fits under its ``limit`` (``budget`` or ``available``); None
    when the estimate alone does not fit on one of them, or there is no margin to lower."""
    if not plan.margin:
        return None
    best = None
    for r in rows.values():
        room = r.get(limit)
        if not r["checked"] or room is None or r["need"] <= room:
            continue
        est = r.get("estimate")
        if est is None or est > room:
            return None
        pct = max(0, math.floor((room / est - 1) * 100 + 1e-9)) if est else 0
        best = pct if best is None else min(best, pct)
    return best


def _lower_margin(plan: FitPlan, pct: int) -> str:
    return (f"a safety margin of {pct}% or less fits it ({SAFETY_MARGIN_VAR}={pct}%; "
            f"it is {format_margin(plan.margin)} now)")


def refusal(plan: FitPlan, report: MemoryReport | None, offload: bool,
            peers_held: Mapping[str, int] | None = None) -> str:
    """Why a load is refused and what would make it fit, for the verdicts ``over_budget``,
    ``peers`` and ``refuse`` (what ``DoesNotFit`` says). ``report``: the deciding prediction
    (its largest part is what the advice shrinks); ``offload``: there are accelerators to put
    layers on; ``peers_held``: bytes per device this user's other managers hold.

    Where the estimate itself fits and only the safety margin does not, it says so, and that
    a smaller margin or a larger budget fits it, rather than advising a smaller model."""
    name = plan.model
    if plan.verdict == "over_budget":
        d, n = next((d, n) for d, n in plan.devices.items()
                    if n["checked"] and n["budget"] is not None and n["need"] > n["budget"])
        said = f"{name} {need_words(plan, d)}{',' if plan.margin and _apart(n) else ''} but the budget there is " \
               f"{format_bytes(n['budget'])}"
        pct = margin_that_fits(plan, plan.devices, "available")  # (the budget less what peers hold there)
        if pct is not None:
            enough = n["need"] + (peers_held or {}).get(d, 0)
            return (f"{said}: the estimate fits, the safety margin alone does not. {sentence(_lower_margin(plan, pct))}"
                    f", or raise {MEMORY_LIMIT_VAR} there to {format_bytes(enough)} or more")
        if n.get("fitted"):
            return (f"{said}: llama.cpp's --fit would leave it over the budget there. Place the layers with num_gpu "
                    f"(fewer on the devices), or raise {MEMORY_LIMIT_VAR} there")
        shrink = _what_to_shrink(report, d, plan.estimator, offload, _left_on_host(plan, d))
        return f"{said}; {shrink}" + ("" if MEMORY_LIMIT_VAR in shrink else f", or raise {MEMORY_LIMIT_VAR}")
    if plan.verdict == "peers":
        d = next(iter(plan.short))
        n = plan.devices[d]
        pct = margin_that_fits(plan, plan.devices, "available")
        return (f"{name} {need_words(plan, d)}; the budget there is {format_bytes(n['budget'])}, and your other "
                f"jupyter-llama managers hold {format_bytes((peers_held or {}).get(d, 0))} of it ("
                + "; ".join(plan.peers) + "). Unload models there (their `stop`, or keep_alive 0), "
                + (f"raise {MEMORY_LIMIT_VAR}, or lower the safety margin: {_lower_margin(plan, pct)}"
                   if pct is not None else f"or raise {MEMORY_LIMIT_VAR}"))
    if plan.verdict == "refuse":
        short = plan.short
        rows = plan.after or plan.devices
        pct = margin_that_fits(plan, rows, "available")
        if pct is not None:
            budgeted = any(r["budget"] is not None for r in rows.values() if r["checked"] and not r["fits"])
            advice = (f"With them gone the estimate would fit and the safety margin alone would not: "
                      f"{_lower_margin(plan, pct)}" + (f", or raise {MEMORY_LIMIT_VAR}" if budgeted else ""))
        else:
            d = next(iter(short))
            advice = sentence(_what_to_shrink(report, d, plan.estimator, offload, _left_on_host(plan, d)))
        return (f"cannot load {name}: {eviction_reason(plan)}; unloading every other model would not make room "
                f"({plan.estimator} estimate), so none was unloaded. {advice}, or unload the others yourself to let "
                "it try alone")
    raise ValueError(f"a {plan.verdict!r} verdict is not a refusal")


def _left_on_host(plan: FitPlan, device: str) -> tuple[int, int] | None:
    """(offloaded, in all) when ``device`` is the host and llama.cpp's --fit is predicted to
    leave layers there because the devices' room holds no more; None otherwise."""
    if device != HOST or plan.layers is None or not any(r.get("fitted") for r in plan.devices.values()):
        return None
    return plan.layers if plan.layers[0] < plan.layers[1] else None


def eviction_reason(plan: FitPlan) -> str:
    """Why a load must evict (or be refused): the loaded-model cap, or the memory short."""
    short = plan.short
    return (f"the loaded-model cap ({plan.cap}) is reached" if plan.over_cap and not short else
            "not enough memory: " + plan.words(short))


def pinned_refusal(model: str, reason: str, pinned: Iterable[LoadedSnapshot], unpinned_first: bool) -> str:
    """A refusal naming the pinned models that alone could make room (``unpinned_first``:
    evicting every unpinned one was counted and would not be enough)."""
    names = ", ".join(s.name for s in pinned)
    if unpinned_first:
        return (f"cannot load {model}: {reason}; evicting every unpinned model would not be enough, and only "
                f"pinned models ({names}) could make room. Unload one of them (keep_alive 0 or `stop`), or set "
                "JUPYTER_LLAMA_EVICT_PINNED=1")
    return (f"cannot load {model}: {reason}, and only pinned models ({names}) could make room. "
            f"Unload one of them (keep_alive 0 or `stop`), or set JUPYTER_LLAMA_EVICT_PINNED=1")
