"""The commands about the llama.cpp engine: ``engine build``, ``engine status``, and
``worker`` (an RPC worker whose device becomes the manager's)."""

from __future__ import annotations

from .frontend import EXIT_OK, EXIT_USAGE, CommandError, Frontend


def cmd_engine_build(args, fe: Frontend):
    from ..engine.binary import BuildError, build_engine

    backend = "cuda" if args.cuda else "vulkan" if args.vulkan else "cpu"
    try:
        if backend != "cuda" and (args.cuda_arch or args.toolkit != "auto"):
            raise CommandError("--toolkit and --cuda-arch go with --cuda", EXIT_USAGE)
        build_engine(backend, force=args.force, jobs=args.jobs, progress=fe.note, toolkit=args.toolkit,
                     archs=args.cuda_arch)
    except BuildError as e:
        raise CommandError(str(e)) from None
    return EXIT_OK


def cmd_engine_status(args, fe: Frontend):
    from ..engine.binary import EngineBroken, EngineNotFound, engine_status

    try:
        data = engine_status()
    except (EngineNotFound, EngineBroken) as e:
        raise CommandError(str(e)) from None
    if args.json:
        fe.json(data)
        return EXIT_OK
    fe.out("\n".join([
        f"binary:   {data['path']}",
        f"source:   {data['source']}" + (f" ({data['backend']} build)" if data.get("backend") else ""),
        f"version:  {data['version'].removeprefix('version: ')}",
        f"fit tool: {data['fit_params'] or 'not found'}",
        f"worker:   {data.get('worker') or 'not built (jupyter-llama engine build --force adds ggml-rpc-server)'}",
        f"pinned:   {data['pinned_source']}",
        "devices:  " + ("\n          ".join(data["devices"]) if data["devices"] else "none (CPU only)"),
        *([f"why:      {data['reason']}"] if data.get("reason") else []),
        *(["builds:   " + "\n          ".join(("* " if b["in_use"] else "  ") + b["description"] + f"  {b['dir']}"
                                             for b in data["builds"])] if data.get("builds") else []),
    ]))
    return EXIT_OK


def cmd_worker(args, fe: Frontend):
    from ..engine.binary import EngineBroken, EngineNotFound, find_engine
    from ..engine.worker import WorkerError, run_worker

    if not fe.foreground:
        raise CommandError("worker runs in the foreground until it is stopped, which would hold this kernel: start "
                           "it from a shell with `jupyter-llama worker` (the same options), then set "
                           "JUPYTER_LLAMA_RPC_WORKERS for the manager", EXIT_USAGE)

    try:
        engine = find_engine()
    except (EngineNotFound, EngineBroken) as e:
        raise CommandError(str(e)) from None
    try:
        return run_worker(engine, host=args.host, port=args.port, threads=args.threads, device=args.device,
                          cache=args.cache, note=fe.note)
    except WorkerError as e:
        raise CommandError(str(e), EXIT_USAGE if e.usage else 1) from None
