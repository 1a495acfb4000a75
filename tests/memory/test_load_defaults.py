"""Ollama's load defaults as a load resolves them (pure policy, no child process): the default
context and its settings, the batch of an embedding load and its prediction, and a num_batch
below what llama-server starts with. The same loads with real children: tests/server/test_ollama_defaults.py."""

from __future__ import annotations

import dataclasses

import pytest

from jupyter_llama import config
from jupyter_llama.load_options import LoadOptions, batch_args, memory_args
from jupyter_llama.memory import estimate as est
from jupyter_llama.memory.sources import estimate_all
from jupyter_llama.models.gguf_info import read_gguf_info

GiB = 1 << 30


@pytest.fixture
def info(make_model):
    """A small synthetic model with a 32768-token training context (vocabulary 256)."""
    return read_gguf_info(make_model("defaults", layers=2, embd=64, heads=4, kv_heads=2, ctx=32768, seed=7))


@pytest.fixture
def no_setting(monkeypatch):
    for var in (config.CONTEXT_LENGTH_VAR, config.OLLAMA_CONTEXT_LENGTH_VAR):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_the_default_context_follows_the_gpus_memory_as_ollamas_does():
    tiers = {0: 4096, 8 * GiB: 4096, 23 * GiB - 1: 4096, 23 * GiB: 32768, 24 * GiB: 32768, 47 * GiB: 262144,
             80 * GiB: 262144, 2 * 80 * GiB: 262144}
    assert {total: config.context_for_gpu_memory(total) for total in tiers} == tiers


def test_without_a_setting_the_default_is_the_tier_of_this_machine(no_setting):
    assert est.default_context() == config.context_for_gpu_memory(est.gpu_memory())


def test_our_setting_wins_over_ollamas(no_setting):
    no_setting.setenv(config.OLLAMA_CONTEXT_LENGTH_VAR, "2048")
    assert est.default_context() == 2048
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "8192")
    assert est.default_context() == 8192
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "0")  # 0: unset, as Ollama reads its own
    assert est.default_context() == 2048


def test_an_automatic_context_is_the_default_capped_at_the_training_context(info, no_setting):
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "4096")
    o = est.within_training(LoadOptions(), info)
    assert (o.num_ctx, o.default_ctx, o.total_ctx) == (None, 4096, 4096)
    assert memory_args(o) == ["-c", "4096"]
    assert est.within_training(o, info) == o  # resolved twice, the same: a request matches its runner
    with_slots = est.within_training(LoadOptions(num_parallel=2), info)
    assert memory_args(with_slots) == ["-c", "8192", "-np", "2"]  # the context each request gets, x slots

    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "65536")
    assert est.within_training(LoadOptions(), info).default_ctx == 32768  # not past the training context
    asked = est.within_training(LoadOptions(num_ctx=1024), info)
    assert (asked.num_ctx, asked.default_ctx, asked.total_ctx) == (1024, 32768, 1024)  # the request's own wins


def test_the_estimate_is_for_the_default_context_not_the_training_context(info, no_setting):
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "2048")
    reports = estimate_all(info, LoadOptions())
    assert reports["detailed"].n_ctx == 2048 and reports["coarse"].n_ctx == 2048
    assert not any("automatic context" in w for w in reports["detailed"].warnings)


def test_a_model_without_a_usable_training_context_keeps_llama_servers_own(make_model, no_setting):
    tiny_ctx = read_gguf_info(make_model("defaults-ctx8", layers=1, embd=32, heads=2, kv_heads=1, ctx=8, seed=7))
    assert est.within_training(LoadOptions(), tiny_ctx).default_ctx is None


def test_a_small_num_batch_is_raised_to_what_llama_server_starts_with():
    # Ollama's docs' "generate request (with options)" sends num_batch 2; llama-server's four
    # automatic slots need four tokens a batch (one a slot), so the child gets -b 4
    assert batch_args(LoadOptions(num_batch=2)) == (4, None)
    assert batch_args(LoadOptions(num_batch=2, num_parallel=1)) == (2, None)
    assert batch_args(LoadOptions(num_batch=3, num_parallel=8)) == (8, None)
    assert batch_args(LoadOptions(num_batch=512)) == (512, None)
    assert batch_args(LoadOptions(num_ubatch=1, embedding=True)) == (None, 4)  # an embedding's batch is its ubatch
    assert batch_args(LoadOptions(num_ubatch=1)) == (None, 1)
    assert LoadOptions(num_batch=2).num_batch == 2  # the request's value is kept: it matches its runner


def test_an_embedding_load_gets_a_batch_its_model_and_machine_justify(info, no_setting):
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "4096")
    # a small vocabulary: Ollama's batch of 2048 costs the logits of 2048 tokens, 2 MiB here
    big = dataclasses.replace(info, file_size=GiB)
    o = est.within_training(LoadOptions(embedding=True), big)
    assert memory_args(o) == ["-c", "4096", "-b", "2048", "-ub", "2048"]
    # the same model as if its vocabulary were Gemma 3's: 1 MiB of logits a token outweighs it,
    # so the batch halves while its logits outweigh both the model and a 16th of the machine's
    # memory, down to llama-server's own micro-batch, and no further
    gemma_like = dataclasses.replace(info, vocab_size=262144, file_size=253_113_024)
    assert [est.embed_batch(gemma_like, 4096, memory=m * GiB) for m in (0, 8, 16, 24, 32, 80)] == [
        512, 512, 1024, 1024, 2048, 2048]
    assert est.embed_batch(dataclasses.replace(gemma_like, file_size=GiB + 1), 4096, memory=0) == 1024
    # an encoder (no output head) computes no logits: Ollama's batch
    encoder = dataclasses.replace(gemma_like, architecture="bert",
                                  tensors=[t for t in info.tensors if t.name != "output.weight"])
    assert est.embed_batch(encoder, 4096, memory=0) == 2048
    # never past the context: num_ctx 64 takes inputs of 64 tokens
    o = est.within_training(LoadOptions(embedding=True, num_ctx=64), big)
    assert memory_args(o) == ["-c", "64", "-b", "64", "-ub", "64"]
    # a num_batch of the request's own is its micro-batch too, as Ollama passes it
    o = est.within_training(LoadOptions(embedding=True, num_batch=256), big)
    assert (o.num_batch, o.num_ubatch) == (256, 256)
    assert est.within_training(o, big) == o


def test_the_estimate_of_an_embedding_load_counts_the_logits_of_its_micro_batch(make_model, no_setting):
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "4096")
    info = read_gguf_info(make_model("defaults-vocab", layers=1, embd=32, heads=2, kv_heads=1, vocab=32000, seed=7))
    plain, embed = (est.within_training(LoadOptions(num_parallel=1, embedding=e, num_batch=1024, num_ubatch=1024),
                                        info) for e in (False, True))
    compute = [est.estimate_detailed(info, o, []).get("cpu", "compute") for o in (plain, embed)]
    # a causal model computes the logits of every token it embeds: 4 bytes a vocabulary entry a token
    assert compute[1] - compute[0] >= 4 * info.vocab_size * (1024 - 1)


def test_gemmas_embedding_load_is_predicted_before_it_loads(no_setting, gemma_model):
    """Gemma 3 270M (a 262,144-token vocabulary): its plain embed load on a machine of 8 GiB is
    -c 4096 -b 512 -ub 512, and the detailed estimate of it is what llama.cpp allocates
    (measured with b11434 on CPU: compute 526.03 MiB, KV 12 + 37.5 MiB), not the 20.93 GiB the
    training context's batch took."""
    no_setting.setenv(config.CONTEXT_LENGTH_VAR, "4096")
    no_setting.setattr(est, "machine_memory", lambda: 8 * GiB)
    info = read_gguf_info(gemma_model)
    o = est.within_training(LoadOptions(embedding=True), info)
    assert memory_args(o) == ["-c", "4096", "-b", "512", "-ub", "512"]
    rep = est.estimate_detailed(info, o, [])
    MiB = 1 << 20
    assert rep.get("cpu", "compute") / MiB == pytest.approx(526.03, rel=0.01)
    assert rep.get("cpu", "kv") / MiB == pytest.approx(49.5, rel=0.01)
    assert rep.total() < GiB
