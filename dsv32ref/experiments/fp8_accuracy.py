"""What the FP8 KV cache costs in accuracy: the reference model in float64 over FlashMLA's latent rows and
DeepGEMM's indexer keys, against the same model over a float64 cache and over a bf16 one.

    python -m dsv32ref fp8-accuracy [--tokens N]                                     -> fp8_accuracy.json

Cache arms (dsv32ref.cache.PagedKVCache): "float64" (the reference the others are measured against), "bf16",
"fp8" (both parts, as deployed), "fp8 latent" (the latent rows alone) and "fp8 indexer" (the indexer keys
alone): the last two say which part an error comes from. Models: tiny DeepSeek-V3.2 shapes at FlashMLA's
latent widths (kv_lora_rank 512, qk_rope_head_dim 64) with index_topk well below the sequence, once with our
dummy weights and once written by transformers (its initialiser, save_pretrained) and loaded by ours.

Per arm and model:
- greedy: each arm generates `tokens` tokens from the same prompt; the fraction equal to the float64 arm's
  position by position, and the first position where they part;
- teacher-forced, over one prefill of the prompt and the float64 arm's tokens (a token's own row is written
  before it attends, so a prefill sees what decode sees): per layer, the attention output's error (RMS of the
  difference over the float64 output's RMS) and the overlap of the indexer's top-k with the float64 arm's
  (shared selected positions over the float64 arm's valid ones, averaged over every token: the first index_topk
  tokens select every visible key and agree trivially, which raises the mean); per position, the logits' largest difference
  over the row's largest |logit|, the KL divergence from the float64 arm's distribution, and top-1 agreement.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

try:
    import transformers
except ImportError:  # optional: the checkpoint written by transformers is then left out
    transformers = None

from dsv32ref.cache import AttentionMetadata, PagedKVCache
from dsv32ref.checkpoint import init_dummy_weights, load_pretrained
from dsv32ref.checks import check_int, is_int, shown
from dsv32ref.config import ModelConfig
from dsv32ref.provenance import provenance
from dsv32ref.reference.model import DeepseekV32ForCausalLM
from dsv32ref.results import write_result

BOTH = ("latent", "indexer")
ARMS = {  # name: (cache dtype, kv_cache_dtype, the parts in FP8)
    "float64": (torch.float64, "auto", ()), "bf16": (torch.bfloat16, "auto", ()),
    "fp8": (torch.float64, "fp8", BOTH),
    "fp8 latent": (torch.float64, "fp8", ("latent",)), "fp8 indexer": (torch.float64, "fp8", ("indexer",))}
BLOCK_SIZE = 16
SHAPES = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=64, index_topk=16, vocab_size=256)


def dummy_model(seed: int) -> DeepseekV32ForCausalLM:
    """tiny-deepseek-v3.2 at FlashMLA's latent widths, dummy weights (checkpoint.init_dummy_weights), float64."""
    config = ModelConfig.preset("tiny-deepseek-v3.2").replace(**SHAPES)
    return init_dummy_weights(DeepseekV32ForCausalLM(config).double(), seed).eval()


def transformers_model(seed: int) -> DeepseekV32ForCausalLM | None:
    """The same shapes written by transformers (its DeepseekV32 class, its initialiser) and loaded by
    load_pretrained in float64; None without transformers."""
    if transformers is None:
        return None
    c = ModelConfig.preset("tiny-deepseek-v3.2").replace(**SHAPES)
    cfg = transformers.DeepseekV32Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads, n_shared_experts=1,
        n_routed_experts=c.n_routed_experts, routed_scaling_factor=2.5, kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim, n_group=1, topk_group=1, num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=True, rms_norm_eps=1e-6, index_topk=c.index_topk, index_head_dim=c.index_head_dim,
        index_n_heads=c.index_n_heads, first_k_dense_replace=1, tie_word_embeddings=False,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        return load_pretrained(path, dtype=torch.float64).eval()


def _cache(model, arm: str, n_tokens: int) -> tuple[PagedKVCache, list[int]]:
    dtype, kv_cache_dtype, parts = ARMS[arm]
    blocks = -(-n_tokens // BLOCK_SIZE)
    return PagedKVCache(model.config, blocks, BLOCK_SIZE, dtype, kv_cache_dtype=kv_cache_dtype,
                        fp8_parts=parts or BOTH), list(range(blocks))


@torch.no_grad()
def greedy(model, arm: str, prompt: list[int], n: int) -> list[int]:
    """n tokens generated greedily: one prefill, then n - 1 decode steps on the arm's cache."""
    cache, table = _cache(model, arm, len(prompt) + n)
    logits = model(torch.tensor(prompt), cache, AttentionMetadata.build([0], [len(prompt)], [table], BLOCK_SIZE))
    out = [int(logits[-1].argmax())]
    for i in range(n - 1):
        meta = AttentionMetadata.build([len(prompt) + i], [1], [table], BLOCK_SIZE)
        out.append(int(model(torch.tensor(out[-1:]), cache, meta)[-1].argmax()))
    return out


@torch.no_grad()
def forced(model, arm: str, ids: list[int]) -> dict:
    """One prefill of ids on the arm's cache -> {"logits" [T, V], "attn" [layers][T, hidden], "topk" [layers][T, k]}."""
    cache, table = _cache(model, arm, len(ids))
    attn = []
    hooks = [layer.self_attn.register_forward_hook(lambda _m, _i, out: attn.append(out[0]))
             for layer in model.model.layers]
    topk: list = []
    try:
        logits = model(torch.tensor(ids), cache, AttentionMetadata.build([0], [len(ids)], [table], BLOCK_SIZE), topk)
    finally:
        for h in hooks:
            h.remove()
    return {"logits": logits, "attn": attn, "topk": topk}


def topk_overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over tokens of |got ∩ want| / |want| (valid entries, >= 0)."""
    shares = []
    for g, w in zip(got.tolist(), want.tolist()):
        w = {i for i in w if i >= 0}
        shares.append(len(w & {i for i in g if i >= 0}) / len(w) if w else 1.0)
    return sum(shares) / len(shares)


def compare(run: dict, ref: dict) -> dict:
    """The teacher-forced metrics of one arm's prefill against the float64 arm's."""
    def rel_rms(a, b):
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    lg, lr = run["logits"], ref["logits"]
    logp, logq = torch.log_softmax(lr, -1), torch.log_softmax(lg, -1)
    row_err = (lg - lr).abs().amax(-1) / lr.abs().amax(-1)  # (T,)
    return {"attn_rel_rms_per_layer": [rel_rms(a, b) for a, b in zip(run["attn"], ref["attn"])],
            "topk_overlap_per_layer": [topk_overlap(a, b) for a, b in zip(run["topk"], ref["topk"])],
            "logits_rel_err_median": float(row_err.median()), "logits_rel_err_max": float(row_err.max()),
            "kl_mean": float((logp.exp() * (logp - logq)).sum(-1).mean()),
            "top1_agreement": float((lg.argmax(-1) == lr.argmax(-1)).double().mean())}


def study(model, prompt: list[int], n: int) -> dict:
    """Every arm on one model: greedy agreement and the teacher-forced metrics."""
    gen = {arm: greedy(model, arm, prompt, n) for arm in ARMS}
    ids = prompt + gen["float64"][:-1]
    runs = {arm: forced(model, arm, ids) for arm in ARMS}
    out = {"prompt_len": len(prompt), "generated": n, "index_topk": model.config.index_topk, "arms": {}}
    for arm in ARMS:
        same = [a == b for a, b in zip(gen[arm], gen["float64"])]
        out["arms"][arm] = dict(compare(runs[arm], runs["float64"]), tokens=gen[arm], greedy_agreement=sum(same) / n,
                                first_divergence=same.index(False) if False in same else None)
    return out


MAX_POSITIONS = 4096  # the models' max_position_embeddings: the prompt and the generated tokens lie within them
MAX_TOKENS = 2048  # generated tokens per arm


def run(tokens: int = 200, prompt_len: int = 48, seeds=(0, 1), out: str | None = None) -> dict:
    check_int("fp8_accuracy.run: tokens", tokens, low=1, high=MAX_TOKENS)
    check_int("fp8_accuracy.run: prompt_len", prompt_len, low=1, high=MAX_POSITIONS - tokens)
    if not isinstance(seeds, (list, tuple)) or not seeds or not all(is_int(s) for s in seeds):
        raise ValueError(f"fp8_accuracy.run: seeds: expected a non-empty list of ints, got {shown(seeds)}")
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise ValueError(f"fp8_accuracy.run: out: expected None or a path, got {type(out).__name__}")
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    t0 = time.time()
    result = {"provenance": provenance(), "arms": {a: {"cache_dtype": str(d), "kv_cache_dtype": k, "fp8_parts": list(p)}
                                                   for a, (d, k, p) in ARMS.items()}, "models": {},
              # over FP8 keys the indexer's keys and queries are Hadamard-rotated, its queries fp8 (dsv32ref.reference.mla)
              "fp8_indexer_numerics": "hadamard-rotated keys and queries, fp8 queries"}
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        for name, make in (("dummy", dummy_model), ("transformers", transformers_model)):
            model = make(seed)
            if model is None:
                continue
            prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
            result["models"][f"{name} seed {seed}"] = r = study(model, prompt, tokens)
            _print(f"{name} seed {seed}", r)
    result["wall_s"] = time.time() - t0
    if out:
        write_result(out, result)
    return result


def _print(name: str, r: dict) -> None:
    print(f"{name}: prompt {r['prompt_len']}, {r['generated']} greedy tokens, index_topk {r['index_topk']}")
    for arm, a in r["arms"].items():
        worst = max(a["attn_rel_rms_per_layer"])
        print(f"  {arm:<12} greedy agreement {a['greedy_agreement']:6.1%} (parts at {a['first_divergence']}), "
              f"top-1 {a['top1_agreement']:6.1%}, logits err median {a['logits_rel_err_median']:.1e}, "
              f"attn err worst layer {worst:.1e}, top-k overlap min {min(a['topk_overlap_per_layer']):.3f}")
