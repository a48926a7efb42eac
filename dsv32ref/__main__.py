"""`python -m dsv32ref` / `dsv32ref`: the main job and the experiments.

    dsv32ref                    the summary below; on a CUDA GPU then the PR's measurements reproduced live
                                (`reproduce`, --quick or the full run), beside the PR's and the recorded figures
    dsv32ref summary            presets (per-layer parameter counts), the reference end to end on the small
                                presets with every check it makes, and what data/ records, in a few lines
    dsv32ref reproduce          the PR's TTFT protocol for every boundary, the ledger, capture memory at one
                                TP4 rank's heads; one table: the PR, the recorded run, this machine (GPU)
    dsv32ref ttft               TTFT + measured ledger of each boundary (GPU)        -> ttft_<model>.json
    dsv32ref capture            start-up memory per boundary under FULL_AND_PIECEWISE (GPU)
                                                                         -> capture_memory_<model>[_h<heads>].json
    dsv32ref regimes            TTFT against prompt length, decode TPOT (GPU)        -> regimes_<model>.json
    dsv32ref timeline           one profiled request per boundary (GPU)              -> timeline_<model>.json
    dsv32ref hostcosts          the TTFT model's host costs (GPU)                    -> host_costs_<model>.json
    dsv32ref kernels            the kernel benchmark (GPU)                           -> kernels.json
    dsv32ref fp8-speed          the FP8 KV cache against bf16: decode, indexer scores (GPU) -> fp8_speed.json
    dsv32ref fp8-accuracy       the FP8 KV cache against bf16 and float64 caches, on the CPU -> fp8_accuracy.json
    dsv32ref ledger --predict   launch ledger of each boundary, on a CPU             -> ledger_predicted_<model>.json

A run's files go to runs/<UTC time>/ (or --out PATH); --record writes them into data/, over what is recorded
there. Exit status 1 if a check fails, 2 if the command needs a GPU this machine lacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from dsv32ref import summary
from dsv32ref.bench import fp8 as fp8_bench
from dsv32ref.bench import kernels as kernel_bench
from dsv32ref.cache import KV_CACHE_DTYPES
from dsv32ref.checks import MAX_SEED, check_replaceable
from dsv32ref.config import PRESETS, ModelConfig
from dsv32ref.engine.model import TensorParallel
from dsv32ref.experiments import (capture_memory, fp8_accuracy, host_costs, ledger, regimes, reproduce, timeline, ttft,
                                  ttft_model)
from dsv32ref.parallel import spawn
from dsv32ref.results import DATA_DIR, partial_path, run_dir, write_result

MODELS = ["glm-5.2", "deepseek-v3.2", "glm-5"]


def _out(args, name: str) -> str:
    if args.out is not None and args.record:
        raise ValueError(f"--record and --out {args.out!r}: give one (--record writes into data/, --out to a path)")
    if args.out is not None and (not args.out or os.path.isdir(args.out) or args.out.endswith(os.sep)):
        raise ValueError(f"--out: expected a file path, got {args.out!r}" + (
            " (ends in a separator)" if args.out.endswith(os.sep) else " (a directory)" if args.out else ""))
    if args.out is not None and "\0" in args.out:
        raise ValueError(f"--out: a path cannot hold a NUL character, got {args.out!r}")
    if args.out:  # where the result goes, before the work that makes it
        for file in (args.out, partial_path(args.out)):  # the result, and what a long run writes as it goes
            check_replaceable("--out", file)
        folder = os.path.dirname(os.path.abspath(args.out))
        name_max = 255  # NAME_MAX of the common file systems: a longer name fails only when the result is written
        if len(os.fsencode(os.path.basename(args.out))) > name_max:
            raise ValueError(f"--out: the file name takes {len(os.fsencode(os.path.basename(args.out)))} bytes, a file "
                             f"system takes at most {name_max}")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out: cannot make the folder {folder!r} ({e.strerror})") from None
        try:  # a file made and removed there (os.access says yes to root in /proc, for one)
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".dsv32ref-out-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"--out: cannot write into the folder {folder!r} ({e.strerror})") from None
    return args.out or os.path.join(DATA_DIR if args.record else run_dir(), name)


def _needs_gpu(what: str, count: int = 1) -> bool:
    if torch.cuda.is_available() and torch.cuda.device_count() >= count:
        return False
    print(f"dsv32ref: error: {what} needs {count} CUDA GPU(s); what one H200 recorded is in data/ (see "
          f"`dsv32ref summary`)", file=sys.stderr)
    return True


def cmd_summary(args) -> int:
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed: expected an int in [0, 2^63), got {args.seed}")
    if args.cmd is None and (args.quick or args.record) and not torch.cuda.is_available():
        print("dsv32ref: error: --quick and --record are reproduce's, which needs a CUDA GPU (the summary alone "
              "reads neither)", file=sys.stderr)
        return 2
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    ok = summary.main(args.preset or ["tiny-deepseek-v3.2", "tiny-glm-5.2"], args.seed)
    if ok and args.cmd is None and torch.cuda.is_available():
        reproduce.run("quick" if args.quick else "full", DATA_DIR if args.record else run_dir())
    return 0 if ok else 1


def cmd_reproduce(args) -> int:
    if _needs_gpu("reproduce"):
        reproduce.print_table(reproduce.table())
        return 2
    reproduce.run("quick" if args.quick else "full", DATA_DIR if args.record else run_dir())
    return 0


def cmd_ttft(args) -> int:
    p = ttft.TTFTProtocol(preset=args.model, requests=args.requests, warmup=args.warmup,
                          skip_topk=tuple(args.skip_topk), fp8_kv=tuple(args.fp8_kv),
                          fused_moe=tuple(args.fused_moe), skinny_gemm=tuple(args.skinny_gemm),
                          fused_skinny=tuple(args.fused_skinny),
                          instrument_ab=("wide", "narrow", "narrow_out") if args.instrument_ab else ())
    if args.tp < 1:
        raise ValueError(f"--tp: expected an int >= 1, got {args.tp}")
    try:
        TensorParallel(0, args.tp).check(ModelConfig.preset(args.model))
    except ValueError as e:
        raise ValueError(f"--tp {args.tp}: {e}") from None
    if _needs_gpu("ttft", args.tp):
        return 2
    out = _out(args, f"ttft_{args.model}" + (f"_tp{args.tp}" if args.tp > 1 else "") + ".json")
    if args.tp > 1:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
        spawn(ttft.rank_main, args.tp, p, out)
    else:
        ttft.run(p, out=out)
    return 0


def cmd_capture(args) -> int:
    if args.heads_per_rank is not None:
        if args.heads_per_rank < 1:
            raise ValueError(f"--heads-per-rank: expected an int >= 1, got {args.heads_per_rank}")
        heads = ModelConfig.preset(args.model).num_attention_heads
        if heads % args.heads_per_rank:
            raise ValueError(f"--heads-per-rank {args.heads_per_rank}: expected a divisor of {args.model}'s {heads} "
                             f"heads (one rank's share under tensor parallelism)")
    if _needs_gpu("capture"):
        return 2
    tag = (f"_h{args.heads_per_rank}" if args.heads_per_rank else "") + \
        ("" if args.plan in ("default", "quick") else f"_{args.plan}") + \
        ("" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}")
    capture_memory.run_plan(args.model, heads_per_rank=args.heads_per_rank, threshold_runs=not args.no_threshold,
                            plan=args.plan, out=_out(args, f"capture_memory_{args.model}{tag}.json"),
                            settings=capture_memory.Settings(kv_cache_dtype=args.kv_cache_dtype))
    return 0


def cmd_regimes(args) -> int:
    kw = {}
    for flag, name, cap in (("--max-prompt", "prompt_lens", args.max_prompt),
                            ("--max-context", "contexts", args.max_context)):
        if cap is None:
            continue
        kw[name] = tuple(v for v in getattr(regimes.RegimeProtocol, name) if v <= cap)
        if not kw[name]:
            raise ValueError(f"{flag}: expected an int >= {min(getattr(regimes.RegimeProtocol, name))} (the "
                             f"shortest of the default {name}), got {cap}")
    if _needs_gpu("regimes"):
        return 2
    regimes.run(regimes.RegimeProtocol(preset=args.model, **kw), out=_out(args, f"regimes_{args.model}.json"))
    return 0


def cmd_timeline(args) -> int:
    if _needs_gpu("timeline"):
        return 2
    timeline.run(args.model, out=_out(args, f"timeline_{args.model}.json"))
    return 0


def cmd_hostcosts(args) -> int:
    if _needs_gpu("hostcosts"):
        return 2
    host_costs.run(args.model, out=_out(args, f"host_costs_{args.model}.json"))
    return 0


def cmd_kernels(args) -> int:
    if _needs_gpu("kernels"):  # before --out's folders are made
        return 2
    return kernel_bench.main(["--out", _out(args, "kernels.json")] + (["--quick"] if args.quick else []))


def cmd_fp8_speed(args) -> int:
    if _needs_gpu("fp8-speed"):
        return 2
    return fp8_bench.main(["--out", _out(args, "fp8_speed.json")] + (["--quick"] if args.quick else []))


def cmd_fp8_accuracy(args) -> int:
    fp8_accuracy.run(tokens=args.tokens, out=_out(args, "fp8_accuracy.json"))  # (run checks --tokens first)
    return 0


def cmd_ledger(args) -> int:
    if not args.predict:
        print("the measured ledger comes with `dsv32ref ttft` (GPU); use --predict for the CPU prediction",
              file=sys.stderr)
        return 2
    out = _out(args, f"ledger_predicted_{args.model}.json")
    if args.measured == "":
        raise ValueError("--measured: expected a TTFT result's path, got '' (leave it out for data/'s)")
    measured = args.measured or os.path.join(DATA_DIR, f"ttft_{args.model}.json")
    if args.measured and not os.path.isfile(measured):
        what = ("a directory, not a TTFT result" if os.path.isdir(measured) else
                "not a regular file" if os.path.exists(measured) else "no such file")
        raise ValueError(f"--measured: {what} {measured!r}")
    # checked before the prediction's minutes
    run = ttft_model.load_ttft_result(measured, args.model) if os.path.exists(measured) else None
    # the run's prompt length (predict_all checks it before its first arm), so that the two compare
    predicted = ledger.predict_all(args.model, prompt_len=run["protocol"]["prompt_len"] if run else 8)
    if run is not None:
        ttft_model.attach(predicted, measured, run)
    write_result(out, predicted)
    return 0


def _add_model_commands(add) -> None:
    """The GPU commands that take only a model: regimes (and how far its map reaches), timeline, hostcosts."""
    for name, fn, help_ in (("regimes", cmd_regimes, "TTFT against prompt length and decode TPOT (GPU)"),
                            ("timeline", cmd_timeline, "one profiled request per boundary on a time axis (GPU)"),
                            ("hostcosts", cmd_hostcosts, "the TTFT model's host costs (GPU)")):
        cmd = add(name, fn, help_)
        cmd.add_argument("--model", default="glm-5.2", choices=MODELS)
        if name == "regimes":  # the default map runs minutes at 32k prompts and 128k contexts: a shorter one
            cmd.add_argument("--max-prompt", type=int, default=None, help="only the default prompt lengths <= this")
            cmd.add_argument("--max-context", type=int, default=None, help="only the default contexts <= this")


TTFT_ARM_FLAGS = (  # ttft's arms: flag, default boundaries, what they switch on
    ("--skip-topk", ["narrow", "narrow_out"], "with EngineConfig.skip_short_topk on (default: narrow narrow_out)"),
    ("--fp8-kv", [], "with the FP8 KV cache (EngineConfig.kv_cache_dtype fp8)"),
    ("--fused-moe", [], "their MoE layers fused (EngineConfig.moe fused)"),
    ("--skinny-gemm", [], "their projections in skinny_gemm (EngineConfig.gemm skinny)"),
    ("--fused-skinny", [], "with both the fused MoE and skinny_gemm"))


def _add_main_commands(parser: argparse.ArgumentParser, add) -> None:
    """summary and reproduce, whose options (--preset, --seed, --quick, --record) are also the top level's: no
    command runs summary, then (GPU) reproduce with --quick / --record. A command's own parser leaves them as given
    before the command (SUPPRESS: no default of its own overwrites them); --preset given on both sides of summary
    appends (its own dest, which _parse adds to the top level's)."""
    s = add("summary", cmd_summary, "presets, the reference end to end, what data/ records", out=False,
            reads=("preset", "seed"))
    for p, default, dest in ((parser, None, "preset"), (s, argparse.SUPPRESS, "preset_after")):
        p.add_argument("--preset", action="append", choices=sorted(p for p in PRESETS if p.startswith("tiny")),
                       default=default, dest=dest, help="small preset(s) to run end to end (default: all tiny presets)")
        p.add_argument("--seed", type=int, default=0 if default is None else default)
    rp = add("reproduce", cmd_reproduce, "the PR's measurements on this GPU, beside its figures and data/'s",
             out=False, reads=("quick", "record"))
    for p, default in ((parser, False), (rp, argparse.SUPPRESS)):
        p.add_argument("--quick", action="store_true", default=default,
                       help="the quick preset (minutes) instead of the full one")
        p.add_argument("--record", action="store_true", default=default,
                       help="write the live run into data/ instead of runs/")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv32ref", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd")

    def add(name, fn, help_, out=True, reads=()):
        """A command; `reads`: the top-level options (TOP_LEVEL) it reads besides --record (with out)."""
        p = sub.add_parser(name, help=help_)
        p.set_defaults(fn=fn, reads={*reads, "record"} if out else set(reads))
        if out:
            p.add_argument("--out", default=None, help="the result's path (default: runs/<UTC time>/<name>.json)")
            p.add_argument("--record", action="store_true", default=argparse.SUPPRESS,
                           help="write into data/, over the recorded result")
        return p

    _add_main_commands(parser, add)
    _add_model_commands(add)
    add("kernels", cmd_kernels, "the kernel benchmark (GPU)", reads=("quick",)).add_argument(
        "--quick", action="store_true", default=argparse.SUPPRESS)
    add("fp8-speed", cmd_fp8_speed, "the FP8 KV cache against bf16: sparse MLA decode, indexer scores (GPU)",
        reads=("quick",)).add_argument("--quick", action="store_true", default=argparse.SUPPRESS)
    add("fp8-accuracy", cmd_fp8_accuracy, "the FP8 KV cache against bf16 and float64 caches (CPU)"
        ).add_argument("--tokens", type=int, default=200, help="greedy tokens generated per arm")
    led = add("ledger", cmd_ledger, "launch ledger of each eager boundary")
    led.add_argument("--predict", action="store_true", help="predict on the CPU from the model structure")
    led.add_argument("--model", default="glm-5.2", choices=MODELS)
    led.add_argument("--measured", default=None, help="a TTFT run to put the TTFT model beside "
                     "(default: data/ttft_<model>.json)")
    t = add("ttft", cmd_ttft, "TTFT and measured ledger of each boundary (GPU)")
    t.add_argument("--model", default="glm-5.2", choices=MODELS)
    t.add_argument("--requests", type=int, default=256)
    t.add_argument("--warmup", type=int, default=8)
    t.add_argument("--tp", type=int, default=1, help="ranks (GPUs): tensor parallel attention/MLP, expert parallel MoE")
    for flag, default, what in TTFT_ARM_FLAGS:
        t.add_argument(flag, nargs="*", default=default, metavar="BOUNDARY", help=f"boundaries that also run {what}")
    t.add_argument("--instrument-ab", action="store_true",
                   help="also time wide, narrow and narrow_out with every profiler range open, interleaved")
    cm = add("capture", cmd_capture, "start-up and capture memory of each boundary (GPU)")
    cm.add_argument("--model", default="glm-5.2", choices=MODELS)
    cm.add_argument("--heads-per-rank", type=int, default=None,
                    help="attention heads on this GPU (e.g. 16: one rank of GLM-5.2 at TP4); default all")
    cm.add_argument("--no-threshold", action="store_true", help="skip the threshold check runs")
    cm.add_argument("--plan", default="default", choices=["default", "quick", "history"],
                    help="default: every boundary + threshold checks; quick: narrow_copy with and without the "
                         "graph-memory estimate; history: narrow_copy with the allocator's history")
    cm.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="fp8: FlashMLA's latent rows and DeepGEMM's indexer keys (EngineConfig.kv_cache_dtype)")
    return parser


# the top level's options, which no command is given or the commands that read them take, and their defaults
TOP_LEVEL = {"preset": None, "seed": 0, "quick": False, "record": False}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line, with summary's --preset after the command appended to those before it."""
    args = _parser().parse_args(argv)
    after = vars(args).pop("preset_after", [])
    args.preset = [*(args.preset or []), *after] or None
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    reads = getattr(args, "reads", set(TOP_LEVEL))  # no command: summary, then (GPU) reproduce
    unread = [f"--{n}" for n, default in TOP_LEVEL.items() if n not in reads and getattr(args, n) != default]
    if unread:
        print(f"dsv32ref: error: {', '.join(unread)}: {args.cmd} does not take it", file=sys.stderr)
        return 2
    try:
        return getattr(args, "fn", cmd_summary)(args)
    except ValueError as e:  # a value the experiment refuses (a count of 0, heads that do not divide): say it
        print(f"dsv32ref: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
