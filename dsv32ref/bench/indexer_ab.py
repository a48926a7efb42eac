"""The indexer (scores + top-k) of earlier commits against the library's, case by case in one run.

    python -m dsv32ref.bench.indexer_ab --base REV [--base REV ...] --out data/indexer_ab.json [--probe]
    python -m dsv32ref.bench.indexer_ab --tune --out data/indexer_tune.json

Each REV's dsv32ref/kernels/indexer_topk.py is read with `git show` and imported beside the library's. Every
indexer case of the kernel benchmark (kernels.INDEXER_CASES, both models) is measured with each, one after
the other on the same inputs: the same key-cache copies rotating through HBM, the same ceilings, the lean
PyTorch path timed once per case. "No slower than before" is then a same-run comparison, not one against a
file measured another day. --probe adds two of the library's knobs (tokens per program, chained launches) and
what a kernel that only reads one decode token's keys takes (the read floor). --tune times the scores pass alone
at tile counts and pipeline depths around the default, the run behind scores_tiles and scores_stages.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from dsv32ref.bench.kernels import (INDEXER_CASES, bench_indexer, bench_read_floor, measure_ceilings, shapes,
                                    start_run)
from dsv32ref.kernels import grid
from dsv32ref.kernels.indexer_topk import scores_tiles, scores_tokens
from dsv32ref.results import write_partial, write_result

MODULE = "dsv32ref/kernels/indexer_topk.py"
REPO = Path(__file__).resolve().parents[2]  # the checkout (git runs there, wherever the command runs)

# the library's knobs: (model, (tokens, context), scores kwargs, top-k kwargs); no top-k kwargs = scores alone
_DS, _GLM = "deepseek-v3.2", "glm-5.2"
PROBE = ([(m, (T, ctx), dict(tokens=g), {}) for m in (_DS, _GLM) for T, ctx in ((64, 4096), (256, 32768), (1024, 4096))
          for g in ((1, 2, 4) if m == _DS else (1, 2, 4, 8))]
         + [(m, (T, ctx), {}, dict(pdl=pdl)) for m in (_DS, _GLM) for T, ctx in ((16, 4096), (1, 131072))
            for pdl in (True, False)])
READ_FLOOR_BYTES = (2 * 128 * 32768, 2 * 128 * 131072)  # one decode token's keys at 32k and 128k


def tune_configs(z: dict, T: int, ctx: int, sms: int) -> list[dict]:
    """--tune: the scores pass of one case at the default tile count t, and at 2t (t/2 at the most, 16), each
    pipelined 2 and 3 deep (1 and 2 for a single tile, which has nothing to overlap)."""
    t0 = scores_tiles(triton.cdiv(T, scores_tokens(T, z["h_i"])), ctx, 64, sms)
    return [dict(tiles=t, num_stages=st) for t in ((8, 16) if t0 == 16 else (t0, 2 * t0))
            for st in ((1, 2) if t == 1 else (2, 3))]


def load_revision(rev: str):
    """(full sha, the module MODULE was at rev), imported from a temporary file (Triton reads its source). Its
    imports resolve against today's package: a revision that needs a helper since renamed fails here."""
    git = dict(cwd=REPO, check=True, capture_output=True, text=True)
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], **git).stdout.strip()
    src = subprocess.run(["git", "show", f"{sha}:{MODULE}"], **git).stdout
    path = Path(tempfile.mkdtemp()) / f"indexer_topk_{sha[:12]}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:
        raise ImportError(f"indexer_ab: {MODULE} at {sha[:12]} imports what today's package lacks: {e}") from e
    return sha, mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", action="append", default=[], help="an earlier revision to compare (repeatable)")
    ap.add_argument("--out", default="data/indexer_ab.json")
    ap.add_argument("--probe", action="store_true", help="also the library's knobs (PROBE) and the read floor")
    ap.add_argument("--probe-only", action="store_true", help="only the probe")
    ap.add_argument("--tune", action="store_true", help="only the scores pass of every case at a few tile counts "
                    "and pipeline depths around the default (tune_configs)")
    args = ap.parse_args(argv)
    if (run := start_run()) is None:
        return 2
    t_start, prov = run
    impls = list(map(load_revision, args.base)) + [("library", None)]
    ceil = measure_ceilings()
    ceil_runs = [dict(ceil, when="start")]
    results = []

    def save(complete: bool = False):
        out = {"provenance": prov, "ceilings": ceil, "ceilings_measured": ceil_runs, "module": MODULE,
               "implementations": [name for name, _ in impls], "results": results, "wall_s": time.time() - t_start}
        (write_result if complete else write_partial)(args.out, out)

    sms = grid.num_sms(torch.device("cuda"), None, "indexer_ab")
    for z in ((shapes(_DS), shapes(_GLM)) if args.tune else ()):
        for ctx, T in INDEXER_CASES:
            for kw in tune_configs(z, T, ctx, sms):
                r = bench_indexer(z, T, ctx, ceil, torch_path=False, scores_kw=kw, scores_only=True)
                r.update(implementation="library", probe="tune")
                results.append(r)
                print(f"tune {z['name']} T={T} ctx={ctx} {kw}: scores {r['ms_scores'] * 1e3:.1f} us "
                      f"({r['scores_fraction_of_copy']:.0%} of copy) ok={r['ok']}", flush=True)
                save()
    for z in ([] if args.probe_only or args.tune else (shapes(_DS), shapes(_GLM))):
        for ctx, T in INDEXER_CASES:
            for i, (name, mod) in enumerate(impls):  # the lean PyTorch path once, with the first
                r = bench_indexer(z, T, ctx, ceil, torch_path=i == 0, impl=mod)
                r["implementation"] = name
                results.append(r)
                print(f"{z['name']} T={T} ctx={ctx} {name[:12]}: {r['ms'] * 1e3:.1f} us (scores {r['ms_scores'] * 1e3:.1f}, "
                      f"{r['scores_fraction_of_copy']:.0%} of copy; top-k {r['ms_topk'] * 1e3:.1f})"
                      + (f"; lean {r['torch_ms'] * 1e3:.1f}" if r.get("torch_ms") else "") + f" ok={r['ok']}", flush=True)
                save()
    if args.probe or args.probe_only:
        for m, (T, ctx), skw, tkw in PROBE:
            r = bench_indexer(shapes(m), T, ctx, ceil, torch_path=False, scores_kw=skw, topk_kw=tkw, scores_only=not tkw)
            r.update(implementation="library", probe="knobs")
            results.append(r)
            print(f"probe {m} T={T} ctx={ctx} {skw} {tkw}: scores {r['ms_scores'] * 1e3:.1f} us "
                  f"({r['scores_fraction_of_copy']:.0%} of copy)"
                  + (f", top-k {r['ms_topk'] * 1e3:.1f} us, both {r['ms'] * 1e3:.1f} us" if tkw else "")
                  + f" ok={r['ok']}", flush=True)
            save()
        for nbytes in READ_FLOOR_BYTES:
            results.append(r := dict(bench_read_floor(nbytes, ceil), ok=True))
            print(f"read floor {nbytes / 1e6:.1f} MB: {r['ms'] * 1e3:.1f} us ({r['fraction_of_copy']:.0%} of copy) "
                  f"{r['block']}x{r['tiles']}, {r['num_warps']} warps", flush=True)
            save()
    end = measure_ceilings()  # as the kernel benchmark: fractions of the higher copy rate of start and end
    ceil_runs.append(dict(end, when="end"))
    ceil = dict(ceil, copy_GBps=max(ceil["copy_GBps"], end["copy_GBps"]))
    for r in results:
        if r["kernel"] == "read_floor":
            r["fraction_of_copy"] = r["GBps"] / ceil["copy_GBps"]
        for part in ("scores", "topk"):
            if f"{part}_GBps" in r:
                r[f"{part}_fraction_of_copy"] = r[f"{part}_GBps"] / ceil["copy_GBps"]
    save(complete=True)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
