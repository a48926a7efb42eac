"""Predict a variant's TTFT from its CPU-predicted launch ledger, the host costs measured on the GPU in the TTFT
run's process (dsv32ref.experiments.host_costs) and its GPU-busy floor.

A prefill step is the host's work before the first launch, the forward, then the read-back. The forward is a
pipeline of layers: the host launches layer l (its graph segment and its eager region) while the GPU runs what
it was given, so each layer takes the longer of the two; the GPU starts a graph's first kernels while the host
is still launching its later nodes, so a launch is charged to the layer whose nodes it submits:

    TTFT     = stage + first graph launch + sum over layers of max(host_l, gpu_l) + sync
    gpu_l    = (floor + kernels launched inside graphs x in_graph_gap_us) / layers
    host_l   = the layer's eager region + the launch of the graph segment after it, either
               measured: the region's host time timed in replay (`regions`, per-region host costs), or
               from launches: the ledger's direct launches of the layer x their per-launch costs
               (gemm_launch_us, aten_launch_us, memcpy_us, the Triton launcher's wrapper_us charged to its
               first kernel) + eager_region_us + graph_node_us per kernel of the segment
    first graph launch = graph_launch_us + graph_node_us x the first layer's kernels

The two host_l differ by the Python the model runs between launches inside a region (slicing, views,
allocations, the forward context): "from launches" leaves it out. The launches after the forward (logits,
sampling) overlap the graph and are not charged; the floor spreads evenly over the layers (it does not: the
layers that run their indexer do more); kernels one op launches beyond the first (cuBLAS split-K, aten's
top-k) are not counted as graph kernels.
"""

from __future__ import annotations

import math

from dsv32ref.checks import is_int, is_number
from dsv32ref.experiments.host_costs import WRAPPER_KERNELS
from dsv32ref.results import read_result

_CHARGED = {kernels[0]: name for name, kernels in WRAPPER_KERNELS.items()}
_FREE = {k for kernels in WRAPPER_KERNELS.values() for k in kernels[1:]}


def launch_cost_us(op: str, costs: dict) -> float:
    """Host cost of one predicted launch `op` ("aten::mm", "aten::copy_ (memcpy)", "triton::_fused_q_kernel")."""
    if op.endswith("(memcpy)"):
        return costs["memcpy_us"]
    if op.startswith("triton::"):
        kernel = op[len("triton::"):]
        if kernel in _FREE:
            return 0.0
        return costs["wrapper_us"][_CHARGED[kernel]]
    if op in GEMMS:
        return costs["gemm_launch_us"]
    return costs["aten_launch_us"]


GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul"}


def predict(predicted: dict, costs: dict, floor_ms: float, regions: dict | None = None) -> dict:
    """`predicted`: one variant of ledger.predict_all's result (with "layers"); `regions`: that boundary's
    measured replay entries (host_costs "regions"), or None to price the layers from their launches."""
    layers = predicted["layers"]
    L = len(layers)
    graph_kernels = sum(layer["graph"] for layer in layers)
    for region, kinds in predicted["ops"].items():  # launches in graphs outside the layers (embedding)
        if region == "embed":
            graph_kernels += sum(kinds.get("graph", {}).values())
    gpu_total = floor_ms + graph_kernels * costs["in_graph_gap_us"] / 1e3
    gpu_l = gpu_total / L
    segments = predicted["graph_launches"]
    regions_n = predicted["eager_regions"]
    per_layer_regions = regions_n / L
    host_from_launches = []
    for layer in layers:
        us = sum(n * launch_cost_us(op, costs) for op, n in layer["direct"].items())
        us += per_layer_regions * costs["eager_region_us"] + layer["graph"] * costs["graph_node_us"]
        host_from_launches.append(us / 1e3)
    measured = regions is not None and "eager_us" in regions and len(regions["eager_us"]) == L
    if measured:
        host = [(e + g) / 1e3 for e, g in zip(regions["eager_us"], regions["graph_us"][1:])]
        first = regions["graph_us"][0] / 1e3
    else:
        host = host_from_launches
        # the GPU starts on a graph's first kernels while the host still submits the rest: only the first
        # layer's nodes are charged
        first = (costs["graph_launch_us"] + layers[0]["graph"] * costs["graph_node_us"]) / 1e3 if segments else 0.0
    forward = sum(max(h, gpu_l) for h in host)
    fixed = {"stage_ms": costs["stage_us"] / 1e3, "first_launch_ms": first, "sync_ms": costs["sync_us"] / 1e3}
    host_bound = sum(h > gpu_l for h in host)
    return {"fixed": fixed, "forward_ms": forward, "host_forward_ms": sum(host),
            "host_forward_from_launches_ms": sum(host_from_launches), "gpu_forward_ms": gpu_total,
            "floor_ms": floor_ms, "in_graph_gaps_ms": gpu_total - floor_ms, "graph_kernels": int(graph_kernels),
            "host_bound_layers": host_bound, "layers": L, "host_source": "measured regions" if measured else "launches",
            "bound": "host" if host_bound > L / 2 else "gpu", "eager_regions": regions_n,
            "ttft_ms": sum(fixed.values()) + forward}


def compare(predicted_ledger: dict, ttft_result: dict, costs: dict | None = None) -> dict:
    """The model for every variant measured in `ttft_result` (a data/ttft_<model>.json) beside its mean and
    median TTFT; `costs`: the host costs to price it with (the TTFT run's own by default). The miss in percent
    of the measured mean and of the median (the mean carries the host's slow tail, which the model does not).
    The two must be of one preset and prompt length (another's ledger modelled the run silently)."""
    for key, have, want in (("preset", predicted_ledger.get("preset"), ttft_result.get("preset")),
                            ("prompt_len", predicted_ledger.get("prompt_len"),
                             (ttft_result.get("protocol") or {}).get("prompt_len"))):
        if have != want:
            raise ValueError(f"compare: the predicted ledger's {key} is {have!r}, the TTFT run's {want!r}")
    costs = costs or ttft_result["host_costs"]
    out = {}
    for v, meas in ttft_result["variants"].items():
        if v not in predicted_ledger["variants"]:
            continue
        p = predict(predicted_ledger["variants"][v], costs, meas["ledger"]["gpu_busy_ms"],
                    (costs.get("regions") or {}).get(v))
        p["measured_ttft_ms"], p["measured_median_ms"] = meas["mean_ms"], meas["median_ms"]
        p["miss_pct"] = 100 * (p["ttft_ms"] - meas["mean_ms"]) / meas["mean_ms"]
        p["miss_median_pct"] = 100 * (p["ttft_ms"] - meas["median_ms"]) / meas["median_ms"]
        out[v] = p
    return out


_COSTS_US = ("aten_launch_us", "eager_region_us", "gemm_launch_us", "graph_launch_us", "graph_node_us",
             "in_graph_gap_us", "memcpy_us", "stage_us", "sync_us")  # the host costs the model prices launches with


def load_ttft_result(path: str, preset: str | None = None) -> dict:
    """A TTFT run's file (`dsv32ref ttft`'s JSON), checked for what the model reads, and (preset) that it measured
    that model: ValueError naming the file and what is wrong (a wrong file fails here, before the prediction's
    minutes)."""
    run = read_result(path)
    if run is None:
        raise ValueError(f"{path!r}: no such file (a TTFT result: `dsv32ref ttft`'s file)")
    missing = [k for k in ("provenance", "host_costs", "variants") if k not in run]
    if missing:
        raise ValueError(f"{path!r}: not a TTFT result (`dsv32ref ttft`'s file): it has no {', '.join(missing)}")
    if preset is not None and run.get("preset") != preset:
        raise ValueError(f"{path!r}: a TTFT run of {run.get('preset')!r}, the prediction is of {preset!r}")
    for key in ("provenance", "host_costs", "variants"):
        if not isinstance(run[key], dict):
            raise ValueError(f"{path!r}: {key}: expected an object, got {type(run[key]).__name__}")
    prompt_len = (run.get("protocol") if isinstance(run.get("protocol"), dict) else {}).get("prompt_len")
    if not (is_int(prompt_len) and prompt_len >= 1):
        raise ValueError(f"{path!r}: protocol.prompt_len: expected an int >= 1 (the prompt the run measured), got "
                         f"{prompt_len!r}")
    costs = run["host_costs"]
    wrappers = costs.get("wrapper_us") if isinstance(costs.get("wrapper_us"), dict) else {}
    bad = [k for k in _COSTS_US if not _duration(costs.get(k))] + [
        f"wrapper_us.{k}" for k in WRAPPER_KERNELS if not _duration(wrappers.get(k))]
    if bad:
        raise ValueError(f"{path!r}: host_costs: expected finite numbers >= 0 (microseconds) for {', '.join(bad)}")
    _check_regions(path, costs.get("regions"))
    for v, meas in run["variants"].items():
        led = meas.get("ledger") if isinstance(meas, dict) else None
        if not (isinstance(led, dict) and _duration(led.get("gpu_busy_ms"))
                and all(_duration(meas.get(k)) and meas[k] > 0 for k in ("mean_ms", "median_ms"))):
            raise ValueError(f"{path!r}: variants[{v!r}]: expected mean_ms and median_ms > 0 and ledger.gpu_busy_ms "
                             f">= 0, finite numbers")
    return run


def _check_regions(path: str, regions) -> None:
    """host_costs.regions (what `predict` takes as each layer's measured host time): absent, or per variant an
    object whose eager_us (one per layer) and graph_us (one more: the segments around them) are lists of durations."""
    if regions is None:
        return
    if not isinstance(regions, dict):
        raise ValueError(f"{path!r}: host_costs.regions: expected an object, got {type(regions).__name__}")
    for v, r in regions.items():
        eager, graph = (r.get("eager_us"), r.get("graph_us")) if isinstance(r, dict) else (None, None)
        if not (isinstance(eager, list) and isinstance(graph, list) and len(graph) == len(eager) + 1
                and all(_duration(x) for x in eager + graph)):
            lists = isinstance(eager, list) and isinstance(graph, list)
            got = (type(r).__name__ if not lists else f"lists of {len(eager)} and {len(graph)}"
                   if len(graph) != len(eager) + 1 else f"{next(x for x in eager + graph if not _duration(x))!r}")
            raise ValueError(f"{path!r}: host_costs.regions[{v!r}]: expected eager_us and graph_us, lists of finite "
                             f"numbers >= 0 (microseconds), graph_us one longer, got {got}")


def _duration(v) -> bool:
    """A measured time: a finite number >= 0."""
    return is_number(v) and math.isfinite(v) and v >= 0


def attach(predicted: dict, measured_path: str, run: dict) -> dict:
    """Put the model of every variant of a TTFT run (`run`, load_ttft_result of measured_path, e.g.
    data/ttft_<preset>.json: its measurement and the host costs it measured in its own process) beside the
    predicted ledger, under "ttft_model"; returns `predicted`."""
    predicted["ttft_model"] = {"measured": measured_path, "measured_commit": run["provenance"].get("git_commit"),
                               "host_costs": run["host_costs"], "variants": compare(predicted, run)}
    for v, m in predicted["ttft_model"]["variants"].items():
        print(f"  model {v:<18} {m['ttft_ms']:.2f} ms predicted, {m['measured_ttft_ms']:.2f} measured "
              f"({m['miss_pct']:+.1f} %), {m['bound']}-bound", flush=True)
    return predicted
