"""The three predictions of a load side by side: the coarse and the detailed estimates
(:mod:`.estimate`) and llama.cpp's own projection (:mod:`.fitparams`, when the engine has
``llama-fit-params``). Apart from both, because the projection is weighed with the detailed
estimator's arithmetic: this module sits above the two.
"""

from __future__ import annotations

import os

from ..load_options import LoadOptions
from ..models.gguf_info import GGUFInfo
from .estimate import estimate_coarse, estimate_detailed, with_cap_note, within_training
from .fitparams import project, project_async
from .report import COARSE, DETAILED, LLAMA_CPP, MemoryReport

__all__ = ["estimate_all", "estimate_all_async", "with_projection_async"]


def estimate_all(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None = None, *,
                 engine=None, model_path: str | os.PathLike | None = None,
                 timeout: float = 60.0) -> dict[str, MemoryReport]:
    """``{"coarse": ..., "detailed": ..., "llama.cpp": ...}``; llama.cpp's own projection (from
    ``llama-fit-params``) only when ``engine`` has it and it answers. Blocks while it runs;
    see :func:`estimate_all_async` for an event loop."""
    asked, (gpus, options) = options, (list(gpus or []), within_training(options, info))
    out = {COARSE: estimate_coarse(info, options, gpus), DETAILED: estimate_detailed(info, options, gpus)}
    fit = getattr(engine, "fit_params", None) if engine is not None else None
    if fit:
        rep = project(fit, model_path or info.path, options, timeout=timeout)
        if rep is not None:
            out[LLAMA_CPP] = rep
    return with_cap_note(out, asked.num_ctx, info)


async def estimate_all_async(info: GGUFInfo, options: LoadOptions, gpus: list[str] | None = None, *,
                             engine=None, model_path: str | os.PathLike | None = None,
                             timeout: float = 60.0) -> dict[str, MemoryReport]:
    """:func:`estimate_all` without blocking the event loop."""
    asked, (gpus, options) = options, (list(gpus or []), within_training(options, info))
    out = {COARSE: estimate_coarse(info, options, gpus), DETAILED: estimate_detailed(info, options, gpus)}
    out = await with_projection_async(out, engine, model_path or info.path, options, timeout=timeout)
    return with_cap_note(out, asked.num_ctx, info)


async def with_projection_async(reports: dict[str, MemoryReport], engine, model_path: str | os.PathLike,
                                options: LoadOptions, timeout: float = 60.0) -> dict[str, MemoryReport]:
    """``reports`` plus llama.cpp's own projection (``llama-fit-params`` with the same flags,
    ``--rpc`` included) when ``engine`` has the tool and it answers."""
    out = dict(reports)
    fit = getattr(engine, "fit_params", None) if engine is not None else None
    if fit:
        rep = await project_async(fit, model_path, options, timeout=timeout)
        if rep is not None:
            out[LLAMA_CPP] = rep
    return out
