"""Named regions and profiler ranges that cost nothing unless a measurement is being taken.

The launch ledger attributes every kernel launch to the innermost named region around it: `region(name)`
marks one (`dsv32ref::<name>` in a torch.profiler trace, and a thread-local stack the CPU ledger reads), and
`eager_range(name)` marks the host time of one eager region at replay (`eager::<name>`).

`torch.profiler.record_function` is not free when no profiler runs: it dispatches two aten ops per range, and
an engine step opens hundreds. So both markers are off by default and return one shared no-op context
manager; `measuring()` turns them on for the requests a ledger profiles. TTFT is timed with them off, and
the TTFT experiment measures what they cost either way (`dsv32ref ttft --instrument-ab`).

`timing_regions()` turns the named regions into host timers instead (no profiler range): each region's host
time per entry, collected into a dict, for the TTFT model's per-launcher costs.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

__all__ = ["measuring", "is_measuring", "region", "current_region", "eager_range", "timing_regions"]

_local = threading.local()


class _Off:
    """The no-op context manager of every region while not measuring. Its __enter__ and __exit__ are
    C-level callables, so entering and leaving it runs no Python frame: `tuple()` returns (), and
    `"".format(exc_type, exc, tb)` returns "", which is falsy, so exceptions propagate. About half the
    host cost of contextlib.nullcontext, which matters at hundreds of regions per step."""

    __slots__ = ()
    __enter__ = tuple
    __exit__ = "".format


_NULL = _Off()


class _State:
    on = False  # process-wide, like the profiler itself
    mode = None  # None (off), "profile" (measuring) or "timer" (timing_regions): the one check a region makes
    times: dict | None = None


_state = _State()


def is_measuring() -> bool:
    return _state.on


@contextlib.contextmanager
def measuring(on: bool = True):
    """Open the named regions and eager ranges inside this block (for a profiled request or a CPU ledger)."""
    old = _state.on, _state.mode
    _state.on, _state.mode = on, "profile" if on else None
    try:
        yield
    finally:
        _state.on, _state.mode = old


class _Region:
    __slots__ = ("name", "_range")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self.name)
        self._range = torch.profiler.record_function(f"dsv32ref::{self.name}")
        self._range.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._range.__exit__(*exc)
        finally:
            _local.stack.pop()
        return False


class _TimedRegion:
    __slots__ = ("name", "_t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        _state.times.setdefault(self.name, []).append((time.perf_counter_ns() - self._t0) / 1e3)
        return False


@contextlib.contextmanager
def timing_regions():
    """Inside this block every named region records its host time: yields {name: [microseconds per entry]}."""
    old = _state.on, _state.mode, _state.times
    _state.on, _state.mode, _state.times = False, "timer", {}
    try:
        yield _state.times
    finally:
        _state.on, _state.mode, _state.times = old


def region(name: str):
    """`with region("attention"): ...`: a named region while measuring, a host timer inside timing_regions(),
    else a shared no-op."""
    if _state.mode is None:
        return _NULL
    return _Region(name) if _state.mode == "profile" else _TimedRegion(name)


def current_region() -> str:
    """The innermost open region ('other' outside every region or when not measuring)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else "other"


def eager_range(name: str):
    """The profiler range around one eager region's replay (host time per eager region), while measuring."""
    return torch.profiler.record_function(f"eager::{name}") if _state.on else _NULL
