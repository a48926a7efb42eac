"""The engine-form model (Triton kernels, fused projections, each eager boundary) against the reference."""

import copy

import pytest
import torch

from dsv32ref.engine import BOUNDARIES, EngineConfig, EngineModel, LLMEngine, StepInput, from_reference
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.kernels.launch import observing_launches
from dsv32ref.kernels.sparse_mla import FEW_KEYS_CONFIG
from dsv32ref.testing import assert_close
from helpers import tiny_model

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU test covers compiled kernels")


def _engine(ref, boundary, device="cpu", mode=CUDAGraphMode.NONE):
    ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      block_size=4, capture_sizes=[1, 2, 4, 8, 16, 32])
    return LLMEngine(ref.config, ec, device=device, dtype=ref.lm_head.weight.dtype,
                     model=from_reference(ref, boundary))


def test_a_staged_step_pads_the_rows_a_longer_step_left():
    """InputBatch.stage after a longer step: the rows past the step's tokens are padding again (token 0, position 0,
    slot -1: no cache write, the padding request), and so are the requests past the step's."""
    from dsv32ref.config import ModelConfig
    from dsv32ref.engine.input_batch import InputBatch

    config = ModelConfig.preset("tiny-deepseek-v3.2")
    ec = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4)
    batch = InputBatch(config, ec, torch.device("cpu"))
    batch.stage(StepInput([(0, list(range(1, 9)), 0), (1, [3, 4], 0)]), [[0, 1], [2]], num_blocks=8)
    batch.upload()
    batch.stage(StepInput([(0, [5, 6, 7], 8)]), [[0, 1, 3]], num_blocks=8)
    batch.upload()
    assert batch.slot_mapping[:3].tolist() == [12, 13, 14] and (batch.slot_mapping[3:] == -1).all()
    assert (batch.input_ids[3:] == 0).all() and (batch.positions[3:] == 0).all()
    assert (batch.req_indices[3:] == ec.max_num_seqs).all() and (batch.seq_lens[1:] == 0).all()


def _gpu_config(preset: str, **overrides):
    """Widths the compiled kernels accept (dot K >= 16), small enough for quick GPU tests."""
    widths = dict(hidden_size=256, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                  v_head_dim=32, num_attention_heads=16, index_n_heads=16, index_head_dim=32, index_topk=16)
    return tiny_model(preset).config.replace(**{**widths, **overrides})


def _reference_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor(tokens))


@CPU
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_engine_matches_reference_and_boundaries_agree(preset, seed):
    """Prefill of two requests in one batch, then a decode step; same logits under the four paths a boundary can
    take (the copy variants add a copy after narrow's: the graph-hazard tests run them against eager)."""
    # GLM-5.2's IndexShare in four layers: a dense one, an indexer, a layer sharing it, an indexer after that;
    # DeepSeek-V3.2 in two: a dense one and a MoE one, each with its indexer
    layers = dict(num_hidden_layers=4, indexer_types=("full", "full", "shared", "full")) if "glm" in preset else \
        dict(num_hidden_layers=2)
    ref = tiny_model(preset, dtype=torch.float32, seed=seed, **layers)
    V = ref.config.vocab_size
    # 9 + 3 tokens: the first prompt has more keys than the top-8, so its prefill selects
    p0, p1 = torch.randint(0, V, (9,)).tolist(), torch.randint(0, V, (3,)).tolist()
    results = {}
    for boundary in ("wide", "narrow", "narrow_out", "none"):
        eng = _engine(ref, boundary)
        toks, how = eng.step(StepInput([(0, p0, 0), (1, p1, 0)]))
        assert how == "NONE"
        logits = [eng.last_logits]
        seqs = [p0 + [toks[0]], p1 + [toks[1]]]
        for _ in range(1):  # a uniform decode step: the graph-safe decode path
            toks, _ = eng.step(StepInput([(0, seqs[0][-1:], len(seqs[0]) - 1), (1, seqs[1][-1:], len(seqs[1]) - 1)]))
            logits.append(eng.last_logits)
            seqs = [seqs[0] + [toks[0]], seqs[1] + [toks[1]]]
        results[boundary] = (torch.stack(logits), seqs)
    base_logits, base_seqs = results["narrow"]
    for boundary, (lg, seqs) in results.items():
        assert torch.equal(lg, base_logits), boundary  # same kernels, same order: bitwise
        assert seqs == base_seqs
    # against the reference model run on each full sequence (positions 0..T-1, no cache)
    for r, (seq, plen) in enumerate(zip(base_seqs, (len(p0), len(p1)))):
        want = _reference_logits(ref, seq[:-1])
        got = base_logits[:, r]  # (steps, vocab): logits at positions plen-1, plen
        assert_close(f"logits of request {r}", got, want[plen - 1: plen + 1], rtol=2**10, atol=2**10)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="gpu_memory_utilization: expected \\(0, 1\\], got 1.5"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="at most max_num_seqs x max_model_len = 128 tokens fit in one step, got 256"):
        EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="boundary: expected one of"):
        EngineModel(tiny_model("tiny-glm-5.2").config, "medium")
    with pytest.raises(ValueError, match="boundary: expected one of"):
        EngineConfig(boundary="medium")
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    with pytest.raises(ValueError, match="model: built for boundary 'narrow', the engine runs 'wide'"):
        LLMEngine(ref.config, EngineConfig(boundary="wide", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8,
                                           num_blocks=4), device="cpu", model=from_reference(ref, "narrow"))


def test_dummy_prefill_context_stays_within_max_model_len():
    """Capture sizes beyond max_model_len (512 tokens, 64 per request) are spread over requests: every
    position has a cos/sin row and every key a block-table entry of its own request. (One 512-token request
    made the kernels read past both, an illegal memory access on the GPU when that memory was unmapped.)"""
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=64, max_num_seqs=8,
                      max_num_batched_tokens=512, block_size=16, num_blocks=16)
    eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))
    for size in (1, 64, 72, 512):
        ctx = eng.runner.batch.dummy(eng.runner.kv_cache, size, uniform=False)
        lens = ctx.seq_lens_cpu
        assert sum(lens) == size and max(lens) <= 64 and len(lens) == -(-size // 64)
        assert ctx.query_start_loc_cpu == [sum(lens[:i]) for i in range(len(lens) + 1)]
        req = ctx.req_indices.long()
        assert int(ctx.positions.max()) < 64 and (ctx.positions < ctx.seq_lens[req]).all()
        assert ctx.seq_lens[: len(lens)].tolist() == lens and int(ctx.seq_lens[len(lens):].abs().sum()) == 0
        starts = torch.tensor(ctx.query_start_loc_cpu[:-1])
        assert torch.equal(ctx.positions, torch.arange(size) - starts[req])


@CPU
@pytest.mark.parametrize("boundary,prefill,decode", [("narrow", ["few"], ["plan"]),
                                                     ("none", ["plan", "few"], ["plan", "few"])])
def test_few_keys_launch_at_prefill_and_where_a_graph_serves_both(boundary, prefill, decode):
    """64 heads, a top-k of 128 slots: a 4-token prompt's tokens take sparse_mla's few-keys launch (programs of 16
    heads), alone on the per-request path (narrow's eager region: the request's 4 slots) and beside the plan's
    launch where the step is graph-safe; a decode step leaves it out unless its FULL graph serves prefill too (none).
    Each list: one layer's sparse_mla launches, "few" the few-keys launch (16 heads a program), "plan" the other."""
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32, num_attention_heads=64, index_topk=128)
    eng = _engine(ref, boundary)
    launched = []
    def observe(name, run):
        if name == "_sparse_mla_kernel":
            launched[-1].append("few" if run.keywords["BLOCK_H"] == FEW_KEYS_CONFIG["BLOCK_H"] else "plan")
        return run()
    with observing_launches(observe):
        for step in (StepInput([(0, [5, 9, 2, 7], 0)]), StepInput([(0, [3], 4)])):
            launched.append([])
            eng.step(step)
    layers = ref.config.num_hidden_layers
    assert launched == [prefill * layers, decode * layers]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_graph_replay_matches_eager_for_every_variant_and_mode(preset):
    """bf16 on the GPU with compiled kernels; sizes padded to capture sizes. Replays equal eager bitwise
    where the same kernels run on the same inputs; padding changes GEMM shapes, so compare within bf16."""
    cfg = _gpu_config(preset)
    ref = tiny_model(preset, dtype=torch.float32).__class__(cfg)
    from dsv32ref import init_dummy_weights

    init_dummy_weights(ref, 0)
    ref = ref.to("cuda", torch.bfloat16).eval()
    prompt = list(range(3, 14))
    for boundary in BOUNDARIES:
        outs = {}
        for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE):
            eng = _engine(ref, boundary, device="cuda", mode=mode)
            eng.capture()
            toks, how = eng.step(StepInput([(0, prompt, 0)]))
            first = eng.last_logits.clone()
            toks2, how2 = eng.step(StepInput([(0, toks, len(prompt))]))
            outs[mode] = (first, eng.last_logits.clone(), how, how2)
            eng.release_graphs()
        assert outs[CUDAGraphMode.PIECEWISE][2:] == ("PIECEWISE", "PIECEWISE")
        # no eager break: FULL graphs serve the prefill too
        assert outs[CUDAGraphMode.FULL_AND_PIECEWISE][2:] == ("FULL" if boundary == "none" else "PIECEWISE", "FULL")
        base = outs[CUDAGraphMode.NONE]
        for mode, o in outs.items():
            for i, step in enumerate(("prefill", "decode")):  # fp32 logits of a bf16 model
                assert_close(f"{boundary} {mode.value} {step} logits", o[i], base[i], dtype=torch.float32,
                             precision=torch.bfloat16, rtol=2, atol=4)


@CPU
def test_failed_capture_releases_graphs_and_falls_back_to_eager(monkeypatch, seed):
    """A capture that fails (as an out-of-memory would) names phase and size, keeps the engine usable."""
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32, seed=seed).__class__(
        tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, indexer_types=("full", "shared")))
    from dsv32ref import init_dummy_weights

    init_dummy_weights(ref, 0)
    ec = EngineConfig(boundary="narrow_copy", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
                      block_size=4, capture_sizes=[4, 8])
    eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref.eval(), "narrow_copy"))
    real_forward = eng.runner.graphs.forward

    def failing(size, full):
        if full and size == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_forward(size, full)

    monkeypatch.setattr(eng.runner.graphs, "forward", failing)
    from dsv32ref.graphs import CaptureError

    with pytest.raises(CaptureError) as e:
        eng.capture()
    msg = str(e.value)
    assert "FULL capture of size 4 failed: RuntimeError: CUDA out of memory" in msg
    assert "memory ledger at the failure: " in msg and "kv_cache" in msg and "runs eagerly" in msg
    assert eng.runner.graphs.piecewise == {} and eng.runner.graphs.full == {} and eng.runner.graphs.mode is CUDAGraphMode.NONE
    toks, how = eng.step(StepInput([(0, [3, 4, 5], 0)]))
    assert how == "NONE" and len(toks) == 1


@CPU
def test_ttft_experiment_control_flow_on_cpu(tmp_path):
    """The TTFT experiment end to end on emulated graphs: an eager-region variant, "none" and a top-k-skip arm
    captured, interleaved requests, ledger per arm, same tokens everywhere. (Timings on a CPU mean nothing; the GPU run records them.)"""
    import json

    from dsv32ref.experiments.ttft import TTFTProtocol, run

    cfg = tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                    n_routed_experts=4, num_experts_per_tok=2)
    p = TTFTProtocol(variants=("narrow", "none"), skip_topk=("narrow",), requests=2, warmup=1,
                     capture_sizes=(8,))  # the 8-token prompt's size: PIECEWISE and FULL captures, fewer of them
    res = run(p, device="cpu", config=cfg, out=str(tmp_path / "t.json"))
    assert set(res["variants"]) == {"narrow", "none", "narrow+skip"} and res["same_tokens_across_variants"]
    assert res["variants"]["narrow+skip"]["skip_short_topk"] and not res["variants"]["narrow"]["skip_short_topk"]
    for v, r in res["variants"].items():
        assert r["prefill_runs_as"] == ("FULL" if v == "none" else "PIECEWISE") and len(r["ttft_ms"]) == 2
        assert r["ledger"]["eager_region_calls"] == (0 if v == "none" else 2)  # one per layer, replayed once
    assert json.loads((tmp_path / "t.json").read_text())["protocol"]["order"].startswith("interleaved")
    assert not (tmp_path / "t.partial.json").exists()
    # the weights a forward reads: every parameter but the embedding table (fp32 here), counted from the config
    from dsv32ref.param_counts import model_parameter_count
    assert res["weight_read"]["bytes"] == 4 * (model_parameter_count(cfg) - cfg.vocab_size * cfg.hidden_size)
    assert res["weight_read"]["limit_ms"] is None and res["variants"]["none"]["floor_over_weight_read"] is None
    by_region = res["weight_read"]["by_region"]
    assert sum(r["bytes"] for r in by_region.values()) == res["weight_read"]["bytes"]


@CPU
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3.2", "tiny-glm-5.2"])
def test_weight_bytes_by_region_name_the_regions_that_read_them(preset):
    """Every weight a forward reads falls in one instrument region, and that region is one the engine enters in a
    step (host timers: timing_regions), so the ledger's GPU time of a region stands beside the region's own weight
    read: the split sums to weight_read's bytes, a dense MLP's weights and a MoE's apart."""
    from dsv32ref.experiments.ttft import weight_bytes_by_region, weight_read
    from dsv32ref.instrument import timing_regions

    layers = dict(indexer_types=("full", "shared")) if "glm" in preset else {}
    ref = tiny_model(preset, dtype=torch.float32, num_hidden_layers=2, first_k_dense_replace=1, **layers)
    eng = _engine(ref, "narrow")
    with timing_regions() as times:
        eng.generate(torch.randint(0, ref.config.vocab_size, (9,)).tolist(), 1)
    by = weight_bytes_by_region(eng.model)
    assert sum(by.values()) == weight_read(eng.model, None)["bytes"]
    assert {"moe", "mlp", "o_proj", "a_proj", "q_gemm"} <= set(by) and set(by) - {"other"} <= set(times), (by, times)
    assert by["mlp"] == 4 * sum(p.numel() for p in eng.model.layers[0].mlp.parameters())


@CPU
def test_ttft_instrument_ab_and_an_interrupted_run_keeps_the_complete_result(tmp_path, monkeypatch):
    """The instrument arms run beside the plain variants; a run stopped in its second variant's ledger leaves
    the complete file of the earlier run untouched and its progress in a partial file."""
    import json

    from dsv32ref.experiments import ledger, ttft
    from dsv32ref.instrument import is_measuring

    cfg = tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                    n_routed_experts=4, num_experts_per_tok=2)
    out = tmp_path / "t.json"
    res = ttft.run(ttft.TTFTProtocol(variants=("wide", "narrow"), requests=1, warmup=0, instrument_ab=("wide", "narrow"),
                                     capture_sizes=(8,)), device="cpu", config=cfg, out=str(out))
    ab = res["instrument"]["variants"]
    assert set(ab) == {"wide", "narrow"} and len(ab["wide"]["ttft_ms_with_ranges"]) == 1
    assert res["instrument"]["region_cost_ns"]["off"] < res["instrument"]["region_cost_ns"]["on"]
    assert ab["wide"]["regions_entered_per_request"] > ab["narrow"]["regions_entered_per_request"] > 0
    assert res["same_tokens_across_variants"] and not is_measuring()
    complete = out.read_text()
    calls = []
    real = ledger.measure

    def flaky(engine, prompt):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(engine, prompt)

    monkeypatch.setattr(ledger, "measure", flaky)
    with pytest.raises(KeyboardInterrupt):
        ttft.run(ttft.TTFTProtocol(variants=("wide", "narrow"), requests=1, warmup=0, mode="none"),
                 device="cpu", config=cfg, out=str(out))
    assert out.read_text() == complete
    partial = json.loads((tmp_path / "t.partial.json").read_text())
    assert partial["partial"] is True and set(partial["variants"]) == {"wide"}
    assert not is_measuring()


@CPU
def test_capture_memory_experiment_control_flow_on_cpu(tmp_path):
    """The start-up memory run, on emulated graphs: every variant starts, captures every size
    PIECEWISE largest first then FULL, and leaves a log per capture with its static buffers, which match
    the memory model."""
    from dsv32ref.experiments.memory_model import predict
    from dsv32ref.experiments.capture_memory import Settings, run

    cfg = tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                                    n_routed_experts=4, num_experts_per_tok=2)
    runs = [{"boundary": b} for b in ("narrow", "narrow_copy", "narrow_copy_shared", "narrow_out")]
    res = run("glm-5.2", runs=runs, device="cpu", config=cfg, out=str(tmp_path / "m.json"),
              settings=Settings(capture_sizes=(1, 2, 4), max_num_seqs=2, max_model_len=32, max_num_batched_tokens=4))
    for r in res["runs"]:
        assert r["failed"] is None
        assert [(c["phase"], c["size"]) for c in r["capture_log"]] == [
            ("PIECEWISE", 4), ("PIECEWISE", 2), ("PIECEWISE", 1), ("FULL", 2), ("FULL", 1)]
        want = predict(cfg, r["boundary"], [1, 2, 4], 2, 4, dtype_bytes=4, estimate=False)["static_buffers"]
        assert r["capture_log"][-1]["static_buffers"] == r["after"]["static_buffers"] == want, r["boundary"]
    per_layer_token = cfg.num_attention_heads * cfg.kv_lora_rank * 4  # fp32 on the CPU
    copy = next(r for r in res["runs"] if r["boundary"] == "narrow_copy")
    assert [c["static_buffers"] for c in copy["capture_log"]] == [  # grows with every new size, then stays
        2 * per_layer_token * n for n in (4, 6, 7, 7, 7)]


def test_memory_model_arithmetic():
    """Hand counts for GLM-5.2 with 16 heads per rank: per token and layer 16 x 512 x 2 = 16 KiB; the default
    sizes up to 512 sum to 1 + 2 + 4 + 8 x (1 + ... + 31) + 17 x (256 + 512) / 2 = 10503 tokens; FULL sizes (up to 256) are a subset; the estimate sees 512, 496, 256
    and 248 before the KV cache is sized (the estimate's captures)."""
    from dsv32ref.config import ModelConfig
    from dsv32ref.experiments.memory_model import predict

    cfg = ModelConfig.preset("glm-5.2").replace(num_attention_heads=16)
    L, kib16 = 78, 16 * 1024
    assert 7 + 8 * 496 + 17 * 384 == 10503 and 7 + 8 * 496 + 256 == 4231
    p = predict(cfg, "narrow_copy")
    assert p["static_buffers"] == L * kib16 * 10503
    assert p["static_before_kv_sizing"] == L * kib16 * (512 + 496 + 256 + 248)
    assert p["graph_outputs"] == (10503 + 4231) * 6144 * 2
    assert predict(cfg, "narrow_copy", estimate=False)["static_before_kv_sizing"] == L * kib16 * 512
    assert predict(cfg, "narrow_copy_shared")["static_buffers"] == 512 * kib16
    assert predict(cfg, "narrow")["static_buffers"] == predict(cfg, "narrow_out")["static_buffers"] == 0


def test_capture_outcome_walks_the_capture_order():
    """Two layers, 2 heads x kv_lora 4 x 2 bytes = 16 B per token and layer, so 32 B per new token; sizes
    up to 16 are [1, 2, 4, 8, 16], FULL (max_num_seqs 4) [4, 2, 1]; the profile run made 16 already."""
    from dsv32ref.experiments.memory_model import capture_outcome

    cfg = tiny_model("tiny-glm-5.2").config.replace(num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=4,
                                                    indexer_types=("full", "shared"))
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4)
    need_pw = 100 + 32 * (8 + 4 + 2 + 1)  # overhead + every new PIECEWISE size
    assert capture_outcome(cfg, need_pw + 50, 100, 50, **kw) == {"fails_at": None, "left": 0}
    assert capture_outcome(cfg, need_pw + 49, 100, 50, **kw) == {"fails_at": ("FULL", 4), "short_by": 1}
    assert capture_outcome(cfg, 100 + 32 * 8, 100, 50, **kw)["fails_at"] == ("PIECEWISE", 4)
    assert capture_outcome(cfg, 150, 100, 50, boundary="narrow", **kw) == {"fails_at": None, "left": 0}
    from dsv32ref.experiments.memory_model import threshold

    t = threshold(cfg, 10**6, 100, 50, total=10**9, util=0.9, max_num_seqs=4)
    assert t["max_tokens_ok"] == 512 and t["fails_at"] is None and t["utilization_at_512"] > 0.9


def test_shared_copy_buffer_is_checked():
    ref = tiny_model("tiny-glm-5.2", dtype=torch.float32)
    m = from_reference(ref, "narrow_copy_shared")
    outputs = m.static_outputs
    with pytest.raises(ValueError, match=r"narrow_copy_shared: the shared copy buffer holds None but a step of 5"):
        outputs.target(0, torch.zeros(5, 8))
    outputs.reserve(4, m.embed_tokens)
    a = m.layers[0].self_attn
    assert all(layer.self_attn.outputs is outputs for layer in m.layers)
    assert outputs.target(0, torch.zeros(3, 8)).data_ptr() == outputs.target(1, torch.zeros(3, 8)).data_ptr()
    with pytest.raises(ValueError, match=r"narrow_copy_shared: the shared copy buffer holds \[4, "):
        outputs.target(0, torch.zeros(5, 8))
    assert outputs.nbytes() == 4 * a.H * a.kv_lora * 4 and outputs.release() == 0  # the shared buffer stays
    per_size = from_reference(ref, "narrow_copy").static_outputs
    b = per_size.target(0, torch.zeros(3, 8))
    assert per_size.target(0, torch.zeros(3, 8)) is b and per_size.target(1, torch.zeros(3, 8)) is not b
    assert per_size.release() == 2 * 3 * a.H * a.kv_lora * 4 and per_size.nbytes() == 0


@pytest.mark.gpu
def test_capture_out_of_memory_on_gpu_is_reported_and_recoverable():
    """A real out-of-memory during capture: the allocator is capped just above what `narrow` needs, so
    narrow_copy's per-size static buffers run out. The error names phase, size and the ledger; afterwards
    no graph is left, the static buffers are freed, and the engine still answers (eagerly) with the tokens
    that `narrow` gives."""
    from dsv32ref import init_dummy_weights
    from dsv32ref.graphs import CaptureError

    cfg = _gpu_config("tiny-glm-5.2", kv_lora_rank=128)
    ref = init_dummy_weights(tiny_model("tiny-glm-5.2").__class__(cfg), 0).to("cuda", torch.bfloat16).eval()

    def engine(boundary):
        ec = EngineConfig(boundary=boundary, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=512,
                          block_size=16, num_blocks=16)
        return LLMEngine(cfg, ec, device="cuda", dtype=torch.bfloat16, model=from_reference(ref, boundary))

    prompt = [3, 4, 5, 6, 7]
    eng = engine("narrow")
    want, _ = eng.generate(prompt, 3)  # eagerly (nothing captured yet), as the fallback will run
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    eng.capture()
    narrow_need = torch.cuda.memory_reserved() - before
    eng.release_graphs()
    del eng
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    eng = engine("narrow_copy")
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated()
    limit = torch.cuda.memory_reserved() + narrow_need + 32 * 2**20
    torch.cuda.set_per_process_memory_fraction(limit / total)
    try:
        with pytest.raises(CaptureError) as e:
            eng.capture()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    msg = str(e.value)
    assert "PIECEWISE capture of size" in msg and "OutOfMemoryError" in msg, msg
    assert "memory ledger at the failure: " in msg and "static_buffers" in msg and "narrow_copy_shared" in msg
    assert eng.runner.graphs.piecewise == {} and eng.runner.graphs.full == {} and eng.runner.graphs.mode is CUDAGraphMode.NONE
    assert eng.model.static_outputs.nbytes() == 0
    import gc

    gc.collect()
    assert torch.cuda.memory_allocated() <= base_alloc + 2**20  # nothing half-captured holds memory
    got, _ = eng.generate(prompt, 3)
    assert got == want


@CPU
def test_generate_prefills_a_prompt_longer_than_the_token_budget_in_chunks(seed):
    """A 24-token prompt on an engine whose steps hold 8 tokens: three prefill steps, each over the cache the
    earlier ones wrote. With the indexer's top-8 selecting among the cached keys, the first token and the next
    step's logits equal one 24-token step's (a 32-token budget: the same scores, the same selection); with a
    top-k that keeps every key (no near-ties to flip), both are within fp32's accumulated rounding of a float64
    copy of the reference model (64 units of each logit's terms; 1 to 3 seen). The request's blocks are released
    afterwards."""
    for index_topk in (8, 64):
        ref = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32, seed=seed, num_hidden_layers=2,
                         index_topk=index_topk)
        prompt = torch.randint(0, ref.config.vocab_size, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
        logits, toks = {}, {}
        for budget in (8, 32):
            ec = EngineConfig(boundary="narrow", mode=CUDAGraphMode.NONE, max_model_len=64, max_num_seqs=2,
                              max_num_batched_tokens=budget, block_size=4, capture_sizes=[8])
            eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, "narrow"))
            toks[budget], _ = eng.generate(prompt, 2)
            logits[budget] = eng.last_logits[0]
            assert not eng.allocator.tables and len(eng.allocator.free) == eng.runner.kv_cache.num_blocks, "released"
        assert toks[8] == toks[32]
        assert_close(f"top-{index_topk}: chunked vs one step", logits[8], logits[32].double(), dtype=torch.float32,
                     rtol=16, atol=16)
        if index_topk == 64:
            exact = copy.deepcopy(ref).double()  # the same weights in float64: the engines' error alone
            seen = {}
            exact.lm_head.register_forward_hook(lambda module, args, out: seen.update(h=args[0][-1]))
            with torch.no_grad():
                expected = exact(torch.tensor(prompt + toks[32][:1]))[-1]  # the decode step's logits
            # a logit's fp32 rounding scales with the terms it sums, sum_i |h_i W_vi|, not with itself: logits
            # near 0 are differences of large products (seeds put 1 of 256 past a bound relative to |expected|)
            terms = seen["h"].abs() @ exact.lm_head.weight.abs().T  # (vocab,)
            for budget, lg in logits.items():
                units = (lg.double() - expected).abs() / (torch.finfo(torch.float32).eps * terms)
                worst = int(units.argmax())
                assert units[worst] <= 64, (f"budget {budget}: logit {worst} off by {float(units[worst]):.1f} x eps "
                                            f"x its terms (64 allowed): got {float(lg[worst]):.9g}, expected "
                                            f"{float(expected[worst]):.9g}")


@CPU
def test_regime_map_control_flow_on_cpu(tmp_path):
    """The regime map end to end on emulated graphs: a prompt past the token budget prefills in chunks (and
    runs as NONE past the capture sizes), one that fits in one step; decode at two batch sizes, FULL and
    PIECEWISE (none: FULL only). The GPU-time split is a GPU measurement: absent here."""
    from dsv32ref.experiments.regimes import RegimeProtocol, run
    cfg = tiny_model("tiny-deepseek-v3.2").config.replace(num_hidden_layers=1)
    p = RegimeProtocol(variants=("narrow", "none"), prompt_lens=(8, 40), ttft_requests=1, long_requests=1,
                       token_budget=16, batches=(1, 2), contexts=(12,), decode_steps=1, capture_sizes=(1, 2, 8),
                       block_size=4)
    res = run(p, out=str(tmp_path / "r.json"), device="cpu", config=cfg)
    short, long = res["prefill"]["8"], res["prefill"]["40"]
    assert all(short[v]["chunks"] == 1 and long[v]["chunks"] == 3 for v in p.variants)
    assert long["narrow"]["runs_as"] == "NONE" and short["none"]["runs_as"] == "FULL"
    assert all(len(long[v]["ttft_ms"]) == 1 and long[v]["indexer_ms"] is None for v in p.variants)
    dec = res["decode"]["12"]
    assert set(dec) == {"1", "2"} and dec["2"]["none"]["PIECEWISE"] is None and "gpu" not in dec["2"]["none"]["FULL"]
    assert res["protocol"]["token_budget"] == 16 and res["decode_skipped"] == []
    assert p.kv_blocks() == 40 // 4 + 1  # the longest prompt (more than 2 x (12 + 1 + 2) decode tokens), plus one


def test_experiment_engines_take_the_steps_they_run():
    """A step past max_num_batched_tokens is refused, so the experiments' engines take their largest: a regime map's
    decode of 16 requests beside 8-token prompts, a TTFT protocol's prompt of its largest capture size (the PR's
    protocol keeps its 16)."""
    from dsv32ref.experiments.protocol import engine_config
    from dsv32ref.experiments.regimes import RegimeProtocol
    assert RegimeProtocol(prompt_lens=(8,), batches=(1, 16)).engine_config("narrow").max_num_batched_tokens == 16
    assert RegimeProtocol().engine_config("narrow").max_num_batched_tokens == 8192
    assert engine_config("narrow", (1, 2, 64)).max_num_batched_tokens == 64
    assert engine_config("narrow").max_num_batched_tokens == 16


def test_regime_map_skips_decode_cases_past_its_kv_tokens():
    """GLM-5.2 keeps about 95 KB a token: 64 requests at 128k context would need 744 GiB. The default protocol
    runs the (context, batch) cases that fit its kv_tokens, lists the rest, and its cache fits one H200 beside
    the weights (about 42 GiB reduced)."""
    from dsv32ref.cache import token_bytes
    from dsv32ref.config import reduced_moe
    from dsv32ref.experiments.regimes import RegimeProtocol
    p, c = RegimeProtocol(), reduced_moe("glm-5.2")
    fits, skipped = p.decode_cases()
    assert (131072, 1) in fits and (131072, 64) in skipped and (8192, 64) in fits
    assert all(B * (C + p.decode_steps + 2) <= p.kv_tokens for C, B in fits)
    latent, key = token_bytes(c, torch.bfloat16)
    indexer_layers = sum(t == "full" for t in c.indexer_types) if c.indexer_types else c.num_hidden_layers
    per_token = c.num_hidden_layers * latent + indexer_layers * key
    assert p.kv_blocks() * p.block_size * per_token < 60 * 2**30
