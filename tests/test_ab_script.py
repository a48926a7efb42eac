"""scripts/ab_sparse_mla_heads.py's arms, on the CPU: the tree's schedules by name, and a copy of the kernel module
from another revision loaded from its file, named by its stem, its sha256 kept for the provenance; what is not a
copy of the module is refused by name. (The timing itself needs the GPU.)"""

import hashlib
import importlib.util
import os
import shutil

import pytest

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
