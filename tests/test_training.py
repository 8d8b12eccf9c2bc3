"""Short real training runs of the vanilla GAN pair: run-folder contents, finite losses,
shared fixed noise, bit-exact resume, and refusing to clobber or mis-resume a run."""
import json
import math
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from common import cpu, sampling
from common.runs import RunFolder
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
from tests.conftest import CodeInAPickle, checkpoint_arrays

SCRIPTS = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}
TINY = ["--batch-size", "32", "--data-limit", "256", "--log-every", "2"]


def train(framework, out, *extra):
    return SCRIPTS[framework].main(["--out", str(out), *TINY, *extra])


def expect_exit(code, message, capsys, framework, out, *extra):
    """A user error ends the script with `code` and one stderr line naming the problem."""
    with pytest.raises(SystemExit) as exit_info:
        train(framework, out, *extra)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == code
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    return err


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_short_run_writes_the_run_folder(framework, amp, tmp_path):
    out = tmp_path / "run"
    summary = train(framework, out, "--iters", "6", "--sample-every", "3",
                    "--checkpoint-every", "2", *(["--amp"] if amp else []))

    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == ("amp-bf16" if amp else "fp32")
    assert config["framework"] == framework and config["batch_size"] == 32
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [2, 4, 6]
    for row in history:
        assert math.isfinite(row["d_loss"]) and math.isfinite(row["g_loss"])
        assert row["loss_scale"] == 1.0 and row["skipped"] == 0 and row["step_ms"] > 0
    assert np.load(out / "fixed_noise.npy").shape == (64, 100)
    assert sorted(p.name for p in (out / "samples").iterdir()) == [
        "step_000000.png", "step_000003.png", "step_000006.png"]  # step 0: the starting point
    suffix = "pt" if framework == "pytorch" else "npz"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"step_000004.{suffix}", f"step_000006.{suffix}"]  # the last two are kept
    saved = json.loads((out / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["median_step_ms"] > 0 and saved["samples_per_s"] == pytest.approx(32 * 1000 / saved["median_step_ms"])
    # in MiB (Linux's ru_maxrss is in KiB): a process of both frameworks holds a few GiB, not a few TiB
    assert 0 < saved["peak_memory_mb"] < 2**16 and saved["step"] == 6
    assert saved["cpu"] == cpu.describe()  # model name, cores, avx512_bf16, amx_bf16
    assert saved["gpu"] is None  # a CPU run (the CUDA tests check a GPU's name)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_the_median_step_time_leaves_out_the_first_step_when_there_is_one_interval(framework, tmp_path,
                                                                                     monkeypatch, capsys):
    """A run of one log interval (--iters up to --log-every, or a resume near its end) used that
    interval whole, tracing and warm-up included: TensorFlow's 30-step run read 47.6 ms/step at
    1.95. The first step here takes 3 s more than the others, as a slow trace would; the bounds
    are relative, as a loaded machine's steps can take hundreds of ms."""
    module = __import__(f"common.{framework}.session", fromlist=["Session"])
    step, calls = module.Session.train_step, []

    def first_step_slow(self, indices):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(3.0)
        return step(self, indices)

    monkeypatch.setattr(module.Session, "train_step", first_step_slow)
    out = tmp_path / "run"
    small = ["--width", "8", "--log-every", "100", "--sample-every", "0", "--checkpoint-every", "3"]
    summary = train(framework, out, "--iters", "6", *small)
    (row,) = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert row["step_ms"] > 3000 / 6  # the history row is the interval's wall time, as it was
    # it was that row's figure; less the first step, the other five steps' mean
    assert 0 < summary["median_step_ms"] < row["step_ms"] / 2, (summary, row)
    assert summary["timed_from_step"] == 0

    calls.clear()  # a resume from step 3: its one interval, less its own first step
    (out / "checkpoints" / f"step_000006.{'pt' if framework == 'pytorch' else 'npz'}").unlink()
    summary = train(framework, out, "--iters", "6", *small, "--resume")
    row = json.loads((out / "history.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 6 and row["step_ms"] > 3000 / 3
    assert 0 < summary["median_step_ms"] < row["step_ms"] / 2 and summary["timed_from_step"] == 3, (summary, row)

    capsys.readouterr()
    calls.clear()  # one step: no steady figure, rather than the first step's
    summary = train(framework, tmp_path / "one", "--iters", "1", "--sample-every", "0")
    assert summary["median_step_ms"] is None and summary["samples_per_s"] is None
    assert "done: step 1, no steady step time (one step)" in capsys.readouterr().out


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_ring_of_gaussians_run_plots_points(framework, tmp_path, monkeypatch):
    plotted, plot = [], sampling.save_scatter

    def recorded(samples, path, real=None, title=""):
        plotted.append((Path(path).name, np.array(samples), np.array(real)))
        plot(samples, path, real=real, title=title)

    monkeypatch.setattr(sampling, "save_scatter", recorded)
    out = tmp_path / "ring"
    train(framework, out, "--dataset", "ring8", "--iters", "4")
    name, generated, real = plotted[-1]
    assert name == "step_000004.png" and (out / "samples" / name).stat().st_size > 1000
    assert generated.shape == (2500, 2) and real.shape == (256, 2) and np.isfinite(generated).all()  # --data-limit 256
    assert np.allclose(np.linalg.norm(real, axis=1), 1, atol=0.1)  # the ring's points, under G's
    assert not np.allclose(generated[:256], real, atol=0.1)
    assert np.load(out / "fixed_noise.npy").shape == (2500, 100)


def test_both_frameworks_draw_the_same_fixed_noise_and_the_seed_picks_the_initial_weights(tmp_path):
    """--seed picks the fixed noise, the same in both frameworks, and each framework's
    initialisation (its global generators: a seed of its own there would make every seed of
    the quality table's means start alike). The same seed's same weights: test_resume_is_bit_exact."""
    for framework in ("pytorch", "tensorflow"):
        for seed in ("3", "4"):
            train(framework, tmp_path / f"{framework}-{seed}", "--iters", "2", "--seed", seed)
    noise = np.load(tmp_path / "pytorch-3" / "fixed_noise.npy")
    np.testing.assert_array_equal(noise, np.load(tmp_path / "tensorflow-3" / "fixed_noise.npy"))
    assert not np.array_equal(noise, np.load(tmp_path / "pytorch-4" / "fixed_noise.npy"))
    for framework in ("pytorch", "tensorflow"):
        with np.load(tmp_path / f"{framework}-3" / "initial_weights.npz") as three, \
                np.load(tmp_path / f"{framework}-4" / "initial_weights.npz") as four:
            weights = [key for key in three.files if three[key].dtype.kind == "f" and three[key].std() > 0]
            assert len(weights) >= 2 and three.files == four.files, three.files  # G's and D's kernels at least
            assert all(not np.array_equal(three[key], four[key]) for key in weights), framework


RESUMED_PRECISIONS = {"fp32": [], "bf16": ["--amp"],
                      # the loss scale doubles every two good steps: it moves across the resume
                      "fp16": ["--amp", "--amp-dtype", "float16", "--growth-interval", "2"]}


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("precision", RESUMED_PRECISIONS)
def test_resume_is_bit_exact(framework, precision, tmp_path):
    """Weights, optimizers, loss scale, noise and the average of G's weights (--ema-decay)."""
    flags = ["--checkpoint-every", "4", "--seed", "5", "--ema-decay", "0.9", *RESUMED_PRECISIONS[precision]]
    # 10 steps of 32 out of 256 examples: the resumed half crosses an epoch boundary.
    train(framework, tmp_path / "straight", "--iters", "10", *flags)
    train(framework, tmp_path / "resumed", "--iters", "6", *flags)
    train(framework, tmp_path / "resumed", "--iters", "10", "--resume", *flags)

    suffix = "pt" if framework == "pytorch" else "npz"
    straight = checkpoint_arrays(tmp_path / "straight" / "checkpoints" / f"step_000010.{suffix}")
    resumed = checkpoint_arrays(tmp_path / "resumed" / "checkpoints" / f"step_000010.{suffix}")
    assert straight.keys() == resumed.keys() and len(straight) > 8
    assert sum(key.startswith(("average/", "averages/")) for key in straight) >= 5
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key], err_msg=key)
    scales = [json.loads(line)["loss_scale"]
              for line in (tmp_path / "straight" / "history.jsonl").read_text().splitlines()]
    if precision == "fp16":  # the scale moved, and the arrays compared above hold it
        assert len(set(scales)) > 2 and any(value.size == 1 and value == scales[-1] for value in straight.values())
    history = [json.loads(line)["step"]
               for line in (tmp_path / "resumed" / "history.jsonl").read_text().splitlines()]
    assert history == [2, 4, 6, 8, 10]
    # the count of skipped steps goes on from the checkpoint's: TensorFlow's checkpoint saving
    # the step as skipped_total went unseen by the test below, where every step is skipped (so
    # the two are equal)
    skipped = {run: [json.loads(line)["skipped_total"]
                     for line in (tmp_path / run / "history.jsonl").read_text().splitlines()]
               for run in ("straight", "resumed")}
    assert skipped["resumed"] == skipped["straight"]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_resumed_run_counts_the_steps_skipped_before_it(framework, tmp_path):
    """Under float16 at a loss scale of 2**64 every step overflows and is skipped (the scale
    halves each time, still far too large after 8): 4 before the resume and 4 after make 8."""
    flags = ["--amp", "--amp-dtype", "float16", "--init-scale", str(2.0**64), "--checkpoint-every", "2"]
    train(framework, tmp_path, "--iters", "4", *flags)
    train(framework, tmp_path, "--iters", "8", "--resume", *flags)
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [(row["step"], row["skipped_total"]) for row in rows] == [(2, 2), (4, 4), (6, 6), (8, 8)]
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 8


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_each_step_trains_on_its_batch_of_the_epochs_permutation(framework):
    """The loop's batches, uploaded one epoch at a time and split there, are those BatchOrder
    names (what a host loader prefetches, and what a resumed run relies on): 10 examples in
    batches of 3, three steps an epoch, the tenth example left out of each."""
    from types import SimpleNamespace

    from common.loop import Batches
    from common.runs import BatchOrder

    if framework == "pytorch":
        import torch

        from common.pytorch.session import Session
        state = SimpleNamespace(runtime=SimpleNamespace(device=torch.device("cpu")))  # what it reads
    else:
        from common.tensorflow.session import Session
        state = None
    session = SimpleNamespace(upload_batches=lambda batches: Session.upload_batches(state, batches))
    order = BatchOrder(num_examples=10, batch_size=3, seed=1)
    batches = Batches(order, session)
    taken = [np.asarray(batches.indices(step)) for step in range(8)]  # into the third epoch
    expected = list(order.batches(0, 8))
    assert [list(batch) for batch in taken] == [list(batch) for batch in expected]
    assert len({tuple(batch) for batch in taken[:3]}) == 3 and len(set(np.concatenate(taken[:3]))) == 9
    assert [list(batch) for batch in taken[:3]] != [list(batch) for batch in taken[3:6]]  # a new epoch, a new order


def test_float32_pytorch_weights_do_not_depend_on_the_thread_count(tmp_path):
    """MKL's float32 GEMM sums in an order that depends on its thread count (on an Intel Xeon the
    vanilla GAN's 64x784 @ 784x128 differs between 1 and 2 threads in its last bits), and MKL may
    run fewer threads than asked when the machine is busy: same-seed runs once ended with other
    weights. The runtime turns on MKL's strict reproducible mode, so 1 and 2 threads agree.
    Where the CPU's GEMM agrees at 1 and 2 threads without it (the Zen 4 EPYC), there is nothing to
    show, and the test says so instead of passing."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    def weights(threads: int, mkl_cbwr: str | None) -> dict:
        env = {key: value for key, value in os.environ.items() if key != "MKL_CBWR"}
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if mkl_cbwr:  # set by the user: the runtime leaves it
            env["MKL_CBWR"] = mkl_cbwr
        out = tmp_path / f"{threads}-{mkl_cbwr}"
        command = [sys.executable, "GAN/vanilla_gan/gan_pytorch.py", "--out", str(out),
                   "--iters", "6", "--batch-size", "64", "--data-limit", "256", "--sample-every", "0"]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return checkpoint_arrays(out / "checkpoints" / "step_000006.pt")

    def same(one: dict, two: dict) -> bool:
        return one.keys() == two.keys() and all(np.array_equal(one[key], two[key]) for key in one)

    if same(weights(1, "AUTO"), weights(2, "AUTO")):  # MKL's default, not strict
        pytest.skip("this CPU's float32 GEMM sums alike at 1 and 2 threads: nothing for strict mode to fix")
    one, two = weights(1, None), weights(2, None)  # the runtime's default
    for key in one:
        np.testing.assert_array_equal(one[key], two[key], err_msg=key)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_resume_rewinds_to_the_checkpoint_when_a_run_died_after_it(framework, tmp_path):
    out = tmp_path / "run"
    train(framework, out, "--iters", "8", "--checkpoint-every", "4")
    suffix = "pt" if framework == "pytorch" else "npz"
    (out / "checkpoints" / f"step_000008.{suffix}").unlink()  # as if killed after step 7
    summary = train(framework, out, "--iters", "8", "--resume")
    assert summary["step"] == 8
    steps = [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]  # rows past the checkpoint were replaced, not duplicated


@pytest.mark.parametrize("iters, log_every, lines", [
    (20000, 100, 10), (1234, 100, 13), (1500, 7, 11), (10, 100, 1), (50, 3, 9)])
def test_without_a_terminal_progress_is_a_line_about_every_tenth_of_the_run(iters, log_every, lines):
    """A history row every log_every steps (and the last); a plain line at about ten of them."""
    from types import SimpleNamespace

    from common.loop import Progress

    printed = []
    cfg = SimpleNamespace(iters=iters, log_every=log_every, model="gan", framework="pytorch")
    progress = Progress(cfg, 0, printed.append, shown=False)
    rows = [*range(log_every, iters, log_every), iters]
    for step in rows:
        progress.show({"step": step, "loss_scale": 1.0, "skipped_total": 0, "step_ms": 1.0}, {"d_loss": 0.5},
                      finishing=step == iters)
    progress.close()
    assert len(printed) == lines, [line.split()[1] for line in printed]
    assert printed[-1].startswith(f"step {iters:>7}/{iters}")


def test_an_existing_run_is_not_clobbered(tmp_path, capsys):
    out = tmp_path / "run"
    train("pytorch", out, "--iters", "2")
    expect_exit(2, "already holds a run: pass --resume to continue it", capsys, "pytorch", out, "--iters", "2")
    # --resume would be refused for these: not advised
    expect_exit(2, "already holds a run of other settings (lr: 0.0002 -> 0.002): --out for a new folder, or "
                "--overwrite to start over", capsys, "pytorch", out, "--iters", "2", "--lr", "0.002")
    train("pytorch", out, "--iters", "2", "--overwrite")  # explicit: allowed


def test_another_datasets_run_gets_a_default_folder_of_its_own(tmp_path, monkeypatch, capsys):
    """The README's MNIST command and then its 2-D mixture one, neither with --out: the second
    met the first's folder and was refused."""
    monkeypatch.chdir(tmp_path)
    gan_pytorch.main([*TINY, "--iters", "2", "--no-tensorboard"])
    gan_pytorch.main([*TINY, "--iters", "2", "--no-tensorboard", "--dataset", "grid25"])
    runs = tmp_path / "runs" / "vanilla_gan"
    assert sorted(path.name for path in runs.iterdir()) == ["pytorch-fp32", "pytorch-fp32-grid25"]
    assert json.loads((runs / "pytorch-fp32-grid25" / "config.json").read_text())["dataset"] == "grid25"
    assert json.loads((runs / "pytorch-fp32" / "config.json").read_text())["dataset"] == "mnist"


def test_a_run_killed_before_its_first_checkpoint_is_sent_to_overwrite_by_both_messages(tmp_path, capsys):
    """--resume said "start without --resume", and without it "pass --resume": a loop."""
    out = tmp_path / "run"
    train("pytorch", out, "--iters", "2")
    for path in (out / "checkpoints").iterdir():  # as if killed before its first checkpoint
        path.unlink()
    expect_exit(1, "no checkpoint left (it stopped before its first, or they were deleted); start it over with "
                "--overwrite", capsys, "pytorch", out, "--iters", "2", "--resume")
    expect_exit(2, "with no checkpoint left (stopped before its first, or they were deleted): pass --overwrite",
                capsys, "pytorch", out, "--iters", "2")


def test_resume_without_iters_keeps_the_runs_own(tmp_path, monkeypatch, capsys):
    """--resume with --iters left out went on to the model's default (20,000), unsaid, for a
    run set to train 4 or 6 iterations; --iters named still sets it."""
    from common.config import parse_args
    from common.errors import UsageError

    out = tmp_path / "run"
    train("pytorch", out, "--iters", "4", "--checkpoint-every", "2")
    for path in (out / "checkpoints").glob("step_000004.*"):  # as if stopped at step 2
        path.unlink()
    resumed = ["--out", str(out), *TINY, "--resume"]
    assert parse_args("vanilla_gan", "pytorch", resumed).iters == 4
    assert parse_args("vanilla_gan", "pytorch", [*resumed, "--iters", "6"]).iters == 6
    assert gan_pytorch.main(resumed)["step"] == 4
    assert gan_pytorch.main([*resumed, "--iters", "6"])["step"] == 6
    capsys.readouterr()
    gan_pytorch.main(resumed)
    assert "nothing to do: the run is at step 6 and --iters is 6" in capsys.readouterr().out

    # the default folder, under each precision --amp may resolve to
    monkeypatch.chdir(tmp_path)
    gan_pytorch.main([*TINY, "--iters", "3", "--amp", "--no-tensorboard"])
    assert parse_args("vanilla_gan", "pytorch", [*TINY, "--resume", "--amp"]).iters == 3
    assert parse_args("vanilla_gan", "pytorch", [*TINY, "--resume"]).iters == 20000  # no float32 run to resume
    # a float16 run beside it, of 7: which one --device auto means is not known yet
    fp16 = Path("runs/vanilla_gan/pytorch-amp-fp16")
    fp16.mkdir()
    settings = json.loads(Path("runs/vanilla_gan/pytorch-amp-bf16/config.json").read_text())
    (fp16 / "config.json").write_text(json.dumps({**settings, "iters": 7}))
    with pytest.raises(UsageError, match=r"^--resume: two runs could be the one meant, runs/vanilla_gan/"
                       r"pytorch-amp-bf16 \(--iters 3\) and runs/vanilla_gan/pytorch-amp-fp16 \(--iters 7\); "
                       r"name --iters, --device or --amp-dtype$"):
        parse_args("vanilla_gan", "pytorch", [*TINY, "--resume", "--amp", "--device", "auto"])
    assert parse_args("vanilla_gan", "pytorch", [*TINY, "--resume", "--amp", "--device", "cpu"]).iters == 3
    assert parse_args("vanilla_gan", "pytorch", [*TINY, "--resume", "--amp", "--amp-dtype", "float16"]).iters == 7


def test_resume_refuses_other_settings_or_nothing_to_resume(tmp_path, capsys):
    out = tmp_path / "run"
    expect_exit(1, "nothing to resume", capsys, "pytorch", out, "--iters", "2", "--resume")
    train("pytorch", out, "--iters", "2")
    expect_exit(1, "lr: 0.0002 -> 0.002", capsys, "pytorch", out,
                "--lr", "0.002", "--iters", "4", "--resume")
    # an --out of its own names no precision, as a default folder does: the run's is kept
    expect_exit(1, "precision: 'fp32' -> 'amp-bf16'", capsys, "pytorch", out, "--amp", "--iters", "4", "--resume")
    # another --data-limit is another epoch's permutation and other examples: no bit-exact resume
    expect_exit(1, "data_limit: 256 -> 128", capsys, "pytorch", out, "--data-limit", "128", "--iters", "4", "--resume")
    # another rate of the average of G is another average from here on (mutation round 10:
    # ema_decay dropped from the settings a resume must keep went unseen)
    expect_exit(1, "ema_decay: 0.999 -> 0.9", capsys, "pytorch", out, "--ema-decay", "0.9", "--iters", "4", "--resume")


def test_resume_refuses_a_recorded_iters_that_is_no_count(tmp_path, capsys):
    """A --resume without --iters goes to the run's own; an edited config.json whose iters is
    no count of iterations is one line, where the model's default took its place (a run of 2
    iterations trained on to 20,000; mutation round 10 found the case untested)."""
    out = tmp_path / "run"
    train("pytorch", out, "--iters", "2")
    config = json.loads((out / "config.json").read_text())
    for iters, shown in ((-5, "-5"), (0, "0"), ("2", "'2'"), (True, "True"), (2**63, str(2**63)), (2.0, "2.0")):
        (out / "config.json").write_text(json.dumps({**config, "iters": iters}))
        expect_exit(2, f"records iters {shown}, not a count of iterations", capsys, "pytorch", out, "--resume")
    (out / "config.json").write_text(json.dumps(config))
    assert train("pytorch", out, "--resume")["step"] == 2  # its own 2: nothing left to train


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_resume_starts_from_the_latest_checkpoint(framework, tmp_path, capsys):
    """Of the two kept (steps 4 and 6), the later: from step 4 the same deterministic steps would
    end alike, so only the line and the history's untouched rows tell."""
    out = tmp_path / "run"
    train(framework, out, "--iters", "6", "--checkpoint-every", "2")
    rows = (out / "history.jsonl").read_text().splitlines()
    capsys.readouterr()
    train(framework, out, "--iters", "8", "--checkpoint-every", "2", "--resume")
    suffix = "pt" if framework == "pytorch" else "npz"
    assert f"resumed from {out / 'checkpoints' / f'step_000006.{suffix}'} at step 6" in capsys.readouterr().out
    assert (out / "history.jsonl").read_text().splitlines()[:3] == rows  # step 6's row kept, not trained again


def test_resume_names_a_datasets_run_in_its_default_folder_of_before(tmp_path, monkeypatch, capsys):
    """Since a dataset other than MNIST has its name in the default folder, a --resume of a run
    trained before looked in runs/<model>/<framework>-<precision>-<dataset> and said only
    "nothing to resume"."""
    monkeypatch.chdir(tmp_path)
    before = Path("runs/vanilla_gan/pytorch-fp32")
    train("pytorch", before, "--dataset", "ring8", "--iters", "2", "--no-tensorboard")
    with pytest.raises(SystemExit):
        gan_pytorch.main([*TINY, "--dataset", "ring8", "--iters", "4", "--resume"])
    assert capsys.readouterr().err == (
        "error: nothing to resume in runs/vanilla_gan/pytorch-fp32-ring8: no config.json; the run of ring8 in "
        "runs/vanilla_gan/pytorch-fp32 is in its default folder of before (without -ring8): --out "
        "runs/vanilla_gan/pytorch-fp32, or move it here\n")
    # an MNIST run there is not the one meant
    train("pytorch", before, "--iters", "2", "--no-tensorboard", "--overwrite")
    expect_exit(1, "nothing to resume in runs/vanilla_gan/pytorch-fp32-ring8: no config.json; start without "
                "--resume", capsys, "pytorch", "runs/vanilla_gan/pytorch-fp32-ring8", "--dataset", "ring8", "--resume")


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_corrupt_checkpoint_is_one_clear_error(framework, tmp_path, capsys):
    out = tmp_path / "run"
    train(framework, out, "--iters", "2")
    suffix = "pt" if framework == "pytorch" else "npz"
    (out / "checkpoints" / f"step_000002.{suffix}").write_bytes(b"not a checkpoint")
    settings = (out / "config.json").read_bytes()
    expect_exit(1, "is unreadable", capsys, framework, out, "--iters", "4", "--resume", "--clip-grad-norm", "1")
    # the refused resume left the run's settings: config.json said --iters 4 and the clipping,
    # which no step had run under (the summary said 2)
    assert (out / "config.json").read_bytes() == settings
    (out / "checkpoints" / f"step_000002.{suffix}").unlink()  # back to the run's own checkpoint ...
    train(framework, out, "--iters", "2", "--overwrite")
    settings = (out / "config.json").read_bytes()
    (out / "history.jsonl").write_text("garbage\n" + (out / "history.jsonl").read_text())  # ... a damaged history
    expect_exit(1, "is not a history row", capsys, framework, out, "--iters", "4", "--resume", "--clip-grad-norm", "1")
    assert (out / "config.json").read_bytes() == settings


def test_a_pytorch_checkpoint_holding_code_or_cut_short_says_so_and_runs_nothing(tmp_path, capsys):
    """torch.load's own error for code in the file runs to a paragraph that advises
    weights_only=False, which would run it; ours says what is wrong in a few words."""
    import torch

    out, marker = tmp_path / "run", tmp_path / "the checkpoint's code ran"
    train("pytorch", out, "--iters", "2")
    path = out / "checkpoints" / "step_000002.pt"
    saved = path.read_bytes()
    torch.save({"format": 1, "meta": CodeInAPickle(marker)}, path)
    expect_exit(1, f"checkpoint {path} is unreadable (it holds more than tensors and plain values, or is "
                "damaged; nothing in it was run); delete it to resume from the one before",
                capsys, "pytorch", out, "--iters", "4", "--resume")
    assert not marker.exists()
    path.write_bytes(saved[:len(saved) // 2])
    expect_exit(1, "is unreadable (cut short or damaged)", capsys, "pytorch", out, "--iters", "4", "--resume")
    # each cut failed in torch.load its own way; some were called "not a file torch.save writes"
    from common.errors import CheckpointError
    from common.pytorch.checkpoint import load_tensors

    for length in (0, 3, 4, 10, 30, 5000, len(saved) - 1):
        path.write_bytes(saved[:length])
        with pytest.raises(CheckpointError) as error:
            load_tensors(path)
        why = "empty or cut short" if length < 4 else "cut short or damaged"
        assert str(error.value) == f"checkpoint {path} is unreadable ({why})", length
    # one written with torch's CRC-32s off (each 0) loads: the CRC check must not refuse it
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(3)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert load_tensors(path)["w"].tolist() == [1.0, 1.0, 1.0]
    for content, why in ((b"PK\x03\x04" + bytes(500), "(cut short or damaged)"),
                         (b"step 2, all well", "(not a zip file of torch.save's: "),
                         (b"xyz", "(it holds more than tensors")):  # short, but no zip's start: not "cut short"
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} is unreadable {why}")):
            load_tensors(path)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_checkpoint_with_a_flipped_bit_is_refused(framework, tmp_path, capsys):
    """torch.load does not check the zip's CRCs: a checkpoint with one bit of a weight flipped
    resumed with that weight wrong (np.load, TensorFlow's reader, refused it)."""
    import zipfile

    out = tmp_path / "run"
    train(framework, out, "--iters", "2")
    (path,) = (out / "checkpoints").iterdir()
    with zipfile.ZipFile(path) as archive:
        largest = max(archive.infolist(), key=lambda entry: entry.file_size)
    content = bytearray(path.read_bytes())
    content[largest.header_offset + 30 + len(largest.filename) + len(largest.extra) + largest.file_size // 2] ^= 1
    path.write_bytes(content)
    crc = {"pytorch": f"(damaged: {largest.filename} fails its CRC check)",
           "tensorflow": f"(BadZipFile: Bad CRC-32 for file '{largest.filename}')"}[framework]
    expect_exit(1, f"checkpoint {path} is unreadable {crc}; delete it to resume from the one before",
                capsys, framework, out, "--iters", "4", "--resume")


def test_a_tensorflow_checkpoint_from_before_the_counted_noise_loads_with_a_warning(tmp_path, capsys):
    """Format 1 saved a tf.random.Generator's 3-number state; format 2 the noise's draw
    counter. Old runs still reopen (evaluate.py, compare.py, --resume), saying that their
    noise restarts (on one line, a line break in the run's path escaped); a format this version
    does not know is one error line."""
    out = tmp_path / "r\nun"
    train("tensorflow", out, "--iters", "2")
    path = out / "checkpoints" / "step_000002.npz"
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    np.savez(path, **{**arrays, "format": np.array(1), "rng/noise/0000": np.array([7, 0, 0], np.int64)})
    capsys.readouterr()
    train("tensorflow", out, "--iters", "4", "--resume")
    printed = capsys.readouterr().out
    assert "resumed from" in printed
    warning = f"warning: {tmp_path}/r\\nun/checkpoints/step_000002.npz predates the counted noise (format 1)"
    assert any(line.startswith(f"{warning}: its noise restarts") for line in printed.splitlines()), printed
    assert "step_000004.npz" in {p.name for p in (out / "checkpoints").iterdir()}

    np.savez(path, **{**arrays, "format": np.array(3)})
    (out / "checkpoints" / "step_000004.npz").unlink()
    expect_exit(1, "written in format 3, and this version reads formats 1 and 2", capsys, "tensorflow", out,
                "--iters", "4", "--resume")


def test_summarize_runs_tabulates_every_run(tmp_path, capsys):
    from scripts import summarize_runs

    train("pytorch", tmp_path / "runs" / "pt", "--iters", "4")
    train("tensorflow", tmp_path / "runs" / "tf", "--iters", "4", "--amp")
    capsys.readouterr()
    assert summarize_runs.main([str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 6  # header, rule, two runs, a blank line, the CPU both ran on
    assert table[4:] == ["", f"CPU: {cpu.summary()}"]
    assert table[2].startswith("| pt | vanilla_gan pytorch | mnist | fp32 | cpu | 4 |")
    assert table[3].startswith("| tf | vanilla_gan tensorflow | mnist | amp-bf16 | cpu | 4 |")
    final = json.loads((tmp_path / "runs" / "pt" / "summary.json").read_text())["final"]
    assert table[2].endswith(f"| d_loss {final['d_loss']:.3f}, g_loss {final['g_loss']:.3f} |")
    (tmp_path / "empty").mkdir()
    for folder in ("empty", "missing"):  # one line each, exit status 1
        with pytest.raises(SystemExit) as stopped:
            summarize_runs.main([str(tmp_path / folder)])
        assert stopped.value.code == 1
        assert len(capsys.readouterr().err.splitlines()) == 1


class PairsInTurn:
    """A batch order for HostLoader: rows (s % period, s % period + 8) at step s."""

    def __init__(self, period: int):
        self.period = period

    def batches(self, start, stop):
        return ([step % self.period, step % self.period + 8] for step in range(start, stop))


def points_loader(count: int):
    """A one-worker HostLoader over `count` 2-D points (values 0, 1, 2, ... row by row)."""
    import torch

    from common.data import Dataset
    from common.pytorch.data import HostLoader

    points = Dataset("ring8", np.arange(2 * count, dtype=np.float32).reshape(count, 2), np.zeros(count, np.int64))
    return HostLoader(points, torch.device("cpu"), (-1.0, 1.0), workers=1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_or_sigterm_that_reaches_the_data_loaders_worker_leaves_it_serving_batches(signum):
    """A terminal's Ctrl-C reaches the whole process group, --workers' DataLoader processes
    too: one it killed made the loader raise "worker exited unexpectedly" at the next batch,
    or inside the checkpoint the loop was saving for that Ctrl-C (no checkpoint written).
    SIGTERM alike, from `kill -TERM -- -PGID` or a stop that signals every process (mutation
    round 9: the workers left to die of SIGTERM went unseen)."""
    import os
    import time

    loader = points_loader(64)
    loader.start(PairsInTurn(56), 0, 1_000)
    try:
        assert loader.batch(None).shape == (2, 2)
        (worker,) = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        os.kill(int(worker), signum)
        time.sleep(0.5)
        for step in range(1, 1_000):  # far past the batches it had prefetched
            assert loader.batch(None)[0, 0] == 2 * (step % 56)
    finally:
        loader.stop()


def test_the_host_loaders_lookup_gives_the_resident_paths_batch():
    """--workers: the batch the precision report measures (lookup, outside the training
    sequence) is scaled to the model's range as the resident path's is (mutation round 9:
    lookup returning the raw uint8 rows went unseen)."""
    import torch

    from common.data import Dataset
    from common.pytorch.data import DeviceData, HostLoader

    images = Dataset("mnist", np.arange(16 * 2 * 3, dtype=np.uint8).reshape(16, 2, 3, 1), np.zeros(16, np.int64))
    indices = torch.tensor([5, 1, 12])
    loader = HostLoader(images, torch.device("cpu"), (-1.0, 1.0), workers=1)
    got, expected = loader.lookup(indices), DeviceData(images, torch.device("cpu"), (-1.0, 1.0)).batch(indices)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_stopped_host_loader_is_let_go_with_its_host_copy_of_the_data():
    """start() registers stop() to run at exit; stop() must take it back, or the exit handler
    keeps every loader and its host copy of the training set alive until the process ends
    (mutation round 9: the atexit.unregister dropped went unseen)."""
    import gc
    import weakref

    loader = points_loader(16)
    loader.start(PairsInTurn(8), 0, 10)
    assert loader.batch(None).shape == (2, 2)
    loader.stop()
    let_go = weakref.ref(loader)
    del loader
    gc.collect()
    assert let_go() is None


# TensorFlow lists them all still: from_generator made its parallel map sequential under op determinism
@pytest.mark.parametrize("framework", ["pytorch"])
def test_the_host_loader_draws_its_batches_as_it_goes_not_the_whole_run_first(framework):
    """--workers N: every batch of the run was listed before the first step, memory and start-up
    growing with --iters (780 MB and 4.5 s at 2,000,000 steps)."""
    from common.data import Dataset
    from common.runs import BatchOrder

    class CountedOrder(BatchOrder):
        drawn = 0

        def batches(self, start_step, stop_step):
            for batch in super().batches(start_step, stop_step):
                CountedOrder.drawn += 1
                yield batch

    images = Dataset("mnist", np.arange(64 * 4, dtype=np.uint8).reshape(64, 2, 2, 1), np.zeros(64, np.int64))
    order, steps = CountedOrder(64, 8, seed=0), 100_000
    if framework == "pytorch":
        import torch

        from common.pytorch.data import HostLoader

        loader = HostLoader(images, torch.device("cpu"), (0.0, 255.0), workers=1)
        loader.start(order, 3, steps)
        first = [loader.batch(None)[:, 0, 0, 0].numpy() for _ in range(20)]  # NCHW
    else:
        from common.tensorflow.data import HostLoader

        loader = HostLoader(images, (0.0, 255.0), workers=1)
        loader.start(order, 3, steps)
        first = [next(loader.iterator)[:, 0, 0, 0].numpy() for _ in range(20)]  # NHWC
    try:
        expected = [batch * 4 for batch in BatchOrder(64, 8, seed=0).batches(3, 23)]  # each image's first pixel
        np.testing.assert_array_equal(first, expected)
        assert CountedOrder.drawn < steps // 10, CountedOrder.drawn
    finally:
        loader.stop()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_checkpoints_the_current_step_and_resume_finishes(signum, tmp_path):
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    out = tmp_path / "run"
    command = [sys.executable, str(REPO / "GAN/vanilla_gan/gan_pytorch.py"), "--out", str(out),
               *TINY, "--iters", "200000", "--checkpoint-every", "0", "--sample-every", "0"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "history.jsonl").exists():  # the first row: the loop is running
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and "checkpoint saved" in stdout
    (step, checkpoint), = RunFolder(out).list_checkpoints()
    assert 0 < step < 200000 and checkpoint.exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["step"] == step
    if signum == signal.SIGINT:  # measured where it stands, it stays unfinished (quality_table.py skips it)
        from scripts import evaluate

        assert evaluate.main([str(out), "--samples", "10"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["stopped_early"] and summary["step"] == step and summary["metrics"]["samples"] == 10

    resumed = gan_pytorch.main(["--out", str(out), *TINY, "--iters", str(step + 4),
                                "--checkpoint-every", "0", "--sample-every", "0", "--resume"])
    assert resumed["step"] == step + 4 and not resumed["stopped_early"]
    assert json.loads((out / "config.json").read_text())["iters"] == step + 4  # a resume that trains records its flags


@pytest.mark.parametrize("signum, target", [(signal.SIGINT, "group"), (signal.SIGTERM, "group"),
                                            (signal.SIGTERM, "each process")])
def test_a_stop_signal_to_every_process_stops_a_run_with_data_loader_workers_cleanly(signum, target, tmp_path):
    """`kill -TERM -- -PGID`, or a stop that signals every process (systemd, Slurm's scancel),
    reaches --workers' DataLoader processes too: one it killed made PyTorch raise "DataLoader
    worker ... is killed by signal" at once, mid-step: a traceback, and no checkpoint."""
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    out = tmp_path / "run"
    command = [sys.executable, str(REPO / "GAN/vanilla_gan/gan_pytorch.py"), "--out", str(out),
               *TINY, "--iters", "200000", "--checkpoint-every", "0", "--sample-every", "0", "--workers", "1"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "history.jsonl").exists():  # the first row: the loop is running
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        if target == "group":
            os.killpg(process.pid, signum)
        else:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
            assert children  # the worker
            for pid in [process.pid, *map(int, children)]:
                os.kill(pid, signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert "checkpoint saved" in stdout
    (step, checkpoint), = RunFolder(out).list_checkpoints()
    assert 0 < step < 200000


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_ctrl_c_while_evaluating_names_the_command_that_measures_the_saved_run(framework, tmp_path, monkeypatch,
                                                                                 capsys):
    """The training is finished and checkpointed when its evaluation starts: a Ctrl-C there said
    only "interrupted", as if the run were lost."""
    module = __import__(f"common.{framework}.session", fromlist=["Session"])

    def interrupted(self, cfg, keep=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(module.Session, "evaluate", interrupted)
    out = tmp_path / "my run"
    err = expect_exit(130, "", capsys, framework, out, "--iters", "2", "--evaluate", "100")
    assert err == (f"error: interrupted while evaluating; the run is saved at step 2: python "
                   f"scripts/evaluate.py '{out}' --samples 100 measures it"), err
    assert [step for step, _ in RunFolder(out).list_checkpoints()] == [2]
    # the evaluation's own flags are in the command; a process that trained nothing (evaluate.py's
    # child) leaves the advice to its caller
    err = expect_exit(130, "", capsys, framework, out, "--iters", "2", "--evaluate", "100", "--eval-draws", "3",
                      "--save-samples", "--resume")
    assert err == "error: interrupted", err
    err = expect_exit(130, "", capsys, framework, out, "--iters", "3", "--evaluate", "100", "--eval-draws", "3",
                      "--save-samples", "--resume")
    assert err.endswith(f"step 3: python scripts/evaluate.py '{out}' --samples 100 --draws 3 --save-samples "
                        "measures it"), err


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_resume_on_images_of_another_shape_says_the_data_changed(framework, tmp_path, capsys):
    """One RGB image added to a gray folder made the data 3-channel: the resume failed in the
    checkpoint's restore, as a checkpoint that "does not fit this model", worded by each framework.
    The refusal lets the run folder go at once, as RunFolder.prepare's own refusals do: while the
    error is still held (here by pytest, in a notebook by its last traceback), another process
    is not told the run is in use."""
    import fcntl

    from PIL import Image

    data, out = tmp_path / "images", tmp_path / "run"
    data.mkdir()
    for index in range(8):
        Image.fromarray(np.full((8, 8), index * 30, np.uint8)).save(data / f"{index}.png")
    flags = ["--dataset", "folder", "--data-dir", str(data), "--width", "8", "--batch-size", "8",
             "--no-tensorboard", "--sample-every", "0"]
    SCRIPTS[framework].main(["--out", str(out), *flags, "--iters", "2"])
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(data / "colour.png")
    settings = (out / "config.json").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[framework].main(["--out", str(out), *flags, "--iters", "4", "--resume"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and err == (
        f"error: --resume: the data is shaped (8, 8, 3), and the run in {out} started on (8, 8, 1): its images "
        "changed (channels or size); resume on the run's data, or train a new run (another --out)"), err
    assert (out / "config.json").read_bytes() == settings
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # another open file, as another process's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the run holds it
    finally:
        os.close(fd)
    (data / "colour.png").unlink()  # the run's data again: it resumes, in this process too (the folder let go)
    SCRIPTS[framework].main(["--out", str(out), *flags, "--iters", "4", "--resume"])
    assert json.loads((out / "summary.json").read_text())["step"] == 4


def test_a_resume_whose_initial_weights_cannot_tell_the_data_shape_resumes(tmp_path, capsys):
    """The data-shape check reads the shape from initial_weights.npz: a run from before it was
    recorded there, or a damaged file, is left to the checkpoint's restore (it resumes), not
    stopped with a traceback."""
    from common import porting

    out = tmp_path / "run"
    train("pytorch", out, "--iters", "2", "--sample-every", "0")
    initial = out / porting.INITIAL_WEIGHTS
    networks, meta = porting.load_weights(initial)
    meta.pop("sample_shape")  # as an older run wrote it
    porting.save_weights(initial, networks, meta)
    train("pytorch", out, "--iters", "4", "--sample-every", "0", "--resume")
    assert json.loads((out / "summary.json").read_text())["step"] == 4
    initial.write_bytes(b"not a zip")  # damaged
    train("pytorch", out, "--iters", "6", "--sample-every", "0", "--resume")
    assert json.loads((out / "summary.json").read_text())["step"] == 6


def nan_losses_then_ctrl_c(framework, monkeypatch, nan_from: int, ctrl_c_at: int):
    """The session's train_step reports NaN losses from its `nan_from`th call on, counted over
    the test's runs (the weights stay finite, as in float16 steps a loss scaler skips), and
    sends this process a SIGINT, as a Ctrl-C does, in its `ctrl_c_at`th call."""
    module = __import__(f"common.{framework}.session", fromlist=["Session"])
    step, calls = module.Session.train_step, []

    def reported(self, indices):
        calls.append(1)
        metrics = step(self, indices)
        if len(calls) == ctrl_c_at:
            os.kill(os.getpid(), signal.SIGINT)
        if len(calls) < nan_from:
            return metrics
        return {key: value if key == "skipped" else value * math.nan for key, value in metrics.items()}

    monkeypatch.setattr(module.Session, "train_step", reported)


NAN_RUN = ["--iters", "10", "--nonfinite-patience", "6", "--sample-every", "0", "--checkpoint-every", "0"]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_run_stopped_while_its_losses_are_inf_nan_says_so(framework, tmp_path, monkeypatch, capsys):
    nan_losses_then_ctrl_c(framework, monkeypatch, nan_from=3, ctrl_c_at=5)
    with pytest.raises(SystemExit) as stopped:
        train(framework, tmp_path / "run", *NAN_RUN)
    assert stopped.value.code == 130
    stdout = capsys.readouterr().out
    assert [line for line in stdout.splitlines() if "inf/NaN" in line] == [
        "warning: the losses have been inf/NaN since step 3 (3 steps; --resume counts on toward "
        "--nonfinite-patience 6): --clip-grad-norm N, which --resume takes, or a lower --lr in a new run "
        "(another --out, or --overwrite)"]  # float32: no --amp-dtype bfloat16; --resume refuses another --lr
    assert "stopped at step 5, checkpoint saved; continue with the same command and --resume" in stdout


def test_divergence_advice_offers_bfloat16_to_float16_runs_only():
    """--amp-dtype bfloat16 was offered to float32 runs, which refuse it without --amp, and to
    bfloat16 runs; and a lower --lr with --resume, which refuses another --lr."""
    from common.loop import divergence_remedies

    assert divergence_remedies("amp-fp16").endswith("or a lower --lr or --amp-dtype bfloat16 in a new run "
                                                    "(another --out, or --overwrite)")
    assert all("bfloat16" not in divergence_remedies(precision) for precision in ("fp32", "amp-bf16"))


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_resume_counts_on_the_inf_nan_streak_from_before_the_stop(framework, tmp_path, monkeypatch, capsys):
    """The checkpoint records the losses' inf/NaN streak: --nonfinite-patience counts the
    steps before a Ctrl-C and after the --resume together (from 0 again, a run that kept
    being preempted never stopped)."""
    out = tmp_path / "run"
    nan_losses_then_ctrl_c(framework, monkeypatch, nan_from=3, ctrl_c_at=5)
    with pytest.raises(SystemExit) as stopped:
        train(framework, out, *NAN_RUN)
    assert stopped.value.code == 130
    capsys.readouterr()
    # steps 3-5 inf/NaN before the stop, 6-8 after it: 6 steps, --nonfinite-patience's
    with pytest.raises(SystemExit) as diverged:
        train(framework, out, *NAN_RUN, "--resume")
    assert diverged.value.code == 1
    err = capsys.readouterr().err
    assert "the losses have been inf/NaN since step 3 (6 steps): stopped at step 8" in err
    # advice --resume takes: the same settings resumed diverge again, bit for bit
    assert err.strip().endswith("; --resume --clip-grad-norm N continues from the last good checkpoint (step 5); "
                                "a lower --lr needs a new run (another --out, or --overwrite)"), err
    assert json.loads((out / "summary.json").read_text())["stopped"] == "losses inf/NaN since step 3"


def is_matrix_product(operation: str) -> bool:
    """Any kernel of the family, whichever the CPU gets: aten::mm / addmm / linear, MatMul,
    oneDNN's _MklMatMul and fused variants, XLA dot."""
    return re.search(r"matmul|(^|::)(add)?mm$|linear|\bdot\b", operation, re.IGNORECASE) is not None


@pytest.mark.parametrize("framework, trace_glob", [("pytorch", "trace.json"), ("tensorflow", "**/*.xplane.pb")])
def test_profile_writes_a_trace_and_a_table_of_top_operations(framework, trace_glob, tmp_path, capsys):
    out = tmp_path / "run"
    train(framework, out, "--iters", "16", "--profile")
    stdout = capsys.readouterr().out
    traces = list((out / "profile").glob(trace_glob))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    table = (out / "profile" / "top_ops.txt").read_text()
    assert table in stdout + "\n"
    assert table.startswith(f"top operations by self {'CPU' if framework == 'pytorch' else 'host'} time over 10")
    rows = [line.split() for line in table.splitlines()[2:]]
    calls = {row[0]: float(row[-3]) for row in rows}
    shares = [float(row[-1].rstrip("%")) for row in rows]
    # Forward alone, a step runs 8 matrix products: G's two layers, and D's two on real, on
    # fake and for G's loss. The table must count them per step, whatever their kernels' names.
    assert sum(count for operation, count in calls.items() if is_matrix_product(operation)) >= 8
    assert len(rows) >= 5
    assert shares == sorted(shares, reverse=True) and 50 < sum(shares) <= 100.5


@pytest.mark.parametrize("framework, name, kind", [
    ("pytorch", "top_ops.txt", "link"), ("tensorflow", "top_ops.txt", "folder"), ("pytorch", "trace.json", "link"),
    ("tensorflow", "plugins", "file"), ("tensorflow", "plugins/profile", "link"), ("pytorch", "", "link")])
def test_a_profile_folder_the_window_would_fail_on_or_write_through_is_refused_before_training(framework, name, kind,
                                                                                               tmp_path, capsys):
    """A link in profile/ had the window's table (or trace) written over the file it points to,
    outside the run; a folder or file in the wrong place failed the run when the window ended
    (TensorFlow: a traceback), its steps since the last checkpoint lost."""
    out, victim = tmp_path / "run", tmp_path / "precious.txt"
    train(framework, out, "--iters", "2")
    victim.write_text("the user's")
    (tmp_path / "elsewhere").mkdir()
    path = out / "profile" / name if name else out / "profile"  # "": profile/ itself, a link to a folder
    path.parent.mkdir(parents=True, exist_ok=True)
    target = victim if name else tmp_path / "elsewhere"
    {"link": lambda: path.symlink_to(target), "folder": path.mkdir, "file": lambda: path.write_text("x")}[kind]()
    what = {"link": "a link", "folder": "a folder", "file": "not a folder"}[kind]
    expect_exit(1, f"{path} is {what}, where --profile writes its", capsys, framework, out, "--iters", "16",
                "--resume", "--profile")
    assert victim.read_text() == "the user's" and not any((tmp_path / "elsewhere").iterdir())
    assert [step for step, _ in RunFolder(out).list_checkpoints()] == [2]  # refused before its first step


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_profile_of_a_run_that_ends_inside_its_window_reports_the_steps_it_profiled(framework, tmp_path, capsys):
    # The window is steps 5 to 14; this run ends after step 8. Left running, PyTorch's
    # profiler crashed the process at exit and TensorFlow's wrote nothing.
    out = tmp_path / "run"
    train(framework, out, "--iters", "8", "--profile")
    table = (out / "profile" / "top_ops.txt").read_text()
    clock = "CPU" if framework == "pytorch" else "host"
    assert table.startswith(f"top operations by self {clock} time over 3 profiled steps")
    assert table in capsys.readouterr().out + "\n"


def test_tensorflow_profile_takes_a_nested_ops_time_off_the_op_around_it(tmp_path):
    """An op that calls a function (a loop, an If) spans the ops it runs: its self time is its
    own span less theirs, or the table counted that time twice. The run-level tests above
    see only shares of the total, which taking nothing off leaves summing to 100%."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from common.tensorflow.profiling import host_operations

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    for key, (name, op_type) in enumerate([("loop/While:While", "While"), ("loop/body/MatMul:MatMul", "MatMul"),
                                           ("ExecutorState::Process", "")], start=1):
        plane.event_metadata[key].id = key
        plane.event_metadata[key].name = name
        plane.event_metadata[key].display_name = op_type
    line = plane.lines.add(name="tf_executor")
    # ps: While 10 us around two MatMuls, 3 + 1, the second starting as the first ends (not in it)
    for key, offset, duration in [(1, 0, 10_000_000), (3, 1_000_000, 5_000_000), (2, 2_000_000, 3_000_000),
                                  (2, 5_000_000, 1_000_000)]:
        line.events.add(metadata_id=key, offset_ps=offset, duration_ps=duration)
    trace = tmp_path / "host.xplane.pb"
    trace.write_bytes(space.SerializeToString())
    assert sorted(host_operations(trace)) == [("MatMul", 2, 4e-3), ("While", 1, 6e-3)]  # ms


def test_tensorflow_profile_counts_xla_instructions_by_kind(tmp_path):
    """Under --xla the compiled step's HLO instructions, inside ThunkExecutor::Execute, are
    counted by kind, their numbering dropped ("MatMul_1.36" and "fusion.3" as "MatMul" and
    "fusion"). The --xla run's test asserts no names, so a numbering half dropped went unseen."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from common.tensorflow.profiling import host_operations

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    names = ["ThunkExecutor::Execute", "MatMul_1.36", "MatMul.2", "fusion.3", "fusion"]
    for key, name in enumerate(names, start=1):
        plane.event_metadata[key].id = key
        plane.event_metadata[key].name = name
    line = plane.lines.add(name="tf_xla_cpu")
    line.events.add(metadata_id=1, offset_ps=0, duration_ps=10_000_000)
    for key in range(2, len(names) + 1):
        line.events.add(metadata_id=key, offset_ps=key * 1_000_000, duration_ps=1_000_000)
    trace = tmp_path / "host.xplane.pb"
    trace.write_bytes(space.SerializeToString())
    assert sorted(host_operations(trace)) == [("XLA MatMul", 2, 2e-3), ("XLA fusion", 2, 2e-3)]


def test_tensorflow_profile_reads_the_newest_trace_of_its_folder(tmp_path, monkeypatch):
    """A resumed run profiled again writes a second trace beside the first (profile/ is kept):
    its table is read from the newest, by time: here the newest is also first by name, so
    neither the oldest nor the last by name passes. Each run above profiles once, so reading
    the oldest went unseen. Its TensorBoard command is one word for the shell (a folder with a
    space split it in two; one starting with "-" reads as an option)."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from common.tensorflow.profiling import Profiler

    for age, (run, op_type) in enumerate([("1", "MatMul"), ("2", "Conv2D")]):  # newest first
        space = xplane_pb2.XSpace()
        plane = space.planes.add(name="/host:CPU")
        plane.event_metadata[1].id = 1
        plane.event_metadata[1].name = f"model/{op_type}:{op_type}"
        plane.event_metadata[1].display_name = op_type
        plane.lines.add(name="tf_executor").events.add(metadata_id=1, offset_ps=0, duration_ps=1_000_000)
        trace = tmp_path / "-r un" / "plugins" / "profile" / f"run{run}" / "host.xplane.pb"
        trace.parent.mkdir(parents=True)
        trace.write_bytes(space.SerializeToString())
        os.utime(trace, (1e9 + 1000 * (1 - age), 1e9 + 1000 * (1 - age)))
    monkeypatch.setattr(tf.profiler.experimental, "stop", lambda: None)
    monkeypatch.chdir(tmp_path)  # --out=-r: a word the shell would read as an option
    rows, said = Profiler().stop(Path("-r un"))
    assert rows == [("MatMul", 1, 1e-3)]
    assert "(tensorboard --logdir './-r un', Profile tab" in said, said


def test_the_top_operations_table_shows_the_15_longest_per_step():
    """Both frameworks' table: the 15 operations of most self time, longest first, their calls
    and times per profiled step and their share of the total. The runs' tables above are held
    to neither their count of rows nor their calls per step: 14 rows, and calls over the
    window, went unseen there."""
    from common.profiling import format_top_ops

    rows = [(f"op{i}", 2 * i, float(i)) for i in range(1, 21)]  # over 2 steps: op_i runs i times a step
    table = format_top_ops(rows, 2, "host time").splitlines()
    assert table[0] == "top operations by self host time over 2 profiled steps (105.00 ms/step in operations)"
    body = [line.split() for line in table[2:]]
    assert [row[0] for row in body] == [f"op{i}" for i in range(20, 5, -1)]
    assert body[0] == ["op20", "20.0", "10.000", "9.5%"]


def test_profile_of_a_run_too_short_for_its_window_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    train("pytorch", out, "--iters", "3", "--profile")
    assert "--profile: nothing profiled: 3 steps to go" in capsys.readouterr().out
    assert not (out / "profile").exists() and (out / "summary.json").exists()
    train("pytorch", out, "--iters", "3", "--resume", "--profile")  # nothing to train: nothing to say
    assert "--profile" not in capsys.readouterr().out


def test_pytorch_profile_rows_are_milliseconds_about_the_profiled_wall_time(tmp_path):
    """The rows' self times are milliseconds: on a CPU the products that fill the window add
    up to about its wall time (bounds of 10x either way: a busy machine stretches both). (Mutation
    round 8: the profiler's microseconds handed on without / 1000, a table 1000x too slow, went
    unseen.)"""
    import torch

    from common.pytorch.profiling import Profiler

    profiler = Profiler(torch.device("cpu"))
    a = torch.randn(256, 256)
    profiler.start(tmp_path)
    began = time.perf_counter()
    for _ in range(20):
        a = torch.mm(a, a).tanh()
    wall_ms = (time.perf_counter() - began) * 1000
    rows, where = profiler.stop(tmp_path)
    total = sum(ms for _, _, ms in rows)
    assert (tmp_path / "trace.json").is_file() and str(tmp_path / "trace.json") in where
    assert 0.1 * wall_ms <= total <= 10 * wall_ms, (total, wall_ms)
    assert {"aten::mm": 20, "aten::tanh": 20}.items() <= {name: calls for name, calls, _ in rows}.items()


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_profile_into_a_file_is_refused_before_the_first_step(framework, tmp_path, capsys):
    """A `profile` file in the run folder failed only when the window ended (TensorFlow with a
    traceback), and the steps trained since the last checkpoint were lost with the run."""
    out = tmp_path / "run"
    train(framework, out, "--iters", "2")
    (out / "profile").write_text("my notes")
    settings = (out / "config.json").read_bytes()
    expect_exit(1, f"{out / 'profile'} is not a folder", capsys, framework, out, "--iters", "16", "--resume",
                "--profile")
    assert (out / "config.json").read_bytes() == settings and (out / "profile").read_text() == "my notes"
    assert [row["step"] for row in RunFolder(out).read_history()] == [2]


def write_png_folder(root, count, size=(12, 12), mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(0)
    for index in range(count):
        folder = root / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        channels = 3 if mode == "RGB" else 1
        pixels = rng.integers(0, 256, (*size, channels), dtype=np.uint8).squeeze()
        Image.fromarray(pixels, mode=mode).save(folder / f"{index}.png")


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_trains_on_an_rgb_image_folder(framework, tmp_path):
    write_png_folder(tmp_path / "images", 40, size=(10, 10))
    out = tmp_path / "run"
    SCRIPTS[framework].main(["--out", str(out), "--dataset", "folder", "--data-dir",
                             str(tmp_path / "images"), "--image-size", "8", "--batch-size", "8",
                             "--iters", "3", "--log-every", "3"])
    from PIL import Image

    grid = Image.open(out / "samples" / "step_000003.png")
    assert grid.mode in ("RGB", "RGBA") and grid.size == (8 * 8 + 9 * 2,) * 2


def test_a_dataset_smaller_than_a_batch_is_one_clear_error(tmp_path, capsys):
    write_png_folder(tmp_path / "images", 3)
    expect_exit(1, "fewer than --batch-size 32", capsys, "pytorch", tmp_path / "run",
                "--dataset", "folder", "--data-dir", str(tmp_path / "images"))


def test_a_dataset_of_no_examples_is_not_told_to_lower_the_batch_size(tmp_path, capsys, monkeypatch):
    """An empty training split was "0 examples, fewer than --batch-size 1; lower --batch-size"
    (a fresh-user review); an IDX pair of 0 images reaches it."""
    from tests.test_data import idx_bytes

    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "train-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros((0, 28, 28), np.uint8)))
    (folder / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(0, np.uint8)))
    err = expect_exit(1, f"error: mnist in {folder} holds no training examples", capsys, "pytorch",
                      tmp_path / "run", "--data-dir", str(folder), "--batch-size", "1")
    assert "--batch-size" not in err


def test_a_dataset_of_exactly_one_batch_trains_a_batch_an_epoch(tmp_path, capsys):
    write_png_folder(tmp_path / "images", 8, size=(8, 8))
    flags = ["--dataset", "folder", "--data-dir", str(tmp_path / "images"), "--batch-size"]
    assert train("pytorch", tmp_path / "run", *flags, "8", "--iters", "3")["step"] == 3
    expect_exit(1, "has 8 examples, fewer than --batch-size 9", capsys, "pytorch", tmp_path / "other",
                *flags, "9", "--iters", "3")


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_run_with_stderr_closed_trains_to_the_end(framework, tmp_path):
    """`2>&-`: sys.stderr is None, and tqdm's bar failed on it at the start (exit 1, no word)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "run"
    script = {"pytorch": "GAN/vanilla_gan/gan_pytorch.py", "tensorflow": "GAN/vanilla_gan/gan_tensorflow.py"}[framework]
    result = subprocess.run([sys.executable, str(REPO / script), "--out", str(out), *TINY, "--iters", "4",
                             "--no-tensorboard"], cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=240,
                            preexec_fn=lambda: os.close(2))
    assert result.returncode == 0 and "done: step 4" in result.stdout, result.stdout[-2000:]
    assert json.loads((out / "summary.json").read_text())["step"] == 4


def test_image_grid_holds_a_last_row_that_is_not_full():
    """3 images in 2 columns make 2 rows, the last one padding: floor division dropped it."""
    images = np.zeros((3, 4, 4, 1), np.float32)
    grid = sampling.image_grid(images, columns=2)
    assert grid.shape == (2 * (4 + 2) + 2, 2 * (4 + 2) + 2, 1)
    assert grid[8:12, 2:6].max() == 0.0 and grid[8:12, 8:12].min() == 1.0  # image 3, then the white ground


def test_colour_grids_clip_values_outside_the_pixel_range(tmp_path):
    """A G's tanh rounds to 1 and beyond under AMP, a VAE's sigmoid too: matplotlib refuses RGB
    values outside [0, 1] (grey ones are clamped by vmin/vmax), so the grid clips them."""
    from PIL import Image

    images = np.stack([np.full((4, 4, 3), 1.5), np.full((4, 4, 3), -2.0)]).astype(np.float32)
    sampling.save_image_grid(images, tmp_path / "grid.png", value_range=(-1.0, 1.0), columns=2)
    pixels = np.asarray(Image.open(tmp_path / "grid.png").convert("RGB"))
    assert (pixels[2:6, 2:6] == 255).all() and (pixels[2:6, 8:12] == 0).all()


def test_a_summary_written_again_by_a_resume_with_nothing_to_train_keeps_the_trainings_figures(tmp_path):
    """A summary.json lost or damaged is written again by --resume (summarize_runs.py and
    compare.py --reuse say so). It held the figures of that process, which trained nothing:
    final losses {}, no step time, and its own peak memory as the training's."""
    import statistics

    out = tmp_path / "run"
    trained = train("pytorch", out, "--iters", "6", "--log-every", "2", "--checkpoint-every", "6")
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    (out / "summary.json").unlink()
    rewritten = train("pytorch", out, "--iters", "6", "--log-every", "2", "--resume")
    assert rewritten == json.loads((out / "summary.json").read_text())
    assert rewritten["step"] == 6 and rewritten["final"] == trained["final"] and rewritten["final"]
    assert rewritten["median_step_ms"] == statistics.median(row["step_ms"] for row in history[1:])
    assert rewritten["samples_per_s"] == pytest.approx(32 * 1000 / rewritten["median_step_ms"])
    assert rewritten["peak_memory_mb"] is None and rewritten["skipped_steps"] == trained["skipped_steps"]
    assert rewritten["timed_from_step"] == 0  # the history's intervals, not this process's (from step 6)
    # timed on a machine the history does not name (a GPU's, maybe, or under torchrun): not this one
    assert (rewritten["cpu"], rewritten["gpu"], rewritten["replicas"]) == (None, None, None)


def test_history_figures_take_the_losses_of_the_row_at_the_step_only():
    """A checkpoint between two log steps (step 5 here): the losses of step 4 are not step 5's."""
    from common.loop import history_figures

    rows = [{"step": 2, "loss": 1.0, "step_ms": 30.0}, {"step": 4, "loss": 0.5, "step_ms": 10.0},
            {"step": 6, "loss": 0.25, "step_ms": 20.0}]
    assert history_figures(rows, 5, 32) == {"final": {}, "median_step_ms": 10.0, "samples_per_s": 3200.0,
                                            "timed_from_step": 0, "peak_memory_mb": None, "cpu": None,
                                            "gpu": None, "replicas": None}
    assert history_figures(rows, 6, 32)["final"] == {"loss": 0.25}
    assert history_figures(rows, 6, 32)["median_step_ms"] == 15.0  # the first interval left out
