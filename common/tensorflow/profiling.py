"""--profile in TensorFlow: tf.profiler over the window common/loop.py chooses, a trace for
TensorBoard, and the operations' self times for the table (common/profiling.py), read from
the trace itself (common/pytorch/profiling.py is the twin)."""
from __future__ import annotations

import collections
import re
from pathlib import Path

import tensorflow as tf

from common.flags import shell_word
from common.profiling import OperationRow


class Profiler:
    clock = "host time"  # the ops' time on the host's threads: on a CPU, all of it

    def start(self, folder: Path):
        tf.profiler.experimental.start(str(folder))

    def stop(self, folder: Path) -> tuple[list[OperationRow], str]:
        tf.profiler.experimental.stop()
        trace = max(folder.glob("plugins/profile/*/*.xplane.pb"), key=lambda path: path.stat().st_mtime)
        return (host_operations(trace),
                f"TensorBoard trace in {folder} (tensorboard --logdir {shell_word(folder)}, Profile tab; "
                "needs tensorboard-plugin-profile)")


def host_operations(trace: Path) -> list[OperationRow]:
    """(operation, calls, self ms) of what the host ran in a TensorFlow profiler trace.

    The trace is an XSpace protobuf (its schema ships with TensorFlow). Executor threads hold
    one event per op run, named "scope/op_name:OpType"; under --xla, the compiled step's HLO
    instructions ("convolution.1", "MatMul_1") run inside ThunkExecutor::Execute spans and
    are counted by kind ("XLA convolution"). An event's time inside another counted event
    (an op calling a function, a loop's body) is taken off the outer one. On a GPU these are
    the host's times; the kernels are in the trace itself.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    calls, self_ps = collections.Counter(), collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            enclosing = []  # (end, label or None, is an XLA executor) of the open events
            for event in sorted(line.events, key=lambda e: (e.offset_ps, -e.duration_ps)):
                while enclosing and enclosing[-1][0] <= event.offset_ps:
                    enclosing.pop()
                metadata = plane.event_metadata[event.metadata_id]
                name, op_type = metadata.name, metadata.display_name
                if op_type and name.endswith(":" + op_type):
                    label = op_type
                elif "::" not in name and not name.startswith("end: ") and any(
                        executor for _, _, executor in enclosing):  # "end: X": a marker, not an op
                    label = "XLA " + re.sub(r"(?:[._]\d+)+$", "", name)  # "MatMul_1.36", "fusion.3": by kind
                else:
                    label = None  # executor bookkeeping
                if label:
                    outer = next((outer for _, outer, _ in reversed(enclosing) if outer), None)
                    if outer:
                        self_ps[outer] -= event.duration_ps
                    calls[label] += 1
                    self_ps[label] += event.duration_ps
                enclosing.append((event.offset_ps + event.duration_ps, label,
                                  name == "ThunkExecutor::Execute"))
    return [(label, calls[label], self_ps[label] / 1e9) for label in calls]
