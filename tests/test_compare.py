"""--init-from across the frameworks, the weights file both read, and scripts/compare.py's
report after tiny two-framework runs."""
import json
import os
import shlex
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from common import cpu, porting, report
from common.errors import UsageError, UserError
from GAN.dcgan import dcgan_tensorflow
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
from scripts import compare

SCRIPTS = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}
TINY = ["--batch-size", "32", "--data-limit", "256", "--log-every", "2", "--sample-every", "3"]


def train(framework, out, *extra):
    return SCRIPTS[framework].main(["--out", str(out), *TINY, "--iters", "3", *extra])


def weights(run):
    networks, meta = porting.load_weights(run / porting.INITIAL_WEIGHTS)
    return networks, meta


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert [kind for kind, _ in a[name]] == [kind for kind, _ in b[name]]
        for (_, x), (_, y) in zip(a[name], b[name]):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("source, target", [("pytorch", "tensorflow"), ("tensorflow", "pytorch")])
def test_a_run_starts_from_the_other_frameworks_initial_weights(source, target, tmp_path):
    train(source, tmp_path / "source")
    train(target, tmp_path / "own")  # same seed, its own framework's initialisation
    train(target, tmp_path / "ported", "--init-from", str(tmp_path / "source"))

    source_weights, meta = weights(tmp_path / "source")
    assert meta["framework"] == source and meta["sample_shape"] == [28, 28, 1]
    assert set(source_weights) == {"generator", "discriminator"}
    ported, _ = weights(tmp_path / "ported")
    assert_same_weights(source_weights, ported)  # exact: float32 values are copied
    own, _ = weights(tmp_path / "own")
    assert not np.array_equal(own["generator"][0][1][0], source_weights["generator"][0][1][0])

    # Same function at step 0: the two step-0 grids (same fixed noise) are pixel for pixel equal.
    grid = lambda run: report.read_grid(report.load_side(run), 0)
    np.testing.assert_array_equal(grid(tmp_path / "source"), grid(tmp_path / "ported"))
    assert np.abs(grid(tmp_path / "source") - grid(tmp_path / "own")).mean() > 0.01


def test_init_from_refuses_what_does_not_fit(tmp_path, capsys):
    train("pytorch", tmp_path / "gan")

    def refused(message, *flags):
        with pytest.raises(SystemExit) as exit_info:
            train("tensorflow", tmp_path / "new", "--overwrite", *flags)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 1 and message in err and "\n" not in err, err

    refused("no weights file", "--init-from", str(tmp_path / "missing"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    refused("not a readable weights file", "--init-from", str(tmp_path / "junk.npz"))
    # a checkpoint, the likeliest wrong file: what --init-from takes instead is named
    (checkpoint,) = (tmp_path / "gan" / "checkpoints").glob("step_*")
    refused("; --init-from takes a run folder or its initial_weights.npz (the step-0 weights, in either framework), "
            "not a checkpoint", "--init-from", str(checkpoint))
    refused("data shaped (28, 28, 1), this run's data is (2,)",
            "--init-from", str(tmp_path / "gan"), "--dataset", "ring8")
    with pytest.raises(SystemExit) as exit_info:  # the model named, not a layer that does not fit
        dcgan_tensorflow.main(["--out", str(tmp_path / "dcgan"), *TINY, "--iters", "1",
                               "--init-from", str(tmp_path / "gan")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and "holds weights of model 'vanilla_gan', this run is 'dcgan'" in err, err


def test_a_resumed_run_keeps_where_it_started_from(tmp_path, capsys, monkeypatch):
    """--init-from is where a run started: --resume keeps it (compare.py --reuse reads it)
    whether the command repeats it or leaves it out, and refuses another."""
    train("pytorch", tmp_path / "source")
    ported, source = tmp_path / "ported", str(tmp_path / "source")
    train("tensorflow", ported, "--init-from", source)
    started_from = lambda: json.loads((ported / "config.json").read_text())["init_from"]
    assert started_from() == source

    assert train("tensorflow", ported, "--resume", "--iters", "4")["step"] == 4
    assert started_from() == source
    with pytest.raises(SystemExit) as exit_info:
        train("tensorflow", ported, "--resume", "--iters", "5", "--init-from", str(tmp_path / "other"))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and f"the run in {ported} started from {source}" in err and "\n" not in err, err
    assert train("tensorflow", ported, "--resume", "--iters", "5", "--init-from", source)["step"] == 5
    assert started_from() == source
    monkeypatch.chdir(tmp_path)  # the same folder, typed another way
    assert train("tensorflow", ported, "--resume", "--iters", "6", "--init-from", "./source/")["step"] == 6
    assert started_from() == source


def test_init_from_a_malformed_or_big_endian_rgb_weights_file_agrees_in_both_twins(tmp_path, capsys):
    """An RGB run's weights (its image-sized Dense axes are reordered for PyTorch): a 1-D kernel
    is one line in both twins (PyTorch: IndexError before), a big-endian file loads in both
    (PyTorch: "byte order different" before)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "rgb" / "a").mkdir(parents=True)
    for index in range(8):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "rgb" / "a" / f"{index}.png")
    flags = ["--dataset", "folder", "--data-dir", str(tmp_path / "rgb"), "--width", "8", "--batch-size", "8",
             "--iters", "1", "--sample-every", "0", "--no-tensorboard"]
    gan_pytorch.main(["--out", str(tmp_path / "source"), *flags])
    with np.load(tmp_path / "source" / porting.INITIAL_WEIGHTS) as stored:
        arrays = {key: stored[key] for key in stored.files}
    np.savez(tmp_path / "malformed.npz", **{**arrays, "layers/generator/003/0": np.zeros(192, np.float32)})
    np.savez(tmp_path / "big-endian.npz", **{key: value.astype(">f4") if key.startswith("layers/") else value
                                             for key, value in arrays.items()})
    errors = []
    for framework in ("pytorch", "tensorflow"):
        with pytest.raises(SystemExit) as exit_info:
            SCRIPTS[framework].main(["--out", str(tmp_path / f"bad-{framework}"), *flags,
                                     "--init-from", str(tmp_path / "malformed.npz")])
        errors.append(capsys.readouterr().err.strip())
        assert exit_info.value.code == 1 and "\n" not in errors[-1], errors[-1]
        SCRIPTS[framework].main(["--out", str(tmp_path / f"swapped-{framework}"), *flags,
                                 "--init-from", str(tmp_path / "big-endian.npz")])
        assert_same_weights(weights(tmp_path / "source")[0], weights(tmp_path / f"swapped-{framework}")[0])
    assert errors[0].replace("bad-pytorch", "") == errors[1].replace("bad-tensorflow", "")
    assert "does not fit this model's generator: layer 3 (Dense): shapes [(192,), (192,)]" in errors[0], errors[0]


def test_weights_file_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    networks = {"encoder": [("Dense", [rng.normal(size=(4, 3)).astype(np.float32),
                                       rng.normal(size=3).astype(np.float32)])] * 12,
                "decoder": [("BatchNormalization", [np.arange(5, dtype=np.float32)] * 4)]}
    porting.save_weights(tmp_path / "w.npz", networks, {"model": "x", "sample_shape": [2]})
    loaded, meta = porting.load_weights(tmp_path / "w.npz")
    assert meta == {"model": "x", "sample_shape": [2]}
    assert_same_weights(networks, loaded)  # 12 layers: the order survives past index 9


def fake_side(tmp_path, name, steps, history):
    run = tmp_path / name
    (run / "samples").mkdir(parents=True)
    for step in steps:
        (run / "samples" / f"step_{step:06d}.png").write_bytes(b"")
    (run / "samples" / "step_000001_recon.png").write_bytes(b"")
    (run / "config.json").write_text(json.dumps({"framework": "pytorch", "precision": "fp32"}))
    (run / "summary.json").write_text(json.dumps({"step": max(steps)}))
    (run / "history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    return report.load_side(run)


def test_report_matches_steps_and_adds_a_loss_scale_panel_only_when_scaled(tmp_path):
    a = fake_side(tmp_path, "a", range(0, 11), [{"step": 2, "loss": 1.0, "loss_scale": 1.0}])
    b = fake_side(tmp_path, "b", range(0, 11, 2), [{"step": 2, "loss": 1.0, "loss_scale": 65536.0}])
    assert a.sample_steps() == list(range(11))  # the _recon grid is not a sample step
    assert report.matching_steps([a, b], most=4) == [0, 4, 6, 10]
    assert report.matching_steps([a, b], most=10) == [0, 2, 4, 6, 8, 10]
    assert report.loss_panels([a, a]) == ["loss"]
    assert report.loss_panels([a, b]) == ["loss", "loss_scale"]
    with pytest.raises(report.UserError, match="not a finished run"):
        report.load_side(tmp_path / "nowhere")


def test_loss_panels_are_the_numbers_of_every_row_not_skipped_steps(tmp_path):
    """A float16 run's rows name the steps its scaler skipped (lists, of unequal lengths) and
    count the steps whose losses were not finite: no panels, and no numpy error plotting them."""
    scaled = [{"step": 5, "d_loss": 1.0, "loss_scale": 2.0 ** 20, "skipped": 5, "skipped_at": [1, 2, 3, 4, 5],
               "nonfinite_steps": 1},
              {"step": 10, "d_loss": 0.9, "g_loss": 0.7, "loss_scale": 2.0 ** 19, "skipped": 2,
               "skipped_at": [6, 9]},
              {"step": 12, "d_loss": 0.8, "g_loss": 0.6, "loss_scale": 2.0 ** 19, "skipped": 0}]
    plain = [{"step": step, "d_loss": 1.0, "g_loss": 0.5, "loss_scale": 1.0} for step in (5, 10, 12)]
    amp = fake_side(tmp_path, "amp", [0, 12], scaled)
    fp32 = fake_side(tmp_path, "fp32", [0, 12], plain)
    assert report.loss_panels([amp, fp32]) == ["d_loss", "g_loss", "loss_scale"]
    for side in (amp, fp32):
        for step in (0, 12):
            plt.imsave(side.run.sample_path(step), np.zeros((8, 8)), cmap="gray")
    report.write_report([amp, fp32], tmp_path / "report", "t", "cmd")
    assert (tmp_path / "report" / "losses.png").stat().st_size > 0
    assert report.files_of_others(tmp_path / "report") == []  # a report compare may write again


def test_compare_does_not_write_its_report_over_a_folder_of_the_users_own(tmp_path, capsys, monkeypatch):
    """--report names a folder of the user's that holds a report.md or a samples.png: they
    were replaced. Refused before anything trains; a report this script wrote is its own to
    redo, even one a failed figure left with its table.json alone."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("my notes")
    (notes / "samples.png").write_bytes(b"my grid")
    (notes / "table.json").write_text('{"title": "mine"}')  # JSON, not a table of compare's
    monkeypatch.setattr(compare, "train", lambda *args, **kwargs: pytest.fail("trained before refusing"))
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--model", "vanilla_gan", "--runs", str(tmp_path / "runs"), *TINY, "--report", str(notes)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert f"--report {notes} already holds report.md, samples.png, table.json, not written by compare.py" in err
    assert (notes / "report.md").read_text() == "my notes" and (notes / "samples.png").read_bytes() == b"my grid"
    (notes / "table.json").write_text(json.dumps(dict.fromkeys(report.REPORT_MARK, [])))  # as write_report's
    assert report.files_of_others(notes) == []
    assert report.files_of_others(tmp_path / "empty") == []

    side = fake_side(tmp_path, "a", [0], [{"step": 2, "loss": 1.0}])
    plt.imsave(side.run.sample_path(0), np.zeros((8, 8)), cmap="gray")

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "loss_figure", disk_full)
    with pytest.raises(OSError):
        report.write_report([side, side], tmp_path / "failed", "t", "cmd")
    assert (tmp_path / "failed" / "samples.png").exists() and report.files_of_others(tmp_path / "failed") == []


def test_a_loss_name_or_label_with_dollar_signs_is_drawn_as_written(tmp_path, monkeypatch):
    """matplotlib reads text between two $ as TeX: an edited history key "$\\foo{$" ended
    compare.py in its parser's traceback. Only those texts are plain: the loss scale's log axis
    labels its ticks in TeX ($\\mathdefault{2^{20}}$), which must still be drawn as powers of 2."""
    odd = fake_side(tmp_path, "odd", [0], [{"step": 2, "$\\foo{$": 1.0, "loss_scale": 2.0**20}])
    plain = fake_side(tmp_path, "plain", [0], [{"step": 2, "$\\foo{$": 0.5, "loss_scale": 1.0}])
    odd.label = "$\\bar{$ fp32"
    for side in (odd, plain):
        plt.imsave(side.run.sample_path(0), np.zeros((8, 8)), cmap="gray")
    figures = []
    monkeypatch.setattr(report.plt, "close", figures.append)
    report.write_report([odd, plain], tmp_path / "report", "t", "cmd")
    assert (tmp_path / "report" / "losses.png").stat().st_size > 0
    texts = {text.get_text(): text for figure in figures for text in figure.findobj(plt.Text)}
    assert not texts["$\\foo{$"].get_parse_math() and not texts["$\\bar{$ fp32"].get_parse_math()
    ticks = [text for text in texts.values() if "mathdefault" in text.get_text()]
    assert ticks and all(text.get_parse_math() for text in ticks)


def test_an_edited_history_of_huge_values_or_many_keys_is_drawn_in_moments(tmp_path, monkeypatch):
    """Values past float32's largest are no loss a run logged: 1e308 and -1e308 on one axis
    ended compare.py in matplotlib's traceback ("arange: cannot compute length"). A row of
    2,000 keys drew 2,000 panels, minutes of work: the figure stops at a few."""
    huge = fake_side(tmp_path, "huge", [0], [{"step": 1, "d_loss": 1e308}, {"step": 2, "d_loss": -1e308},
                                             {"step": 3, "d_loss": 3e38}, {"step": 4, "d_loss": -3e38}])
    wide = fake_side(tmp_path, "wide", [0], [{"step": 1, **{f"k{i}": 1.0 for i in range(2000)}}])
    for side in (huge, wide):
        plt.imsave(side.run.sample_path(0), np.zeros((8, 8)), cmap="gray")
    assert report.loss_panels([huge]) == ["d_loss"]
    scaled = fake_side(tmp_path, "scaled", [0], [{"step": 1, "loss_scale": 2.0, **{f"k{i}": 1.0 for i in range(20)}}])
    assert report.loss_panels([scaled])[-2:] == [f"k{report.MAX_LOSS_PANELS - 2}", "loss_scale"]
    drawn = []
    plot = report.plt.Axes.plot

    def recorded(axis, steps, values, **kwargs):
        drawn.append(list(values))
        return plot(axis, steps, values, **kwargs)

    monkeypatch.setattr(report.plt.Axes, "plot", recorded)
    report.write_report([huge, wide], tmp_path / "report", "t", "cmd")
    assert [3e38, -3e38] in drawn  # the float32 range is drawn, beyond it left out
    assert len(drawn) == 2 * report.MAX_LOSS_PANELS  # both runs in each of the first panels
    assert (tmp_path / "report" / "losses.png").stat().st_size > 0


def test_the_report_gives_the_second_runs_step_time_as_a_multiple_of_the_firsts(tmp_path):
    """The sentence under the table compares the last run with the first: the ratio the wrong
    way up would call the slower run the faster one."""
    fast = fake_side(tmp_path, "fast", [0], [{"step": 2, "loss": 1.0}])
    slow = fake_side(tmp_path, "slow", [0], [{"step": 2, "loss": 1.0}])
    fast.label, fast.summary["median_step_ms"] = "pytorch fp32", 10.0
    slow.label, slow.summary["median_step_ms"] = "pytorch amp-bf16", 25.0
    for side in (fast, slow):
        plt.imsave(side.run.sample_path(0), np.zeros((8, 8)), cmap="gray")
    report.write_report([fast, slow], tmp_path / "report", "t", "cmd")
    lines = (tmp_path / "report" / "report.md").read_text().splitlines()
    assert "pytorch amp-bf16 takes 2.50x the step time of pytorch fp32." in lines


def test_the_report_says_when_the_runs_metrics_were_measured_on_different_sample_counts(tmp_path):
    """An evaluate.py --samples 10 of one run beside the other's 20: two FIDs that do not compare
    stood side by side unsaid."""
    sides = [fake_side(tmp_path, name, [0], [{"step": 2, "loss": 1.0}]) for name in ("a b", "c")]
    for side, samples in zip(sides, (20, 10)):
        side.summary["metrics"] = {"fid": 9.0, "samples": samples}
        plt.imsave(side.run.sample_path(0), np.zeros((8, 8)), cmap="gray")
    report.write_report(sides, tmp_path / "report", "t", "cmd")
    note = ("The runs' metrics were measured on different numbers of samples (20 and 10): they do not compare; "
            "compare.py's --reuse --evaluate N measures both on N and tables them.")
    assert note in (tmp_path / "report" / "report.md").read_text().splitlines()
    sides[1].summary["metrics"]["samples"] = 20
    report.write_report(sides, tmp_path / "report", "t", "cmd")
    assert "different numbers of samples" not in (tmp_path / "report" / "report.md").read_text()


def test_sample_drift_is_the_mean_absolute_difference_of_the_two_grids(tmp_path):
    """A grid a quarter of whose pixels went from black to white has drifted 0.25, not 1 (the
    largest difference of any pixel), on the 0-1 scale the report states."""
    black = fake_side(tmp_path, "black", [0], [{"step": 2, "loss": 1.0}])
    quarter = fake_side(tmp_path, "quarter", [0], [{"step": 2, "loss": 1.0}])
    grid = np.zeros((8, 8, 3), dtype=np.uint8)
    plt.imsave(black.run.sample_path(0), grid)  # RGB bytes: saved as they are, not rescaled
    grid[:4, :4] = 255
    plt.imsave(quarter.run.sample_path(0), grid)
    table = report.write_report([black, quarter], tmp_path / "report", "t", "cmd")
    assert table["sample_drift"] == {"0": pytest.approx(0.25)}
    assert ("Mean absolute difference of the two sample grids (pixels in [0, 1]): step 0 0.2500."
            in (tmp_path / "report" / "report.md").read_text())


def planned(monkeypatch, argv) -> list:
    """The Plans compare.main(argv) would train, in order; nothing trained, no report."""
    trained = []

    class Planned(Exception):
        pass

    def stop(*args, **kwargs):
        raise Planned

    monkeypatch.setattr(compare, "train", lambda plan, extra, **kwargs: trained.append(plan))
    monkeypatch.setattr(compare.report, "load_side", stop)  # no report: the runs were not trained
    with pytest.raises(Planned):
        compare.main(argv)
    return trained


@pytest.mark.parametrize("mode", [["--amp"], ["--fp32-vs-amp", "pytorch"]])
def test_compare_gives_amp_dtype_to_the_amp_runs_alone(mode, tmp_path, monkeypatch):
    """--amp-dtype float16 on a CPU (or bfloat16 on CUDA): the float32 run refuses it, and
    compare once passed it to every script without the --amp it had taken itself."""
    trained = planned(monkeypatch, ["--model", "vanilla_gan", "--runs", str(tmp_path), *TINY, "--iters", "2",
                                    "--device", "cpu", *mode, "--amp-dtype", "float16"])
    amp_runs = trained if mode == ["--amp"] else trained[1:]
    assert [plan.framework for plan in trained] == (["pytorch", "tensorflow"] if mode == ["--amp"] else
                                                    ["pytorch", "pytorch"])
    for plan in amp_runs:
        command = plan.command([])
        assert command[command.index("--amp-dtype") + 1] == "float16" and "--amp" in command
        assert (plan.config.amp_dtype, plan.precision) == ("float16", "amp-fp16")
        assert plan.folder.name == f"{plan.framework}-amp-fp16" and plan.expected()["amp_dtype"] == "float16"
    if mode != ["--amp"]:
        fp32 = trained[0]
        assert "--amp-dtype" not in fp32.command([]) and "--amp" not in fp32.command([])
        assert (fp32.config.amp_dtype, fp32.precision, fp32.folder.name) == ("auto", "fp32", "pytorch-fp32")


def test_compare_names_another_datasets_runs_as_the_scripts_do(tmp_path, monkeypatch):
    """Its runs of the ring beside its MNIST ones, in the folders the scripts would pick (an
    MNIST run's folder met by a ring run was refused, or replaced under --overwrite)."""
    from common.config import parse_args, run_dir_for

    trained = [plan for dataset in ("mnist", "ring8") for plan in planned(
        monkeypatch, ["--model", "vanilla_gan", "--runs", str(tmp_path), "--iters", "2", "--device", "cpu",
                      "--dataset", dataset])]
    assert [plan.folder.name for plan in trained] == ["pytorch-fp32", "tensorflow-fp32", "pytorch-fp32-ring8",
                                                      "tensorflow-fp32-ring8"]
    for plan in trained:
        default = run_dir_for(parse_args("vanilla_gan", plan.framework, plan.flags), plan.precision)
        assert plan.folder == tmp_path / default.relative_to("runs")


def test_compare_fp32_vs_float16_on_a_cpu(tmp_path):
    """Trained: the float16 run's history names the steps its scaler skipped (--init-scale 1e8
    overflows at first), and the report plots the float32 and float16 runs' losses side by side."""
    runs = tmp_path / "runs"
    assert compare.main(["--model", "vanilla_gan", "--runs", str(runs), "--fp32-vs-amp", "pytorch",
                         "--amp-dtype", "float16", "--init-scale", "1e8", "--iters", "5", "--log-every", "2",
                         "--sample-every", "5", "--batch-size", "8", "--width", "8", "--data-limit", "64",
                         "--no-tensorboard", "--device", "cpu"]) == 0
    fp32, amp = (json.loads((runs / "vanilla_gan" / name / "config.json").read_text())
                 for name in ("pytorch-fp32", "pytorch-amp-fp16"))
    assert (fp32["amp"], fp32["amp_dtype"], amp["amp"], amp["amp_dtype"]) == (False, "auto", True, "float16")
    table = json.loads((runs / "vanilla_gan" / "compare-fp32-vs-amp-fp16-pytorch" / "table.json").read_text())
    assert [row["precision"] for row in table["rows"]] == ["fp32", "amp-fp16"]
    assert table["rows"][1]["skipped_steps"] > 0
    history = report.load_side(runs / "vanilla_gan" / "pytorch-amp-fp16").history
    assert len({len(row.get("skipped_at", [])) for row in history}) > 1  # [1, 2], [3, 4], [5]: no array


def test_compare_writes_the_report_and_reuses_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --runs relative to where the user is, for compare and its runs
    runs = Path("runs")
    flags = ["--model", "vanilla_gan", "--runs", str(runs), *TINY, "--iters", "6"]
    assert compare.main([*flags, "--same-init"]) == 0

    folder = runs / "vanilla_gan" / "compare-pytorch-vs-tensorflow-fp32-same-init"
    assert {p.name for p in folder.iterdir()} == {
        "samples.png", "losses.png", "table.md", "table.json", "report.md"}
    table = json.loads((folder / "table.json").read_text())
    assert [(r["framework"], r["precision"], r["steps"]) for r in table["rows"]] == [
        ("pytorch", "fp32", 6), ("tensorflow", "fp32", 6)]
    assert all(r["median_step_ms"] > 0 and r["peak_memory_mb"] > 0 for r in table["rows"])
    assert table["sample_steps"] == [0, 3, 6]
    drift = table["sample_drift"]
    assert drift["0"] == 0.0 and drift["6"] > 0  # same start, then the two trainings part
    tensorflow_config = json.loads((runs / "vanilla_gan" / "tensorflow-fp32-init-pytorch"
                                    / "config.json").read_text())
    assert tensorflow_config["init_from"] == str(tmp_path / runs / "vanilla_gan" / "pytorch-fp32")  # absolute
    markdown = (folder / "table.md").read_text()
    assert markdown.count("\n") == 4 and "| pytorch fp32 | cpu | 6 |" in markdown
    assert all(r["cpu"] == cpu.describe() for r in table["rows"])
    assert f"\nCPU: {cpu.summary()}\n" in (folder / "report.md").read_text()  # the two runs' machine, once

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # existing runs are never retrained silently
        compare.main([*flags, "--same-init"])
    assert exit_info.value.code == 2 and "--reuse" in capsys.readouterr().err

    summary = runs / "vanilla_gan" / "pytorch-fp32" / "summary.json"
    before = summary.stat().st_mtime_ns
    assert compare.main([*flags, "--fp32-vs-amp", "pytorch", "--reuse", "--report", "my report"]) == 0
    assert summary.stat().st_mtime_ns == before  # float32 reused, only AMP trained
    written = json.loads(Path("my report", "table.json").read_text())["command"]  # as a shell reads it back
    assert shlex.split(written) == ["python", "scripts/compare.py", *flags, "--fp32-vs-amp", "pytorch", "--reuse",
                                    "--report", "my report"]
    last = capsys.readouterr().out.splitlines()[-1]  # where to look, as `make demo` ends
    assert last.endswith(f"tensorboard --logdir {runs / 'vanilla_gan'}")
    table = json.loads(Path("my report", "table.json").read_text())
    assert [r["precision"] for r in table["rows"]] == ["fp32", "amp-bf16"]

    with pytest.raises(SystemExit) as exit_info:
        compare.main([*flags, "--same-init", "--reuse", "--lr", "1e-4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "lr: 0.0002 here, 0.0001 asked" in err

    # --runs typed another way names the same runs: refused as "other settings" (init_from) before
    ported = runs / "vanilla_gan" / "tensorflow-fp32-init-pytorch" / "summary.json"
    before = ported.stat().st_mtime_ns
    assert compare.main([*flags[:2], "--runs", str(tmp_path / "runs"), *flags[4:], "--same-init", "--reuse"]) == 0
    assert ported.stat().st_mtime_ns == before
    capsys.readouterr()

    grid = runs / "vanilla_gan" / "tensorflow-fp32-init-pytorch" / "samples" / "step_000000.png"
    plt.imsave(grid, np.zeros((10, 10, 3)))  # a valid PNG of another size: numpy's broadcast error before
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*flags, "--same-init", "--reuse"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and "are grids of other sizes" in err and "\n" not in err, err

    # A run whose checkpoints/ is a dangling link (on a disk not mounted) is refused: it was
    # taken for one with no checkpoint yet, and trained again over its results
    killed = grid.parents[1]
    (killed / "summary.json").unlink()
    shutil.rmtree(killed / "checkpoints")
    (killed / "checkpoints").symlink_to(tmp_path / "unmounted")
    history = (killed / "history.jsonl").read_text()
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*flags, "--same-init", "--reuse"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and "checkpoints is not a folder" in err and "\n" not in err, err
    assert (killed / "history.jsonl").read_text() == history and (killed / "checkpoints").is_symlink()

    # A run killed before its first checkpoint has nothing to resume: it is trained again
    (killed / "checkpoints").unlink()
    assert compare.main([*flags, "--same-init", "--reuse"]) == 0
    assert "holds no checkpoint yet: training it from the start" in capsys.readouterr().out
    assert json.loads((killed / "summary.json").read_text())["step"] == 6

    # settings that shape the training, beyond those --resume keeps, are compared too
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*flags, "--same-init", "--reuse", "--clip-grad-norm", "0.01"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "clip_grad_norm: 0.0 here, 0.01 asked" in err


# --- sample grids that are not PNGs the runs wrote ---------------------------------------------
def png_header_claiming(path, side):
    """A PNG whose header claims side x side RGBA pixels and whose data holds almost nothing."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def test_compare_refuses_a_fifo_for_a_sample_grid_instead_of_waiting_on_it(tmp_path):
    """In a subprocess with a timeout: a regression fails here rather than hanging the suite."""
    from tests.conftest import run_script
    from tests.test_script_errors import TINY as FAKE_TINY
    from tests.test_script_errors import fake_compare_runs

    grid = fake_compare_runs(tmp_path / "runs")["pytorch"] / "samples" / "step_000002.png"
    grid.unlink()
    os.mkfifo(grid)
    result = run_script("scripts/compare.py", "--model", "vanilla_gan", "--runs", str(tmp_path / "runs"),
                        *FAKE_TINY, "--reuse", timeout=60)
    err = result.stderr.strip()
    assert result.returncode == 1 and err.startswith("error: ") and "\n" not in err, err
    assert f"{grid} is not a regular file" in err, err
    with pytest.raises(report.UserError, match="not a regular file"):
        report.read_png(grid)


@pytest.mark.parametrize("side", [20_000, 12_000], ids=["past-twice-the-limit", "past-the-limit"])
def test_a_png_header_claiming_a_huge_image_is_unreadable_not_allocated(side, tmp_path):
    """plt.imread skips Pillow's decompression-bomb check (Image.MAX_IMAGE_PIXELS): it allocated
    what the header claims (65535^2 RGBA: 17 GB, out of memory) before it found the data short."""
    path = png_header_claiming(tmp_path / "step_000002.png", side)
    with pytest.raises(report.UserError, match="not a readable PNG image.*decompression bomb") as info:
        report.read_png(path)
    assert "\n" not in str(info.value)


def test_reuse_takes_an_auto_amp_run_for_the_same_dtype_named(tmp_path):
    """On a CPU --amp is bfloat16: a run made with --amp is the run --amp --amp-dtype bfloat16
    asks for (the folder and the recorded precision agree); it was refused as other settings."""
    flags = ["--iters", "4", *TINY]
    made = compare.Plan("vanilla_gan", "pytorch", True, flags, tmp_path, "cpu")
    made.folder.mkdir(parents=True)
    (made.folder / "config.json").write_text(json.dumps(made.expected()))
    (made.folder / "summary.json").write_text(json.dumps({"step": 4}))
    named = compare.Plan("vanilla_gan", "pytorch", True, flags, tmp_path, "cpu", amp_dtype="bfloat16")
    assert named.folder == made.folder and named.precision == made.precision == "amp-bf16"
    assert compare.decide(named, reuse=True, overwrite=False) is None  # reused as it is
    other = compare.Plan("vanilla_gan", "pytorch", True, flags, tmp_path, "cpu", amp_dtype="float16")
    assert other.folder != made.folder


def planned_run(plan: compare.Plan, checkpoint_step: int, summary: dict) -> None:
    """`plan`'s folder as a run leaves it: its config, summary and a checkpoint (empty: decide
    reads checkpoints by name)."""
    (plan.folder / "checkpoints").mkdir(parents=True)
    (plan.folder / "checkpoints" / f"step_{checkpoint_step:06d}.pt").touch()
    (plan.folder / "config.json").write_text(json.dumps(plan.expected()))
    (plan.folder / "summary.json").write_text(json.dumps(summary))


def test_reuse_with_evaluate_measures_a_finished_run_that_lacks_the_metrics(tmp_path):
    """--reuse --evaluate N reused a finished run unmeasured, and the report, which names
    --evaluate N in its command, had no metric columns: the run is now resumed, which evaluates."""
    def plan(*extra):
        return compare.Plan("vanilla_gan", "pytorch", False, ["--iters", "4", *TINY, *extra], tmp_path, "cpu")

    finished = plan()
    planned_run(finished, 4, {"step": 4})
    assert compare.decide(finished, reuse=True, overwrite=False) is None
    assert compare.decide(plan("--evaluate", "200"), reuse=True, overwrite=False) == ["--resume"]
    (finished.folder / "summary.json").write_text(json.dumps({"step": 4, "metrics": {"samples": 200, "fid": 9.0}}))
    assert compare.decide(plan("--evaluate", "200"), reuse=True, overwrite=False) is None
    assert compare.decide(plan("--evaluate", "500"), reuse=True, overwrite=False) == ["--resume"]


def test_reuse_refusals_name_the_side_to_delete_not_overwrite(tmp_path):
    """--overwrite retrains both sides: a run of other settings, or one trained past --iters,
    is retrained alone by deleting its folder, which the refusal names."""
    def plan(*extra):
        return compare.Plan("vanilla_gan", "pytorch", False, ["--iters", "4", *TINY, *extra], tmp_path, "cpu")

    run = plan()
    planned_run(run, 6, {"step": 6})
    again = f"; delete {run.folder} to train this side again (--overwrite would retrain both)"
    with pytest.raises(UserError) as refused:
        compare.decide(run, reuse=True, overwrite=False)
    assert str(refused.value) == f"cannot reuse {run.folder}: it trained 6 iterations, --iters asks for 4{again}"
    other = compare.Plan("vanilla_gan", "pytorch", False, ["--iters", "4", *TINY, "--lr", "0.001"], tmp_path, "cpu")
    assert other.folder == run.folder
    with pytest.raises(UserError) as refused:
        compare.decide(other, reuse=True, overwrite=False)
    assert str(refused.value).startswith(f"cannot reuse {run.folder}: other settings (lr: ")
    assert str(refused.value).endswith(f"; --runs for another folder{again}"), refused.value


def test_reuse_with_evaluate_never_measures_a_run_by_training_it_again(tmp_path):
    """Measuring is a --resume with nothing left to train, which holds only at a checkpoint of
    the summary's step. A run stopped on inf/NaN losses (its last good checkpoint earlier), or
    one whose last checkpoint was deleted, was resumed there: its steps trained again, its
    history and summary rewritten and the "stopped" record lost, where evaluate.py refuses."""
    def plan(*extra):
        return compare.Plan("vanilla_gan", "pytorch", False, ["--iters", "2", *TINY, *extra], tmp_path, "cpu")

    run = plan()
    planned_run(run, 1, {"step": 2, "stopped": "losses inf/NaN since step 2"})
    # --overwrite would retrain the other side too: the hint names this side's folder
    stopped = (r"stopped at step 2 \(losses inf/NaN since step 2\).*; delete \S+pytorch-fp32 to train this side "
               r"again \(--overwrite would retrain both\)")
    with pytest.raises(UserError, match=stopped):
        compare.decide(plan("--evaluate", "10"), reuse=True, overwrite=False)
    (run.folder / "summary.json").write_text(json.dumps({"step": 2}))  # its last checkpoint deleted
    with pytest.raises(UserError, match=r"no checkpoint at the step of its summary \(2; last checkpoint: 1\)"):
        compare.decide(plan("--evaluate", "10"), reuse=True, overwrite=False)
    (run.folder / "checkpoints" / "step_000001.pt").unlink()
    with pytest.raises(UserError, match="has no checkpoint left"):
        compare.decide(plan("--evaluate", "10"), reuse=True, overwrite=False)
    assert compare.decide(run, reuse=True, overwrite=False) is None  # unmeasured, it is reused as it is


def test_reuse_refuses_to_train_again_over_results_whose_checkpoints_were_deleted(tmp_path):
    """A run with results (a summary at step 4) but its checkpoints deleted, say to save space,
    cannot be continued to --iters 6: it was trained again from the start under --overwrite,
    its results lost, where the model script alone refuses. One killed before its first
    checkpoint (no summary) is still trained again: it has nothing to keep."""
    def plan(iters):
        return compare.Plan("vanilla_gan", "pytorch", False, ["--iters", str(iters), *TINY], tmp_path, "cpu")

    run = plan(4)
    run.folder.mkdir(parents=True)
    (run.folder / "config.json").write_text(json.dumps(run.expected()))
    (run.folder / "summary.json").write_text(json.dumps({"step": 4}))
    with pytest.raises(UsageError) as refused:
        compare.decide(plan(6), reuse=True, overwrite=False)
    assert str(refused.value) == (f"cannot continue {run.folder}: it holds results up to step 4 but no checkpoint to "
                                  f"continue from (deleted?); delete {run.folder} to train this side again "
                                  "(--overwrite would retrain both), or --runs for another folder")
    (run.folder / "summary.json").write_text(json.dumps({"step": 4, "stopped": "losses inf/NaN since step 2"}))
    with pytest.raises(UsageError, match=r"no checkpoint to continue from \(it stopped: losses inf/NaN since step 2\)"):
        compare.decide(plan(6), reuse=True, overwrite=False)
    (run.folder / "summary.json").unlink()
    assert compare.decide(plan(6), reuse=True, overwrite=False) == ["--overwrite"]


def test_compare_hands_run_folders_starting_with_a_dash_to_the_scripts(tmp_path, monkeypatch):
    """--runs ./-r: Path("./-r") prints as "-r", and `--out -r/...` ended in the script's parser
    as a flag of its own ("argument --out: expected one argument")."""
    from common.config import parse_args

    planned = []

    class Planned(Exception):
        pass

    def stop(*args, **kwargs):
        raise Planned

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare, "train", lambda plan, extra, **kwargs: planned.append(plan))
    monkeypatch.setattr(compare.report, "load_side", stop)
    with pytest.raises(Planned):
        compare.main(["--model", "vanilla_gan", "--runs", "./-r", *TINY, "--iters", "2", "--device", "cpu",
                      "--same-init"])
    pytorch, tensorflow = (parse_args("vanilla_gan", plan.framework, plan.command(["--overwrite"])[2:])
                           for plan in planned)
    assert pytorch.out == os.path.join("-r", "vanilla_gan", "pytorch-fp32") and pytorch.overwrite
    assert tensorflow.out == os.path.join("-r", "vanilla_gan", "tensorflow-fp32-init-pytorch")
    assert tensorflow.init_from == str(tmp_path / pytorch.out)  # recorded absolute


def test_make_demo_trains_into_its_own_folder_and_replaces_no_run():
    """`make demo` once ran both model scripts with --overwrite into the default run folders,
    replacing a user's own runs/vanilla_gan/... without a word; its runs are its own now, and
    reused when it runs again."""
    import shlex
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    planned = subprocess.run(["make", "--dry-run", "--always-make", "demo", "DEMO_AMP=", f"PY={sys.executable}"],
                             cwd=root, capture_output=True, text=True, timeout=120, check=True).stdout
    scripts = [shlex.split(line) for line in planned.splitlines() if ".py" in line and "pip" not in line]
    assert scripts and all("--overwrite" not in command for command in scripts)
    (demo,) = [command for command in scripts if command[1].endswith("compare.py")]
    args, flags = compare.parse(demo[2:])
    assert args.model == "vanilla_gan" and args.reuse and "--iters" in flags
    assert Path(args.runs) != Path("runs") and Path(args.runs).parts[0] == "runs"
    # make clean removes the demo's runs and no other: it removed all of runs/, a user's own too
    cleaned = subprocess.run(["make", "--dry-run", "clean"], cwd=root, capture_output=True, text=True,
                             timeout=60, check=True).stdout
    removed = [Path(word) for line in cleaned.splitlines() if line.startswith("rm ")
               for word in shlex.split(line)[1:] if not word.startswith("-")]
    assert Path(args.runs) in removed and not any(Path("runs").is_relative_to(path) for path in removed), removed


@pytest.mark.parametrize("cpuinfo, flag", [
    ("model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n", ""),  # AVX2 only: bfloat16 emulated
    ("model name\t: Intel Xeon\nflags\t\t: avx2 avx512_bf16\n", "--amp"),
    ("model name\t: Intel Xeon\nflags\t\t: avx2 amx_bf16 amx_tile\n", "--amp"),
    (None, ""),  # no /proc/cpuinfo (macOS): an Intel Mac would emulate it, 11.6x slower
    ("processor\t: 0\nFeatures\t: fp asimd bf16\n", ""),  # ARM: no x86 flags to tell by
])
def test_make_demo_trains_under_amp_only_where_bfloat16_is_known_native(cpuinfo, flag, monkeypatch):
    """The demo once ran --amp wherever the CPU could not be told; the emulation warning
    still keeps quiet there (it does not guess)."""
    import subprocess
    import sys

    monkeypatch.setattr(cpu, "_cpuinfo", lambda: cpuinfo)
    assert cpu.demo_precision_flag() == flag
    unknown = cpuinfo is None or "Features" in cpuinfo
    assert cpu.has_native_bf16() is (flag == "--amp" or unknown)  # the emulation warning speaks only when sure
    assert cpu.describe()["amx_bf16"] is (None if unknown else "amx_bf16" in cpuinfo)
    monkeypatch.undo()
    root = Path(__file__).resolve().parents[1]
    planned = subprocess.run(["make", "--dry-run", "--always-make", "demo", f"PY={sys.executable}"],
                             cwd=root, capture_output=True, text=True, timeout=120, check=True).stdout
    (demo,) = [line.split() for line in planned.splitlines() if "compare.py" in line]
    assert ("--amp" in demo) is (cpu.demo_precision_flag() == "--amp")  # the Makefile asks cpu.py


def test_the_tensorboard_command_printed_is_the_one_that_runs(tmp_path, monkeypatch):
    """After `make demo` tensorboard is in .venv/bin, on no PATH: the last line names it there."""
    bin_folder = tmp_path / "venv" / "bin"
    bin_folder.mkdir(parents=True)
    (bin_folder / "tensorboard").write_text("#!/bin/sh\n")
    monkeypatch.setattr(compare.sys, "executable", str(bin_folder / "python"))
    monkeypatch.chdir(tmp_path)
    logdir = Path("runs") / "vanilla_gan"
    monkeypatch.setattr(compare.shutil, "which", lambda name: None)
    assert compare.tensorboard_command(logdir) == "venv/bin/tensorboard --logdir runs/vanilla_gan"
    monkeypatch.chdir(bin_folder)  # a bare name would be looked for on the PATH
    assert compare.tensorboard_command(logdir) == "./tensorboard --logdir runs/vanilla_gan"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not under the working folder: the whole path
    assert compare.tensorboard_command(Path("-r")) == f"{bin_folder / 'tensorboard'} --logdir ./-r"
    monkeypatch.setattr(compare.shutil, "which", lambda name: "/usr/bin/tensorboard")  # on the PATH
    assert compare.tensorboard_command(logdir) == "tensorboard --logdir runs/vanilla_gan"


def test_the_report_table_prints_counts_whole_and_figures_to_four_places():
    row = {"run": "pytorch fp32", "device": "cpu", "steps": 4, "median_step_ms": 1.0, "samples_per_s": 2.0,
           "peak_memory_mb": 3.0, "skipped_steps": 0, "final_losses": {},
           "metrics": {"samples": 2500.0, "modes_covered": 8, "high_quality": 0.71234}}
    line = report.markdown_table([row]).splitlines()[-1]
    assert line.endswith("| 0.7123 | 8 | 2500 |"), line  # not 8.0000 and 2500.0000


def test_the_report_table_keeps_each_run_on_one_row_of_its_columns():
    """A loss, metric or device of a run's files (an edit) holding `|` or a line break opened a
    column or ended the row."""
    row = {"run": "pytorch fp32", "device": "cpu|0\r\n", "steps": 4, "median_step_ms": 1.0, "samples_per_s": 2.0,
           "peak_memory_mb": 3.0, "skipped_steps": 0, "final_losses": {"d|lo\nss": 1.0}, "metrics": {"f|id": 2.5}}
    assert report.markdown_table([row]).splitlines() == [
        r"| run | device | steps | median ms/step | samples/s | peak MB | skipped | final losses | f\|id |",
        "|---|" + "---|" * 8, r"| pytorch fp32 | cpu\|0 | 4 | 1.00 | 2 | 3 | 0 | d\|lo ss 1.000 | 2.5000 |"]


def test_matching_steps_thin_one_step_too_many_to_the_most_asked_first_and_last_kept(tmp_path):
    """Five common steps for a report of at most four rows: four rows, the first and the last
    step among them (not all five)."""
    a = fake_side(tmp_path, "a", range(5), [{"step": 2, "loss": 1.0}])
    b = fake_side(tmp_path, "b", range(5), [{"step": 2, "loss": 1.0}])
    steps = report.matching_steps([a, b], most=4)
    assert len(steps) == 4 and steps[0] == 0 and steps[-1] == 4 and steps == sorted(set(steps))
    assert report.matching_steps([a, b], most=5) == [0, 1, 2, 3, 4]


def test_the_report_table_leaves_the_loss_scale_and_skip_counts_out_of_the_final_losses(tmp_path):
    """A float16 run's summary adds its loss scale and skip counts to "final": the table's final
    losses are the losses alone, as summarize_runs.py shows them."""
    side = fake_side(tmp_path, "amp", [0], [{"step": 2, "d_loss": 1.0}])
    side.summary["final"] = {"d_loss": 1.0, "g_loss": 0.5, "loss_scale": 512.0, "skipped": 0, "skipped_total": 1,
                             "nonfinite_steps": 3}
    (row,) = report.table_rows([side])
    assert row["final_losses"] == {"d_loss": 1.0, "g_loss": 0.5}
    assert "| d_loss 1.000, g_loss 0.500 |" in report.markdown_table([row])


def test_the_report_gives_no_pixel_drift_between_scatter_plots_of_a_mixture(tmp_path):
    """The drift is a difference of two image grids: two ring8 runs' scatter plots (axes, dots,
    a legend) differ in pixels that say nothing about their samples, so the report leaves it out."""
    sides = [fake_side(tmp_path, name, [0], [{"step": 2, "d_loss": 1.0}]) for name in ("a", "b")]
    for side, value in zip(sides, (0, 255)):
        side.config["dataset"] = "ring8"
        plt.imsave(side.run.sample_path(0), np.full((8, 8, 3), value, dtype=np.uint8))
    table = report.write_report(sides, tmp_path / "report", "t", "cmd")
    assert table["sample_drift"] == {}
    assert "Mean absolute difference" not in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--reuse", "--overwrite"], "--reuse and --overwrite contradict each other"),
    (["--fp32-vs-amp", "pytorch", "--same-init"], "--fp32-vs-amp compares precisions in one framework"),
    (["--fp32-vs-amp", "pytorch", "--amp"], "--fp32-vs-amp compares precisions in one framework"),
])
def test_compare_refuses_flags_that_contradict_each_other(argv, message):
    """--same-init has no TensorFlow side to start under --fp32-vs-amp, and --reuse with
    --overwrite would keep and replace the same runs: both refused before anything trains."""
    with pytest.raises(UsageError, match=message):
        compare.parse(["--model", "vanilla_gan", *argv])


def test_reuse_refuses_a_run_of_other_initial_weights_or_of_more_iterations(tmp_path):
    """A finished run started from its own initial weights is no --same-init run (its grids
    would not agree at step 0), nor one of 4 iterations a run of 2: both refused, not reused
    or continued."""
    def plan(iters, init_from=None):
        made = compare.Plan("vanilla_gan", "tensorflow", False, ["--iters", str(iters), *TINY], tmp_path, "cpu")
        made.init_from = init_from
        return made

    planned_run(plan(4), 4, {"step": 4})
    assert compare.decide(plan(4), reuse=True, overwrite=False) is None
    with pytest.raises(UsageError, match=r"cannot reuse .*other settings \(init_from: None here"):
        compare.decide(plan(4, init_from=tmp_path / "pytorch-fp32"), reuse=True, overwrite=False)
    with pytest.raises(UsageError, match="it trained 4 iterations, --iters asks for 2"):
        compare.decide(plan(2), reuse=True, overwrite=False)


def test_a_report_of_many_common_steps_shows_four_of_them_first_and_last_kept(tmp_path):
    """write_report picks at most four rows of grids by itself (mutation round 10: a default
    of three went unseen; every other test asks matching_steps for its count)."""
    sides = [fake_side(tmp_path, name, range(7), [{"step": 2, "loss": 1.0}]) for name in ("a", "b")]
    for side in sides:
        for step in range(7):
            plt.imsave(side.run.sample_path(step), np.zeros((8, 8)), cmap="gray")
    table = report.write_report(sides, tmp_path / "report", "t", "cmd")
    assert table["sample_steps"] == [0, 2, 4, 6]


def test_a_loss_scale_backed_off_below_one_still_gets_its_panel(tmp_path):
    """A float16 scaler halves its scale on every overflow, below 1 if need be: a run whose
    scale only ever went down is a scaled run too (mutation round 10: "scaled" as a scale
    above 1 went unseen)."""
    backed_off = fake_side(tmp_path, "amp", [0], [{"step": 2, "loss": 1.0, "loss_scale": 0.5}])
    plain = fake_side(tmp_path, "fp32", [0], [{"step": 2, "loss": 1.0, "loss_scale": 1.0}])
    assert report.loss_panels([plain, backed_off]) == ["loss", "loss_scale"]


def test_a_grayscale_grid_is_read_as_three_equal_channels(tmp_path):
    """A grid saved as 8-bit grayscale (a tool's re-save of the run's RGBA PNG) is height x
    width, not height x width x channels: read as RGB, its drift against the same picture in
    colour is 0 (mutation round 10: dropping the grayscale branch of read_grid went unseen)."""
    from PIL import Image

    gray = fake_side(tmp_path, "gray", [0], [{"step": 2, "loss": 1.0}])
    colour = fake_side(tmp_path, "colour", [0], [{"step": 2, "loss": 1.0}])
    pixels = np.tile(np.arange(0, 256, 16, dtype=np.uint8), (16, 1))
    Image.fromarray(pixels, mode="L").save(gray.run.sample_path(0))
    Image.fromarray(np.stack([pixels] * 3, axis=-1), mode="RGB").save(colour.run.sample_path(0))
    grid = report.read_grid(gray, 0)
    assert grid.shape == (16, 16, 3) and np.array_equal(grid, report.read_grid(colour, 0))
    assert report.sample_drift([gray, colour], [0]) == {0: 0.0}


def test_a_dangling_link_of_a_report_files_name_is_the_users_not_replaced(tmp_path):
    """A link to nowhere named report.md does not exist() but would be replaced all the same
    (mutation round 10: leaving out the is_symlink test of files_of_others went unseen)."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "report.md").symlink_to(tmp_path / "elsewhere.md")
    assert report.files_of_others(folder) == ["report.md"]


def test_compare_takes_amp_dtype_auto_without_amp_as_the_scripts_do():
    """--amp-dtype auto is the default, which a float32 run accepts: refused only for a named
    dtype without --amp (mutation round 10: refusing "auto" too went unseen)."""
    args, _ = compare.parse(["--model", "vanilla_gan", "--amp-dtype", "auto"])
    assert args.amp_dtype == "auto"
    with pytest.raises(UsageError, match="--amp-dtype bfloat16 needs --amp"):
        compare.parse(["--model", "vanilla_gan", "--amp-dtype", "bfloat16"])


def test_the_report_makes_no_step_time_ratio_from_a_median_of_zero(tmp_path):
    """An edited summary's median_step_ms of 0 (a number, so read as sound) has no ratio to
    give: the sentence is left out, not a ZeroDivisionError after both runs trained (mutation
    round 10: testing the medians against None alone went unseen)."""
    zero = fake_side(tmp_path, "zero", [0], [{"step": 2, "loss": 1.0}])
    slow = fake_side(tmp_path, "slow", [0], [{"step": 2, "loss": 1.0}])
    zero.summary["median_step_ms"], slow.summary["median_step_ms"] = 0.0, 25.0
    for side in (zero, slow):
        plt.imsave(side.run.sample_path(0), np.zeros((8, 8)), cmap="gray")
    report.write_report([zero, slow], tmp_path / "report", "t", "cmd")
    assert "the step time of" not in (tmp_path / "report" / "report.md").read_text()


def test_the_report_table_prints_a_figure_of_zero_as_zero_not_as_missing():
    """"-" is a figure the run did not record (null); 0 is one it did (mutation round 10:
    printing any false value as "-" went unseen)."""
    row = {"run": "pytorch fp32", "device": "cpu", "steps": 4, "median_step_ms": None, "samples_per_s": 0.0,
           "peak_memory_mb": 0.0, "skipped_steps": 0, "final_losses": {}, "metrics": {}}
    assert report.markdown_table([row]).splitlines()[-1] == "| pytorch fp32 | cpu | 4 | - | 0 | 0 | 0 | - |"


def test_a_side_stopped_by_a_signal_says_whether_it_holds_a_checkpoint_to_go_on_from(tmp_path, monkeypatch):
    """A Ctrl-C while a side's script still imported said "saved a checkpoint" of a run that
    had written nothing. Said once the child has ended: its checkpoint may be the one it saved
    as it stopped."""
    import sys

    from common.errors import Interrupted

    plan = compare.Plan("vanilla_gan", "tensorflow", False, TINY, tmp_path, "cpu")
    checkpoints = plan.folder / "checkpoints"
    checkpoints.mkdir(parents=True)  # as a run makes it as it starts
    for name in ("diverged_step_000002.npz", ".step_000002.npz.tmp-1"):  # no checkpoints to go on from
        (checkpoints / name).write_bytes(b"")
    saves = f"import pathlib, sys; pathlib.Path({str(checkpoints / 'step_000002.npz')!r}).write_bytes(b''); "
    for child, said in (("", "the tensorflow fp32 run stopped before its first checkpoint; --reuse trains it from "
                              "the start"),
                        (saves, "the tensorflow fp32 run holds a checkpoint; --reuse continues it")):
        monkeypatch.setattr(plan, "command", lambda extra, child=child: [
            sys.executable, "-c", f"{child}import sys; sys.exit(130)"])
        with pytest.raises(Interrupted) as stopped:
            compare.train(plan, [])
        assert (str(stopped.value), stopped.value.exit_code) == (f"interrupted: {said}", 130)
    # under --overwrite the checkpoint may be the run it replaces; a checkpoints/ on a disk not
    # mounted is no run to train from the start (--reuse refuses it)
    with pytest.raises(Interrupted) as stopped:
        compare.train(plan, [], starting_over=True)
    assert str(stopped.value) == ("interrupted: the tensorflow fp32 run was being trained again (--overwrite); the "
                                  "same command starts it over")
    shutil.rmtree(checkpoints)
    checkpoints.symlink_to(tmp_path / "unmounted")
    monkeypatch.setattr(plan, "command", lambda extra: [sys.executable, "-c", "import sys; sys.exit(130)"])
    with pytest.raises(Interrupted) as stopped:
        compare.train(plan, [])
    assert str(stopped.value).startswith(f"interrupted: the tensorflow fp32 run: {checkpoints} "), stopped.value


def test_reuse_takes_an_older_runs_init_from_recorded_as_typed_for_the_same_folder(tmp_path, monkeypatch):
    """Runs of an older version recorded --init-from as typed (relative): compared as a path,
    from the folder it was typed in, with --runs now typed absolute; another folder is refused."""
    monkeypatch.chdir(tmp_path)
    plan = compare.Plan("vanilla_gan", "tensorflow", False, ["--iters", "4", *TINY], tmp_path / "runs", "cpu")
    plan.init_from = tmp_path / "runs" / "vanilla_gan" / "pytorch-fp32"
    plan.folder.mkdir(parents=True)
    for typed, reused in (("runs/vanilla_gan/pytorch-fp32", True), ("runs/vanilla_gan/pytorch-amp-bf16", False)):
        (plan.folder / "config.json").write_text(json.dumps({**plan.expected(), "init_from": typed}))
        (plan.folder / "summary.json").write_text(json.dumps({"step": 4}))
        if reused:
            assert compare.decide(plan, reuse=True, overwrite=False) is None  # finished: used as it is
        else:
            with pytest.raises(UsageError, match="other settings \\(init_from: "):
                compare.decide(plan, reuse=True, overwrite=False)
