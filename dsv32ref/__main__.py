"""`python -m dsv32ref` / `dsv32ref`: the main job and the experiments.

    dsv32ref                    on a CPU: the summary below. On a CUDA GPU: the summary, then the seed PR's
                                measurements reproduced live (`reproduce`), --full by default or --quick
    dsv32ref summary            presets (per-layer parameter counts), the reference end to end on the small
                                presets with every check it makes, and the recorded GPU results
    dsv32ref reproduce          the PR's TTFT protocol for every boundary, the ledger, capture memory at one
                                TP4 rank's heads; one table, PR / ours (GPU) -> data/
    dsv32ref regimes            TTFT against prompt length, decode TPOT per batch and context (GPU)
                                                                            -> data/regimes_<preset>.json
    dsv32ref timeline           one profiled request per boundary on a time axis (GPU)
                                                                            -> data/timeline_<preset>.json
    dsv32ref kernels            the kernel benchmark (GPU)                     -> data/kernels.json
    dsv32ref ledger --predict   launch ledger of each eager boundary, on a CPU -> data/ledger_predicted.json
    dsv32ref ttft               TTFT + measured ledger of each boundary (GPU)  -> data/ttft_<preset>.json
    dsv32ref capture            start-up memory per boundary under FULL_AND_PIECEWISE capture (GPU)
                                                                            -> data/capture_memory_<preset>.json
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dsv32ref.cache import AttentionMetadata, BlockAllocator
from dsv32ref.checks import rel_err
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


def print_recorded_results(data_dir: str = "data") -> None:
    """What the GPU runs recorded (data/*.json), with their provenance."""
    import glob
    import json
    import os

    files = sorted(glob.glob(os.path.join(data_dir, "*.json")))
    if not files:
        return
    print(f"\nRecorded results in {data_dir}/:")
    for f in files:
        with open(f) as fh:
            d = json.load(fh)
        p = d.get("provenance", {})
        if p.get("git_commit") is None:  # seeds.json: the PR's published figures, not a run of ours
            print(f"  {os.path.basename(f):<32} published figures: {d.get('title', p.get('source', '?'))}")
            continue
        print(f"  {os.path.basename(f):<32} {p.get('device', '?')}, {p.get('date', '?')[:10]}, "
              f"commit {p['git_commit'][:10]}")
        variants = d.get("variants")
        for v, r in (variants if isinstance(variants, dict) else {}).items():
            if "mean_ms" in r:
                led = r["ledger"]
                clean = "kernel_ms_by_name" in led and not any(k.startswith("dsv32ref::") for k in led["kernel_ms_by_name"])
                floor = f"{led['gpu_busy_ms']:.2f} ms" if clean else "n/a (range annotations were counted as kernels)"
                print(f"    {v:<12} TTFT mean {r['mean_ms']:.2f} ms (p99 {r['p99_ms']:.2f}), floor {floor}, "
                      f"direct launches {r['ledger']['direct_total']}, graph launches {r['ledger']['graph_launches']}")
            elif "direct_total" in r:
                print(f"    {v:<12} predicted direct launches {r['direct_total']}, graph launches {r['graph_launches']}")
        for r in d.get("runs") or []:  # capture memory: one engine start-up per run
            extra = "" if r["max_num_batched_tokens"] == 512 else f", max tokens {r['max_num_batched_tokens']}"
            outcome = f"out of memory at {r['failed_at']}" if r["failed"] else "starts"
            print(f"    {r['boundary']:<19} util {r['gpu_memory_utilization']:.3g}, estimate "
                  f"{'on' if r['estimate_graph_memory'] else 'off'}{extra}: {outcome}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv32ref", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")
    s = sub.add_parser("summary", help="presets, the reference end to end, recorded results (default)")
    for p in (parser, s):
        p.add_argument("--preset", action="append", choices=sorted(p for p in PRESETS if p.startswith("tiny")),
                       help="small preset(s) to run end to end (default: all tiny presets)")
        p.add_argument("--seed", type=int, default=0)
    rp = sub.add_parser("reproduce", help="the seed PR's measurements on this GPU, beside its figures")
    for p in (parser, rp):
        p.add_argument("--quick", action="store_true", help="the quick preset (minutes) instead of the full one")
    hcp = sub.add_parser("hostcosts", help="the TTFT model's host costs, per-region times included (GPU)")
    hcp.add_argument("--model", default="glm-5.2", choices=["glm-5.2", "deepseek-v3.2", "glm-5"])
    hcp.add_argument("--out", default=None)
    rg = sub.add_parser("regimes", help="TTFT against prompt length and decode TPOT, every variant (GPU)")
    rg.add_argument("--model", default="glm-5.2", choices=["glm-5.2", "deepseek-v3.2", "glm-5"])
    rg.add_argument("--out", default=None)
    tl = sub.add_parser("timeline", help="one profiled request per boundary on a time axis (GPU)")
    tl.add_argument("--model", default="glm-5.2", choices=["glm-5.2", "deepseek-v3.2", "glm-5"])
    tl.add_argument("--out", default=None)
    k = sub.add_parser("kernels", help="kernel benchmark on the GPU")
    k.add_argument("--out", default="data/kernels.json")
    k.add_argument("--quick", action="store_true")
    led = sub.add_parser("ledger", help="launch ledger of each eager boundary")
    led.add_argument("--predict", action="store_true", help="predict on the CPU from the model structure")
    led.add_argument("--model", default="glm-5.2", choices=["glm-5.2", "deepseek-v3.2", "glm-5"])
    led.add_argument("--out", default=None)
    t = sub.add_parser("ttft", help="TTFT and measured ledger of each boundary on the GPU")
    t.add_argument("--model", default="glm-5.2", choices=["glm-5.2", "deepseek-v3.2", "glm-5"])
    t.add_argument("--requests", type=int, default=256)
    t.add_argument("--warmup", type=int, default=8)
    t.add_argument("--tp", type=int, default=1, help="ranks (GPUs): tensor parallel attention/MLP, expert parallel MoE")
    t.add_argument("--out", default=None)
    t.add_argument("--skip-topk", nargs="*", default=["narrow", "narrow_out"], metavar="BOUNDARY",
                   help="boundaries that also run with EngineConfig.skip_short_topk on (default: narrow narrow_out)")
    t.add_argument("--split", nargs="*", default=["none"], metavar="BOUNDARY",
                   help="boundaries that also run with EngineConfig.split_graphs on (default: none; a FULL graph is "
                        "what splitting helps)")
    t.add_argument("--instrument-ab", action="store_true",
                   help="also time wide, narrow and narrow_out with every profiler range open (what the instrument "
                        "costs when on), interleaved with the rest")
    cm = sub.add_parser("capture", help="start-up and capture memory of each boundary on the GPU")
    cm.add_argument("--model", default="glm-5.2", choices=["glm-5.2", "deepseek-v3.2", "glm-5"])
    cm.add_argument("--heads-per-rank", type=int, default=None,
                    help="attention heads on this GPU (e.g. 16: one rank of GLM-5.2 at TP4); default all")
    cm.add_argument("--no-threshold", action="store_true", help="skip the threshold check runs")
    cm.add_argument("--plan", default="default", choices=["default", "history"],
                    help="default: every boundary + threshold checks; history: narrow_copy with allocator history")
    cm.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "capture":
        from dsv32ref.experiments.capture_memory import run_plan

        if not torch.cuda.is_available():
            print("capture needs a CUDA GPU")
            return 2
        tag = (f"_h{args.heads_per_rank}" if args.heads_per_rank else "") + ("_history" if args.plan == "history" else "")
        run_plan(args.model, heads_per_rank=args.heads_per_rank, threshold_runs=not args.no_threshold, plan=args.plan,
                 out=args.out or f"data/capture_memory_{args.model}{tag}.json")
        return 0
    if args.cmd == "kernels":
        from dsv32ref.bench.kernels import main as bench_main

        return bench_main(["--out", args.out] + (["--quick"] if args.quick else []))
    if args.cmd == "ledger":
        from dsv32ref.experiments.ledger import predict_all

        if not args.predict:
            print("the measured ledger comes with `dsv32ref ttft` (GPU); use --predict for the CPU prediction")
            return 2
        import os

        measured, costs = f"data/ttft_{args.model}.json", f"data/host_costs_{args.model}.json"
        predict_all(args.model, out=args.out or f"data/ledger_predicted_{args.model}.json",
                    measured=measured if os.path.exists(measured) else None,
                    host_costs=costs if os.path.exists(costs) else None)
        return 0
    if args.cmd == "ttft":
        from dsv32ref.experiments.ttft import rank_main, run

        if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
            print(f"ttft needs {args.tp} CUDA GPU(s); the recorded results are in data/ (see `dsv32ref summary`)")
            return 2
        tag = f"_tp{args.tp}" if args.tp > 1 else ""
        out = args.out or f"data/ttft_{args.model}{tag}.json"
        if args.tp > 1:
            import os

            from dsv32ref.parallel import spawn

            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
            spawn(rank_main, args.tp, args.model, args.requests, args.warmup, out)
        else:
            run(args.model, n_requests=args.requests, warmup=args.warmup, out=out,
                instrument_ab=("wide", "narrow", "narrow_out") if args.instrument_ab else (),
                skip_topk=tuple(args.skip_topk), split=tuple(args.split))
        return 0
    if args.cmd in ("hostcosts", "regimes", "timeline"):  # one GPU experiment per model -> data/<name>_<model>.json
        from dsv32ref.experiments import host_costs, regimes, timeline

        name, experiment = {"hostcosts": ("host_costs", host_costs), "regimes": ("regimes", regimes),
                            "timeline": ("timeline", timeline)}[args.cmd]
        if not torch.cuda.is_available():
            print(f"{args.cmd} needs a CUDA GPU; the recorded results are in data/{name}_<model>.json")
            return 2
        experiment.run(args.model, out=args.out or f"data/{name}_{args.model}.json")
        return 0
    if args.cmd == "reproduce":
        from dsv32ref.experiments.reproduce import print_table, run as reproduce, table

        if not torch.cuda.is_available():
            print("reproduce needs a CUDA GPU; the recorded runs beside the PR's figures:")
            print_table(table())
            return 2
        reproduce("quick" if args.quick else "full")
        return 0
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    print_presets()
    ok = all([run_reference(p, args.seed) for p in (args.preset or ["tiny-deepseek-v3.2", "tiny-glm-5.2"])])
    print_recorded_results()
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    if ok and args.cmd is None and torch.cuda.is_available():
        from dsv32ref.experiments.reproduce import run as reproduce

        reproduce("quick" if args.quick else "full")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
