"""Short real training runs of the vanilla GAN pair: run-folder contents, finite losses,
shared fixed noise, bit-exact resume, and refusing to clobber or mis-resume a run."""
import json
import math

import numpy as np
import pytest
import torch

from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

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


def checkpoint_arrays(path):
    """Every tensor of a checkpoint as numpy, keyed by name, whichever the framework."""
    if path.suffix == ".npz":
        with np.load(path) as stored:
            return {k: stored[k] for k in stored.files if not k.startswith("meta/")}
    state = torch.load(path, weights_only=True)
    arrays = {}
    for group in ("modules", "optimizers"):
        for name, sub in state[group].items():
            flat = sub if group == "modules" else {
                f"{i}/{k}": v for i, slot in sub["state"].items() for k, v in slot.items()}
            arrays.update({f"{group}/{name}/{k}": v.numpy() for k, v in flat.items()
                           if torch.is_tensor(v)})
    arrays["rng"] = state["rng"]["cpu"].numpy()
    return arrays


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
        "step_000003.png", "step_000006.png"]
    suffix = "pt" if framework == "pytorch" else "npz"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"step_000004.{suffix}", f"step_000006.{suffix}"]  # the last two are kept
    saved = json.loads((out / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["median_step_ms"] > 0 and saved["samples_per_s"] > 0
    assert saved["peak_memory_mb"] > 0 and saved["step"] == 6


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_ring_of_gaussians_run_plots_points(framework, tmp_path):
    out = tmp_path / "ring"
    train(framework, out, "--dataset", "ring8", "--iters", "4")
    assert (out / "samples" / "step_000004.png").stat().st_size > 1000
    assert np.load(out / "fixed_noise.npy").shape == (2500, 100)


def test_both_frameworks_draw_the_same_fixed_noise(tmp_path):
    train("pytorch", tmp_path / "pt", "--iters", "2", "--seed", "3")
    train("tensorflow", tmp_path / "tf", "--iters", "2", "--seed", "3")
    other_seed = tmp_path / "other"
    train("pytorch", other_seed, "--iters", "2", "--seed", "4")
    noise = np.load(tmp_path / "pt" / "fixed_noise.npy")
    np.testing.assert_array_equal(noise, np.load(tmp_path / "tf" / "fixed_noise.npy"))
    assert not np.array_equal(noise, np.load(other_seed / "fixed_noise.npy"))


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_resume_is_bit_exact(framework, amp, tmp_path):
    flags = ["--checkpoint-every", "4", "--seed", "5", *(["--amp"] if amp else [])]
    # 10 steps of 32 out of 256 examples: the resumed half crosses an epoch boundary.
    train(framework, tmp_path / "straight", "--iters", "10", *flags)
    train(framework, tmp_path / "resumed", "--iters", "6", *flags)
    train(framework, tmp_path / "resumed", "--iters", "10", "--resume", *flags)

    suffix = "pt" if framework == "pytorch" else "npz"
    straight = checkpoint_arrays(tmp_path / "straight" / "checkpoints" / f"step_000010.{suffix}")
    resumed = checkpoint_arrays(tmp_path / "resumed" / "checkpoints" / f"step_000010.{suffix}")
    assert straight.keys() == resumed.keys() and len(straight) > 8
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key], err_msg=key)
    history = [json.loads(line)["step"]
               for line in (tmp_path / "resumed" / "history.jsonl").read_text().splitlines()]
    assert history == [2, 4, 6, 8, 10]


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


def test_an_existing_run_is_not_clobbered(tmp_path, capsys):
    out = tmp_path / "run"
    train("pytorch", out, "--iters", "2")
    expect_exit(2, "already holds a run", capsys, "pytorch", out, "--iters", "2")
    train("pytorch", out, "--iters", "2", "--overwrite")  # explicit: allowed


def test_resume_refuses_other_settings_or_nothing_to_resume(tmp_path, capsys):
    out = tmp_path / "run"
    expect_exit(1, "nothing to resume", capsys, "pytorch", out, "--iters", "2", "--resume")
    train("pytorch", out, "--iters", "2")
    expect_exit(1, "lr: 0.001 -> 0.002", capsys, "pytorch", out,
                "--lr", "0.002", "--iters", "4", "--resume")


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_corrupt_checkpoint_is_one_clear_error(framework, tmp_path, capsys):
    out = tmp_path / "run"
    train(framework, out, "--iters", "2")
    suffix = "pt" if framework == "pytorch" else "npz"
    (out / "checkpoints" / f"step_000002.{suffix}").write_bytes(b"not a checkpoint")
    expect_exit(1, "is unreadable", capsys, framework, out, "--iters", "4", "--resume")
