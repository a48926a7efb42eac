import pytest
import torch

from dsv32ref.reference.indexer import indexer_scores, topk_indices


def dense_scores_loop(q, k, w, scale):
    """I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s] * scale), one scalar at a time."""
    n, H, _ = q.shape
    out = torch.zeros(n, k.shape[0], dtype=torch.float64)
    for t in range(n):
        for s in range(k.shape[0]):
            out[t, s] = sum(w[t, h].item() * max(float(q[t, h] @ k[s]) * scale, 0.0) for h in range(H))
    return out


def reference_topk(scores, pos, k):
    """Sorted by (-score, position) among s <= pos[t]; -1 padded."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for t in range(scores.shape[0]):
        vis = [s for s in range(scores.shape[1]) if s <= pos[t]]
        order = sorted(vis, key=lambda s: (-scores[t, s].item(), s))[:k]
        out[t, : len(order)] = torch.tensor(order, dtype=torch.int32)
    return out


def test_scores_match_loop(seed):
    q, k, w = torch.randn(5, 4, 16, dtype=torch.float64), torch.randn(11, 16, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    got = indexer_scores(q, k, w, 16 ** -0.5)
    assert torch.allclose(got, dense_scores_loop(q, k, w, 16 ** -0.5), rtol=1e-12, atol=1e-12)
    assert (got != 0).any() and (got < 0).any()  # negative weights: scores of either sign


@pytest.mark.parametrize("n,S,k", [(6, 6, 4), (5, 20, 8), (3, 3, 8), (4, 50, 50), (1, 1, 2048)])
def test_topk_matches_reference_causal(n, S, k, seed):
    scores = torch.randn(n, S, dtype=torch.float64)
    pos = torch.sort(torch.randint(0, S, (n,))).values
    pos[-1] = S - 1
    got = topk_indices(scores, pos, k)
    assert got.dtype == torch.int32 and got.shape == (n, k)
    assert torch.equal(got, reference_topk(scores, pos, k))
    # top-k larger than the visible tokens keeps all of them and pads with -1
    assert (got >= 0).sum(1).tolist() == [min(k, int(p) + 1) for p in pos]
    assert ((got <= pos[:, None]) | (got == -1)).all()


def test_topk_ties_break_to_lower_position():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0]], dtype=torch.float64)
    assert topk_indices(scores, torch.tensor([5]), 3).tolist() == [[1, 2, 4]]
    assert topk_indices(scores, torch.tensor([4]), 3).tolist() == [[1, 2, 4]]
    assert topk_indices(scores, torch.tensor([3]), 3).tolist() == [[1, 2, 0]]
    # all-equal scores (e.g. ReLU zeroed everything): the earliest positions
    assert topk_indices(torch.zeros(1, 10), torch.tensor([9]), 4).tolist() == [[0, 1, 2, 3]]


def test_topk_with_random_ties(seed):
    scores = torch.randint(0, 3, (7, 30)).double()  # many ties
    pos = torch.randint(0, 30, (7,))
    assert torch.equal(topk_indices(scores, pos, 6), reference_topk(scores, pos, 6))


def test_bad_inputs():
    with pytest.raises(ValueError, match="query_positions: a query at position 9 needs more than the 5 keys"):
        topk_indices(torch.zeros(1, 5), torch.tensor([9]), 2)
    with pytest.raises(ValueError, match=r"k_idx: expected shape \[\*, 16\], got \[4, 8\]"):
        indexer_scores(torch.zeros(2, 3, 16), torch.zeros(4, 8), torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match=r"weights: expected shape \[2, 3\], got \[2, 4\]"):
        indexer_scores(torch.zeros(2, 3, 16), torch.zeros(4, 16), torch.zeros(2, 4), 1.0)
    with pytest.raises(ValueError, match="k_idx: expected device cpu, got meta"):
        indexer_scores(torch.zeros(2, 3, 16), torch.zeros(4, 16, device="meta"), torch.zeros(2, 3), 1.0)
