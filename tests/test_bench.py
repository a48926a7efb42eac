"""The indexer A/B harness on a CPU: it imports the indexer of an earlier commit beside the library's, and its
data file holds every case for every implementation, each checked against the reference."""

import json
import os
import subprocess

import pytest

from dsv32ref.bench.indexer_ab import MODULE, load_revision
from test_data import ROOT, _history

AB = os.path.join(ROOT, "data", "indexer_ab.json")


def test_load_revision_imports_the_module_as_it_was():
    """The revisions the data compares still load (their module runs against today's helpers), as their text."""
    if _history() is None:
        pytest.skip("no git history here (a copy without .git)")
    with open(AB) as f:
        bases = json.load(f)["implementations"][:-1]
    for rev in bases:
        sha, mod = load_revision(rev[:7])
        assert sha == rev
        assert callable(mod.indexer_scores_paged) and callable(mod.topk_from_scores)
        want = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, capture_output=True, text=True).stdout
        with open(mod.__file__) as f:
            assert f.read() == want  # the text at that commit, not the working tree's
    with pytest.raises(subprocess.CalledProcessError):
        load_revision("0" * 40)


def test_ab_data_covers_every_case_for_every_implementation():
    with open(AB) as f:
        d = json.load(f)
    impls = d["implementations"]
    assert impls[-1] == "library" and len(impls) >= 2
    history = _history()
    if history is not None:
        assert all(sha in history for sha in impls[:-1]), impls
    cases = {}
    for r in d["results"]:
        assert r["ok"], r
        if r["kernel"] == "indexer_topk" and not r.get("probe"):
            cases.setdefault((r["model"], r["T"], r["context"]), []).append(r["implementation"])
    assert cases and all(sorted(v) == sorted(impls) for v in cases.values()), cases
    # the lean PyTorch path is timed once per case, with the first implementation, where its logits fit
    firsts = [r for r in d["results"] if r.get("implementation") == impls[0] and r["kernel"] == "indexer_topk"]
    assert all(r.get("torch_ms") or r["T"] * r["context"] * 64 * 2 > 4.3e9 for r in firsts)
