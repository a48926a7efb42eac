"""Input checks shared by the reference and the kernel launchers: a ValueError that names the tensor."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Sequence

import torch

__all__ = ["check_tensor", "check_same_device", "check_disjoint", "check_eps", "check_fits", "check_int", "check_keys",
           "check_range", "check_replaceable", "device_memory_bytes", "module_bytes", "check_rope_table", "check_scale",
           "check_fp32_scale", "shown", "checking_device_values", "device_value_checks_on", "is_int", "is_number",
           "is_finite_number", "rel_err"]


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
    dense_dims: int = 0,
) -> torch.Tensor:
    """Raise ValueError naming `name` unless `t` is a tensor of the given shape/dtype/device.

    `shape` entries of None match any size; a leading `...` matches any number of leading dims.
    `dense_dims=k`: the last k dims must be laid out row-major without gaps (what a kernel assumes for the
    strides it is not passed; a dim of size 1 may have any stride).
    A tensor on the meta device is refused (no values: a check of them would fail inside torch).
    Returns `t`, so calls can be chained in assignments.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        lead = len(shape) > 0 and shape[0] is Ellipsis  # [..., a, b]: any leading dims, then a, b
        tail = tuple(shape[1:]) if lead else tuple(shape)
        dims = tuple(t.shape[t.dim() - len(tail):]) if t.dim() >= len(tail) else None
        ok = dims is not None and (lead or t.dim() == len(tail)) and all(e is None or e == a for e, a in zip(tail, dims))
        if not ok:
            want = "[" + ", ".join("..." if e is Ellipsis else "*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name}: expected dtype {want}, got {t.dtype}")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name}: expected device {torch.device(device).type}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if t.is_meta:  # (after the device check: beside a tensor on the cpu, that is what is wrong with it)
        raise ValueError(f"{name}: a tensor on the meta device holds no values to compute with")
    if dense_dims and t.numel():  # no element, no layout to get wrong (a trailing 0 made every stride "wrong")
        want, step = [], 1
        for d in range(t.dim() - 1, t.dim() - 1 - min(dense_dims, t.dim()), -1):
            if t.shape[d] > 1 and t.stride(d) != step:
                dims = "the last dim" if dense_dims == 1 else f"the last {dense_dims} dims"
                raise ValueError(f"{name}: {dims} must be dense (stride {step} at dim {d}), got strides "
                                 f"{t.stride()} for shape {list(t.shape)}")
            step *= t.shape[d]
    return t


def is_int(v) -> bool:
    """An int that is not a bool (True is an int to Python, never a size or an id here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


MAX_SEED = 2 ** 63 - 1  # seeds are ints in [0, MAX_SEED]: torch's generators take them modulo 2^63


def check_int(name: str, v, low: int = 1, high: int | None = None) -> int:
    """An int >= low (and <= high): else ValueError naming `name` and what it got."""
    if not is_int(v):
        raise ValueError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    if v < low or (high is not None and v > high):
        raise ValueError(f"{name}: expected {f'an int in [{low}, {high}]' if high is not None else f'>= {low}'}, "
                         f"got {v}")
    return v


def check_bool(name: str, v) -> bool:
    """A bool (not a truthy string or an int): else ValueError naming `name`."""
    if not isinstance(v, bool):
        raise ValueError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
    return v


def shown(v) -> str:
    """v's repr for a message; past 40 characters its first 24 and its length (a 309-digit int is not 1.8e39)."""
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:24]}... ({len(r)} characters)"


def is_finite_number(v) -> bool:
    """An int or float (not a bool) that is finite as a float (an int past float's range is not)."""
    try:
        return is_number(v) and math.isfinite(v)
    except OverflowError:
        return False


def check_scale(name: str, v) -> float:
    """A finite, positive float (a softmax or norm scale): else ValueError naming it."""
    if not (is_finite_number(v) and v > 0):
        raise ValueError(f"{name}: expected a finite number > 0, got {shown(v)}")
    return float(v)


FP32_MAX = 3.4028234663852886e38
FP32_TINY = 2.0 ** -149  # float32's smallest subnormal: anything smaller rounds to 0


def check_fp32_scale(name: str, v, factor: float = 1.0) -> float:
    """check_scale, and v x factor (what a kernel multiplies by, in float32) neither infinite nor 0 there: a scale
    of 1e308 would make every score inf (and the softmax NaN), one of 1e-50 every score 0."""
    scale = check_scale(name, v)
    if not FP32_TINY <= scale * factor <= FP32_MAX:
        what = "a value" if factor == 1 else f"a value whose product with {factor:.6g} lies"
        raise ValueError(f"{name}: expected {what} within float32's range [{FP32_TINY:.3g}, "
                         f"{FP32_MAX:.4g}] (the kernel computes in it), got {shown(v)}")
    return scale


def check_compute_scale(name: str, v, dtype: torch.dtype) -> float:
    """A reference's softmax scale, applied in dtype promoted to fp32: in float64 check_scale, else
    check_fp32_scale (a scale float32 cannot hold would give NaN or uniform attention)."""
    if torch.promote_types(dtype, torch.float32) == torch.float64:
        return check_scale(name, v)
    return check_fp32_scale(name, v)


def check_eps(name: str, v) -> float:
    """A norm's epsilon: a finite number > 0 that stays > 0 and finite in float32, where the norms compute (1e-50
    is 0 there, and a zero row would then be NaN): else ValueError naming it."""
    eps = check_scale(name, v)
    if not FP32_TINY <= eps <= FP32_MAX:
        raise ValueError(f"{name}: expected a value > 0 in float32 and finite there (the norms compute in it), got "
                         f"{shown(v)}")
    return eps


def check_rope_table(launcher: str, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """cos/sin fp32 [max_pos >= 1, rope/2] with the same strides (a kernel indexes both with cos's); returns rope."""
    check_tensor("cos", cos, shape=(None, None), dtype=torch.float32, dense_dims=1)
    if cos.shape[0] < 1:
        raise ValueError(f"{launcher}: cos/sin must hold at least one position, got shape {list(cos.shape)}")
    check_tensor("sin", sin, shape=tuple(cos.shape), dtype=torch.float32, dense_dims=1)
    if sin.stride() != cos.stride():
        raise ValueError(f"{launcher}: sin must have cos's strides {cos.stride()}, got {sin.stride()}")
    return 2 * cos.shape[1]


def check_keys(name: str, given: dict | None, allowed) -> None:
    """`given` is None or a dict whose keys are all in `allowed`: else ValueError naming every other key (a typo
    must not pass silently) or what was given instead of a dict."""
    if given is None:
        return
    if not isinstance(given, dict):
        raise ValueError(f"{name}: expected None or a dict, got {type(given).__name__} {shown(given)}")
    unknown = sorted((k for k in given if k not in allowed), key=repr)  # repr: keys of any types sort
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")


class _DeviceChecks:
    on = os.environ.get("DSV32REF_CHECK_DEVICE_VALUES", "") not in ("", "0")


_device_checks = _DeviceChecks()


def device_value_checks_on() -> bool:
    return _device_checks.on


@contextlib.contextmanager
def checking_device_values(on: bool = True):
    """Debug mode: launchers read back the device-side metadata they index with (positions, slots, block ids,
    sequence lengths, request indices) and raise ValueError naming any value out of range, before launching;
    they also refuse outputs that overlap their inputs, each other or themselves (host time on every call).

    Off by default: it synchronises with the device (no use inside a CUDA graph capture). Without it the
    kernels still never read or write out of bounds (they mask such values; see each launcher), but a
    result computed from a bad value is meaningless. Also on for the whole process with
    DSV32REF_CHECK_DEVICE_VALUES=1."""
    old, _device_checks.on = _device_checks.on, on
    try:
        yield
    finally:
        _device_checks.on = old


def check_range(name: str, t: torch.Tensor | None, low: int, high: int, what: str) -> None:
    """Debug mode only: every value of `t` in [low, high), else ValueError naming `name` and `what` bounds it."""
    if t is None or not t.numel() or not _device_checks.on:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        raise ValueError(f"{name}: values must lie in [{low}, {high}) ({what}), got [{lo}, {hi}]")


def check_device(name: str, device) -> torch.device:
    """A cpu or cuda device (what this package runs on) that torch can place tensors on here: else ValueError naming
    `name` (not torch's assertion). The meta device is refused too: tensors there hold no values."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}: expected a device such as 'cpu' or 'cuda:0', got {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a cpu or cuda device, got {dev}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{name}: {dev} is not available here ({torch.cuda.device_count()} CUDA devices)")
    return dev


def device_memory_bytes(device: torch.device) -> int:
    """What `device` holds in all: a GPU's memory, or for the cpu the machine's physical memory within this
    process's cgroup limit (where Linux sets one)."""
    if device.type == "cuda":
        return _memory_bytes("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return _memory_bytes("cpu", None)


@functools.lru_cache(maxsize=None)
def _memory_bytes(kind: str, index: int | None) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(index).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):  # cgroup v2's limit: a number, or "max" for none
        with open("/sys/fs/cgroup/memory.max") as f:
            total = min(total, int(f.read()))
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes a module's parameters (each shared one once) and buffers hold."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def check_fits(name: str, nbytes: int, device: torch.device) -> None:
    """An allocation of nbytes on `device` that could fit there: else ValueError naming `name` and both sizes,
    before torch tries (a cache or a model sized by a typo would otherwise fail in the allocator, or on the cpu
    be granted and then fill the machine's memory as its zeros are written)."""
    total = device_memory_bytes(device)
    if nbytes > total:
        raise ValueError(f"{name}: needs {nbytes / 2 ** 30:.1f} GiB, more than {device} holds in all "
                         f"({total / 2 ** 30:.1f} GiB)")


def check_readable(name: str, path: str) -> None:
    """A file about to be read: nothing there (the reader says what is missing) or a regular file. A FIFO, device
    or folder is refused (a FIFO's read never ends)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{name}: {path!r} is not a regular file")


def check_replaceable(name: str, path: str) -> None:
    """A file about to be written by replacing what is at `path`, links followed (write_atomic renames over the
    link's target): nothing there, or a regular file. A device, FIFO or folder there is refused (renaming over
    /dev/null would put a file in its place)."""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        raise ValueError(f"{name}: {path!r} exists and is not a regular file; a result replaces the file at its path")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first argument that is not a tensor (None: absent), or listing every tensor's
    device unless they all live on one device."""
    for n, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len({d for d in devices.values()}) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors on different devices: {listing}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, end) from t's first element to its last (empty: an empty span)."""
    if not t.numel():
        return 0, 0
    first = last = 0
    for n, s in zip(t.shape, t.stride()):
        if s < 0:
            first += (n - 1) * s
        else:
            last += (n - 1) * s
    size = t.element_size()
    return t.data_ptr() + size * first, t.data_ptr() + size * (last + 1)


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two of t's elements share memory (an expanded or otherwise aliasing view): by stride, each dim must
    step past everything the smaller-stride dims reach (a sufficient test: it can refuse exotic layouts that do not
    overlap)."""
    if not t.numel():
        return False
    reach = 0
    for s, n in sorted((abs(s), n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if s <= reach:
            return True
        reach += s * (n - 1)
    return False


def check_disjoint(launcher: str, outputs: dict, inputs: dict) -> None:
    """Each output's bytes (None: absent) overlap no input's and no other output's, and no output's elements share
    memory among themselves: a ValueError naming them. Spans are compared (the bytes from a tensor's first element
    to its last), so interleaved views of one buffer count as overlapping."""
    outputs = {name: t for name, t in outputs.items() if t is not None}
    spans = [(name, *_span(t)) for name, t in outputs.items()]
    for name, t in outputs.items():
        if _self_overlapping(t):
            raise ValueError(f"{launcher}: {name} has elements that share memory (shape {list(t.shape)}, strides "
                             f"{list(t.stride())}); pass a tensor whose elements are distinct")
    others = spans + [(name, *_span(t)) for name, t in inputs.items() if t is not None]
    for i, (name, a0, a1) in enumerate(spans):
        for other, b0, b1 in others[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{launcher}: {name} overlaps {other} in memory; pass separate tensors")


def check_slots(name: str, slot_mapping: torch.Tensor, n_slots: int) -> None:
    """Flat cache slots: each in [0, n_slots) and none twice (index_copy_ would keep one of two rows for a slot,
    which one unspecified on a GPU): else a ValueError naming `name`."""
    if slot_mapping.numel() and (int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= n_slots):
        raise ValueError(f"{name}: slots must lie in [0, {n_slots}), got [{int(slot_mapping.min())}, "
                         f"{int(slot_mapping.max())}]")
    slots, counts = torch.unique(slot_mapping, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{name}: each slot at most once, got slots {slots[counts > 1][:4].tolist()} "
                         f"{int(counts.max())} times")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64: the comparator of every check in this project."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()
