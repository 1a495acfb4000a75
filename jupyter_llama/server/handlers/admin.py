"""Our own routes under ``<base_url>llama/``, beside Ollama's and OpenAI's.

    GET    api/devices  api/events  api/log  api/me    POST api/estimate  api/prune
    GET    metrics                       Prometheus's text format (jupyter_llama.hub.metrics)
    GET    api/openapi.json              this API's OpenAPI 3.1 description (server/openapi.json)
    *      any other path                a JSON 404 that names it
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from tornado import web

from ...api import ollama as oa
from ...api.ollama import ndjson
from ...api.options import split_options
from ...errors import NoSuchRoute, NotLoaded
from ...scheduler import BadRequest
from .base import NDJSON, LlamaHandler, api_method, dumps, finite


class PruneHandler(LlamaHandler):
    """``POST api/prune``: drop partial downloads no pull is working on (ours; Ollama prunes at start)."""

    @web.authenticated
    @authorized
    @api_method
    async def post(self):
        self.check_admin("prune the store")
        removed = await asyncio.to_thread(self.store.prune_partials)
        self.finish_json({"removed": removed, "freed": sum(r["bytes"] for r in removed)})


@functools.lru_cache(maxsize=8)
def openapi_body(base_url: str) -> str:
    """The OpenAPI description shipped in the server package, its server URL set to ``base_url``
    (made once per base URL: the file is 90 KB)."""
    from importlib.resources import files

    spec = json.loads(files("jupyter_llama.server").joinpath("openapi.json").read_text(encoding="utf-8"))
    for server in spec.get("servers", []):
        server.get("variables", {}).get("base_url", {})["default"] = base_url
    return json.dumps(spec)


class OpenAPIHandler(LlamaHandler):
    """``GET api/openapi.json``: the description, its server URL set to this server's base URL."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        self.finish(await asyncio.to_thread(openapi_body, self.base_url))


class MeHandler(LlamaHandler):
    """``GET api/me`` (ours): who this request is, as this manager sees them. On a manager
    shared through a JupyterHub: their groups, whether they administer it, the namespace of
    their own models, their quota, their requests now and in the last minute, and the models
    their requests loaded. On a single user's manager: ``shared`` false."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        who, hub = self.who, self.hub
        if who is None or hub is None:
            self.finish_json({"name": self.current_user.username, "shared": False})
            return
        sched = self.ext.scheduler
        book = sched.users if sched is not None else None
        body = {"name": who.name, "groups": list(who.groups), "admin": who.admin, "shared": True,
                "namespace": hub.namespace(who), "user_models": hub.user_models,
                "quota": hub.who_quota(who).to_dict(),
                "in_flight": book.in_flight.get(who.name, 0) if book else 0,
                "waiting": book.waiting_by_user().get(who.name, 0) if book else 0,
                "requests_last_minute": book.requests_last_minute(who.name) if book else 0,
                "models": sorted(lo.name for lo in sched.live() if lo.loaded_by == who.name) if sched else []}
        self.finish(dumps(body))


class MetricsHandler(LlamaHandler):
    """``GET metrics`` (ours): Prometheus's text format (jupyter_llama.hub.metrics). On a manager
    shared through a JupyterHub, for its admins only (the numbers are everyone's): a Prometheus
    scrapes it with an admin's token."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        from ...hub.metrics import CONTENT_TYPE, render, snapshot

        self.check_admin("read the metrics of every user (a Prometheus scrapes them with an admin's token)")
        sched = self.ext.scheduler
        snap = snapshot(sched) if sched is not None else {"models": [], "pending": 0, "evictions": {}, "users": None}
        self.finish(render(snap), set_content_type=CONTENT_TYPE)


class DevicesHandler(LlamaHandler):
    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self) -> None:
        from ...memory import devices as devmod

        sched = self.ext.scheduler
        usage: dict[str, int] = {}
        loaded = []
        if sched is None:
            inv = await asyncio.to_thread(devmod.inventory)
        else:
            inv = await sched.inventory()  # under the scheduler's budgets
            usage = sched.usage()
            loaded = [{"name": lo.name, "state": lo.state, "source": lo.charge.source,
                       "by_device": lo.charge.by_device()} | self.people(lo) for lo in sched.live()
                      if self.visible(lo.name)]
        body = inv.to_dict()
        if sched is not None:  # what a new model may still use on each device: the scheduler's own figure
            room = sched.available(inv, usage)
            for d in body.get("devices", []):
                d["available"] = room.get(d["id"], (None, None))[0]
        body["usage"] = usage
        body["loaded"] = loaded
        body["text"] = devmod.format_inventory(inv)
        self.finish(dumps(body))


class LogHandler(LlamaHandler):
    """A loaded model's llama-server log: what llama.cpp said about devices, layers and memory."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        model = self.get_argument("model", "").strip()
        if not model:
            raise BadRequest("say which model's log to show: ?model=NAME (ps lists the loaded ones)")
        self.check_visible(model)
        try:
            lines = int(self.get_argument("lines", "200") or 200)
        except ValueError:
            raise BadRequest("lines must be a whole number") from None
        sched = self.ext.scheduler
        lo = await sched.find_loaded(model) if sched is not None else None
        # (else a load that failed: what its child said is what the user needs now)
        failed = await sched.find_failed(model) if lo is None and sched is not None else None
        if lo is None and failed is None:
            raise NotLoaded(model)
        out = (lo or failed).log(lines, self.get_argument("match", None) or None)
        if failed is not None:
            out["state"] = "its load failed"
        self.finish(dumps(out))


class EstimateHandler(LlamaHandler):
    @web.authenticated
    @authorized
    @api_method
    async def post(self) -> None:
        body = self.json_body()
        name = oa.model_name(body)
        opts = split_options(body.get("options")).load_options()
        from ...memory import estimate as est
        from ...memory.sources import estimate_all_async

        sched = self.ext.scheduler
        if sched is not None:
            res = await sched.estimate(name, opts, engine=self.ext.engine)
        else:  # no engine yet: predictions still answer "would it fit here?"
            from ...memory import devices as devmod

            ref = await self.store.resolve(name)
            inv = await asyncio.to_thread(devmod.inventory)
            estimates = await estimate_all_async(ref.info, opts, [d.id for d in inv.accelerators()])
            res = {"options": opts, "estimates": estimates, "actual": None, "loaded": None, "same_options": False,
                   "fit": None}
        lo, actual = res["loaded"], res["actual"]
        out: dict[str, Any] = {
            "model": name, "options": res["options"].to_dict(),
            "estimates": {k: v.to_dict() for k, v in res["estimates"].items()},
            "loaded": None if lo is None else {
                "name": lo.name, "options": lo.options.to_dict(), "fit_source": lo.fit_source,
                "same_options": res["same_options"],
                "predictions": {k: v.to_dict() for k, v in lo.predictions.items()}},
            "actual": actual.to_dict() if actual else None,
            "fit": res["fit"].to_dict() if res["fit"] is not None else None,
            "table": est.format_estimates(res["estimates"], actual),
        }
        self.finish(dumps(out))


class EventsHandler(LlamaHandler):
    counts_as_activity = False  # a live event feed is watching, not working

    @web.authenticated
    @authorized
    @api_method
    async def get(self):
        model = self.get_argument("model", None) or None
        try:
            since = int(self.get_argument("since", "0") or 0)
            limit = int(self.get_argument("limit", "1000") or 1000)
        except ValueError:
            raise BadRequest("since and limit must be whole numbers") from None
        stream = self.get_argument("stream", "0").lower() in ("1", "true", "yes")
        if model:
            self.check_visible(model)
        sched = self.ext.scheduler
        if not stream:
            events = sched.events.recent(model, limit, since) if sched is not None else []
            shown = [d for d in map(self.event_for, events) if d is not None]
            self.finish(dumps({"events": shown}))
            return
        sched = await self.ext.get_scheduler()
        await self.cancellable(self._follow(sched, model, since, limit))

    async def _follow(self, sched, model, since, limit) -> None:
        with sched.events.listen() as sub:  # listening before reading history: nothing falls between
            self.start_stream(NDJSON)
            last = since
            for e in sched.events.recent(model, limit, since):
                d = self.event_for(e)
                if d is not None:
                    await self.send(ndjson(finite(d)))
                last = e.seq
            await self.send(b"")  # headers out now, even with no history
            while True:
                e = await sub.get()
                if e.seq <= last or not e.concerns(model):
                    continue
                last = e.seq
                d = self.event_for(e)
                if d is not None:
                    await self.send(ndjson(finite(d)))


class UnknownRouteHandler(LlamaHandler):
    """Any other path under ``/llama/``: a JSON 404 that names the path, not Jupyter's HTML page."""

    counts_as_activity = False

    @web.authenticated
    @authorized
    @api_method
    async def get(self, path: str) -> None:
        raise NoSuchRoute(f"no route {self.request.method} /llama/{path} in jupyter-llama; GET /llama/api/version "
                          "answers, and the README lists the routes (Ollama's /api/..., OpenAI's /v1/...)")

    # (one answer to every method: the path is unknown whatever the method)
    post = delete = put = get
