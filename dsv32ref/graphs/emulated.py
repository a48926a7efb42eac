"""A CPU stand-in for CUDA graphs, for teaching and for tests on machines without a GPU.

A CUDA graph is a recorded list of kernel launches whose arguments (pointers included) are frozen at
capture; replay relaunches them. `RecordingBackend` does the same on the CPU: while a segment is open it
records every kernel-launching aten op and every Triton launch (observed through dsv32ref.kernels.launch)
with the very tensors it was called on; `replay()` re-runs them in order, writing into the tensors captured
(the "pool"). Allocations and views record nothing, as in a real graph. Eager regions are not recorded: BreakableCapture runs them between
segments, as it does on a GPU.

Ops run while they are recorded (a GPU capture runs none), which gives the values a GPU's capture gives by
replaying each segment once at its end: the capture skips that replay for this backend
(`runs_ops_during_capture`), so an in-place op is applied once, as on a GPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dsv32ref.graphs.breakable import CaptureError
from dsv32ref.kernels.launch import observing_launches

# aten ops that launch no kernel (views, metadata, allocation, profiler markers)
NO_KERNEL_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "split", "split_with_sizes", "slice",
    "select", "unsqueeze", "squeeze", "as_strided", "empty", "empty_like", "new_empty", "empty_strided", "alias",
    "detach", "chunk", "unbind", "narrow", "lift_fresh", "_reshape_alias", "unflatten", "flatten",
    "is_same_size", "promote_types", "result_type", "sym_size", "sym_stride", "sym_numel", "_local_scalar_dense",
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",
}

# aten ops that read a device value back to the host (a sync) or size their output by the data: a CUDA capture
# refuses both, and a recording would freeze the value or the shape its capture saw
HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                 "unique_dim"}


def _masked_index(func, args) -> bool:
    """aten::index or index_put with a boolean mask (x[x > 0], x[x > 0] = v): the elements it reads or writes are
    as many as the mask's True values. (.tolist() reads values back without an aten op: not caught here.)"""
    return func.overloadpacket.__name__ in ("index", "index_put", "index_put_") and len(args) > 1 and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


class RecordedGraph:
    def __init__(self):
        self.ops: list = []  # (label, closure)

    def replay(self) -> None:
        for _, op in self.ops:
            op()

    def reset(self) -> None:
        self.ops.clear()

    @property
    def num_ops(self) -> int:
        return len(self.ops)


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in HOST_SYNC_OPS or _masked_index(func, args):
            raise CaptureError(f"aten::{func.overloadpacket.__name__} inside a graph segment: it reads a device "
                               f"value back to the host (or sizes its output by one), which a CUDA capture "
                               f"refuses; move it to an eager region or out of the captured forward")
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ not in NO_KERNEL_OPS:
            def rerun(func=func, args=args, kwargs=kwargs, out=out):
                res = func(*args, **kwargs)
                for item in res if isinstance(res, (tuple, list)) else (res,):
                    if hasattr(item, "wait"):  # a collective (c10d op) returns its work handle: finish it
                        item.wait()
                _copy_into(out, res)  # results land in the captured output tensors

            self.graph.ops.append((f"aten::{func.overloadpacket.__name__}", rerun))
        return out


def _quiet(run):
    """Launch with the recorder suspended: the interpreter's own tensor ops are not the model's launches."""
    with _disable_current_modes():
        return run()


class RecordingBackend:
    """Graph backend for BreakableCapture on the CPU (see the module docstring)."""

    runs_ops_during_capture = True

    def __init__(self):
        self._mode = None
        self._launches = None

    def begin(self) -> RecordedGraph:
        g = RecordedGraph()

        def on_launch(name, run):  # a Triton launch: recorded with its arguments, then run
            g.ops.append((f"triton::{name}", lambda: _quiet(run)))
            return _quiet(run)

        self._launches = observing_launches(on_launch)
        self._launches.__enter__()
        self._mode = _Recorder(g)
        self._mode.__enter__()
        return g

    def end(self, g: RecordedGraph) -> None:
        self._stop()

    def abort(self, g: RecordedGraph) -> None:
        self._stop()
        g.reset()

    def _stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._launches is not None:
            self._launches.__exit__(None, None, None)
            self._launches = None
