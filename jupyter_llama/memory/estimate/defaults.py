"""A load's options as Ollama resolves a request's: the context brought down to the model's
training context, the default context (a setting, else by the GPUs' memory), and the batch of
an embedding load; and the note an estimate carries when the context asked for was cut.
"""

from __future__ import annotations

import dataclasses
import functools

from ... import config
from ...load_options import LoadOptions
from ...models.gguf_info import GGUFInfo
from ..report import MemoryReport
from .archs import LLAMA_LIKE


def capped_ctx(num_ctx: int | None, info: GGUFInfo) -> int | None:
    """``num_ctx`` brought down to the model's training context, as Ollama does before it
    loads (None, and a model that does not say its training context, stay as they are)."""
    trained = info.context_length or 0
    return trained if num_ctx and trained and num_ctx > trained else num_ctx


@functools.lru_cache(maxsize=1)
def gpu_memory() -> int:
    """Bytes of memory on this machine's visible GPUs, all together (0 without one), as the
    manager first saw them: Ollama also sizes its default context once, at start."""
    from ..devices import list_gpus

    return sum(g.total for g in list_gpus())


def default_context() -> int:
    """The context a request gets when neither it nor the model's preset sets ``num_ctx``:
    ``JUPYTER_LLAMA_CONTEXT_LENGTH``, else ``OLLAMA_CONTEXT_LENGTH``, else Ollama's default
    for the GPUs' memory (4096 tokens, 32768 from 23 GiB in all, 262144 from 47 GiB; see
    :func:`config.context_for_gpu_memory`). A setting that cannot be read is a ConfigError
    naming it."""
    setting = config.context_length()
    return setting[0] if setting else config.context_for_gpu_memory(gpu_memory())


# The batch of an embedding load: Ollama's (its DefaultEmbeddingNumBatch) at most, llama-server's
# own micro-batch at least. An input is embedded in one micro-batch, so this is also the longest
# input such a load takes, unless the context is shorter.
EMBED_BATCH = 2048
EMBED_BATCH_LEAST = 512  # (llama-server's default -ub)
# What the logits of an embedding batch may take, as a share of the machine's memory: what
# Ollama's batch of logits costs a model with Llama 3's vocabulary on a 16 GiB machine.
EMBED_LOGITS_SHARE = 16


@functools.lru_cache(maxsize=1)
def machine_memory() -> int:
    """The memory a load may use on this machine, as first seen: its GPUs' together, else the
    host's (its cgroup limit counted), 0 when unknown."""
    if gpu_memory():
        return gpu_memory()
    try:
        from ..devices import read_host_memory

        return read_host_memory().total
    except OSError:
        return 0


def _has_output_head(info: GGUFInfo) -> bool:
    """The model ends in an output projection to its vocabulary (a causal language model: its
    own ``output.weight``, or the token embedding tied to it in an architecture we model)."""
    return info.architecture in LLAMA_LIKE or any(t.name == "output.weight" for t in info.tensors)


def embed_batch(info: GGUFInfo, ctx: int, memory: int | None = None) -> int:
    """The batch (and micro-batch) an embedding load of ``info`` gets when the request sets
    neither: :data:`EMBED_BATCH`, halved down to :data:`EMBED_BATCH_LEAST` while the logits of
    the batch would outweigh both the model itself and a :data:`EMBED_LOGITS_SHARE`-th of the
    machine's memory (``memory``; None: :func:`machine_memory`); never more than ``ctx``.

    A causal model computes the logits of every token of a micro-batch when it embeds
    (``4 * n_vocab`` bytes a token), and llama.cpp reserves its compute buffer for them: with a
    large vocabulary a batch as long as the context costs many times the model's own size, so
    the cost has to be justified by the model's size or by the machine's.
    A model without an output head (an encoder such as BERT) computes no logits and gets
    Ollama's batch. The result depends on the model and the machine only, never on what is free
    now: a request's options must resolve to those of the runner it is served by."""
    batch = EMBED_BATCH
    if _has_output_head(info):
        memory = machine_memory() if memory is None else memory
        room = max(info.file_size, memory // EMBED_LOGITS_SHARE)
        while batch > EMBED_BATCH_LEAST and 4 * info.vocab_size * batch > room:
            batch //= 2
    return max(1, min(batch, ctx))


def within_training(options: LoadOptions, info: GGUFInfo, default_ctx: int | None = None) -> LoadOptions:
    """``options`` as a load of ``info`` uses them, the way Ollama resolves a request's:

    * ``num_ctx`` above the training context is brought down to it (:func:`capped_ctx`);
    * ``LoadOptions.default_ctx``, what an automatic ``num_ctx`` stands for, is ``default_ctx``
      (None: :func:`default_context`) capped at the training context the same way (a model
      that says no training context, or one below the least a load takes, keeps llama-server's
      own). It is set whether or not ``num_ctx`` is, so that it is the same in every request
      for the model: a request that sets no ``num_ctx`` still matches a runner loaded with one
      (no reload for a client that cannot set it, such as OpenAI's);
    * an embedding load with neither ``num_batch`` nor ``num_ubatch`` gets a batch and
      micro-batch of :func:`embed_batch` (an input is embedded in one micro-batch), not the
      context itself; with only ``num_batch``, a micro-batch of that size, as Ollama gives it.

    Resolving the same options twice gives the same result, so a request's options match
    those its runner was loaded with."""
    capped = capped_ctx(options.num_ctx, info)
    if capped != options.num_ctx:
        options = options.replace(num_ctx=capped)
    if options.default_ctx is None:
        ctx = capped_ctx(default_context() if default_ctx is None else default_ctx, info)
        if ctx is not None and ctx >= config.MIN_CONTEXT:
            options = options.replace(default_ctx=ctx)
    else:
        capped = capped_ctx(options.default_ctx, info)
        if capped != options.default_ctx:
            options = options.replace(default_ctx=capped)
    if options.embedding and options.num_ubatch is None:
        ctx = options.request_ctx or info.context_length or EMBED_BATCH
        batch = options.num_batch or embed_batch(info, ctx * (options.num_parallel or 1))
        options = options.replace(num_batch=batch, num_ubatch=batch)
    return options


def with_cap_note(reports: dict[str, MemoryReport], asked: int | None, info: GGUFInfo) -> dict[str, MemoryReport]:
    """``reports`` (copies), each with a note that ``asked``, the context the user asked for,
    was brought down to the training context (:func:`capped_ctx`), when it was: the figures
    are for the context a load really gets, not the one asked for."""
    capped = capped_ctx(asked, info)
    if capped == asked:
        return reports
    note = (f"num_ctx {asked} is more than the model's training context: it is loaded with {capped}, as Ollama "
            "does, and estimated so")
    return {k: dataclasses.replace(r, warnings=[*r.warnings, note]) for k, r in reports.items()}
