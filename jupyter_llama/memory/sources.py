"""The three predictions of a load side by side: the coarse and the detailed estimates
(:mod:`.estimate`) and llama.cpp's own projection (:mod:`.fitparams`, when the engine has
``llama-fit-params``). Apart from both, because the projection is weighed with the detailed
estimator's arithmetic: this module sits above the two.
"""

from __future__ import annotations

import dataclasses
import os

from ..load_options import LoadOptions
from ..models.gguf_info import GGUFInfo
from .estimate import estimate_coarse, estimate_detailed, with_cap_note, within_training
from .fitparams import FitParamsResult, log_result, run_fit_params, run_fit_params_async
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
        out = _with_result(out, run_fit_params(fit, model_path or info.path, options, timeout))
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
    fit = getattr(engine, "fit_params", None) if engine is not None else None
    if not fit:
        return dict(reports)
    return _with_result(reports, await run_fit_params_async(fit, model_path, options, timeout))


def _with_result(reports: dict[str, MemoryReport], res: FitParamsResult) -> dict[str, MemoryReport]:
    """``reports`` with llama.cpp's projection when it describes this load; where it ran but
    describes another (:func:`.fitparams.withheld`), the detailed report says why it is not
    shown, so a reader does not look for a column that went missing. A failed run is only
    logged (the engine may simply lack the tool)."""
    log_result(res)
    out = dict(reports)
    if res.report is not None:
        out[LLAMA_CPP] = res.report
    elif res.withheld and DETAILED in out:
        out[DETAILED] = dataclasses.replace(out[DETAILED], warnings=[
            *out[DETAILED].warnings, f"llama.cpp's own projection (llama-fit-params) is not shown: {res.error}"])
    return out
