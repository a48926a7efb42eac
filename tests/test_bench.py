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


def test_scores_defaults_are_near_the_best_of_the_tune():
    """The scores pass's default tiles and pipeline depth, at every case of the H200 tune (132 SMs): one of the
    configurations it measured, and within 3 % of the fastest of them."""
    import triton

    from dsv32ref.bench.kernels import INDEXER_CASES, shapes
    from dsv32ref.kernels.indexer_topk import scores_stages, scores_tiles, scores_tokens

    with open(os.path.join(ROOT, "data", "indexer_tune.json")) as f:
        d = json.load(f)
    assert d["provenance"]["device"] == "NVIDIA H200"
    sms = 132
    by = {}
    for r in d["results"]:
        assert r["ok"] and r["probe"] == "tune", r
        kw = r["scores_kw"]
        by.setdefault((r["model"], r["T"], r["context"]), {})[kw["tiles"], kw["num_stages"]] = r["ms_scores"]
    assert len(by) == 2 * len(INDEXER_CASES)
    for (model, T, ctx), ms in by.items():
        tokens = scores_tokens(T, shapes(model)["h_i"])
        rows = triton.cdiv(T, tokens)
        tiles = scores_tiles(rows, ctx, 64, sms)
        stages = scores_stages(tiles, tokens, rows * triton.cdiv(ctx, 64 * tiles), sms)
        assert (tiles, stages) in ms, (model, T, ctx, tiles, stages, sorted(ms))
        assert ms[tiles, stages] <= 1.03 * min(ms.values()), (model, T, ctx, tiles, stages, ms)
