"""The launch ledger of one forward: direct kernel launches and graph launches, by class.

measured (GPU): torch.profiler over one step; the runtime's launch calls (cudaLaunchKernel,
    cuLaunchKernel(Ex), cudaLaunchKernelExC) are direct launches, each assigned to the innermost
    `dsv32ref::<region>` range around it; cudaGraphLaunch calls are graph launches. The GPU-busy floor is
    the sum of the step's kernel durations, graph-launched kernels included.
predicted (CPU): the same engine model with the same layer structure at tiny widths, run under a
    breakable capture with a stand-in graph backend; every launching aten op and every Triton launch is
    counted in the region it runs in, as direct when it runs inside an eager region (or with no graphs),
    else as part of a graph. A graph launch per graph segment. Triton kernels are recorded, not run.
    `predict_all` does it for one 8-token prefill of each eager-boundary variant: the preset's layer
    structure (layer count, IndexShare schedule, dense and MoE layers, head counts, top-k) at tiny widths,
    since launch counts depend on structure and on the shape-dependent kernel choices only (sparse_mla's
    split assumes the H200's SMs, ASSUMED_SMS).

Both take their regions from dsv32ref.instrument, which opens them only inside `measuring()`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dsv32ref.graphs.breakable import BreakableCapture, current_capture
from dsv32ref.graphs.emulated import NO_KERNEL_OPS as _NO_KERNEL
from dsv32ref.graphs.emulated import patch_triton_launches, restore_triton_launches
from dsv32ref.instrument import current_region, measuring
from dsv32ref.results import write_partial, write_result

LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
ASSUMED_SMS = 132  # the H200's streaming multiprocessors, for the prediction's split-K choice


class _LaunchCounter(TorchDispatchMode):
    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.ledger.fused:  # inside a function that is one kernel on the GPU (already counted)
            pass
        elif name == "copy_" and _is_memcpy(*args[:2]):
            self.ledger.record("aten::copy_", memcpy=True)
        elif name not in _NO_KERNEL:
            self.ledger.record(f"aten::{name}")
        return func(*args, **(kwargs or {}))


ONE_KERNEL_ON_CUDA = {torch.nn.functional.rms_norm: "aten::_fused_rms_norm"}  # decomposed into ~8 ops on a CPU


class _FusedOnCuda(TorchFunctionMode):
    """Functions that CUDA runs as one kernel but the CPU decomposes: counted once, their ops not at all."""

    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = ONE_KERNEL_ON_CUDA.get(func)
        if name is None or self.ledger.fused:
            return func(*args, **(kwargs or {}))
        self.ledger.record(name)
        self.ledger.fused = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.ledger.fused = False


def _is_memcpy(dst, src) -> bool:
    """A same-dtype copy between contiguous tensors is a cudaMemcpyAsync, not a kernel launch."""
    return (isinstance(src, torch.Tensor) and dst.dtype == src.dtype and dst.is_contiguous()
            and src.is_contiguous() and dst.shape == src.shape)


class PredictedLedger:
    def __init__(self):
        self.direct: Counter = Counter()  # region -> launches outside graphs
        self.in_graph: Counter = Counter()  # region -> launches captured in graphs
        self.ops: Counter = Counter()  # (region, op, direct?) -> count
        self.memcpy: Counter = Counter()  # region -> direct cudaMemcpyAsync calls
        self.events: list[tuple[str, str, bool]] = []  # (region, op, direct?) in launch order
        self.graph_launches = 0
        self.eager_regions = 0  # eager calls between the graph segments (segments - 1, unless splits add some)
        self.fused = False  # set while a ONE_KERNEL_ON_CUDA function runs
        self.layer: int | None = None  # the decoder layer running now (None: outside the layers)
        self.by_layer: Counter = Counter()  # (layer, op, direct?) -> count

    def record(self, op: str, memcpy: bool = False) -> None:
        cap = current_capture()
        direct = cap is None or not cap.segment_open
        region = current_region()
        if memcpy:
            if direct:
                self.memcpy[region] += 1
        else:
            (self.direct if direct else self.in_graph)[region] += 1
        self.ops[(region, op + (" (memcpy)" if memcpy else ""), direct)] += 1
        self.events.append((region, op + (" (memcpy)" if memcpy else ""), direct))
        if self.layer is not None:
            self.by_layer[(self.layer, op + (" (memcpy)" if memcpy else ""), direct)] += 1

    def layers(self, num_layers: int) -> list[dict]:
        """Per decoder layer: its direct launches by op and how many launches it has inside graphs."""
        out = [{"direct": {}, "graph": 0} for _ in range(num_layers)]
        for (layer, op, direct), n in sorted(self.by_layer.items()):
            if direct:
                out[layer]["direct"][op] = out[layer]["direct"].get(op, 0) + n
            else:
                out[layer]["graph"] += n
        return out


@contextlib.contextmanager
def _track_layers(model, ledger: PredictedLedger):
    """Set ledger.layer while each decoder layer's forward runs (forward hooks, removed afterwards)."""
    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(ledger, "layer", i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: setattr(ledger, "layer", None)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _count_triton_launches(ledger: PredictedLedger):
    """Replace dsv32ref's Triton kernels by recorders: a launch is counted, not run. The prediction needs
    the control flow only, and no host decision in the model reads kernel outputs."""
    patched = patch_triton_launches(lambda name, launch, a, k: ledger.record(f"triton::{name}"))
    try:
        yield
    finally:
        restore_triton_launches(patched)


class _CountingBackend:
    """Stand-in graph backend: segments are counted, nothing is captured (ops run for real on the CPU)."""

    runs_ops_during_capture = True

    class _G:
        def replay(self):
            pass

        def reset(self):
            pass

    def begin(self):
        return self._G()

    def end(self, g):
        pass

    def abort(self, g):
        pass


def predict(engine, step, piecewise: bool = True) -> PredictedLedger:
    """Count the launches of one step of `engine` (a CPU LLMEngine), as PIECEWISE graphs (one graph segment
    per stretch between eager breaks; the whole forward for boundary "none") or with no graphs. The step's
    launches outside the forward are counted too, in region "other", as the GPU measurement counts them:
    the metadata upload (LLMEngine.upload), logits and greedy sampling (LLMEngine.sample, whose read-back of
    the tokens is one device-to-host copy). Kernels whose launch count depends on the GPU's size (sparse_mla's
    split) assume the engine's EngineConfig.num_sms."""
    from dsv32ref.engine.context import set_forward_context

    ledger = PredictedLedger()
    prep = engine.stage(step)  # host work only: the CPU tensors it builds are not launches
    with torch.no_grad(), measuring(), _count_triton_launches(ledger), _FusedOnCuda(ledger), _LaunchCounter(ledger), \
            _track_layers(engine.model, ledger):
        engine.upload()
        with set_forward_context(engine.forward_context(prep)):
            if piecewise:
                with BreakableCapture(_CountingBackend(), name="ledger prediction") as cap:
                    hidden = engine.model(engine.input_ids[: prep.num_tokens])
                ledger.graph_launches = cap.graph.num_graphs
                ledger.eager_regions = sum(kind == "eager" for kind, _ in cap.graph.entries)
            else:
                hidden = engine.model(engine.input_ids[: prep.num_tokens])
        engine.sample(prep, hidden)
        ledger.record("aten::_local_scalar_dense", memcpy=True)  # .tolist(): one device-to-host copy
    return ledger


def span_us(intervals) -> float:
    return max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0


def idle_time_us(intervals) -> float:
    """Time inside [first kernel start, last kernel end] with no kernel running (launch gaps, host waits)."""
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return span_us(intervals) - busy


def _is_annotation(e) -> bool:
    """record_function ranges also appear on the GPU timeline (user annotations): they are not kernels."""
    return getattr(e, "is_user_annotation", False) or e.name.startswith(("dsv32ref::", "eager::"))


def _gpu_ms_by_region(engine, prompt: list[int]) -> dict:
    """One more request with graphs off (mode NONE): kernel time of each dsv32ref:: region, so that graph-
    launched work can be attributed too (the kernels are the same; only how they are launched differs).
    A kernel belongs to the innermost region annotation on the GPU timeline that contains its start."""
    import bisect

    from torch.profiler import ProfilerActivity, profile

    mode, engine.runner.mode = engine.runner.mode, type(engine.runner.mode).NONE
    try:
        with measuring():
            engine.generate(prompt, 1)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.generate(prompt, 1)
                torch.cuda.synchronize()
    finally:
        engine.runner.mode = mode
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ann = sorted((e.time_range.start, e.time_range.end, e.name[len("dsv32ref::"):]) for e in gpu
                 if e.name.startswith("dsv32ref::"))
    starts = [a[0] for a in ann]
    by = Counter()
    for e in gpu:
        if _is_annotation(e):
            continue
        t, best = e.time_range.start, None
        for s0, e0, name in ann[max(0, bisect.bisect_right(starts, t) - 64): bisect.bisect_right(starts, t)]:
            if s0 <= t < e0 and (best is None or e0 - s0 < best[0]):
                best = (e0 - s0, name)
        by[best[1] if best else "other"] += e.time_range.elapsed_us() / 1e3
    return dict(by.most_common())


def measure(engine, prompt: list[int]) -> dict:
    """Profile one request (one prefill step) on the GPU: direct launches by region, graph launches, the floor,
    kernel time by kernel name; on a GPU also kernel time by region from one eager request. The profiled
    request runs with the named regions open, so its host times include theirs (TTFT is timed without)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    with measuring():  # the named regions and eager ranges exist only while a ledger is taken
        engine.generate(prompt, 1)  # warm
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            engine.generate(prompt, 1)
            if cuda:
                torch.cuda.synchronize()
    events = prof.events()

    def region_of(e) -> str:
        """The innermost dsv32ref:: range above the event in the profiler's call tree."""
        p = e.cpu_parent
        while p is not None and not p.name.startswith("dsv32ref::"):
            p = p.cpu_parent
        return p.name[len("dsv32ref::"):] if p is not None else "other"

    direct, memcpy, graph_launches, kernel_us, kernels = Counter(), Counter(), 0, 0.0, 0
    by_name = Counter()
    intervals, eager_us, eager_calls, entered = [], 0.0, 0, 0
    for e in events:
        if e.name in LAUNCH_APIS:
            direct[region_of(e)] += 1
        elif e.name == "cudaMemcpyAsync":
            memcpy[region_of(e)] += 1
        elif e.name == "cudaGraphLaunch":
            graph_launches += 1
        elif e.device_type == torch.autograd.DeviceType.CUDA and not _is_annotation(e):
            kernel_us += e.time_range.elapsed_us()
            by_name[e.name[:80]] += e.time_range.elapsed_us() / 1e3
            kernels += 1
            intervals.append((e.time_range.start, e.time_range.end))
        elif e.name.startswith("eager::") and e.device_type == torch.autograd.DeviceType.CPU:
            eager_us += e.time_range.elapsed_us()
            eager_calls += 1
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("dsv32ref::", "eager::")):
            entered += 1
    return {"direct": dict(direct), "direct_total": sum(direct.values()), "graph_launches": graph_launches,
            "memcpy": dict(memcpy), "gpu_busy_ms": kernel_us / 1e3, "kernels": kernels,
            "gpu_idle_ms": idle_time_us(intervals) / 1e3, "gpu_span_ms": span_us(intervals) / 1e3,
            "eager_region_host_ms": eager_us / 1e3, "eager_region_calls": eager_calls,
            "regions_entered": entered,
            "kernel_ms_by_name": dict(by_name.most_common(25)),
            "gpu_ms_by_region_eager": _gpu_ms_by_region(engine, prompt) if cuda else None,
            "note": "'other': launches outside the model forward (logits, sampling, input copies)"}




def structure_config(preset: str):
    """The preset's structure at tiny widths (heads, indexer heads and top-k kept: they decide launches)."""
    from dsv32ref.experiments.ttft import reduced_config

    return reduced_config(preset).replace(
        hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        index_head_dim=16, intermediate_size=64, moe_intermediate_size=32, vocab_size=128)


def predict_all(preset: str = "glm-5.2", prompt_len: int = 8, variants=None, out: str | None = None,
                measured: str | None = None, host_costs: str | None = None) -> dict:
    """Every variant's predicted ledger; with `measured` (a TTFT run's JSON, e.g. data/ttft_<preset>.json) also
    the TTFT model of each variant beside that run's measurement (dsv32ref.experiments.ttft_model), under
    "ttft_model", priced with the host costs the TTFT run measured in its own process when they include its
    eager regions' times, else with those in `host_costs` (data/host_costs_<preset>.json, another process)."""
    from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput
    from dsv32ref.experiments.ttft import arm
    from dsv32ref.graphs import CUDAGraphMode
    from dsv32ref.provenance import provenance

    config = structure_config(preset)
    result = {"provenance": provenance(), "preset": preset, "prompt_len": prompt_len, "assumed_sms": ASSUMED_SMS,
              "note": "counts of launching aten ops and Triton launches; one aten op is predicted as one kernel",
              "variants": {}}
    for v in variants or BOUNDARIES + ("none+split",):
        t0 = time.time()
        _, boundary, switches = arm(v)
        eng = LLMEngine(config, EngineConfig(boundary=boundary, mode=CUDAGraphMode.NONE, max_model_len=64,
                                             max_num_seqs=2, max_num_batched_tokens=16, block_size=16,
                                             capture_sizes=[8, 16], num_sms=ASSUMED_SMS, **switches),
                        device="cpu", dtype=torch.bfloat16)  # bf16 as on the GPU: dtype casts are launches too
        L = predict(eng, StepInput([(0, list(range(1, prompt_len + 1)), 0)]))
        ops = {}
        for (region, op, direct), n in sorted(L.ops.items()):
            ops.setdefault(region, {}).setdefault("direct" if direct else "graph", {})[op] = n
        result["variants"][v] = {"direct": dict(L.direct), "direct_total": sum(L.direct.values()),
                                 "memcpy": dict(L.memcpy),
                                 "in_graph": dict(L.in_graph), "graph_launches": L.graph_launches,
                                 "eager_regions": L.eager_regions, "ops": ops,
                                 "layers": L.layers(config.num_hidden_layers)}
        print(f"  {v:<12} direct {sum(L.direct.values())}, graph launches {L.graph_launches} "
              f"({time.time() - t0:.0f} s)", flush=True)
        if out:
            write_partial(out, result)
    if measured:
        import json

        from dsv32ref.experiments import ttft_model

        with open(measured) as f:
            run = json.load(f)
        costs, source = run.get("host_costs"), measured
        if host_costs and not (costs or {}).get("regions"):  # the run's own, when it timed its regions
            with open(host_costs) as f:
                costs, source = json.load(f), host_costs
        if costs is not None:
            result["ttft_model"] = {"measured": measured, "measured_commit": run["provenance"].get("git_commit"),
                                    "host_costs_from": source, "host_costs_commit": costs.get("provenance", run[
                                        "provenance"]).get("git_commit"), "host_costs": costs,
                                    "variants": ttft_model.compare(result, run, costs)}
            for v, m in result["ttft_model"]["variants"].items():
                print(f"  model {v:<18} {m['ttft_ms']:.2f} ms predicted, {m['measured_ttft_ms']:.2f} measured "
                      f"({m['miss_pct']:+.1f} %), {m['bound']}-bound", flush=True)
    if out:
        write_result(out, result)
    return result
