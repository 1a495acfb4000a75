"""The detailed estimate's family features, without a child: MLA's compressed cache, LFM2's
recurrent state, and where a mixture of experts' experts go when llama.cpp's --fit spreads it
over devices and host memory (its placement is checked against real children in
tests/devices and bench/estimate_accuracy.py)."""

from __future__ import annotations

import pickle

import pytest

from jupyter_llama.load_options import LoadOptions
from jupyter_llama.memory.estimate import (
    Share,
    estimate_detailed,
    experts_on_host,
    fit_layers,
    kv_cache_bytes,
    partial_layers,
    plan_context,
    rs_bytes,
    tensor_devices,
    weight_bytes,
)
from jupyter_llama.memory.report import COMPUTE, HOST, KV, RS, WEIGHTS, MiB
from jupyter_llama.models.gguf_info import read_gguf_info
from jupyter_llama.models.synth import FAMILIES, write_synthetic

GPUS = ["rpc:127.0.0.1:50001", "rpc:127.0.0.1:50002"]


@pytest.fixture(scope="module")
def infos(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: read_gguf_info(write_synthetic(root / f"{name}.gguf", shape)) for name, shape in FAMILIES.items()}


def test_mla_caches_one_compressed_row_and_no_v(infos):
    info, s = infos["deepseek2"], FAMILIES["deepseek2"]
    for fa in ("on", "off"):
        kv = kv_cache_bytes(info, plan_context(info, LoadOptions(num_ctx=1024, num_parallel=1, flash_attn=fa)))
        assert kv == {il: 1024 * (s.n_kv_lora + s.n_rope) * 2 for il in range(s.layers)}


def test_lfm2_keeps_a_state_per_slot_in_its_convolution_layers_and_a_cache_in_the_rest(infos):
    info, s = infos["lfm2"], FAMILIES["lfm2"]
    for slots in (1, 3):
        plan = plan_context(info, LoadOptions(num_ctx=2048, num_parallel=slots))
        assert rs_bytes(info, plan) == {il: 2 * s.embd * 4 * slots for il in (0, 1, 3, 4)}
        assert sorted(kv_cache_bytes(info, plan)) == [2, 5]
    assert rs_bytes(infos["llama"], plan_context(infos["llama"], LoadOptions(num_ctx=512))) == {}


def test_the_state_goes_with_its_layer(infos):
    info = infos["lfm2"]
    rep = estimate_detailed(info, LoadOptions(num_ctx=512, num_parallel=2, num_gpu=4), GPUS[:1])
    # -ngl 4 offloads the last four of seven (the output layer counted): blocks 3-5
    assert rep.get(GPUS[0], RS) == 2 * 2 * FAMILIES["lfm2"].embd * 4 * 2  # layers 3 and 4
    assert rep.get(HOST, RS) == 2 * 2 * FAMILIES["lfm2"].embd * 4 * 2  # layers 0 and 1
    assert not any("unavailable" in w for w in rep.warnings)


def test_a_share_says_which_layers_keep_their_experts_in_host_memory(infos):
    info = infos["qwen3moe"]
    split = [Share(4, partial=3, overflow="attn", to_next=True), Share(1)]
    assert list(map(float, tuple(list(split)))) == [4.0, 1.0]  # a plain split to everything else
    assert pickle.loads(pickle.dumps(split[0])).partial == 3 and f"{split[0]},{split[1]}" == "4.0,1.0"
    # blocks 0-3 on the first device: block 0 whole, block 1 moves its feed-forward to the next
    # device, blocks 2 and 3 keep their experts in host memory
    assert partial_layers(info, GPUS, split) == {1: ("attn", GPUS[1]), 2: ("moe", HOST), 3: ("moe", HOST)}
    placed = tensor_devices(info, LoadOptions(num_ctx=512), GPUS, split)
    assert placed["blk.0.ffn_up_exps.weight"] == GPUS[0]
    assert placed["blk.1.ffn_gate_inp.weight"] == placed["blk.1.ffn_down_exps.weight"] == GPUS[1]
    assert placed["blk.1.ffn_norm.weight"] == placed["blk.1.attn_q.weight"] == GPUS[0]
    assert placed["blk.2.ffn_up_exps.weight"] == HOST and placed["blk.2.ffn_gate_inp.weight"] == GPUS[0]
    assert experts_on_host(info, LoadOptions(num_ctx=512), GPUS, split) == {2, 3}
    experts = sum(t.n_bytes for t in info.tensors if t.layer in (2, 3) and info.is_expert_tensor(t.name))
    dense = weight_bytes(info, LoadOptions(num_ctx=512), GPUS, [Share(4), Share(1)])
    spread = weight_bytes(info, LoadOptions(num_ctx=512), GPUS, split)
    moved = sum(t.n_bytes for t in info.tensors if t.layer == 1 and t.name.startswith("blk.1.ffn_")
                and "norm" not in t.name)
    assert spread[GPUS[0]] == dense[GPUS[0]] - experts - moved and spread[GPUS[1]] == dense[GPUS[1]] + moved


def test_experts_in_host_memory_move_their_compute_there_too(infos):
    info = infos["qwen3moe"]
    opts = LoadOptions(num_ctx=512, num_parallel=1)
    whole = estimate_detailed(info, opts, GPUS, split=[Share(4), Share(1)])
    spread = estimate_detailed(info, opts, GPUS, split=[Share(4, partial=4), Share(1)])
    assert spread.get(GPUS[0], WEIGHTS) < whole.get(GPUS[0], WEIGHTS)
    assert spread.get(HOST, COMPUTE) > 0 and spread.get(GPUS[0], KV) == whole.get(GPUS[0], KV)
    # tensor overrides turn pipelining off: no four copies of every input
    assert spread.get(GPUS[0], COMPUTE) < whole.get(GPUS[0], COMPUTE)


def test_fit_moves_experts_to_host_memory_before_it_gives_up_layers(infos):
    """What llama.cpp's --fit does with a mixture of experts that does not fit: every layer still
    offloaded (the dense weights fit), the experts of most in host memory."""
    info = infos["qwen3moe"]
    opts = LoadOptions(num_ctx=512, num_parallel=1)
    free = 24 * 1024 * MiB
    rooms = [(GPUS[0], 11 * MiB // 2), (GPUS[1], 7 * MiB // 2)]
    split = fit_layers(info, opts, rooms, free=[free, free])
    assert [float(s) for s in split] == [4.0, 1.0]  # all five layers offloaded
    assert [s.partial for s in split] == [4, 0]
    rep = estimate_detailed(info, opts, GPUS, split=split)
    assert all(rep.total(device=g) <= room for g, room in rooms)
    # a dense model in the same rooms gives up layers instead
    dense = fit_layers(infos["llama"], opts, [(GPUS[0], 2 * MiB), (GPUS[1], 1 * MiB)], free=[free, free])
    assert sum(dense) < infos["llama"].block_count + 1 and not any(getattr(s, "partial", 0) for s in dense)
