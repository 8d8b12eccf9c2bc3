"""Quality evaluation end to end: the glue from a trainer's samples to the metrics (on cases
with known answers), --evaluate at the end of training, and scripts/evaluate.py on finished
runs of both frameworks."""
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from common import cpu, evaluation
from common import data as datasets
from common.runs import RunFolder
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
from scripts import evaluate as evaluate_script
from VAE.vanilla_vae import vae_tensorflow


def torch_sees_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


TINY = ["--batch-size", "32", "--data-limit", "256", "--log-every", "2", "--iters", "4"]


class ImagesAsSamples:
    """A stand-in trainer whose 'generator' returns fixed images, whatever z is."""

    z_dim = 3

    def __init__(self, images_uint8):
        self.images = images_uint8.astype(np.float32) / 255.0
        self.calls = 0

    def sample(self, z):
        start = self.calls
        self.calls += len(z)
        return self.images[start:start + len(z)]


def config(**overrides):
    return SimpleNamespace(**{"dataset": "mnist", "image_size": None, "evaluate": 500, "seed": 0,
                              "iwae_k": 4, "eval_draws": 1, "data_limit": None, **overrides})


def test_real_test_images_score_like_themselves():
    test = evaluation.mnist_subset("test", 500)  # the reference set the evaluation draws
    results = evaluation.evaluate(config(), ImagesAsSamples(test), log=lambda *_: None)
    assert results["fid"] < 1e-6
    assert results["precision"] == 1.0 and results["recall"] == 1.0
    assert results["classes_covered"] == 10 and results["class_kl"] < 0.05


def test_one_repeated_digit_covers_one_class_and_scores_badly():
    test = datasets.load_dataset("mnist", split="test", limit=500)
    one_digit = np.repeat(test.x[:1], 500, axis=0)
    results = evaluation.evaluate(config(), ImagesAsSamples(one_digit), log=lambda *_: None)
    assert results["classes_covered"] == 1
    assert results["class_kl"] == pytest.approx(math.log(10))
    assert results["recall"] < 0.05 and results["fid"] > 100


class ImagesPickedByNoise:
    """A stand-in trainer whose 'generator' maps each z to one of a pool of MNIST images: other
    noise, other samples."""

    z_dim = 3

    def __init__(self, pool_uint8):
        self.pool = pool_uint8.astype(np.float32) / 255.0

    def sample(self, z):
        return self.pool[(np.abs(z[:, 0]) * 1e6).astype(np.int64) % len(self.pool)]


def test_eval_draws_add_other_noise_and_keep_the_runs_own_first():
    trainer = ImagesPickedByNoise(datasets.load_dataset("mnist", split="train", limit=2000).x)
    quiet = lambda *_: None
    own = evaluation.evaluate(config(), trainer, log=quiet)
    results = evaluation.evaluate(config(eval_draws=3), trainer, log=quiet)
    draws = results.pop("draws")
    assert results == own  # the figures beside the draws are the run's own draw's
    assert set(draws) == set(own) - {"samples"} and all(len(values) == 3 for values in draws.values())
    for draw, fid in enumerate(draws["fid"]):
        samples = trainer.sample(evaluation.evaluation_noise(500, 3, seed=0, draw=draw))
        assert fid == evaluation.image_metrics(samples)["fid"]
    assert len(set(draws["fid"])) == 3  # three draws of z, three sets of samples
    # draw 0 is the stream every recorded figure was measured on
    assert np.array_equal(evaluation.evaluation_noise(5, 3, seed=7),
                          np.random.default_rng([7, 23]).standard_normal((5, 3)).astype(np.float32))


def test_save_samples_is_handed_the_runs_own_draw_once():
    """--save-samples keeps the samples the recorded figures were measured on: draw 0's, not
    another draw's (under --eval-draws), and only once."""
    trainer = ImagesPickedByNoise(datasets.load_dataset("mnist", split="train", limit=2000).x)
    kept = []
    evaluation.evaluate(config(eval_draws=3), trainer, log=lambda *_: None, keep=kept.append)
    assert len(kept) == 1
    assert np.array_equal(kept[0], trainer.sample(evaluation.evaluation_noise(500, 3, seed=0)))


def test_samples_holding_a_nan_are_not_saved():
    images = datasets.load_dataset("mnist", split="test", limit=20).x.copy()
    trainer = ImagesAsSamples(images)
    trainer.images[3, 10, 10, 0] = np.nan
    kept, said = [], []
    evaluation.evaluate(config(evaluate=20), trainer, log=said.append, keep=kept.append)
    assert kept == [] and said == ["evaluation: the samples hold inf/NaN; no metrics, none saved"]


def test_vae_bounds_equal_the_closed_form_when_the_posterior_is_the_prior():
    # q(z|x) = N(0, I) = p(z), and logits 0 make log p(x|z) = -D log 2 for any x in [0, 1]:
    # every importance weight is -D log 2, so the ELBO and the IWAE bound are exactly that.
    images = np.random.default_rng(0).uniform(0, 1, (7, 28, 28, 1)).astype(np.float32)
    encode = lambda x: (np.zeros((len(x), 5)), np.zeros((len(x), 5)))
    decode_logits = lambda z: np.zeros((len(z), 784), np.float32)
    bounds = evaluation.vae_bounds(encode, decode_logits, images, k=300, seed=0)
    assert bounds["test_elbo"] == pytest.approx(-784 * math.log(2))
    assert bounds["test_iwae_k300"] == pytest.approx(-784 * math.log(2))


def test_vae_bounds_match_the_closed_form_when_the_posterior_is_not_the_prior():
    # q(z|x) = N(1, 0.5^2) in each of d dimensions, p(z) = N(0, I), and logits 0 make
    # log p(x|z) = -D log 2 for any x in [0, 1], whatever z. Then:
    #   ELBO   = -D log 2 - KL(q || p), KL = d/2 (s^2 + m^2 - 1 - log s^2) = d (1/8 + log 2)
    #   log p(x) = log E_p[p(x|z)] = -D log 2, and the IWAE bound lies between the two,
    #   rising towards log p(x) as k grows (Burda et al. 2016).
    # Each log weight is -D log 2 + sum over dimensions of -1/2 - log 2 - eps/2 + 3/8 eps^2
    # (z = 1 + eps/2), of variance d (1/4 + 2 (3/8)^2) = d 17/32: the Monte-Carlo error of the
    # ELBO's mean over n images and k samples is sqrt(d 17/32 / (n k)).
    d, n, pixels = 5, 50, 784
    images = np.random.default_rng(1).uniform(0, 1, (n, 28, 28, 1)).astype(np.float32)
    encode = lambda x: (np.full((len(x), d), 1.0), np.full((len(x), d), math.log(0.25)))
    decode_logits = lambda z: np.zeros((len(z), pixels), np.float32)
    log_px = -pixels * math.log(2)
    elbo = log_px - d * (1 / 8 + math.log(2))
    few = evaluation.vae_bounds(encode, decode_logits, images, k=10, seed=0)
    many = evaluation.vae_bounds(encode, decode_logits, images, k=1000, seed=0)
    assert set(many) == {"test_elbo", "test_iwae_k1000"}
    monte_carlo_error = math.sqrt(d * 17 / 32 / (n * 1000))
    assert many["test_elbo"] == pytest.approx(elbo, abs=4 * monte_carlo_error)
    assert many["test_elbo"] < few["test_iwae_k10"] < many["test_iwae_k1000"] < log_px


def test_vae_bounds_score_each_image_with_its_own_posterior_samples():
    # Images of ones and of zeros; the encoder puts the ones' posterior at z = +3 and the zeros'
    # at -3 (sd 0.1: z never crosses 0), and the decoder predicts ones for z > 0, zeros below,
    # with logits +-30. Each image decoded from its own z scores log p(x|z) = -D softplus(-30),
    # about -7e-11; from another image's z, -D softplus(30) = -23,520 nats. So the ELBO is
    # -D softplus(-30) - KL only if every z is decoded against the image it was drawn for, with
    # KL = 1/2 (0.01 + 9 - 1 - log 0.01) per image (d = 1). Log weights vary by
    # 1/2 eps^2 (1 - 0.01) - 0.3 eps: variance 0.09 + 0.98^2 / 2.
    n, k, pixels = 6, 200, 784
    images = np.zeros((n, 28, 28, 1), np.float32)
    images[::2] = 1.0
    encode = lambda x: (np.where(x.reshape(len(x), -1).mean(axis=1, keepdims=True) > 0.5, 3.0, -3.0),
                        np.full((len(x), 1), math.log(0.01)))
    decode_logits = lambda z: np.repeat(np.where(z > 0, 30.0, -30.0), pixels, axis=1).astype(np.float32)
    kl = 0.5 * (0.01 + 9 - 1 - math.log(0.01))
    elbo = -pixels * math.log1p(math.exp(-30)) - kl
    bounds = evaluation.vae_bounds(encode, decode_logits, images, k=k, seed=0)
    monte_carlo_error = math.sqrt((0.09 + 0.98**2 / 2) / (n * k))
    assert bounds["test_elbo"] == pytest.approx(elbo, abs=4 * monte_carlo_error)


@pytest.mark.parametrize("script", [gan_pytorch, gan_tensorflow], ids=["pytorch", "tensorflow"])
def test_evaluate_flag_measures_at_the_end_of_training(script, tmp_path):
    out = tmp_path / "run"
    summary = script.main(["--out", str(out), *TINY, "--evaluate", "300"])
    saved = json.loads((out / "summary.json").read_text())
    assert saved["metrics"] == pytest.approx(summary["metrics"])
    metrics = saved["metrics"]
    assert set(metrics) == {"samples", "fid", "precision", "recall", "classes_covered", "class_kl"}
    assert metrics["samples"] == 300
    assert metrics["fid"] > 50  # four steps of training are far from digits
    assert 0 <= metrics["precision"] <= 1 and 0 <= metrics["recall"] <= 1


@pytest.mark.parametrize("script", [gan_pytorch, gan_tensorflow], ids=["pytorch", "tensorflow"])
def test_save_samples_writes_the_evaluations_samples_as_uint8_images(script, tmp_path, capsys):
    out = tmp_path / "run"
    summary = script.main(["--out", str(out), *TINY, "--evaluate", "300", "--save-samples", "--seed", "5"])
    assert f"evaluation samples in {out / 'eval_samples.npz'}" in capsys.readouterr().out
    with np.load(out / "eval_samples.npz", allow_pickle=False) as saved:
        assert set(saved.files) == {"samples", "step", "seed"}
        samples, step, seed = saved["samples"], int(saved["step"]), int(saved["seed"])
    assert samples.shape == (300, 28, 28, 1) and samples.dtype == np.uint8
    assert (step, seed) == (4, 5)
    assert len(np.unique(samples)) > 100  # pixels, not a constant
    # the samples the summary's figures came from (to a pixel's rounding to 8 bits)
    rescored = evaluation.image_metrics(samples.astype(np.float32) / 255)
    assert rescored["fid"] == pytest.approx(summary["metrics"]["fid"], rel=1e-3)


def test_save_samples_keeps_2d_points_as_float32(tmp_path):
    folder = RunFolder(tmp_path)
    points = np.random.default_rng(0).standard_normal((50, 2))  # float64, as numpy draws them
    with np.load(folder.write_eval_samples(points, step=7, seed=3), allow_pickle=False) as saved:
        assert saved["samples"].dtype == np.float32 and np.array_equal(saved["samples"], points.astype(np.float32))
        assert (int(saved["step"]), int(saved["seed"])) == (7, 3)
    images = np.array([0.0, 0.4 / 255, 0.6 / 255, 254.6 / 255, 1.0, 1.2, -0.1]).reshape(1, 7, 1, 1)
    with np.load(folder.write_eval_samples(images, step=7, seed=3), allow_pickle=False) as saved:
        assert saved["samples"].ravel().tolist() == [0, 0, 1, 255, 255, 255, 0]  # rounded, clipped


class PointsOnThreeRingModes:
    """A stand-in 2-D 'generator': four samples in five sit exactly on one of the ring's first
    three means, the fifth halfway between two neighbouring means (0.38 from each, where a
    high-quality sample lies within 3 sd = 0.03)."""

    z_dim = 2

    def __init__(self):
        self.calls = 0

    def sample(self, z):
        index = np.arange(self.calls, self.calls + len(z))
        self.calls += len(z)
        means = datasets.RING8_MEANS
        between = 0.5 * (means[0] + means[1])
        return np.where((index % 5 == 4)[:, None], between, means[index % 3]).astype(np.float32)


def test_mixture_figures_judge_2500_samples_against_the_runs_own_mixture():
    quiet = lambda *_: None
    on_the_ring = PointsOnThreeRingModes()
    results = evaluation.evaluate(config(dataset="ring8", evaluate=10000), on_the_ring, log=quiet)
    assert results == {"samples": 2500, "modes_covered": 3, "high_quality": 0.8}
    assert on_the_ring.calls == 2500  # the protocol's count, whatever --evaluate asks
    # the same points judged against the grid of 25: the nearest mean, (0, 0), is 0.92-1 away,
    # where 3 sd is 0.15
    on_the_grid = config(dataset="grid25", evaluate=10000)
    results = evaluation.evaluate(on_the_grid, PointsOnThreeRingModes(), log=quiet)
    assert results == {"samples": 2500, "modes_covered": 0, "high_quality": 0.0}


def test_mixture_runs_report_modes(tmp_path):
    out = tmp_path / "ring"
    gan_pytorch.main(["--out", str(out), *TINY, "--dataset", "ring8", "--evaluate", "10000"])
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert set(metrics) == {"samples", "modes_covered", "high_quality"}
    assert metrics["samples"] == 2500  # the protocol's count
    assert 0 <= metrics["modes_covered"] <= 8 and 0 <= metrics["high_quality"] <= 1


def test_evaluate_script_reopens_a_finished_run_and_keeps_its_figures(tmp_path, capsys, monkeypatch):
    out = tmp_path / "vae"
    vae_tensorflow.main(["--out", str(out), *TINY, "--amp", "--data-limit", "512"])
    before = json.loads((out / "summary.json").read_text())
    assert "metrics" not in before
    settings = (out / "config.json").read_bytes()  # TINY's flags, which evaluate.py does not pass

    monkeypatch.chdir(tmp_path)  # a path relative to where the user is: the reopened run's too
    assert evaluate_script.main(["vae", "--samples", "200", "--iwae-k", "8"]) == 0
    after = json.loads((out / "summary.json").read_text())
    metrics = after.pop("metrics")
    assert after == before  # timing and losses of the training run are kept
    assert {"fid", "test_elbo", "test_iwae_k8"} <= set(metrics)
    assert metrics["test_iwae_k8"] >= metrics["test_elbo"]  # the IWAE bound is the tighter one
    assert -800 < metrics["test_elbo"] < 0  # nats per image, after four steps
    # the training's settings as they were: compare.py --reuse and quality_table.py read them
    assert (out / "config.json").read_bytes() == settings
    printed = capsys.readouterr().out
    assert "test_iwae_k8" in printed and "real-data floor, 200 MNIST training images" in printed


def test_image_metrics_measure_precision_and_recall_with_three_neighbours():
    """k = 3, Kynkaenniemi et al.'s and every figure the README reports: noisy MNIST training
    digits against test digits score 0.97 / 0.64 with 3 neighbours, 1.0 / 0.84 with 5."""
    from common import feature_net, metrics

    reference = evaluation.mnist_subset("test", 100)
    noise = np.random.default_rng(0).normal(0, 0.3, reference.shape).astype(np.float32)
    samples = np.clip(evaluation.mnist_subset("train", 100) + noise, 0, 1)
    measured = evaluation.image_metrics(samples, reference)
    real, fake = (feature_net.features_and_logits(images)[0] for images in (reference, samples))
    three, five = (metrics.precision_recall(real, fake, k=k) for k in (3, 5))
    assert (measured["precision"], measured["recall"]) == (three["precision"], three["recall"])
    assert (three["precision"], three["recall"]) != (five["precision"], five["recall"])


def test_evaluate_script_checks_every_run_before_it_measures_the_first(tmp_path, capsys):
    """A mistyped second folder stops it before the first run's minutes of sampling, not after."""
    out = tmp_path / "gan"
    gan_pytorch.main(["--out", str(out), *TINY])
    before = (out / "summary.json").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        evaluate_script.main([str(out), str(tmp_path / "not_a_run"), "--samples", "200"])
    assert stopped.value.code == 1
    output = capsys.readouterr()
    assert "not_a_run" in output.err and f"{out}:" not in output.out  # nothing measured
    assert (out / "summary.json").read_bytes() == before


def test_evaluate_script_draws_record_each_draw_until_the_next_evaluation(tmp_path, capsys):
    out = tmp_path / "gan"
    gan_pytorch.main(["--out", str(out), *TINY, "--evaluate", "200", "--eval-draws", "2"])
    trained = json.loads((out / "summary.json").read_text())
    assert [values[0] for values in trained["metrics_over_draws"].values()] == \
        [trained["metrics"][name] for name in trained["metrics_over_draws"]]

    assert evaluate_script.main([str(out), "--samples", "200", "--draws", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    over_draws = summary["metrics_over_draws"]
    assert summary["metrics"] == trained["metrics"]  # the run's own draw, measured again
    assert over_draws["fid"][:2] == trained["metrics_over_draws"]["fid"] and len(over_draws["fid"]) == 3
    fids = over_draws["fid"]
    printed = capsys.readouterr().out
    assert "mean (range) over 3 draws: " in printed
    assert f"fid {np.mean(fids):.4g} ({min(fids):.4g}-{max(fids):.4g})" in printed

    assert evaluate_script.main([str(out), "--samples", "200", "--iwae-k", "5"]) == 0
    assert "metrics_over_draws" not in json.loads((out / "summary.json").read_text())  # not this evaluation's
    command = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluate: ")]
    assert len(command) == 1 and "--iwae-k" not in command[0]  # the VAE's alone: a GAN would note it ignored


@pytest.mark.parametrize("script", [gan_pytorch, gan_tensorflow], ids=["pytorch", "tensorflow"])
def test_evaluate_script_measures_a_run_trained_on_a_gpu_on_the_device_it_is_told(script, tmp_path, capfd):
    """A run trained under --amp on a GPU records device cuda and float16 through "auto"; where
    there is no GPU, --device cpu reopens it there, in float16 still (its precision)."""
    out = tmp_path / "run"
    script.main(["--out", str(out), *TINY, "--iters", "2", "--amp", "--amp-dtype", "float16"])
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "amp-fp16"
    on_gpu = {**config, "device": "cuda:0" if script is gan_pytorch else "cuda", "amp_dtype": "auto"}
    (out / "config.json").write_text(json.dumps(on_gpu))

    if not torch_sees_cuda():  # on its own device, where there is none: the script's one line says what to do
        with pytest.raises(SystemExit):
            evaluate_script.main([str(out), "--samples", "100"])
        assert "use --device cpu" in capfd.readouterr().err
    assert evaluate_script.main([str(out), "--samples", "100", "--device", "cpu"]) == 0
    assert "fid" in json.loads((out / "summary.json").read_text())["metrics"]
    assert json.loads((out / "config.json").read_text()) == on_gpu  # where it trained, as it was


def test_evaluate_script_errors_are_one_line(tmp_path, capsys):
    for argv, code, message in [([], 2, "at least one run folder"),
                                ([str(tmp_path)], 1, "not a finished run")]:
        with pytest.raises(SystemExit) as exit_info:
            evaluate_script.main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == code and message in err and "\n" not in err, err


def test_real_data_floor_is_small():
    floor = evaluation.real_data_floor(1000)
    assert 0 < floor["fid"] < 10 and floor["precision"] > 0.7 and floor["classes_covered"] == 10


def test_quality_table_lr_overrides_every_models_learning_rate(tmp_path, capsys):
    """--lr (a former default, say) reaches the runs it trains, and only runs of that --lr are
    tabulated: a run of another learning rate is not taken for one of the default's."""
    from scripts import quality_table

    argv = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "ring8", "--precisions",
            "fp32", "--iters", "4", "--samples", "100", "--runs", str(tmp_path)]
    assert quality_table.main([*argv, "--lr", "1e-3", "--iwae-k", "7"]) == 0
    assert json.loads((tmp_path / "vanilla_gan" / "ring8" / "pytorch-fp32" / "config.json").read_text())["lr"] == 1e-3
    # --iwae-k is the VAE's: a GAN's command goes without it (its script would note it ignored)
    command = [line for line in capsys.readouterr().out.splitlines() if line.startswith("quality_table: ")]
    assert len(command) == 1 and "--iwae-k" not in command[0] and "--lr 0.001" in command[0]
    assert evaluation.iwae_flags("vae", 7) == ["--iwae-k", "7"] and evaluation.iwae_flags("dcgan", 7) == []

    def tabulated(*extra):
        assert quality_table.main([*argv, *extra, "--table-only"]) == 0
        rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"]
        return [row["metrics"]["samples"] for row in rows if row["model"] == "vanilla_gan"]

    assert tabulated("--lr", "1e-3") == [100]
    capsys.readouterr()
    # the run found and why it is left out: the message named --samples alone, not the cause
    folder = tmp_path / "vanilla_gan" / "ring8" / "pytorch-fp32"
    with pytest.raises(SystemExit) as exit_info:
        tabulated()  # the model's default learning rate: no run of it here
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and (f"no runs of these settings measured on --samples 100 under {tmp_path} "
                                          f"({folder}: other settings (lr 0.001, not 0.0001))") in err, err
    with pytest.raises(SystemExit) as exit_info:
        tabulated("--lr", "1e-3", "--samples", "200")  # measured on 100: FID moves with the count
    assert exit_info.value.code == 1 and f"({folder}: measured on 100 samples, not 200)" in capsys.readouterr().err
    (folder / "summary.json").unlink()  # as if still training: the message gave no reason
    with pytest.raises(SystemExit) as exit_info:
        tabulated("--lr", "1e-3")
    assert exit_info.value.code == 1 and f"({folder}: no summary.json (a run not finished)):" in capsys.readouterr().err


def test_quality_table_keeps_each_run_on_one_row_of_its_columns():
    """A precision (config.json) or IWAE metric (summary.json) holding `|` or a line break (an
    edit) opened a column or ended the row."""
    from scripts import quality_table

    row = {"model": "vanilla_vae", "dataset": "mnist", "framework": "pytorch", "precision": "amp|bf16\n",
           "metrics": {"test_iwae_5|x\r\n": -90.0}}
    table = quality_table.markdown([row]).splitlines()
    assert len(table) == 3 and table[0].endswith(r"| IWAE 5\|x | FID vs fp32 |"), table
    assert table[2] == r"| vanilla_vae | mnist | pytorch | amp\|bf16 | - | - | - | - | - | - | - | -90.0 | - |"


def test_quality_table_trains_evaluates_and_reuses(tmp_path, capsys):
    from scripts import quality_table

    argv = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "mnist", "ring8",
            "--iters", "4", "--samples", "100", "--runs", str(tmp_path)]
    assert quality_table.main(argv) == 0
    rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"]
    assert [(r["dataset"], r["precision"]) for r in rows] == [
        ("mnist", "-"), ("mnist", "fp32"), ("mnist", "amp-bf16"), ("ring8", "fp32"), ("ring8", "amp-bf16")]
    assert rows[2]["fid_ratio"] == pytest.approx(rows[2]["metrics"]["fid"] / rows[1]["metrics"]["fid"])
    assert "modes_covered" in rows[3]["metrics"] and rows[4]["metrics"]["samples"] == 100
    assert evaluation.sample_count("ring8", 10_000) == 2500  # the mixture protocol's count
    table = (tmp_path / "quality_table.md").read_text()
    assert table.count("\n") == 2 + len(rows) + 2 and "| vanilla_gan | ring8 | pytorch | amp-bf16 |" in table
    assert table.endswith(f"|\n\nCPU: {cpu.summary()}\n")  # the runs' machine, below the table

    summary = tmp_path / "vanilla_gan" / "mnist" / "pytorch-fp32" / "summary.json"
    before = summary.stat().st_mtime_ns
    capsys.readouterr()
    assert quality_table.main(argv) == 0  # everything reused: nothing trained or measured again
    assert summary.stat().st_mtime_ns == before and "quality_table: " not in capsys.readouterr().out

    # A run killed before its first checkpoint has nothing to resume: it is trained again.
    killed = tmp_path / "vanilla_gan" / "ring8" / "pytorch-amp"
    shutil.rmtree(killed / "checkpoints")
    (killed / "summary.json").unlink()
    assert quality_table.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("quality_table: ") == 1 and f"--out={killed} --dataset ring8" in out and "--overwrite" in out
    assert json.loads((killed / "summary.json").read_text())["step"] == 4

    # --table-only trains nothing: DCGAN, never run here, is left out of the table
    assert quality_table.main([*argv, "--models", "vanilla_gan", "dcgan", "--table-only"]) == 0
    rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"]
    assert len(rows) == 5 and not (tmp_path / "dcgan").exists()
    # a summary short of its config's --iters (an older version's evaluation of a stopped run
    # wrote stopped_early false) is not tabulated as finished
    summary_path = tmp_path / "vanilla_gan" / "ring8" / "pytorch-amp" / "summary.json"
    finished = summary_path.read_text()
    summary_path.write_text(json.dumps({**json.loads(finished), "step": 3, "stopped_early": False}))
    capsys.readouterr()
    assert quality_table.main([*argv, "--table-only"]) == 0
    assert len(json.loads((tmp_path / "quality_table.json").read_text())["rows"]) == 4
    # ...and says so beside the table, which read as complete
    assert f"note: left out of the table: {killed}: stopped at step 3 of 4\n" in capsys.readouterr().out
    summary_path.write_text(finished)

    # A run of other settings (a default changed since it ran) is refused, not reused
    config_path = tmp_path / "vanilla_gan" / "mnist" / "pytorch-fp32" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "batch_size": 32}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        quality_table.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "batch_size 32, not 64" in err and "\n" not in err, err
    # --overwrite would retrain every run of the command, not the one named
    assert err.endswith("; delete its folder to train that run again (--overwrite would retrain every run of "
                        "the command)"), err

    # An unfinished run whose checkpoints were deleted but whose results are there is refused:
    # it was trained again under --overwrite, its results lost
    summary_path.write_text(json.dumps({**json.loads(finished), "step": 3, "stopped_early": True}))
    shutil.rmtree(killed / "checkpoints")
    history = (killed / "history.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        quality_table.main([*argv, "--datasets", "ring8"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "results up to step 3 but no checkpoint" in err and "\n" not in err, err
    assert (killed / "history.jsonl").read_bytes() == history


def test_quality_table_trains_only_the_precisions_asked_for(tmp_path):
    from scripts import quality_table

    argv = ["--models", "lsgan", "--frameworks", "pytorch", "--datasets", "mnist", "--iters", "2",
            "--samples", "50", "--runs", str(tmp_path), "--precisions"]
    assert quality_table.main([*argv, "fp32"]) == 0
    rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"]
    assert [(r["dataset"], r["precision"]) for r in rows] == [("mnist", "-"), ("mnist", "fp32")]
    assert not (tmp_path / "lsgan" / "mnist" / "pytorch-amp").exists()
    fp32 = rows[1]

    # AMP alone, later: its FID is compared with the float32 run measured before
    assert quality_table.main([*argv, "amp"]) == 0
    amp = json.loads((tmp_path / "quality_table.json").read_text())["rows"][1]
    assert (fp32["precision"], amp["precision"]) == ("fp32", "amp-bf16")
    assert amp["fid_ratio"] == pytest.approx(amp["metrics"]["fid"] / fp32["metrics"]["fid"])

    # ... but not with float32's FID on another sample count (FID shrinks as the count grows)
    assert quality_table.main([*argv[:-4], "60", *argv[-3:], "amp"]) == 0
    amp = json.loads((tmp_path / "quality_table.json").read_text())["rows"][1]
    assert amp["metrics"]["samples"] == 60 and "fid_ratio" not in amp


def test_quality_table_seeds_give_each_run_then_means_and_a_ratio_of_means(tmp_path, capsys):
    import statistics

    from scripts import quality_table

    argv = ["--models", "lsgan", "--frameworks", "pytorch", "--datasets", "mnist", "--iters", "2",
            "--samples", "50", "--runs", str(tmp_path), "--seeds", "0", "3"]
    assert quality_table.main(argv) == 0
    rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"][1:]
    assert [(r["precision"], r["seed"]) for r in rows] == [
        ("fp32", 0), ("amp-bf16", 0), ("fp32", 3), ("amp-bf16", 3), ("fp32", None), ("amp-bf16", None)]
    seed3 = tmp_path / "lsgan" / "mnist" / "pytorch-fp32-seed3"
    assert rows[2]["folder"] == str(seed3) and json.loads((seed3 / "config.json").read_text())["seed"] == 3
    assert (tmp_path / "lsgan" / "mnist" / "pytorch-amp").is_dir()  # seed 0 keeps the one-seed layout
    fid = {(r["precision"], r["seed"]): r["metrics"]["fid"] for r in rows}
    assert fid["fp32", 0] != fid["fp32", 3]  # the seed reached the training
    fp32_mean, amp_mean = rows[4], rows[5]
    assert fp32_mean["metrics"]["fid"] == pytest.approx((fid["fp32", 0] + fid["fp32", 3]) / 2)
    assert fp32_mean["spread"]["fid"] == pytest.approx(statistics.stdev([fid["fp32", 0], fid["fp32", 3]]))
    assert amp_mean["fid_ratio"] == pytest.approx(
        (fid["amp-bf16", 0] + fid["amp-bf16", 3]) / (fid["fp32", 0] + fid["fp32", 3]))
    assert rows[3]["fid_ratio"] == pytest.approx(fid["amp-bf16", 3] / fid["fp32", 3])  # each seed's own pair
    table = (tmp_path / "quality_table.md").read_text()
    assert "| seed |" in table and f"| mean of 2 | {fp32_mean['metrics']['fid']:.2f} ± " in table
    classes, spread = fp32_mean["metrics"]["classes_covered"], fp32_mean["spread"]["classes_covered"]
    assert f"| {classes:.1f} ± {spread:.1f} |" in table  # a mean of counts keeps a decimal

    # AMP alone, from the runs there are: each seed against its own float32 run measured before
    assert quality_table.main([*argv, "--precisions", "amp", "--table-only"]) == 0
    amp_rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"][1:]
    assert [r["seed"] for r in amp_rows] == [0, 3, None]
    assert amp_rows[1]["fid_ratio"] == pytest.approx(fid["amp-bf16", 3] / fid["fp32", 3])
    assert amp_rows[2]["fid_ratio"] == pytest.approx(amp_mean["fid_ratio"])

    # A metric that was inf/NaN (null in summary.json) in one seed: its mean is too, in one line
    # of the table (statistics.stdev raised a traceback on it)
    summary = json.loads((seed3 / "summary.json").read_text())
    summary["metrics"]["precision"] = None
    (seed3 / "summary.json").write_text(json.dumps(summary))
    assert quality_table.main([*argv, "--table-only"]) == 0
    fp32_mean = json.loads((tmp_path / "quality_table.json").read_text())["rows"][5]
    assert fp32_mean["seeds"] == [0, 3] and fp32_mean["metrics"]["precision"] is None
    assert fp32_mean["metrics"]["fid"] == pytest.approx((fid["fp32", 0] + fid["fp32", 3]) / 2)
    # Integers near float's largest in both (an edited file): their sum is inf, not an OverflowError
    for folder in (seed3, tmp_path / "lsgan" / "mnist" / "pytorch-fp32"):
        summary = json.loads((folder / "summary.json").read_text())
        summary["metrics"]["recall"] = 10**308
        (folder / "summary.json").write_text(json.dumps(summary))
    assert quality_table.main([*argv, "--table-only"]) == 0
    fp32_mean = json.loads((tmp_path / "quality_table.json").read_text())["rows"][5]
    assert fp32_mean["seeds"] == [0, 3] and fp32_mean["metrics"]["recall"] is None  # inf: null

    # A seed without its float32 run: the means keep to the seeds with both, here one: no mean rows
    shutil.rmtree(seed3)
    assert quality_table.main([*argv, "--table-only"]) == 0
    rows = json.loads((tmp_path / "quality_table.json").read_text())["rows"][1:]
    assert [(r["precision"], r["seed"]) for r in rows] == [("fp32", 0), ("amp-bf16", 0), ("amp-bf16", 3)]

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        quality_table.main([*argv[:-2], "3", "3"])
    err = capsys.readouterr().err.strip()
    assert err == "error: --seeds names 3 more than once: it would be measured and tabled twice", err
    for repeated, named in ((["--frameworks", "pytorch", "pytorch"], "pytorch"),
                            (["--precisions", "fp32", "amp", "fp32"], "fp32"),
                            (["--datasets", "mnist", "mnist"], "mnist")):  # each run twice in the table
        with pytest.raises(SystemExit) as exit_info:
            quality_table.main([*argv, *repeated, "--table-only"])
        err = capsys.readouterr().err.strip()
        said = f"error: {repeated[0]} names {named} more than once: it would be measured and tabled twice"
        assert exit_info.value.code == 2 and err == said, err


def test_quality_table_seed_means_keep_to_the_seeds_measured_in_both_precisions():
    """Float32 seed 2 has no AMP run: counted in float32's mean FID (40, not 15), it would make
    AMP's mean look more than twice as good as float32's over the very seeds the table shows."""
    from scripts import quality_table

    def row(precision, seed, fid):
        return {"model": "lsgan", "dataset": "mnist", "framework": "pytorch", "precision": precision,
                "seed": seed, "metrics": {"fid": fid}}

    rows = [row("fp32", 0, 10.0), row("amp-bf16", 0, 11.0), row("fp32", 1, 20.0), row("amp-bf16", 1, 22.0),
            row("fp32", 2, 90.0)]
    fp32_mean, amp_mean = quality_table.seed_means(rows, {0: 10.0, 1: 20.0, 2: 90.0})
    assert (fp32_mean["precision"], fp32_mean["seeds"]) == ("fp32", [0, 1])
    assert fp32_mean["metrics"]["fid"] == pytest.approx(15.0)
    assert (amp_mean["precision"], amp_mean["seeds"]) == ("amp-bf16", [0, 1])
    assert amp_mean["fid_ratio"] == pytest.approx(16.5 / 15.0)


def write_mnist_files(folder, side, count=64):
    """MNIST-format IDX files (both splits) of `count` random side x side images."""
    from tests.test_data import idx_bytes

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
            idx_bytes(rng.integers(0, 256, (count, side, side), dtype=np.uint8)))
        (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(rng.integers(0, 10, count, dtype=np.uint8)))
    return folder


SMALL = ["--batch-size", "8", "--width", "8", "--iters", "2", "--log-every", "1", "--no-tensorboard"]


@pytest.mark.parametrize("script", [gan_pytorch, gan_tensorflow], ids=["pytorch", "tensorflow"])
def test_evaluate_on_mnist_files_of_another_size_says_no_sample_metric(script, tmp_path, capsys):
    """20x20 MNIST-format images under --data-dir: --dataset mnist without --image-size, and the
    feature net (28x28 only) once ended the run after training with a ValueError traceback."""
    data = write_mnist_files(tmp_path / "data", side=20)
    out = tmp_path / "run"
    summary = script.main(["--out", str(out), "--data-dir", str(data), *SMALL, "--evaluate", "10"])
    assert summary["metrics"] == {"samples": 10}
    assert json.loads((out / "summary.json").read_text())["metrics"] == {"samples": 10}
    assert "no sample metric for --dataset mnist of 20x20x1 images" in capsys.readouterr().out


def test_evaluate_script_reopens_a_run_whose_folder_starts_with_a_dash(tmp_path, capsys, monkeypatch):
    """`evaluate.py ./-weird`: Path("./-weird") prints as "-weird", and `--out -weird` reached
    the run's script as a flag ("argument --out: expected one argument"). The run is of 20x20
    MNIST-format images, which the reopened script measures without a sample metric too."""
    data = write_mnist_files(tmp_path / "data", side=20)
    gan_pytorch.main(["--out", str(tmp_path / "-weird"), "--data-dir", str(data), *SMALL])
    monkeypatch.chdir(tmp_path)
    assert evaluate_script.main(["./-weird", "--samples", "10"]) == 0
    assert json.loads((tmp_path / "-weird" / "summary.json").read_text())["metrics"] == {"samples": 10}
    assert "-weird: samples 10\n" in capsys.readouterr().out


def test_evaluate_script_prints_counts_as_whole_numbers(tmp_path, capsys, monkeypatch):
    """`samples 1e+04` once: every figure went through {:.4g}."""
    monkeypatch.setattr(evaluation, "check_evaluable", lambda folder: None)
    monkeypatch.setattr(evaluation, "evaluate_run", lambda *args: {
        "samples": 10_000, "fid": 12.3456, "precision": 1.0, "classes_covered": 10, "class_kl": 0.01234})
    monkeypatch.setattr(evaluation, "real_data_floor", lambda samples: {"samples": 10_000, "fid": 2.345})
    assert evaluate_script.main([str(tmp_path), "--samples", "10000"]) == 0
    printed = capsys.readouterr().out
    assert f"{tmp_path}: samples 10000, fid 12.35, precision 1, classes_covered 10, class_kl 0.01234\n" in printed
    assert evaluation.figure(25_000.0) == "25000" and evaluation.figure(2500) == "2500"


def test_in_chunks_calls_at_most_a_chunk_at_a_time_and_keeps_the_order():
    """The VAE's bounds decode k x images latents in chunks and reshape the result to (k, images):
    chunks joined in another order score each image against another image's latents."""
    calls = []

    def doubled(x):
        calls.append(len(x))
        return 2 * x

    array = np.arange(2 * evaluation.CHUNK + 7)
    np.testing.assert_array_equal(evaluation.in_chunks(doubled, array), 2 * array)
    assert calls == [evaluation.CHUNK, evaluation.CHUNK, 7]


def test_random_subset_draws_distinct_images_over_the_whole_set_in_their_order():
    """MNIST test's first half is its cleaner writers: the subset is drawn from all of it,
    without repeats (a repeated image counts twice in FID and the bounds), in the set's order,
    the same every call; a set no larger than asked is used whole."""
    images = np.arange(10_000)
    subset = evaluation.random_subset(images, 1000)
    assert len(subset) == 1000 and len(set(subset.tolist())) == 1000
    assert np.all(np.diff(subset) > 0)  # in their order
    assert (subset >= 5000).mean() == pytest.approx(0.5, abs=0.1)  # both halves, not the first 1,000
    np.testing.assert_array_equal(evaluation.random_subset(images, 1000), subset)
    np.testing.assert_array_equal(evaluation.random_subset(images[:50], 100), images[:50])


class VaeOnNumberedImages:
    """A stand-in VAE: samples of no measured size (8x8), and an encoder that records the test
    images it is given (image i holds the value i in every pixel)."""

    z_dim = 2

    def __init__(self):
        self.encoded = []

    def sample(self, z):
        return np.zeros((len(z), 8, 8, 1), np.float32)

    def encode(self, x):
        self.encoded += [int(image.flat[0]) for image in x]
        return np.zeros((len(x), 2)), np.zeros((len(x), 2))

    def decode_logits(self, z):
        return np.zeros((len(z), 64), np.float32)


def test_vae_bounds_score_a_random_draw_of_all_test_images_and_say_when_there_are_fewer(monkeypatch):
    """MNIST's bounds: `--evaluate N` test images drawn from all 10,000 (its first ones alone
    scored 5 nats better); "folder" has no test split: a random N of the images it trained on
    (its first N had been its first classes, and past --data-limit, images never trained on). A
    --data-dir with fewer than asked: the bounds say on how many ("bound_images")."""
    asked, held = [], {"mnist": 10_000, "folder": 30}

    def numbered_images(cfg, count):
        asked.append(count)
        held_here = held[cfg.dataset] if count is None else min(count, held[cfg.dataset])
        return np.arange(held_here, dtype=np.float32)[:, None, None, None] * np.ones((8, 8, 1))

    monkeypatch.setattr(evaluation.datasets, "fixed_test_images", numbered_images)
    said = []
    vae = VaeOnNumberedImages()
    results = evaluation.evaluate(config(evaluate=50, iwae_k=2), vae, log=said.append)
    assert asked == [evaluation.MNIST_TEST_IMAGES] and "bound_images" not in results
    assert vae.encoded == evaluation.random_subset(np.arange(10_000), 50).tolist() != list(range(50))
    assert {"test_elbo", "test_iwae_k2"} <= set(results)
    assert "training images" not in said[-1]

    asked.clear()
    said.clear()
    vae = VaeOnNumberedImages()
    results = evaluation.evaluate(config(dataset="folder", evaluate=50, iwae_k=2), vae, log=said.append)
    assert asked == [None] and results["bound_images"] == 30 and sorted(vae.encoded) == list(range(30))
    # and the line says so: "test_elbo" alone read as a test set's (a fresh-user review)
    assert said[-1].endswith("(bounds on the training images: a folder has no test split)"), said
    asked.clear()
    vae = VaeOnNumberedImages()  # 20 asked of the 30 it trained on: a random 20, not the first
    evaluation.evaluate(config(dataset="folder", evaluate=20, iwae_k=2, data_limit=30), vae, log=said.append)
    assert asked == [30] and vae.encoded == evaluation.random_subset(np.arange(30), 20).tolist() != list(range(20))


def test_samples_holding_a_nan_are_not_measured():
    """One NaN pixel among the samples: no metric, where the feature net would turn it into a
    figure (or an error), and the log says why."""
    images = datasets.load_dataset("mnist", split="test", limit=20).x.copy()
    trainer = ImagesAsSamples(images)
    trainer.images[3, 10, 10, 0] = np.nan
    said = []
    results = evaluation.evaluate(config(evaluate=20), trainer, log=said.append)
    assert results == {"samples": 20, "finite_samples": 0.0}
    assert said == ["evaluation: the samples hold inf/NaN; no metrics"]


def test_evaluate_run_reopens_a_run_as_it_was_trained_with_the_draws_asked_for(tmp_path, monkeypatch):
    """The command that reopens a finished run: its TensorBoard off where it trained without one
    (its metrics would make the events it never had), its device's kind, and --eval-draws for
    any count of draws past one (--draws 2 once measured one)."""
    import subprocess

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model": "vanilla_gan", "framework": "pytorch", "precision": "fp32",
                                                    "device": "cuda:0", "tensorboard": False}))
    (folder / "summary.json").write_text(json.dumps({"step": 4, "metrics": {"samples": 100, "fid": 5.0}}))
    commands = []
    monkeypatch.setattr(evaluation, "check_evaluable", lambda folder: None)
    monkeypatch.setattr(evaluation, "run_child",
                        lambda command, message: commands.append(command) or subprocess.CompletedProcess(command, 0))
    for draws in (1, 2):
        assert evaluation.evaluate_run(folder, 100, None, draws) == {"samples": 100, "fid": 5.0}
    one, two = commands
    for command in commands:
        assert "--no-tensorboard" in command and command[command.index("--device") + 1] == "cuda"
        assert command[command.index("--iters") + 1] == "4" and "--resume" in command
    assert "--eval-draws" not in one and two[two.index("--eval-draws") + 1] == "2"
    assert "--save-samples" not in one + two
    evaluation.evaluate_run(folder, 100, None, save_samples=True)
    assert "--save-samples" in commands[-1]


def measured_quality_run(runs, seed, metrics):
    """A finished float32 ring8 run of vanilla_gan under quality_table.py's settings for `seed`,
    measured with `metrics`, as quality_table.py would find it."""
    from scripts import quality_table

    folder = quality_table.run_folder(runs, "vanilla_gan", "ring8", "pytorch", False, seed)
    folder.mkdir(parents=True)
    settings = quality_table.training_settings("vanilla_gan", "ring8", "pytorch", False,
                                               SimpleNamespace(iters=None, lr=None), seed)
    (folder / "config.json").write_text(json.dumps({**settings, "precision": "fp32"}))
    (folder / "summary.json").write_text(json.dumps({"step": settings["iters"], "metrics": metrics}))
    return folder


def test_quality_table_names_the_seed_of_a_run_of_one_seed_other_than_0(tmp_path, monkeypatch):
    """--seeds 5: the table's rows are seed 5's, not seed 0's, and say so in a seed column."""
    from scripts import quality_table

    monkeypatch.setattr(evaluation, "real_data_floor", lambda samples: {"samples": samples, "fid": 1.0})
    measured_quality_run(tmp_path, 5, {"samples": 10, "modes_covered": 8, "high_quality": 0.9})
    assert quality_table.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "ring8",
                               "--precisions", "fp32", "--seeds", "5", "--samples", "10", "--runs", str(tmp_path),
                               "--table-only"]) == 0
    header, _, _, row = (tmp_path / "quality_table.md").read_text().splitlines()[:4]
    assert "| precision | seed |" in header and row.startswith("| vanilla_gan | ring8 | pytorch | fp32 | 5 |")


def test_quality_table_reuses_a_mixture_run_measured_on_the_protocols_2500_samples(tmp_path, monkeypatch):
    """--samples 10000 measures a 2-D mixture run on the protocol's 2,500: a run measured so is
    measured, not evaluated again at every call."""
    from scripts import quality_table

    monkeypatch.setattr(evaluation, "real_data_floor", lambda samples: {"samples": samples, "fid": 1.0})
    evaluated = []
    monkeypatch.setattr(quality_table, "evaluate_run", lambda *args: evaluated.append(args))
    measured_quality_run(tmp_path, 0, {"samples": 2500, "modes_covered": 8, "high_quality": 0.9})
    assert quality_table.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "ring8",
                               "--precisions", "fp32", "--samples", "10000", "--runs", str(tmp_path)]) == 0
    assert evaluated == []
    (row,) = [row for row in json.loads((tmp_path / "quality_table.json").read_text())["rows"] if "folder" in row]
    assert row["metrics"]["samples"] == 2500


def test_evaluate_script_prints_the_floor_when_any_run_measured_images_not_only_the_last(tmp_path, capsys,
                                                                                       monkeypatch):
    """An MNIST run and then a ring8 run: the MNIST run's FID is read against the floor, which
    is printed even though the last run measured no image."""
    mnist, ring = tmp_path / "mnist", tmp_path / "ring"
    results = {mnist: {"samples": 100, "fid": 12.5}, ring: {"samples": 100, "modes_covered": 8}}
    monkeypatch.setattr(evaluation, "check_evaluable", lambda folder: None)
    monkeypatch.setattr(evaluation, "evaluate_run", lambda folder, *args: dict(results[folder]))
    monkeypatch.setattr(evaluation, "real_data_floor", lambda samples: {"samples": samples, "fid": 2.5})
    assert evaluate_script.main([str(mnist), str(ring), "--samples", "100"]) == 0
    assert "real-data floor, 100 MNIST training images vs as many test images: fid 2.5" in capsys.readouterr().out
    assert evaluate_script.main([str(ring), "--samples", "100"]) == 0
    assert "real-data floor" not in capsys.readouterr().out  # no image measured: no floor


def test_evaluate_notes_run_flags_under_floor_alone_only(tmp_path, monkeypatch, capsys):
    """One flag ignored under --floor is "it", said once; with a run named, the run's evaluation reads
    --draws and --device, and no note says they were ignored."""
    from scripts import evaluate

    monkeypatch.setattr(evaluation, "real_data_floor", lambda samples: {"samples": samples, "fid": 1.0})
    assert evaluate.main(["--floor", "--samples", "10", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("note: --device: a run's evaluation reads it, and --floor names no "
                                              "run: ignored\n")
    assert evaluate.main(["--floor", "--samples", "10", "--iwae-k", "5"]) == 0  # said once, not twice
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")] == [
        "note: --iwae-k: a run's evaluation reads it, and --floor names no run: ignored"]
    monkeypatch.setattr(evaluation, "check_evaluable", lambda folder: None)
    monkeypatch.setattr(evaluation, "evaluate_run", lambda folder, *args, **kwargs: {"fid": 9.0, "samples": 10})
    assert evaluate.main([str(tmp_path / "gan"), "--floor", "--samples", "10", "--draws", "2", "--device", "cpu"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_evaluate_names_the_flags_it_ignored(tmp_path, monkeypatch, capsys):
    """--floor alone took --draws, --device and --save-samples without a word, and GAN runs
    took --iwae-k, whose bound is the VAE's."""
    from scripts import evaluate

    assert evaluate.main(["--floor", "--samples", "10", "--draws", "3", "--save-samples"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: --draws, --save-samples: a run's evaluation reads them, and --floor names no "
                          "run: ignored\n"), out
    measured = {"vae": {"test_elbo": -90.0, "samples": 10}, "gan": {"fid": 9.0, "samples": 10}}
    monkeypatch.setattr(evaluation, "check_evaluable", lambda folder: None)
    monkeypatch.setattr(evaluation, "evaluate_run", lambda folder, *args: dict(measured[Path(folder).name]))
    monkeypatch.setattr(evaluation, "real_data_floor", lambda samples: {"samples": samples, "fid": 1.0})
    for runs, noted in ((["gan"], True), (["gan", "vae"], False)):
        assert evaluate.main([*(str(tmp_path / run) for run in runs), "--samples", "10", "--iwae-k", "5"]) == 0
        said = "note: --iwae-k: the VAE's likelihood bound; none of these runs is a VAE: ignored"
        assert (said in capsys.readouterr().out) == noted



def test_a_quality_table_run_stopped_by_a_signal_says_whether_it_holds_a_checkpoint_to_go_on_from(tmp_path,
                                                                                               monkeypatch, capsys):
    """A Ctrl-C while the model script still imported said "saved a checkpoint" of a run that
    had written nothing (as compare.py's sides did)."""
    from common.errors import Interrupted
    from scripts import quality_table

    folder = tmp_path / "vanilla_gan" / "ring8" / "pytorch-fp32"

    def interrupted_child(command, on_interrupt, **kwargs):  # as run_child says it once the child ended
        raise Interrupted(f"interrupted: {on_interrupt()}")

    monkeypatch.setattr(quality_table, "run_child", interrupted_child)
    argv = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--datasets", "ring8", "--precisions", "fp32",
            "--iters", "4", "--samples", "100", "--runs", str(tmp_path)]
    said = []
    for extra in ([], ["--overwrite"]):
        if extra:  # a checkpoint there may be the run --overwrite replaces
            (folder / "checkpoints").mkdir(parents=True)
            (folder / "checkpoints" / "step_000002.pt").write_bytes(b"")
        with pytest.raises(SystemExit) as stopped:
            quality_table.main([*argv, *extra])
        assert stopped.value.code == 130
        said.append(capsys.readouterr().err.strip())
    assert said == [f"error: interrupted: {folder} stopped before its first checkpoint; the same command trains it "
                    "from the start", f"error: interrupted: {folder} was being trained again (--overwrite); the same "
                    "command starts it over"]
