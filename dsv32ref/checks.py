"""Input checks shared by the reference and the kernel launchers: a ValueError that names the tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_tensor", "check_same_device", "rel_err"]


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Raise ValueError naming `name` unless `t` is a tensor of the given shape/dtype/device.

    `shape` entries of None match any size. Returns `t`, so calls can be chained in assignments.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(e is None or e == a for e, a in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
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
    return t


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError listing every tensor's device unless they all live on one device."""
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len({d for d in devices.values()}) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors on different devices: {listing}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64: the comparator of every check in this project."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()
