"""scripts/ab_sparse_mla_heads.py on the CPU: its arms (the tree's schedules by name, and a copy of the kernel module
from another revision loaded from its file, named by its stem, its sha256 kept for the provenance; what is not a
copy of the module is refused by name), the top-k of each --rows mode, the check of a result against the reference
(exact where no row is selected) and the steps and waves a step's time is taken over. (The timing itself needs
the GPU.)"""

import hashlib
import importlib.util
import os
import shutil

import pytest
import torch

from dsv32ref.kernels import sparse_mla_heads_n, sparse_mla_hopper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_sparse_mla_heads", os.path.join(ROOT, "scripts",
                                                                                      "ab_sparse_mla_heads.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_copy_of_the_kernel_module_is_an_arm_beside_the_tree_schedules(ab, tmp_path):
    copy = tmp_path / "base.py"
    shutil.copy(sparse_mla_heads_n.__file__, copy)
    kernels, copies = ab.choose_arms(["heads_n"], [str(copy)])
    assert list(kernels) == ["heads_n", "base"]
    assert kernels["heads_n"] is sparse_mla_heads_n.sparse_mla_heads_n
    assert callable(kernels["base"]) and kernels["base"] is not sparse_mla_heads_n.sparse_mla_heads_n
    assert copies == {"base": {"file": str(copy), "sha256": hashlib.sha256(copy.read_bytes()).hexdigest(),
                               "schedule": "heads_n"}}
    other = tmp_path / "base_hopper.py"
    shutil.copy(sparse_mla_hopper.__file__, other)
    kernels, copies = ab.choose_arms(["hopper"], [str(other)])
    assert kernels["base_hopper"] is not sparse_mla_hopper.sparse_mla_hopper
    assert copies["base_hopper"]["schedule"] == "hopper"
    hopper_named = tmp_path / "hopper.py"  # a copy of the heads-as-N module, named like the other schedule
    shutil.copy(sparse_mla_heads_n.__file__, hopper_named)
    kernels, copies = ab.choose_arms(["heads_n"], [str(other), str(hopper_named)])
    assert ab.arms_on_m(kernels, copies) == ["base_hopper"]
    assert ab.arms_on_m(*ab.choose_arms(["heads_n", "hopper"], [])) == ["hopper"]
    kernels, copies = ab.choose_arms(["heads_n", "hopper"], [])
    assert list(kernels) == ["heads_n", "hopper"] and copies == {}


def test_what_is_not_a_copy_of_the_module_is_refused_by_name(ab, tmp_path):
    with pytest.raises(ValueError, match="--against: expected a copy of a kernel module, got .*not a file"):
        ab.choose_arms(["heads_n"], [str(tmp_path / "missing.py")])
    other = tmp_path / "other.py"
    other.write_text("def sparse_mla():\n    pass\n")
    with pytest.raises(ValueError, match="other.py: expected a module defining sparse_mla_heads_n or sparse_mla_hop"):
        ab.choose_arms([], [str(other)])
    clash = tmp_path / "heads_n.py"
    shutil.copy(sparse_mla_heads_n.__file__, clash)
    with pytest.raises(ValueError, match="arm's name 'heads_n' is taken"):
        ab.choose_arms(["heads_n"], [str(clash)])
    with pytest.raises(ValueError, match="expected at least one arm, got none"):
        ab.choose_arms([], [])


def test_the_rows_modes_select_what_they_say_and_an_unknown_one_is_refused(ab):
    topk = torch.randperm(64, dtype=torch.int32).view(4, 16)
    assert ab.rows_topk("selected", topk) is topk
    assert torch.equal(ab.rows_topk("none", topk), torch.full((4, 16), -1, dtype=torch.int32))
    assert torch.equal(ab.rows_topk("repeated", topk), torch.zeros(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"--rows: expected some of \['selected', 'none', 'repeated'\], got 'all'"):
        ab.rows_topk("all", topk)


def test_where_no_row_is_selected_every_token_must_give_exactly_out_zero_and_lse_inf(ab):
    """The check of the none mode: the reference's empty softmax (out 0, lse +inf), held exactly for every token
    (not only the first four the reference computes); -inf (an empty split's lse before the merge), a finite lse
    or a NaN anywhere is a failure."""
    q = torch.randn(6, 2, 8, dtype=torch.bfloat16)
    ref, ref_lse = ab.reference(q, None, None, torch.full((6, 3), -1), 1.0, 6)
    assert torch.equal(ref, torch.zeros(4, 2, 6, dtype=torch.float64)) and torch.isposinf(ref_lse).all()
    assert ab.reference(q[:1], None, None, torch.full((1, 3), -1), 1.0, 6)[0].shape == (1, 2, 6)
    out, lse = torch.zeros(6, 2, 6, dtype=torch.bfloat16), torch.full((6, 2), float("inf"))
    assert ab.check(out, lse, ref, ref_lse) == (0.0, True)
    for bad_lse in (float("-inf"), 3.0, float("nan")):
        worse = lse.clone()
        worse[5, 1] = bad_lse
        assert ab.check(out, worse, ref, ref_lse) == (float("inf"), False), bad_lse
    out[5, 1, 5] = float("nan")
    assert ab.check(out, lse, ref, ref_lse) == (float("inf"), False)


def test_with_rows_selected_the_relative_error_decides(ab):
    ref, ref_lse = torch.rand(4, 2, 6, dtype=torch.float64) + 1, torch.ones(4, 2, dtype=torch.float64)
    err, ok = ab.check(ref.float() * (1 + 1e-3), ref_lse.float(), ref, ref_lse)
    assert ok and 5e-4 < err < 2e-3
    assert ab.check(ref.float() * 1.05, ref_lse.float(), ref, ref_lse)[1] is False
    out = torch.cat([ref.float(), torch.full((1, 2, 6), float("nan"))])  # a NaN past the tokens compared
    assert ab.check(out, torch.ones(5, 2), ref, ref_lse)[1] is False


@pytest.mark.parametrize("B,splits,steps,waves,waves_32", [
    (1, 16, 2, 1, 1), (16, 8, 4, 1, 2), (64, 2, 16, 1, 2), (128, 1, 32, 1, 2), (256, 1, 32, 2, 4), (133, 1, 32, 2, 3)])
def test_a_step_is_taken_over_each_programs_64_key_steps_and_the_waves_of_programs(ab, B, splits, steps, waves,
                                                                                    waves_32):
    """The decode's shapes on 132 SMs (an H100): 2048 top-k slots (2000: the last step part full), 16 heads a
    program (32 heads: two head blocks), or the 64-head schedule's one block, one program an SM."""
    assert ab.steps_and_waves(B, 16, 2048, splits, 16, 132) == (steps, waves)
    assert ab.steps_and_waves(B, 32, 2048, splits, 16, 132) == (steps, waves_32)
    assert ab.steps_and_waves(B, 32, 2000, splits, 64, 132) == (steps, waves)
