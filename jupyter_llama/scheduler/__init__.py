"""The scheduler: one place that decides what is loaded, whether it fits, what to evict.

One module per seam:

* :mod:`.settings`: :class:`SchedulerSettings`, parsed from the environment or the
  extension's traits.
* :mod:`.state`: what is loaded (:class:`Loaded`, and :class:`LoadedSnapshot`, its plain
  copy for the policy), the requests holding it (:class:`Lease`), and the event log of
  decisions (:class:`Event`, :class:`EventLog`).
* :mod:`.policy`: the decisions as pure functions over a snapshot of the devices, the
  loaded models and the settings: the fit plan (:class:`FitPlan`), the room under budgets,
  placement, the eviction order and the victim, and the words of every verdict. No event
  loop, process or file: ``tests/scheduler/test_policy.py`` tries them in a moment.
* :mod:`.loop`: :class:`Scheduler`, which acquires and leases runners, holds the load lock,
  keeps the keep-alive timers, retries out-of-memory loads, and evicts by asking the policy.

Every name importers used from the single module it once was is still here.
"""

from ..errors import (
                      BadRequest,
                      DoesNotFit,
                      JupyterLlamaError,
                      LoadFailed,
                      ModelNotFound,
                      PinnedInTheWay,
                      SchedulerError,
                      ServerBusy,
)
from ..models.ref import ModelRef
from .loop import FREED_FRESH_S, FileResolver, Predictor, Resolver, RunnerFactory, Scheduler, default_predictor
from .policy import FitPlan, _fit_words, _what_to_shrink, available, budget_room, eviction_order, fit_plan
from .settings import SAFETY_MARGIN_VAR, SchedulerSettings
from .state import PLACEMENT_FIELDS, Event, EventKind, EventLog, Lease, Loaded, LoadedSnapshot, ModelState, Subscription

__all__ = [
    "BadRequest", "DoesNotFit", "JupyterLlamaError", "LoadFailed", "ModelNotFound", "PinnedInTheWay", "SchedulerError",
    "ServerBusy",
    "ModelRef",
    "FREED_FRESH_S", "FileResolver", "Predictor", "Resolver", "RunnerFactory", "Scheduler", "default_predictor",
    "FitPlan", "_fit_words", "_what_to_shrink", "available", "budget_room", "eviction_order", "fit_plan",
    "SAFETY_MARGIN_VAR", "SchedulerSettings",
    "PLACEMENT_FIELDS", "Event", "EventKind", "EventLog", "Lease", "Loaded", "LoadedSnapshot", "ModelState",
    "Subscription",
]
