"""What launchers size and chain their grids by: the streaming-multiprocessor count (split the work only while SMs
idle), and whether a launch may overlap the one before it (programmatic dependent launch); and how a kernel's
matrix products are taken where it runs (`dot_precision`, `mma`)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv32ref.checks import is_int

# Assumed when the tensors are not on a GPU and the caller names none (interpreter runs). The launch-ledger
# prediction passes the H200's 132, so that it splits the work the way the GPU will.
CPU_SMS = 4


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


def num_sms(device: torch.device, override: int | None, caller: str) -> int:
    """`override` if given (an int >= 1), else the device's SM count (CPU_SMS for CPU tensors)."""
    if override is not None:
        if not is_int(override) or override < 1:
            raise ValueError(f"{caller}: num_sms must be None or an int >= 1, got {override!r}")
        return int(override)
    return _cuda_sms(device.index) if device.type == "cuda" else CPU_SMS


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device ((9, 0): Hopper), None for any other device."""
    return _cuda_capability(device.index) if device.type == "cuda" else None


def pdl(device: torch.device, override: bool | None, caller: str) -> bool:
    """Whether to launch with programmatic dependent launch (sm_90 on; never under the interpreter): a kernel so
    launched may start while the kernel before it runs, and waits (griddepcontrol.wait) before it reads what
    that one wrote. `override` if given (True only where the device has it), else wherever it has it."""
    supported = device.type == "cuda" and cuda_capability(device) >= (9, 0)
    if override is None:
        return supported
    if not isinstance(override, bool):
        raise ValueError(f"{caller}: pdl must be None, True or False, got {override!r}")
    if override and not supported:
        raise ValueError(f"{caller}: pdl=True needs a CUDA device of compute capability >= 9.0, got {device}")
    return override


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """How `mma` multiplies tiles of dtype: "ieee" for fp32; "tf32" (the operands' own MMA: bf16 and fp16 on a
    GPU); "upcast" for bf16 tiles under the interpreter (CPU tensors), whose tl.dot on bf16 operands returns
    garbage: they are multiplied in fp32 instead, where every bf16 product is exact."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if dtype == torch.bfloat16 and device.type != "cuda" else "tf32"


@triton.jit
def mma(a, b, PRECISION: tl.constexpr):
    """tl.dot(a, b) with fp32 accumulation, PRECISION from `dot_precision`. fp8 x fp8: sm_90's MMA accumulates
    8-bit products at reduced precision (about 14 bits), so the sum is promoted to fp32 after every K = 32 step."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype.is_fp8():
        return tl.dot(a, b, max_num_imprecise_acc=32)
    else:
        return tl.dot(a, b, input_precision=PRECISION)
