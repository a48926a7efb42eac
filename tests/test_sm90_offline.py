"""sm_90's Gluon kernels built for sm_90a on the CPU (triton's own ptxas, no GPU): each fits the shared memory one
block may take and spills no register, as sparse_mla_paged would launch it. The build runs in a process of its
own: the tests' triton is the interpreter."""

import json
import os
import subprocess
import sys

import pytest

from dsv32ref.kernels import sparse_mla_hopper
from dsv32ref.kernels.fused_moe import SELECT_ALIGN_WARPS
from dsv32ref.kernels.sm90_offline import MAX_SHARED_BYTES, have_ptxas

pytestmark = pytest.mark.skipif(
    not have_ptxas() or sparse_mla_hopper._TRITON not in sparse_mla_hopper.SUPPORTED_TRITON,
    reason="needs triton's ptxas and a triton the sm_90 kernels are built for")


def _build(kernel: str, pointers: dict | None = None, gluon: bool = True, **const) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "dsv32ref.kernels.sm90_offline", kernel, json.dumps(const),
                           *(["--gluon"] if gluon else []), "--pointers", json.dumps(pointers or {})],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("splits,valid_first", [(1, False), (4, True)])
def test_the_pair_kernel_builds_for_sm90_within_a_block_without_spills(splits, valid_first):
    r = _build("dsv32ref.kernels.sparse_mla_pairs:_sparse_mla_pairs_kernel", D_LAT=512, D_ROPE=64,
               VALID_FIRST=valid_first, NUM_SPLITS=splits, num_warps=4)
    assert r["shared_bytes"] <= MAX_SHARED_BYTES, r["shared_bytes"]
    assert r["spill_store_bytes"] == 0, r["spill_store_bytes"]
    assert r["opcodes"].get("HGMMA", 0) > 0


# Over FlashMLA's FP8 rows its producer spills a few bytes (found by this build: 4 to 12 by the constexprs), asserted
# exactly as the heads-as-N cases below.
@pytest.mark.parametrize("fp8,valid_first,splits,known_spill", [
    pytest.param(False, False, 1, 0, id="bf16-rows"), pytest.param(False, True, 4, 0, id="bf16-rows-splits"),
    pytest.param(True, False, 1, 8, id="fp8-rows"), pytest.param(True, True, 1, 12, id="fp8-rows-valid-first"),
    pytest.param(True, False, 4, 0, id="fp8-rows-splits"),
    pytest.param(True, True, 4, 4, id="fp8-rows-valid-first-splits")])
def test_the_warp_specialized_kernel_builds_for_sm90_within_a_block_without_new_spills(fp8, valid_first, splits,
                                                                                        known_spill):
    r = _build("dsv32ref.kernels.sparse_mla_hopper:_sparse_mla_ws_kernel", {"cache_ptr": "*u8"} if fp8 else {},
               D_LAT=512, D_ROPE=64, VALID_FIRST=valid_first, FP8=fp8, NUM_SPLITS=splits, num_warps=8)
    assert r["shared_bytes"] <= MAX_SHARED_BYTES and r["spill_store_bytes"] == known_spill, r


# The first FP8 producer spills 20 bytes at 32 heads with top-k splits (found by this build). The case asserts that
# spill and no more: a growth fails it, and so does the fix, which then sets its bound to 0.
@pytest.mark.parametrize("fp8,hb,splits,known_spill", [
    pytest.param(False, 16, 1, 0, id="bf16-rows-16"), pytest.param(False, 32, 4, 0, id="bf16-rows-32-splits"),
    pytest.param(True, 16, 1, 0, id="fp8-rows-16"), pytest.param(True, 16, 4, 0, id="fp8-rows-16-splits"),
    pytest.param(True, 32, 1, 0, id="fp8-rows-32"), pytest.param(True, 32, 4, 20, id="fp8-rows-32-splits")])
def test_the_heads_as_n_kernel_builds_for_sm90_within_a_block_without_new_spills(fp8, hb, splits, known_spill):
    """Its FP8 producers carry two steps of rows in registers under a register cap: a spill shows here first."""
    r = _build("dsv32ref.kernels.sparse_mla_heads_n:_sparse_mla_heads_n_kernel", {"cache_ptr": "*u8"} if fp8 else {},
               HB=hb, D_LAT=512, D_ROPE=64, VALID_FIRST=False, FP8=fp8, NUM_SPLITS=splits, num_warps=4)
    assert r["shared_bytes"] <= MAX_SHARED_BYTES and r["spill_store_bytes"] == known_spill, r
    assert r["opcodes"].get("HGMMA", 0) > 0


@pytest.mark.parametrize("block_t,num_warps", [(1, 4), (8, 4), (8, 8)])
def test_the_router_logits_kernel_builds_for_sm90_without_spills_under_its_launch_options(block_t, num_warps):
    """A Triton kernel, num_warps a launch option beside its constexprs (not one of its arguments); route_kernel
    launches 4 warps over up to 8 tokens, which must hold their sums in at most 72 registers: 7 programs an SM
    (a warp's registers come in units of 256 of the SM's 65536; at 73 to 80 six fit, and DeepSeek-V3.2's 896
    programs at 16 tokens take two waves again)."""
    r = _build("dsv32ref.kernels.fused_moe:_router_logits_kernel", {"x_ptr": "*bf16", "w_ptr": "*fp32",
               "partial_ptr": "*fp32"}, gluon=False, E_PAD=256, BLOCK_T=block_t, BLOCK_E=16, BLOCK_K=32, STEPS=8,
               num_warps=num_warps)
    assert r["spill_store_bytes"] == 0 and r["opcodes"].get("FFMA", 0) > 0, r
    assert num_warps != 4 or r["registers"] <= 72, r["registers"]


@pytest.mark.parametrize("router", [dict(N_GROUP=1, PER_GROUP=256, TOPK_GROUP=1),  # GLM-5.2's
                                    dict(N_GROUP=8, PER_GROUP=32, TOPK_GROUP=4)], ids=["glm-5.2", "deepseek-v3.2"])
def test_the_one_program_router_and_alignment_builds_for_sm90_with_little_spilled(router):
    """fused_moe's selection and alignment in one program (steps of up to 16 tokens) at the full routers' sizes
    (256 experts, 32 splits of hidden, 16 tokens of 8 routed experts and a shared one, 257 local experts), under
    the warps fused_moe launches it with: at most 24 bytes spilled (4 warps spilled 60)."""
    r = _build("dsv32ref.kernels.fused_moe:_select_align_kernel",
               {"partial_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                "sorted_pair_ptr": "*i32", "block_expert_ptr": "*i32", "offsets_ptr": "*i32"}, gluon=False,
               **router, TOP_K=8, NORM=True, E_PAD=256, K_PAD=8, BLOCK_T=16, SPLITS_PAD=32, SHARED=True, NE_PAD=512,
               P_PAD=256, BLOCK_M=16, num_warps=SELECT_ALIGN_WARPS)
    assert r["spill_store_bytes"] <= 24, r


def test_the_offline_build_refuses_pointer_types_that_are_not_pointers():
    """Checked before anything is imported or built."""
    from dsv32ref.kernels.sm90_offline import main

    for bad in ("[1]", '{"cache_ptr": "u8"}', '{"cache_ptr": 8}'):
        with pytest.raises(ValueError, match=r"--pointers: expected a JSON object of pointer types"):
            main(["dsv32ref.kernels.sparse_mla_heads_n:_sparse_mla_heads_n_kernel", "{}", "--pointers", bad])
