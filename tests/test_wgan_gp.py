"""WGAN-GP: the gradient penalty on hand values, the penalty and the critic's gradients under
float16 with loss scaling equal to float32's (and would not without the unscaling), the loss
scale holding over a float16 run, an iteration counted as skipped when any of its six updates
was, five critic updates per generator update, the batch-size rule, and the twins' MLPs
computing the same function (the image networks are in tests/test_porting.py with every
model)."""
import json
import math
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch
from torch import nn

from common.config import LOSS_SCALE_INIT
from GAN.wgan_gp import hparams, wgan_gp_pytorch, wgan_gp_tensorflow

SCRIPTS = {"pytorch": wgan_gp_pytorch, "tensorflow": wgan_gp_tensorflow}
TINY = ["--batch-size", "20", "--data-limit", "64", "--log-every", "2", "--iters", "4"]
FLOAT16_SCALE = 2.0**16  # GradScaler's first scale, and this repository's


def history(out):
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def batch(shape_hwc=(8, 8, 1), count=6, seed=0):
    """real, fake (NHWC) and eps, in float32."""
    rng = np.random.default_rng(seed)
    real = rng.uniform(-1, 1, (count, *shape_hwc)).astype(np.float32)
    fake = rng.uniform(-1, 1, (count, *shape_hwc)).astype(np.float32)
    eps = rng.uniform(0, 1, (count, 1, 1, 1)).astype(np.float32)
    return real, fake, eps


def nchw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array.transpose(0, 3, 1, 2)))


def penalties(critic_torch, critic_keras, real, fake, eps) -> tuple[float, float]:
    """The penalty of both frameworks' gradient_penalty in float32 (nothing scaled)."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    pt = wgan_gp_pytorch.gradient_penalty(critic_torch, nchw(real), nchw(fake), nchw(eps), scaler)
    tf_value = wgan_gp_tensorflow.gradient_penalty(critic_keras, tf.constant(real), tf.constant(fake),
                                                   tf.constant(eps), keras.optimizers.Adam())
    return float(pt.detach()), float(tf_value)


# --- the penalty on hand values ------------------------------------------------------------------
def test_penalty_of_a_linear_critic_is_the_norm_of_its_weights_minus_one_squared():
    """f(x) = w.x + b has gradient w at every x: penalty = (||w|| - 1)^2, the norm over all
    pixels of an example (a per-pixel norm would give mean((|w_i| - 1)^2) instead)."""
    real, fake, eps = batch()
    w = np.random.default_rng(1).standard_normal(real[0].size).astype(np.float32)
    w *= 3.0 / np.linalg.norm(w)  # ||w|| = 3: penalty (3 - 1)^2 = 4
    linear = nn.Sequential(nn.Flatten(), nn.Linear(w.size, 1))
    with torch.no_grad():  # PyTorch flattens (C, H, W): reorder w from Keras' (H, W, C)
        linear[1].weight.copy_(torch.from_numpy(w.reshape(real.shape[1:]).transpose(2, 0, 1).reshape(1, -1)))
        linear[1].bias.fill_(0.5)
    dense = keras.Sequential([keras.Input(real.shape[1:]), keras.layers.Flatten(), keras.layers.Dense(1)])
    dense.layers[-1].set_weights([w.reshape(-1, 1), np.array([0.5], np.float32)])
    for value in penalties(linear, dense, real, fake, eps):
        assert value == pytest.approx(4.0, rel=1e-6)
    per_pixel = float(np.mean((np.abs(w) - 1) ** 2))
    assert abs(per_pixel - 4.0) > 0.5


def test_pytorch_penalty_differentiates_a_float32_layer_in_float32_under_autocast():
    """The AMP examples call autograd.grad outside autocast: inside it, the gradient of a
    layer that runs in float32 (FullPrecision, the critics' last) was computed from its weights
    rounded to bfloat16, 3e-4 off float32's penalty, where the Keras twin's tape keeps the
    float32 layer's gradient in float32."""
    from common.pytorch.amp import FullPrecision

    torch.manual_seed(0)
    critic = FullPrecision(nn.Linear(256, 1))
    real, fake, eps = torch.randn(8, 256), torch.randn(8, 256), torch.rand(8, 1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    float32 = wgan_gp_pytorch.gradient_penalty(critic, real, fake, eps, scaler)
    assert float(float32.detach()) == pytest.approx((critic.layer.weight.detach().norm().item() - 1) ** 2, rel=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = wgan_gp_pytorch.gradient_penalty(critic, real, fake, eps, scaler)
    assert float(under_autocast.detach()) == pytest.approx(float(float32.detach()), rel=1e-6)


def test_penalty_of_a_quadratic_critic_follows_the_interpolates():
    """f(x) = ||x||^2 / 2 has gradient x: penalty = mean((||x_hat|| - 1)^2), x_hat = eps x + (1 - eps) x~."""
    real, fake, eps = batch()
    x_hat = eps * real + (1 - eps) * fake
    expected = np.mean((np.linalg.norm(x_hat.reshape(len(x_hat), -1), axis=1) - 1) ** 2)

    def quadratic_torch(x):
        return 0.5 * x.flatten(1).square().sum(1, keepdim=True)

    def quadratic_keras(x, training=False):
        return 0.5 * tf.reduce_sum(tf.square(tf.reshape(x, [tf.shape(x)[0], -1])), axis=1, keepdims=True)

    for value in penalties(quadratic_torch, quadratic_keras, real, fake, eps):
        assert value == pytest.approx(expected, rel=1e-5)


def test_critic_and_generator_losses_on_hand_values():
    real, fake, penalty = np.array([[2.0], [4.0]], np.float32), np.array([[1.0], [-1.0]], np.float32), 0.25
    # critic: mean(fake) - mean(real) + lambda * penalty = 0 - 3 + 2.5 (or 0.025); generator: -mean(fake) = 0
    for module, to_tensor in ((wgan_gp_pytorch, torch.tensor), (wgan_gp_tensorflow, tf.constant)):
        assert float(module.critic_loss(to_tensor(real), to_tensor(fake), to_tensor(penalty), 10.0)) == -0.5
        assert float(module.critic_loss(to_tensor(real), to_tensor(fake), to_tensor(penalty), 0.1)) == \
            pytest.approx(-2.975, rel=1e-6)
        assert float(module.generator_loss(to_tensor(real))) == -3.0


def critic_loss_is_the_penalised_estimate(metrics: dict, penalty_weight: float) -> bool:
    """A step's (or a history row's) means obey d_loss = -wasserstein + lambda * penalty: the
    lambda the step used, read off what it logged."""
    expected = -float(metrics["wasserstein"]) + penalty_weight * float(metrics["penalty"])
    return float(metrics["d_loss"]) == pytest.approx(expected, rel=1e-4, abs=1e-5)


# --- float16 with loss scaling against float32 ---------------------------------------------------
def relative_error(got: list, expected: list) -> float:
    """|got - expected| / |expected| over all the gradients as one vector (the last layer's
    bias has a zero gradient: the Wasserstein term's +1 and -1 cancel)."""
    got, expected = (np.concatenate([np.ravel(g) for g in grads]) for grads in (got, expected))
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def finite(penalty: float, gradients: list) -> bool:
    return math.isfinite(penalty) and all(np.isfinite(g).all() for g in gradients)


def at_the_first_finite_scale(critic_step) -> tuple[float, float, list]:
    """critic_step(scale) from 2**16 down, halving after a non-finite result as dynamic loss
    scaling does (it skips that step and halves): (scale, penalty, gradients)."""
    scale = FLOAT16_SCALE
    while scale >= 2**10:
        penalty, gradients = critic_step(scale)
        if finite(penalty, gradients):
            return scale, penalty, gradients
        scale /= 2
    raise AssertionError("float16 overflowed at every scale down to 2**10")


def torch_critic_step(critic, real, fake, eps, scale: float | None):
    """The critic's penalty and its gradients, as WGANGP.train_step computes them; with a
    `scale`: float16 autocast and a GradScaler at that scale, the gradients read unscaled."""
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
    critic.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=scale is not None):
        penalty = wgan_gp_pytorch.gradient_penalty(critic, real, fake, eps, scaler)
        loss = wgan_gp_pytorch.critic_loss(critic(real), critic(fake), penalty, hparams.penalty_weight(real.shape[1:]))
    scaler.scale(loss).backward()
    return float(penalty.detach()), [p.grad.numpy() / (scale or 1.0) for p in critic.parameters()]


@pytest.mark.parametrize("shape", [(1, 28, 28), (2,)], ids=["conv-28x28", "mlp-points"])
def test_pytorch_float16_penalty_and_critic_gradients_equal_float32(shape, monkeypatch):
    torch.manual_seed(0)
    critic = wgan_gp_pytorch.build_networks(shape, 4)["discriminator"]
    real, fake = torch.rand(8, *shape) * 2 - 1, torch.rand(8, *shape) * 2 - 1
    eps = torch.rand(8, *(1,) * len(shape))
    penalty32, grads32 = torch_critic_step(critic, real, fake, eps, None)
    scale, penalty16, grads16 = at_the_first_finite_scale(
        lambda scale: torch_critic_step(critic, real, fake, eps, scale))
    assert 0 < penalty32 and penalty16 == pytest.approx(penalty32, rel=1e-2)
    # float16 keeps 11 significant bits: 1.5e-2 measured for this seed's critic (its initial
    # weights moved when DCGAN's generator, built first from the same seed, grew)
    assert relative_error(grads16, grads32) < 2e-2
    # Without the unscaling the penalty sees gradients `scale` times too large: far off (or inf).
    monkeypatch.setattr(wgan_gp_pytorch, "scale_on_device", lambda scaler, device: None)
    broken, _ = torch_critic_step(critic, real, fake, eps, scale)
    assert not broken == pytest.approx(penalty32, rel=0.5)


def keras_critic_step(critic, real, fake, eps, scale: float | None, unscale=True):
    """The Keras twin of torch_critic_step: a LossScaleOptimizer at `scale`, or a plain one.
    unscale=False hands the penalty an optimizer that scales the loss but is no
    LossScaleOptimizer, so it does not divide the scale back out: the bug to be caught."""
    optimizer = keras.optimizers.Adam()
    if scale is not None:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=scale)
        optimizer.build(critic.trainable_variables)  # scale_loss uses the live scale once built
    with tf.GradientTape() as tape:
        penalty_optimizer = optimizer if unscale else types.SimpleNamespace(scale_loss=optimizer.scale_loss)
        penalty = wgan_gp_tensorflow.gradient_penalty(critic, real, fake, eps, penalty_optimizer)
        loss = wgan_gp_tensorflow.critic_loss(critic(real, training=True), critic(fake, training=True), penalty,
                                              hparams.penalty_weight(real.shape[1:]))
        scaled_loss = optimizer.scale_loss(loss)
    gradients = tape.gradient(scaled_loss, critic.trainable_variables)
    return float(penalty), [np.asarray(g, np.float32) / (scale or 1.0) for g in gradients]


@pytest.mark.parametrize("shape", [(28, 28, 1), (2,)], ids=["conv-28x28", "mlp-points"])
def test_keras_float16_penalty_and_critic_gradients_equal_float32(shape):
    rng = np.random.default_rng(0)
    real, fake = (rng.uniform(-1, 1, (8, *shape)).astype(np.float32) for _ in range(2))
    eps = tf.constant(rng.uniform(0, 1, (8, *(1,) * len(shape))).astype(np.float32))
    keras.utils.set_random_seed(0)
    try:
        critic32 = wgan_gp_tensorflow.build_networks(shape, 4)["discriminator"]
        keras.mixed_precision.set_global_policy("mixed_float16")
        critic16 = wgan_gp_tensorflow.build_networks(shape, 4)["discriminator"]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    critic16.set_weights(critic32.get_weights())
    assert critic16.layers[0].compute_dtype == "float16"

    penalty32, grads32 = keras_critic_step(critic32, real, fake, eps, None)
    scale, penalty16, grads16 = at_the_first_finite_scale(
        lambda scale: keras_critic_step(critic16, real, fake, eps, scale))
    assert 0 < penalty32 and penalty16 == pytest.approx(penalty32, rel=1e-2)
    assert relative_error(grads16, grads32) < 1e-2
    broken, _ = keras_critic_step(critic16, real, fake, eps, scale, unscale=False)
    assert not broken == pytest.approx(penalty32, rel=0.5)


@pytest.mark.parametrize("framework", SCRIPTS)
def test_float16_loss_scale_holds_over_200_steps_on_the_ring(framework, tmp_path):
    """200 generator iterations (1,200 optimizer steps) of the MLPs on ring8 in float16 (emulated
    on CPU): the scale backs off from 2**16, skipping those steps, but never falls below 2**10.
    A row's mean critic loss is inf or NaN where a step of it overflowed, finite elsewhere."""
    threads = torch.get_num_threads()
    if framework == "pytorch":  # MLPs this small gain nothing from a second thread, which on a
        torch.set_num_threads(1)  # busy 2-core machine made the test 7x slower
    out = tmp_path / "run"
    try:
        SCRIPTS[framework].main(["--out", str(out), "--dataset", "ring8", "--amp", "--amp-dtype", "float16",
                                 "--iters", "200", "--batch-size", "40", "--width", "4", "--log-every", "10",
                                 "--sample-every", "0", "--lr", "1e-4", "--beta1", "0"])  # as the README's float16 run
    finally:
        torch.set_num_threads(threads)
    rows = history(out)
    assert len(rows) == 20 and json.loads((out / "config.json").read_text())["precision"] == "amp-fp16"
    assert rows[-1]["loss_scale"] < LOSS_SCALE_INIT and any(row["skipped"] for row in rows)  # it backed off
    assert min(row["loss_scale"] for row in rows) >= 2**10
    assert all(math.isfinite(row["g_loss"]) for row in rows)
    clean = [row for row in rows if not row["skipped"]]
    assert len(clean) >= len(rows) // 2 and all(math.isfinite(row["d_loss"] + row["penalty"]) for row in clean)


# --- the training step and the flags -------------------------------------------------------------
@pytest.mark.parametrize("framework", SCRIPTS)
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_trains_a_few_steps_on_images_with_finite_losses(framework, amp, tmp_path):
    out = tmp_path / "run"
    SCRIPTS[framework].main(["--out", str(out), *TINY, "--width", "8", *(["--amp"] if amp else [])])
    rows = history(out)
    assert [row["step"] for row in rows] == [2, 4]
    assert all(math.isfinite(row[key]) for row in rows for key in ("d_loss", "g_loss", "penalty", "wasserstein"))
    assert all(critic_loss_is_the_penalised_estimate(row, hparams.LAMBDA) for row in rows)  # 10 on images
    assert json.loads((out / "config.json").read_text())["precision"] == ("amp-bf16" if amp else "fp32")
    assert (out / "samples" / "step_000004.png").exists()


@pytest.mark.parametrize("framework", SCRIPTS)
def test_one_iteration_is_five_critic_updates_on_fifths_of_the_batch_and_one_generator_update(
        framework, monkeypatch):
    from common.config import parse_args
    from tests.conftest import runtime_and_data

    script, sizes, eps_drawn, penalties, critic_losses = SCRIPTS[framework], [], [], [], []
    original, original_loss = script.gradient_penalty, script.critic_loss
    scalar = lambda value: float(value.detach() if framework == "pytorch" else value)  # noqa: E731

    def spy(critic, real, fake, eps, *args, **kwargs):
        sizes.append(int(real.shape[0]))
        eps_drawn.append(np.asarray(eps))
        penalties.append(scalar(penalty := original(critic, real, fake, eps, *args, **kwargs)))
        return penalty

    def loss_spy(*args):
        critic_losses.append(scalar(loss := original_loss(*args)))
        return loss

    monkeypatch.setattr(script, "gradient_penalty", spy)
    monkeypatch.setattr(script, "critic_loss", loss_spy)
    cfg = parse_args("wgan_gp", framework, ["--dataset", "ring8", "--batch-size", "40", "--width", "2"])
    runtime, data = runtime_and_data(cfg, hparams.PIXEL_RANGE)
    networks = script.build_networks(data.sample_shape, cfg.width)
    wgan = script.WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
    real = data.dataset.x[:40]
    metrics = wgan.train_step(torch.from_numpy(real) if framework == "pytorch" else tf.constant(real))
    assert sizes == [8] * hparams.CRITIC_STEPS
    assert set(metrics) == {"d_loss", "g_loss", "penalty", "wasserstein"}
    assert critic_loss_is_the_penalised_estimate(metrics, hparams.POINT_LAMBDA)  # 0.1 on the mixtures
    # the interpolation weights: one per example, uniform on [0, 1] (a normal draw leaves it)
    assert all(eps.shape == (8, 1) and eps.min() >= 0 and eps.max() <= 1 for eps in eps_drawn)
    assert np.concatenate(eps_drawn).std() > 0.1
    # logged: the means over the 5 critic updates (their sums kept the check above true)
    assert float(metrics["d_loss"]) == pytest.approx(np.mean(critic_losses), rel=1e-5)
    assert float(metrics["penalty"]) == pytest.approx(np.mean(penalties), rel=1e-5)
    if framework == "pytorch":
        def updates(optimizer):
            return {int(state["step"]) for state in optimizer.state.values()}
        assert updates(wgan.critic_optimizer) == {5} and updates(wgan.g_optimizer) == {1}
    else:
        assert int(wgan.critic_optimizer.iterations) == 5 and int(wgan.g_optimizer.iterations) == 1


@pytest.mark.parametrize("framework", SCRIPTS)
def test_a_batch_size_that_is_not_a_multiple_of_five_is_refused(framework, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[framework].main(["--out", str(tmp_path / "run"), *TINY, "--batch-size", "42"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size 42 is not a multiple of 5" in err and "--batch-size 40" in err
    assert "among N data-parallel replicas, a multiple of 5N" in err  # torchrun's 2 refuse 5 later
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):  # below one batch per critic step the hint rounds up, not to 0
        SCRIPTS[framework].main(["--out", str(tmp_path / "run"), *TINY, "--batch-size", "3"])
    assert "--batch-size 3 is not a multiple of 5" in (err := capsys.readouterr().err) and "--batch-size 5" in err, err


def test_compile_is_refused_before_anything_runs(tmp_path, capsys):
    """torch.compile has no double backward, which the penalty takes: it failed after loading
    the data and compiling."""
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS["pytorch"].main(["--out", str(tmp_path / "run"), *TINY, "--compile"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "cannot differentiate twice" in err
    assert not (tmp_path / "run").exists()


def test_defaults_are_the_papers_but_the_rates_and_budgets():
    """The paper's beta2, critic updates and batches everywhere, its lambda 10 on images (0.1,
    the authors' toy code's, on the 2-D mixtures); MNIST trains at Adam 7e-4 for 3,500
    iterations with the paper's beta1 0, the ring and the grid at 3e-4 with the toy code's
    beta1 0.5 for 8,000 (hparams.py says why). All sample from G itself."""
    from common.config import parse_args

    assert hparams.CRITIC_STEPS == 5 and hparams.point_units(hparams.WIDTH) == 512
    assert (hparams.penalty_weight((1, 28, 28)), hparams.penalty_weight((2,))) == (10, 0.1)
    for dataset, rate, beta1, iterations in (("mnist", 7e-4, 0.0, 3500), ("ring8", 3e-4, 0.5, 8000),
                                             ("grid25", 3e-4, 0.5, 8000)):
        cfg = parse_args("wgan_gp", "pytorch", ["--dataset", dataset])
        assert (cfg.lr, cfg.iters, cfg.beta1, cfg.beta2, cfg.batch_size, cfg.ema_decay) == (
            rate, iterations, beta1, 0.9, 5 * 64, 0.0), dataset


def test_one_skipped_critic_update_among_five_counts_the_iteration_as_skipped_in_tensorflow(monkeypatch):
    """Keras' LossScaleOptimizer halves its scale on every update it skips: the session sees
    one non-finite critic update out of five (the loop's `skipped`), as PyTorch's does."""
    from common.config import RunConfig
    from common.tensorflow.data import load_data
    from common.tensorflow.runtime import setup
    from common.tensorflow.session import Session

    cfg = RunConfig(model="wgan_gp", framework="tensorflow", amp=True, amp_dtype="float16", batch_size=20,
                    dataset="ring8", data_limit=64, seed=1, width=4)
    runtime = setup(cfg, log=lambda *_: None)
    try:
        data = load_data(cfg, runtime, hparams.PIXEL_RANGE)
        networks = wgan_gp_tensorflow.build_networks(data.sample_shape, cfg.width)
        calls, clean_loss = [], wgan_gp_tensorflow.critic_loss

        def third_update_poisoned(real_scores, fake_scores, penalty, penalty_weight):
            calls.append(1)
            loss = clean_loss(real_scores, fake_scores, penalty, penalty_weight)
            return loss * np.inf if len(calls) == 3 else loss  # its gradients are inf and NaN

        monkeypatch.setattr(wgan_gp_tensorflow, "critic_loss", third_update_poisoned)
        wgan = wgan_gp_tensorflow.WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
        session = Session(wgan, data, runtime)
        for optimizer in (wgan.d_optimizer, wgan.g_optimizer):  # low enough that only the poison overflows
            optimizer.dynamic_scale.assign(2.0 ** 8)
        scale_before = float(wgan.d_optimizer.dynamic_scale)
        skipped = float(session.train_on(data.batch(tf.range(20)))["skipped"])  # eager: one call, five updates
        assert len(calls) == hparams.CRITIC_STEPS
        assert float(wgan.d_optimizer.dynamic_scale) == scale_before / 2 and skipped == 1.0
    finally:
        keras.mixed_precision.set_global_policy("float32")


def updates_applied(framework, wgan) -> tuple[int, int]:
    """The critic's and G's optimizer steps applied so far: PyTorch Adam's per-parameter
    'step' (0 before its first), Keras' `iterations` (which counts applied steps only)."""
    if framework == "pytorch":
        return tuple(max([int(state["step"]) for state in optimizer.state.values()], default=0)
                     for optimizer in (wgan.critic_optimizer, wgan.g_optimizer))
    return int(wgan.critic_optimizer.iterations), int(wgan.g_optimizer.iterations)


def loss_scales(framework, wgan, runtime) -> list[float]:
    if framework == "pytorch":
        return [runtime.scaler.get_scale()]
    return [float(optimizer.dynamic_scale) for optimizer in (wgan.critic_optimizer, wgan.g_optimizer)]


@pytest.mark.parametrize("framework", SCRIPTS)
def test_an_iteration_counts_as_skipped_when_any_of_its_six_updates_was_skipped(framework):
    """float16 at --growth-interval 1: every clean update doubles the scale and every overflow
    halves it. From 2**8 the first iterations are clean; then the scale reaches float16's
    overflow and an iteration's updates grow and back it off by turns. The session's `skipped`
    (what history.jsonl and summary.json count) must say, iteration by iteration, whether the
    optimizers applied fewer than 5 critic steps or no G step, read from their step counters.
    Comparing the scale before and after the whole iteration missed the iterations where the
    growths made up for the backoffs (all but the first in this run)."""
    from common.config import parse_args

    if framework == "pytorch":
        from common.pytorch.data import load_data
        from common.pytorch.runtime import setup
        from common.pytorch.session import Session
    else:
        from common.tensorflow.data import load_data
        from common.tensorflow.runtime import setup
        from common.tensorflow.session import Session
    script, iterations = SCRIPTS[framework], 10
    cfg = parse_args("wgan_gp", framework, ["--dataset", "ring8", "--data-limit", "64", "--batch-size", "20",
                                            "--width", "4", "--amp", "--amp-dtype", "float16",
                                            "--growth-interval", "1", "--init-scale", "256"])
    runtime = setup(cfg, log=lambda *_: None)
    try:
        data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
        networks = script.build_networks(data.sample_shape, cfg.width)
        wgan = script.WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
        session = Session(wgan, data, runtime)
        indices = session.upload_batches(np.arange(20)[None])[0]
        reported, expected, cancelled = [], [], 0
        for _ in range(iterations):
            (critic_before, g_before), scales_before = updates_applied(framework, wgan), loss_scales(
                framework, wgan, runtime)
            reported.append(float(session.train_step(indices)["skipped"]))  # the loop's step (tf.function)
            critic_after, g_after = updates_applied(framework, wgan)
            expected.append(float(critic_after - critic_before < hparams.CRITIC_STEPS or g_after - g_before < 1))
            went_down = any(a < b for a, b in zip(loss_scales(framework, wgan, runtime), scales_before))
            cancelled += expected[-1] == 1.0 and not went_down
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert 0 < sum(expected) < iterations  # clean iterations and skipped ones
    assert cancelled > 0, "no skip was made up for by a growth in its iteration: this no longer tests it"
    assert reported == expected
