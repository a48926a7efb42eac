"""Predict a variant's TTFT from its CPU-predicted launch ledger, the host costs measured once on the GPU
(dsv32ref.experiments.host_costs) and its GPU-busy floor.

A prefill step is the host's work before the first launch, then the forward, then the read-back:

    TTFT = stage + max(host_forward, gpu_forward) + sync
    host_forward = sum over the forward's direct launches of their cost (gemm_launch_us for mm / bmm,
                   aten_launch_us for other aten ops, memcpy_us, or the Triton launcher's wrapper_us, charged
                   to its first kernel) + eager regions x eager_region_us (which includes the next segment's
                   graph launch) + the first graph launch + graph_node_us per kernel captured in graphs
    gpu_forward  = floor + kernels launched inside graphs x in_graph_gap_us

The forward is whichever of host and GPU is slower: when the host launches faster than the GPU runs, the
queue hides the host (boundary "none", one graph launch); when it is slower, the GPU waits on it (wide). The
launches after the forward (logits, sampling) overlap the graph and are not charged. What the model leaves
out: Python in the model between launches (slicing, the forward context), layers where host and GPU take
turns being the slower one (the max is taken over the whole forward, not per layer), kernels one op launches
beyond the first (cuBLAS split-K, aten's top-k).
"""

from __future__ import annotations

from dsv32ref.experiments.host_costs import WRAPPER_KERNELS

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


def predict(predicted: dict, costs: dict, floor_ms: float) -> dict:
    """`predicted`: one variant of ledger.predict_all's result; returns each term in ms and the TTFT."""
    direct_us = graph_kernels = 0.0
    for region, kinds in predicted["ops"].items():
        if region == "other":  # after the forward: overlapped with the graph (the upload is in stage)
            continue
        for op, n in kinds.get("direct", {}).items():
            direct_us += n * launch_cost_us(op, costs)
        graph_kernels += sum(n for op, n in kinds.get("graph", {}).items() if not op.endswith("(memcpy)"))
    graphs = predicted["graph_launches"]
    regions = max(graphs - 1, 0)
    host = {"launches_ms": direct_us / 1e3, "eager_regions_ms": regions * costs["eager_region_us"] / 1e3,
            "graph_launches_ms": (costs["graph_launch_us"] if graphs else 0.0) / 1e3
            + graph_kernels * costs["graph_node_us"] / 1e3}
    gpu = {"floor_ms": floor_ms, "in_graph_gaps_ms": graph_kernels * costs["in_graph_gap_us"] / 1e3}
    host_ms, gpu_ms = sum(host.values()), sum(gpu.values())
    fixed = {"stage_ms": costs["stage_us"] / 1e3, "sync_ms": costs["sync_us"] / 1e3}
    return {"host_forward": host, "gpu_forward": gpu, "fixed": fixed, "host_forward_ms": host_ms,
            "gpu_forward_ms": gpu_ms, "bound": "host" if host_ms > gpu_ms else "gpu",
            "eager_regions": regions, "graph_kernels": int(graph_kernels),
            "ttft_ms": sum(fixed.values()) + max(host_ms, gpu_ms)}


def compare(predicted_ledger: dict, ttft_result: dict) -> dict:
    """The model for every variant measured in `ttft_result` (a data/ttft_<model>.json) beside its mean TTFT,
    with the host costs that run measured; the miss in percent of the measurement."""
    costs = ttft_result["host_costs"]
    out = {}
    for v, meas in ttft_result["variants"].items():
        base = v.split("+")[0]
        if base not in predicted_ledger["variants"] or "+" in v:
            continue
        p = predict(predicted_ledger["variants"][base], costs, meas["ledger"]["gpu_busy_ms"])
        p["measured_ttft_ms"] = meas["mean_ms"]
        p["miss_pct"] = 100 * (p["ttft_ms"] - meas["mean_ms"]) / meas["mean_ms"]
        out[v] = p
    return out
