"""Hostile or damaged run folders, checkpoints and weights files: each is one error line and a
non-zero exit, never a traceback, a hang, another model's state, or a deleted folder that held
no run; and neither --overwrite in scripts/benchmark.py nor scripts/evaluate.py touches a run
it should not."""
import errno
import io
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from common import porting, sampling
from common.pytorch import checkpoint as pytorch_checkpoint
from common.runs import RunFolder
from common.tensorflow import checkpoint as tensorflow_checkpoint
from GAN.least_squares_gan import lsgan_pytorch, lsgan_tensorflow
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
from tests.conftest import run_script
from VAE.vanilla_vae import vae_pytorch, vae_tensorflow

TINY = ["--iters", "2", "--batch-size", "8", "--width", "8", "--data-limit", "64", "--no-tensorboard"]
SCRIPTS = {("vanilla_gan", "pytorch"): gan_pytorch, ("vanilla_gan", "tensorflow"): gan_tensorflow,
           ("lsgan", "pytorch"): lsgan_pytorch, ("lsgan", "tensorflow"): lsgan_tensorflow,
           ("vanilla_vae", "pytorch"): vae_pytorch, ("vanilla_vae", "tensorflow"): vae_tensorflow}
SUFFIX = {"pytorch": "pt", "tensorflow": "npz"}
CHECKPOINTS = {"pytorch": pytorch_checkpoint.Checkpoints, "tensorflow": tensorflow_checkpoint.Checkpoints}


def train(out, *extra, model="vanilla_gan", framework="pytorch"):
    return SCRIPTS[model, framework].main(["--out", str(out), *TINY, *extra])


def refused(capsys, message, out, *extra, code=1, model="vanilla_gan", framework="pytorch"):
    """The script ends with `code` and one stderr line holding `message`."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train(out, *extra, model=model, framework=framework)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == code, err
    assert err.startswith("error: ") and message in err and "\n" not in err, err


def files(folder):
    """Every file under `folder` with its bytes: what must stay as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- 1. --overwrite replaces a run and nothing else ------------------------------------------

def test_a_folder_that_holds_no_run_is_never_deleted(tmp_path, capsys):
    victim = tmp_path / "victim"
    (victim / "thesis").mkdir(parents=True)
    (victim / "thesis" / "ch1.txt").write_text("x")
    refused(capsys, "holds no run", victim, "--overwrite", code=2)
    refused(capsys, "holds no run", victim, code=2)  # not "already holds a run": it does not
    assert (victim / "thesis" / "ch1.txt").read_text() == "x"

    (tmp_path / "file").write_text("x")
    refused(capsys, "not a folder", tmp_path / "file", "--overwrite", code=2)
    assert (tmp_path / "file").read_text() == "x"

    run = tmp_path / "run"
    train(run)
    (run / "notes.txt").write_text("x")
    (run / "mydata").mkdir()
    (run / "mydata" / "train-images-idx3-ubyte").write_text("x")
    (run / "samples" / "step_000099.png").write_text("x")
    (run / "samples" / "my_notes.txt").write_text("x")  # kept too, in the run's own folders
    (run / "checkpoints" / "best_keep.pt").write_text("x")
    (run / "checkpoints" / ".step_000007.pt.tmp-12").write_text("x")  # a killed save's leftover
    (run / "samples" / ".step_000003.png.tmp-12").write_text("x")  # a killed grid's
    (run / "eval_samples.npz").write_text("x")  # --save-samples' file, and a killed write's
    (run / ".eval_samples.npz.tmp-12").write_text("x")
    # names that only begin like a run's (matched whole): the user's copies
    (run / "config.json.bak").write_text("x")
    (run / "samples_old").mkdir()
    (run / "samples_old" / "step_000002.png").write_text("x")
    (run / "checkpoints" / "step_000002.pt.bak").write_text("x")
    refused(capsys, "already holds a run", run, code=2)
    capsys.readouterr()
    train(run, "--overwrite", "--iters", "1")  # the run is replaced, all of it, and nothing else
    assert ("--overwrite: kept checkpoints/best_keep.pt, checkpoints/step_000002.pt.bak, config.json.bak, mydata, "
            "notes.txt, samples/my_notes.txt, samples_old in" in capsys.readouterr().out)
    assert (run / "notes.txt").read_text() == "x" and (run / "mydata" / "train-images-idx3-ubyte").exists()
    assert (run / "config.json.bak").read_text() == "x" and (run / "samples_old" / "step_000002.png").exists()
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["my_notes.txt", "step_000000.png",
                                                                  "step_000001.png"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best_keep.pt", "step_000001.pt",
                                                                      "step_000002.pt.bak"]
    assert not (run / "eval_samples.npz").exists() and not (run / ".eval_samples.npz.tmp-12").exists()
    assert json.loads((run / "config.json").read_text())["iters"] == 1


def test_a_grid_is_written_over_whatever_holds_its_name(tmp_path):
    """A grid is written to a temporary file and renamed over its path: a FIFO there was a
    traceback (or a blocked open), and a run killed mid-write leaves no half a PNG."""
    run = tmp_path / "run"
    train(run, "--sample-every", "2")
    os.mkfifo(run / "samples" / "step_000004.png")
    assert train(run, "--sample-every", "2", "--resume", "--iters", "4")["step"] == 4
    grid = run / "samples" / "step_000004.png"
    assert grid.is_file() and grid.read_bytes().startswith(b"\x89PNG")
    assert sorted(path.name for path in (run / "samples").iterdir()) == [
        "step_000000.png", "step_000002.png", "step_000004.png"]  # no temporary file left


DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON past Python's recursion limit


@pytest.mark.parametrize("config", ['{"model": ["vanilla_gan"], "framework": "pytorch", "precision": "fp32"}', DEEP])
def test_an_edited_config_is_one_line_under_overwrite_and_resume(config, tmp_path, capsys):
    """Neither a TypeError (an unhashable model) nor a RecursionError: not a run's config, so
    --overwrite keeps the folder, and --resume says the file is unreadable."""
    run = tmp_path / "run"
    train(run)
    (run / "config.json").write_text(config)
    refused(capsys, "holds no run", run, "--overwrite", code=2)
    assert (run / "checkpoints" / "step_000002.pt").exists()
    if config == DEEP:
        refused(capsys, "config.json is unreadable (maximum recursion depth", run, "--resume", "--iters", "4")


def test_a_history_line_past_the_recursion_limit_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    train(run, "--log-every", "1")
    with open(run / "history.jsonl", "a") as history:
        history.write(DEEP + "\n" + json.dumps({"step": 2, "d_loss": 1.0}) + "\n")
    refused(capsys, "history.jsonl line 3 is not a history row", run, "--resume", "--iters", "4")


def test_overwrite_replaces_a_run_through_a_symlinked_folder(tmp_path):
    train(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    train(tmp_path / "link", "--overwrite", "--seed", "3")
    assert (tmp_path / "link").is_symlink()
    assert json.loads((tmp_path / "real" / "config.json").read_text())["seed"] == 3


# --- 2. the benchmark replaces only its own runs --------------------------------------------

def test_the_benchmark_never_replaces_a_run_it_did_not_make(tmp_path, capsys):
    from scripts import benchmark

    flags = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32",
             "--iters", "4", "--log-every", "2", "--batch-size", "8", "--width", "8",
             "--data-limit", "64", "--no-tensorboard"]
    trained = tmp_path / "runs" / "vanilla_gan" / "pytorch-fp32"  # the benchmark's layout
    train(trained)
    before = files(trained)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--out", str(tmp_path / "runs"), *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and "a run the benchmark did not make" in err and "\n" not in err, err
    assert files(trained) == before
    with pytest.raises(SystemExit) as exit_info:  # the run's own folder: it wrote its table and runs inside it
        benchmark.main(["--out", str(trained), *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and f"--out {trained} is a run's folder" in err and "\n" not in err, err
    assert files(trained) == before

    assert benchmark.main(["--out", str(tmp_path / "bench"), *flags]) == 0
    made = tmp_path / "bench" / "vanilla_gan" / "pytorch-fp32"
    assert json.loads((made / "config.json").read_text())["benchmark"] is True
    assert benchmark.main(["--out", str(tmp_path / "bench"), *flags]) == 0  # its own: replaced


# --- 3. evaluate.py never trains --------------------------------------------------------------

def test_evaluate_refuses_a_run_that_stopped_on_nonfinite_losses(tmp_path, capsys):
    from scripts import evaluate

    run = tmp_path / "div"
    with pytest.raises(SystemExit):
        train(run, "--iters", "50", "--lr", "1e6", "--nonfinite-patience", "1", "--log-every", "1",
              "--checkpoint-every", "1", "--ema-decay", "0", model="lsgan")
    assert "stopped" in json.loads((run / "summary.json").read_text())
    before = files(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(run), "--samples", "10"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 1 and "stopped at step" in captured.err and "\n" not in captured.err.strip()
    assert "resumed from" not in captured.out and files(run) == before

    finished = tmp_path / "finished"  # a run whose last checkpoint is gone
    train(finished, "--checkpoint-every", "1")
    (finished / "checkpoints" / "step_000002.pt").unlink()
    before = files(finished)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(finished), "--samples", "10"])
    assert exit_info.value.code == 1 and "no checkpoint at the step of its summary" in capsys.readouterr().err
    assert files(finished) == before  # evaluate.py left the run as it was
    # quality_table.py measures through evaluate_run, which checks the same: it retrained the run
    from common import evaluation
    from common.errors import UserError

    with pytest.raises(UserError, match="no checkpoint at the step of its summary"):
        evaluation.evaluate_run(finished, 10, None)
    assert files(finished) == before  # and so did evaluate_run


# --- 4. history.jsonl after a crash ----------------------------------------------------------

def test_resume_drops_a_history_line_cut_short_and_refuses_garbage(tmp_path, capsys):
    run = tmp_path / "h"
    train(run, "--log-every", "1")
    with open(run / "history.jsonl", "a") as history:
        history.write('{"step": 1, "d_lo')  # what a kill -9 mid-append leaves
    train(run, "--log-every", "1", "--resume", "--iters", "4")
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]

    with open(run / "history.jsonl", "a") as history:  # the same, with its newline (echo >>)
        history.write('{"step": 5, "d_lo\n')
    train(run, "--log-every", "1", "--resume", "--iters", "5")
    assert [json.loads(line)["step"] for line in (run / "history.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]

    lines = (run / "history.jsonl").read_text().splitlines()
    for garbage in ("[1]", '{"d_loss": 1}', '{"step": "2"}', "{not json"):
        (run / "history.jsonl").write_text("\n".join([lines[0], garbage, *lines[1:]]) + "\n")
        refused(capsys, "history.jsonl line 2 is not a history row", run, "--log-every", "1", "--resume",
                "--iters", "6")


def test_a_run_resumed_under_other_library_versions_says_so_and_keeps_the_earlier_ones(tmp_path, capsys):
    """Its bit-exact resume holds within one set of versions: config.json keeps the versions
    each part of the run ran under, and the resumed run warns."""
    run = tmp_path / "v"
    train(run)
    config = json.loads((run / "config.json").read_text())
    current = config["versions"]
    assert set(current) == {"torch", "numpy"} and "earlier_versions" not in config
    old = {**current, "torch": "2.0.0"}
    (run / "config.json").write_text(json.dumps({**config, "versions": old}))
    capsys.readouterr()
    train(run, "--resume", "--iters", "4")
    out = capsys.readouterr().out
    assert f"warning: resumed under other library versions (torch 2.0.0 -> {torch.__version__})" in out
    config = json.loads((run / "config.json").read_text())
    assert config["versions"] == current and config["earlier_versions"] == [old]

    train(run, "--resume", "--iters", "6")  # the same versions again: no warning, the record kept
    assert "other library versions" not in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["earlier_versions"] == [old]

    # another change: the versions of every part so far, the first one's too
    older = {**current, "numpy": "1.0.0"}
    (run / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()), "versions": older}))
    train(run, "--resume", "--iters", "8")
    assert "(numpy 1.0.0 -> " in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["earlier_versions"] == [old, older]


# --- 5. only regular files are opened ---------------------------------------------------------

def test_a_fifo_as_weights_file_or_checkpoint_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "fifo.npz")
    result = run_script("GAN/vanilla_gan/gan_pytorch.py", *TINY, "--out", str(tmp_path / "new"),
                        "--init-from", str(tmp_path / "fifo.npz"), timeout=120)
    assert result.returncode == 1 and "is not a regular file" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr

    for framework, script in (("pytorch", "GAN/vanilla_gan/gan_pytorch.py"),
                              ("tensorflow", "GAN/vanilla_gan/gan_tensorflow.py")):
        run = tmp_path / framework
        train(run, framework=framework)  # in this process; what could wait on a fifo runs in a child
        os.mkfifo(run / "checkpoints" / f"step_000009.{SUFFIX[framework]}")  # the latest, by name
        result = run_script(script, *TINY, "--out", str(run), "--resume", "--iters", "12", timeout=300)
        assert result.returncode == 1 and "is not a regular file" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        # its own advice only, not an unreadable file's "delete it" too (mutation round 8: the
        # PyTorch restore's own check dropped, which added it, went unseen)
        assert "delete it" not in result.stderr, result.stderr[-2000:]

        (run / "checkpoints" / f"step_000009.{SUFFIX[framework]}").unlink()  # and the fixed noise
        (run / "fixed_noise.npy").unlink()
        os.mkfifo(run / "fixed_noise.npy")
        result = run_script(script, *TINY, "--out", str(run), "--resume", "--iters", "12", timeout=300)
        assert result.returncode == 1 and "fixed_noise.npy is not a regular file" in result.stderr, \
            result.stderr[-2000:]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_damaged_fixed_noise_file_or_a_failed_last_grid_costs_no_training(framework, tmp_path, capsys,
                                                                              monkeypatch):
    """The noise file is checked, header against size, before a resumed run trains (its first
    grid comes steps later; a header claiming 40 TB was an out-of-memory error telling the
    user to shrink the batch). A last grid that fails after the last checkpoint is drawn by
    --resume."""
    run = tmp_path / "run"
    train(run, framework=framework)
    noise = (run / "fixed_noise.npy").read_bytes()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 100)})
    (run / "fixed_noise.npy").write_bytes(header.getvalue() + bytes(64))
    refused(capsys, "fixed_noise.npy holds 64 bytes but its header claims float32(100000000000, 100)", run,
            "--resume", "--iters", "4", framework=framework)
    (run / "fixed_noise.npy").write_bytes(noise[:-4])  # truncated
    refused(capsys, "fixed_noise.npy holds 25,596 bytes but its header claims float32(64, 100)", run,
            "--resume", "--iters", "4", framework=framework)
    np.save(run / "fixed_noise.npy", np.zeros((3, 3)))  # sound, of another dtype: its size was not the matter
    refused(capsys, "fixed_noise.npy holds float64(3, 3), not the float32 rows a run writes", run,
            "--resume", "--iters", "4", framework=framework)
    assert [path.name for path in (run / "checkpoints").iterdir()] == [f"step_000002.{SUFFIX[framework]}"]

    (run / "fixed_noise.npy").write_bytes(noise)
    save_grid = sampling.save_image_grid

    def disk_full_at_step_4(images, path, *args, **kwargs):
        if path.name == "step_000004.png":
            raise OSError(errno.ENOSPC, "No space left on device")
        save_grid(images, path, *args, **kwargs)

    monkeypatch.setattr(sampling, "save_image_grid", disk_full_at_step_4)
    refused(capsys, "No space left on device", run, "--resume", "--iters", "4", framework=framework)
    assert f"step_000004.{SUFFIX[framework]}" in {path.name for path in (run / "checkpoints").iterdir()}
    monkeypatch.setattr(sampling, "save_image_grid", save_grid)
    assert train(run, "--resume", "--iters", "4", framework=framework)["step"] == 4
    assert (run / "samples" / "step_000004.png").is_file()
    (run / "summary.json").write_text('{"step": 4, "med')  # cut short: reopening it wrote a traceback
    assert train(run, "--resume", "--iters", "4", framework=framework)["step"] == 4


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_grid_that_fails_between_checkpoints_costs_no_training(framework, tmp_path, capsys, monkeypatch):
    """A grid written between two checkpoints that fails (permission refused, say) is followed
    by a checkpoint of its step, and a history row of the steps logged since the last one,
    before the one-line error: before, the steps since the last checkpoint were lost. --resume
    draws the grid and ends where an unbroken run ends. When that checkpoint cannot be written
    either (a full disk), the error is still the grid's."""
    every_step = ["--iters", "4", "--sample-every", "1", "--checkpoint-every", "4"]
    save_grid = sampling.save_image_grid

    def refused_at_step_3(images, path, *args, **kwargs):
        if path.name == "step_000003.png":
            raise OSError(errno.EACCES, "Permission denied", str(path))
        save_grid(images, path, *args, **kwargs)

    run = tmp_path / "run"
    monkeypatch.setattr(sampling, "save_image_grid", refused_at_step_3)
    refused(capsys, "step_000003.png: Permission denied", run, *every_step, "--log-every", "2", framework=framework)
    assert [path.name for path in (run / "checkpoints").iterdir()] == [f"step_000003.{SUFFIX[framework]}"]
    assert [json.loads(line)["step"] for line in (run / "history.jsonl").read_text().splitlines()] == [2, 3]
    assert not (run / "samples" / "step_000003.png").exists()

    monkeypatch.setattr(sampling, "save_image_grid", save_grid)
    resumed = train(run, *every_step, "--log-every", "1", "--resume", framework=framework)
    unbroken = train(tmp_path / "unbroken", *every_step, "--log-every", "1", framework=framework)
    assert (run / "samples" / "step_000003.png").read_bytes() == \
        (tmp_path / "unbroken" / "samples" / "step_000003.png").read_bytes()
    assert resumed["step"] == 4 and resumed["final"] == unbroken["final"]

    def disk_full(checkpoints, path, meta):
        raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".tmp-1")

    monkeypatch.setattr(sampling, "save_image_grid", refused_at_step_3)
    monkeypatch.setattr(CHECKPOINTS[framework], "save", disk_full)
    refused(capsys, "step_000003.png: Permission denied", tmp_path / "full", *every_step, framework=framework)


# --- 6. another model's weights ---------------------------------------------------------------

@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("other", ["lsgan", "vanilla_vae"])  # the same shapes; other networks
def test_another_models_checkpoint_is_refused_by_its_model(other, framework, tmp_path, capsys):
    """Named by the model it records, before its tensors are matched: the VAE's failed on a
    missing network, a line that did not say why."""
    train(tmp_path / "other", model=other, framework=framework)
    train(tmp_path / "gan", framework=framework)
    name = f"step_000002.{SUFFIX[framework]}"
    shutil.copy(tmp_path / "other" / "checkpoints" / name, tmp_path / "gan" / "checkpoints" / name)
    refused(capsys, f"is of model {other}, this run is vanilla_gan", tmp_path / "gan", "--resume", "--iters", "4",
            framework=framework)


def test_init_from_another_model_is_refused_and_from_the_other_framework_works(tmp_path, capsys):
    train(tmp_path / "gan")
    refused(capsys, "holds weights of model 'vanilla_gan', this run is 'lsgan'", tmp_path / "lsgan",
            "--init-from", str(tmp_path / "gan"), model="lsgan")
    assert not (tmp_path / "lsgan").exists()
    train(tmp_path / "ported", "--init-from", str(tmp_path / "gan"), framework="tensorflow")  # documented
    source, _ = porting.load_weights(tmp_path / "gan" / porting.INITIAL_WEIGHTS)
    ported, _ = porting.load_weights(tmp_path / "ported" / porting.INITIAL_WEIGHTS)
    np.testing.assert_array_equal(source["generator"][0][1][0], ported["generator"][0][1][0])


# --- 7. hand-edited checkpoints and weights files ----------------------------------------------

def edit_pt(path, change):
    state = torch.load(path, map_location="cpu", weights_only=True)
    change(state)
    torch.save(state, path)


def first_moment(state):
    slot = state["optimizers"]["generator"]["state"][0]
    slot["exp_avg"] = torch.zeros(3, 5)


PT_EDITS = {
    "meta {}": (lambda s: s.__setitem__("meta", {}), "has no valid step"),
    "meta a list": (lambda s: s.__setitem__("meta", [1, 2]), "has no valid meta"),
    "step a string": (lambda s: s["meta"].__setitem__("step", "2"), "has no valid step"),
    "step negative": (lambda s: s["meta"].__setitem__("step", -1), "has no valid step"),
    "step past int64": (lambda s: s["meta"].__setitem__("step", 2**63), "has no valid step"),
    "step another": (lambda s: s["meta"].__setitem__("step", 3), "not the step its name says"),
    "inf/NaN streak negative": (lambda s: s["meta"].__setitem__("nonfinite_streak", -1),
                                "has no valid nonfinite_streak"),
    "inf/NaN streak past the step": (lambda s: s["meta"].__setitem__("nonfinite_streak", 3),
                                     "has no valid nonfinite_streak (found 3)"),
    "lr a string": (lambda s: s["optimizers"]["generator"]["param_groups"][0].__setitem__("lr", "abc"),
                    "param_groups/0/lr is 'abc'"),
    # hyperparameters load_state_dict would have put in place of this run's (its flags'): a
    # KeyError, ZeroDivisionError or a "can't be cast" RuntimeError mid-step, or --lr overridden
    "amsgrad on": (lambda s: s["optimizers"]["generator"]["param_groups"][0].__setitem__("amsgrad", True),
                   "optimizers/generator/param_groups/0/amsgrad is True, this run's False"),
    "beta1 1": (lambda s: s["optimizers"]["discriminator"]["param_groups"][0].__setitem__("betas", (1.0, 0.999)),
                "optimizers/discriminator/param_groups/0/betas is (1.0, 0.999), this run's "),
    "lr another": (lambda s: s["optimizers"]["generator"]["param_groups"][0].__setitem__("lr", 1e39),
                   "optimizers/generator/param_groups/0/lr is 1e+39, this run's "),
    "maximize": (lambda s: s["optimizers"]["generator"]["param_groups"][0].__setitem__("maximize", True),
                 "param_groups/0/maximize is True, this run's False"),
    "lr removed": (lambda s: s["optimizers"]["generator"]["param_groups"][0].pop("lr"),
                   "optimizers/generator/param_groups/0 has no 'lr'"),
    # Adam's step read it: a KeyError traceback (mutation round 8: "eps" dropped from the
    # settings every group must hold went unseen)
    "eps removed": (lambda s: s["optimizers"]["discriminator"]["param_groups"][0].pop("eps"),
                    "optimizers/discriminator/param_groups/0 has no 'eps'"),
    "moment misshapen": (first_moment, "optimizers/generator/state/0/exp_avg is (3, 5)"),
    # a network changed since the run was trained: load_state_dict's first line named nothing
    "a weight missing": (lambda s: s["modules"]["generator"].popitem(), "modules/generator has 7 tensors, the model 8"),
    "a weight renamed": (lambda s: s["modules"]["generator"].__setitem__(
        "extra.weight", s["modules"]["generator"].popitem()[1]), "modules/generator has no "),
    "a weight misshapen": (lambda s: s["modules"]["generator"].__setitem__(
        next(iter(s["modules"]["generator"])), torch.zeros(2, 2)), "is (2, 2), expected a tensor of shape ("),
    # load_state_dict took the real part (with a two-line warning) and 0/1 weights, and named no
    # reason for a sparse or a meta tensor (a fresh-user review found them; the Keras twin refuses)
    **{f"a weight {kind}": (lambda s, change=change: s["modules"]["generator"].update(
        {key: change(value) for key, value in list(s["modules"]["generator"].items())[:1]}), message)
       for kind, change, message in [
           ("complex", lambda t: t.to(torch.complex64), "weight is complex64 ("),
           ("bool", lambda t: t.bool(), "weight is bool ("),
           ("sparse", lambda t: t.to_sparse(), "weight is a sparse_coo tensor, expected a tensor of shape"),
           ("without data", lambda t: torch.empty(t.shape, device="meta"), "weight is a tensor without data")]},
    "scale a string": (lambda s: s["scaler"].__setitem__("scale", "big"), "scaler/scale"),
    "ema updates negative": (lambda s: s["averages"]["generator"].__setitem__("updates", -3), "updates"),
    # a count that is not whole: int() made it another silently (mutation round 8: check_like
    # taking a float where the running state holds an int went unseen)
    "ema updates fractional": (lambda s: s["averages"]["generator"].__setitem__("updates", 2.5),
                               "averages/generator/updates is 2.5, expected a whole number, 0 or more, like "),
    # another version of the file's layout (mutation round 8: the format check dropped went unseen)
    "format another": (lambda s: s.__setitem__("format", 2), "(ValueError: not a checkpoint of this repository)"),
    # Adam's step -1 divided by zero; NaN weights or moments trained on, exit 0
    "adam step negative": (lambda s: [slot.__setitem__("step", torch.tensor(-1.0))
                                      for slot in s["optimizers"]["generator"]["state"].values()],
                           "optimizers/generator/state/0/step is -1.0, not a count"),
    "adam step fractional": (lambda s: [slot.__setitem__("step", torch.tensor(2.5))
                                        for slot in s["optimizers"]["generator"]["state"].values()],
                             "optimizers/generator/state/0/step is 2.5, not a count"),
    # load_state_dict keeps a step's dtype: an integer one failed the next step with a traceback
    # (mutation round 8: the floating-point check of the state dropped went unseen)
    "adam step an integer": (lambda s: [slot.__setitem__("step", slot["step"].long())
                                        for slot in s["optimizers"]["generator"]["state"].values()],
                             "optimizers/generator/state/0/step is torch.int64, not floating-point"),
    # a scalar moment broadcast into the update's output: a traceback at the next step (mutation
    # round 8 found it taken: the shape check allowed any scalar)
    "a moment a scalar": (lambda s: s["optimizers"]["generator"]["state"][0].__setitem__("exp_avg", torch.tensor(0.5)),
                          "optimizers/generator/state/0/exp_avg is (), not ("),
    # a step shaped like the weight was refused only as an "ambiguous" truth value
    "adam step misshapen": (lambda s: s["optimizers"]["generator"]["state"][0].__setitem__(
        "step", torch.ones_like(s["optimizers"]["generator"]["state"][0]["exp_avg"])),
        "optimizers/generator/state/0/step is ("),
    "a moment a list": (lambda s: s["optimizers"]["generator"]["state"][0].__setitem__("exp_avg", [0.5]),
                        "optimizers/generator/state/0/exp_avg is a list, not a tensor"),
    # Adam's square root of it NaN'd the weights, trained on, exit 0
    "a second moment negative": (lambda s: s["optimizers"]["generator"]["state"][0]["exp_avg_sq"].fill_(-1.0),
                                 "optimizers/generator/state/0/exp_avg_sq holds a negative number"),
    "a moment NaN": (lambda s: s["optimizers"]["generator"]["state"][0]["exp_avg_sq"].fill_(float("nan")),
                     "holds inf/NaN in optimizers/generator/state/0/exp_avg_sq"),
    "a weight inf": (lambda s: next(iter(s["modules"]["generator"].values())).fill_(float("inf")),
                     "holds inf/NaN in modules/generator/"),
    # the average of G, which the grids and the evaluation sample: NaN images (mutation round 8:
    # the averages left out of the scan for inf/NaN went unseen)
    "an averaged weight inf": (lambda s: next(iter(s["averages"]["generator"]["module"].values())).fill_(
        float("inf")), "holds inf/NaN in averages/generator/module/"),
    # checked as loaded: float64 1e300 is inf in the float32 weight, the scale inf or 0 skips every step
    "a float64 weight past float32": (lambda s: s["modules"]["generator"].__setitem__(
        next(iter(s["modules"]["generator"])),
        torch.full_like(next(iter(s["modules"]["generator"].values())), 1e300, dtype=torch.float64)),
        "holds inf/NaN in modules/generator/"),
    "scale past float32": (lambda s: s["scaler"].__setitem__("scale", 1e300), "scaler/scale is inf"),
    "scale 0": (lambda s: s["scaler"].__setitem__("scale", 0.0), "scaler/scale is 0.0"),
}


@pytest.fixture(scope="module")
def pytorch_run(tmp_path_factory):
    """A finished tiny run (float16 AMP: its loss scaler is checkpointed too), copied per test."""
    run = tmp_path_factory.mktemp("pt") / "run"
    gan_pytorch.main(["--out", str(run), *TINY, "--amp", "--amp-dtype", "float16"])
    return run


@pytest.mark.parametrize("edit", PT_EDITS)
def test_a_hand_edited_pytorch_checkpoint_is_one_error_line(edit, pytorch_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(pytorch_run, run)
    change, message = PT_EDITS[edit]
    edit_pt(run / "checkpoints" / "step_000002.pt", change)
    refused(capsys, message, run, "--amp", "--amp-dtype", "float16", "--resume", "--iters", "4")


def floats_of(path):
    """Every floating-point array a checkpoint holds, as numpy."""
    if path.suffix == ".npz":
        with np.load(path) as stored:
            return [stored[key] for key in stored.files if stored[key].dtype.kind == "f"]
    found, pending = [], [torch.load(path, weights_only=True)]
    while pending:
        value = pending.pop()
        if torch.is_tensor(value) and value.is_floating_point():
            found.append(value.numpy())
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return found


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_diverging_run_checkpoints_no_nan_weights_for_resume_to_pick(framework, tmp_path, capsys):
    """At --lr 1e6 the weights go NaN within steps; the checkpoints --resume picks from stay finite."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        train(run, "--iters", "60", "--lr", "1e6", "--checkpoint-every", "1", "--log-every", "1",
              "--nonfinite-patience", "10", "--ema-decay", "0", model="lsgan", framework=framework)
    assert "have been inf/NaN since step" in capsys.readouterr().err
    assert list(run.glob("checkpoints/diverged_step_*"))
    for _, path in RunFolder(run).list_checkpoints():
        assert all(np.isfinite(array).all() for array in floats_of(path)), path


def test_a_finished_run_whose_last_steps_went_nan_can_still_be_evaluated(pytorch_run, tmp_path, capsys):
    """Reopened with nothing left to train (evaluate.py's --resume), its NaN checkpoint loads;
    training on from it is what is refused."""
    run = tmp_path / "run"
    shutil.copytree(pytorch_run, run)
    edit_pt(run / "checkpoints" / "step_000002.pt", PT_EDITS["a weight inf"][0])
    amp = ["--amp", "--amp-dtype", "float16"]
    assert train(run, *amp, "--resume", "--iters", "2")["step"] == 2
    refused(capsys, "holds inf/NaN in modules/generator/", run, *amp, "--resume", "--iters", "4")


def test_a_run_from_before_the_average_of_g_resumes_and_reopens(tmp_path):
    """Runs from before --ema-decay have no "averages" in their checkpoints and no ema_decay
    in config.json: they kept no average, and reopen as --ema-decay 0 (evaluate.py's flags
    say so; without it the script's 0.999 would be refused as another setting), and
    compare.py --reuse and quality_table.py take them for runs of --ema-decay 0."""
    from types import SimpleNamespace

    from common import evaluation
    from scripts import compare, quality_table

    run = tmp_path / "run"
    train(run, "--ema-decay", "0")
    edit_pt(run / "checkpoints" / "step_000002.pt", lambda state: state.pop("averages"))
    today = json.loads((run / "config.json").read_text())
    config = {key: value for key, value in today.items() if key != "ema_decay"}
    (run / "config.json").write_text(json.dumps(config))
    flags = evaluation.rerun_flags(config, 2)
    assert flags[flags.index("--ema-decay") + 1] == "0.0"
    flags = evaluation.rerun_flags({**config, "device": "cuda:0"}, 2)  # as a PyTorch run on CUDA records it
    assert flags[flags.index("--device") + 1] == "cuda"
    assert quality_table.settings_differences(config, {"ema_decay": 0.0, "seed": today["seed"]}) == []
    plan = SimpleNamespace(folder=run, config=SimpleNamespace(iters=2, evaluate=0, dataset="mnist"),
                           expected=lambda: today)
    assert compare.decide(plan, reuse=True, overwrite=False) is None  # finished, and reused
    assert train(run, "--ema-decay", "0", "--resume", "--iters", "4")["step"] == 4


def test_a_checkpoint_from_before_the_foreach_update_resumes_with_it(tmp_path):
    """Checkpoints written before the optimizers asked for `foreach` hold None there: they
    load, and the optimizer goes on with this code's update."""
    run = tmp_path / "run"
    train(run)
    edit_pt(run / "checkpoints" / "step_000002.pt", lambda state: [
        group.__setitem__("foreach", None)
        for optimizer in state["optimizers"].values() for group in optimizer["param_groups"]])
    assert train(run, "--resume", "--iters", "4")["step"] == 4
    saved = torch.load(run / "checkpoints" / "step_000004.pt", map_location="cpu", weights_only=True)
    assert {group["foreach"] for optimizer in saved["optimizers"].values()
            for group in optimizer["param_groups"]} == {True}


@pytest.mark.parametrize("key, value, flag", [("image_size", 32, "--image-size"),
                                             ("data_dir", "/data/mnist", "--data-dir")])
def test_a_mixture_run_that_recorded_an_image_flag_still_resumes_and_evaluates(key, value, flag, tmp_path):
    """--image-size and --data-dir were ignored for the 2-D mixtures, and recorded; they are
    refused now, so the runs that recorded one are reopened without it."""
    from common import evaluation

    run = tmp_path / "run"
    train(run, "--dataset", "ring8")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, key: value}))
    assert flag not in evaluation.rerun_flags({**config, key: value}, 2)
    assert train(run, "--dataset", "ring8", "--resume", "--iters", "4")["step"] == 4


def edit_npz(path, change):
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    change(arrays)
    np.savez(path, **arrays)


def a_string_weight(arrays):
    key = next(k for k in sorted(arrays) if k.startswith("module/generator/"))
    arrays[key] = np.full(arrays[key].shape, "x")


NPZ_EDITS = {
    "step removed": (lambda a: a.pop("meta/step"), "has no valid step"),
    "format abc": (lambda a: a.__setitem__("format", np.array("abc")), "is not a checkpoint of this repository"),
    "a string weight": (a_string_weight, "holds <U1"),
    "step negative": (lambda a: a.__setitem__("meta/step", np.array(-1)), "has no valid step"),
    "step a float": (lambda a: a.__setitem__("meta/step", np.array(2.0)), "has no valid step"),
    "inf/NaN streak a float": (lambda a: a.__setitem__("meta/nonfinite_streak", np.array(1.0)),
                               "has no valid nonfinite_streak"),
    # Adam's iterations -1 and NaN weights trained on NaN, exit 0
    "iterations negative": (lambda a: a.__setitem__("optimizer/generator/0000", np.array(-1, np.int64)),
                            "optimizer/generator/0000 holds a negative count"),
    "a weight NaN": (lambda a: a["module/generator/0000"].fill(np.nan), "holds inf/NaN in module/generator/0000"),
    # checked as the variable holds it: float64 1e300 is inf in float32, uint64 2**64 - 1 is -1 in int64
    "a float64 weight past float32": (lambda a: a.__setitem__("module/generator/0000", np.full(
        a["module/generator/0000"].shape, 1e300)), "holds inf/NaN in module/generator/0000"),
    "iterations uint64": (lambda a: a.__setitem__("optimizer/generator/0000", np.array(2**64 - 1, np.uint64)),
                          "optimizer/generator/0000 holds a negative count"),
    # Adam's variables: iterations, the rate, then each weight's two moments; a negative
    # second moment's square root NaN'd the weights, trained on, exit 0 (a first moment may be
    # negative: the weight's moments after it are loaded)
    "a second moment negative": (lambda a: [a["optimizer/generator/0002"].fill(-1.0),
                                            a["optimizer/generator/0003"].fill(-1.0)],
                                 "optimizer/generator/0003, an Adam second moment, holds a negative number"),
    # one entry is enough: a check of whole arrays (all(), not any()) let these through
    "one second moment entry negative": (lambda a: a["optimizer/generator/0003"].flat.__setitem__(0, -1.0),
                                         "optimizer/generator/0003, an Adam second moment, holds a negative number"),
    "one weight entry NaN": (lambda a: a["module/generator/0000"].flat.__setitem__(0, np.nan),
                             "holds inf/NaN in module/generator/0000"),
    # the rate, which trained on to NaN (exit 0)
    "learning rate another": (lambda a: a.__setitem__("optimizer/generator/0001", np.array(3e38, np.float32)),
                              "does not fit this model: optimizer/generator/0001, a learning rate, is 3e+38, "
                              "this run's 0.0002"),
    # a rate one float32 step off reads the same in :g: the message gives both in full
    "learning rate a step off": (lambda a: a.__setitem__("optimizer/generator/0001", np.array(
        np.nextafter(np.float32(0.0002), np.float32(1)))), "a learning rate, is 0.00020000000949949026, "
                                 "this run's 0.00019999999494757503"),
    # the tensors are matched by order: a count checked only one way let zip() drop an extra
    # tensor without a word, and a shape left unchecked reached assign(), a traceback
    "a tensor extra": (lambda a: a.__setitem__("module/generator/0008", np.zeros(3, np.float32)),
                       "does not fit this model: module/generator has 9 tensors, the model 8"),
    "a weight transposed": (lambda a: a.__setitem__("module/generator/0000", a["module/generator/0000"].T.copy()),
                            "does not fit this model: module/generator/0000 is (8, 100), expected (100, 8)"),
    # a one-element array passed for a count, a longer one failed in .item(), a traceback
    "step an array": (lambda a: a.__setitem__("meta/step", np.array([2, 2])), "has no valid step"),
    "model an array": (lambda a: a.__setitem__("meta/model", np.array(["vanilla_gan"])), "has no valid model name"),
}


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("network", ["module", "average"])
def test_a_negative_batch_norm_running_variance_is_refused(framework, network, tmp_path, capsys):
    """Samples and evaluation divide by its square root: NaN images, exit 0. DCGAN's D and G,
    and the average of G's weights, have batch norm."""
    from GAN.dcgan import dcgan_pytorch, dcgan_tensorflow

    script = dcgan_pytorch if framework == "pytorch" else dcgan_tensorflow
    run = tmp_path / "run"
    script.main(["--out", str(run), *TINY, "--ema-decay", "0.9"])
    checkpoint = run / "checkpoints" / f"step_000002.{SUFFIX[framework]}"
    if framework == "pytorch":
        state = torch.load(checkpoint, weights_only=True)
        where = "modules/generator" if network == "module" else "averages/generator/module"
        tensors = state["modules"]["generator"] if network == "module" else state["averages"]["generator"]["module"]
        name = next(name for name in tensors if name.endswith("running_var"))
        tensors[name][0] = -1.0
        torch.save(state, checkpoint)
        key = f"{where}/{name}"
    else:
        names = [weight.name for weight in script.build_networks((28, 28, 1), 8)["generator"].weights]
        key = f"{network}/generator/{names.index('moving_variance'):04d}"
        edit_npz(checkpoint, lambda arrays: arrays[key].__setitem__(0, -1.0))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--out", str(run), *TINY, "--ema-decay", "0.9", "--resume", "--iters", "4"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and err.startswith("error: ") and "\n" not in err, err
    assert key in err and "negative number" in err, err


@pytest.fixture(scope="module")
def tensorflow_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("tf") / "run"
    gan_tensorflow.main(["--out", str(run), *TINY])
    return run


@pytest.mark.parametrize("edit", NPZ_EDITS)
def test_a_hand_edited_tensorflow_checkpoint_is_one_error_line(edit, tensorflow_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tensorflow_run, run)
    change, message = NPZ_EDITS[edit]
    edit_npz(run / "checkpoints" / "step_000002.npz", change)
    refused(capsys, message, run, "--resume", "--iters", "4", framework="tensorflow")


def test_a_tensorflow_loss_scale_of_zero_or_past_float32_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    amp = ["--amp", "--amp-dtype", "float16"]
    gan_tensorflow.main(["--out", str(run), *TINY, *amp])
    scale = "optimizer/generator/0003"  # the LossScaleOptimizer's: iterations, rate, clean steps, scale
    arrays = dict(np.load(run / "checkpoints" / "step_000002.npz"))
    assert arrays[scale].dtype == np.float32 and arrays[scale] > 1
    for value, message in [(0.0, "the loss scale is 0.0"), (1e300, "the loss scale is inf")]:
        edit_npz(run / "checkpoints" / "step_000002.npz", lambda a: a.__setitem__(scale, np.array(value)))
        refused(capsys, message, run, *amp, "--resume", "--iters", "4", framework="tensorflow")


def set_meta(meta):
    return lambda arrays: arrays.__setitem__("meta", np.array(json.dumps(meta)))


WEIGHTS_EDITS = {
    "meta a list": (set_meta([1]), "has no valid meta"),
    "sample_shape 5": (set_meta({"model": "vanilla_gan", "sample_shape": 5}), "no valid sample_shape"),
    "a string weight": (lambda a: a.__setitem__("layers/generator/000/0", np.array([["x"]])), "not numbers"),
    # trained on NaN, its checkpoints then refused by --resume
    "a NaN weight": (lambda a: poke(a, "layers/generator/000/0", np.nan), "holds inf/NaN or values past float32's"),
    "float64 past float32": (lambda a: poke(a, "layers/discriminator/001/1", 1e300, np.float64),
                             "past float32's range"),
    # PyTorch dropped an extra array without a word (zip), or indexed past a missing one
    "an extra array": (lambda a: a.__setitem__("layers/generator/000/2", np.zeros(3, np.float32)),
                       "does not fit this model's generator: Linear: PyTorch holds 2 arrays, the weights give 3"),
}


def poke(arrays, key, value, dtype=np.float32):
    arrays[key] = arrays[key].astype(dtype)
    arrays[key].flat[0] = value


@pytest.mark.parametrize("edit", WEIGHTS_EDITS)
def test_a_hand_edited_weights_file_is_one_error_line(edit, pytorch_run, tmp_path, capsys):
    weights = tmp_path / "weights.npz"
    shutil.copy(pytorch_run / porting.INITIAL_WEIGHTS, weights)
    change, message = WEIGHTS_EDITS[edit]
    edit_npz(weights, change)
    refused(capsys, message, tmp_path / "new", "--init-from", str(weights))


def test_a_relative_data_dir_is_recorded_absolute_and_reopens_from_another_folder(tmp_path, monkeypatch, capsys):
    """--data-dir is recorded as an absolute path: --resume and scripts/evaluate.py from
    another working folder read the same files, and the same text naming other files there is
    refused. Older runs, which recorded it as typed, read it against the working folder."""
    from common import evaluation
    from tests.test_data import write_mnist_dir

    (tmp_path / "a" / "data").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    write_mnist_dir(tmp_path / "a" / "data", count=16)
    write_mnist_dir(tmp_path / "data", count=16, seed=1)  # "data", typed in tmp_path
    run, fashion = tmp_path / "run", ["--dataset", "fashion-mnist"]
    monkeypatch.chdir(tmp_path / "a")
    train(run, *fashion, "--data-dir", "data")
    config = json.loads((run / "config.json").read_text())
    assert config["data_dir"] == str(tmp_path / "a" / "data")

    monkeypatch.chdir(tmp_path)
    refused(capsys, "data_dir", run, *fashion, "--data-dir", "data", "--resume", "--iters", "4")
    assert train(run, *fashion, "--data-dir", "a/data", "--resume", "--iters", "4")["step"] == 4
    flags = evaluation.rerun_flags(config, 4)
    assert flags[flags.index("--data-dir") + 1] == str(tmp_path / "a" / "data")

    (run / "config.json").write_text(json.dumps({**config, "data_dir": "a/data"}))  # an older run
    assert train(run, *fashion, "--data-dir", "a/data", "--resume", "--iters", "6")["step"] == 6

    from common.config import parse_args

    monkeypatch.setenv("HOME", str(tmp_path))  # "~" that no shell expanded (--data-dir=~/a/data)
    assert parse_args("vanilla_gan", "pytorch", ["--data-dir=~/a/data"]).data_dir == str(tmp_path / "a" / "data")


@pytest.mark.parametrize("folder", ["samples", "checkpoints"])
@pytest.mark.parametrize("kind", ["file", "dangling-link"])
def test_a_file_where_the_run_keeps_a_folder_is_one_error_line_and_changes_nothing(folder, kind, tmp_path, capsys):
    run = tmp_path / "run"
    train(run)
    shutil.rmtree(run / folder)
    if kind == "file":
        (run / folder).write_text("a file, not the run's folder")
    else:
        (run / folder).symlink_to(tmp_path / "gone")
    settings = (run / "config.json").read_bytes()
    refused(capsys, f"{folder} is not a folder, where the run keeps its {folder}: move it out of the run folder", run,
            "--resume", "--iters", "4")
    assert (run / "config.json").read_bytes() == settings  # the refused resume wrote nothing
    if kind == "file":
        assert (run / folder).read_text() == "a file, not the run's folder"


def test_a_loss_scale_of_zero_counts_as_a_state_not_to_checkpoint():
    """About 165 overflows in a row take 65536 to 0 inside --nonfinite-patience's 200 steps;
    such a checkpoint, whose weights are finite, pruned good ones and was refused by --resume."""
    from types import SimpleNamespace

    import keras

    from common.tensorflow.amp import LossScaleOptimizer

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer = SimpleNamespace(modules={}, optimizers={}, averages={})
    checkpoints = pytorch_checkpoint.Checkpoints(trainer, SimpleNamespace(scaler=scaler))
    assert checkpoints.nonfinite() is None
    scaler.scale(torch.ones(1))  # creates the scale tensor
    scaler.update(0.0)
    assert checkpoints.nonfinite() == "scaler/scale"
    scaler.update(math.inf)  # refused by --resume as well
    assert checkpoints.nonfinite() == "scaler/scale"

    optimizer = LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=1024.0)
    optimizer.build([keras.Variable(1.0)])
    noise = SimpleNamespace(draws=keras.Variable(0, dtype="int64"))
    trainer = SimpleNamespace(modules={}, optimizers={"generator": optimizer}, averages={}, noise=noise)
    checkpoints = tensorflow_checkpoint.Checkpoints(trainer, None)
    assert checkpoints.nonfinite() is None
    optimizer.dynamic_scale.assign(0.0)
    assert checkpoints.nonfinite() == "optimizer/generator: the loss scale"
    optimizer.dynamic_scale.assign(math.inf)  # an optimizer variable, so the scan of them finds it first
    assert checkpoints.nonfinite().startswith("optimizer/generator")


def test_checkpoints_past_a_million_steps_are_ordered_by_step_not_by_name(tmp_path):
    """step_1000000.pt sorts before step_999999.pt by name, but it is the later checkpoint:
    --resume picks it, and pruning keeps it with the one before."""
    run = RunFolder(tmp_path)
    run.checkpoints.mkdir()
    for step in (999_998, 999_999, 1_000_000):
        run.checkpoint_path(step, "pt").write_bytes(b"state")
    assert [step for step, _ in run.list_checkpoints()] == [999_998, 999_999, 1_000_000]
    assert run.latest_checkpoint() == (1_000_000, tmp_path / "checkpoints" / "step_1000000.pt")
    run.prune_checkpoints()
    assert {p.name for p in run.checkpoints.iterdir()} == {"step_999999.pt", "step_1000000.pt"}


def test_a_full_disk_at_a_history_row_names_the_history_file(tmp_path, monkeypatch):
    """The row is written through a bare descriptor, whose error named no file ("cannot write
    the output: No space left on device")."""
    import errno
    import os

    from common.errors import file_system_problem

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    run = RunFolder(tmp_path)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as raised:
        run.append_history({"step": 1, "loss": 0.5})
    assert file_system_problem(raised.value) == f"{tmp_path / 'history.jsonl'}: No space left on device"


def test_a_rename_onto_a_folder_names_the_file_asked_for_not_the_temporary_one(tmp_path):
    from common.errors import file_system_problem
    from common.runs import atomic_write

    (tmp_path / "table.md").mkdir()
    with pytest.raises(OSError) as raised:
        atomic_write(tmp_path / "table.md", lambda f: f.write(b"x"))
    assert file_system_problem(raised.value) == f"{tmp_path / 'table.md'}: Is a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["table.md"]  # the temporary file gone too


def test_a_full_disk_while_writing_names_the_file_asked_for(tmp_path):
    """The write itself names no file; the temporary one beside it is not the user's."""
    import errno

    from common.errors import file_system_problem
    from common.runs import atomic_write

    def full(file):
        file.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        atomic_write(tmp_path / "table.md", full)
    assert file_system_problem(raised.value) == f"{tmp_path / 'table.md'}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_no_file_of_a_run_is_written_through_a_link_left_in_its_folder(tmp_path):
    """A run folder from elsewhere can hold links where the run writes its temporary files
    (fixed_noise.npy.tmp was one fixed name): a write through one landed in the file it points
    to, outside the folder. A history.jsonl that is a link is refused, not appended to."""
    import numpy as np

    from common import sampling
    from common.errors import UserError
    from common.runs import RunFolder, atomic_write

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / f".fixed_noise.npy.tmp-{os.getpid()}").symlink_to(victim)
    noise = sampling.fixed_noise(run, 4, 3, seed=0)
    np.testing.assert_array_equal(np.load(run / "fixed_noise.npy"), noise)
    (run / f".table.md.tmp-{os.getpid()}").symlink_to(victim)
    atomic_write(run / "table.md", lambda f: f.write(b"x"))
    assert (run / "table.md").read_bytes() == b"x" and not (run / "table.md").is_symlink()
    assert victim.read_text() == "mine" and sorted(p.name for p in run.iterdir()) == ["fixed_noise.npy", "table.md"]
    (run / "history.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match="history.jsonl is a link"):
        RunFolder(run).append_history({"step": 1, "loss": 0.5})
    assert victim.read_text() == "mine"


@pytest.mark.parametrize("script", ["benchmark", "quality_table", "compare"])
def test_a_folder_where_a_scripts_table_goes_is_refused_before_any_run(script, tmp_path, capsys, monkeypatch):
    """The file was written after every run: benchmark.py lost hours of measurements, with an
    error naming a temporary file."""
    import importlib
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail(f"ran {args[0]}"))
    module = importlib.import_module(f"scripts.{script}")
    out = tmp_path / "out"
    blocked, argv = {
        "benchmark": (out / "benchmark.json", ["--models", "vanilla_gan", "--iters", "4", "--log-every", "2",
                                               "--out", str(out)]),
        "quality_table": (out / "quality_table.md", ["--models", "vanilla_gan", "--datasets", "ring8",
                                                     "--iters", "4", "--runs", str(out)]),
        "compare": (out / "table.md", ["--model", "vanilla_gan", "--iters", "4", "--runs", str(tmp_path / "runs"),
                                       "--report", str(out)]),
    }[script]
    blocked.mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and f"{blocked} is a folder, not a file" in err and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [*out.iterdir()] == [blocked]


def test_a_run_folder_in_use_by_another_process_is_refused(tmp_path, capsys):
    """Two runs in one folder at once (two --resume, two --overwrite, or an evaluation beside the
    training) interleaved their history rows, out of order, and both exited 0."""
    import subprocess
    import sys

    run = tmp_path / "run"
    train(run)
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        settings = (run / "config.json").read_bytes()
        for flags in (["--resume", "--iters", "4"], ["--overwrite"]):
            refused(capsys, f"{run} is in use by another process", run, *flags)
        assert (run / "config.json").read_bytes() == settings  # nothing read or written
        assert RunFolder(run).latest_checkpoint()[0] == 2
    finally:
        holder.kill()
        holder.wait()
    train(run, "--resume", "--iters", "4")  # free again; and one process may reopen its own folder
    train(run, "--resume", "--iters", "6")


def test_a_refused_run_lets_the_folder_go_at_once(tmp_path, capsys):
    """The refusal's traceback (kept by `pytest.raises`, a notebook's last error) held the
    RunFolder, and with it the lock: another process was refused the folder."""
    import subprocess
    import sys

    run = tmp_path / "run"
    train(run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as kept:
        train(run, "--resume", "--iters", "4", "--batch-size", "16")  # other settings: refused
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
             "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')")
    result = subprocess.run([sys.executable, "-c", probe, str(run)], capture_output=True, text=True, timeout=60)
    assert kept.value.code == 1 and result.stdout == "free\n", result.stderr[-500:]


def test_a_folder_that_cannot_be_locked_is_trained_in_with_a_warning(tmp_path, capsys, monkeypatch):
    """NFS without local locks refuses an exclusive flock on a folder opened read-only (EBADF):
    that is no other process, and every run there was refused."""
    import errno
    import fcntl

    def unsupported(fd, operation):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    train(tmp_path / "r\nun")  # a line break in its name: the warning stays one line
    warnings = [line for line in capsys.readouterr().err.splitlines() if "cannot be locked" in line]
    assert warnings and warnings[0].startswith(f"warning: {tmp_path}/r\\nun cannot be locked (Bad file descriptor)")
    assert json.loads((tmp_path / "r\nun" / "summary.json").read_text())["step"] == 2


# --- 8. strict JSON: a loss that went inf/NaN is null, and reads back as NaN --------------------

def strict(text):
    """What jq or JavaScript's JSON.parse make of `text`: bare NaN/Infinity/-Infinity refused."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_run_whose_losses_go_nonfinite_writes_strict_json_with_null(tmp_path, capsys):
    from common import report
    from common.runs import read_json

    run = tmp_path / "div"
    with pytest.raises(SystemExit):
        train(run, "--iters", "6", "--lr", "1e6", "--nonfinite-patience", "3", "--log-every", "1",
              "--ema-decay", "0", model="lsgan")
    assert "have been inf/NaN since step" in capsys.readouterr().err
    rows = [strict(line) for line in (run / "history.jsonl").read_text().splitlines()]
    summary = strict((run / "summary.json").read_text())
    gone = [row for row in rows if row["d_loss"] is None]
    assert gone and all(row["nonfinite_steps"] == 1 for row in gone)
    assert summary["final"]["d_loss"] is None and summary["stopped"].startswith("losses inf/NaN")
    # read back as the NaN the plots, tables and TensorBoard have always met there
    history = RunFolder(run).read_history()
    assert [math.isnan(row["d_loss"]) for row in history] == [row["d_loss"] is None for row in rows]
    assert math.isnan(read_json(run / "summary.json")["final"]["d_loss"])
    # compare.py's report of it: table.json strict too, its markdown as before
    side = report.load_side(run, "diverged")
    written = report.write_report([side, side], tmp_path / "report", "diverged", "compare")
    assert "d_loss nan" in (tmp_path / "report" / "table.md").read_text()
    table = strict((tmp_path / "report" / "table.json").read_text())
    assert table["rows"][0]["final_losses"]["d_loss"] is None
    assert math.isnan(written["rows"][0]["final_losses"]["d_loss"])


def test_strict_json_writes_nonfinite_floats_as_null_through_nested_objects():
    from common import runs

    value = {"loss": math.nan, "scale": math.inf, "low": -math.inf, "fine": 1.5, "count": 3, "flag": True,
             "text": "NaN", "none": None, "numpy": np.float64("nan"), "steps": [1, math.nan, (math.inf, 2.0)],
             "nested": {"deeper": [{"fid": math.nan}]}}
    assert runs.finite_or_null(value) == {
        "loss": None, "scale": None, "low": None, "fine": 1.5, "count": 3, "flag": True, "text": "NaN",
        "none": None, "numpy": None, "steps": [1, None, [None, 2.0]], "nested": {"deeper": [{"fid": None}]}}
    text = runs.strict_json(value, indent=2, sort_keys=True)
    assert strict(text) == runs.finite_or_null(value)
    assert math.isnan(value["loss"])  # the value handed in is left as it was
    with pytest.raises(ValueError):  # a non-finite float that got past it is an error, not invalid JSON
        runs.strict_json({"loss": object()}, default=lambda unknown: math.nan)


def test_null_losses_read_back_as_nan_and_a_file_with_bare_nan_still_reads(tmp_path):
    from common.errors import UserError
    from common.runs import read_json

    run = RunFolder(tmp_path)
    run.history_file.write_text(
        '{"step": 1, "d_loss": 0.5, "g_loss": null, "step_ms": 2.0}\n'
        '{"step": 2, "d_loss": NaN, "g_loss": Infinity, "step_ms": 2.0, "nonfinite_steps": 1}\n'  # an older run's
        '{"step": 3, "d_loss": null, "g_loss": -Infinity, "step_ms": 2.0, "skipped_at": [3]}\n')
    rows = run.read_history()
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[0]["d_loss"] == 0.5
    assert math.isnan(rows[0]["g_loss"]) and math.isnan(rows[1]["d_loss"]) and math.isnan(rows[2]["d_loss"])
    assert rows[1]["g_loss"] == math.inf and rows[2]["g_loss"] == -math.inf and rows[2]["skipped_at"] == [3]
    run.truncate_history(2)  # a resume rewrites what it keeps: strict, bare NaN and all
    assert [strict(line) for line in run.history_file.read_text().splitlines()] == [
        {"step": 1, "d_loss": 0.5, "g_loss": None, "step_ms": 2.0},
        {"step": 2, "d_loss": None, "g_loss": None, "step_ms": 2.0, "nonfinite_steps": 1}]
    for damaged in ('{"step": null, "d_loss": 1.0}', '{"step": 4, "skipped_at": [null]}',
                    '{"step": 4, "skipped_at": null}'):  # still no row
        run.history_file.write_text(damaged + "\n" + '{"step": 5, "d_loss": 1.0}\n')
        with pytest.raises(UserError, match="line 1 is not a history row"):
            run.read_history()

    for text in ('{"step": 2, "final": {"d_loss": null}, "metrics": {"fid": null}, "median_step_ms": null,'
                 ' "metrics_over_draws": {"fid": [1.0, null]}}',
                 '{"step": 2, "final": {"d_loss": NaN}, "metrics": {"fid": NaN}, "median_step_ms": null,'
                 ' "metrics_over_draws": {"fid": [1.0, NaN]}}'):  # the same from an older run
        (tmp_path / "summary.json").write_text(text)
        summary = read_json(tmp_path / "summary.json", ("step",))
        assert math.isnan(summary["final"]["d_loss"]) and math.isnan(summary["metrics"]["fid"])
        assert math.isnan(summary["metrics_over_draws"]["fid"][1])
        assert summary["median_step_ms"] is None  # null that means "not measured" stays None
        run.write_summary(summary)
        assert strict((tmp_path / "summary.json").read_text())["final"] == {"d_loss": None}


def test_a_fixed_noise_file_of_another_shape_or_dtype_or_a_dangling_link_is_refused(tmp_path, capsys):
    """The grids of a resumed run come from the noise file it wrote; one of float64 (a user's
    own np.save), a link to nothing, or one of other rows is refused, not drawn from or drawn
    again: a dangling link was taken for no file, and the run's grids changed noise mid-run.
    All before training (other rows were found at the first grid, steps later)."""
    run = tmp_path / "run"
    train(run)
    noise = run / "fixed_noise.npy"
    np.save(noise, np.zeros((64, 100), np.float64))
    refused(capsys, "not the float32 rows a run writes", run, "--resume", "--iters", "4")
    noise.unlink()
    noise.symlink_to(tmp_path / "gone.npy")
    refused(capsys, "fixed_noise.npy is not a regular file", run, "--resume", "--iters", "4")
    assert [path.name for path in (run / "checkpoints").iterdir()] == ["step_000002.pt"]  # refused before training
    noise.unlink()
    np.save(noise, np.zeros((32, 100), np.float32))
    refused(capsys, "holds float32(32, 100), expected float32(64, 100)", run, "--resume", "--iters", "4",
            "--sample-every", "0")
    assert [path.name for path in (run / "checkpoints").iterdir()] == ["step_000002.pt"]


def test_a_fixed_noise_file_of_the_right_rows_but_another_width_is_refused(tmp_path):
    """Noise of another --z-dim (or a model's with another latent size), with as many rows as
    the grid: refused, not handed to a generator it does not fit (mutation round 10: checking
    the row count alone went unseen)."""
    np.save(tmp_path / "fixed_noise.npy", np.zeros((64, 50), np.float32))
    with pytest.raises(sampling.UserError, match=r"holds float32\(64, 50\), expected float32\(64, 100\)"):
        sampling.check_fixed_noise(tmp_path, 64, 100)
    sampling.check_fixed_noise(tmp_path, 64, 50)


def test_a_setting_a_resume_leaves_out_is_shown_as_unset_not_as_pythons_none():
    """--resume without the run's --data-dir said "(data_dir: '/data' -> None)" (a fresh-user
    review): None is Python's word for it."""
    from common.runs import setting_changes

    assert setting_changes({"data_dir": "/data", "width": 8}, {"data_dir": None, "width": 8}) == \
        "data_dir: '/data' -> unset"
    assert setting_changes({"data_dir": None}, {"data_dir": "/data"}) == "data_dir: unset -> '/data'"
