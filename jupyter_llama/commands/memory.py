"""The commands about memory: ``estimate`` (a model's prediction under load options),
``devices`` (GPUs, host memory, budgets) and ``plot`` (predicted against actual)."""

from __future__ import annotations

import re

from .frontend import EXIT_OK, EXIT_USAGE, CommandError, Frontend, _manager_configured
from .helpers import _call, _check_output, _mib
from .options import LOAD_OPTIONS


def _is_file(name: str) -> bool:
    import os

    return name.endswith(".gguf") and os.path.isfile(os.path.expanduser(name))


def cmd_estimate(args, fe: Frontend):
    from ..memory.estimate import format_estimates
    from ..memory.report import MemoryReport

    opts = {k: getattr(args, k) for k in LOAD_OPTIONS if getattr(args, k, None) is not None}
    if _is_file(args.model) and args.url is None and not _manager_configured():
        # A file needs no manager: predict here, without starting one.
        from ..engine.binary import EngineBroken, EngineNotFound, find_engine
        from ..load_options import LoadOptions, LoadOptionsError
        from ..memory.devices import inventory
        from ..memory.sources import estimate_all
        from ..models.gguf_info import GGUFError, read_gguf_info

        try:
            info = read_gguf_info(args.model)
        except GGUFError as e:
            raise CommandError(str(e), EXIT_USAGE) from None
        try:
            engine = find_engine()
        except (EngineNotFound, EngineBroken):
            engine = None
        try:
            options = LoadOptions(**opts)
        except LoadOptionsError as e:  # (as the manager words it)
            raise CommandError(f"bad option: {e}", EXIT_USAGE) from None
        reports = estimate_all(info, options, [g.id for g in inventory().gpus], engine=engine,
                               model_path=args.model)
        data = {"model": args.model, "options": opts, "estimates": {k: v.to_dict() for k, v in reports.items()},
                "actual": None}
    else:
        data = _call(fe, fe.client().estimate, args.model, opts or None, model=args.model)
    if args.json:
        fe.json(data)
        return EXIT_OK
    reports = {k: MemoryReport.from_dict(v) for k, v in data["estimates"].items()}
    actual = MemoryReport.from_dict(data["actual"]) if data.get("actual") else None
    fe.out(format_estimates(reports, actual))
    fit = data.get("fit")
    if fit:  # the scheduler's own verdict, the one a load would act on
        fe.out(f"\nfit ({fit['estimator']}): {fit['verdict_words']}\n  {fit['text']}")
    elif data.get("actual") is None and data.get("loaded"):
        fe.out(f"\n{data['loaded']['name']} is loaded with other options: no actual figures for these")
    return EXIT_OK


def cmd_devices(args, fe: Frontend):
    from ..config import ConfigError
    from ..memory.devices import format_inventory, inventory

    if fe.has_manager(args):  # the manager's devices and budgets, and what its models use
        data = _call(fe, fe.client().devices)
        if args.json:
            fe.json(data)
            return EXIT_OK
        used = ", ".join(f"{d} {_mib(n)}" for d, n in (data.get("usage") or {}).items()) or "nothing"
        fe.out(f"{data.get('text', '')}\nin use by loaded models: {used}")
        from ..config import env

        mine, server = env("MEMORY_LIMIT"), fe.client().server
        if mine and not ((data.get("budgets") or {}).get("limits")) and not server.warning:
            # (a background manager's other settings were pointed out as it was found)
            fe.note(f"note: here JUPYTER_LLAMA_MEMORY_LIMIT is {mine}, but the manager at {server.url} was started "
                    "without it: a manager keeps the settings it started with; restart it with the variable set")
        return EXIT_OK
    try:
        inv = inventory()
    except ConfigError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if args.json:
        fe.json(inv.to_dict())
    else:
        fe.out(format_inventory(inv))
    return EXIT_OK


def cmd_plot(args, fe: Frontend):
    from ..load_options import LoadOptions
    from ..memory.report import MemoryReport
    from ..plots import plot_memory

    opts = {k: getattr(args, k) for k in LOAD_OPTIONS if getattr(args, k, None) is not None}
    if args.output:
        _check_output(args.output, example=f"{_file_safe(args.model)}.png")
    data = _call(fe, fe.client().estimate, args.model, opts or None, model=args.model)
    reports = {k: MemoryReport.from_dict(v) for k, v in data["estimates"].items()}
    if data.get("actual"):
        reports["actual"] = MemoryReport.from_dict(data["actual"])
    fig = plot_memory(reports, model=args.model, options=LoadOptions(**opts))
    fe.figure(fig, output=args.output, name=f"plot-{_file_safe(args.model)}")
    return fig


def _file_safe(name: str) -> str:
    """A model's name (or a file's path: its file name) as part of a file name: ``tiny:latest``
    -> ``tiny-latest``."""
    import os

    base = os.path.basename(name.rstrip("/")) if "/" in name else name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.") or "model"
