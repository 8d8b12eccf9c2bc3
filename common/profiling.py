"""The profiled window and the table of top operations, the same for both frameworks; each
framework's profiler (common/pytorch/profiling.py, common/tensorflow/profiling.py) hands in
(operation, calls, self milliseconds) rows."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

WARMUP_STEPS = 5  # steps after the start before the profiled window (tracing, allocator)
PROFILED_STEPS = 10
TOP_OPS = 15  # rows of the table

OperationRow = tuple[str, int, float]  # (operation, calls, self milliseconds) over the window


class Profiler(Protocol):
    """A framework's profiler over the window (common/pytorch/profiling.py,
    common/tensorflow/profiling.py)."""

    clock: str  # what its times measure, for the table's title: "CPU time", "CUDA kernel time", "host time"

    def start(self, folder: Path) -> None: ...

    def stop(self, folder: Path) -> tuple[list[OperationRow], str]:
        """The window's operations and a line saying where the trace is."""


def format_top_ops(rows: list[OperationRow], steps: int, clock: str = "time") -> str:
    """The operations with the most self time (`clock`: what was timed) over `steps` profiled
    steps, per step."""
    if not rows:
        return f"the profiler recorded no operations over {steps} steps (see the trace)"
    rows = sorted(rows, key=lambda row: -row[2])
    total = sum(ms for _, _, ms in rows)
    shown = [(name if len(name) <= 60 else name[:57] + "...", calls, ms) for name, calls, ms in rows[:TOP_OPS]]
    width = max([len(name) for name, _, _ in shown] + [len("operation")])
    lines = [f"top operations by self {clock} over {steps} profiled step{'s' * (steps != 1)} "
             f"({total / steps:.2f} ms/step in operations)",
             f"  {'operation':<{width}}  {'calls/step':>10}  {'ms/step':>8}  {'share':>6}"]
    lines += [f"  {name:<{width}}  {calls / steps:>10.1f}  {ms / steps:>8.3f}  {ms / total:>6.1%}"
              for name, calls, ms in shown]
    return "\n".join(lines)
