"""TensorFlow starts quietly: its C++ start-up notices give way to one line of ours
(common/quiet.py), a user's own log level wins, and nothing else written to stderr is lost."""
import os
import re
import subprocess
import sys

from common import quiet
from tests.conftest import REPO, run_script

TINY_RUN = ("GAN/vanilla_gan/gan_tensorflow.py", "--iters", "2", "--data-limit", "64", "--batch-size", "32",
            "--sample-every", "0", "--checkpoint-every", "0")
# TensorFlow's one CPU device holds every core: the line says how many ("1 CPU" read as one core)
OUR_LINE = re.compile(r"^vanilla_gan \| tensorflow \S+ \(keras \S+\), "
                      rf"sees 1 CPU device \({len(os.sched_getaffinity(0))} cores\)[^,]*, oneDNN (on|off), "
                      r"C\+\+ log level (\d+)", re.MULTILINE)
# Pieces of the lines TensorFlow 2.21 opened every run with on a CPU-only machine.
NOTICES = ["absl::InitializeLog", "oneDNN custom operations are on", "cpu_feature_guard"]
NO_DRIVER_NOTICES = ["Could not find cuda drivers", "cuInit"]


def tiny_tensorflow_run(tmp_path, **env):
    """(our line's match, stderr) of a 2-step run, in this environment less any TF settings, plus `env`."""
    inherited = {name: value for name, value in os.environ.items()
                 if name not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLED_DEVICE_TYPES")}
    result = run_script(*TINY_RUN, "--out", str(tmp_path / "run"), env={**inherited, **env})
    assert result.returncode == 0, result.stderr[-2000:]
    line = OUR_LINE.search(result.stdout)
    assert line, result.stdout[:500]
    return line, result.stderr


def test_a_tensorflow_run_opens_with_our_line_instead_of_its_cpp_notices(tmp_path):
    line, stderr = tiny_tensorflow_run(tmp_path)
    assert line[2] == quiet.LOG_LEVEL
    silenced = NOTICES + ([] if quiet.gpu_driver_present() else NO_DRIVER_NOTICES)
    assert [notice for notice in silenced if notice in stderr] == [], stderr[-2000:]


def test_a_users_own_log_level_wins_and_0_brings_the_notices_back(tmp_path):
    line, stderr = tiny_tensorflow_run(tmp_path, TF_CPP_MIN_LOG_LEVEL="0")
    assert line[2] == "0"
    if line[1] == "on":
        assert "oneDNN custom operations are on" in stderr
    if not quiet.gpu_driver_present():
        # Without a GPU driver TensorFlow's CUDA stub says so on import, after absl's banner,
        # whatever the CPU and oneDNN: at level 0 nothing drops them.
        missing = [notice for notice in ("absl::InitializeLog", "Could not find cuda drivers") if notice not in stderr]
        assert missing == [], stderr[-2000:]


def test_the_stderr_filter_drops_only_the_notices_and_loses_nothing_when_the_process_crashes():
    code = """
import os
from common import quiet
with quiet.dropping_from_stderr("|".join(quiet.LOAD_NOTICES)):
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
    os.write(2, b"I0000 00:00:1795324105.581047   16591 port.cc:153] oneDNN custom operations are on. You\\n")
    os.write(2, b"E0000 00:00:1795324110.854119   16591 some.cc:52] a real error\\n")
    os.write(2, b"a log's own prefix: "
                b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n")
    os.write(2, b"F0000 00:00:1795324110.854119   16591 some.cc:53] Check failed: and then")
    os.abort()
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "oneDNN" not in result.stderr
    # the notices are matched from a line's start: a line that quotes one further on stays
    assert result.stderr.count("InitializeLog") == 1 and "\na log's own prefix: WARNING: All log" in result.stderr
    assert "a real error\n" in result.stderr and result.stderr.endswith("Check failed: and then")


def test_without_a_gpu_driver_only_the_device_types_the_user_left_unset_become_cpu(monkeypatch):
    """TF_ENABLED_DEVICE_TYPES=CPU spares a machine with no GPU driver the CUDA probe, unless the
    user set it: the runs above leave it unset, so setting it over the user's went unseen."""
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    monkeypatch.setenv("TF_ENABLED_DEVICE_TYPES", "CPU,GPU")
    monkeypatch.setattr(quiet, "gpu_driver_present", lambda: False)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)  # as before the first import (put back after)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the import hook it adds goes with it
    quiet.quiet_tensorflow_start()
    assert os.environ["TF_ENABLED_DEVICE_TYPES"] == "CPU,GPU"
    monkeypatch.delenv("TF_ENABLED_DEVICE_TYPES")
    quiet.quiet_tensorflow_start()
    assert os.environ["TF_ENABLED_DEVICE_TYPES"] == "CPU"


def test_a_log_level_that_is_no_number_reads_as_0_and_only_above_0_hints_how_to_see_all(monkeypatch):
    """As TensorFlow reads TF_CPP_MIN_LOG_LEVEL; our line says how to bring the notices back only
    where some are hidden. The runs above set numbers, so both went unseen there."""
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "verbose")
    assert quiet.log_level() == 0 and quiet.describe_log_level() == "C++ log level 0"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    assert quiet.describe_log_level() == "C++ log level 2 (TF_CPP_MIN_LOG_LEVEL=0 shows all)"


def test_any_one_sign_of_a_gpu_driver_counts_as_a_driver(monkeypatch):
    """Each path is one vendor's (NVIDIA, ROCm, DRM, WSL): a machine shows one of them, and
    without a driver found TensorFlow is held to its CPU. Each is faked here, whatever the
    machine has."""
    import ctypes

    def no_library(name):
        raise OSError(name)

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/kfd")
    assert quiet.gpu_driver_present()
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert not quiet.gpu_driver_present()
