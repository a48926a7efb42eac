"""The FP8 accuracy study (dsv32ref.experiments.fp8_accuracy) on a few tokens: each arm's cache is what it says,
the float64 arm is its own reference, the metrics are what their definitions give on known inputs."""

import pytest
import torch

from dsv32ref.experiments import fp8_accuracy as acc


def test_arms_store_what_they_name():
    model = acc.dummy_model(0)
    for arm, (dtype, _, parts) in acc.ARMS.items():
        cache, table = acc._cache(model, arm, 40)
        assert len(table) == 3 and cache.num_blocks == 3
        fp8_lat, fp8_idx = cache.latent[0].dtype == torch.uint8, cache.indexer_k[0].dtype == torch.uint8
        assert (fp8_lat, fp8_idx) == ("fp8" in arm and "latent" in parts, "fp8" in arm and "indexer" in parts), arm
        if not fp8_lat:
            assert cache.latent[0].dtype == dtype


def test_topk_overlap_counts_shared_valid_entries():
    want = torch.tensor([[0, 1, 2, -1], [5, 6, -1, -1], [-1, -1, -1, -1]])
    got = torch.tensor([[2, 1, 7, 9], [-1, 6, 4, 5], [3, -1, -1, -1]])
    assert acc.topk_overlap(got, want) == (2 / 3 + 2 / 2 + 1.0) / 3


def test_the_study_runs_and_float64_is_its_own_reference():
    model = acc.dummy_model(1)
    prompt = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    r = acc.study(model, prompt, 4)
    f = r["arms"]["float64"]
    assert f["greedy_agreement"] == 1.0 and f["first_divergence"] is None and f["logits_rel_err_max"] == 0.0
    assert f["kl_mean"] == 0.0 and set(f["topk_overlap_per_layer"]) == {1.0}
    for arm, a in r["arms"].items():
        assert len(a["tokens"]) == 4 and len(a["attn_rel_rms_per_layer"]) == model.config.num_hidden_layers
        assert 0 <= a["greedy_agreement"] <= 1 and a["kl_mean"] >= -1e-12, arm
    assert r["arms"]["fp8"]["logits_rel_err_median"] > 0  # the FP8 cache does change something


def test_run_refuses_counts_it_cannot_generate():
    """tokens, prompt_len, seeds and out checked before any model is built (-3 tokens gave a greedy agreement of
    -0.33, 0 a ZeroDivisionError after the arms ran, 5000 a refusal of positions after minutes)."""
    for kw, match in ((dict(tokens=-3), r"fp8_accuracy.run: tokens: expected an int in \[1, 2048\], got -3"),
                      (dict(tokens=0), r"tokens: expected an int in \[1, 2048\], got 0"),
                      (dict(tokens=5000), r"tokens: expected an int in \[1, 2048\], got 5000"),
                      (dict(tokens=2.0), r"tokens: expected an int, got float"),
                      (dict(tokens=2048, prompt_len=2049), r"prompt_len: expected an int in \[1, 2048\], got 2049"),
                      (dict(prompt_len=0), r"prompt_len: expected an int in \[1, 3896\], got 0"),
                      (dict(seeds=()), r"seeds: expected a non-empty list of ints, got \(\)"),
                      (dict(seeds=[0.5]), r"seeds: expected a non-empty list of ints"),
                      (dict(out=3), r"out: expected None or a path, got int")):
        with pytest.raises(ValueError, match=match):
            acc.run(**kw)
