"""`python -m dsv32ref` / `dsv32ref`: the main job.

At this stage it summarises the presets (per-layer parameter counts) and runs the reference end to end on a
small preset, printing every check it makes. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dsv32ref.cache import AttentionMetadata, BlockAllocator
from dsv32ref.checkpoint import init_dummy_weights
from dsv32ref.config import PRESETS, ModelConfig
from dsv32ref.diagnostics import attention_stats
from dsv32ref.param_counts import layer_parameter_counts, model_parameter_count
from dsv32ref.reference.model import DeepseekV32ForCausalLM


def _fmt(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def print_presets() -> None:
    print("Per-layer parameter counts (MTP layers excluded)")
    print(f"{'preset':<20} {'layers':<18} {'MLA':>9} {'indexer':>9} {'MLP/MoE':>9} {'layer':>9}")
    for name in ("deepseek-v3.2", "glm-5", "glm-5.2"):
        c = ModelConfig.preset(name)
        counts = layer_parameter_counts(c)
        groups: dict[tuple, list[int]] = {}
        for i, cnt in enumerate(counts):
            groups.setdefault(tuple(cnt.values()), []).append(i)
        for values, layers in groups.items():
            cnt = dict(zip(counts[0].keys(), values))
            span = f"{len(layers)} x [{layers[0]}..{layers[-1]}]"
            print(f"{name:<20} {span:<18} {_fmt(cnt['mla']):>9} {_fmt(cnt['indexer']):>9} "
                  f"{_fmt(cnt['mlp']):>9} {_fmt(cnt['total']):>9}")
        print(f"{name:<20} total {_fmt(model_parameter_count(c))}, softmax scale {c.softmax_scale:.6f}, "
              f"{c.num_indexer_layers}/{c.num_hidden_layers} layers run their indexer")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_reference(preset: str, seed: int) -> bool:
    config = ModelConfig.preset(preset)
    torch.manual_seed(seed)
    model = init_dummy_weights(DeepseekV32ForCausalLM(config).double(), seed).eval()
    V = config.vocab_size
    prompts = [torch.randint(0, V, (n,)) for n in (19, 6, 11)]
    checks: list[tuple[str, float, str, float]] = []  # (name, value, "<=" or ">", bound)

    with torch.no_grad():
        t0 = time.perf_counter()
        one_shot = [model(p) for p in prompts]
        dt = time.perf_counter() - t0
        print(f"\n{preset}: forward of {[len(p) for p in prompts]} tokens (float64, CPU) in {dt * 1e3:.0f} ms; "
              f"logits {list(one_shot[0].shape)}")
        model.set_form("naive")
        naive = [model(p) for p in prompts]
        model.set_form("absorbed")
        checks.append(("absorbed == naive MLA (rel err)", max(_rel(a, b) for a, b in zip(one_shot, naive)), "<=", 1e-10))

        # The same three sequences as a paged batch: prefill all but 3 tokens, then decode them.
        alloc, block = BlockAllocator(64, 4), 4
        cache = model.new_cache(64, block)
        lens = [len(p) - 3 for p in prompts]
        got = [[] for _ in prompts]
        steps = [[p[:n] for p, n in zip(prompts, lens)]] + [[p[n + i: n + i + 1] for p, n in zip(prompts, lens)] for i in range(3)]
        ctx = [0] * len(prompts)
        for step in steps:
            tables = [alloc.ensure(b, ctx[b] + len(t)) for b, t in enumerate(step)]
            meta = AttentionMetadata.build(ctx, [len(t) for t in step], tables, block)
            logits = model(torch.cat(step), cache, meta)
            for b, (lo, hi) in enumerate(zip(meta.query_start_loc_cpu, meta.query_start_loc_cpu[1:])):
                got[b].append(logits[lo:hi])
                ctx[b] += hi - lo
        checks.append(("batched prefill + decode == one-shot (rel err)",
                       max(_rel(torch.cat(g), o) for g, o in zip(got, one_shot)), "<=", 1e-10))

        stats = attention_stats(model.float(), torch.randint(0, V, (48,)))
        ent = min(s["entropy_ratio"] for s in stats)
        pmax = max(s["max_prob"] for s in stats)
        recent = max(s["recent_overlap"] for s in stats if s["runs_indexer"])
        checks.append(("dummy weights: min attention entropy / log(k)", ent, ">", 0.05))
        checks.append(("dummy weights: max mean top probability", pmax, "<=", 0.95))
        checks.append(("dummy weights: top-k overlap with the k most recent", recent, "<=", 0.6))

    ok = True
    for name, value, op, bound in checks:
        passed = value > bound if op == ">" else value <= bound
        ok &= passed
        print(f"  {'PASS' if passed else 'FAIL'}  {name}: {value:.3g} ({op} {bound:g})")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv32ref", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=sorted(p for p in PRESETS if p.startswith("tiny")),
                        help="small preset(s) to run end to end (default: all tiny presets)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    print_presets()
    ok = all([run_reference(p, args.seed) for p in (args.preset or ["tiny-deepseek-v3.2", "tiny-glm-5.2"])])
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
