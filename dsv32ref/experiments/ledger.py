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

import bisect
import contextlib
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from dsv32ref.checks import check_int
from dsv32ref.config import reduced_moe
from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput
from dsv32ref.experiments.protocol import arm
from dsv32ref.graphs import BreakableCapture, CUDAGraphMode, current_capture
from dsv32ref.graphs.emulated import NO_KERNEL_OPS as _NO_KERNEL
from dsv32ref.instrument import current_region, measuring
from dsv32ref.kernels.launch import observing_launches
from dsv32ref.provenance import provenance
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
        self.eager_regions = 0  # eager calls between the graph segments (segments - 1)
        self.fused = False  # set while a ONE_KERNEL_ON_CUDA function runs
        self.layer: int | None = None  # the decoder layer running now (None: outside the layers)
        self.by_layer: Counter = Counter()  # (layer, op, direct?) -> count

    def enter_layer(self, layer: int | None) -> None:
        self.layer = layer

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
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: ledger.enter_layer(i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: ledger.enter_layer(None)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _count_triton_launches(ledger: PredictedLedger):
    """Count dsv32ref's Triton launches without running them (through the kernels' launch seam): the
    prediction needs the control flow only, and no host decision in the model reads kernel outputs."""
    return observing_launches(lambda name, run: ledger.record(f"triton::{name}"))


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
    """Count the launches of one step of `engine` (a CPU LLMEngine built with mode NONE), as PIECEWISE graphs
    (one graph segment per stretch between eager breaks; the whole forward for boundary "none") or with no
    graphs. The step's launches outside the forward are counted too, in region "other", as the GPU measurement
    counts them: the metadata upload, logits and greedy sampling (whose read-back of the tokens is one
    device-to-host copy). Kernels whose launch count depends on the GPU's size (sparse_mla's split) assume the
    engine's EngineConfig.num_sms."""
    ledger = PredictedLedger()
    prep = engine.stage(step)  # host work only: the CPU tensors it builds are not launches
    with torch.no_grad(), measuring(), _count_triton_launches(ledger), _FusedOnCuda(ledger), _LaunchCounter(ledger), \
            _track_layers(engine.model, ledger):
        engine.upload()
        if piecewise:  # the eager forward inside a capture: eager breaks end segments as they would on a GPU
            with BreakableCapture(_CountingBackend(), name="ledger prediction") as cap:
                _, hidden = engine.execute(prep)
            ledger.graph_launches = cap.graph.num_graphs
            ledger.eager_regions = len(cap.graph.eager_names())
        else:
            _, hidden = engine.execute(prep)
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


def is_annotation(e) -> bool:
    """record_function ranges also appear on the GPU timeline (user annotations): they are not kernels."""
    return getattr(e, "is_user_annotation", False) or e.name.startswith(("dsv32ref::", "eager::"))


def _gpu_ms_by_region(engine, prompt: list[int]) -> dict:
    """One more request with graphs off (mode NONE): kernel time of each dsv32ref:: region, so that graph-
    launched work can be attributed too (the kernels are the same; only how they are launched differs).
    A kernel belongs to the innermost region annotation on the GPU timeline that contains its start."""
    with engine.runner.graphs.using_mode(CUDAGraphMode.NONE), measuring():
        engine.generate(prompt, 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompt, 1)
            torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ann = sorted((e.time_range.start, e.time_range.end, e.name[len("dsv32ref::"):]) for e in gpu
                 if e.name.startswith("dsv32ref::"))
    starts = [a[0] for a in ann]
    by = Counter()
    for e in gpu:
        if is_annotation(e):
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
        elif e.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(e):
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
    return reduced_moe(preset).replace(
        hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        index_head_dim=16, intermediate_size=64, moe_intermediate_size=32, vocab_size=128)


def _predicted(L: PredictedLedger, num_layers: int) -> dict:
    ops = {}
    for (region, op, direct), n in sorted(L.ops.items()):
        ops.setdefault(region, {}).setdefault("direct" if direct else "graph", {})[op] = n
    return {"direct": dict(L.direct), "direct_total": sum(L.direct.values()), "memcpy": dict(L.memcpy),
            "in_graph": dict(L.in_graph), "graph_launches": L.graph_launches, "eager_regions": L.eager_regions,
            "ops": ops, "layers": L.layers(num_layers)}


PREDICT_MAX_TOKENS = 16  # the prompt lengths predict_all takes: one step of the CPU engine it counts launches on


def predict_all(preset: str = "glm-5.2", prompt_len: int = 8, variants=BOUNDARIES, out: str | None = None) -> dict:
    """Every arm's predicted ledger for one `prompt_len`-token prefill (arms: dsv32ref.experiments.protocol; at
    most PREDICT_MAX_TOKENS tokens, one step of the engine it predicts on)."""
    check_int("predict_all: prompt_len", prompt_len, 1, PREDICT_MAX_TOKENS)
    if isinstance(variants, str) or not isinstance(variants, (list, tuple)) or not variants:
        raise ValueError(f"predict_all: variants: expected a non-empty list of arm names, got {variants!r}")
    for v in variants:
        arm(v)  # each name checked before the first arm runs
    config = structure_config(preset)
    result = {"provenance": provenance(), "preset": preset, "prompt_len": prompt_len, "assumed_sms": ASSUMED_SMS,
              "note": "counts of launching aten ops and Triton launches; one aten op is predicted as one kernel",
              "variants": {}}
    for v in variants:
        t0 = time.time()
        _, boundary, switches = arm(v)
        eng = LLMEngine(config, EngineConfig(boundary=boundary, mode=CUDAGraphMode.NONE, max_model_len=64,
                                             max_num_seqs=2, max_num_batched_tokens=PREDICT_MAX_TOKENS, block_size=16,
                                             capture_sizes=[8, 16], num_sms=ASSUMED_SMS, **switches),
                        device="cpu", dtype=torch.bfloat16)  # bf16 as on the GPU: dtype casts are launches too
        L = predict(eng, StepInput([(0, list(range(1, prompt_len + 1)), 0)]))
        result["variants"][v] = _predicted(L, config.num_hidden_layers)
        print(f"  {v:<12} direct {sum(L.direct.values())}, graph launches {L.graph_launches} "
              f"({time.time() - t0:.0f} s)", flush=True)
        if out:
            write_partial(out, result)
    if out:
        write_result(out, result)
    return result
