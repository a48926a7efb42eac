"""Named regions and profiler ranges that cost nothing unless a measurement is being taken.

The launch ledger attributes every kernel launch to the innermost named region around it: `region(name)`
marks one (`dsv32ref::<name>` in a torch.profiler trace, and a thread-local stack the CPU ledger reads), and
`eager_range(name)` marks the host time of one eager region at replay (`eager::<name>`).

`torch.profiler.record_function` is not free when no profiler runs: it dispatches two aten ops per range, and
an engine step opens hundreds. So both markers are off by default and return one shared no-op context
manager; `measuring()` turns them on for the requests a ledger profiles. TTFT is timed with them off, and
the TTFT experiment measures what they cost either way (`dsv32ref ttft --instrument-ab`).
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["measuring", "is_measuring", "region", "current_region", "eager_range"]

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


_state = _State()


def is_measuring() -> bool:
    return _state.on


@contextlib.contextmanager
def measuring(on: bool = True):
    """Open the named regions and eager ranges inside this block (for a profiled request or a CPU ledger)."""
    old, _state.on = _state.on, on
    try:
        yield
    finally:
        _state.on = old


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


def region(name: str):
    """`with region("attention"): ...`: a named region while measuring, else a shared no-op."""
    return _Region(name) if _state.on else _NULL


def current_region() -> str:
    """The innermost open region ('other' outside every region or when not measuring)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else "other"


def eager_range(name: str):
    """The profiler range around one eager region's replay (host time per eager region), while measuring."""
    return torch.profiler.record_function(f"eager::{name}") if _state.on else _NULL
