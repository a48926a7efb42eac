"""scripts/ab_sparse_mla_heads.py's arms, on the CPU: the tree's schedules by name, and a copy of the kernel module
from another revision loaded from its file, named by its stem, its sha256 kept for the provenance; what is not a
copy of the module is refused by name. (The timing itself needs the GPU.)"""

import hashlib
import importlib.util
import os
import shutil

import pytest
import torch

from dsv32ref.kernels import sparse_mla_heads_n

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
    assert copies == {"base": {"file": str(copy), "sha256": hashlib.sha256(copy.read_bytes()).hexdigest()}}
    kernels, copies = ab.choose_arms(["heads_n", "hopper"], [])
    assert list(kernels) == ["heads_n", "hopper"] and copies == {}


def test_what_is_not_a_copy_of_the_module_is_refused_by_name(ab, tmp_path):
    with pytest.raises(ValueError, match="--against: expected a copy of sparse_mla_heads_n.py, got .*not a file"):
        ab.choose_arms(["heads_n"], [str(tmp_path / "missing.py")])
    other = tmp_path / "other.py"
    other.write_text("def sparse_mla_hopper():\n    pass\n")
    with pytest.raises(ValueError, match="other.py: expected a module defining sparse_mla_heads_n"):
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


def test_a_token_that_selects_no_row_must_give_exactly_out_zero_and_lse_inf(ab):
    """The check of the none mode: the reference's empty softmax (out 0, lse +inf), held exactly, a NaN or a
    finite lse is a failure; with rows selected the relative error decides."""
    q = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    ref, ref_lse = ab.reference(q, None, None, torch.full((4, 3), -1), 1.0, 6)
    assert torch.equal(ref, torch.zeros(4, 2, 6, dtype=torch.float64)) and torch.isposinf(ref_lse).all()
    out, lse = torch.zeros(4, 2, 6, dtype=torch.bfloat16), torch.full((4, 2), float("inf"))
    assert ab.check(out, lse, ref, ref_lse) == (0.0, True)
    assert ab.check(out, torch.where(torch.arange(2) == 1, 3.0, lse), ref, ref_lse) == (float("inf"), False)
    out[2, 1, 5] = float("nan")
    assert ab.check(out, lse, ref, ref_lse)[1] is False
    ref_lse = torch.ones(4, 2, dtype=torch.float64)
    err, ok = ab.check(ref.to(torch.bfloat16) + 1e-3, ref_lse.float(), ref + 1e-3, ref_lse)
    assert ok and err < 1e-2
