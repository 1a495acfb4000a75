"""The commands about the models in the store: ``list``, ``show``, ``pull``, ``create`` (from
a GGUF file or a Modelfile), ``synth``, ``cp``, ``rm``, ``prune``, and ``inspect`` (a GGUF
file's contents)."""

from __future__ import annotations

import argparse

from .frontend import EXIT_OK, EXIT_USAGE, CommandError, Frontend
from .helpers import _call, _check_output, _mib
from .options import SYNTH_FIELDS


def cmd_list(args, fe: Frontend):
    from ..memory.report import render_table

    data = _call(fe, fe.client().tags)
    if args.json:
        fe.json(data)
        return EXIT_OK
    rows = [[m["name"], (m.get("digest") or "")[:12], _mib(m.get("size")), (m.get("details") or {}).get(
        "quantization_level", ""), (m.get("modified_at") or "")[:19].replace("T", " ")] for m in data.get("models", [])]
    fe.out(render_table(["NAME", "ID", "SIZE", "QUANT", "MODIFIED"], rows) if rows else
           "no models yet: `pull`, `create NAME --from FILE.gguf` or `synth NAME` add one")
    return EXIT_OK


def cmd_show(args, fe: Frontend):
    data = _call(fe, fe.client().show, args.model, model=args.model)
    if args.json:
        fe.json(data)
        return EXIT_OK
    d = data.get("details") or {}
    info = data.get("model_info") or {}
    lines = [f"{'model:':<26}{args.model}",
             f"{'architecture:':<26}{d.get('family', '')}",
             f"{'parameters:':<26}{d.get('parameter_size', '')}",
             f"{'quantization:':<26}{d.get('quantization_level', '')}",
             f"{'format:':<26}{d.get('format', 'gguf')}"]
    for key in sorted(info):
        if key.endswith((".context_length", ".embedding_length", ".block_count", ".attention.head_count",
                         ".attention.head_count_kv")):
            lines.append(f"{key.split('.', 1)[1] + ':':<26}{info[key]}")
    if data.get("digest"):
        lines.append(f"{'digest:':<26}{data['digest']}")
    for f in data.get("files") or []:
        state = "" if f.get("present", True) else "  MISSING"
        which = f.get("digest", "")[:19] or f.get("path", "")  # (a file named by its path has no digest)
        lines.append(f"{'file:':<26}{f.get('role', '')} {which} {_mib(f.get('size'))}{state}")
    if "verified" in data:
        lines.append(f"{'verified:':<26}{data['verified']}")
    lines += _preset_lines(data.get("preset") or {}, data.get("parameters") or "")
    fe.out("\n".join(lines))
    return EXIT_OK


def _preset_lines(preset: dict, parameters: str) -> list[str]:
    """A model's preset for ``show``: its parameters (as Ollama prints them), system message,
    template, messages and licenses; multi-line texts indented under their heading."""
    def block(title: str, text: str) -> list[str]:
        rows = str(text).splitlines() or [""]
        return [f"{title + ':':<26}{rows[0]}"] + [" " * 26 + r for r in rows[1:]]

    out: list[str] = []
    if parameters:
        out += ["preset parameters:"] + ["  " + ln for ln in parameters.splitlines()]
    if preset.get("system"):
        out += block("system", preset["system"])
    if preset.get("template"):
        out += block("template", preset["template"])
    for m in preset.get("messages") or []:
        out += block(f"message ({m.get('role', '')})", m.get("content", ""))
    for lic in preset.get("license") or []:
        out += block("license", lic)
    return out


def cmd_pull(args, fe: Frontend):
    last = _call(fe, fe.pull, args.source, args.name)
    if last.get("status") != "success":
        raise CommandError(f"pull of {args.source} did not finish: {last}")
    return EXIT_OK


def cmd_create(args, fe: Frontend):
    import os

    from ..models.gguf_info import GGUFError, read_gguf_info

    modelfile = getattr(args, "modelfile", None)
    if not args.from_file and not modelfile:
        if not os.path.isfile("Modelfile"):
            raise CommandError("create: give --from FILE.gguf or -f MODELFILE (there is no ./Modelfile)", EXIT_USAGE)
        modelfile = "Modelfile"
    if modelfile:
        return _create_from_modelfile(args.name, modelfile, fe)
    path = os.path.abspath(os.path.expanduser(args.from_file))
    try:
        read_gguf_info(path)  # a clear error before uploading anything
    except GGUFError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    client = fe.client()
    digest = _call(fe, client.create_blob, path)
    files = {os.path.basename(path): digest}
    proj = getattr(args, "projector", None)
    if proj:
        files[os.path.basename(proj)] = _call(fe, client.create_blob, proj)
    _call(fe, client.create, args.name, files=files)
    described = getattr(args, "described", None)  # (a synthetic model's files are gone by now)
    fe.note(f"created {args.name} {described or f'from {path}'} ({digest[:19]})"
            + (f" with the projector {proj}" if proj and not described else ""))
    return EXIT_OK


def _create_from_modelfile(name: str, modelfile: str, fe: Frontend) -> int:
    """``create NAME -f Modelfile``: read it (the core's parser), upload its FROM files, create."""
    import os

    from ..api.modelfile import ModelfileError, read_modelfile

    try:
        mf = read_modelfile(os.path.expanduser(modelfile))
    except ModelfileError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    for w in mf.warnings:
        fe.note(f"warning: {w}")
    client = fe.client()
    files = {os.path.basename(f): _call(fe, client.create_blob, f) for f in mf.from_files} or None
    body = mf.create_body(name, files)
    body.pop("model")
    _call(fe, client.create, name, from_=body.pop("from", None), **body, model=mf.from_model)
    fe.note(f"created {name} from {mf.from_model or ', '.join(mf.from_files)}")
    return EXIT_OK


def cmd_synth(args, fe: Frontend):
    import os
    import tempfile

    from ..models.synth import SynthShape, write_projector, write_synthetic

    overrides = {k: getattr(args, k) for k in SYNTH_FIELDS if getattr(args, k, None) is not None}
    if not args.name and not args.output:
        raise CommandError("synth: give a NAME to register, or --output FILE to write", EXIT_USAGE)
    def write(path: str) -> tuple[str, str | None]:
        out = write_synthetic(path, shape)
        proj = (write_projector(out.with_name(out.stem + "-mmproj.gguf"), shape.embd, seed=shape.seed)
                if args.projector else None)
        return str(out), (str(proj) if proj else None)

    try:
        shape = SynthShape(**overrides)
        if args.output:
            _check_output(args.output)
            path, proj = write(args.output)
            fe.note(f"wrote {path} ({os.path.getsize(path):,} bytes)" + (f" and {proj}" if proj else ""))
            if not args.name:
                return EXIT_OK
            return cmd_create(argparse.Namespace(name=args.name, from_file=path, projector=proj), fe)
        with tempfile.TemporaryDirectory(prefix="jupyter-llama-synth-") as tmp:
            path, proj = write(os.path.join(tmp, "synth.gguf"))
            described = (f"as a synthetic {shape.type} {shape.arch} of {shape.layers} layers, {shape.embd} wide, "
                         f"{os.path.getsize(path) / 2**20:.1f} MiB")
            return cmd_create(argparse.Namespace(name=args.name, from_file=path, projector=proj, described=described
                                                 + (", with a projector" if proj else "")), fe)
    except ValueError as e:
        raise CommandError(f"synth: {e}", EXIT_USAGE) from None
    except OSError as e:
        raise CommandError(f"synth: cannot write {args.output or e.filename}: {e.strerror or e}") from None


def cmd_cp(args, fe: Frontend):
    _call(fe, fe.client().copy, args.source, args.destination, model=args.source)
    fe.note(f"copied {args.source} to {args.destination}")
    return EXIT_OK


def cmd_rm(args, fe: Frontend):
    for m in args.models:
        _call(fe, fe.client().delete, m, model=m)
        fe.note(f"deleted {m}")
    return EXIT_OK


def cmd_prune(args, fe: Frontend):
    data = _call(fe, fe.client().prune)
    if args.json:
        fe.json(data)
        return EXIT_OK
    what = {"partial": "partial download", "blob": "unused blob", "tmp": "left-over temporary file"}
    for r in data["removed"]:
        kind = what.get(r.get("kind"), "file")
        fe.out(f"removed {kind} {r['file']} ({_mib(r['bytes'])}{', from ' + r['url'] if r.get('url') else ''})")
    fe.out(f"freed {_mib(data['freed'])}" if data["removed"] else
           "nothing to drop: no partial download, unused blob or left-over file")
    return EXIT_OK


def cmd_inspect(args, fe: Frontend):
    from ..models.gguf_info import GGUFError, format_info, read_gguf_info

    try:
        info = read_gguf_info(args.file)
    except GGUFError as e:
        raise CommandError(str(e), EXIT_USAGE) from None
    if args.json:
        fe.json(info.to_dict(tensors=True))
    else:
        fe.out(format_info(info, tensors=args.tensors))
    return EXIT_OK
