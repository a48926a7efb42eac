"""Boundary "none" (no eager break: FULL graphs serve prefill) and the short-prefill top-k skip, on emulated
graphs (CPU, interpreter) and, with the gpu marker, on CUDA graphs."""

import pytest
import torch

from dsv32ref.engine import EngineConfig, LLMEngine, StepInput, from_reference
from dsv32ref.engine.model import causal_topk
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.testing import assert_close
from helpers import tiny_model

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU test covers compiled kernels")


def _small_ref(preset="tiny-glm-5.2", seed=0):
    """Two layers (one that runs its indexer, one that shares it): every code path, captures in seconds."""
    from dsv32ref import init_dummy_weights

    base = tiny_model(preset)
    cfg = base.config.replace(num_hidden_layers=2, indexer_types=("full", "shared")) if "glm" in preset else \
        base.config.replace(num_hidden_layers=2)
    return init_dummy_weights(base.__class__(cfg), seed).eval()


def _engine(ref, boundary, mode=CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=(2, 16), device="cpu", **kw):
    ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      block_size=4, capture_sizes=list(capture_sizes), **kw)
    return LLMEngine(ref.config, ec, device=device, dtype=ref.lm_head.weight.dtype,
                     model=from_reference(ref, boundary))


def _run(eng, prompts, decode_steps=2):
    """Prefill every prompt in one step, then uniform decode steps; (logits per step, tokens, how per step)."""
    toks, how = eng.step(StepInput([(i, p, 0) for i, p in enumerate(prompts)]))
    logits, hows, seqs = [eng.last_logits.clone()], [how], [p + [t] for p, t in zip(prompts, toks)]
    for _ in range(decode_steps):
        toks, how = eng.step(StepInput([(i, s[-1:], len(s) - 1) for i, s in enumerate(seqs)]))
        logits.append(eng.last_logits.clone())
        hows.append(how)
        seqs = [s + [t] for s, t in zip(seqs, toks)]
    return logits, seqs, hows


def test_causal_topk_is_what_selection_returns_when_every_key_fits():
    pos = torch.tensor([0, 3, 6, 2])
    out = torch.full((4, 8), 99, dtype=torch.int32)
    causal_topk(pos, out)
    for t, p in enumerate(pos.tolist()):
        want = list(range(p + 1)) + [-1] * (8 - p - 1)
        assert out[t].tolist() == want, t


@CPU
def test_none_replays_prefill_in_a_full_graph_and_equals_the_other_variants(seed):
    """Two requests prefilled in one step (a mixed batch of 11 + 5 tokens, padded to 16): "none" replays the
    FULL graph of size 16; narrow replays a PIECEWISE one. Same tokens, logits within fp32 noise, and both
    against the reference model on each whole sequence. (Every boundary against the reference, without
    graphs, for both presets: tests/test_engine.py.)"""
    ref = _small_ref(seed=seed)
    V = ref.config.vocab_size
    prompts = [torch.randint(0, V, (11,)).tolist(), torch.randint(0, V, (5,)).tolist()]
    got = {}
    for boundary in ("none", "narrow"):
        eng = _engine(ref, boundary)
        eng.capture()
        if boundary == "none":
            assert sorted(eng.runner.graphs.full) == [2, 16] and not eng.runner.graphs.piecewise  # no PIECEWISE graphs
            assert eng.runner.memory["scores_workspace"] == eng.ec.max_step_tokens * 64 * 4
        got[boundary] = _run(eng, prompts)
    assert got["none"][2] == ["FULL", "FULL", "FULL"]
    assert got["narrow"][2] == ["PIECEWISE", "FULL", "FULL"]
    for boundary in ("narrow",):
        assert got["none"][1] == got[boundary][1], boundary  # same tokens
        for i, (a, b) in enumerate(zip(got["none"][0], got[boundary][0])):
            assert_close(f"none vs {boundary}, step {i}", a, b, rtol=64, atol=64)
    for r, (seq, plen) in enumerate(zip(got["none"][1], map(len, prompts))):
        with torch.no_grad():
            want = ref(torch.tensor(seq[:-1]))[plen - 1: plen + 2]
        assert_close(f"none vs reference, request {r}", torch.stack([lg[r] for lg in got["none"][0]]), want,
                     rtol=2**10, atol=2**10)


@CPU
def test_none_past_the_largest_capture_size_runs_eagerly_with_the_same_result(seed):
    ref = _small_ref(seed=seed)
    prompt = torch.randint(0, ref.config.vocab_size, (20,)).tolist()  # > 2, the largest captured size
    a, b = _engine(ref, "none", capture_sizes=(2,)), _engine(ref, "narrow", mode=CUDAGraphMode.NONE)
    a.capture()
    la, sa, ha = _run(a, [prompt], decode_steps=1)
    lb, sb, _ = _run(b, [prompt], decode_steps=1)
    assert ha == ["NONE", "FULL"] and sa == sb
    for i, (x, y) in enumerate(zip(la, lb)):
        assert_close(f"step {i}", x, y, rtol=64, atol=64)


def _indexer_launches(eng, step):
    from dsv32ref.experiments.ledger import predict

    led = predict(eng, step, piecewise=False)
    return sum(n for (region, op, _), n in led.ops.items() if op.startswith("triton::_indexer_scores"))


@CPU
@pytest.mark.parametrize("boundary", ["narrow", "none"])
def test_short_prefill_skips_the_indexer_only_when_every_key_fits(boundary, seed):
    """index_topk is 8 in the tiny presets. Prompts of 5 and 8 tokens: every request has <= 8 keys, the skip
    applies, the result is bitwise the same (the causal list is exactly what selection returns) and no
    indexer score kernel runs. A 9-token prompt: not taken."""
    ref = _small_ref(seed=seed)
    K, V = ref.config.index_topk, ref.config.vocab_size
    assert K == 8
    short = [torch.randint(0, V, (5,)).tolist(), torch.randint(0, V, (K,)).tolist()]
    on = _engine(ref, boundary, mode=CUDAGraphMode.NONE, skip_short_topk=True)
    off = _engine(ref, boundary, mode=CUDAGraphMode.NONE)
    lon, son, _ = _run(on, short, decode_steps=0)
    loff, soff, _ = _run(off, short, decode_steps=0)
    assert son == soff and torch.equal(lon[0], loff[0])
    step = StepInput([(7, short[0], 0), (8, short[1], 0)])
    assert _indexer_launches(on, step) == 0
    assert _indexer_launches(off, StepInput([(7, short[0], 0), (8, short[1], 0)])) > 0
    long = StepInput([(9, torch.randint(0, V, (K + 1,)).tolist(), 0)])
    ctx = on.runner.forward_context(on.stage(long))
    assert not ctx.skip_topk and _indexer_launches(on, StepInput([(10, long.requests[0][1], 0)])) > 0


@CPU
def test_short_prefill_skip_is_never_baked_into_a_graph(seed):
    """The FULL graphs of "none" are captured with the indexer: a step that would skip it replays it anyway,
    and a later long step replays the same graph correctly."""
    ref = _small_ref(seed=seed)
    V = ref.config.vocab_size
    eng = _engine(ref, "none", capture_sizes=(16,), skip_short_topk=True)
    eng.capture()
    plain = _engine(ref, "none", mode=CUDAGraphMode.NONE)
    for n in (6, 12):
        prompt = torch.randint(0, V, (n,)).tolist()
        (ta,), how = eng.step(StepInput([(n, prompt, 0)]))
        la = eng.last_logits
        (tb,), _ = plain.step(StepInput([(n, prompt, 0)]))
        assert how == "FULL" and ta == tb
        assert_close(f"{n}-token prompt", la, plain.last_logits, rtol=64, atol=64)


def test_engine_switches_are_validated():
    with pytest.raises(ValueError, match="EngineConfig.skip_short_topk: expected a bool, got 1"):
        EngineConfig(skip_short_topk=1)


@CPU
def test_ledger_predicts_one_graph_launch_for_none():
    """The whole forward is one graph segment; nothing in the forward is launched directly."""
    from dsv32ref.experiments.ledger import predict_all

    res = predict_all("glm-5.2", variants=["none", "narrow"])["variants"]
    assert res["none"]["graph_launches"] == 1 and res["none"]["direct"].get("attention", 0) == 0
    assert sum(res["none"]["direct"].values()) == res["none"]["direct"].get("other", 0)
    assert res["narrow"]["graph_launches"] > 1
    assert res["narrow"]["eager_regions"] == res["narrow"]["graph_launches"] - 1
    assert res["narrow"]["graph_launches"] == 78 + 1  # one eager region per layer


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_none_on_cuda_graphs_matches_eager(preset):
    """bf16, compiled kernels: the FULL graph of "none" serves a two-request prefill and decode; it agrees
    with the same model run without graphs and with narrow's PIECEWISE replay."""
    from test_engine import _gpu_config

    from dsv32ref import init_dummy_weights

    cfg = _gpu_config(preset)
    ref = tiny_model(preset, dtype=torch.float32).__class__(cfg)
    init_dummy_weights(ref, 0)
    ref = ref.to("cuda", torch.bfloat16).eval()
    prompts = [list(range(3, 14)), list(range(20, 25))]
    out = {}
    for boundary, mode in (("none", CUDAGraphMode.FULL_AND_PIECEWISE), ("none", CUDAGraphMode.NONE),
                           ("narrow", CUDAGraphMode.FULL_AND_PIECEWISE)):
        eng = _engine(ref, boundary, mode=mode, device="cuda")
        eng.capture()
        out[(boundary, mode)] = _run(eng, prompts)
        eng.release_graphs()
    graphs = out[("none", CUDAGraphMode.FULL_AND_PIECEWISE)]
    assert graphs[2] == ["FULL", "FULL", "FULL"]
    for key in (("none", CUDAGraphMode.NONE), ("narrow", CUDAGraphMode.FULL_AND_PIECEWISE)):
        for i, (a, b) in enumerate(zip(graphs[0], out[key][0])):
            assert_close(f"none FULL vs {key}, step {i}", a, b, dtype=torch.float32, precision=torch.bfloat16,
                         rtol=2, atol=4)


@CPU
def test_region_host_times_come_from_a_timed_replay_that_changes_nothing(seed):
    """host_costs.region_host_us times each entry of the PIECEWISE graph in replay order (the model runner's
    timed replay), one eager region per layer; the graph is left as it was and gives the same logits."""
    from dsv32ref.experiments.host_costs import region_host_us

    ref = _small_ref(seed=seed)
    eng = _engine(ref, "narrow", capture_sizes=(8,))
    eng.capture()
    prompt = torch.randint(0, ref.config.vocab_size, (8,)).tolist()
    entries = list(eng.runner.graphs.piecewise[8].graph.entries)
    eng.generate(prompt, 1)
    before = eng.last_logits.clone()
    r = region_host_us(eng, prompt, requests=2)
    assert r["runs_as"] == "PIECEWISE" and len(r["eager_us"]) == 2 and len(r["graph_us"]) == 3
    assert all(t > 0 for t in r["eager_us"] + r["graph_us"])
    assert eng.runner.graphs.piecewise[8].graph.entries == entries
    eng.generate(prompt, 1)
    assert torch.equal(eng.last_logits, before)
    none = _engine(ref, "none", capture_sizes=(8,))
    none.capture()
    assert region_host_us(none, prompt, requests=1) == {"runs_as": "FULL"}


def test_ttft_model_is_a_pipeline_of_layers():
    """Two layers, GPU 1 ms each: a layer whose host takes 3 ms costs 3, one whose host takes 0.5 costs 1;
    stage, the first graph launch and the sync are added once; from launches, each op is priced by class."""
    from dsv32ref.experiments.ttft_model import launch_cost_us, predict

    costs = {"in_graph_gap_us": 0.0, "graph_node_us": 0.0, "eager_region_us": 0.0, "graph_launch_us": 10.0,
             "stage_us": 100.0, "sync_us": 20.0, "aten_launch_us": 5.0, "gemm_launch_us": 15.0, "memcpy_us": 7.0,
             "wrapper_us": {"attention": 200.0}}
    assert launch_cost_us("aten::bmm", costs) == 15.0 and launch_cost_us("aten::add", costs) == 5.0
    assert launch_cost_us("aten::copy_ (memcpy)", costs) == 7.0
    assert launch_cost_us("triton::_sparse_mla_kernel", costs) == 200.0
    assert launch_cost_us("triton::_combine_splits_kernel", costs) == 0.0
    ledger = {"layers": [{"direct": {}, "graph": 10}, {"direct": {}, "graph": 10}], "graph_launches": 3,
              "eager_regions": 2, "ops": {}}
    regions = {"eager_us": [2990.0, 490.0], "graph_us": [10.0, 10.0, 10.0]}
    p = predict(ledger, costs, floor_ms=2.0, regions=regions)
    assert p["host_source"] == "measured regions" and p["host_bound_layers"] == 1
    assert abs(p["forward_ms"] - 4.0) < 1e-9
    assert abs(p["ttft_ms"] - (0.1 + 0.01 + 4.0 + 0.02)) < 1e-9
    ledger["layers"][0]["direct"] = {"triton::_sparse_mla_kernel": 1, "aten::bmm": 2}  # 230 us < 1 ms
    q = predict(ledger, costs, floor_ms=2.0)
    assert q["host_source"] == "launches" and abs(q["forward_ms"] - 2.0) < 1e-9


def test_ttft_model_charges_the_first_layers_nodes_to_the_first_launch():
    """One graph, no eager region: the first launch is charged the first layer's kernels only (the GPU starts
    while the host submits the rest), no eager-region cost is charged."""
    from dsv32ref.experiments.ttft_model import predict

    costs = {"in_graph_gap_us": 0.0, "graph_node_us": 1.0, "eager_region_us": 50.0, "graph_launch_us": 10.0,
             "stage_us": 0.0, "sync_us": 0.0, "aten_launch_us": 5.0, "gemm_launch_us": 15.0, "memcpy_us": 7.0,
             "wrapper_us": {}}
    layers = [{"direct": {}, "graph": 100}, {"direct": {}, "graph": 300}]
    one = predict({"layers": layers, "graph_launches": 1, "eager_regions": 0, "ops": {}}, costs, floor_ms=2.0)
    assert abs(one["fixed"]["first_launch_ms"] - 0.11) < 1e-12  # 10 us + the first layer's 100 nodes
    assert one["eager_regions"] == 0 and one["forward_ms"] == 2.0  # GPU-bound layers


def test_timeline_merges_busy_stretches_and_keeps_the_gaps_it_hides():
    from dsv32ref.experiments.timeline import merge

    merged, hidden = merge([(10.0, 12.0), (0.0, 5.0), (5.5, 6.0), (20.0, 21.0), (11.0, 13.0)], gap=2.0)
    assert merged == [[0.0, 6.0], [10.0, 13.0], [20.0, 21.0]] and hidden == 0.5
    assert merge([], 1.0) == ([], 0.0)


@pytest.mark.gpu
def test_timeline_records_one_request_per_boundary():
    """A tiny engine: the narrow request alternates graph launches and eager regions, in order, inside the
    request; none has one launch and no region; the GPU is busy inside the request's span."""
    from test_engine import _gpu_config

    from dsv32ref import init_dummy_weights
    from dsv32ref.experiments.timeline import record

    cfg = _gpu_config("tiny-glm-5.2")
    ref = init_dummy_weights(tiny_model("tiny-glm-5.2", dtype=torch.float32).__class__(cfg), 0).to("cuda", torch.bfloat16)
    for boundary in ("narrow", "none"):
        eng = _engine(ref.eval(), boundary, capture_sizes=(8,), device="cuda")
        eng.capture()
        r = record(eng, list(range(3, 11)))
        n = len(r["host_graph_launch"])
        assert (n, len(r["host_eager"])) == ((cfg.num_hidden_layers + 1, cfg.num_hidden_layers) if boundary == "narrow"
                                             else (1, 0))
        assert all(0 <= s <= e <= r["request_us"] for s, e in r["host_graph_launch"] + r["host_eager"])
        assert r["gpu_busy"] and r["kernel_us"] > 0
        eng.release_graphs()
