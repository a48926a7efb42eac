"""Tensor + expert parallelism through torch.distributed (gloo, CPU): the sharded engine equals one process,
eagerly and with collectives inside (emulated) graph segments, wherever a boundary puts them (the copy variants
run narrow's collectives; the graph-hazard tests run them)."""

import os

import pytest
import torch

from dsv32ref import DeepseekV32ForCausalLM, init_dummy_weights
from dsv32ref.engine import EngineConfig, EngineModel, LLMEngine, StepInput, TensorParallel, from_reference, shard
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.parallel import spawn
from dsv32ref.testing import assert_close
from helpers import tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) tests; the GPU run needs 4 GPUs")


def _config():
    return tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                     first_k_dense_replace=1)


def _engine(config, model, boundary, mode):
    ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8,
                      block_size=4, capture_sizes=[8])
    return LLMEngine(config, ec, device="cpu", dtype=torch.float32, model=model)


PROMPT = [7, 3, 9, 1, 4, 4, 2, 8]


def _run(config, state, boundary, mode, tp=None):
    ref = DeepseekV32ForCausalLM(config)
    ref.load_state_dict(state)
    model = from_reference(ref.eval(), boundary)
    if tp is not None:
        model = shard(model, tp)
    eng = _engine(config, model, boundary, mode)
    eng.capture()
    _, how = eng.step(StepInput([(0, PROMPT, 0)]))
    return eng.last_logits, how


def _worker(rank, world, config, state, cases, out_dir):
    import torch.distributed as dist

    for boundary, mode in cases:
        logits, how = _run(config, state, boundary, CUDAGraphMode(mode), TensorParallel(rank, world, dist.group.WORLD))
        if rank == 0:
            torch.save((logits, how), os.path.join(out_dir, f"{boundary}-{mode}.pt"))


@pytest.mark.parametrize("world,cases", [
    (2, [(b, "piecewise") for b in ("wide", "narrow_out", "none")] + [("narrow", "none")]),
    (4, [("narrow_out", "piecewise")]),  # one head per rank
])
def test_sharded_equals_single_process(world, cases, tmp_path):
    config = _config()
    ref = init_dummy_weights(DeepseekV32ForCausalLM(config), seed=0)
    state = ref.state_dict()
    spawn(_worker, world, config, state, cases, str(tmp_path), backend="gloo")
    for boundary, mode in cases:
        want, _ = _run(config, state, boundary, CUDAGraphMode.NONE)
        got, how = torch.load(tmp_path / f"{boundary}-{mode}.pt")
        assert how == ("PIECEWISE" if mode == "piecewise" else "NONE")
        assert_close(f"logits, {world} ranks, {boundary} {mode}", got, want, rtol=128, atol=128)


def test_shard_rejects_indivisible_sizes():
    model = EngineModel(_config())
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the tensor-parallel size 3"):
        shard(model, TensorParallel(0, 3))
    with pytest.raises(ValueError, match="shard: expected the full model \\(tensor-parallel size 1\\), got size 2"):
        shard(shard(model, TensorParallel(0, 2)), TensorParallel(0, 2))


def test_a_shard_holds_its_rank_of_every_split_weight():
    """Rank 1 of 2: heads 2..3 of every per-head weight, the second half of each expert list and MLP column
    block; everything else replicated (the same tensor values)."""
    c = _config()
    full = from_reference(init_dummy_weights(DeepseekV32ForCausalLM(c), seed=0).eval(), "narrow")
    part = shard(full, TensorParallel(1, 2))
    H, a, b = c.num_attention_heads, full.layers[1].self_attn, part.layers[1].self_attn
    assert b.H == H // 2 and torch.equal(b.W_UK, a.W_UK[H // 2:]) and torch.equal(b.W_UV, a.W_UV[H // 2:])
    assert torch.equal(b.q_b_proj, a.q_b_proj.view(H, -1, c.q_lora_rank)[H // 2:].reshape(-1, c.q_lora_rank))
    assert torch.equal(b.o_proj, a.o_proj.view(c.hidden_size, H, -1)[:, H // 2:].reshape(c.hidden_size, -1))
    assert torch.equal(b.fused_qkv_a_proj, a.fused_qkv_a_proj) and torch.equal(part.lm_head, full.lm_head)
    moe_a, moe_b = full.layers[1].mlp, part.layers[1].mlp
    k = c.n_routed_experts // 2
    assert (moe_b.expert0, moe_b.n_local) == (k, k) and torch.equal(moe_b.w13, moe_a.w13[k:])
    inter = moe_a.shared.down_proj.shape[1]
    assert torch.equal(moe_b.shared.down_proj, moe_a.shared.down_proj[:, inter // 2:])
    assert torch.equal(moe_b.shared.gate_up_proj[: inter // 2], moe_a.shared.gate_up_proj[inter // 2: inter])


def test_ttft_experiment_under_tensor_parallel(tmp_path):
    """`dsv32ref ttft --tp N`'s control flow with gloo, eagerly (the test above runs the collectives inside
    graphs): every rank runs the same requests in lockstep, rank 0 writes the result, and the greedy tokens
    equal the single-process run's."""
    import json

    from dsv32ref.experiments.ttft import TTFTProtocol, rank_main, run

    config = _config().replace(n_routed_experts=4, num_experts_per_tok=2)
    variants = ("narrow", "narrow_out")
    p = TTFTProtocol(variants=variants, requests=1, warmup=0, mode="none")
    out = tmp_path / "tp.json"
    spawn(rank_main, 2, p, str(out), "cpu", config, backend="gloo")
    got = json.loads(out.read_text())
    assert got["protocol"]["tensor_parallel"] == got["protocol"]["expert_parallel"] == 2
    assert set(got["variants"]) == set(variants) and got["same_tokens_across_variants"]
    assert all(len(r["ttft_ms"]) == 1 for r in got["variants"].values())
    single = run(p, device="cpu", config=config)
    assert got["first_tokens"] == single["first_tokens"]
