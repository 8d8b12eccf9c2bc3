"""A quiet start for TensorFlow: every TensorFlow entry point calls quiet_tensorflow_start()
before it first imports tensorflow or keras. common/tensorflow/runtime.py then prints one line
of ours instead: TensorFlow's version, devices, oneDNN on/off and the C++ log level.

On a CPU-only machine TensorFlow 2.21 opened each run with nine lines of C++ logging, which
reach stderr by three routes, so one setting cannot quiet them all:

- The CPU feature guard's notice is logged after TensorFlow has read TF_CPP_MIN_LOG_LEVEL.
  Level 1 (our default) drops it, and every later INFO line; warnings and errors still show.
- "failed call to cuInit" (an ERROR) comes from probing the CUDA driver when devices are
  listed. On a Linux machine with no GPU driver of any kind, TF_ENABLED_DEVICE_TYPES=CPU skips
  the probe (CUDA_VISIBLE_DEVICES="" does not). With any driver present, nothing is changed.
- The oneDNN notice, "Could not find cuda drivers" and absl's "All log messages before
  absl::InitializeLog()" banner are logged while TensorFlow's libraries load (twice: the
  profiler plugin carries its own copy), before TF_CPP_MIN_LOG_LEVEL is read, so no setting
  reaches them. These exact lines are dropped from stderr while `import tensorflow` runs.
  Everything else written to stderr in that time passes through at once (a child process
  forwards it, so even a crash during the import loses nothing).

A user's own TF_CPP_MIN_LOG_LEVEL or TF_ENABLED_DEVICE_TYPES wins; TF_CPP_MIN_LOG_LEVEL=0
brings back TensorFlow's whole start-up log (nothing is set and nothing is dropped).
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import subprocess
import sys

LOG_LEVEL = "1"  # INFO off; WARNING, ERROR and FATAL shown

# Start-up lines no setting reaches, matched whole from their start (absl's "I<date> <time>
# <thread> <file>:<line>] " prefix, INFO only).
LOAD_NOTICES = (r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
                r"I[\d :.]+ port\.cc:\d+\] oneDNN custom operations are on\.")
NO_DRIVER_NOTICE = r"I[\d :.]+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"

# Where a GPU driver shows itself: NVIDIA, AMD ROCm, Intel and other DRM GPUs, WSL.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd", "/dev/dri", "/dev/dxg")

# The child process that forwards stderr: every line at once, except those matching argv[1].
FORWARD_STDERR = """\
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; keep forwarding until it lets go
drop = re.compile(sys.argv[1].encode())
for line in sys.stdin.buffer:
    if not drop.match(line):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
"""


def log_level() -> int:
    """TensorFlow's C++ log level as TensorFlow reads it (unset or not a number: 0)."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def describe_log_level() -> str:
    level = log_level()
    return f"C++ log level {level}" + (" (TF_CPP_MIN_LOG_LEVEL=0 shows all)" if level else "")


def gpu_driver_present() -> bool:
    """Whether TensorFlow could find a GPU here; outside Linux (Metal, ...) assume it could."""
    if not sys.platform.startswith("linux") or any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")  # a driver without a /proc or /dev entry (some containers)
    except OSError:
        return False
    return True


def quiet_tensorflow_start() -> None:
    """Set TensorFlow's log level and, without a GPU driver, its device types (unless the user
    has), and drop the load-time notices from the first `import tensorflow`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", LOG_LEVEL)
    if log_level() == 0 or "tensorflow" in sys.modules:
        return
    notices = LOAD_NOTICES
    if not gpu_driver_present():
        os.environ.setdefault("TF_ENABLED_DEVICE_TYPES", "CPU")
        notices += (NO_DRIVER_NOTICE,)
    if not any(isinstance(finder, _QuietImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuietImport("|".join(notices)))


class _QuietImport:
    """An import hook that finds nothing itself: it runs the first import of tensorflow with
    `drop` filtered out of stderr, and removes itself from sys.meta_path as it does."""

    def __init__(self, drop: str):
        self.drop = drop

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # as the other finders find it
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None  # the import goes on (or fails) as it would have

        def exec_module(module):
            del loader.exec_module  # the loader's own again
            with dropping_from_stderr(self.drop):
                loader.exec_module(module)

        loader.exec_module = exec_module
        return spec


@contextlib.contextmanager
def dropping_from_stderr(pattern: str):
    """Route file descriptor 2 (C++ and Python writes alike) through a child process that
    forwards every line as it comes, except the lines `pattern` matches from their start."""
    saved = child = None
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no stderr, no child: leave it
        sys.stderr.flush()
        saved = os.dup(2)
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", FORWARD_STDERR, pattern],
                                 stdin=subprocess.PIPE, stdout=saved, stderr=saved)
        os.dup2(child.stdin.fileno(), 2)
    if child is None:
        if saved is not None:
            os.close(saved)
        yield
        return
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        child.stdin.close()  # the child forwards what is left and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
