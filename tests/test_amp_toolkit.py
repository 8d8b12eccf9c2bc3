"""The AMP toolkit: loss-scaler flags reach GradScaler and LossScaleOptimizer, gradient clipping
sees unscaled gradients, AdamW gets the same decay in both frameworks, and the training loop's
monitor records skipped steps, warns about a low loss scale and stops a run whose losses stay
inf/NaN (with a checkpoint)."""
import json
import math
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

from common import loop, models
from common.config import RunConfig, parse_args
from common.distributed import OneProcess
from common.runs import RunFolder

# --- the monitor, driven by a fake session (no framework) ----------------------------------

class ScriptedSession:
    """Plays back per-step metrics chosen by the test: `values(step)` -> dict of floats."""

    precision = "fp32"
    replicas = OneProcess()
    noise_shape = (64, 100)  # its grids are never drawn

    def __init__(self, values, scale=1.0, weights_nonfinite_from=None):
        self.values, self.scale, self.step = values, scale, 0
        self.weights_nonfinite_from = weights_nonfinite_from
        self.saved, self.saved_meta = [], []
        self.checkpoints = self  # saves nothing but the names and metadata
        self.suffix = "npz"

    def start(self, order, start_step, stop_step):
        pass

    def stop_loading(self):
        pass

    def upload_batches(self, batches):
        return list(batches)

    def train_step(self, indices):
        self.step += 1
        return self.values(self.step)

    def fetch(self, metrics):
        return {k: float(v) for k, v in metrics.items()}

    def stop_signal(self, signum):
        return signum

    def loss_scale(self):
        return self.scale

    def synchronize(self):
        pass

    def write_samples(self, run, step):
        pass

    def save(self, path, meta):
        path.write_bytes(b"state")
        self.saved.append(path.name)
        self.saved_meta.append(meta)

    def nonfinite(self):
        gone = self.weights_nonfinite_from is not None and self.step >= self.weights_nonfinite_from
        return "modules/generator/0" if gone else None

    def peak_memory_mb(self):
        return 1.0

    def gpu_name(self):
        return None

    def open_tensorboard(self, folder, purge_step):
        raise AssertionError("scripted runs are made with tensorboard=False")


def run_loop(tmp_path, values, scale=1.0, weights_nonfinite_from=None, **settings):
    settings = {"log_every": 10, "sample_every": 0, "checkpoint_every": 0, **settings}
    cfg = RunConfig(model="fake", framework="none", batch_size=4, tensorboard=False,  # no writer here
                    **settings)
    run = RunFolder(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    messages = []
    session = ScriptedSession(values, scale, weights_nonfinite_from)
    try:
        summary = loop.train(cfg, run, session, num_examples=64, log=messages.append)
    except loop.TrainingDiverged as error:
        summary = error
    return summary, run.read_history(), messages, session


def test_every_skipped_step_is_recorded(tmp_path):
    skipped = {3, 7, 18}
    summary, history, _, _ = run_loop(
        tmp_path, lambda step: {"loss": 1.0, "skipped": float(step in skipped)}, scale=1024.0, iters=20)
    assert [row.get("skipped_at") for row in history] == [[3, 7], [18]]
    assert [row["skipped"] for row in history] == [2, 1]
    assert summary["skipped_steps"] == 3 and "skipped_at" not in summary["final"]


def test_a_checkpoint_between_log_steps_counts_the_skips_since_the_last_row(tmp_path):
    skipped = {3, 12, 14, 17}
    summary, history, _, session = run_loop(
        tmp_path, lambda step: {"loss": 1.0, "skipped": float(step in skipped)}, scale=1024.0,
        iters=20, checkpoint_every=15)
    assert session.saved == ["step_000015.npz", "step_000020.npz"]
    # at step 15 the last row (step 10) has counted one; steps 12 and 14 are still open
    assert [meta["skipped_total"] for meta in session.saved_meta] == [3, 4]
    assert [row["skipped_total"] for row in history] == [1, 4] and summary["skipped_steps"] == 4


def test_a_low_loss_scale_is_warned_about_once(tmp_path):
    _, _, messages, _ = run_loop(tmp_path, lambda step: {"loss": 1.0, "skipped": 0.0}, scale=8.0,
                                 iters=600)
    warnings = [m for m in messages if m.startswith("warning: the loss scale")]
    assert len(warnings) == 1 and "below 16 for 200 steps" in warnings[0]
    # advice --resume takes, the rest as a new run: --resume keeps --lr and the precision
    assert warnings[0].endswith("float16 gradients keep overflowing: --clip-grad-norm N, which --resume takes, or a "
                                "lower --lr or --amp-dtype bfloat16 in a new run (another --out, or --overwrite)")

    _, _, messages, _ = run_loop(tmp_path / "ok", lambda step: {"loss": 1.0, "skipped": 0.0},
                                 scale=32.0, iters=600)
    assert not [m for m in messages if m.startswith("warning")]
    # bfloat16/float32 runs report a scale of 1 but scale nothing: no warning either
    _, _, messages, _ = run_loop(tmp_path / "bf16", lambda step: {"loss": 1.0}, iters=600)
    assert not [m for m in messages if m.startswith("warning")]


def test_losses_that_stay_nonfinite_stop_the_run_with_a_checkpoint(tmp_path):
    values = lambda step: {"loss": math.inf if step >= 30 else 1.0}
    error, history, _, session = run_loop(tmp_path, values, iters=1000, nonfinite_patience=40)
    assert isinstance(error, loop.TrainingDiverged)
    assert "since step 30" in str(error) and "\n" not in str(error)
    assert session.saved == ["diverged_step_000070.npz"]  # not a name --resume would pick
    assert RunFolder(tmp_path / "run").latest_checkpoint() is None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 70 and summary["stopped"] == "losses inf/NaN since step 30"
    assert history[-1]["nonfinite_steps"] == 10


def test_a_divergence_with_no_earlier_checkpoint_says_to_train_again(tmp_path):
    """No good checkpoint to --resume from: the advice is a new run, with what keeps its
    losses finite (float32: no --amp-dtype bfloat16, which it would refuse without --amp)."""
    error, _, _, _ = run_loop(tmp_path, lambda step: {"loss": math.inf if step >= 30 else 1.0}, iters=1000,
                              nonfinite_patience=40)
    assert str(error).endswith("; no earlier checkpoint to resume from: train again (--overwrite) with a lower "
                               "--lr or --clip-grad-norm N"), error


def test_a_divergence_keeps_the_good_checkpoints_and_names_the_last(tmp_path):
    # the weights go NaN at step 30; checkpoints every 5 steps, a patience of 40 steps
    values = lambda step: {"loss": math.nan if step >= 30 else 1.0}
    error, _, messages, session = run_loop(tmp_path, values, weights_nonfinite_from=30, iters=1000,
                                           checkpoint_every=5, nonfinite_patience=40)
    withheld = [m for m in messages if m.startswith("warning: the state at step 30 holds inf/NaN in modules/")]
    assert len(withheld) == 1  # said once, not at every withheld checkpoint
    # no checkpoint of NaN weights pruned the good ones: --resume picks step 25's
    assert session.saved[-3:] == ["step_000020.npz", "step_000025.npz", "diverged_step_000070.npz"]
    assert RunFolder(tmp_path / "run").latest_checkpoint()[0] == 25
    assert "last good checkpoint (step 25)" in str(error)


def test_a_run_that_ends_on_nonfinite_weights_keeps_its_last_state_and_says_so(tmp_path):
    # evaluate.py measures a finished run at its last step, whatever it holds
    values = lambda step: {"loss": math.nan if step >= 30 else 1.0}
    summary, _, messages, session = run_loop(tmp_path, values, weights_nonfinite_from=30, iters=40,
                                             checkpoint_every=5, nonfinite_patience=100)
    assert session.saved[-2:] == ["step_000025.npz", "step_000040.npz"]
    assert summary["step"] == 40 and "stopped" not in summary
    warnings = [m for m in messages if m.startswith("warning: the run ends with its losses inf/NaN")]
    assert len(warnings) == 1  # inf/NaN from step 30 to the last, 40: 11 steps
    assert "since step 30 (11 steps, fewer than --nonfinite-patience 100," in warnings[0]


def test_reopening_a_run_that_ended_on_inf_nan_losses_trains_nothing_and_warns_nothing(tmp_path, monkeypatch):
    """evaluate.py reopens a finished run with --resume at its --iters: the inf/NaN streak its
    last checkpoint records was said by the process that trained it; the reopening trains
    nothing, and says nothing of it."""
    values = lambda step: {"loss": math.nan if step >= 30 else 1.0}
    _, _, messages, session = run_loop(tmp_path, values, iters=40, checkpoint_every=5, nonfinite_patience=100)
    assert len([m for m in messages if m.startswith("warning: the run ends with its losses inf/NaN")]) == 1
    last = session.saved_meta[-1]
    assert (last["step"], last["nonfinite_streak"]) == (40, 11)

    monkeypatch.setattr(ScriptedSession, "restore", lambda self, path, model: dict(last), raising=False)
    cfg = RunConfig(model="fake", framework="none", batch_size=4, tensorboard=False, iters=40, resume=True,
                    log_every=10, sample_every=0, checkpoint_every=0, nonfinite_patience=100)
    reopened, messages = ScriptedSession(values), []
    summary = loop.train(cfg, RunFolder(tmp_path / "run"), reopened, num_examples=64, log=messages.append)
    assert reopened.step == 0 and summary["step"] == 40  # nothing trained
    assert not [m for m in messages if m.startswith("warning")], messages


def test_a_checkpoint_between_log_steps_records_the_inf_nan_streak_up_to_its_step(tmp_path):
    # losses inf/NaN at steps 1-10 and from 13 on; a row every 10 steps, a checkpoint every 5
    values = lambda step: {"loss": math.nan if step <= 10 or step >= 13 else 1.0}
    _, _, _, session = run_loop(tmp_path, values, iters=20, checkpoint_every=5, nonfinite_patience=100)
    assert session.saved == ["step_000005.npz", "step_000010.npz", "step_000015.npz", "step_000020.npz"]
    # at step 15 the last row (step 10) ends a streak of 10; steps 11 and 12, still open, end it
    assert [meta["nonfinite_streak"] for meta in session.saved_meta] == [5, 10, 3, 8]


def test_occasional_nonfinite_losses_do_not_stop_the_run(tmp_path):
    values = lambda step: {"loss": math.nan if step % 10 == 5 else 1.0}
    summary, history, messages, _ = run_loop(tmp_path, values, iters=300, nonfinite_patience=2)
    assert summary["step"] == 300 and "stopped" not in summary
    assert all(row["nonfinite_steps"] == 1 for row in history)
    assert not [m for m in messages if m.startswith("warning")]  # the last steps' losses were finite


def test_the_other_replicas_are_let_go_and_the_summary_written_before_the_evaluation(tmp_path, monkeypatch):
    """The evaluation is the writer's alone: the other replicas waited through it, and one that
    outlasted their wait (10 minutes) ended the run without a summary; one that failed did too."""
    events = []

    class Replicas(OneProcess):
        def wait_for_writer(self):
            events.append("replicas let go")

    def evaluate(session, cfg, keep=None):
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        events.append(f"evaluated after a summary at step {summary['step']}")
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(ScriptedSession, "replicas", Replicas())
    monkeypatch.setattr(ScriptedSession, "evaluate", evaluate, raising=False)
    with pytest.raises(RuntimeError, match="the evaluation failed"):
        run_loop(tmp_path, lambda step: {"loss": 1.0}, iters=20, evaluate=10)
    assert events == ["replicas let go", "evaluated after a summary at step 20"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 20 and "metrics" not in summary  # the training's figures stay


@pytest.mark.parametrize("finite", [True, False])
def test_save_samples_replaces_an_earlier_evaluations_file_or_removes_it(finite, tmp_path, monkeypatch):
    """The file holds this evaluation's samples or, where they held inf/NaN (keep is not
    called), none: an earlier evaluation's would pass for this one's."""
    samples = np.full((10, 28, 28, 1), 0.5, np.float32)

    def evaluate(session, cfg, keep=None):
        if finite:
            keep(samples)
        return {"samples": 10} if finite else {"samples": 10, "finite_samples": 0.0}

    monkeypatch.setattr(ScriptedSession, "evaluate", evaluate, raising=False)
    (tmp_path / "run").mkdir()
    earlier = RunFolder(tmp_path / "run").write_eval_samples(np.zeros((3, 28, 28, 1)), step=5, seed=0)
    _, _, messages, _ = run_loop(tmp_path, lambda step: {"loss": 1.0}, iters=20, evaluate=10, save_samples=True)
    if finite:
        with np.load(earlier, allow_pickle=False) as saved:
            assert int(saved["step"]) == 20 and saved["samples"].shape == (10, 28, 28, 1)
            assert (saved["samples"] == 128).all()  # 0.5 of 255, rounded
        assert f"evaluation samples in {earlier}" in messages
    else:
        assert not earlier.exists()


# --- the options reach the frameworks ------------------------------------------------------

SCALER_FLAGS = ["--amp", "--amp-dtype", "float16", "--init-scale", "1024", "--growth-interval", "7"]


def test_gradscaler_gets_every_scaler_flag():
    from common.pytorch.runtime import setup

    cfg = parse_args("vanilla_gan", "pytorch", [*SCALER_FLAGS, "--growth-factor", "3", "--backoff-factor", "0.25"])
    scaler = setup(cfg, log=lambda *_: None).scaler
    assert scaler.is_enabled()
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (1024.0, 3.0, 0.25, 7)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("steps_before, scales", [
    (2, [1024.0] * 3 + [2048.0] * 4 + [4096.0] * 2),  # 2 + 2 clean steps, then every 4
    (6, [1024.0] * 6 + [2048.0] * 3),                  # 6 clean steps, past 4: grows at the next one
], ids=["count-below", "count-past"])
def test_a_resumed_loss_scale_grows_at_the_commands_growth_interval(framework, steps_before, scales, tmp_path):
    """The scale and its count of clean steps come from the checkpoint, the growth interval
    from the command (PyTorch's load_state_dict brought back the saved one). A count past the
    new interval grows at the next clean step: both libraries grow when the count equals the
    interval, so it would never grow again."""
    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

    script = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}[framework]
    out = str(tmp_path / "run")
    tiny = ["--out", out, "--batch-size", "16", "--data-limit", "64", "--log-every", "1", "--sample-every", "0",
            "--amp", "--amp-dtype", "float16", "--init-scale", "1024", "--no-tensorboard"]
    script.main([*tiny, "--iters", str(steps_before)])  # clean steps of the default interval, 2,000
    script.main([*tiny, "--iters", "9", "--resume", "--growth-interval", "4"])
    rows = [json.loads(line) for line in Path(out, "history.jsonl").read_text().splitlines()]
    assert [row["skipped"] for row in rows] == [0] * 9
    assert [row["loss_scale"] for row in rows] == scales


def test_loss_scale_optimizer_gets_what_keras_supports_and_refuses_the_rest(capsys):
    import keras

    from common.tensorflow.optimizers import make_optimizer
    from common.tensorflow.runtime import setup

    cfg = parse_args("vanilla_gan", "tensorflow", [*SCALER_FLAGS, "--clip-grad-norm", "2.5"])
    runtime = setup(cfg, log=lambda *_: None)
    try:
        optimizer = make_optimizer(cfg, runtime)
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        optimizer.build([keras.Variable([0.0])])
        assert float(optimizer.dynamic_scale) == 1024.0 and optimizer.dynamic_growth_steps == 7
        assert optimizer.inner_optimizer.global_clipnorm == 2.5  # clipped after unscaling
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for flag in (["--growth-factor", "3"], ["--backoff-factor", "0.25"]):
        with pytest.raises(SystemExit) as exit_info:
            from GAN.vanilla_gan import gan_tensorflow
            gan_tensorflow.main([*SCALER_FLAGS, *flag])
        assert exit_info.value.code == 2 and "PyTorch-only" in capsys.readouterr().err


def test_gradient_clipping_sees_unscaled_gradients():
    """The GAN step unscales before it clips, for both networks: clipping the still-scaled
    gradients would leave 0.5 / 1024 once scaler.step() unscales them."""
    import torch

    from common.pytorch.data import load_data
    from common.pytorch.runtime import setup
    from GAN.gan_step_pytorch import GAN
    from GAN.vanilla_gan import gan_pytorch as model

    cfg = parse_args("vanilla_gan", "pytorch", [*SCALER_FLAGS, "--clip-grad-norm", "0.5", "--dataset", "ring8",
                                                "--data-limit", "64", "--batch-size", "16"])
    runtime = setup(cfg, log=lambda *_: None)
    data = load_data(cfg, runtime, model.hparams.PIXEL_RANGE)
    steep = 50.0  # true gradient norms far above 0.5, and no float16 overflow at a scale of 1024
    gan = GAN(model.Generator(data.sample_shape, cfg.width), model.Discriminator(data.sample_shape, cfg.width),
              lambda real, fake: steep * model.discriminator_loss(real, fake),
              lambda fake: steep * model.generator_loss(fake), model.hparams.Z_DIM, cfg, runtime, data)
    before = {name: [p.detach().clone() for p in m.parameters()] for name, m in gan.modules.items()}
    gan.train_step(data.batch(torch.arange(16)))
    assert runtime.scaler.get_scale() == 1024.0  # no overflow: both steps were applied
    for name, module in gan.modules.items():
        norm = torch.sqrt(sum(p.grad.square().sum() for p in module.parameters()))
        assert float(norm) == pytest.approx(0.5, rel=1e-3), name
        assert any(not torch.equal(b, p) for b, p in zip(before[name], module.parameters())), name


@pytest.mark.parametrize("model_name", ["wgan_gp", "vanilla_vae"])
def test_the_steps_of_their_own_unscale_before_they_clip(model_name):
    """WGAN-GP's and the VAE's steps (not the shared GAN step above) unscale before they clip:
    clipping the still-scaled gradients to 1e-3 would leave 1e-3 / 1024 once scaler.step()
    unscales them. The critic's gradients are those of its last of five updates."""
    import torch

    from common.pytorch.data import load_data
    from common.pytorch.runtime import setup
    from GAN.wgan_gp import wgan_gp_pytorch
    from VAE.vanilla_vae import vae_pytorch

    clip = 1e-3  # under the true gradient norms of both models' networks at their initialisation
    flags = [*SCALER_FLAGS, "--clip-grad-norm", str(clip), "--data-limit", "64"]
    if model_name == "wgan_gp":
        cfg = parse_args(model_name, "pytorch", [*flags, "--dataset", "ring8", "--width", "2", "--batch-size", "20"])
        runtime = setup(cfg, log=lambda *_: None)
        data = load_data(cfg, runtime, wgan_gp_pytorch.hparams.PIXEL_RANGE)
        networks = wgan_gp_pytorch.build_networks(data.sample_shape, cfg.width)
        trainer = wgan_gp_pytorch.WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
        clipped_together = [[name] for name in trainer.modules]  # each network its own optimizer
    else:
        cfg = parse_args(model_name, "pytorch", [*flags, "--width", "16", "--batch-size", "16"])
        runtime = setup(cfg, log=lambda *_: None)
        data = load_data(cfg, runtime, vae_pytorch.hparams.PIXEL_RANGE)
        networks = vae_pytorch.build_networks(data.sample_shape, cfg.width)
        trainer = vae_pytorch.VAE(networks["encoder"], networks["decoder"], cfg, runtime)
        clipped_together = [list(trainer.modules)]  # one optimizer, one norm over both
    before = {name: [p.detach().clone() for p in m.parameters()] for name, m in trainer.modules.items()}
    trainer.train_step(data.batch(torch.arange(cfg.batch_size)))
    assert runtime.scaler.get_scale() == 1024.0  # no overflow: every update was applied
    for names in clipped_together:
        grads = [p.grad for name in names for p in trainer.modules[name].parameters()]
        assert float(torch.sqrt(sum(g.square().sum() for g in grads))) == pytest.approx(clip, rel=1e-3), names
    for name, module in trainer.modules.items():
        assert any(not torch.equal(b, p) for b, p in zip(before[name], module.parameters())), name


def test_adamw_decay_is_the_same_in_both_frameworks():
    import keras
    import torch

    from common.pytorch import optimizers as torch_optimizers
    from common.tensorflow import optimizers as keras_optimizers
    from common.tensorflow.runtime import setup

    flags = ["--optimizer", "adamw", "--weight-decay", "0.05", "--lr", "0.002", "--beta1", "0.3", "--beta2", "0.9",
             "--clip-grad-norm", "0.5"]
    torch_cfg = parse_args("vanilla_gan", "pytorch", flags)
    weights = [torch.zeros(1, requires_grad=True)]
    group = torch_optimizers.make_optimizer(torch_cfg, weights).param_groups[0]
    tf_cfg = parse_args("vanilla_gan", "tensorflow", flags)
    keras_optimizer = keras_optimizers.make_optimizer(tf_cfg, setup(tf_cfg, log=lambda *_: None))
    assert isinstance(keras_optimizer, keras.optimizers.AdamW)
    assert (group["weight_decay"], group["eps"], group["lr"], group["betas"]) == (0.05, 1e-8, 0.002, (0.3, 0.9))
    assert (keras_optimizer.weight_decay, keras_optimizer.epsilon) == (0.05, 1e-8)
    assert float(keras_optimizer.learning_rate) == pytest.approx(0.002)
    # AdamW takes the flags Adam takes: its betas, and --clip-grad-norm (PyTorch clips in the step)
    assert (keras_optimizer.beta_1, keras_optimizer.beta_2, keras_optimizer.global_clipnorm) == (0.3, 0.9, 0.5)


def test_adam_gets_the_same_betas_and_epsilon_in_both_frameworks():
    """Adam, the default, as the AdamW test above: Adam's first step is the gradient's sign
    whatever its betas and epsilon, so the one-step twins test let Keras' Adam take beta1 for
    beta2, or Keras' epsilon (1e-7 for PyTorch's 1e-8), unseen."""
    import keras
    import torch

    from common.pytorch import optimizers as torch_optimizers
    from common.tensorflow import optimizers as keras_optimizers
    from common.tensorflow.runtime import setup

    flags = ["--lr", "0.002", "--beta1", "0.3", "--beta2", "0.9"]
    group = torch_optimizers.make_optimizer(parse_args("vanilla_gan", "pytorch", flags),
                                            [torch.zeros(1, requires_grad=True)]).param_groups[0]
    tf_cfg = parse_args("vanilla_gan", "tensorflow", flags)
    keras_optimizer = keras_optimizers.make_optimizer(tf_cfg, setup(tf_cfg, log=lambda *_: None))
    assert isinstance(keras_optimizer, keras.optimizers.Adam)
    assert (group["betas"], group["eps"]) == ((0.3, 0.9), 1e-8)
    assert (keras_optimizer.beta_1, keras_optimizer.beta_2, keras_optimizer.epsilon) == (0.3, 0.9, 1e-8)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_the_multi_tensor_optimizer_steps_exactly_as_the_per_parameter_one(optimizer):
    """make_optimizer's `foreach` update must not change a single bit of training: every
    measured run in the README was trained with PyTorch's per-parameter CPU default."""
    import torch

    from common.pytorch import optimizers as torch_optimizers

    flags = ["--optimizer", optimizer, "--lr", "0.003"] + (["--weight-decay", "0.05"] if optimizer == "adamw" else [])
    cfg = parse_args("vanilla_gan", "pytorch", flags)
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in [(64, 32, 4, 4), (32,), (10, 7)]]
    gradients = [[torch.randn(w.shape, generator=generator) for w in start] for _ in range(30)]

    def train(make):
        weights = [w.clone().requires_grad_() for w in start]
        opt = make(weights)
        for step in gradients:
            for w, g in zip(weights, step):
                w.grad = g.clone()
            opt.step()
        return opt, [w.detach() for w in weights]

    ours, trained = train(lambda weights: torch_optimizers.make_optimizer(cfg, weights))
    reference_class = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    same = {k: ours.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    _, expected = train(lambda weights: reference_class(weights, **same, foreach=False))
    assert ours.defaults["foreach"] is True and type(ours) is reference_class
    assert not torch.equal(trained[0], start[0])
    for got, want in zip(trained, expected):
        assert torch.equal(got, want)


# --- the precision report -------------------------------------------------------------------

TINY = ["--batch-size", "16", "--data-limit", "64", "--log-every", "2", "--iters", "2"]


def report_rows(text):
    lines = text[text.index("precision report"):].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("  "):
            break
        layer, weights, output = line.split()[0], line.split()[-2], line.split()[-1]
        rows[layer] = (weights, output)
    return rows


def test_precision_report_shows_what_ran_in_16_bits_pytorch(tmp_path, capsys):
    import torch

    from GAN.vanilla_gan import gan_pytorch

    reported = gan_pytorch.main(["--out", str(tmp_path / "a"), *TINY, "--amp", "--precision-report"])
    printed = capsys.readouterr().out
    rows = report_rows(printed)
    # D runs on the real batch, the fake one and for G's loss: one row per layer all the same
    # (mutation round 8: report_rows' dict hid the repeated rows of a dropped dedup)
    assert printed.count("  discriminator.out.layer ") == 1
    assert rows["generator.hidden.0"] == ("float32", "bfloat16")    # autocast's matmul
    assert rows["generator.out.layer"] == ("float32", "float32")    # FullPrecision output layer
    assert rows["discriminator.hidden.2"] == ("-", "bfloat16")
    assert rows["discriminator.out.layer"] == ("float32", "float32")
    # leaf layers only: a container's output is its last leaf's (mutation round 8: the
    # containers' rows, reported when the children check was dropped, went unseen)
    assert not {"generator", "generator.hidden", "generator.out", "discriminator.out"} & rows.keys()

    # The report's probe step is undone: the run trains exactly as without it, also when it
    # probes a resumed run, whose optimizer already holds moments the probe step would move,
    # and the average of G (on by default) has not moved either.
    plain = gan_pytorch.main(["--out", str(tmp_path / "b"), *TINY, "--amp"])
    assert plain["final"] == reported["final"]
    averages = [torch.load(RunFolder(tmp_path / run).latest_checkpoint()[1], weights_only=True)["averages"]
                for run in ("a", "b")]
    assert averages[0]["generator"]["updates"] == averages[1]["generator"]["updates"] == 2
    for name, tensor in averages[1]["generator"]["module"].items():
        assert torch.equal(averages[0]["generator"]["module"][name], tensor), name
    longer = [*TINY, "--amp", "--iters", "4", "--resume"]
    reported = gan_pytorch.main(["--out", str(tmp_path / "a"), *longer, "--precision-report"])
    plain = gan_pytorch.main(["--out", str(tmp_path / "b"), *longer])
    assert plain["final"] == reported["final"]


def test_precision_report_leaves_the_float16_loss_scale_as_it_was_pytorch(tmp_path):
    """Under float16 the probe step's scaler.update() counts a clean step too: the report puts
    the scaler back, so the scale grows at the same steps as without the report. (Mutation round
    8: the scaler's state left as the probe step made it went unseen; the test above runs
    bfloat16, whose scaler is off.)"""
    from GAN.vanilla_gan import gan_pytorch

    flags = [*TINY, "--iters", "4", "--log-every", "1", "--amp", "--amp-dtype", "float16", "--init-scale", "8",
             "--growth-interval", "2", "--no-tensorboard"]
    scales = []
    for run, report in (("a", ["--precision-report"]), ("b", [])):
        gan_pytorch.main(["--out", str(tmp_path / run), *flags, *report])
        scales.append([row["loss_scale"] for row in RunFolder(tmp_path / run).read_history()])
    assert scales[0] == scales[1] == [8.0, 16.0, 16.0, 32.0]


@pytest.mark.parametrize("amp, dtype", [(True, "bfloat16"), (False, "float32")])
def test_sample_grids_and_evaluation_run_under_the_runs_precision_pytorch(amp, dtype, tmp_path, monkeypatch):
    """The session runs inference (grids at step 0 and the end, --evaluate's samples) under the
    autocast of the training step; its hidden layer shows which precision ran."""
    from GAN import gan_step_pytorch
    from GAN.vanilla_gan import gan_pytorch

    seen = []
    original = gan_step_pytorch.GAN.generate

    def spy(self, z):
        seen.append(str(self.generator.hidden(z).dtype).replace("torch.", ""))
        return original(self, z)

    monkeypatch.setattr(gan_step_pytorch.GAN, "generate", spy)
    gan_pytorch.main(["--out", str(tmp_path / "run"), *TINY, "--evaluate", "100", *(["--amp"] if amp else [])])
    assert len(seen) == 3 and set(seen) == {dtype}  # step 0, the last step, the evaluation


def test_precision_report_shows_what_ran_in_16_bits_tensorflow(tmp_path, capsys):
    import keras

    from GAN.vanilla_gan import gan_tensorflow

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gan_tensorflow.main(["--out", str(tmp_path / "a"), *TINY, "--amp", "--precision-report"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Keras warned, with its own file's path, when the probe got a tensor for its list of inputs
    assert not [w for w in caught if "structure of `inputs`" in str(w.message)]
    rows = report_rows(capsys.readouterr().out)
    *hidden, output = [r for name, r in rows.items() if name.startswith("generator.dense")]
    assert len(hidden) == 3 and set(hidden) == {("float32", "bfloat16")} and output == ("float32", "float32")
    assert all(weights in ("float32", "-") for weights, _ in rows.values())
    # G's samples leave it in float32, as the PyTorch twin's: the reshape after the float32
    # layers took the policy's bfloat16 and rounded them
    generator_rows = [r for name, r in rows.items() if name.startswith("generator.")]
    assert generator_rows[-1] == ("-", "float32")


def test_tensorflow_precision_report_leaves_the_networks_as_they_were():
    """The probe runs on zeros in inference mode: in training mode batch norm moved its running
    statistics toward the zeros' (DCGAN's), changing the networks the run then trains and
    samples with. The vanilla GAN above has no batch norm, so a probe in training mode went
    unseen."""
    from types import SimpleNamespace

    import numpy as np

    from common.tensorflow.precision_report import precision_report
    from GAN.dcgan import dcgan_tensorflow

    networks = dcgan_tensorflow.build_networks((28, 28, 1), 8)
    before = {name: [w.numpy() for w in network.weights] for name, network in networks.items()}
    kinds = [kind for _, kind, _, _ in precision_report(SimpleNamespace(modules=networks))]
    assert "BatchNormalization" in kinds
    for name, network in networks.items():
        assert len(network.weights) == len(before[name]), name
        for saved, weight in zip(before[name], network.weights):
            np.testing.assert_array_equal(saved, weight.numpy(), err_msg=f"{name}: {weight.path}")


# --- scripts/benchmark.py -------------------------------------------------------------------

class FakeScripts:
    """Stands in for the model scripts benchmark.py runs: records each command and writes the
    run folder's summary.json and config.json, with the step time `step_ms(command, call)`."""

    def __init__(self, monkeypatch, step_ms=lambda command, call: 10.0, device="cpu"):
        self.commands, self.step_ms, self.real_run, self.device = [], step_ms, subprocess.run, device
        self.environments = []  # each command's env=
        monkeypatch.setattr(subprocess, "run", self)

    def __call__(self, command, **kwargs):
        if "--out" not in command:  # not a model script: platform.platform() asking uname
            return self.real_run(command, **kwargs)
        self.commands.append(command)
        self.environments.append(kwargs.get("env"))
        out = Path(kwargs.get("cwd") or ".") / command[command.index("--out") + 1]  # where the script would write
        out.mkdir(parents=True, exist_ok=True)
        step_ms = self.step_ms(command, len(self.commands))
        (out / "summary.json").write_text(json.dumps({
            "median_step_ms": step_ms, "samples_per_s": 1000 / step_ms, "peak_memory_mb": 1.0, "skipped_steps": 0,
            "gpu": "NVIDIA H100 80GB HBM3" if self.device.startswith("cuda") else None}))
        precision = {"bfloat16": "amp-bf16", "float16": "amp-fp16"}.get(
            command[command.index("--amp-dtype") + 1] if "--amp-dtype" in command else None, "fp32")
        tf32 = command[command.index("--tf32") + 1] if "--tf32" in command else "auto"
        script = next(part for part in command if part.endswith(".py"))
        model, framework = next((model.key, framework) for model in models.MODELS.values()
                                for framework in models.FRAMEWORKS if str(model.script(framework)) == script)
        (out / "config.json").write_text(json.dumps({"model": model, "framework": framework, "precision": precision,
                                                     "device": self.device, "tf32": tf32}))
        return subprocess.CompletedProcess(command, 0, "", "")


def test_benchmark_writes_the_table_with_the_speedup(tmp_path, capsys, monkeypatch):
    from common import cpu
    from scripts import benchmark

    # two runs each, round robin: fp32 takes 10 then 12 ms/step, AMP 20 then 16
    scripts = FakeScripts(monkeypatch, lambda command, call: {1: 10.0, 2: 20.0, 3: 12.0, 4: 16.0}[call])
    assert benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--iters", "8",
                           "--log-every", "2", "--out", str(tmp_path), "--data-limit", "128",
                           "--batch-size", "32", "--repeat", "2"]) == 0
    assert [line.split()[3] for line in capsys.readouterr().out.splitlines()
            if line.startswith("benchmark: ")] == ["fp32", "amp-bf16"] * 2
    assert all(command[-4:] == ["--data-limit", "128", "--batch-size", "32"] for command in scripts.commands)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    fp32, amp = report["rows"]
    assert (fp32["precision"], amp["precision"]) == ("fp32", "amp-bf16")
    # the median of 2 runs is the slower one; both are kept
    assert (fp32["step_ms_runs"], amp["step_ms_runs"]) == ([10.0, 12.0], [16.0, 20.0])
    assert (fp32["median_step_ms"], amp["median_step_ms"]) == (12.0, 20.0)
    assert amp["speedup"] == pytest.approx(12.0 / 20.0) and "speedup" not in fp32
    assert report["machine"]["flags"] == ["--data-limit", "128", "--batch-size", "32"]
    assert report["machine"]["cpu"] == cpu.describe()  # model name, cores, avx512_bf16, amx_bf16
    table = (tmp_path / "benchmark.md").read_text()
    assert table.startswith(f"CPU: {cpu.summary()}; flags: --data-limit 128 --batch-size 32\n")
    assert "| 20.00 (16.00-20.00) |" in table and "| 0.60x |" in table and table.count("\n|") == 4

    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--iters", "3", "--log-every", "2"])
    assert exit_info.value.code == 2 and "two --log-every intervals" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # the model scripts' bounds (common/config.py), before any configuration runs: 65 ran them all
    (["--workers", "65"], "--workers: must be from 0 to 64, got 65"),
    (["--workers", "-1"], "--workers: must be from 0 to 64, got -1"),
    (["--replicas", "1"], "--replicas: must be 0 (off) or from 2 to 64, got 1"),
    (["--replicas", "-2"], "--replicas: must be 0 (off) or from 2 to 64, got -2"),
    (["--replicas", "100000000000000000000"], "--replicas: must be 0 (off) or from 2 to 64"),
    (["--repeat", "0"], "--repeat: must be from 1 to 100, got 0"),
    (["--iters", "100000000000000000000"], "--iters: must be from 2 to 1,000,000"),
    (["--log-every", "0"], "--log-every: must be from 1 to 1,000,000, got 0"),
    # a configuration twice: its two runs were tabled as one of --repeat 2, with a range
    (["--frameworks", "pytorch", "pytorch"], "--frameworks names pytorch more than once: it would be measured"),
    (["--precisions", "fp32", "amp-bf16", "fp32"], "--precisions names fp32 more than once"),
])
def test_benchmark_bounds_its_counts_before_running_anything(argv, message, tmp_path, capsys, monkeypatch):
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32",
                        "--iters", "4", "--log-every", "2", "--out", str(tmp_path / "bench"), *argv])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message in err and "\n" not in err, err
    assert scripts.commands == []


@pytest.mark.parametrize("flags, message, code", [
    (["--batch-sise", "16"], "error: unrecognized arguments: --batch-sise 16 (see --help)", 2),
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0", 2),
    (["--amp"], "error: --amp is set for each configuration by the benchmark; use --precisions", 2),
    (["--amp-d", "float16"], "error: --amp-dtype (typed --amp-d) is set for each configuration by the benchmark", 2),
    (["--xla"], "error: --xla is set for each configuration by the benchmark; use --compiled", 2),
    # its own work measured with the steps' (482 MB against 400), its table thrown away
    (["--profile"], "error: --profile would add its own work to the measurements (the peak memory, and the steps "
                    "--profile traces): use it on a model script", 2),
    (["--precision-rep"], "error: --precision-report (typed --precision-rep) would add its own work", 2),
    # a prefix of other flags too: the script's parser says so, not "--distribute (typed --d)"
    (["--d", "cpu"], "error: ambiguous option: --d could match --d", 2),
])
def test_benchmark_checks_the_flags_it_hands_on_before_running_anything(flags, message, code, tmp_path, capsys,
                                                                         monkeypatch):
    """A typo failed every configuration in turn, and the empty table replaced the last one; an
    --amp among them made the row named fp32 measure AMP (the script takes a flag's last value)."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    (tmp_path / "benchmark.md").write_text("the last benchmark\n")
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32", "amp-bf16",
                        "--iters", "4", "--log-every", "2", "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == code and err.count("\n") == 1 and message in err, err
    assert scripts.commands == [] and (tmp_path / "benchmark.md").read_text() == "the last benchmark\n"


def test_benchmark_refuses_pytorch_rows_on_cuda_without_a_gpu_before_running_anything(tmp_path, capsys,
                                                                                      monkeypatch):
    """Each PyTorch row started its process, loaded its data and failed in turn, one line each."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    monkeypatch.setattr(benchmark, "torch_sees_a_gpu", lambda: False)  # a GPU machine too
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32", "amp-bf16",
                        "--iters", "4", "--log-every", "2", "--out", str(tmp_path), "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == ("error: vanilla_gan pytorch fp32 refused: --device cuda, but "
                                                 "PyTorch sees no CUDA GPU; use --device cpu\n"), err
    assert scripts.commands == []


def test_benchmark_leaves_tensorflow_rows_on_cuda_to_tensorflow(tmp_path, monkeypatch):
    """PyTorch's view of the GPUs (its CPU build sees none) does not speak for TensorFlow: its
    rows on --device cuda run, and TensorFlow answers for its own GPUs there."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch, device="cuda")
    monkeypatch.setattr(benchmark, "torch_sees_a_gpu", lambda: False)
    assert benchmark.main(["--models", "vanilla_gan", "--frameworks", "tensorflow", "--precisions", "fp32",
                           "--iters", "4", "--log-every", "2", "--out", str(tmp_path), "--device", "cuda"]) == 0
    assert len(scripts.commands) == 1 and "cuda" in scripts.commands[0]


def test_benchmark_measures_the_others_when_a_script_refuses_one_configuration(tmp_path, capsys, monkeypatch):
    """--compiled with WGAN-GP (no double backward in torch.compile): the up-front check refused
    the whole benchmark; that configuration alone is refused, before anything runs."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "wgan_gp", "--frameworks", "pytorch", "--precisions", "fp32",
                        "--compiled", "--iters", "4", "--log-every", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 1 and len(err) == 2, err
    assert err[0].startswith("error: wgan_gp pytorch fp32 torch.compile refused: --compile: torch.compile cannot ")
    assert [(command[1].split("/")[-1], "--compile" in command) for command in scripts.commands] == [
        ("gan_pytorch.py", False), ("gan_pytorch.py", True), ("wgan_gp_pytorch.py", False)]
    assert len(json.loads((tmp_path / "benchmark.json").read_text())["rows"]) == 3


def test_benchmark_refuses_a_torchrun_row_whose_batch_does_not_divide_before_running_anything(
        tmp_path, capsys, monkeypatch):
    """PyTorch's replica rows run under torchrun, whose scripts check the batch only once started:
    the row failed after the others were measured, under torchrun's banner line (a fresh-user
    review). Now it is refused up front, as TensorFlow's mirrored row is."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--precisions", "fp32", "--replicas", "3", "--batch-size", "10",
                        "--iters", "4", "--log-every", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 1
    for framework in ("pytorch", "tensorflow"):
        assert (f"error: vanilla_gan {framework} fp32 x3 refused: --batch-size 10 does not divide among 3 replicas: "
                "use a multiple of 3") in "\n".join(err), err
    assert not any("torch.distributed.run" in command for command in scripts.commands)


def test_benchmark_names_a_failed_torchrun_rows_own_error_not_torchruns_banner(tmp_path, capsys, monkeypatch):
    from scripts import benchmark

    banner = "============================================================"
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, "", f"error: data directory /nowhere does not exist\n{banner}\nRoot Cause (first observed "
                        f"failure):\n{banner}\n"))
    with pytest.raises(SystemExit):
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32", "--replicas",
                        "2", "--iters", "4", "--log-every", "2", "--out", str(tmp_path)])
    assert "error: vanilla_gan pytorch fp32 x2 failed (exit 1): data directory /nowhere does not exist" in \
        capsys.readouterr().err


def test_benchmark_whose_configurations_all_fail_keeps_the_last_table(tmp_path, capsys, monkeypatch):
    from scripts import benchmark

    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, "", "error: data directory /nowhere does not exist; check the path\n"))
    (tmp_path / "benchmark.md").write_text("the last benchmark\n")
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32", "amp-bf16",
                        "--iters", "4", "--log-every", "2", "--out", str(tmp_path)])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: all 2 configurations failed (above); nothing "
                                                        f"written to {tmp_path}")
    assert (tmp_path / "benchmark.md").read_text() == "the last benchmark\n"
    assert not (tmp_path / "benchmark.json").exists()


def test_benchmark_gives_the_speedup_when_fp32_is_listed_last(tmp_path, monkeypatch):
    """--precisions amp-bf16 fp32: the AMP row is measured before its baseline, and once showed
    "-" for its speedup."""
    from scripts import benchmark

    FakeScripts(monkeypatch, lambda command, call: 5.0 if "--amp" in command else 10.0)
    assert benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "amp-bf16",
                           "fp32", "--iters", "8", "--log-every", "2", "--out", str(tmp_path)]) == 0
    amp, fp32 = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert (amp["precision"], fp32["precision"]) == ("amp-bf16", "fp32")
    assert amp["speedup"] == pytest.approx(2.0) and "speedup" not in fp32
    table = (tmp_path / "benchmark.md").read_text()
    assert "| vanilla_gan | pytorch | amp-bf16 |" in table and "| 2.00x |" in table


@pytest.mark.parametrize("failing", ["compiled fp32", "fp32 in round 2"])
def test_benchmark_goes_on_past_a_failed_configuration_and_says_so_at_the_end(failing, tmp_path, capsys,
                                                                             monkeypatch):
    """PyTorch 2.11 cannot compile DCGAN's float32 step on CUDA: the other rows still come. A
    configuration that fails in a later round keeps the runs it made (here the baseline)."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch, lambda command, call: 10.0 if "--compile" not in command else 5.0)
    fake_run, calls = scripts.__call__, []

    def failing_run(command, **kwargs):
        calls.append(command)
        compiled_fp32 = "--compile" in command and "--amp" not in command
        eager_fp32_again = "--compile" not in command and "--amp" not in command and len(calls) > 4
        if compiled_fp32 if failing == "compiled fp32" else eager_fp32_again:
            return subprocess.CompletedProcess(command, 1, "", "error: torch.compile failed in PyTorch 2.11.0\n")
        return fake_run(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--iters", "8", "--log-every", "2",
                        "--compiled", "--repeat", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1
    ran = [line.split(maxsplit=1)[1].split(" (load")[0] for line in out.splitlines()
           if line.startswith("benchmark: ")]
    every = ["vanilla_gan pytorch fp32", "vanilla_gan pytorch fp32 torch.compile", "vanilla_gan pytorch amp-bf16",
             "vanilla_gan pytorch amp-bf16 torch.compile"]
    failed = every[1] if failing == "compiled fp32" else every[0]
    again = every if failing == "fp32 in round 2" else [name for name in every if name != failed]
    assert ran == every + again  # a configuration that failed is not run again
    failure = f"{failed} failed (exit 1): torch.compile failed in PyTorch 2.11.0"  # the script's line, once
    assert err.splitlines() == [f"error: {failure}", "error: 1 of 4 configurations failed (above); the others are "
                                f"in {tmp_path / 'benchmark.md'}"]
    report = json.loads((tmp_path / "benchmark.json").read_text())
    rows = [(row["precision"], row["compiler"], row.get("speedup"), row["step_ms_runs"]) for row in report["rows"]]
    if failing == "compiled fp32":
        assert rows == [("fp32", "-", None, [10.0, 10.0]), ("amp-bf16", "-", 1.0, [10.0, 10.0]),
                        ("amp-bf16", "torch.compile", 2.0, [5.0, 5.0])]
    else:  # the baseline's one run still gives the others their speedup
        assert rows == [("fp32", "-", None, [10.0]), ("fp32", "torch.compile", 2.0, [5.0, 5.0]),
                        ("amp-bf16", "-", 1.0, [10.0, 10.0]), ("amp-bf16", "torch.compile", 2.0, [5.0, 5.0])]
    assert report["failed"] == [{"configuration": failed, "error": failure}]
    assert (tmp_path / "benchmark.md").read_text().endswith(f"\n\nFailed: {failure}\n")


def test_benchmark_runs_where_the_user_is(tmp_path, capsys, monkeypatch):
    """A relative --out means the same folder to benchmark.py and to the scripts it runs (they
    once ran in the checkout: a run there of the same name was replaced)."""
    from scripts import benchmark

    FakeScripts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32",
                           "--iters", "8", "--log-every", "2", "--out", "bench"]) == 0
    assert (tmp_path / "bench" / "vanilla_gan" / "pytorch-fp32" / "summary.json").is_file()
    assert json.loads((tmp_path / "bench" / "benchmark.json").read_text())["rows"][0]["median_step_ms"] == 10.0


def test_benchmark_gpu_rows_name_tf32_and_fp32_is_ieee_float32(tmp_path, monkeypatch):
    """On a GPU, float32 is measured with TensorFloat-32 off (fp32, the baseline) and on
    (fp32-tf32), and the AMP rows with it off: they differ from fp32 by autocast alone."""
    from common import cpu
    from scripts import benchmark

    step_ms = {"fp32": 40.0, "fp32-tf32": 20.0, "amp-fp16": 10.0}
    scripts = FakeScripts(monkeypatch, lambda command, call: list(step_ms.values())[call - 1], device="cuda:0")
    assert benchmark.main(["--models", "dcgan", "--frameworks", "pytorch", "--precisions", *step_ms,
                           "--iters", "8", "--log-every", "2", "--out", str(tmp_path)]) == 0
    assert [command[command.index("--tf32") + 1] for command in scripts.commands] == ["off", "on", "off"]
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    # each row named by its configuration: config.json records fp32-tf32 as fp32 (on a CPU, with
    # TF32 "-", the two rows looked the same)
    assert [(row["precision"], row["tf32"]) for row in rows] == [("fp32", "off"), ("fp32-tf32", "on"),
                                                                 ("amp-fp16", "off")]
    assert [row.get("speedup") for row in rows] == [None, pytest.approx(2.0), pytest.approx(4.0)]
    table = (tmp_path / "benchmark.md").read_text()
    assert "| dcgan | pytorch | fp32-tf32 | on | - |" in table
    assert table.startswith(f"CPU: {cpu.summary()}; GPU: NVIDIA H100 80GB HBM3; flags: -\n")  # the GPU's name, once


def test_benchmark_paper_dcgan_preset_runs_dcgan_at_64x64_width_64_and_flags_after_it_win(tmp_path, monkeypatch):
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    assert benchmark.main(["--preset", "paper-dcgan", "--frameworks", "pytorch", "--precisions", "fp32",
                           "--batch-size", "16", "--out", str(tmp_path)]) == 0
    (command,) = scripts.commands
    assert command[1].endswith("dcgan_pytorch.py")
    flags = command[command.index("--workers") + 2:]
    assert flags == ["--image-size", "64", "--width", "64", "--batch-size", "64", "--batch-size", "16"]
    assert command[command.index("--iters") + 1] == "40" and command[command.index("--log-every") + 1] == "10"
    from common.config import parse_args

    cfg = parse_args("dcgan", "pytorch", flags)  # the script reads the last --batch-size
    assert (cfg.image_size, cfg.width, cfg.batch_size) == (64, 64, 16)
    assert json.loads((tmp_path / "benchmark.json").read_text())["machine"]["preset"] == "paper-dcgan"


def test_benchmark_compiled_and_host_loader_rows_compare_with_eager_resident_fp32(tmp_path, monkeypatch):
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch, lambda command, call: 10.0 * call)
    assert benchmark.main(["--models", "vanilla_gan", "--frameworks", "tensorflow", "--precisions", "fp32",
                           "--compiled", "--workers", "2", "--iters", "8", "--log-every", "2",
                           "--out", str(tmp_path), "--data-limit", "128", "--batch-size", "32"]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [(row["compiler"], row["data"]) for row in rows] == [
        ("-", "resident"), ("-", "2 workers"), ("XLA", "resident"), ("XLA", "2 workers")]
    for row in rows[1:]:
        assert row["speedup"] == pytest.approx(rows[0]["median_step_ms"] / row["median_step_ms"])
    # each row ran its own script with its flags, in a folder of its own
    assert [("--xla" in command, command[command.index("--workers") + 1]) for command in scripts.commands] == [
        (False, "0"), (False, "2"), (True, "0"), (True, "2")]
    assert scripts.commands[-1][scripts.commands[-1].index("--out") + 1].endswith(
        "vanilla_gan/tensorflow-fp32-compiled-workers2")


def test_benchmark_gives_replica_rows_a_scaling_and_no_speedup_over_one_replica(tmp_path, monkeypatch):
    """A row of two replicas is read against its one-replica row ("scaling"); a speedup over
    the one-replica float32 row would mix what AMP buys with what the second replica does."""
    from scripts import benchmark

    FakeScripts(monkeypatch, lambda command, call: 5.0 if "--amp" in command else 10.0)
    assert benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32", "amp-bf16",
                           "--replicas", "2", "--iters", "4", "--log-every", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [(row["precision"], row["replicas"], row.get("speedup"), row.get("scaling")) for row in rows] == [
        ("fp32", 1, None, None), ("fp32", 2, None, pytest.approx(0.5)),
        ("amp-bf16", 1, pytest.approx(2.0), None), ("amp-bf16", 2, None, pytest.approx(0.5))]


def test_benchmark_gives_sync_bn_to_the_replica_rows_only(tmp_path, monkeypatch):
    """--replicas 2 --sync-bn handed the flag to the one-replica rows too, which both scripts
    refuse (nothing to synchronise): every one of them failed."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    assert benchmark.main(["--models", "dcgan", "--frameworks", "tensorflow", "--precisions", "fp32",
                           "--replicas", "2", "--sync-bn", "--iters", "4", "--log-every", "2",
                           "--out", str(tmp_path)]) == 0
    assert [("--sync-bn" in command, command[command.index("--replicas") + 1] if "--replicas" in command else "1")
            for command in scripts.commands] == [(False, "1"), (True, "2")]


def test_benchmark_interrupted_in_a_configuration_marks_its_run_for_the_next_benchmark(tmp_path, capsys,
                                                                                     monkeypatch):
    """Ctrl-C while a configuration trains: its script saves and exits 130, the benchmark stops
    in one line, and the run it leaves is marked as the benchmark's, so that the next
    benchmark replaces it instead of refusing it as a run of the user's."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    fake_run = scripts.__call__

    def interrupted(command, **kwargs):
        result = fake_run(command, **kwargs)  # the run folder as the script leaves it
        if "--out" not in command:
            return result
        return subprocess.CompletedProcess(command, 130, "", "error: interrupted\n")

    monkeypatch.setattr(subprocess, "run", interrupted)
    argv = ["--models", "vanilla_gan", "--frameworks", "pytorch", "--precisions", "fp32", "--iters", "4",
            "--log-every", "2", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == ("error: interrupted: the benchmark stopped at vanilla_gan pytorch "
                                               "fp32; no table was written")
    run = tmp_path / "vanilla_gan" / "pytorch-fp32"
    assert json.loads((run / "config.json").read_text())["benchmark"] is True
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert benchmark.main(argv) == 0  # the next benchmark replaces it


def test_benchmark_measures_no_xla_row_of_replicas_which_the_scripts_refuse(tmp_path, capsys, monkeypatch):
    """--compiled --replicas 2 in TensorFlow: XLA under --distribute is refused by the script,
    so the benchmark plans no such row (a failure at the end, exit 1, for a row never possible);
    PyTorch's compiled row of replicas is measured."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    assert benchmark.main(["--models", "vanilla_gan", "--precisions", "fp32", "--compiled", "--replicas", "2",
                           "--iters", "4", "--log-every", "2", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [(row["framework"], row["compiler"], row["replicas"]) for row in rows] == [
        ("pytorch", "-", 1), ("pytorch", "-", 2), ("pytorch", "torch.compile", 1), ("pytorch", "torch.compile", 2),
        ("tensorflow", "-", 1), ("tensorflow", "-", 2), ("tensorflow", "XLA", 1)]
    assert len(scripts.commands) == 7


def test_benchmark_replica_rows_run_torchrun_and_mirrored_and_give_the_scaling(tmp_path, capsys):
    """The real scripts, in processes of their own, one and two replicas in each framework."""
    from scripts import benchmark

    assert benchmark.main(["--models", "vanilla_gan", "--precisions", "fp32", "--replicas", "2", "--iters", "4",
                           "--log-every", "2", "--out", str(tmp_path), "--data-limit", "128",
                           "--batch-size", "32"]) == 0
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [(row["framework"], row["replicas"]) for row in rows] == [
        ("pytorch", 1), ("pytorch", 2), ("tensorflow", 1), ("tensorflow", 2)]
    for alone, together in (rows[:2], rows[2:]):
        assert together["scaling"] == pytest.approx(together["samples_per_s"] / (2 * alone["samples_per_s"]))
        assert "scaling" not in alone
    for row in rows:  # what the scripts measured
        assert row["median_step_ms"] > 0 and row["peak_memory_mb"] > 0 and row["device"] == "cpu"
    folder = tmp_path / "vanilla_gan"
    for framework in ("pytorch", "tensorflow"):  # each really ran on two replicas
        assert json.loads((folder / f"{framework}-fp32-replicas2" / "config.json").read_text())["replicas"] == 2
        assert json.loads((folder / f"{framework}-fp32-replicas1" / "config.json").read_text())["replicas"] == 1
    assert "vanilla_gan tensorflow fp32 x2" in capsys.readouterr().out


def test_benchmark_runs_every_row_one_thread_per_replica_only_under_replicas(tmp_path, monkeypatch):
    """Under --replicas both rows, one replica and N, run one thread per process (PyTorch's
    OMP_NUM_THREADS, TensorFlow's intra-op pool), so "scaling" compares like with like: with
    all cores each, N processes fought over them and the scaling read far below 100%. Without
    --replicas the scripts keep the threads they would have."""
    from scripts import benchmark

    for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
        monkeypatch.delenv(name, raising=False)
    scripts = FakeScripts(monkeypatch)
    common = ["--models", "vanilla_gan", "--precisions", "fp32", "--iters", "4", "--log-every", "2"]
    assert benchmark.main([*common, "--replicas", "2", "--out", str(tmp_path / "replicas")]) == 0
    assert len(scripts.commands) == 4  # each framework, one replica and two
    for command, env in zip(scripts.commands, scripts.environments):
        assert env["OMP_NUM_THREADS"] == "1" and env["TF_NUM_INTRAOP_THREADS"] == "1", command
        assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is handed on
    scripts.commands.clear()
    scripts.environments.clear()
    assert benchmark.main([*common, "--out", str(tmp_path / "alone")]) == 0
    assert len(scripts.environments) == 2
    for env in scripts.environments:
        assert env is None or ("OMP_NUM_THREADS" not in env and "TF_NUM_INTRAOP_THREADS" not in env)


def test_xla_compiles_the_tensorflow_step_and_is_refused_by_pytorch(tmp_path, capsys, monkeypatch):
    import keras

    from common.tensorflow import session
    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
    from VAE.vanilla_vae import vae_tensorflow

    compiled = []

    class Spy(session.Session):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            compiled.append(self._step._jit_compile)

    monkeypatch.setattr(session, "Session", Spy)
    try:
        gan = gan_tensorflow.main(["--out", str(tmp_path / "gan"), *TINY, "--amp", "--xla",
                                   "--iters", "16", "--profile"])
        vae = vae_tensorflow.main(["--out", str(tmp_path / "vae"), *TINY, "--xla"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert compiled == [True, True]  # the step really went to XLA
    assert all(math.isfinite(v) for v in (gan["final"]["d_loss"], vae["final"]["loss"]))
    assert json.loads((tmp_path / "gan" / "config.json").read_text())["xla"] is True
    # The profile's table counts the compiled step's HLO instructions, not TensorFlow ops.
    rows = (tmp_path / "gan" / "profile" / "top_ops.txt").read_text().splitlines()[2:]
    # (which instruction leads, and its name, depend on the CPU and on XLA's fusions)
    assert len(rows) >= 3 and all(row.startswith("  XLA ") for row in rows), rows
    with pytest.raises(SystemExit) as exit_info:
        gan_pytorch.main(["--out", str(tmp_path / "pt"), *TINY, "--xla"])
    assert exit_info.value.code == 2 and "--xla is TensorFlow's" in capsys.readouterr().err


def test_compile_trains_like_eager_and_keeps_checkpoints_portable(tmp_path, capsys, monkeypatch):
    import torch
    import torch._dynamo

    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

    compiled = []
    original = torch.nn.Module.compile

    def spy(module, *args, **kwargs):
        compiled.append((type(module).__name__, kwargs))
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    flags = [*TINY, "--iters", "4", "--sample-every", "2", "--precision-report"]
    fast = gan_pytorch.main(["--out", str(tmp_path / "compiled"), *flags, "--compile"])
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    fast_report = report_rows(capsys.readouterr().out)
    eager = gan_pytorch.main(["--out", str(tmp_path / "eager"), *flags])
    assert [kwargs for _, kwargs in compiled] == [{"dynamic": False}] * 2  # G and D
    assert graphs >= 2  # the training step really ran compiled graphs
    for key in ("d_loss", "g_loss"):  # inductor reorders float sums: equal, not bit-equal
        assert fast["final"][key] == pytest.approx(eager["final"][key], rel=1e-4)
    # The precision report ran eagerly (a compiled graph hides the layers): every layer listed.
    # G: 3 x (Linear, LeakyReLU) and its output layer; D: Flatten, 2 x (Linear, LeakyReLU), its output
    assert fast_report == report_rows(capsys.readouterr().out) and len(fast_report) == 13
    # Checkpoints keep the plain state_dict keys: an eager --resume reads them.
    resumed = gan_pytorch.main(["--out", str(tmp_path / "compiled"), *TINY, "--iters", "6", "--resume"])
    assert resumed["step"] == 6
    with pytest.raises(SystemExit) as exit_info:
        gan_tensorflow.main(["--out", str(tmp_path / "tf"), *TINY, "--compile"])
    assert exit_info.value.code == 2 and "--compile is PyTorch's" in capsys.readouterr().err


def load_as(path: Path, source: str) -> dict:
    """Functions whose frames carry `path` as their file, like the module there would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    namespace = {}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("raised_in, compiling, one_line", [
    ("generated", True, True),   # inductor's generated code under --compile: one line
    ("generated", False, False),  # not torch.compile's doing without --compile: the traceback
    ("model", True, False),       # the model's own code, called through Dynamo's frame: the traceback
    ("generated, TORCHINDUCTOR_CACHE_DIR", True, True),  # a cache folder of another name
])
def test_an_error_of_torch_compiles_own_is_one_line_and_the_models_keeps_its_traceback(
        raised_in, compiling, one_line, tmp_path, capsys, monkeypatch):
    """PyTorch 2.11's inductor fails DCGAN's float32 step on CUDA (tests/test_cuda.py); here
    stand-ins raise at the first step from files named like inductor's generated code, or
    from the model's code through a file named like Dynamo's."""
    import torch

    from common.pytorch import session
    from GAN.vanilla_gan import gan_pytorch

    cache = tmp_path / "torchinductor_user"
    if raised_in == "generated, TORCHINDUCTOR_CACHE_DIR":
        cache = tmp_path / "compiled graphs"
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    generated = load_as(cache / "xp" / "cxp.py",
                        "def call(args):\n    raise AssertionError('expected size 64==64, stride 49==1 at dim=1')\n")
    dynamo = load_as(tmp_path / "torch" / "_dynamo" / "eval_frame.py", "def _fn(f, *args):\n    return f(*args)\n")
    model = load_as(tmp_path / "model.py", "def forward(x):\n    raise AssertionError('the model: bad shape')\n")
    step = generated["call"] if raised_in.startswith("generated") else model["forward"]
    monkeypatch.setattr(session.Session, "train_on", lambda self, batch: dynamo["_fn"](step, batch))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, *args, **kwargs: None)  # the stand-in compiles
    argv = ["--out", str(tmp_path / "run"), *TINY, *(["--compile"] if compiling else [])]
    if not one_line:
        with pytest.raises(AssertionError):
            gan_pytorch.main(argv)
        return
    with pytest.raises(SystemExit) as exit_info:
        gan_pytorch.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: torch.compile failed in PyTorch ")
    assert "(AssertionError: expected size 64==64, stride 49==1 at dim=1); train without --compile" in err


# --- --workers: the host loader --------------------------------------------------------------

@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_host_loader_trains_on_the_same_batches_as_the_resident_data(framework, tmp_path):
    import keras

    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

    script = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}[framework]
    flags = ["--batch-size", "16", "--data-limit", "64", "--log-every", "1", "--iters", "9",
             "--sample-every", "0"]  # 9 steps cross two epoch boundaries
    try:
        resident = script.main(["--out", str(tmp_path / "resident"), *flags])
        loaded = script.main(["--out", str(tmp_path / "loaded"), *flags, "--workers", "2"])
        resumed_flags = [*flags, "--workers", "2", "--checkpoint-every", "4"]
        script.main(["--out", str(tmp_path / "resumed"), *resumed_flags, "--iters", "5"])
        resumed = script.main(["--out", str(tmp_path / "resumed"), *resumed_flags, "--resume"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    history = lambda name: RunFolder(tmp_path / name).read_history()
    assert history("loaded") and [(r["d_loss"], r["g_loss"]) for r in history("loaded")] == [
        (r["d_loss"], r["g_loss"]) for r in history("resident")]
    assert loaded["final"] == resident["final"] == resumed["final"]


def test_tensorflow_host_loader_lists_the_batches_a_pipeline_at_a_time(monkeypatch):
    """Pipelines of 4 steps from step 3: the batches are BatchOrder's across both kinds of
    boundary, and starting a run of a million steps lists only the first pipeline's (one list
    for the whole run took 4,557 MB at --iters 3,000,000)."""
    import numpy as np

    from common import data as datasets
    from common.runs import BatchOrder
    from common.tensorflow.data import HostLoader

    dataset = datasets.load_dataset("mnist", limit=40)
    loader = HostLoader(dataset, (-1.0, 1.0), workers=2)
    monkeypatch.setattr(HostLoader, "steps_per_pipeline", 4)
    order = BatchOrder(len(dataset.x), batch_size=8, seed=3)  # 5 steps an epoch
    loader.start(order, 3, 14)
    loaded = [batch.numpy() for batch in loader.iterator]
    expected = [loader.batch(indices).numpy() for indices in order.batches(3, 14)]
    assert len(loaded) == 11 and all(np.array_equal(a, b) for a, b in zip(loaded, expected))

    listed = []

    def batches(first, last):
        listed.append(last - first)
        return BatchOrder.batches(order, first, last)

    monkeypatch.setattr(order, "batches", batches)
    loader.start(order, 0, 1_000_000)
    for _ in range(6):
        next(loader.iterator)
    assert listed == [4, 4]
    loader.stop()


# --- scripts/bf16_rounding.py: how each framework rounds its bfloat16 results ---------------

def test_rounding_tells_rounding_to_nearest_from_dropping_the_low_bits():
    import numpy as np

    from scripts import bf16_rounding

    pairs, exact = bf16_rounding.sample_pairs(20_000)
    assert np.array_equal(bf16_rounding.to_bfloat16(pairs), pairs)  # inputs exact in bfloat16
    exact32 = exact.astype(np.float32)
    nearest = bf16_rounding.rounding(bf16_rounding.to_bfloat16(exact32), exact)
    truncated = bf16_rounding.rounding((exact32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32), exact)
    assert nearest["verdict"] == "to nearest" and abs(nearest["toward_sign"]) < 1e-4
    assert truncated["verdict"] == "toward zero" and truncated["error"] > 1.8 * nearest["error"]
    assert bf16_rounding.rounding(exact, exact)["verdict"] == "exact"
    # ties go to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7
    assert bf16_rounding.to_bfloat16(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)).tolist() == [1.0, 1 + 2**-6]


def test_bf16_rounding_script_measures_both_frameworks_casts_as_rounded_to_nearest(capsys):
    from scripts import bf16_rounding

    assert bf16_rounding.main(["--count", "5000", "--batch", "2"]) == 0
    ops_table, layers_table = capsys.readouterr().out.split("Whole layers")
    rows = [line.split(" | ") for line in ops_table.splitlines() if line.startswith(("| pytorch", "| tensorflow"))]
    ops = {(row[0].strip("| "), row[1]): row[-1].strip(" |") for row in rows}
    assert len(ops) == 11 and set(ops.values()) <= {"to nearest", "toward zero", "biased"}
    # every framework's float32 -> bfloat16 cast rounds to nearest, on every CPU
    cast = "cast (float32 sum -> bfloat16)"
    assert ops[("pytorch", cast)] == ops[("tensorflow", cast)] == "to nearest"
    layers = [line for line in layers_table.splitlines() if line.startswith(("| pytorch", "| tensorflow"))]
    assert "layer (batch 2)" in layers_table and len(layers) == 3 * 3  # PyTorch eager, TensorFlow eager and XLA
    for flags, message in ((["--count", "10"], "--count: must be from 1,000 to 100,000,000, got 10"),
                           (["--batch", "0"], "--batch: must be from 1 to 16,384, got 0"),
                           (["--frameworks", "pytorch", "pytorch"], "--frameworks names pytorch more than once")):
        with pytest.raises(SystemExit) as exit_info:
            bf16_rounding.main(flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_every_op_of_the_rounding_table_rounds_its_result_to_bfloat16(framework):
    """Each row of the ops table measures a bfloat16 result: its error is bfloat16's (~1e-3 of
    the result's size), never float32's (~1e-8). A row computed in float32 (autocast off for
    "matmul under autocast") would read "to nearest" all the same, and claim a rounding
    nothing did."""
    from scripts import bf16_rounding

    rows = bf16_rounding.measure(framework, *bf16_rounding.sample_pairs(5000))
    assert len(rows) == (5 if framework == "pytorch" else 6)
    if framework == "pytorch":
        assert rows[-1]["op"] == "matmul under autocast"
    for row in rows:
        assert 1e-4 < row["error"] < 1e-2, row


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_layer_errors_are_counted_in_single_roundings_of_each_products_exact_value(framework):
    import numpy as np

    from scripts import bf16_rounding

    exact = np.random.default_rng(1).standard_normal((2, 5000))
    assert bf16_rounding.in_roundings(bf16_rounding.to_bfloat16(exact.astype(np.float32)), exact) == 1.0
    # a sum of two partial sums, each rounded to bfloat16 before the sum is rounded again
    halves = bf16_rounding.to_bfloat16(exact.astype(np.float32))
    assert bf16_rounding.in_roundings(bf16_rounding.to_bfloat16(halves.sum(0)), exact.sum(0)) > 1.2

    float32 = bf16_rounding.measure_layers(framework, "float32", batch=3)
    bfloat16 = bf16_rounding.measure_layers(framework, "bfloat16", batch=3)
    assert len(float32) == len(bfloat16) == 3 * (1 if framework == "pytorch" else 2)
    for row in float32:  # each product matched with its own float64 value, in its own layout
        assert all(row[product] < 0.01 for product in bf16_rounding.PRODUCTS), row
    for row in bfloat16:  # no bfloat16 result errs less than the exact value rounded once
        assert all(row[product] > 0.99 for product in bf16_rounding.PRODUCTS), row


# --- scripts/amp_gradients.py: each framework's AMP gradients against its own float32 ones --

@pytest.mark.parametrize("model, width", [("vanilla_gan", 8), ("dcgan", 4)])
def test_amp_gradients_measures_each_framework_against_its_own_float32(model, width, capsys):
    import torch

    from common import models
    from scripts import amp_gradients

    result = amp_gradients.main(["--model", model, "--width", str(width), "--batch-size", "8", "--batches", "2"])
    torch_script = models.get(model).module("pytorch")
    torch.manual_seed(0)
    expected = [(network, name) for network, module in torch_script.build_networks((1, 28, 28), width).items()
                for name, _ in module.named_parameters()]
    assert sorted((row["network"], row["name"]) for row in result["weights"]) == sorted(expected)
    # the same weights, ported: float32 agrees to its rounding (2.9e-7 and 4.4e-6 measured, Zen 4)
    assert result["float32_gap"] < 1e-4
    for row in result["weights"]:  # bfloat16 really ran in both, and errs by its ~3 significant digits
        assert 1e-5 < row["pytorch"] < 0.5 and 1e-5 < row["tensorflow"] < 0.5, row
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith(("| discriminator |", "| generator |"))]
    assert len(rows) == len(expected) + 2  # every weight, then each network's as a whole


def test_amp_gradients_stops_when_the_twins_weights_do_not_pair_up(monkeypatch):
    from scripts import amp_gradients

    monkeypatch.setattr(amp_gradients, "torch_to_keras", lambda *args: None)  # each twin keeps its own init
    with pytest.raises(RuntimeError, match="do not pair up"):
        amp_gradients.measure("vanilla_gan", 8, batch_size=8, batches=1)


def test_amp_gradients_refuses_bad_flags_in_one_line(capsys):
    from scripts import amp_gradients

    with pytest.raises(SystemExit) as exit_info:
        amp_gradients.main(["--batch-size", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "--batch-size: must be from 2 to 60,000" in err and "\n" not in err, err
    with pytest.raises(SystemExit) as exit_info:  # an alias is the model, as in the other scripts
        amp_gradients.main(["--model", "gan", "--batch-size", "1"])
    assert exit_info.value.code == 2 and "--batch-size: must be from 2 to 60,000" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        amp_gradients.main(["--model", "vae"])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_an_amp_gradient_gone_nan_is_an_infinite_error_not_the_mark_of_a_zero_gradient(monkeypatch):
    """ "-" marks a float32 gradient of 0, where there is no error to measure; an AMP gradient
    that overflowed to NaN is infinitely wrong, and its network's error with it."""
    import numpy as np

    from scripts import amp_gradients

    measured = amp_gradients.pytorch_gradients

    def one_nan_under_amp(*args, amp):
        gradients = measured(*args, amp=amp)
        if amp:
            gradients[0] = np.full_like(gradients[0], np.nan)  # D's first weight
        return gradients

    monkeypatch.setattr(amp_gradients, "pytorch_gradients", one_nan_under_amp)
    result = amp_gradients.measure("vanilla_gan", 8, batch_size=8, batches=1)
    first = result["weights"][0]
    assert first["network"] == "discriminator" and first["pytorch"] == math.inf and first["tensorflow"] < 1
    assert result["networks"]["discriminator"]["pytorch"] == math.inf
    assert result["networks"]["generator"]["pytorch"] < 1
    rows = amp_gradients.table(result).splitlines()
    assert rows[2].split(" | ")[3:5] == ["inf", f"{first['tensorflow']:.4f}"], rows[2]


def test_amp_gradients_sets_the_amp_error_beside_the_minibatch_noise():
    """The noise column is batch 1's float32 gradient against batch 0's; a network's error is
    its weights' errors weighted by their gradients' norms, so it lies between theirs."""
    import numpy as np
    import torch

    from common import data as datasets
    from common import models
    from scripts import amp_gradients

    result = amp_gradients.measure("lsgan", 8, batch_size=8, batches=2)
    torch_script = models.get("lsgan").module("pytorch")
    torch.manual_seed(0)
    networks = torch_script.build_networks((1, 28, 28), 8)
    images = datasets.to_unit_range(datasets.load_dataset("mnist", limit=16).x) * 2 - 1
    z = np.random.default_rng(0).standard_normal((2, 8, models.get("lsgan").hparams.Z_DIM), np.float32)
    first, second = (amp_gradients.pytorch_gradients(torch_script, networks, images[i * 8:(i + 1) * 8], z[i], amp=False)
                     for i in range(2))
    for row, a, b in zip(result["weights"], second, first):
        assert row["noise"] == pytest.approx(amp_gradients.relative_error(a, b), rel=1e-6), row
    discriminator = len(list(networks["discriminator"].parameters()))
    assert result["networks"]["generator"]["noise"] == pytest.approx(
        amp_gradients.network_error(second[discriminator:], first[discriminator:]), rel=1e-6)

    one_batch = amp_gradients.measure("lsgan", 8, batch_size=8, batches=1)
    for network, row in one_batch["networks"].items():
        assert math.isnan(row["noise"])  # no previous batch to compare with
        for framework in ("pytorch", "tensorflow"):
            errors = [w[framework] for w in one_batch["weights"] if w["network"] == network]
            assert min(errors) <= row[framework] <= max(errors), (network, framework)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_amp_gradients_measures_at_a_trained_runs_weights(framework, tmp_path):
    """--weights loads the networks of the run's last checkpoint (not its initial weights),
    from either framework, and takes the model and width from the run."""
    import numpy as np
    import torch

    from common import models
    from GAN.least_squares_gan import lsgan_pytorch, lsgan_tensorflow
    from scripts import amp_gradients
    from tests.conftest import checkpoint_arrays

    run = tmp_path / "run"
    script = lsgan_pytorch if framework == "pytorch" else lsgan_tensorflow
    script.main(["--out", str(run), "--iters", "3", "--batch-size", "8", "--width", "8", "--data-limit", "64",
                 "--no-tensorboard", "--sample-every", "0"])
    config, step, checkpoint = amp_gradients.trained_run(run, None, None)
    assert (config["model"], config["width"], step) == ("lsgan", 8, 3)

    torch.manual_seed(0)
    networks = lsgan_pytorch.build_networks((1, 28, 28), 8)
    initial = {name: [p.detach().clone() for p in network.parameters()] for name, network in networks.items()}
    amp_gradients.load_checkpoint_weights(checkpoint, framework, lsgan_tensorflow, networks, (28, 28, 1), 8)
    saved = checkpoint_arrays(checkpoint)
    for name, network in networks.items():
        loaded = [p.detach().numpy() for p in network.parameters()]
        assert any(not np.array_equal(a, b.numpy()) for a, b in zip(loaded, initial[name]))
        if framework == "pytorch":
            expected = [saved[f"modules/{name}/{key}"] for key, _ in network.named_parameters()]
        else:  # Keras' Dense kernels are (in, out), PyTorch's weights (out, in)
            keys = sorted(k for k in saved if k.startswith(f"module/{name}/"))
            expected = [saved[k].T if saved[k].ndim == 2 else saved[k] for k in keys]
        assert len(loaded) == len(expected) > 0, name  # a renamed Keras key would leave nothing to compare
        for a, b in zip(loaded, expected):
            np.testing.assert_array_equal(a, b)

    result = amp_gradients.measure(None, None, batch_size=8, batches=2, weights=run)
    assert result["model"] == "lsgan" and result["width"] == 8 and str(checkpoint) in result["source"]
    assert len(result["weights"]) == sum(1 for n in networks.values() for _ in n.parameters())
    assert models.get(result["model"]).hparams.Z_DIM == 100 and result["float32_gap"] < 1e-4


def test_amp_gradients_refuses_runs_it_cannot_measure_in_one_line(tmp_path, capsys):
    import torch

    from GAN.least_squares_gan import lsgan_pytorch
    from scripts import amp_gradients
    from tests.conftest import CodeInAPickle

    run = tmp_path / "run"
    lsgan_pytorch.main(["--out", str(run), "--iters", "2", "--batch-size", "8", "--width", "8", "--data-limit", "64",
                        "--no-tensorboard", "--sample-every", "0"])

    def refused(argv, message):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            amp_gradients.main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code not in (0, None) and len(err.splitlines()) == 1 and message in err, err

    refused(["--weights", str(tmp_path)], "not a finished run")
    refused(["--weights", str(run / "config.json")], f"{run / 'config.json'} is not a folder: name the run's folder")
    refused(["--weights", str(run), "--model", "dcgan"], "leave --model and --width out")
    refused(["--weights", str(run), "--width", "16"], "leave --model and --width out")
    settings = (run / "config.json").read_text()
    for width in (-1, 10**30):  # an edit: a traceback from the framework building the networks
        (run / "config.json").write_text(json.dumps({**json.loads(settings), "width": width}))
        refused(["--weights", str(run)], f"config.json is damaged: framework 'pytorch', width {width}")
    (run / "config.json").write_text(settings)
    checkpoint = next((run / "checkpoints").glob("step_*.pt"))
    saved = checkpoint.read_bytes()
    checkpoint.write_bytes(b"not a checkpoint")
    refused(["--weights", str(run)], f"--weights: checkpoint {checkpoint} is unreadable (")
    torch.save({"modules": {"generator": CodeInAPickle(tmp_path / "ran")}}, checkpoint)
    refused(["--weights", str(run)], "is unreadable (it holds more than tensors and plain values, or is damaged")
    assert not (tmp_path / "ran").exists()
    torch.save({"modules": {}}, checkpoint)
    refused(["--weights", str(run)], "does not hold this model's networks (KeyError: 'generator')")
    checkpoint.write_bytes(saved)
    checkpoint.unlink()
    refused(["--weights", str(run)], "has no checkpoint")


def lsgan_run_with_edited_weights(tmp_path, framework, edit):
    """A finished LSGAN run of `framework` whose last checkpoint's networks `edit` changed,
    edit(network name, PyTorch's name or the .npz key, array) returning the new array."""
    import numpy as np
    import torch

    from GAN.least_squares_gan import lsgan_pytorch, lsgan_tensorflow

    run = tmp_path / "run"
    (lsgan_pytorch if framework == "pytorch" else lsgan_tensorflow).main(
        ["--out", str(run), "--iters", "2", "--batch-size", "8", "--width", "8", "--data-limit", "64",
         "--no-tensorboard", "--sample-every", "0"])
    checkpoint = next((run / "checkpoints").glob("step_*"))
    if framework == "pytorch":
        state = torch.load(checkpoint, weights_only=True)
        for name, network in state["modules"].items():
            for key, value in network.items():
                network[key] = torch.from_numpy(edit(name, key, value.numpy()))
        torch.save(state, checkpoint)
    else:
        with np.load(checkpoint) as stored:
            arrays = {key: stored[key] for key in stored.files}
        for key, value in arrays.items():
            if key.startswith("module/"):
                arrays[key] = edit(key.split("/")[1], key, value)
        np.savez(checkpoint, **arrays)
    return run, checkpoint


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_amp_gradients_names_its_flag_for_a_checkpoint_that_is_no_file_in_both_frameworks(framework, tmp_path,
                                                                                           capsys):
    run, checkpoint = lsgan_run_with_edited_weights(tmp_path, framework, lambda name, key, array: array)
    checkpoint.unlink()
    checkpoint.mkdir()
    assert amp_gradients_refusal(run, capsys) == f"error: --weights: checkpoint {checkpoint} is not a regular file; " \
                                                  "remove it or name another"


def amp_gradients_refusal(run, capsys) -> str:
    """The one line amp_gradients.py --weights `run` refuses it with, exit status 1."""
    from scripts import amp_gradients

    capsys.readouterr()  # the training's
    with pytest.raises(SystemExit) as exit_info:
        amp_gradients.main(["--weights", str(run), "--batch-size", "8", "--batches", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("framework, key, entry, value, name", [
    ("pytorch", "out.layer.weight", (0, 3), float("nan"), "discriminator/out.layer.weight"),
    # a TensorFlow run's, named by PyTorch's name: D's first Dense kernel is hidden.1.weight
    ("tensorflow", "module/discriminator/0000", (5, 2), float("inf"), "discriminator/hidden.1.weight")])
def test_amp_gradients_refuses_inf_nan_weights_in_one_line_naming_the_weight(framework, key, entry, value, name,
                                                                             tmp_path, capsys):
    """Were they measured, every gradient would be NaN, printed as "-" (a gradient of 0), exit 0."""

    def edited(network, found, array):
        if found == key and network == "discriminator":
            array = array.copy()
            array[entry] = value
        return array

    run, checkpoint = lsgan_run_with_edited_weights(tmp_path, framework, edited)
    err = amp_gradients_refusal(run, capsys)
    assert f"checkpoint {checkpoint} holds inf/NaN in {name}" in err, err


def test_amp_gradients_refuses_a_tensorflow_checkpoint_of_other_than_floats_in_one_line(tmp_path, capsys):
    """Keras' set_weights casts what it is given: weights saved as strings ("0.0", "-0.") were
    measured, rounded to their digits, exit 0; the run's own restore refuses the file."""
    as_text = lambda network, key, value: value.astype("U3")  # noqa: E731
    run, checkpoint = lsgan_run_with_edited_weights(tmp_path, "tensorflow", as_text)
    err = amp_gradients_refusal(run, capsys)
    assert f"checkpoint {checkpoint} does not hold this model's networks" in err and "holds <U3" in err, err


def test_amp_gradients_refuses_weights_whose_float32_gradients_disagree_in_one_line(tmp_path, capsys):
    """D's last weights scaled by 1e-36: its output near-constant, the gradients under it
    subnormal, which TensorFlow flushes to 0 and PyTorch keeps. At the initialisation such a
    gap is the script's bug (a traceback); at a checkpoint's weights, theirs."""

    def scaled(network, key, value):
        return value * 1e-36 if (network, key) == ("discriminator", "out.layer.weight") else value

    run, checkpoint = lsgan_run_with_edited_weights(tmp_path, "pytorch", scaled)
    err = amp_gradients_refusal(run, capsys)
    assert f"at the weights of {checkpoint}, the two frameworks' float32 gradients differ by" in err, err


def test_amp_gradients_refuses_finite_weights_whose_float32_gradients_overflow(tmp_path, capsys):
    """D's first weights x1e37, finite: its activations overflow, every gradient NaN, which the
    table printed as "-" (its mark of a gradient of 0), exit 0."""

    def huge(network, key, value):
        return value * 1e37 if (network, key) == ("discriminator", "hidden.1.weight") else value

    run, checkpoint = lsgan_run_with_edited_weights(tmp_path, "pytorch", huge)
    err = amp_gradients_refusal(run, capsys)
    assert f"at the weights of {checkpoint}, the float32 gradient of " in err and "holds inf/NaN" in err, err


def test_ctrl_c_stops_the_benchmark_without_a_table(tmp_path, capsys, monkeypatch):
    """A model script stopped by Ctrl-C exits 130: the benchmark stops there with one line and
    exit 130. It counted the stop as a failed configuration, ran the next one, wrote the table
    it said it had not, and exited 1."""
    from scripts import benchmark

    scripts = FakeScripts(monkeypatch)
    fake_run = scripts.__call__

    def stopped_second(command, **kwargs):
        result = fake_run(command, **kwargs)
        if "--out" in command and len(scripts.commands) == 2:
            return subprocess.CompletedProcess(command, 130, "", "error: interrupted\n")
        return result

    monkeypatch.setattr(subprocess, "run", stopped_second)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--models", "vanilla_gan", "--frameworks", "pytorch", "--iters", "8", "--log-every", "2",
                        "--out", str(tmp_path / "bench")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 130 and len(scripts.commands) == 2
    assert err == "error: interrupted: the benchmark stopped at vanilla_gan pytorch amp-bf16; no table was written", err
    assert not (tmp_path / "bench" / "benchmark.md").exists() and not (tmp_path / "bench" / "benchmark.json").exists()


def test_full_precision_runs_a_float32_input_in_float32_inside_autocast():
    """The output layers and the VAE's heads compute in float32 under AMP, whatever their
    input's dtype: a float32 input inside autocast went to autocast's 16-bit matmul."""
    import torch

    from common.pytorch.amp import FullPrecision

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 8)
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = FullPrecision(layer)(x)
        rounded = layer(x)  # what autocast alone computes
    assert out.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    torch.testing.assert_close(out, layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("model", ["vanilla_gan", "wgan_gp", "vanilla_vae"])
def test_every_forward_pass_of_a_pytorch_amp_step_runs_under_autocast(model):
    """Under --amp the training steps run every network's hidden layers in bfloat16, in every
    forward pass of the step: D's for G's loss too, the critic's in each of WGAN-GP's updates
    and its penalty, G's and the VAE's encoder and decoder. Only the FullPrecision output
    layers leave autocast. (Mutation round 12: the GAN step's G update with autocast off, D
    then computing G's loss in float32, went unseen.)"""
    import torch

    from common.pytorch.amp import FullPrecision
    from tests.conftest import runtime_and_data

    entry = models.get(model)
    script = entry.module("pytorch")
    cfg = parse_args(model, "pytorch", ["--amp", "--amp-dtype", "bfloat16", "--width", "8", "--batch-size", "20",
                                        "--data-limit", "64"])
    runtime, data = runtime_and_data(cfg, entry.hparams.PIXEL_RANGE)
    networks = script.build_networks(data.sample_shape, cfg.width)
    if model == "vanilla_vae":
        trainer = script.VAE(networks["encoder"], networks["decoder"], cfg, runtime)
    elif model == "wgan_gp":
        trainer = script.WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
    else:
        from GAN.gan_step_pytorch import GAN

        trainer = GAN(networks["generator"], networks["discriminator"], script.discriminator_loss,
                      script.generator_loss, entry.hparams.Z_DIM, cfg, runtime, data)
    computed = {name: [] for name in trainer.modules}
    for name, network in trainer.modules.items():
        in_float32 = {id(layer) for wrapper in network.modules() if isinstance(wrapper, FullPrecision)
                      for layer in wrapper.modules()}
        for layer in network.modules():
            if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.ConvTranspose2d)) and (
                    id(layer) not in in_float32):
                layer.register_forward_hook(
                    lambda module, inputs, output, name=name: computed[name].append(output.dtype))
    trainer.train_step(data.batch(torch.arange(cfg.batch_size)))
    for name, dtypes in computed.items():
        assert dtypes and set(dtypes) == {torch.bfloat16}, f"{name}: {dtypes}"


def test_an_evaluation_without_save_samples_writes_no_samples_file_and_keeps_the_last(tmp_path, monkeypatch):
    """--evaluate alone measures the samples and keeps none: the evaluation is handed no keep
    (mutation round 10: handing keep over always went unseen), and the samples an earlier
    evaluation saved stay as they were: they say their step, and no --save-samples asked for
    them to go."""
    handed = []

    def evaluate(session, cfg, keep=None):
        handed.append(keep)
        if keep is not None:
            keep(np.full((10, 28, 28, 1), 0.5, np.float32))
        return {"samples": 10}

    monkeypatch.setattr(ScriptedSession, "evaluate", evaluate, raising=False)
    (tmp_path / "run").mkdir()
    earlier = RunFolder(tmp_path / "run").write_eval_samples(np.zeros((3, 28, 28, 1)), step=5, seed=0)
    saved = earlier.read_bytes()
    _, _, messages, _ = run_loop(tmp_path, lambda step: {"loss": 1.0}, iters=20, evaluate=10)
    assert handed == [None] and earlier.read_bytes() == saved
    assert not any("evaluation samples in" in message for message in messages)
