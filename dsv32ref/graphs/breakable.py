"""Breakable CUDA graphs: capture a forward as graph segments with eager regions between them.

How the serving engine does it (and this module, in its own words):
- `BreakableCapture` is a thread-local context. Entering it begins a graph capture into a shared memory
  pool. A call to an `@eager_break` function during the capture ends the current graph, replays it once
  (so the eager region sees real inputs), runs the function eagerly, records (graph, call) and begins a
  new graph. Leaving the context ends the last graph.
- Replay calls every entry in order: graph.replay(), then the eager call, then the next graph...
- Outside a capture an `@eager_break` function is a plain call; called while no segment is open (from
  inside another eager region) it runs inline; in FULL mode (`eager_breaks_enabled(False)`) it is
  captured like any other op.
- Eager regions must write into buffers their caller allocated: a tensor allocated inside one lives at a
  new address every replay, which the next graph segment cannot see. Returning a freshly allocated
  tensor is an error.
- Tensor arguments are held through non-owning aliases, so the pool memory of one capture size can be
  reused by the next once the caller drops its references (the graphs of different sizes never run at
  the same time).
- Side streams: an eager break reached on a stream forked from the capture stream joins it into the segment
  that ends and forks it again from the next (`CudaGraphBackend`). An event recorded in one segment cannot be
  waited on in the next (CUDA: it belongs to a finished capture); `maybe_execute_in_parallel`, the serving
  engine's overlap helper, forks its side stream from the current segment instead when its first function
  crossed an eager break.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv32ref.checks import check_tensor
from dsv32ref.instrument import eager_range

__all__ = ["eager_break", "BreakableCapture", "BreakableGraph", "CaptureError", "eager_breaks_enabled",
           "maybe_execute_in_parallel", "weak_alias", "CudaGraphBackend", "capture_stream", "current_capture"]


class CaptureError(RuntimeError):
    """A capture that cannot proceed; the message says what and where. No graph is left half-captured."""


_state = threading.local()


def current_capture() -> "BreakableCapture | None":
    """The breakable capture active on this thread, or None."""
    return getattr(_state, "capture", None)


@contextlib.contextmanager
def eager_breaks_enabled(enabled: bool):
    """FULL-graph mode turns eager breaks off: decorated functions are then captured like any op."""
    old = getattr(_state, "breaks_enabled", True)
    _state.breaks_enabled = enabled
    try:
        yield
    finally:
        _state.breaks_enabled = old


# ---- non-owning tensor aliases -------------------------------------------------------------------------

class _ArrayInterface:
    """Exposes a tensor's memory through the (CUDA) array interface, without keeping the tensor alive."""

    def __init__(self, t: torch.Tensor):
        iface = {"shape": tuple(t.shape), "typestr": f"<i{t.element_size()}", "version": 3,
                 "data": (t.data_ptr(), False), "strides": tuple(s * t.element_size() for s in t.stride())}
        if t.is_cuda:
            self.__cuda_array_interface__ = iface
        else:
            self.__array_interface__ = iface


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # weak_alias's views


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as `t` that does not own it (vLLM's weak_ref_tensor).

    Valid while the memory stays allocated: for activations captured into a graph pool, as long as that
    pool's graphs live. Typed through a same-width integer view, so bf16/fp8 work too.
    """
    check_tensor("weak_alias: t", t)
    if t.element_size() not in _INT_OF_SIZE or t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"weak_alias: t: expected a tensor of 1, 2, 4 or 8-byte elements on the cpu or a GPU, got "
                         f"{t.dtype} on {t.device}")
    if t.numel() == 0:
        return t.new_empty(t.shape)
    int_dtype = _INT_OF_SIZE[t.element_size()]
    if t.is_cuda:
        alias = torch.as_tensor(_ArrayInterface(t.view(int_dtype)), device=t.device)
    else:
        import numpy as np

        alias = torch.from_numpy(np.asarray(_ArrayInterface(t.view(int_dtype))))
    return alias.view(t.dtype)


def _map_tensors(obj, fn):
    """obj with every tensor inside it (also nested in lists, tuples, dicts and dataclass instances)
    replaced by fn(tensor); containers are rebuilt, the rest is kept as is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuples too
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _map_tensors(getattr(obj, f.name), fn))
        return new
    return obj


def _tensors(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _alias_args(args: tuple, kwargs: dict):
    """Non-owning aliases of every tensor argument, nested ones included (vLLM holds them weakly too)."""
    return _map_tensors(tuple(args), weak_alias), _map_tensors(dict(kwargs), weak_alias)


# ---- graph backends ------------------------------------------------------------------------------------

_CAPTURE_STREAMS: dict = {}


def capture_stream(device=None) -> "torch.cuda.Stream":
    """The one side stream every capture on a device runs on (the serving engine's graph_capture stream).

    One stream, not a new one per capture: the caching allocator reuses a freed block only for allocations
    on the stream that allocated it, so captures spread over many streams each grow the shared pool by a full
    set of activations (measured: 32 streams, 7 GiB of pool for 0.2 GiB of activations), and cuBLAS keeps a
    32 MiB workspace per stream. The workspace is created here, outside any capture, by one small GEMM."""
    dev = torch.cuda.current_device() if device is None else torch.device(device).index
    if dev not in _CAPTURE_STREAMS:
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            a = torch.ones(16, 16, device=f"cuda:{dev}", dtype=torch.bfloat16)
            torch.mm(a, a)
        torch.cuda.current_stream(dev).wait_stream(s)
        _CAPTURE_STREAMS[dev] = s
    return _CAPTURE_STREAMS[dev]


class CudaGraphBackend:
    """torch.cuda.CUDAGraph segments on the device's capture stream, all in one memory pool.

    Every segment begins and ends on the capture stream, also when the eager break that ends it is reached
    on a side stream (work forked from the capture stream and joined back later, as the serving engine
    overlaps the indexer): the side stream is joined into the capture stream before the segment ends (CUDA
    refuses to end a capture with unjoined work), and forked from it again once the next segment has begun,
    so that what the side stream does next is captured and joins back as the caller wrote it."""

    def __init__(self, pool=None, stream=None):
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = stream if stream is not None else capture_stream()

    def begin(self):
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool)
        if side != self.stream:  # an eager break on a side stream: fork it from the new segment
            side.wait_stream(self.stream)
        return g

    def end(self, g) -> None:
        side = torch.cuda.current_stream()
        if side != self.stream:  # join the side stream's captured work before the segment ends
            self.stream.wait_stream(side)
        with torch.cuda.stream(self.stream):
            g.capture_end()

    @contextlib.contextmanager
    def capturing(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def abort(self, g) -> None:
        with contextlib.suppress(Exception):
            g.capture_end()
        with contextlib.suppress(Exception):
            g.reset()


# ---- capture -------------------------------------------------------------------------------------------

@dataclass
class _EagerCall:
    fn: Callable
    name: str
    args: tuple
    kwargs: dict


@dataclass
class BreakableGraph:
    """The result of a capture: segments to replay in order (a graph, or an eager call)."""

    entries: list = field(default_factory=list)  # each: ("graph", graph) or ("eager", _EagerCall)

    @property
    def num_graphs(self) -> int:
        return sum(kind == "graph" for kind, _ in self.entries)

    @property
    def pattern(self) -> str:
        """'G E G E G': the order of graph segments and eager regions."""
        return " ".join("G" if kind == "graph" else "E" for kind, _ in self.entries)

    def replay(self) -> None:
        for kind, item in self.entries:
            if kind == "graph":
                item.replay()
            else:
                with eager_range(item.name):  # host time per eager region, only while measuring
                    item.fn(*item.args, **item.kwargs)

    def replay_timed(self) -> list[float]:
        """replay(), returning the host time of each entry in microseconds, in order (a graph segment's launch,
        an eager region's call): what the host spends per segment and per region."""
        times = []
        for kind, item in self.entries:
            t0 = time.perf_counter_ns()
            if kind == "graph":
                item.replay()
            else:
                item.fn(*item.args, **item.kwargs)
            times.append((time.perf_counter_ns() - t0) / 1e3)
        return times

    def eager_names(self) -> list[str]:
        """The eager regions' names, in replay order."""
        return [item.name for kind, item in self.entries if kind == "eager"]

    def reset(self) -> None:
        """Release the graphs (and so their pool memory, once no other graph holds it)."""
        for kind, item in self.entries:
            if kind == "graph" and hasattr(item, "reset"):
                item.reset()
        self.entries.clear()


class BreakableCapture:
    """`with BreakableCapture(backend) as cap: out = model(...)`; then `cap.graph.replay()`."""

    def __init__(self, backend=None, name: str = "capture"):
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.name = name
        self.graph = BreakableGraph()
        self._open = None  # the graph segment being captured, None inside an eager region
        self.segments_begun = 0

    @property
    def segment_open(self) -> bool:
        """True while a graph segment is being captured; False inside an eager region (work runs directly)."""
        return self._open is not None

    def __enter__(self) -> "BreakableCapture":
        if current_capture() is not None:
            raise CaptureError(f"{self.name}: a breakable capture is already active on this thread "
                               f"({current_capture().name}); captures do not nest")
        self._ctx = self.backend.capturing() if hasattr(self.backend, "capturing") else contextlib.nullcontext()
        self._ctx.__enter__()
        _state.capture = self
        try:
            self._begin()
        except BaseException:
            _state.capture = None
            self._ctx.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self._close_segment()
            else:  # leave nothing half-captured: end the open segment and drop every graph
                if self._open is not None:
                    self.backend.abort(self._open)
                    self._open = None
                self.graph.reset()
        finally:
            _state.capture = None
            self._ctx.__exit__(exc_type, exc, tb)
        return False

    def _close_segment(self) -> None:
        g, self._open = self._open, None
        self.backend.end(g)
        self.graph.entries.append(("graph", g))
        # Run the captured work once, so the eager region that follows sees real inputs. A backend whose ops
        # already ran while they were recorded (the CPU stand-in) must not run them a second time: an in-place
        # op would then be applied twice, unlike on a GPU, where capture runs nothing.
        if not getattr(self.backend, "runs_ops_during_capture", False):
            g.replay()

    def _begin(self) -> None:
        self._open = self.backend.begin()
        self.segments_begun += 1

    def run_eager(self, fn: Callable, name: str, args: tuple, kwargs: dict):
        self._close_segment()
        out = fn(*args, **kwargs)
        _check_no_new_tensors(name, out, args, kwargs)
        a, k = _alias_args(args, kwargs)
        self.graph.entries.append(("eager", _EagerCall(fn, name, a, k)))
        self._begin()
        return out


def _storages(objs) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _tensors(objs) if t.numel()}


def _check_no_new_tensors(name: str, out: Any, args: tuple, kwargs: dict) -> None:
    known = _storages((args, kwargs))
    for o in _tensors(out):  # nested in containers too
        if o.numel() and o.untyped_storage().data_ptr() not in known:
            raise CaptureError(
                f"eager region {name!r} returned a tensor of shape {list(o.shape)} that it allocated itself: "
                f"under a breakable graph it would live at a new address on every replay. Write into a "
                f"buffer the caller passes in instead.")


def maybe_execute_in_parallel(fn0: Callable, fn1: Callable, event0, event1, aux_stream=None):
    """(fn0(), fn1()) with fn1 on `aux_stream`, overlapped with fn0 (vLLM's helper, in its order): event0 is
    recorded on the current stream, fn0 runs there; the aux stream waits on event0, runs fn1 and records
    event1; the current stream waits on event1. Without an aux stream, fn0 then fn1.

    Under a breakable capture, when fn0 crossed an eager break, event0 belongs to a finished graph segment and
    CUDA refuses a wait on it from the next one: the aux stream then forks from the current segment instead
    (wait_stream). fn1 starts after the eager region rather than beside it; every value is what eager
    execution computes, since fn1 read nothing fn0 wrote."""
    if aux_stream is None:
        return fn0(), fn1()
    cap = current_capture()
    begun = cap.segments_begun if cap is not None else None
    main = torch.cuda.current_stream()
    event0.record(main)
    r0 = fn0()
    with torch.cuda.stream(aux_stream):
        if cap is not None and cap.segments_begun != begun:
            aux_stream.wait_stream(main)
        else:
            event0.wait(aux_stream)
        r1 = fn1()
        event1.record(aux_stream)
    event1.wait(main)
    return r0, r1


def eager_break(fn: Callable | None = None, *, name: str | None = None):
    """Mark a function as an eager region: it ends the current graph segment during a breakable capture."""

    def wrap(f):
        label = name or f.__qualname__

        @functools.wraps(f)
        def inner(*args, **kwargs):
            cap = current_capture()
            if cap is None or not cap.segment_open or not getattr(_state, "breaks_enabled", True):
                return f(*args, **kwargs)  # no capture, nested inside an eager region, or FULL mode
            return cap.run_eager(f, label, args, kwargs)

        inner.__eager_break__ = True
        return inner

    return wrap(fn) if fn is not None else wrap
