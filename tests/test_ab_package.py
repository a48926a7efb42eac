"""scripts/ab_package.py on the CPU: its arms (this tree and package copies of other revisions, refused by name
when they are not), the running order (every arm once per round and probe, rotating), that each worker imports its
own arm's package, and the table (medians over rounds, a wrong round marks the case). The probes need a GPU."""

import importlib.util
import os
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_package", ROOT / "scripts" / "ab_package.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """A copy of the package in a folder of its own, as `git archive REV dsv32ref | tar -x -C DIR` makes it."""
    folder = tmp_path_factory.mktemp("ab") / "base"
    shutil.copytree(ROOT / "dsv32ref", folder / "dsv32ref", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "REVISION").write_text("0123abc\n")
    return folder


def test_the_arms_are_the_tree_and_each_copy_by_its_folder(ab, copy, tmp_path):
    assert ab.arms([str(copy)]) == {"tree": ROOT, "base": copy}
    assert ab.revision(copy) == "0123abc" and ab.revision(ROOT) == "working tree"
    with pytest.raises(ValueError, match=r"--against .*empty: expected a folder holding a copy of the package"):
        ab.arms([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="the arm 'base' is taken"):
        ab.arms([str(copy), str(copy)])
    with pytest.raises(ValueError, match="the arm .* is taken"):
        ab.arms([str(ROOT)])


def test_every_arm_runs_each_probe_once_a_round_in_rotating_order(ab):
    order = ab.schedule(["tree", "a", "b"], ["route", "sparse_mla"], 2)
    assert order[:3] == [("tree", "route"), ("a", "route"), ("b", "route")]
    assert order[6:9] == [("a", "route"), ("b", "route"), ("tree", "route")]
    assert sorted(order) == sorted([(a, p) for a in ("tree", "a", "b") for p in ("route", "sparse_mla")] * 2)
    for probes, rounds, match in ((["route"], 0, r"--rounds: expected an int in \[1, 100\], got 0"),
                                  (["route"], 3 * 10 ** 9, r"--rounds: expected an int in \[1, 100\]"),
                                  (["routing"], 1, r"--probes: expected some of .*got \['routing'\]"),
                                  (["where", "where"], 1, r"--probes: .*each once"),
                                  ([], 1, "--probes: expected some of")):
        with pytest.raises(ValueError, match=match):
            ab.schedule(["tree"], probes, rounds)


@pytest.mark.parametrize("out", ["", "/tmp/", "/nonexistent/x.json", "/tmp"])
def test_the_result_path_is_refused_before_any_probe_runs(out):
    """--out is checked before the first probe runs: an empty path, a folder, a missing folder."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_package.py"), "--probes", "where", "--rounds",
                           "1", "--out", out], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--out:" in done.stderr and "where" not in done.stdout, done.stderr


def test_each_worker_imports_its_own_arms_package(ab, copy):
    """Run from the repository root, where `python -m` would import the tree's package for every arm."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        where = {arm: ab.run_worker(folder, "where")["package"] for arm, folder in ab.arms([str(copy)]).items()}
    finally:
        os.chdir(cwd)
    assert where == {"tree": str(ROOT / "dsv32ref" / "__init__.py"), "base": str(copy / "dsv32ref" / "__init__.py")}
    with pytest.raises(RuntimeError, match="probe nowhere under .*: exit 1"):
        ab.run_worker(copy, "nowhere")


def test_the_table_takes_medians_over_rounds_and_keeps_a_wrong_round(ab):
    runs = [dict(arm="tree", probe="route", cases={"x T1": (10.0, True)}),
            dict(arm="base", probe="route", cases={"x T1": (12.0, True)}),
            dict(arm="base", probe="route", cases={"x T1": (14.0, False)}),
            dict(arm="tree", probe="route", cases={"x T1": (11.0, True)})]
    row = ab.summarise(runs)["route"]["x T1"]
    assert row["tree"] == {"us": 10.5, "ok": True, "over_tree": 1.0}
    assert row["base"] == {"us": 13.0, "ok": False, "over_tree": 13.0 / 10.5}
