"""How every launcher starts its kernel: `launch(kernel, grid, *args, **meta)`.

This is the seam through which a launch can be observed without touching the kernels: the CPU stand-in for
CUDA graphs records each launch to replay it, and the launch ledger's prediction counts launches without
running them. They register an observer for a block of code (`observing_launches`); nothing is patched.

An observer is called as `observer(name, run)`, where `name` is the kernel's function name and `run()` starts
the launch; what the observer returns is what the launch returns. With no observer the launch runs directly,
after one check of an empty list.
"""

from __future__ import annotations

import contextlib
import functools

__all__ = ["kernel_name", "launch", "observing_launches"]

_observers: list = []  # innermost last; process-wide, like the profiler


def kernel_name(kernel) -> str:
    """`_sparse_mla_kernel` for a Triton or Gluon kernel (the name a ledger counts it under)."""
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


def launch(kernel, grid, *args, **meta):
    """kernel[grid](*args, **meta), or hand it to the innermost observer."""
    if not _observers:
        return kernel[grid](*args, **meta)
    return _observers[-1](kernel_name(kernel), functools.partial(kernel[grid], *args, **meta))


@contextlib.contextmanager
def observing_launches(observer):
    """Inside this block, every kernel launch goes through observer(name, run) (see the module docstring)."""
    _observers.append(observer)
    try:
        yield observer
    finally:
        for i in range(len(_observers) - 1, -1, -1):
            if _observers[i] is observer:
                del _observers[i]
                break
