"""Bad input to any script (wrong flags, damaged run files, an output path it cannot write, a
size that does not fit in memory) ends as one error line and a non-zero exit, not a traceback."""
import errno
import importlib
import json
import os
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from common.config import parse_args
from common.errors import UsageError, described, exit_on_user_error, first_line
from tests.conftest import REPO

TINY = ["--iters", "2", "--batch-size", "8", "--width", "8", "--data-limit", "64", "--no-tensorboard",
        "--device", "cpu"]


def one_line_exit(capsys, call, code=None) -> str:
    """Run `call`; it must exit (with `code` when given, else non-zero) after one stderr line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        call()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == code if code is not None else exit_info.value.code not in (0, None), err
    assert err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# --- 1. every script's bad flag: one line, exit 2; --help still prints the whole help -----------
@pytest.mark.parametrize("script, argv", [
    ("compare", ["--model", "no_such_model"]),
    ("evaluate", ["--no-such-flag"]),
    ("benchmark", ["--repeat", "many"]),
    ("quality_table", ["--no-such-flag"]),
    ("parity", ["--no-such-flag"]),
    ("amp_gradients", ["--no-such-flag"]),
    ("bf16_rounding", ["--no-such-flag"]),
    ("summarize_runs", ["--no-such-flag", "runs"]),
    ("train_feature_net", ["--no-such-flag"]),
    ("evaluate", [""]),  # empty paths: an unset shell variable
    ("benchmark", ["--out", ""]),
    ("compare", ["--runs", ""]),
    ("amp_gradients", ["--weights", ""]),
    ("quality_table", ["--runs", ""]),
    ("summarize_runs", [""]),
])
def test_a_helper_scripts_bad_flag_is_one_line(script, argv, capsys):
    main = importlib.import_module(f"scripts.{script}").main
    err = one_line_exit(capsys, lambda: main(argv), code=2)
    assert "error:" in err and "(see --help)" in err


@pytest.mark.parametrize("flag", ["--out", "--ou=x", "--init-f", "--resume", "--resu"])
def test_compare_refuses_the_flags_it_sets_itself_abbreviated_too(flag, capsys):
    """argparse expands a prefix in the model scripts: --ou would have reached them as --out."""
    from scripts import compare

    err = one_line_exit(capsys, lambda: compare.main(["--model", "vanilla_gan", flag, "x"]), code=2)
    assert "is set by compare.py itself" in err


def test_help_still_prints_the_whole_help(capsys):
    from scripts import summarize_runs

    with pytest.raises(SystemExit) as exit_info:
        summarize_runs.main(["--help"])
    assert exit_info.value.code == 0 and len(capsys.readouterr().out.splitlines()) > 3


@pytest.mark.parametrize("line_break", ["\n", "\r", "\u2028"])
def test_a_line_break_in_a_path_or_value_stays_inside_the_one_line(line_break, tmp_path, capsys):
    """Written out, it split the line: the second half read as a message of its own. Escaped
    as Python writes it, the name can be told from one with a space."""
    from GAN.vanilla_gan import gan_pytorch

    escaped = line_break.encode("unicode_escape").decode()
    missing = tmp_path / f"no{line_break}data"
    err = one_line_exit(capsys, lambda: gan_pytorch.main(
        ["--dataset", "cifar10", "--data-dir", str(missing), "--out", str(tmp_path / "run"), *TINY]), code=1)
    assert f"data directory {tmp_path}/no{escaped}data does not exist" in err, err

    from common.flags import OneLineErrorParser  # argparse's own line, a value the flag's type quoted as is

    err = one_line_exit(capsys, lambda: OneLineErrorParser(prog="x.py").error(f"bad value 'a{line_break}b'"), code=2)
    assert err == f"x.py: error: bad value 'a{escaped}b' (see --help)", err


# --- 2. and 4. values numpy or the memory cannot take: refused when the flags are read ----------
@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("flag, value", [
    ("--seed", "4294967296"), ("--seed", "-1"), ("--image-size", "100000"),
    ("--width", "1000000000000"), ("--evaluate", "100000000000"), ("--iwae-k", "100000000000"),
    ("--eval-draws", "0"), ("--eval-draws", "21"),
    # TensorFlow: a traceback converting it to a tensor (10**20), or a C++ abort (std::bad_alloc, 3 * 10**9)
    ("--workers", "100000000000000000000"), ("--workers", "3000000000"),
])
def test_values_out_of_range_are_refused_at_parse_time(framework, flag, value, capsys):
    err = one_line_exit(capsys, lambda: parse_args("vanilla_gan", framework, [flag, value]), code=2)
    assert f"argument {flag}: must be from" in err or f"argument {flag}: must be 0 (off) or from" in err


HUGE = "100000000000000000000"  # 10**20: past int64, where numpy and the frameworks raised their own errors


@pytest.mark.parametrize("script, argv, flag", [
    ("end_layers", ["--frameworks", "pytorch", "--calls", "1", "--width", HUGE], "--width"),  # TypeError: Overflow
    ("end_layers", ["--frameworks", "pytorch", "--width", "1", "--calls", HUGE], "--calls"),  # Maximum dimension
    ("bf16_rounding", ["--frameworks", "pytorch", "--count", HUGE], "--count"),
    ("bf16_rounding", ["--frameworks", "pytorch", "--count", "1000", "--batch", HUGE], "--batch"),
    ("amp_gradients", ["--width", HUGE, "--batch-size", "2", "--batches", "1"], "--width"),
    ("amp_gradients", ["--batch-size", "60001"], "--batch-size"),  # MNIST's 60,000 training images
    ("amp_gradients", ["--batches", HUGE], "--batches"),
])
def test_a_helper_scripts_absurd_count_is_refused_at_parse_time(script, argv, flag, capsys):
    main = importlib.import_module(f"scripts.{script}").main
    err = one_line_exit(capsys, lambda: main(argv), code=2)
    assert f"argument {flag}: must be from" in err, err


def test_end_layers_measures_each_framework_once(capsys):
    """`--frameworks pytorch pytorch` measured and printed PyTorch twice (its twins refuse it)."""
    from scripts import end_layers

    err = one_line_exit(capsys, lambda: end_layers.main(["--frameworks", "pytorch", "pytorch"]), code=2)
    assert "--frameworks names pytorch more than once" in err, err


def test_the_largest_seed_is_taken():
    assert parse_args("vanilla_gan", "pytorch", ["--seed", str(2**32 - 1)]).seed == 2**32 - 1


def test_the_largest_count_a_run_records_is_taken_and_one_past_it_refused(capsys):
    """Counts go up to a checkpoint's int64, 2**63 - 1 (what the message says), that one included."""
    largest = str(2**63 - 1)
    assert parse_args("vanilla_gan", "pytorch", ["--nonfinite-patience", largest]).nonfinite_patience == 2**63 - 1
    assert parse_args("vanilla_gan", "pytorch", ["--checkpoint-every", largest]).checkpoint_every == 2**63 - 1
    err = one_line_exit(capsys, lambda: parse_args("vanilla_gan", "pytorch", ["--nonfinite-patience", str(2**63)]),
                        code=2)
    assert f"argument --nonfinite-patience: must be at most 2**63 - 1, got {2**63}" in err, err


def test_dcgan_refuses_a_huge_image_size_before_loading_anything(tmp_path, capsys):
    from GAN.dcgan import dcgan_pytorch

    argv = [*TINY, "--dataset", "folder", "--data-dir", str(tmp_path / "nowhere"), "--image-size", "100000"]
    assert "--image-size" in one_line_exit(capsys, lambda: dcgan_pytorch.main(argv), code=2)


# --- 3. an --out the run cannot write ----------------------------------------------------------
@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_out_that_is_or_lies_under_a_file_is_one_line(framework, where, tmp_path, capsys):
    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

    (tmp_path / "afile").write_text("")
    main = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}[framework].main
    err = one_line_exit(capsys, lambda: main([*TINY, "--out", str(tmp_path / where)]), code=2)
    assert f"{tmp_path / 'afile'} is a file" in err


def test_a_read_only_out_is_refused_at_parse_time(tmp_path, monkeypatch):
    import os

    real_access = os.access  # root may write anywhere: pretend tmp_path is read-only
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path) and real_access(path, mode))
    with pytest.raises(UsageError, match=re.escape(f"--out: {tmp_path} is not writable")):
        parse_args("vanilla_gan", "pytorch", ["--out", str(tmp_path / "run")])


@pytest.mark.parametrize("error, expected", [
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/runs/afile/sub"), "/runs/afile/sub: Not a directory"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"), "/ro/run: Read-only file system"),
    (PermissionError(errno.EACCES, "Permission denied", "/root/run"), "/root/run: Permission denied"),
    (OSError(errno.ENOSPC, "No space left on device"), "cannot write the output: No space left on device"),
])
def test_file_system_errors_become_one_line_naming_the_path(error, expected, capsys):
    @exit_on_user_error
    def main():
        raise error

    assert one_line_exit(capsys, main, code=1) == f"error: {expected}"


def test_what_a_first_line_announces_is_quoted_with_it_when_asked():
    """TensorFlow's lost worker is named on the line after "... (stopped sending heartbeats):";
    its "Graph execution error:" announces only more detail, so this is asked for, not done."""
    lost = RuntimeError("The following tasks are unhealthy (stopped sending heartbeats):\n"
                        "/job:worker/replica:0/task:1\nThe tasks have crashed.")
    assert first_line(lost, announced=True) == ("The following tasks are unhealthy (stopped sending heartbeats): "
                                                 "/job:worker/replica:0/task:1")
    assert first_line(lost) == "The following tasks are unhealthy (stopped sending heartbeats):"
    assert first_line(RuntimeError("Failed:"), announced=True) == "Failed:"  # nothing follows


@pytest.mark.parametrize("error, expected", [
    (RuntimeError("connection reset\n  at gloo/transport.cc:154"), "connection reset"),
    (ValueError("  \n"), "ValueError"),  # no message: the type (str.splitlines()[0] raised IndexError)
    (RuntimeError("{{function_node __wrapped__FlushSummaryWriter_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
                  "events.out; No space left on device\n\tFailed to flush 7 events"),
     "events.out; No space left on device"),
])
def test_an_error_quoted_in_ours_is_its_first_line(error, expected):
    assert first_line(error) == expected
    assert described(error) == (expected if expected == type(error).__name__ else f"{type(error).__name__}: {expected}")


def test_a_full_disk_names_the_file_being_written(tmp_path, capsys):
    @exit_on_user_error
    def main():
        with open(tmp_path / "sample.png", "wb") as file:  # a failed write() knows no path
            file.write(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")

    assert one_line_exit(capsys, main, code=1) == f"error: {tmp_path / 'sample.png'}: No space left on device"


def test_a_full_disk_under_a_library_s_own_error_names_the_file_being_written(tmp_path, capsys):
    """torch.save on a full disk raises "[enforce fail at inline_container.cc:672] . unexpected
    pos 704 vs 598" (a traceback), with the OS's ENOSPC as its context."""
    @exit_on_user_error
    def main():
        with open(tmp_path / "step_000020.pt", "wb") as file:
            try:
                file.write(b"x")
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904

    assert one_line_exit(capsys, main, code=1) == f"error: {tmp_path / 'step_000020.pt'}: No space left on device"


@pytest.mark.parametrize("error", [NameError("undefined"), RuntimeError("unexpected pos")])
def test_a_bug_raised_while_handling_a_file_system_error_keeps_its_traceback(error):
    """Only PyTorch's writer error stands for the OS's answer beneath it."""
    @exit_on_user_error
    def main():
        try:
            raise FileExistsError(errno.EEXIST, "File exists", "/tmp")
        except FileExistsError:
            raise error  # noqa: B904

    with pytest.raises(type(error)):
        main()


@pytest.mark.parametrize("exception, code, printed", [
    (KeyboardInterrupt, 130, "error: interrupted\n"),  # Ctrl-C outside the loop, or a second one in it
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), 141, ""),  # `| head`: quietly, as Unix tools do
])
def test_an_interrupt_or_a_closed_pipe_is_no_traceback(exception, code, printed, capsys, monkeypatch):
    from common import errors

    monkeypatch.setattr(errors, "_silence_stdout", lambda: None)  # not pytest's own stdout

    @exit_on_user_error
    def main():
        raise exception

    monkeypatch.setattr(errors, "_stdout_is_broken", lambda: True)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == code and capsys.readouterr().err == printed


def test_a_broken_pipe_to_another_process_is_no_quiet_exit():
    """Only a closed stdout (`| head`) stops quietly; a pipe to a child that died is a failure."""
    @exit_on_user_error
    def main():
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        main()


@pytest.mark.parametrize("error", [KeyError("step"), FileNotFoundError(errno.ENOENT, "gone", "x"),
                                   RuntimeError("shape mismatch")])
def test_programming_errors_keep_their_traceback(error):
    @exit_on_user_error
    def main():
        raise error

    with pytest.raises(type(error)):
        main()


# --- 4. a genuine out-of-memory: one line ------------------------------------------------------
def out_of_memory_errors():
    import tensorflow as tf
    import torch

    try:
        np.zeros((10**7, 10**7))  # 728 TiB: refused at once
    except MemoryError as error:  # numpy's _ArrayMemoryError
        too_big = error
    return [too_big,
            RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                         "memory: you tried to allocate 4000000000000000 bytes."),
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 559.00 GiB"),
            tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[100000]")]


@pytest.mark.parametrize("index", range(4), ids=["numpy", "torch-cpu", "torch-cuda", "tensorflow"])
def test_out_of_memory_becomes_one_line(index, capsys):
    error = out_of_memory_errors()[index]

    @exit_on_user_error
    def main():
        raise error

    err = one_line_exit(capsys, main, code=1)
    assert err.startswith("error: out of memory (") and "smaller" in err and "enforce fail" not in err


# --- 5. the feature net's flags ----------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "--lr: must be a positive finite number"),
    (["--lr", "inf"], "--lr: must be a positive finite number"),
    (["--lr", "1e7"], "--lr: must be a positive number up to 10**6, got 1e7"),
    (["--seed", "-1"], "--seed: must be from 0"),
    (["--seed", "4294967296"], "--seed: must be from 0"),
    (["--result-json", "{tmp}/afile/x.json"], "afile is a file"),
    (["--out", "{tmp}"], "is a folder, not a file"),
    # renamed over, these would become plain files: /dev/null and /dev/stdout as a root user types them
    (["--result-json", "{tmp}/fifo"], "fifo is not a regular file"),
    (["--table-out", "{tmp}/link"], "link is a link"),
    (["--out", "{tmp}/dangling"], "dangling is a link"),
])
def test_feature_net_flags_are_checked_before_training(argv, message, tmp_path, capsys):
    from scripts import train_feature_net

    (tmp_path / "afile").write_text("")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "afile")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    assert message in one_line_exit(capsys, lambda: train_feature_net.main(argv), code=2)


# --- 6. damaged files in run folders -----------------------------------------------------------
def fake_compare_runs(runs):
    """The two run folders compare.py --reuse expects for TINY, as a finished run leaves them."""
    from scripts import compare

    folders = {}
    for framework in ("pytorch", "tensorflow"):
        plan = compare.Plan("vanilla_gan", framework, False, TINY, runs, "cpu")
        (plan.folder / "samples").mkdir(parents=True)
        (plan.folder / "config.json").write_text(json.dumps({**plan.expected(), "device": "cpu"}))
        (plan.folder / "summary.json").write_text(json.dumps(
            {"model": "vanilla_gan", "framework": framework, "step": 2, "median_step_ms": 1.0,
             "samples_per_s": 8.0, "peak_memory_mb": 1.0, "skipped_steps": 0, "final": {"d_loss": 1.0}}))
        (plan.folder / "history.jsonl").write_text(json.dumps({"step": 2, "d_loss": 1.0}) + "\n")
        for step in (0, 2):
            plt.imsave(plan.folder / "samples" / f"step_{step:06d}.png", np.zeros((8, 8)), cmap="gray")
        folders[framework] = plan.folder
    return folders


def test_compare_reuses_sound_fake_runs(tmp_path):
    from scripts import compare

    fake_compare_runs(tmp_path / "runs")
    assert compare.main(["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"]) == 0


def test_compare_prints_the_note_on_metrics_of_different_sample_counts(tmp_path, capsys):
    """The report's note that the two runs' metrics do not compare is printed under the table
    too, not only written into report.md."""
    from scripts import compare

    folders = fake_compare_runs(tmp_path / "runs")
    for framework, samples in (("pytorch", 20), ("tensorflow", 10)):
        summary = json.loads((folders[framework] / "summary.json").read_text())
        summary["metrics"] = {"fid": 9.0, "samples": samples}
        (folders[framework] / "summary.json").write_text(json.dumps(summary))
    assert compare.main(["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == ["note: the runs' metrics were measured on different numbers of samples (20 and 10): they do "
                     "not compare; compare.py's --reuse --evaluate N measures both on N and tables them"], notes


def test_compare_points_to_tensorboard_only_for_runs_that_wrote_events(tmp_path, capsys):
    """Runs trained with --no-tensorboard (TINY's) have no events to show: the last line sent
    the user to an empty TensorBoard (a fresh-user review found it)."""
    from scripts import compare

    folders = fake_compare_runs(tmp_path / "runs")
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"]
    last_line = lambda: (compare.main(argv), capsys.readouterr().out.splitlines()[-1])[1]
    assert last_line() == "compare: neither run wrote TensorBoard events (they trained with --no-tensorboard)"
    (folders["tensorflow"] / "events.out.tfevents.1.host").write_bytes(b"")
    assert last_line().startswith("compare: the tensorflow fp32 run (the other wrote none) in TensorBoard, "
                                  "over the model's other runs: ")
    (folders["pytorch"] / "events.out.tfevents.1.host").write_bytes(b"")
    assert last_line().startswith("compare: both runs in TensorBoard, over the model's other runs: ")
    assert last_line().endswith(f"--logdir {tmp_path / 'runs' / 'vanilla_gan'}")


def test_compare_writes_its_report_for_runs_under_a_folder_name_with_an_undecodable_byte(tmp_path):
    """The report names the runs' folders: report.md's str.encode() raised UnicodeEncodeError
    on the lone surrogate Python reads the byte as, after both runs were done."""
    from scripts import compare

    runs = tmp_path / os.fsdecode(b"runs\xff")
    fake_compare_runs(runs)
    report = tmp_path / "report"
    assert compare.main(["--model", "vanilla_gan", "--runs", str(runs), *TINY, "--reuse", "--report", str(report)]) == 0
    assert "runs\\udcff" in (report / "report.md").read_text()


def test_a_run_folder_named_with_an_undecodable_byte_prints_under_a_strict_stdout(tmp_path):
    """Under en_US.UTF-8 (stdout's errors "strict", not C.UTF-8's "surrogateescape") the run
    folder's line raised UnicodeEncodeError, after the folder was made."""
    from tests.conftest import run_script

    out = tmp_path / os.fsdecode(b"run\xff")
    result = run_script("GAN/vanilla_gan/gan_pytorch.py", "--out", str(out), "--iters", "2", "--batch-size", "16",
                        "--data-limit", "64", "--sample-every", "0", "--no-tensorboard",
                        env={**os.environ, "PYTHONIOENCODING": "utf-8"}, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"run folder: {tmp_path}/run\\udcff\n" in result.stdout


def test_compare_plots_a_float16_history_that_names_its_skipped_steps(tmp_path, capsys):
    """skipped_at (steps, in lists of unequal lengths) and nonfinite_steps, as a float16 run logs
    them: once a loss panel each, and numpy's "inhomogeneous shape" traceback."""
    from common import report
    from scripts import compare

    folder = fake_compare_runs(tmp_path / "runs")["pytorch"]
    rows = [{"step": 1, "d_loss": 1.0, "loss_scale": 32768.0, "skipped": 2, "skipped_at": [0, 1],
             "nonfinite_steps": 2},
            {"step": 2, "d_loss": 0.5, "loss_scale": 16384.0, "skipped": 1, "skipped_at": [2]}]
    (folder / "history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder.parent / "tensorflow-fp32" / "history.jsonl").write_text("".join(
        json.dumps({"step": 2, "d_loss": 1.0, "skipped_at": [1, 2]}) + "\n" for _ in range(2)))
    assert compare.main(["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    sides = [report.load_side(folder), report.load_side(folder.parent / "tensorflow-fp32")]
    assert report.loss_panels(sides) == ["d_loss", "loss_scale"]


# JSON a run never writes, though valid: each once ended in a traceback in a table or a plot
EDITED_SUMMARIES = ['{"step": "2"}', '{"step": 2, "final": [1]}', '{"step": 2, "final": {"d_loss": "x"}}',
                    '{"step": 2, "median_step_ms": "5"}', '{"step": 2, "metrics": {"fid": "x"}}',
                    '{"step": 2, "metrics": [1]}', "[" * 100_000 + "]" * 100_000,
                    # integers past float's range: OverflowError in a table or a plot
                    '{"step": 2, "final": {"d_loss": 1%s}}' % ("0" * 400), '{"step": 1%s}' % ("0" * 30)]


@pytest.mark.parametrize("name, content", [
    ("config.json", "[1]"), ("summary.json", '{"step": 2, "med'), ("summary.json", "{}"),
    ("history.jsonl", '{"step": 1, "d_lo\n{"step": 2, "d_loss": 1.0}\n'), ("samples/step_000002.png", "not a png"),
    *[("summary.json", edited) for edited in EDITED_SUMMARIES],
    ("history.jsonl", '{"step": 2, "d_loss": {"a": 1}}\n'), ("config.json", '{"precision": ["fp32"]}'),
    ("history.jsonl", '{"step": 2, "d_loss": 1%s}\n' % ("0" * 400)),
])
def test_compare_names_a_damaged_file_in_one_line(name, content, tmp_path, capsys):
    from scripts import compare

    folder = fake_compare_runs(tmp_path / "runs")["pytorch"]
    (folder / name).write_text(content)
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"]
    assert str(folder / name) in one_line_exit(capsys, lambda: compare.main(argv), code=1)


@pytest.mark.parametrize("flag", ["--report", "--runs"])
def test_compare_refuses_a_file_for_a_folder(flag, tmp_path, capsys):
    from scripts import compare

    fake_compare_runs(tmp_path / "runs")
    (tmp_path / "afile").write_text("")
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse", flag, str(tmp_path / "afile")]
    assert "afile is a file, not a folder" in one_line_exit(capsys, lambda: compare.main(argv), code=2)


@pytest.mark.parametrize("script, flag, below", [
    ("train_feature_net", "--result-json", "/summary.json"),  # replaced the run's own summary
    ("train_feature_net", "--table-out", "/samples/table.md"), ("compare", "--report", ""),
    ("compare", "--report", "/samples"), ("quality_table", "--runs", ""), ("benchmark", "--out", "/bench"),
])
def test_the_tools_write_nothing_inside_a_run_folder(script, flag, below, tmp_path, capsys):
    """A report, a table or a tool's runs went into a run's folder, among its files."""
    module = importlib.import_module(f"scripts.{script}")
    run = fake_compare_runs(tmp_path / "runs")["pytorch"]
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    argv = {"train_feature_net": ["--precisions", "fp32"] if flag == "--table-out" else [],
            "compare": ["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"],
            "quality_table": ["--models", "vanilla_gan", "--datasets", "ring8", "--table-only"],
            "benchmark": []}[script]
    where = "a run's folder" if not below else f"inside the run folder {run}"
    assert f"{flag} {run}{below} is {where}; name a path outside it" in one_line_exit(
        capsys, lambda: module.main([*argv, flag, f"{run}{below}"]), code=2)
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


def test_compare_refuses_a_report_inside_a_run_it_is_about_to_train_or_behind_a_link(tmp_path, capsys):
    """The check of --report ran before the runs existed: a report named inside the run folder
    this command trains into went in among its files. A link to a run's samples/ was read as
    the link's own path, outside every run."""
    from scripts import compare

    planned = compare.Plan("vanilla_gan", "pytorch", False, TINY, tmp_path / "new", "cpu").folder
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "new"), *TINY]
    assert f"--report {planned}/report is, or is inside, the run folder {planned} this command trains into" in \
        one_line_exit(capsys, lambda: compare.main([*argv, "--report", f"{planned}/report"]), code=2)
    (tmp_path / "new").mkdir()
    (tmp_path / "new-link").symlink_to(tmp_path / "new")  # --runs through a link, --report as resolved
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "new-link"), *TINY]
    assert "this command trains into" in one_line_exit(
        capsys, lambda: compare.main([*argv, "--report", str(planned)]), code=2)
    assert list((tmp_path / "new").iterdir()) == []  # refused before training

    run = fake_compare_runs(tmp_path / "runs")["pytorch"]
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    (tmp_path / "link").symlink_to(run / "samples")
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse"]
    assert f"is inside the run folder {run}" in one_line_exit(
        capsys, lambda: compare.main([*argv, "--report", str(tmp_path / "link")]), code=2)
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("below", ["", "/report"])
def test_compare_refuses_a_link_to_nothing_for_its_report_folder(below, tmp_path, capsys):
    """Read as no folder there yet, it passed the check and failed ("File exists") after both
    runs; benchmark.py's --out failed every configuration."""
    from scripts import benchmark, compare

    fake_compare_runs(tmp_path / "runs")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    argv = ["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--reuse",
            "--report", f"{tmp_path}/dangling{below}"]
    message = f"{tmp_path}/dangling is a link to {tmp_path}/nowhere, which does not exist"
    assert message in one_line_exit(capsys, lambda: compare.main(argv), code=2)
    assert message in one_line_exit(capsys, lambda: benchmark.main(["--out", f"{tmp_path}/dangling{below}"]), code=2)


@pytest.mark.parametrize("name, content", [
    ("summary.json", '{"step": 2, "med'), ("summary.json", "{}"), ("config.json", None),
    ("summary.json", '{"model": "vanilla_gan", "framework": "tensorflow", "step": 2, "final": [1]}'),
    ("summary.json", "[" * 100_000 + "]" * 100_000), ("summary.json", '[{"model": "vanilla_gan"}]'),
    ("summary.json", '{"model": 3, "framework": "tensorflow", "step": 2}'),
    ("config.json", '{"precision": "fp32", "device": ["cpu"]}'),
    ("summary.json", '{"model": "vanilla_gan", "framework": "tensorflow", "step": 2, "median_step_ms": 1%s}'
     % ("0" * 400)),
])
def test_summarize_runs_names_a_damaged_file_in_one_line(name, content, tmp_path, capsys):
    from scripts import summarize_runs

    folder = fake_compare_runs(tmp_path / "runs")["tensorflow"]
    if content is None:
        (folder / name).unlink()
    else:
        (folder / name).write_text(content)
    err = one_line_exit(capsys, lambda: summarize_runs.main([str(tmp_path / "runs")]), code=1)
    assert name in err and str(folder) in err
    # a tool that only reads: no "delete the run folder", whose checkpoints may be sound
    assert err.endswith("writes it again, then evaluate.py measures it" if name == "summary.json"
                        else "move the folder aside to table the others"), err


def test_summarize_runs_tells_apart_runs_of_two_folders_and_lists_each_once(tmp_path, capsys):
    """Two folders' runs were both labelled vanilla_gan/pytorch-fp32, and a folder named
    inside another gave its runs a second row."""
    from scripts import summarize_runs

    first, second = fake_compare_runs(tmp_path / "a"), fake_compare_runs(tmp_path / "b")
    assert summarize_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), str(first["pytorch"].parent)]) == 0
    labels = [line.split(" | ")[0].removeprefix("| ") for line in capsys.readouterr().out.splitlines()[2:]
              if line.startswith("| ")]
    assert labels == [str(first["pytorch"]), str(first["tensorflow"]), str(second["pytorch"]),
                      str(second["tensorflow"])]
    assert summarize_runs.main([str(tmp_path / "a")]) == 0  # one folder: labels relative to it
    out = capsys.readouterr().out
    assert f"| {first['pytorch'].relative_to(tmp_path / 'a')} | " in out and str(tmp_path) not in out.split("\n\n")[0]


def test_summarize_runs_says_it_does_not_follow_links_to_folders(tmp_path, capsys):
    from scripts import summarize_runs

    runs = fake_compare_runs(tmp_path / "runs")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "here").symlink_to(tmp_path / "runs")
    err = one_line_exit(capsys, lambda: summarize_runs.main([str(tmp_path / "linked")]), code=1)
    assert err == (f"error: no summary.json under those folders (links to folders are not followed: name "
                   f"{tmp_path / 'linked' / 'here'} itself); train a model first"), err
    assert summarize_runs.main([str(tmp_path / "linked" / "here")]) == 0  # named, a link is read
    assert str(runs["pytorch"].name) in capsys.readouterr().out


def test_summarize_runs_tabulates_sound_runs(tmp_path, capsys):
    from scripts import summarize_runs

    folders = fake_compare_runs(tmp_path / "runs")
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "| vanilla_gan tensorflow | mnist | fp32 | cpu | 2 | 1.00 |" in out
    summary = json.loads((folders["tensorflow"] / "summary.json").read_text())  # what a float16 run adds
    (folders["tensorflow"] / "summary.json").write_text(json.dumps(
        {**summary, "final": {"d_loss": 1.0, "loss_scale": 512.0, "skipped": 0, "skipped_total": 1,
                              "nonfinite_steps": 3}}))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "vanilla_gan tensorflow" in line]
    assert row.endswith("| 0 | d_loss 1.000 |"), row  # its losses alone, as compare's report
    (folders["tensorflow"] / "summary.json").write_text(json.dumps(summary))
    assert out.endswith("\nCPU: not recorded (a run from before summary.json kept it)\n")
    # rows that looked alike: each names its folder, and a run of replicas or one stopped says so
    stopped = json.loads((folders["tensorflow"] / "summary.json").read_text())
    (folders["tensorflow"] / "summary.json").write_text(json.dumps({**stopped, "stopped_early": True, "replicas": 2}))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    tensorflow_folder = folders["tensorflow"].relative_to(tmp_path / "runs")
    assert f"| {tensorflow_folder} | vanilla_gan tensorflow | mnist, 2 replicas | fp32 | cpu | 2/2 (stopped) |" in out
    (folders["tensorflow"] / "summary.json").write_text(json.dumps(stopped))

    summary = json.loads((folders["pytorch"] / "summary.json").read_text())
    machine = {"model": "AMD EPYC", "cores": 2, "avx512_bf16": True, "amx_bf16": False}
    (folders["pytorch"] / "summary.json").write_text(json.dumps({**summary, "cpu": machine}))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [  # runs from two machines: which ran where
        f"CPU: AMD EPYC, 2 cores, avx512_bf16 yes, amx_bf16 no ({folders['pytorch']})",
        f"CPU: not recorded (a run from before summary.json kept it) ({folders['tensorflow']})"]
    (folders["pytorch"] / "summary.json").write_text(json.dumps({**summary, "cpu": machine, "gpu": "NVIDIA\n H100"}))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == (  # a CUDA run: its GPU too, on the line
        f"CPU: AMD EPYC, 2 cores, avx512_bf16 yes, amx_bf16 no; GPU: NVIDIA H100 ({folders['pytorch']})")
    # never this machine's, nor a traceback; a count of cores as text would have printed as one
    for edited in ({}, {**machine, "avx512_bf16": "yes"}, {**machine, "cores": "2"}, ["AMD EPYC"]):
        (folders["pytorch"] / "summary.json").write_text(json.dumps({**summary, "cpu": edited}))
        assert summarize_runs.main([str(tmp_path / "runs")]) == 0
        assert capsys.readouterr().out.splitlines()[-2] == (
            f"CPU: unreadable (summary.json's \"cpu\" is not what a run writes) ({folders['pytorch']})")


def test_summarize_runs_names_a_mistyped_folder_beside_a_sound_one(tmp_path, capsys):
    """`summarize_runs.py runs/a runs/tpyo`: the table of runs/a alone, exit 0, left out the
    runs the user asked for without a word; the missing folder is named in one line instead."""
    from scripts import summarize_runs

    fake_compare_runs(tmp_path / "runs")
    missing = tmp_path / "missing"
    err = one_line_exit(capsys, lambda: summarize_runs.main([str(tmp_path / "runs"), str(missing)]), code=1)
    assert err == f"error: {missing} is not a folder (name folders holding run folders)", err


def table_cells(row: str) -> list[str]:
    """A markdown table row's cells, split where GitHub's parser splits them: at every `|` that
    no backslash precedes."""
    return re.split(r"(?<!\\)\|", row)[1:-1]


def test_summarize_runs_keeps_each_run_on_one_row_of_its_columns(tmp_path, capsys):
    """Text of a run's (an edited summary.json, a folder's name) holding `|` or a line break
    opened a column or ended the row; a lone surrogate ("\\ud800") stopped the table in a
    UnicodeEncodeError traceback. The CPU lines below it stay a line each too."""
    from scripts import summarize_runs

    folders = fake_compare_runs(tmp_path / "runs")
    hostile = folders["tensorflow"].rename(folders["tensorflow"].parent / "tf|32\nrun")
    summary = json.loads((hostile / "summary.json").read_text())
    machine = {"model": "AMD\nEPYC\ud800", "cores": 2, "avx512_bf16": True, "amx_bf16": False}
    (hostile / "summary.json").write_text(json.dumps(
        {**summary, "model": "a|b\r\nc\ud800", "final": {"d|lo\nss": 1.0}, "cpu": machine}))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    table, machines = capsys.readouterr().out.split("\n\n")
    rows = table.splitlines()
    assert len(rows) == 4 and all(len(table_cells(row)) == len(summarize_runs.COLUMNS) for row in rows), rows
    folder = str(hostile.relative_to(tmp_path / "runs")).replace("|", r"\|").replace("\n", " ")
    path = str(hostile).replace("\n", " ")  # in the CPU line: not a cell, its `|` kept
    assert rows[3] == (f"| {folder} | a\\|b c\\ud800 tensorflow | mnist | fp32 | cpu | 2 | 1.00 | 8 | 1 | 0 "
                       "| d\\|lo ss 1.000 |")
    assert machines.splitlines()[1] == (
        f"CPU: AMD EPYC\\ud800, 2 cores, avx512_bf16 yes, amx_bf16 no ({path})")


@pytest.mark.parametrize("name, table_only, content", [
    ("config.json", False, '{"iters": 2, "precis'), ("summary.json", True, '{"iters": 2, "precis'),
    ("summary.json", True, '{"step": 2, "metrics": [1]}'),
    ("summary.json", True, '{"step": 2, "metrics": {"fid": "x"}}'),
    ("config.json", False, '{"iters": 2, "precision": [1]}'),
    ("summary.json", True, '{"step": 2, "metrics": {"modes_covered": 1%s}}' % ("0" * 400)),
    ("summary.json", True, '{"step": 2, "metrics": {"fid": -1.0}}'),  # a squared distance; a mean of 0 was divided by
])
def test_quality_table_names_a_damaged_file_in_one_line(name, table_only, content, tmp_path, capsys):
    from scripts import quality_table

    folder = tmp_path / "quality" / "vanilla_gan" / "mnist" / "pytorch-fp32"
    folder.mkdir(parents=True)
    (folder / name).write_text(content)
    argv = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "mnist", "--precisions", "fp32",
            "--samples", "10", "--runs", str(tmp_path / "quality"), *(["--table-only"] if table_only else [])]
    assert str(folder / name) in one_line_exit(capsys, lambda: quality_table.main(argv), code=1)


def test_quality_table_only_says_when_there_is_nothing_to_tabulate(tmp_path, capsys):
    from scripts import quality_table

    argv = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "ring8", "--samples", "10",
            "--runs", str(tmp_path / "typo"), "--table-only"]
    assert "no runs of these settings measured on --samples 10 under" in one_line_exit(
        capsys, lambda: quality_table.main(argv), code=1)
    assert not (tmp_path / "typo").exists()
    assert "--table-only and --overwrite contradict" in one_line_exit(
        capsys, lambda: quality_table.main([*argv, "--overwrite"]), code=2)


@pytest.mark.parametrize("argv, message", [
    (["--samples", "5", "--floor"], "--samples: must be from 10 to 50,000, got 5"),
    (["--samples", "50001", "--floor"], "--samples: must be from 10 to 50,000"),
    (["--iwae-k", "0", "--floor"], "--iwae-k: must be from 1 to 10,000, got 0"),
    (["--draws", "0", "--floor"], "--draws: must be from 1 to 20, got 0"),
])
def test_evaluate_bounds_its_counts(argv, message, capsys):
    from scripts import evaluate

    assert message in one_line_exit(capsys, lambda: evaluate.main(argv), code=2)


def test_evaluate_floor_compares_at_most_the_test_sets_images(monkeypatch, capsys):
    """MNIST has 10,000 test images: a larger --samples measures 10,000 of each and says so."""
    from common import evaluation
    from scripts import evaluate

    counts = []
    monkeypatch.setattr(evaluation, "mnist_subset", lambda split, count: counts.append(count) or np.zeros(1))
    monkeypatch.setattr(evaluation, "image_metrics", lambda samples, reference: {"fid": 1.0})
    assert evaluate.main(["--floor", "--samples", "20000"]) == 0
    out = capsys.readouterr().out
    assert counts == [10_000, 10_000] and "10000 MNIST training images vs as many test images: fid 1\n" in out


def test_quality_table_refuses_models_and_datasets_that_make_no_run(tmp_path, capsys):
    """DCGAN and the VAE take images only: asked for the 2-D mixtures alone, the table held the
    real-data row only, written over the one in --runs."""
    from scripts import quality_table

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "quality_table.md").write_text("the table measured before\n")
    argv = ["--models", "dcgan", "vae", "--datasets", "ring8", "grid25", "--samples", "10", "--runs", str(runs)]
    err = one_line_exit(capsys, lambda: quality_table.main(argv), code=2)
    assert ("--models dcgan vanilla_vae: MNIST images only, no --datasets ring8 grid25; add mnist, or a model "
            "that takes them (vanilla_gan lsgan wgan_gp)") in err
    assert (runs / "quality_table.md").read_text() == "the table measured before\n"


def test_quality_table_refuses_a_file_for_runs(tmp_path, capsys):
    from scripts import quality_table

    (tmp_path / "afile").write_text("")
    err = one_line_exit(capsys, lambda: quality_table.main(["--runs", str(tmp_path / "afile"), "--table-only"]), code=2)
    assert "afile is a file, not a folder" in err


@pytest.mark.parametrize("flag, message", [
    ("--init-from", "--init-from is set by compare.py itself; use --same-init (TensorFlow starts from "
                    "PyTorch's initial weights)"),
    ("--init-f", "--init-from (typed --init-f) is set by compare.py itself; use --same-init"),
    ("--out", "--out is set by compare.py itself; use --runs, --reuse or --overwrite"),
    ("--ou=x", "--out (typed --ou) is set by compare.py itself; use --runs, --reuse or --overwrite"),
    ("--resu", "--resume (typed --resu) is set by compare.py itself; use --runs, --reuse or --overwrite"),
])
def test_compare_names_each_flag_it_sets_once_with_what_to_use_instead(flag, message, capsys):
    """--init-from once read "--init-from (--init-from) ...; use --runs, --reuse or --overwrite":
    the name twice, and a hint for the run folders where --same-init is what it asks for."""
    from scripts import compare

    err = one_line_exit(capsys, lambda: compare.main(["--model", "vanilla_gan", flag, "x"]), code=2)
    assert message in err, err


SCRIPTS_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@pytest.mark.parametrize("script", sorted(name.removesuffix(".py") for name in os.listdir(SCRIPTS_FOLDER)
                                          if name.endswith(".py") and name != "__init__.py"))
def test_a_scripts_help_begins_with_its_docstrings_whole_first_paragraph(script, capsys):
    """Not its first line: five scripts' --help stopped mid-sentence."""
    module = importlib.import_module(f"scripts.{script}")
    first_paragraph = " ".join(module.__doc__.split("\n\n")[0].split())
    assert first_paragraph[-1] in ".?"
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert first_paragraph in " ".join(capsys.readouterr().out.split())


def test_a_scripts_help_leaves_out_its_docstrings_later_paragraphs():
    """The test above finds the first paragraph in --help, not that the rest stays out (mutation
    round 10: a description of the whole docstring went unseen)."""
    from common.flags import first_paragraph

    assert first_paragraph("Train a model,\n    in two lines.\n\nHow it works,\nat length.\n") == (
        "Train a model, in two lines.")


# --- 8. Ctrl-C while a script runs another -----------------------------------------------------
CHILD = """
import signal, sys, time
from pathlib import Path
def stop(signum, frame):
    time.sleep(1.0)  # a checkpoint being written: the parent must not kill the child now
    Path(sys.argv[1]).write_text("saved")
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
Path(sys.argv[1] + ".started").write_text("")
time.sleep(60)
"""
PARENT = """
import sys
sys.path.insert(0, {repo!r})
from common.errors import exit_on_user_error, run_child
exit_on_user_error(lambda: run_child([sys.executable, "-c", {child!r}, {marker!r}], "the run saved a checkpoint"))()
"""


def signal_a_parent(tmp_path, child: str, send) -> tuple[int, str]:
    """Run PARENT over `child` (which writes <marker>.started, then <marker>), call `send(pid)`
    once the child has started (then write <marker>.sent), and return the parent's exit status
    and stderr; whatever is left of the pair, which share a process group, is killed."""
    import signal
    import subprocess
    import sys
    import time

    marker = str(tmp_path / "marker")
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(repo=str(REPO), child=child, marker=marker)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker + ".started") and time.monotonic() < deadline:
            time.sleep(0.05)
        send(parent.pid)
        Path(marker + ".sent").write_text("")
        _, err = parent.communicate(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
        try:
            os.killpg(parent.pid, signal.SIGKILL)  # a child left behind, still in the parent's group
        except ProcessLookupError:  # none
            pass
    return parent.returncode, err


def test_ctrl_c_reaches_the_child_which_saves_before_the_parent_stops_in_one_line(tmp_path):
    """A terminal sends Ctrl-C to the whole process group. subprocess.run raised
    KeyboardInterrupt in compare.py and benchmark.py (a traceback) and killed the training
    child 0.25 s later, mid-checkpoint; run_child waits for it and stops with one line, 130."""
    import signal

    code, err = signal_a_parent(tmp_path, CHILD, lambda pid: os.killpg(pid, signal.SIGINT))
    assert code == 130, err
    assert err.strip() == "error: interrupted: the run saved a checkpoint"
    assert (tmp_path / "marker").read_text() == "saved"


STOPPING_CHILD = """
import signal, sys, time
from pathlib import Path
def stop(signum, frame):
    Path(sys.argv[1]).write_text(signal.Signals(signum).name)
    sys.exit(128 + signum)
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, stop)
Path(sys.argv[1] + ".started").write_text("")
time.sleep(60)
"""


def test_a_sigterm_to_the_parent_alone_is_passed_on_to_the_child(tmp_path):
    """`kill -TERM` of the parent's pid alone killed it at once, with no line, and left the
    child training on alone."""
    import signal

    code, err = signal_a_parent(tmp_path, STOPPING_CHILD, lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == 128 + signal.SIGTERM, err  # the child sleeps for 60 s unless it is told
    assert err.strip() == "error: interrupted: the run saved a checkpoint"
    assert (tmp_path / "marker").read_text() == "SIGTERM"


NOTING_CHILD = """
import signal, sys, time
from pathlib import Path
received = []
signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
Path(sys.argv[1] + ".started").write_text("")
deadline = time.monotonic() + 30
while not Path(sys.argv[1] + ".sent").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # a copy passed on by the parent arrives within this
Path(sys.argv[1]).write_text(str(len(received)))
"""


def test_a_ctrl_c_is_not_passed_on_to_the_child(tmp_path):
    """A terminal's Ctrl-C reaches the child itself (the whole group gets it); a copy passed on
    by the parent was a second Ctrl-C moments after the first, and ended a child outside its
    training loop in a traceback (in most of 20 tries, a child in exit_on_user_error). Sent to
    the parent alone, it is noted there, and the parent stops with its line once the child ends."""
    import signal

    code, err = signal_a_parent(tmp_path, NOTING_CHILD, lambda pid: os.kill(pid, signal.SIGINT))
    assert code == 130, err
    assert err.strip() == "error: interrupted: the run saved a checkpoint"
    assert (tmp_path / "marker").read_text() == "0"


@pytest.mark.parametrize("given", [False, True])
def test_a_child_runs_alone_whatever_replica_variables_a_shell_left(monkeypatch, given):
    """A WORLD_SIZE left in a shell had evaluate.py's model script wait 10 minutes to join
    replicas that never come (and a TensorFlow one refuse to run); the others pass on, and an
    environment the caller gives is filtered alike."""
    import sys

    from common.errors import REPLICA_VARIABLES, run_child

    left = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "TF_CONFIG": "{}", "AMPGEN_KEPT": "yes"}
    for name, value in left.items():
        monkeypatch.setenv(name, value)
    show = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))" % sorted(left)
    result = run_child([sys.executable, "-c", show], "unused", capture_output=True, text=True,
                       **({"env": dict(os.environ)} if given else {}))
    seen = json.loads(result.stdout)
    assert set(REPLICA_VARIABLES) == set(left) - {"AMPGEN_KEPT"}
    assert seen == {**{name: None for name in REPLICA_VARIABLES}, "AMPGEN_KEPT": "yes"}
    assert os.environ["WORLD_SIZE"] == "2"  # this process's own environment is left as it was
    emptied = run_child([sys.executable, "-c", show], "unused", capture_output=True, text=True, env={})
    assert json.loads(emptied.stdout)["AMPGEN_KEPT"] is None  # an empty environment given is kept empty


def test_run_child_gives_back_the_signal_handlers_it_found():
    """Left in place, its SIGTERM handler would only note a later SIGTERM to compare.py or the
    benchmark (between two children), which would then never stop. (Mutation round 13.)"""
    import signal
    import sys

    from common.errors import run_child

    found = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    run_child([sys.executable, "-c", "pass"], "unused")
    assert {signum: signal.getsignal(signum) for signum in found} == found


def test_a_child_run_from_another_thread_runs_alone_too(monkeypatch):
    """Off the main thread run_child sets no handlers, but still leaves out the replica
    variables. (Mutation round 13.)"""
    import sys
    import threading

    from common.errors import run_child

    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = []
    command = [sys.executable, "-c", "import os; print(os.environ.get('WORLD_SIZE'))"]
    thread = threading.Thread(target=lambda: seen.append(run_child(command, "unused", capture_output=True,
                                                                   text=True).stdout.strip()))
    thread.start()
    thread.join(timeout=60)
    assert seen == ["None"]


def test_a_child_that_stopped_on_its_own_ctrl_c_stops_the_parent_too():
    """A child that exits 130 (143: a SIGTERM of its own) was interrupted, its checkpoint
    saved: the script that ran it stops as well, with its one line and that status, and does
    not go on to the next run as if the child had failed, or read the results it never wrote.
    Other statuses are the caller's."""
    import sys

    from common.errors import Interrupted, run_child

    for status in (130, 143):  # a Ctrl-C, or a SIGTERM sent to the child alone
        with pytest.raises(Interrupted, match="^interrupted: the run saved a checkpoint$") as stopped:
            run_child([sys.executable, "-c", f"import sys; sys.exit({status})"], "the run saved a checkpoint")
        assert stopped.value.exit_code == status
    assert run_child([sys.executable, "-c", "import sys; sys.exit(1)"], "unused").returncode == 1


def test_a_reader_that_goes_away_stops_a_script_quietly(tmp_path):
    """`python GAN/vanilla_gan/gan_pytorch.py ... | head -1`: a BrokenPipeError traceback."""
    import subprocess
    import sys

    from tests.conftest import REPO

    process = subprocess.Popen([sys.executable, str(REPO / "GAN/vanilla_gan/gan_pytorch.py"), "--out",
                                str(tmp_path / "run"), *TINY, "--iters", "2"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read()
    assert process.wait(timeout=240) == 141 and "Traceback" not in stderr, stderr[-2000:]


def test_summarize_runs_names_a_run_folder_given_itself_by_its_name(tmp_path, capsys):
    """`summarize_runs.py runs/vanilla_gan/pytorch-fp32`: the row names the folder, not "."
    (mutation round 10: taking the path relative to the folder named went unseen)."""
    from scripts import summarize_runs

    folder = fake_compare_runs(tmp_path / "runs")["pytorch"]
    assert summarize_runs.main([str(folder)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "vanilla_gan pytorch" in line]
    assert row.startswith(f"| {folder.name} | vanilla_gan pytorch |"), row


def test_summarize_runs_shows_a_dash_for_a_skip_count_the_summary_lacks(tmp_path, capsys):
    """A summary.json without skipped_steps (an older run's, or an edit) counted none: "-" in
    that cell, not a 0 (mutation round 10: a default of 0 went unseen)."""
    from scripts import summarize_runs

    folder = fake_compare_runs(tmp_path / "runs")["tensorflow"]
    summary = json.loads((folder / "summary.json").read_text())
    del summary["skipped_steps"]
    (folder / "summary.json").write_text(json.dumps(summary))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "vanilla_gan tensorflow" in line]
    assert row.endswith("| 1.00 | 8 | 1 | - | d_loss 1.000 |"), row


def test_summarize_runs_shows_a_stopped_run_whose_config_lacks_its_iters(tmp_path, capsys):
    """A run stopped early whose config.json holds no --iters (an edit): its step count alone,
    not a KeyError traceback (mutation round 10: reading config["iters"] unchecked went unseen)."""
    from scripts import summarize_runs

    folder = fake_compare_runs(tmp_path / "runs")["tensorflow"]
    config = json.loads((folder / "config.json").read_text())
    del config["iters"]
    (folder / "config.json").write_text(json.dumps(config))
    summary = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**summary, "stopped_early": True}))
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "vanilla_gan tensorflow" in line]
    assert "| mnist | fp32 | cpu | 2 | 1.00 |" in row, row


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_an_out_where_no_folder_can_be_made_is_one_line(framework, capsys):
    """/proc takes no new folders: mkdir's "No such file or directory" was a traceback (a
    fresh-user review found it)."""
    from common import models

    script = models.get("vanilla_gan").module(framework)
    err = one_line_exit(capsys, lambda: script.main([*TINY, "--out", "/proc/no-run-here"]), code=2)
    assert err == ("error: cannot make the run folder /proc/no-run-here (No such file or directory); "
                   "choose another --out")


def test_a_quoted_reason_is_cut_at_a_sentence_or_a_word_not_mid_phrase():
    """gloo's reason, cut at 80 characters, ended "... by peer. This is typically caused" (a
    fresh-user review)."""
    from common.errors import clipped

    gloo = "Read error [127.0.0.1]:54479: Connection reset by peer. This is typically caused by a peer that died"
    assert clipped(gloo, 80) == "Read error [127.0.0.1]:54479: Connection reset by peer"
    assert clipped("word " * 30, 40) == "word word word word word word word..."
    assert len(clipped("word " * 30, 40)) <= 40
    assert clipped("short enough. Kept whole", 80) == "short enough. Kept whole"


def test_summarize_runs_of_two_folders_lists_them_in_path_order_by_their_full_folders(tmp_path, capsys):
    """Two folders named: each row is labelled with its run's folder as given (runs of both
    read alike otherwise), the folders walked in path order ("a" before "a-2", whose name
    sorts first as a string) and a folder named summary.json said to be damaged, not skipped."""
    from scripts import summarize_runs

    first, second = fake_compare_runs(tmp_path / "runs" / "a"), fake_compare_runs(tmp_path / "runs" / "a-2")
    assert summarize_runs.main([str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "a-2")]) == 0
    labels = [line.split(" | ")[0].removeprefix("| ") for line in capsys.readouterr().out.splitlines()[2:]
              if line.startswith("| ")]
    assert labels == [str(first["pytorch"]), str(first["tensorflow"]), str(second["pytorch"]),
                      str(second["tensorflow"])]
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0  # one folder: walked in path order too
    labels = [line.split(" | ")[0].removeprefix("| ") for line in capsys.readouterr().out.splitlines()[2:]
              if line.startswith("| ")]
    assert labels == [str(folder.relative_to(tmp_path / "runs")) for folder in
                      (first["pytorch"], first["tensorflow"], second["pytorch"], second["tensorflow"])]
    (second["pytorch"] / "summary.json").unlink()
    (second["pytorch"] / "summary.json").mkdir()
    err = one_line_exit(capsys, lambda: summarize_runs.main([str(tmp_path / "runs")]), code=1)
    assert str(second["pytorch"] / "summary.json") in err, err
