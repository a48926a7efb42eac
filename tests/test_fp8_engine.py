"""The engine with kv_cache_dtype="fp8": FlashMLA's latent rows and DeepGEMM's indexer keys, written and read by the
kernels under every boundary, against the same engine with float caches; what the option costs in memory."""

import pytest
import torch

from dsv32ref.cache import AttentionMetadata, PagedKVCache, check_kv_cache_dtype, token_bytes, write_tokens
from dsv32ref.config import ModelConfig
from dsv32ref.engine import EngineConfig, LLMEngine, StepInput, from_reference
from dsv32ref.engine.memory import kv_bytes_per_token
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.reference.fp8_cache import quantize_indexer_keys, quantize_latent
from dsv32ref.testing import assert_close
from helpers import hadamard_butterflies_fp32, tiny_model

CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run")


def _fp8_model(seed):
    """The tiny DeepSeek-V3.2 with FlashMLA's latent widths (512 + 64), the only ones its FP8 rows hold; two
    layers (a dense one and a MoE one), so that layer 1 reads what layer 0's FP8 rows made of the prompt."""
    return tiny_model("tiny-deepseek-v3.2", dtype=torch.float32, seed=seed, kv_lora_rank=512, qk_rope_head_dim=64,
                      index_head_dim=64, num_hidden_layers=2)


def _run(ref, boundary, kv_cache_dtype, prompts):
    """A prefill of the prompts in one step, then one decode step -> (logits [2, requests, vocab], engine, the
    prefill's sampled tokens)."""
    ec = EngineConfig(boundary=boundary, mode=CUDAGraphMode.NONE, max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=32, block_size=8, capture_sizes=[1, 2, 4, 8, 16, 32],
                      kv_cache_dtype=kv_cache_dtype)
    eng = LLMEngine(ref.config, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, boundary))
    toks, _ = eng.step(StepInput([(r, p, 0) for r, p in enumerate(prompts)]))
    logits = [eng.last_logits]
    eng.step(StepInput([(r, [t], len(p)) for r, (p, t) in enumerate(zip(prompts, toks))]))
    return torch.stack(logits + [eng.last_logits]), eng, toks


@CPU
def test_fp8_engine_writes_the_float_engines_rows_quantised_and_both_paths_agree(seed):
    """Layer 0's cache (its rows depend on the prompt alone): the FP8 engine's bytes are the oracle's quantisation of
    the float engine's rows, slot by slot. Both cache-reading paths give the same FP8 logits, bit for bit. (How far they are
    from the float engine's is the accuracy study's subject: dsv32ref.experiments.fp8_accuracy.)"""
    ref = _fp8_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, ref.config.vocab_size, (n,), generator=g).tolist() for n in (11, 5)]
    base, eng_auto, _ = _run(ref, "narrow", "auto", prompts)
    # the two paths that read the caches: narrow's per-request eager one and none's graph-safe one (the other
    # boundaries run narrow's path; the float engine's test holds every boundary to the same logits)
    results = {b: _run(ref, b, "fp8", prompts) for b in ("narrow", "none")}
    fp8, eng, _ = results["narrow"]
    for b, (logits, _, _) in results.items():
        assert torch.equal(logits, fp8), b
    lat, lat8 = eng_auto.runner.kv_cache.latent[0], eng.runner.kv_cache.latent[0]
    written = torch.cat([_slots(eng, r, len(p)) for r, p in enumerate(prompts)])  # the prompts' slots
    assert torch.equal(_slots(eng_auto, 0, 12), _slots(eng, 0, 12))
    want = quantize_latent(lat.view(-1, 576)[written])
    got = lat8.view(-1, 656)[written]
    assert torch.equal(got, want)  # k_pe too: the kernels round to bf16 as torch does, under the interpreter too
    # the FP8 keys are rotated (Hadamard) before they are quantised; the float engine's are not
    keys = quantize_indexer_keys(hadamard_butterflies_fp32(eng_auto.runner.kv_cache.indexer_k[0].view(-1, 1, 64)[written]))
    blocks = eng.runner.kv_cache.indexer_k[0].view(-1, 8 * 68)
    for n, s in enumerate(written.tolist()):
        assert torch.equal(blocks[s // 8, (s % 8) * 64:(s % 8 + 1) * 64], keys[n, 0, 0, :64])
    assert fp8.isfinite().all() and base.isfinite().all()


def _slots(eng, seq_id, n):
    """The cache slots of a sequence's first n tokens."""
    table = torch.tensor(eng.allocator.ensure(seq_id, n))
    pos = torch.arange(n)
    return table[pos // eng.ec.block_size] * eng.ec.block_size + pos % eng.ec.block_size


def test_what_an_fp8_cache_costs_and_refuses():
    """Bytes per token per layer: DeepSeek-V3.2 bf16 (1152, 256), FP8 (656, 132); the engine's ledger counts them;
    an FP8 cache for other latent widths, an unknown kv_cache_dtype, and the reference's float path over an FP8
    cache are refused naming the field."""
    ds = ModelConfig.preset("deepseek-v3.2")
    assert token_bytes(ds, torch.bfloat16) == (1152, 256) and token_bytes(ds, torch.bfloat16, "fp8") == (656, 132)
    full = sum(ds.runs_indexer(i) for i in range(ds.num_hidden_layers))
    assert kv_bytes_per_token(ds, torch.bfloat16, "fp8") == 656 * ds.num_hidden_layers + 132 * full
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype: expected one of \('auto', 'fp8'\), got 'fp8_e5m2'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    tiny = tiny_model("tiny-deepseek-v3.2", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp8' stores FlashMLA's rows of kv_lora_rank 512 and "
                                         r"qk_rope_head_dim 64, the model has 32 and 8"):
        LLMEngine(tiny.config, EngineConfig(kv_cache_dtype="fp8", max_model_len=64, max_num_seqs=2,
                                            max_num_batched_tokens=8, num_blocks=4), device="cpu", dtype=torch.float32,
                  model=from_reference(tiny, "narrow"))
    ref = _fp8_model(0)
    cache = PagedKVCache(ref.config, 4, 8, torch.float32, kv_cache_dtype="fp8")
    assert cache.latent[0].shape == (4, 8, 656) and cache.indexer_k[0].shape == (4, 8, 68)
    assert cache.nbytes() == 4 * 8 * kv_bytes_per_token(ref.config, torch.float32, "fp8")
    with pytest.raises(ValueError, match=r"cache: the reference reads and writes float caches, got torch.uint8"):
        write_tokens(cache.latent[0], torch.tensor([0]), torch.zeros(1, 576))
    with pytest.raises(ValueError, match=r"cache: the reference reads and writes float caches, got .*float8_e4m3fn"):
        write_tokens(torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn), torch.tensor([0, 1]), torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"x: config: expected a ModelConfig, got NoneType"):
        check_kv_cache_dtype("x", "fp8", None)
    with pytest.raises(ValueError, match=r"fp8_parts: expected a non-empty tuple of \('latent', 'indexer'\), got \('kv',\)"):
        PagedKVCache(ref.config, 4, 8, torch.float32, kv_cache_dtype="fp8", fp8_parts=("kv",))
    half = PagedKVCache(ref.config, 4, 8, torch.float32, kv_cache_dtype="fp8", fp8_parts=("indexer",))
    assert half.latent[0].dtype == torch.float32 and half.indexer_k[0].shape == (4, 8, 68)


@CPU
def test_the_fp8_engine_is_the_reference_model_over_an_fp8_cache(seed):
    """The reference model, stepping through the engine's steps on its own FP8 cache (quantised on write by the
    oracle, dequantised on read), gives the engine's FP8 logits. Layer 0's bytes are equal; in deeper layers
    the kernels' fp32 sums and torch's differ in the last bit, which flips an fp8 rounding in a few values of a
    few thousand, so the logits agree to 2^16 fp32 steps of the row's largest, not to fp32 rounding. This
    comparison's worst error on the CPU over DSV32REF_SEED=0..119 was 2^14.0 steps (the tail is long: 2^13 failed
    one seed); with one fp8 value zeroed in every latent row the engine writes (_store_latent_fp8) it was at least
    2^18.2 over seeds 0..7, with one group's scale doubled at least 2^21.4."""
    ref = _fp8_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, ref.config.vocab_size, (n,), generator=g).tolist() for n in (11, 5)]
    fp8, eng, sampled = _run(ref, "narrow", "fp8", prompts)
    tables = [eng.allocator.ensure(r, len(p) + 1) for r, p in enumerate(prompts)]
    cache = PagedKVCache(ref.config, eng.runner.kv_cache.num_blocks, 8, torch.float32, kv_cache_dtype="fp8")
    with torch.no_grad():
        ids = torch.tensor(prompts[0] + prompts[1])
        first = ref(ids, cache, AttentionMetadata.build([0, 0], [11, 5], tables, 8))
        ends = torch.tensor([10, 15])
        second = ref(torch.tensor(sampled), cache, AttentionMetadata.build([11, 5], [1, 1], tables, 8))
    assert_close("prefill logits", fp8[0], first[ends], rtol=2**16, atol=2**16)
    assert_close("decode logits", fp8[1], second, rtol=2**16, atol=2**16)


def test_the_ttft_protocol_runs_fp8_arms_beside_the_others():
    """`--fp8-kv narrow` adds the arm narrow+fp8: the narrow boundary on an engine with the FP8 KV cache."""
    from dsv32ref.experiments.ttft import TTFTProtocol
    p = TTFTProtocol(variants=("narrow", "none"), fp8_kv=("narrow", "none"))
    assert p.arms()[2:] == [("narrow+fp8", "narrow", {"kv_cache_dtype": "fp8"}),
                            ("none+fp8", "none", {"kv_cache_dtype": "fp8"})]


def test_first_token_margins_are_the_gap_between_the_top_two_logits(seed):
    """What the TTFT run records beside its FP8 arms: per prompt, the first token's largest logit minus the
    second largest, from an untimed rerun; equal to the gap in the logits of the same step."""
    from dsv32ref.experiments.ttft import first_token_margins
    ref = _fp8_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, ref.config.vocab_size, (n,), generator=g).tolist() for n in (7, 3)]
    _, eng, _ = _run(ref, "narrow", "auto", prompts[:1])
    margins = first_token_margins(eng, prompts)
    for prompt, margin in zip(prompts, margins):
        eng.generate(prompt, 1)
        top = eng.last_logits[0].topk(2).values
        assert margin == float(top[0] - top[1]) and margin >= 0


def test_capture_memory_starts_engines_with_the_fp8_cache():
    """`dsv32ref capture --kv-cache-dtype fp8`: every start-up of the plan gets the FP8 KV cache, and the file says so."""
    import dataclasses

    from dsv32ref.experiments.capture_memory import Settings
    s = Settings(kv_cache_dtype="fp8")
    ec = s.engine_config({"boundary": "narrow_copy", "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.9,
                          "estimate_graph_memory": False})
    assert ec.kv_cache_dtype == "fp8" and dataclasses.asdict(s)["kv_cache_dtype"] == "fp8"
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_dtype: expected one of \('auto', 'fp8'\), got 'int8'"):
        Settings(kv_cache_dtype="int8").engine_config({"boundary": "narrow", "max_num_batched_tokens": 8,
                                                       "gpu_memory_utilization": 0.9, "estimate_graph_memory": True})


@CPU
def test_the_ttft_run_keeps_each_fp8_arms_tokens_beside_the_margins(tmp_path, seed):
    """The TTFT experiment with an FP8 arm, on emulated graphs: the run keeps the FP8 arm's first token of every
    timed request, in the order of the bf16 arm's tokens and margins, so that each difference can be set beside
    how close the bf16 call was; its agreement is the fraction of equal pairs."""
    from dsv32ref.experiments.ttft import TTFTProtocol, run
    cfg = _fp8_model(seed).config
    p = TTFTProtocol(variants=("none",), fp8_kv=("none",), requests=2, warmup=0, mode="none")
    res = run(p, device="cpu", config=cfg, out=str(tmp_path / "t.json"))
    fp8 = res["fp8_first_tokens"]["none+fp8"]
    assert set(res["variants"]) == {"none", "none+fp8"} and res["variants"]["none+fp8"]["kv_cache_dtype"] == "fp8"
    assert len(fp8) == len(res["first_tokens"]) == len(res["first_token_margins"]) == 2
    assert res["tokens_equal_to_first_arm"]["none+fp8"] == sum(a == b for a, b in zip(fp8, res["first_tokens"])) / 2
