"""Capture bookkeeping with a stand-in graph object (CPU): order, nesting, weak references, errors, threads."""

import gc
import threading
import weakref

import pytest
import torch

from dsv32ref.graphs import (BreakableCapture, CaptureError, CUDAGraphMode, GraphRunner, default_capture_sizes,
                             eager_break, eager_breaks_enabled, maybe_execute_in_parallel, weak_alias)


class FakeGraph:
    def __init__(self, gid, log):
        self.gid, self.log = gid, log

    def replay(self):
        self.log.append(f"G{self.gid}")

    def reset(self):
        self.log.append(f"reset{self.gid}")


class FakeBackend:
    def __init__(self, log):
        self.log, self.n = log, 0

    def begin(self):
        self.n += 1
        self.log.append(f"begin{self.n}")
        return FakeGraph(self.n, self.log)

    def end(self, g):
        self.log.append(f"end{g.gid}")

    def abort(self, g):
        self.log.append(f"abort{g.gid}")


@eager_break
def attend(x, out):
    out.copy_(x * 2)
    log.append("E")
    return out


@eager_break(name="outer")
def outer(x, out):
    attend(x, out)  # nested: inline
    log.append("outer")
    return out


log: list = []


def model(x, out, layers=3):
    for _ in range(layers):
        x = x + 1
        attend(x, out)
        x = out + 0
    return x


def test_outside_capture_is_a_plain_call():
    log.clear()
    out = torch.zeros(3)
    assert torch.equal(model(torch.ones(3), out), torch.tensor([22.0] * 3))  # ((1+1)*2+1)*2+1)*2
    assert log == ["E", "E", "E"]


def test_segments_in_order_and_replay_interleaves():
    log.clear()
    out = torch.zeros(3)
    with BreakableCapture(FakeBackend(log)) as cap:
        model(torch.ones(3), out)
    assert cap.graph.pattern == "G E G E G E G"
    assert cap.graph.num_graphs == 4
    # during capture each segment is replayed once before its eager region runs on real inputs
    assert log == ["begin1", "end1", "G1", "E", "begin2", "end2", "G2", "E", "begin3", "end3", "G3", "E",
                   "begin4", "end4", "G4"]
    log.clear()
    cap.graph.replay()
    assert log == ["G1", "E", "G2", "E", "G3", "E", "G4"]


def test_nested_eager_break_runs_inline():
    log.clear()
    out = torch.zeros(2)
    with BreakableCapture(FakeBackend(log)) as cap:
        outer(torch.ones(2), out)
    assert cap.graph.pattern == "G E G"
    assert log[-5:] == ["E", "outer", "begin2", "end2", "G2"]


def test_full_mode_captures_eager_regions():
    log.clear()
    out = torch.zeros(2)
    with eager_breaks_enabled(False):
        with BreakableCapture(FakeBackend(log)) as cap:
            model(torch.ones(2), out)
    assert cap.graph.pattern == "G"


def test_timed_replay_times_each_entry_and_replays_the_same_work():
    """replay_timed() runs what replay() runs, in order, and returns one host time per entry (microseconds)."""
    out = torch.zeros(2)
    with BreakableCapture(FakeBackend(log)) as cap:
        model(torch.ones(2), out)
    log.clear()
    cap.graph.replay()
    plain = list(log)
    log.clear()
    times = cap.graph.replay_timed()
    assert log == plain and len(times) == len(cap.graph.entries) and all(t >= 0 for t in times)
    assert cap.graph.eager_names() == ["attend"] * 3 and cap.segments_begun == 4  # three layers


def test_runner_forces_a_mode_for_a_block_and_restores_it():
    runner = GraphRunner(lambda size, full: torch.zeros(size), CUDAGraphMode.FULL_AND_PIECEWISE, [4],
                         lambda: FakeBackend([]), warmup=False)
    runner.capture_all()
    with runner.using_mode(CUDAGraphMode.NONE):
        assert runner.lookup(4, True)[0] == "NONE"
    with runner.using_mode(CUDAGraphMode.PIECEWISE):
        assert runner.lookup(4, True)[0] == "PIECEWISE"
    assert runner.lookup(4, True)[0] == "FULL" and runner.mode is CUDAGraphMode.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="using_mode: expected a CUDAGraphMode, got 'none'"):
        with runner.using_mode("none"):
            pass


def test_parallel_helper_without_a_side_stream_runs_both_in_order():
    calls = []
    assert maybe_execute_in_parallel(lambda: calls.append(0) or "a", lambda: calls.append(1) or "b",
                                     None, None) == ("a", "b")
    assert calls == [0, 1]


def test_nested_capture_is_an_error():
    with BreakableCapture(FakeBackend([]), name="outer capture"):
        with pytest.raises(CaptureError, match="already active on this thread \\(outer capture\\)"):
            with BreakableCapture(FakeBackend([]), name="inner"):
                pass


def test_eager_region_returning_a_fresh_tensor_is_an_error_and_leaves_no_state():
    @eager_break
    def bad(x):
        return x * 2

    glog = []
    with pytest.raises(CaptureError, match="'test_eager_region_returning.*bad' returned a tensor of shape \\[4\\]"):
        with BreakableCapture(FakeBackend(glog)) as cap:
            bad(torch.ones(4))
    assert cap.graph.entries == [] and "reset1" in glog
    with BreakableCapture(FakeBackend([])):  # the thread is free again
        pass


def test_failure_mid_capture_aborts_the_open_segment():
    @eager_break
    def ok(x, out):
        out.copy_(x)
        return out

    glog = []
    with pytest.raises(ValueError, match="boom"):
        with BreakableCapture(FakeBackend(glog)) as cap:
            ok(torch.ones(2), torch.zeros(2))
            raise ValueError("boom")
    assert "abort2" in glog and cap.graph.entries == []


def test_tensor_arguments_are_held_weakly():
    captured_out = torch.zeros(3)
    x = torch.ones(3)
    ref_x = weakref.ref(x)
    with BreakableCapture(FakeBackend([])) as cap:
        attend(x, captured_out)
    (kind, call), = [e for e in cap.graph.entries if e[0] == "eager"]
    assert call.args[0].data_ptr() == ref_x().data_ptr()  # same memory ...
    del x
    gc.collect()
    assert ref_x() is None  # ... but the capture did not keep the tensor alive


def test_weak_alias_shares_memory_for_all_dtypes():
    for dt in (torch.float32, torch.bfloat16, torch.int32, torch.float8_e4m3fn):
        t = torch.arange(12).reshape(3, 4).to(dt)
        a = weak_alias(t[:, 1:])
        assert a.dtype == dt and a.shape == (3, 3) and a.data_ptr() == t[:, 1:].data_ptr()
        assert torch.equal(a.float(), t[:, 1:].float())


def test_captures_are_thread_local():
    results = {}

    def other():
        out = torch.zeros(2)
        l2 = []
        attend_calls = len(log)
        attend(torch.ones(2), out)  # no capture on this thread: a plain call
        results["plain"] = len(log) == attend_calls + 1
        with BreakableCapture(FakeBackend(l2)) as c2:
            attend(torch.ones(2), out)
        results["pattern"] = c2.graph.pattern

    with BreakableCapture(FakeBackend([])) as cap:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        attend(torch.ones(2), torch.zeros(2))
    assert results == {"plain": True, "pattern": "G E G"} and cap.graph.pattern == "G E G"


def test_runner_order_modes_and_lookup():
    glog, order = [], []
    backend = FakeBackend(glog)

    def forward(size, full):
        out = torch.zeros(size)
        attend(torch.ones(size), out)
        return out

    runner = GraphRunner(forward, CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8], lambda: backend, warmup=False,
                         on_capture=lambda phase, size: order.append((phase, size)))
    runner.capture_all()
    assert order == [("PIECEWISE", 8), ("PIECEWISE", 4), ("PIECEWISE", 2), ("PIECEWISE", 1),
                     ("FULL", 8), ("FULL", 4), ("FULL", 2), ("FULL", 1)]
    assert runner.piecewise[4].graph.pattern == "G E G" and runner.full[4].graph.pattern == "G"
    assert runner.lookup(3, uniform_decode=True)[:2] == ("FULL", 4)
    assert runner.lookup(3, uniform_decode=False)[:2] == ("PIECEWISE", 4)
    assert runner.lookup(9, uniform_decode=False)[:2] == ("NONE", None)
    pw = GraphRunner(forward, CUDAGraphMode.PIECEWISE, [1, 2], lambda: backend)
    pw.capture_all()
    assert pw.lookup(1, uniform_decode=True)[0] == "PIECEWISE" and not pw.full


def test_runner_with_full_graphs_for_every_step_captures_and_serves_only_full():
    """full_serves_all (no eager break: FULL graphs serve prefill and mixed steps too): no PIECEWISE phase, FULL
    graphs at every capture size (past max_full_size, the largest decode batch, as the engine builds it), and a
    prefill step of 3 tokens is served by the FULL graph of size 4."""
    def forward(size, full):
        return torch.zeros(size)

    runner = GraphRunner(forward, CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4], lambda: FakeBackend([]), warmup=False,
                         max_full_size=2, full_serves_all=True)
    runner.capture_all()
    assert runner.phase_sizes() == [("FULL", [4, 2, 1])] and not runner.piecewise
    assert runner.lookup(3, uniform_decode=False)[:2] == ("FULL", 4)
    assert runner.lookup(5, uniform_decode=False)[:2] == ("NONE", None)


def test_runner_failure_names_phase_and_size():
    def forward(size, full):
        if size == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.zeros(size)

    runner = GraphRunner(forward, CUDAGraphMode.PIECEWISE, [2, 4], lambda: FakeBackend([]))
    with pytest.raises(CaptureError, match="PIECEWISE capture of size 4 failed: RuntimeError: CUDA out of memory"):
        runner.capture_all()
    assert runner.piecewise == {}


def test_default_capture_sizes():
    sizes = default_capture_sizes()
    assert sizes[:5] == [1, 2, 4, 8, 16] and 248 in sizes and 256 in sizes and sizes[-1] == 512
    assert len(sizes) == 3 + 31 + 17 and default_capture_sizes(64)[-1] == 64


def test_gpu_idle_time_from_kernel_intervals():
    from dsv32ref.experiments.ledger import idle_time_us, span_us

    iv = [(0, 10), (5, 12), (20, 25), (30, 31), (24, 26)]
    assert span_us(iv) == 31
    assert idle_time_us(iv) == (20 - 12) + (30 - 26)
    assert idle_time_us([]) == 0


def test_cpu_stand_in_applies_in_place_ops_once_during_capture():
    """As on a GPU (capture runs nothing, each segment is replayed once at its end), an in-place op before an
    eager break reaches the eager region once during capture, not twice."""
    from dsv32ref.graphs.emulated import RecordingBackend

    @eager_break(name="read")
    def read(x, out):
        out.copy_(x)
        return out

    x, out = torch.zeros(3), torch.empty(3)

    def step():
        x.add_(1.0)
        read(x, out)
        x.mul_(2.0)

    with BreakableCapture(RecordingBackend()) as cap:
        step()
    assert out.tolist() == [1.0] * 3 and x.tolist() == [2.0] * 3  # what a GPU capture leaves
    x.zero_()
    cap.graph.replay()
    assert out.tolist() == [1.0] * 3 and x.tolist() == [2.0] * 3
    cap.graph.replay()
    assert out.tolist() == [3.0] * 3 and x.tolist() == [6.0] * 3


@pytest.mark.parametrize("sync", [lambda x: x.add_(x.max().item()), lambda x: x[x > 0].sum(),
                                  lambda x: x.__setitem__(x > 0, 1.0), lambda x: torch.nonzero(x)],
                         ids=["item", "boolean-mask", "boolean-mask-write", "nonzero"])
def test_cpu_stand_in_refuses_a_host_sync_inside_a_segment(sync):
    """.item() or an op whose output size depends on the data, inside a recorded segment: a CaptureError, as a
    CUDA capture refuses them (the recording froze the value the capture saw, and replay gave stale results)."""
    from dsv32ref.graphs.emulated import RecordingBackend

    x = torch.arange(4.0)
    with pytest.raises(CaptureError, match=r"aten::\w+ inside a graph segment: it reads a device value back"):
        with BreakableCapture(RecordingBackend()):
            sync(x)


def test_tensors_nested_in_containers_are_held_weakly_and_checked():
    from dataclasses import dataclass

    @dataclass
    class Meta:
        scale: torch.Tensor
        n: int

    @eager_break(name="nested")
    def nested(bufs, meta, out):
        out.copy_(bufs["a"] * meta.scale + bufs["b"][0])
        return {"out": out}

    log.clear()
    a, b, scale, out = torch.ones(4), torch.full((4,), 2.0), torch.tensor(3.0), torch.empty(4)
    refs = [weakref.ref(t) for t in (a, b, scale)]
    with BreakableCapture(FakeBackend(log)) as cap:
        nested({"a": a, "b": [b]}, Meta(scale, 1), out)
    assert out.tolist() == [5.0] * 4
    (_, call), = [e for e in cap.graph.entries if e[0] == "eager"]
    held = call.args
    assert isinstance(held[1], Meta) and held[1].n == 1 and held[1].scale is not scale  # an alias, not the tensor
    del a, b, scale
    gc.collect()
    assert all(r() is None for r in refs)  # nothing the capture holds keeps them alive

    @eager_break(name="fresh")
    def fresh(x):
        return [x, {"new": x * 2}]  # a tensor allocated inside the region, nested in the output

    with pytest.raises(CaptureError, match=r"eager region 'fresh' returned a tensor of shape \[4\]"):
        with BreakableCapture(FakeBackend(log)):
            fresh(torch.ones(4))


def _replays_like_eager(cap, step, x, out, trials: int = 3) -> None:
    """On fresh inputs x, the captured step's replay writes into `out` what the step run eagerly writes."""
    for trial in range(trials):
        x.normal_()
        out.zero_()
        cap.graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        step()  # the same step eagerly, on the same inputs
        torch.cuda.synchronize()
        assert torch.equal(got, out), trial


@pytest.mark.gpu
def test_eager_break_inside_a_side_stream_region_on_the_gpu():
    """Work forked to a second stream and joined back, with an eager break inside the side-stream part (the
    serving engine's indexer overlap): it captures, and replays what eager execution computes."""
    from dsv32ref.graphs import CudaGraphBackend

    @eager_break(name="side")
    def side_op(x, out):
        out.copy_(x * 3)
        return out

    x = torch.randn(1024, device="cuda")
    a, b, y, out = (torch.empty(1024, device="cuda") for _ in range(4))
    side = torch.cuda.Stream()

    def step():
        a.copy_(x + 1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b.copy_(a * 2)
            side_op(b, y)  # the eager break, reached on the side stream
            y.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        out.copy_(a + y)

    step()  # warm-up outside the capture
    torch.cuda.synchronize()
    with BreakableCapture(CudaGraphBackend()) as cap:
        step()
    assert cap.graph.pattern == "G E G"
    _replays_like_eager(cap, step, x, out)


@pytest.mark.gpu
@pytest.mark.parametrize("break_in", ["fn0", "fn1"])
def test_the_parallel_helper_across_an_eager_break_replays_like_eager(break_in):
    """vLLM's maybe_execute_in_parallel order: event0 recorded on the capture stream, fn0 there, the side stream
    waits on event0 and runs fn1, the capture stream waits on event1. With the eager break inside fn0, event0
    belongs to a segment that has ended when the side stream would wait on it (CUDA refuses); inside fn1 (the
    indexer on the side stream), the break is reached on the side stream. Both capture, and replay what eager
    execution computes."""
    from dsv32ref.graphs import CudaGraphBackend

    @eager_break(name="region")
    def region(x, out):
        out.copy_(x * 3)
        return out

    x = torch.randn(1024, device="cuda")
    a, b, y, out = (torch.empty(1024, device="cuda") for _ in range(4))
    side, e0, e1 = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()

    def fn0():
        if break_in == "fn0":
            region(a, y)
        else:
            y.copy_(a * 3)
        return y.add_(1)

    def fn1():
        b.copy_(a * 2)
        return region(b, b) if break_in == "fn1" else b

    def step():
        a.copy_(x + 1)
        maybe_execute_in_parallel(fn0, fn1, e0, e1, side)
        out.copy_(y + b)

    step()  # warm-up outside the capture
    torch.cuda.synchronize()
    with BreakableCapture(CudaGraphBackend()) as cap:
        step()
    assert cap.graph.pattern == "G E G"
    _replays_like_eager(cap, step, x, out)
