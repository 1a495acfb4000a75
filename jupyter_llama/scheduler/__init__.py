"""The scheduler package; see :mod:`.loop` (moving into one module per seam)."""

from ..errors import (BadRequest, DoesNotFit, LoadFailed, ModelNotFound, PinnedInTheWay, SchedulerError,
                      ServerBusy)
from ..models.ref import ModelRef
from .loop import (FREED_FRESH_S, PLACEMENT_FIELDS, Event, EventKind, EventLog, FileResolver, FitPlan, Lease,
                   Loaded, ModelState, Predictor, Resolver, Scheduler, SchedulerSettings, Subscription,
                   _fit_words, _what_to_shrink, budget_room, default_predictor)
