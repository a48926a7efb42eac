"""The library of another revision beside this tree's, probe by probe, in alternating processes (GPU).

    git archive REV dsv32ref | tar -x -C DIR        # a copy of the package at REV (echo REV > DIR/REVISION)
    python scripts/ab_package.py --against DIR [DIR ...]
        [--probes sparse_mla route add_rms_norm sparse_mla_fp8 indexer_fp8 sparse_mla_prefill] [--rounds 2]
        [--out F.json]

Each probe runs in a process of its own with one arm's package first on its path: this tree's, then each copy's,
round after round (the order rotating), so that a change is timed against what it replaces under the same drift
and no arm inherits another's compiled kernels or allocator. A probe times the library's public launchers at the
engine's shapes by CUDA-graph replay (medians) and first checks what it times against a float64 reference, per
element (dsv32ref.testing.compare): `ok` beside every time. A worker that imported another package than its arm's
is an error. The table gives each case's median over the rounds and each copy's time over the tree's.
`python -m` and `python -c` would put the working directory first on the path, which is why the workers are this
file run as a script (its own folder first: no package there).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# "where": which package an arm imports (no GPU)
PROBES = ("sparse_mla", "route", "add_rms_norm", "sparse_mla_fp8", "indexer_fp8", "sparse_mla_prefill", "where")
MAX_ROUNDS = 100  # each round runs every probe in every arm, a process each


def arms(against: list[str]) -> dict[str, pathlib.Path]:
    """name -> the folder holding its dsv32ref: "tree" for this checkout, then each copy by its folder's name."""
    out = {"tree": ROOT}
    for path in against:
        folder = pathlib.Path(path).resolve()
        if not (folder / "dsv32ref" / "__init__.py").is_file():
            raise ValueError(f"--against {path}: expected a folder holding a copy of the package (dsv32ref/__init__.py)"
                             f", found none")
        if folder.name in out or folder == ROOT:
            raise ValueError(f"--against {path}: the arm {folder.name!r} is taken; name the folder otherwise")
        out[folder.name] = folder
    return out


def revision(folder: pathlib.Path) -> str:
    """The copy's REVISION file, or "working tree" for this checkout."""
    file = folder / "REVISION"
    return file.read_text().strip() if file.is_file() else "working tree" if folder == ROOT else "unknown"


def schedule(names: list[str], probes: list[str], rounds: int) -> list[tuple[str, str]]:
    """(arm, probe) in running order: per round and probe every arm once, the arms' order rotating by round."""
    if not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"--rounds: expected an int in [1, {MAX_ROUNDS}], got {rounds!r}")
    unknown = sorted(set(probes) - set(PROBES))
    if unknown or not probes or len(set(probes)) != len(probes):
        raise ValueError(f"--probes: expected some of {list(PROBES)}, each once, got {probes!r}")
    return [(names[(i + r) % len(names)], p) for r in range(rounds) for p in probes for i in range(len(names))]


def run_worker(folder: pathlib.Path, probe: str) -> dict:
    """One probe in a process of its own, `folder`'s package first on its path -> its JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, __file__, "--worker", probe], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"probe {probe} under {folder}: exit {done.returncode}\n{done.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if not pathlib.Path(result["package"]).is_relative_to(folder / "dsv32ref"):
        raise RuntimeError(f"probe {probe} under {folder}: the worker imported {result['package']}, not that copy")
    return result


def summarise(runs: list[dict]) -> dict:
    """{probe: {case: {arm: {"us": median over rounds, "ok": every round's check, "over_tree": us / tree's}}}}."""
    table: dict = {}
    for r in runs:
        for case, (us, ok) in r["cases"].items():
            table.setdefault(r["probe"], {}).setdefault(case, {}).setdefault(r["arm"], []).append((us, ok))
    for cases in table.values():
        for case, by_arm in cases.items():
            cases[case] = {arm: {"us": statistics.median(u for u, _ in xs), "ok": all(ok for _, ok in xs)}
                           for arm, xs in by_arm.items()}
            for row in cases[case].values():
                row["over_tree"] = row["us"] / cases[case]["tree"]["us"] if "tree" in cases[case] else None
    return table


# ---- the probes (run in the workers, against whichever package comes first on the path) ----

def _graph_us(calls, replays: int = 30) -> float:
    """Median microseconds of one call, replayed from a CUDA graph of all `calls` in turn. The script's own timer,
    not an arm's bench.kernels.bench_graph: every arm is timed by the same instrument, whatever its revision holds."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[0]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(replays + 5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times[5:])


def _matches(out, lse, ref, ref_lse) -> bool:
    """sparse_mla's out and lse against the float64 reference, per element (out: 2 units of bf16 of the element
    and of its row's largest; lse: fp32's sum of exponentials, 1e-4 absolute, where one key of 2048 left out moves
    it by about 5e-4)."""
    import torch
    from dsv32ref.testing import compare

    return bool(compare("out", out, ref, dtype=torch.bfloat16, row_dims=2)) and \
        (lse.double() - ref_lse).abs().max().item() <= 1e-4


def probe_sparse_mla() -> dict:
    """sparse_mla_paged (valid-first top-k) at 8-token prompts of 8 and 2048 keys and decode batches, both models."""
    import torch
    from dsv32ref.bench.kernels import BLOCK_SIZE, decode_batch, one_request, shapes, slots_of
    from dsv32ref.kernels import sparse_mla_paged
    from dsv32ref.reference import sparse_mla

    cases = {}
    for model in ("glm-5.2", "deepseek-v3.2"):
        z = shapes(model)
        for kind, T, ctx in (("prefill", 8, 8), ("prefill", 8, 2048), ("decode", 8, 4096), ("decode", 1, 32768)):
            r = decode_batch(T, ctx) if kind == "decode" else one_request(ctx, T)
            cache = torch.randn(r["nblocks"], BLOCK_SIZE, 576, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(T, z["H"], 576, device="cuda", dtype=torch.bfloat16)
            visible = r["positions"] + 1
            slots = torch.arange(z["k"], device="cuda")[None, :]
            topk = torch.where(slots < visible[:, None], (torch.rand(T, z["k"], device="cuda") * visible[:, None])
                               .long(), -1).int()  # valid entries first, -1 after
            out = torch.full((T, z["H"], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.full((T, z["H"]), float("nan"), device="cuda")
            scale = z["config"].softmax_scale

            def call(q=q, cache=cache, r=r, topk=topk, out=out, lse=lse, scale=scale):
                sparse_mla_paged(q, cache, r["block_table"], r["req"], r["seq_lens"], topk, scale, out, lse,
                                 valid_first=True)

            call()
            slots = torch.where(topk >= 0, slots_of(r["block_table"], topk.long().clamp_min(0), r["req"]), -1)
            ref, ref_lse = sparse_mla(q.double(), cache.view(-1, 576).double(), slots.int(), scale, 512)  # float64
            cases[f"{model} {kind} T{T} ctx{ctx}"] = (_graph_us([call] * 10), _matches(out, lse, ref, ref_lse))
    return cases


def probe_sparse_mla_fp8() -> dict:
    """sparse_mla_paged decode over FlashMLA's FP8 rows at 16, 64 and 128 heads (GLM-5.2's sizes): 64 requests of
    one token at a 32k context, each selecting 2048 distinct rows (bench.fp8's inputs, whose bf16 cache holds the
    dequantised rows: the float64 reference runs over it)."""
    import torch
    from dsv32ref.bench.fp8 import decode_calls, decode_inputs
    from dsv32ref.bench.kernels import shapes, slots_of
    from dsv32ref.reference import sparse_mla

    z = shapes("glm-5.2")
    r = decode_inputs(z, 64, 32768)
    slots = slots_of(r["block_table"], r["topk"].long(), r["req"]).int()
    rows = r["caches"][0][0].view(-1, z["d_lat"] + z["rope"]).double()  # the FP8 rows' values, as bf16
    cases = {}
    for H in (16, 64, 128):
        q, calls, outs, lses = decode_calls(z, r, H)  # each arm run once on poisoned outputs
        ref, ref_lse = sparse_mla(q.double(), rows, slots, z["config"].softmax_scale, z["d_lat"])
        cases[f"glm-5.2 decode fp8 B64 ctx32768 H{H}"] = (_graph_us([calls["fp8"]] * 4),
                                                         _matches(outs["fp8"], lses["fp8"], ref, ref_lse))
    return cases


def _indexer_row_ok(scores, cache, block_table, q8, w, i: int, d: int) -> bool:
    """Request i's scores (its keys dequantised from the cache through its block-table row) against the float64
    reference, within 2^-13 of its terms' scale (the sum of their magnitudes)."""
    from dsv32ref.reference import indexer_scores
    from dsv32ref.reference.fp8_cache import dequantize_indexer_keys

    keys = dequantize_indexer_keys(cache[block_table[i].long()].unsqueeze(2)).reshape(-1, d).double()
    ref = indexer_scores(q8[i:i + 1].double(), keys, w[i:i + 1].double(), d ** -0.5)[0]
    terms = indexer_scores(q8[i:i + 1].double().abs(), keys.abs(), w[i:i + 1].double().abs(), d ** -0.5)[0]
    return bool(((scores[i].double() - ref[: scores.shape[1]]).abs() <= 2 ** -13 * terms[: scores.shape[1]]).all())


def probe_indexer_fp8() -> dict:
    """indexer_scores_paged at decode over DeepGEMM's FP8 keys with fp8 queries (bench.fp8's inputs), its default
    tiles, both models: requests of one token at 32k and 128k keys each, the first and the last request checked
    against the float64 reference (within 2^-13 of its terms' scale, the fp8 MMA's accumulation)."""
    import torch
    from dsv32ref.bench.fp8 import copies_for, key_caches
    from dsv32ref.bench.kernels import BLOCK_SIZE, decode_batch, shapes
    from dsv32ref.kernels.indexer_topk import indexer_scores_paged
    from dsv32ref.reference.numerics import fp8_quantize

    cases = {}
    for model in ("glm-5.2", "deepseek-v3.2"):
        d, h = shapes(model)["d_i"], shapes(model)["h_i"]
        for B, ctx in ((128, 131072), (64, 131072), (128, 32768), (16, 32768)):
            r = decode_batch(B, ctx)
            caches = [key_caches(r["nblocks"] * BLOCK_SIZE, d)[1]
                      for _ in range(copies_for(r["nblocks"] * BLOCK_SIZE * (d + 4)))]
            q8, q_scale = fp8_quantize(torch.randn(B, h, d, device="cuda"), block=d)
            w = torch.randn(B, h, device="cuda") * h ** -0.5 * q_scale[..., 0]
            scores = torch.full((B, ctx), float("nan"), device="cuda")
            calls = [lambda c=c: indexer_scores_paged(q8, w, c, r["block_table"], r["req"], r["positions"],
                                                      d ** -0.5, scores, tokens=1) for c in caches]
            calls[0]()
            ok = all(_indexer_row_ok(scores, caches[0], r["block_table"], q8, w, i, d) for i in (0, B - 1))
            cases[f"{model} decode fp8 keys B{B} ctx{ctx}"] = (_graph_us(calls * max(1, 4 // len(calls))), ok)
            del caches, calls
            torch.cuda.empty_cache()
    return cases


def probe_route() -> dict:
    """route_kernel at 1, 8 and 16 tokens, both models, over 16 copies of the router's fp32 weight (past the L2)."""
    import torch
    from dsv32ref.config import ModelConfig
    from dsv32ref.kernels.fused_moe import route_kernel
    from dsv32ref.reference.moe import route
    from dsv32ref.testing import compare

    cases = {}
    for model in ("glm-5.2", "deepseek-v3.2"):
        c = ModelConfig.preset(model)
        E, hidden, k = c.n_routed_experts, c.hidden_size, c.num_experts_per_tok
        weights = [torch.randn(E, hidden, device="cuda") * hidden ** -0.5 for _ in range(16)]
        bias = torch.randn(E, device="cuda") * 0.01
        for T in (1, 8, 16):
            x = torch.randn(T, hidden, device="cuda").to(torch.bfloat16)
            ids = torch.full((T, k), -7, dtype=torch.int32, device="cuda")
            w = torch.full((T, k), float("nan"), device="cuda")
            route_kernel(c, x, weights[0], bias, ids, w)
            ref_ids, ref_w = route(c, x.double(), weights[0].double(), bias.double())
            ok = torch.equal(ids.long(), ref_ids) and bool(compare("weights", w, ref_w, dtype=torch.float32, rtol=16,
                                                                   atol=16))
            calls = [lambda c=c, x=x, wt=wt, bias=bias, ids=ids, w=w: route_kernel(c, x, wt, bias, ids, w)
                     for wt in weights]
            cases[f"{model} T{T}"] = (_graph_us(calls), ok)
    return cases


def probe_add_rms_norm() -> dict:
    """add_rms_norm at 1, 8, 1024 and 8192 tokens of hidden 6144 (GLM-5.2) and 7168 (DeepSeek-V3.2)."""
    import torch
    from dsv32ref.checks import rel_err
    from dsv32ref.kernels import add_rms_norm
    from dsv32ref.reference import rms_norm

    cases = {}
    for hidden in (6144, 7168):
        for T in (1, 8, 1024, 8192):
            x, res = (torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
            out, res_out = (torch.full_like(x, float("nan")) for _ in range(2))

            def call(x=x, res=res, weight=weight, out=out, res_out=res_out):
                add_rms_norm(x, res, weight, 1e-6, out, res_out)

            call()
            h = x.double() + res.double()
            ok = rel_err(out, rms_norm(h, weight.double(), 1e-6)) <= 1e-2 and rel_err(res_out, h) <= 1e-2
            cases[f"hidden{hidden} T{T}"] = (_graph_us([call] * 20), ok)
    return cases


def probe_sparse_mla_prefill() -> dict:
    """sparse_mla_paged over one 32k-token request's last 512-8192 tokens (2048 random visible keys each, repeats
    possible: the kernel benchmark's rows), both models, checked per element against the float64 reference in
    chunks of tokens; and a bf16 GEMM of 8192^3 timed in the same process: the ceiling to read its rate against
    (2 T H 2048 (576 + 512) FLOPs a call)."""
    import torch
    from dsv32ref.bench.kernels import BLOCK_SIZE, one_request, shapes, slots_of
    from dsv32ref.kernels import sparse_mla_paged
    from dsv32ref.reference import sparse_mla

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    cases = {"gemm 8192^3": (_graph_us([lambda: torch.mm(a, b, out=c)] * 4, replays=10), True)}
    del a, b, c
    for model, sizes in (("glm-5.2", (512, 2048, 8192)), ("deepseek-v3.2", (512, 2048))):
        z = shapes(model)
        for T in sizes:
            r = one_request(32768, T)
            cache = torch.randn(r["nblocks"], BLOCK_SIZE, 576, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(T, z["H"], 576, device="cuda", dtype=torch.bfloat16)
            topk = (torch.rand(T, z["k"], device="cuda") * (r["positions"] + 1)[:, None]).long().int()
            out = torch.full((T, z["H"], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.full((T, z["H"]), float("nan"), device="cuda")
            scale = z["config"].softmax_scale

            def call(q=q, cache=cache, r=r, topk=topk, out=out, lse=lse, scale=scale):
                sparse_mla_paged(q, cache, r["block_table"], r["req"], r["seq_lens"], topk, scale, out, lse)

            call()
            slots = slots_of(r["block_table"], topk.long(), r["req"]).int()
            rows, ok = cache.view(-1, 576).double(), True
            for t0 in range(0, T, 128):  # the float64 gathers of 128 tokens: about 2.4 GB at the peak
                sl = slice(t0, t0 + 128)
                ref, ref_lse = sparse_mla(q[sl].double(), rows, slots[sl], scale, 512)
                ok = ok and _matches(out[sl], lse[sl], ref, ref_lse)
            cases[f"{model} T{T}"] = (_graph_us([call] * 2, replays=10), ok)
    return cases


def probe_where() -> dict:
    """No case: the worker's line names the package it imported (a dry run of the arms)."""
    return {}


def worker(probe: str) -> None:
    import torch

    import dsv32ref

    if probe not in PROBES:
        raise ValueError(f"--worker: expected one of {list(PROBES)}, got {probe!r}")
    torch.manual_seed(0)
    cases = globals()[f"probe_{probe}"]()
    print(json.dumps({"probe": probe, "package": dsv32ref.__file__, "cases": cases}), flush=True)


def check_out(out: str | None) -> None:
    """--out names a file this process can write (in a folder that exists), or is not given."""
    if out is None:
        return
    path = pathlib.Path(out)
    if not out or out.endswith(os.sep) or path.is_dir():
        raise ValueError(f"--out: expected a file path, got {out!r}")
    if not path.resolve().parent.is_dir() or not os.access(path.resolve().parent, os.W_OK):
        raise ValueError(f"--out: no writable folder {str(path.resolve().parent)!r} for {out!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", nargs="+", default=[], metavar="DIR")
    ap.add_argument("--probes", nargs="+", default=list(PROBES[:4]))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    try:  # every argument, the result's path too, before the first probe runs
        folders = arms(args.against)
        order = schedule(list(folders), args.probes, args.rounds)
        check_out(args.out)
    except ValueError as e:
        ap.error(str(e))
    runs = []
    for arm, probe in order:
        r = run_worker(folders[arm], probe)
        runs.append(dict(r, arm=arm))
        print(f"{arm:<12} {probe:<13} {r['package']}", flush=True)
    table = summarise(runs)
    for probe, cases in table.items():
        for case, by_arm in cases.items():
            print(f"{probe:<13} {case:<36} " + "  ".join(
                f"{arm} {row['us']:8.2f} us{'' if row['ok'] else ' (WRONG)'}" +
                (f" x{row['over_tree']:.3f}" if arm != "tree" else "") for arm, row in by_arm.items()))
    if args.out:
        sys.path.insert(0, str(ROOT))
        from dsv32ref.provenance import provenance

        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "arms": {a: revision(p) for a, p in folders.items()},
                       "rounds": args.rounds, "runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
