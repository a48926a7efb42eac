"""The situations in which DSA went silently wrong under CUDA graphs in serving engines, for every boundary:
each step runs on an engine that replays captured graphs and on one that runs the same model eagerly, and the
two must agree (logits within rounding, the same tokens and top-k selections).

    short capture, long replay    graphs are captured with one-token contexts; replayed at contexts past
                                  index_topk (chunked prefill and decode)
    short-prefill shortcut        the capturing engine skips the top-k where every key fits (a host decision):
                                  a graph must not bake the shortcut in and replay it for a longer prompt
    padded rows                   rows past a step's tokens (seq_len 0, slot -1) write no cache row, least of
                                  all one of another request's blocks
    NaN and tied indexer scores   a NaN key row is selected first by the graph as by eager; ties go alike
    freed blocks reused           a request that reuses the blocks of a longer, finished one reads none of
                                  its stale rows
    around each capture size      prompts below, at and above each captured size, and past the largest
    mixed steps                   a decode token and a prefill chunk in one step

On the CPU the graphs are the recording stand-in (dsv32ref.graphs.emulated) over interpreted kernels; the
gpu-marked twin runs real CUDA graphs (one pool shared by every size), compiled bf16 kernels and, at
DeepSeek's latent widths with one SM to fill, the sm_90 sparse-attention kernel.
"""

import pytest
import torch

from dsv32ref import init_dummy_weights
from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput, from_reference
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.testing import assert_close
from helpers import tiny_model

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the gpu-marked twin covers the GPU")
CAPTURE_SIZES = (2, 4)


def _ref(device: str):
    """Two layers (one runs its indexer, one shares it), a top-k of 4 (so that short prompts pass it); on the GPU
    at DeepSeek's latent widths."""
    base = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    cfg = base.config.replace(num_hidden_layers=2, indexer_types=("full", "shared"), index_topk=4)
    if device == "cuda":
        cfg = cfg.replace(hidden_size=256, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                          v_head_dim=32, num_attention_heads=16, index_n_heads=16, index_head_dim=64)
    ref = init_dummy_weights(base.__class__(cfg), 0).eval()
    return ref.to("cuda", torch.bfloat16) if device == "cuda" else ref


def _pair(boundary: str, device: str) -> tuple[LLMEngine, LLMEngine]:
    """(the graph engine, captured, with the short-prefill skip on; the eager engine, skip off)."""
    ref = _ref(device)
    engines = []
    for mode, skip in ((CUDAGraphMode.FULL_AND_PIECEWISE, True), (CUDAGraphMode.NONE, False)):
        ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
                          block_size=4, num_blocks=48, capture_sizes=list(CAPTURE_SIZES), skip_short_topk=skip,
                          num_sms=1 if device == "cuda" else None)  # one SM: no top-k splits, sm_90's kernel
        engines.append(LLMEngine(ref.config, ec, device=device, dtype=ref.lm_head.weight.dtype,
                                 model=from_reference(ref, boundary)))
    engines[0].capture()
    return engines[0], engines[1]


_PAIRS: dict = {}


@pytest.fixture
def pair(request):
    """One captured pair per (boundary, device), reused by every hazard: the graph engine's cache and block
    allocator carry each scenario's leftovers into the next, as a serving engine's do."""
    key = request.param
    if key not in _PAIRS:
        _PAIRS[key] = _pair(*key)
    return _PAIRS[key]


def _tol(eng):
    return dict(rtol=2, atol=4, precision=torch.bfloat16) if eng.device.type == "cuda" else dict(rtol=64, atol=64)


def both(pair, requests, label: str) -> tuple[list[int], str]:
    """One step on both engines: logits within rounding, the same top-k rows (on the CPU) and tokens; returns
    (the eager engine's tokens, which both engines take next, and how the graph engine ran the step). On the GPU
    bf16 GEMMs of padded and unpadded shapes may round apart: the top-k rows then agree in 90 % of entries."""
    g, e = pair
    tg, how = g.step(StepInput(requests))
    te, _ = e.step(StepInput(requests))
    assert_close(f"{label}: logits", g.last_logits, e.last_logits, dtype=torch.float32, **_tol(g))
    n = sum(len(t) for _, t, _ in requests)
    topk_g, topk_e = g.runner.batch.topk[:n], e.runner.batch.topk[:n]
    if g.device.type == "cpu":
        assert tg == te and torch.equal(topk_g, topk_e), f"{label}: tokens {tg} {te}, top-k"
    else:
        same = [len((set(a) & set(b)) - {-1}) / max(len(set(a) - {-1}), len(set(b) - {-1}), 1)
                for a, b in zip(topk_g.tolist(), topk_e.tolist())]  # the selected keys, as sets
        assert min(same) >= 0.9, f"{label}: top-k rows agree in {min(same):.0%} at worst"
    return te, how


def release(pair, *seq_ids) -> None:
    for eng in pair:
        for s in seq_ids:
            eng.allocator.release(s)


def _prompt(eng, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, eng.config.vocab_size, (n,), generator=g).tolist()


def prefill(pair, seq: int, prompt: list[int], chunk: int = 4) -> list[int]:
    """The prompt in chunks of at most `chunk` tokens (chunked prefill past the first), then its next token."""
    for start in range(0, len(prompt), chunk):
        toks, _ = both(pair, [(seq, prompt[start:start + chunk], start)], f"seq {seq} chunk at {start}")
    return toks


# ---- the hazards ---------------------------------------------------------------------------------------

def short_capture_long_replay(pair):
    g = pair[0]
    prompt = _prompt(g, 10, 1)  # 4 + 4 + 2: the later chunks replay the graphs at contexts 4 and 8
    tok = prefill(pair, 1, prompt)
    _, how = both(pair, [(1, tok, len(prompt))], "decode")  # at context 10 (> index_topk): a FULL graph
    assert how == "FULL"  # captured at context 1
    release(pair, 1)


def short_prefill_shortcut(pair):
    g = pair[0]
    k = g.config.index_topk
    for seq, n in ((2, 3), (3, k), (5, k + 2)):  # the skip applies up to index_topk keys, then not
        prefill(pair, seq, _prompt(g, n, seq))  # k + 2: its last chunk replays a graph with k + 2 keys
    release(pair, 2, 3, 5)


def padded_rows(pair):
    g = pair[0]
    tok = prefill(pair, 6, _prompt(g, 6, 6))  # a live request holding blocks
    cache = g.runner.kv_cache
    before = [t.clone() for t in cache.latent + [t for t in cache.indexer_k if t is not None]]
    prompt = _prompt(g, 3, 7)  # 3 tokens padded to 4 rows
    both(pair, [(7, prompt, 0)], "3 tokens padded to 4")
    slots = {b * g.ec.block_size + o for b in g.allocator.tables[7] for o in range(g.ec.block_size)}
    for t0, t1 in zip(before, cache.latent + [t for t in cache.indexer_k if t is not None]):
        changed = (t0.view(-1, t0.shape[-1]) != t1.view(-1, t1.shape[-1])).any(-1).nonzero().flatten().tolist()
        assert set(changed) <= slots and len(changed) == len(prompt), (changed, sorted(slots))
    both(pair, [(6, tok, 6)], "the live request after the padded step")
    release(pair, 6, 7)


def nan_and_tied_scores(pair):
    g = pair[0]
    tok = prefill(pair, 8, _prompt(g, 8, 8))
    for eng in pair:  # request 8's indexer key at position 5 turns NaN: every later query selects it first
        block = eng.allocator.tables[8][5 // eng.ec.block_size]
        eng.runner.kv_cache.indexer_k[0][block, 5 % eng.ec.block_size] = float("nan")
    tok, how = both(pair, [(8, tok, 8)], "decode with a NaN indexer key")
    assert 5 in g.runner.batch.topk[0].tolist() and how == "FULL"
    release(pair, 8)
    # ties: a prompt of one repeated token, replayed in chunks past index_topk
    prefill(pair, 9, [3] * 7)
    release(pair, 9)


def freed_blocks_reused(pair):
    g = pair[0]
    long_prompt = _prompt(g, 8, 10)
    prefill(pair, 10, long_prompt)
    used = list(g.allocator.tables[10])
    release(pair, 10)  # its rows stay in the cache, stale
    prompt = _prompt(g, 6, 11)
    tok, _ = both(pair, [(11, prompt, 0)], "a short request on freed blocks")
    assert set(g.allocator.tables[11]) <= set(used)
    both(pair, [(11, tok, len(prompt))], "its decode step")
    release(pair, 11)


def around_capture_sizes(pair):
    g = pair[0]
    for n in sorted({s + d for s in CAPTURE_SIZES for d in (-1, 0, 1)}):  # 5: past the largest
        _, how = both(pair, [(12, _prompt(g, n, n), 0)], f"{n}-token prompt")
        captured = n <= max(CAPTURE_SIZES)
        full = g.ec.spec.graph_safe_prefill or n == 1  # one token of one request: a uniform decode step
        assert how == ("NONE" if not captured else "FULL" if full else "PIECEWISE"), n
        release(pair, 12)


def mixed_steps(pair):
    g = pair[0]
    tok = prefill(pair, 13, _prompt(g, 6, 13))
    toks, how = both(pair, [(13, tok, 6), (14, _prompt(g, 2, 14), 0)], "a decode token beside a prefill chunk")
    assert how == ("FULL" if g.ec.spec.graph_safe_prefill else "PIECEWISE")
    both(pair, [(14, [toks[1]], 2), (13, [toks[0]], 7)], "both decoding, order swapped")
    release(pair, 13, 14)


HAZARDS = [short_capture_long_replay, short_prefill_shortcut, padded_rows, nan_and_tied_scores, freed_blocks_reused,
           around_capture_sizes, mixed_steps]


@CPU
class TestOnTheCPUStandInWithEagerRegions:  # two classes: two test processes share the interpreted runs
    @pytest.mark.parametrize("pair", [(b, "cpu") for b in BOUNDARIES[:3]], indirect=True, ids=BOUNDARIES[:3])
    @pytest.mark.parametrize("hazard", HAZARDS, ids=[h.__name__ for h in HAZARDS])
    def test_hazard(self, pair, hazard):
        hazard(pair)


@CPU
class TestOnTheCPUStandInLater:
    @pytest.mark.parametrize("pair", [(b, "cpu") for b in BOUNDARIES[3:]], indirect=True, ids=BOUNDARIES[3:])
    @pytest.mark.parametrize("hazard", HAZARDS, ids=[h.__name__ for h in HAZARDS])
    def test_hazard(self, pair, hazard):
        hazard(pair)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [(b, "cuda") for b in BOUNDARIES], indirect=True, ids=BOUNDARIES)
@pytest.mark.parametrize("hazard", HAZARDS, ids=[h.__name__ for h in HAZARDS])
def test_hazard_on_cuda_graphs(pair, hazard):
    hazard(pair)


@pytest.mark.gpu
def test_the_gpu_hazards_run_the_sm90_kernel():
    """At DeepSeek's latent widths with one SM to fill, bf16, no config: what the GPU hazards replay (16 heads) is
    sm_90's warp-specialized kernel with the heads as the MMA's N where the device is an sm_90 one."""
    from dsv32ref.kernels.sparse_mla import kernel_choice

    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16, device="cuda")
    want = "sm_90 heads as N" if torch.cuda.get_device_capability() == (9, 0) else "triton"
    assert kernel_choice(q, 512, 1, None)[0] == want
