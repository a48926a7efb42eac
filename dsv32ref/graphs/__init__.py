"""Breakable CUDA graphs and the runner that captures a model per token count and mode."""

from dsv32ref.graphs.breakable import (BreakableCapture, BreakableGraph, CaptureError, CudaGraphBackend,
                                       current_capture, eager_break, eager_breaks_enabled, maybe_execute_in_parallel,
                                       weak_alias)
from dsv32ref.graphs.runner import CUDAGraphMode, GraphRunner, default_capture_sizes

__all__ = ["BreakableCapture", "BreakableGraph", "CUDAGraphMode", "CaptureError", "CudaGraphBackend", "GraphRunner",
           "current_capture", "default_capture_sizes", "eager_break", "eager_breaks_enabled",
           "maybe_execute_in_parallel", "weak_alias"]
