"""Capture a forward per token count, in the serving engine's modes, and replay the right one per step.

Modes (vLLM's CUDAGraphMode):
    NONE                 everything eager
    PIECEWISE            breakable graphs: graph segments between the eager regions (prefill, mixed batches)
    FULL                 one graph per size with the eager regions captured too (needs graph-safe attention:
                         uniform decode)
    FULL_AND_PIECEWISE   FULL for uniform-decode steps, PIECEWISE for the rest (the engine's default)
Capture sizes default to [1, 2, 4] + 8..248 step 8 + 256..max step 16. Sizes are captured largest first,
PIECEWISE before FULL, all into one memory pool: a smaller capture reuses what a larger one freed.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from dsv32ref.graphs.breakable import BreakableCapture, BreakableGraph, CaptureError, eager_breaks_enabled


class CUDAGraphMode(enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_full(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE)


def default_capture_sizes(max_size: int = 512) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def phase_sizes(mode: CUDAGraphMode, capture_sizes: list[int], max_full_size: int | None = None,
                full_serves_all: bool = False) -> list[tuple[str, list[int]]]:
    """[(phase, sizes largest first)] in capture order: PIECEWISE (every size), then FULL (sizes up to
    max_full_size: uniform decode has at most one token per sequence). With `full_serves_all` (a model
    with no eager break) FULL graphs serve every step, so FULL takes every size and PIECEWISE, which would
    capture the same graphs, is skipped."""
    sizes = sorted(set(capture_sizes), reverse=True)
    out = [("PIECEWISE", sizes)] if mode.has_piecewise and not (full_serves_all and mode.has_full) else []
    if mode.has_full:
        out.append(("FULL", [s for s in sizes if full_serves_all or max_full_size is None or s <= max_full_size]))
    return out


@dataclass
class _Captured:
    graph: BreakableGraph
    output: Any


@dataclass
class GraphRunner:
    """Owns the captured graphs of one model.

    forward(size, uniform_decode) runs the model on the static input buffers of `size` tokens (the caller
    fills them before each replay; `prepare(size, uniform_decode)` fills them before each capture) and
    returns the static output. `backend_factory()` returns a graph
    backend sharing one pool across every capture.
    """

    forward: Callable[[int, bool], Any]
    mode: CUDAGraphMode
    capture_sizes: list[int]
    backend_factory: Callable[[], Any]
    piecewise: dict[int, _Captured] = field(default_factory=dict)
    full: dict[int, _Captured] = field(default_factory=dict)
    on_capture: Callable[[str, int], None] | None = None  # progress / memory ledger hook (phase, size)
    max_full_size: int | None = None  # FULL graphs serve uniform decode: at most one token per sequence
    warmup: bool = True
    prepare: Callable[[int, bool], None] | None = None  # fills static inputs before a capture (host copies
    # are not allowed while capturing)
    full_serves_all: bool = False  # FULL graphs serve prefill and mixed steps too (no eager break)

    def __post_init__(self):
        self.capture_sizes = sorted(set(self.capture_sizes))

    def padded_size(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def phase_sizes(self) -> list[tuple[str, list[int]]]:
        return phase_sizes(self.mode, self.capture_sizes, self.max_full_size, self.full_serves_all)

    def capture_all(self) -> None:
        for phase, sizes in self.phase_sizes():
            for size in sizes:
                self.capture(phase, size)

    def capture(self, phase: str, size: int) -> None:
        full = phase == "FULL"
        if self.prepare is not None:
            self.prepare(size, full)
        try:
            if self.warmup:
                # one eager run first: kernels compile, libraries initialise their handles and workspaces,
                # none of which may happen while a stream is capturing
                with eager_breaks_enabled(not full):
                    self.forward(size, full)
            with eager_breaks_enabled(not full):
                with BreakableCapture(self.backend_factory(), name=f"{phase} capture of size {size}") as cap:
                    out = self.forward(size, full)
        except CaptureError:
            raise
        except Exception as e:  # out of memory, or anything else: say where, keep earlier graphs usable
            raise CaptureError(f"{phase} capture of size {size} failed: {type(e).__name__}: {e}") from e
        (self.full if full else self.piecewise)[size] = _Captured(cap.graph, out)
        if self.on_capture is not None:
            self.on_capture(phase, size)

    def lookup(self, num_tokens: int, uniform_decode: bool) -> tuple[str, int | None, _Captured | None]:
        """(how this step runs: 'FULL' / 'PIECEWISE' / 'NONE', padded size, the captured graph)."""
        size = self.padded_size(num_tokens)
        if size is None or self.mode is CUDAGraphMode.NONE:
            return "NONE", None, None
        if (uniform_decode or self.full_serves_all) and self.mode.has_full and size in self.full:
            return "FULL", size, self.full[size]
        if self.mode.has_piecewise and size in self.piecewise:
            return "PIECEWISE", size, self.piecewise[size]
        return "NONE", None, None

    @contextlib.contextmanager
    def using_mode(self, mode: CUDAGraphMode):
        """Steps inside this block run in `mode`, the captured graphs kept: NONE for an eager step of a captured
        engine, PIECEWISE to replay piecewise graphs where FULL ones would serve."""
        if not isinstance(mode, CUDAGraphMode):
            raise ValueError(f"using_mode: expected a CUDAGraphMode, got {mode!r}")
        old, self.mode = self.mode, mode
        try:
            yield self
        finally:
            self.mode = old

    def release(self) -> None:
        for table in (self.piecewise, self.full):
            for c in table.values():
                c.graph.reset()
            table.clear()
