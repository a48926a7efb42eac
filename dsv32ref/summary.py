"""The main job's summary: per-layer parameter counts of every preset, the reference end to end on the small
presets with each check it makes, and what data/ records, in a few lines."""

from __future__ import annotations

import glob
import os
import time

import torch

from dsv32ref.cache import AttentionMetadata, BlockAllocator
from dsv32ref.checks import rel_err, shown
from dsv32ref.checkpoint import init_dummy_weights
from dsv32ref.config import ModelConfig
from dsv32ref.diagnostics import attention_stats
from dsv32ref.param_counts import layer_parameter_counts, model_parameter_count
from dsv32ref.reference.model import DeepseekV32ForCausalLM
from dsv32ref.results import DATA_DIR, read_result, reading

__all__ = ["main", "print_presets", "print_recorded", "run_reference"]


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
        checks.append(("absorbed == naive MLA (rel err)", max(rel_err(a, b) for a, b in zip(one_shot, naive)), "<=", 1e-10))

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
                       max(rel_err(torch.cat(g), o) for g, o in zip(got, one_shot)), "<=", 1e-10))

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


def print_recorded(data_dir: str = DATA_DIR) -> None:
    """What data/ records, in a few lines: where and at which commit, GLM-5.2's TTFT per boundary beside the
    PR's, and narrow_copy's start-up (data/README.md lists every file, its command and its readers)."""
    if not isinstance(data_dir, (str, os.PathLike)):
        raise ValueError(f"print_recorded: data_dir: expected a folder of results, got {shown(data_dir)}")
    if not os.path.isdir(data_dir):  # (an installed package has no data/)
        print(f"\nRecorded: no folder {os.fspath(data_dir)!r} here (data/ comes with a checkout of the repository)")
        return
    files = sorted(glob.glob(os.path.join(data_dir, "*.json")))
    gpu = {}
    for f in files:
        with reading(f):
            p = (read_result(f) or {}).get("provenance", {})
            if p.get("git_commit") and "CPU" not in str(p.get("device")):
                gpu.setdefault((p["device"], p["git_commit"][:7]), []).append(os.path.basename(f))
    where = "; ".join(f"{len(v)} on {d} at commit {c}" for (d, c), v in gpu.items())
    folder = "data" if os.path.abspath(data_dir) == DATA_DIR else data_dir  # the repository's, wherever this runs
    print(f"\nRecorded in {folder}/ ({len(files)} files, listed in {folder}/README.md): {where or 'no GPU runs'}")
    seeds, run = (read_result(os.path.join(data_dir, name)) for name in ("seeds.json", "ttft_glm-5.2.json"))
    cap = read_result(os.path.join(data_dir, "capture_memory_glm-5.2_h16.json"))
    with reading(f"{data_dir}'s seeds.json, ttft_glm-5.2.json and capture_memory_glm-5.2_h16.json"):
        if seeds and run:
            ours = ", ".join(f"{v} {r['mean_ms']:.1f}" for v, r in run["variants"].items() if "+" not in v)
            print(f"  GLM-5.2 TTFT mean (ms): {ours}; the PR (TP4): wide {seeds['ttft']['wide']['mean_ms']}, narrow "
                  f"{seeds['ttft']['narrow']['mean_ms']}")
        if cap:
            outcomes = [f"estimate {'on' if r['estimate_graph_memory'] else 'off'}: "
                        + (f"out of memory at {r['failed_at']}" if r["failed"] else "starts")
                        for r in cap["runs"] if r["boundary"] == "narrow_copy" and r["gpu_memory_utilization"] == 0.9
                        and r["max_num_batched_tokens"] == 512]
            print(f"  narrow_copy start-up at 16 heads (one TP4 rank): {'; '.join(outcomes)}")


def main(presets: list[str], seed: int = 0) -> bool:
    """The whole summary; True if every check passed."""
    print_presets()
    ok = all([run_reference(p, seed) for p in presets])
    print_recorded()
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return ok
