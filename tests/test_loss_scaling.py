"""float16 loss scaling really skips a poisoned step and backs off, in both frameworks, and the
session reports the skipped step.

Runs the shared GAN step with float16 AMP on CPU (slow there, fine for a tiny MLP on 2-D
points) and makes the discriminator's loss infinite for exactly one step.
"""
import numpy as np
import pytest

from common.config import LOSS_SCALE_INIT, RunConfig
from tests.conftest import cuda_param


def make_cfg(framework, device="auto"):
    return RunConfig(model="vanilla_gan", framework=framework, amp=True, amp_dtype="float16",
                     batch_size=16, dataset="ring8", data_limit=64, seed=1, device=device)


class Poison:
    """Wraps a discriminator loss: adds +inf while `armed`, so every D gradient is inf/NaN."""

    def __init__(self, loss, infinity):
        self.loss, self.infinity, self.armed = loss, infinity, False

    def __call__(self, real_logits, fake_logits):
        loss = self.loss(real_logits, fake_logits)
        return loss + self.infinity(real_logits) if self.armed else loss


@pytest.mark.parametrize("device", ["cpu", cuda_param("cuda")])
def test_gradscaler_skips_the_step_and_halves_the_scale(device):
    import torch

    from common.pytorch.data import load_data
    from common.pytorch.runtime import setup
    from common.pytorch.session import Session
    from GAN.gan_step_pytorch import GAN
    from GAN.vanilla_gan import gan_pytorch as model

    cfg = make_cfg("pytorch", device)
    runtime = setup(cfg, log=lambda *_: None)
    assert runtime.scaler.is_enabled() and runtime.compute_dtype == torch.float16
    assert runtime.device.type == device
    data = load_data(cfg, runtime, model.hparams.PIXEL_RANGE)
    poison = Poison(model.discriminator_loss, lambda logits: logits.float().sum() * float("inf"))
    gan = GAN(model.Generator(data.sample_shape, cfg.width), model.Discriminator(data.sample_shape, cfg.width), poison,
              model.generator_loss, model.hparams.Z_DIM, cfg, runtime, data)
    assert all(p.device.type == device for p in gan.discriminator.parameters())
    session = Session(gan, data, runtime)
    step = lambda: session.train_step(torch.arange(16))["skipped"].item()

    assert step() == 0.0
    assert runtime.scaler.get_scale() == LOSS_SCALE_INIT
    d_before = [p.detach().clone() for p in gan.discriminator.parameters()]

    poison.armed = True
    assert step() == 1.0
    assert runtime.scaler.get_scale() == LOSS_SCALE_INIT / 2
    for before, after in zip(d_before, gan.discriminator.parameters()):
        assert torch.equal(before, after)  # the poisoned D step was not applied
        assert torch.isfinite(after).all()

    poison.armed = False
    assert step() == 0.0
    assert runtime.scaler.get_scale() == LOSS_SCALE_INIT / 2  # grows only after 2000 clean steps
    assert any(not torch.equal(b, a) for b, a in zip(d_before, gan.discriminator.parameters()))


def test_loss_scale_optimizer_skips_the_step_and_halves_the_scale():
    import keras
    import tensorflow as tf

    from common.tensorflow.data import load_data
    from common.tensorflow.runtime import setup
    from common.tensorflow.session import Session
    from GAN.gan_step_tensorflow import GAN
    from GAN.vanilla_gan import gan_tensorflow as model

    cfg = make_cfg("tensorflow")
    runtime = setup(cfg, log=lambda *_: None)
    try:
        assert keras.mixed_precision.global_policy().name == "mixed_float16"
        data = load_data(cfg, runtime, model.hparams.PIXEL_RANGE)
        poison = Poison(model.discriminator_loss,
                        lambda logits: tf.reduce_sum(tf.cast(logits, tf.float32)) * np.inf)
        gan = GAN(model.make_generator(data.sample_shape, cfg.width),
                  model.make_discriminator(data.sample_shape, cfg.width), poison,
                  model.generator_loss, model.hparams.Z_DIM, cfg, runtime, data)
        assert isinstance(gan.d_optimizer, keras.optimizers.LossScaleOptimizer)
        session = Session(gan, data, runtime)
        batch = data.batch(tf.range(16))
        step = lambda: float(session.train_on(batch)["skipped"])  # eager: `armed` is re-read

        assert step() == 0.0
        assert float(gan.d_optimizer.dynamic_scale) == LOSS_SCALE_INIT
        d_before = [v.numpy() for v in gan.discriminator.trainable_variables]

        poison.armed = True
        assert step() == 1.0
        assert float(gan.d_optimizer.dynamic_scale) == LOSS_SCALE_INIT / 2
        assert float(gan.g_optimizer.dynamic_scale) == LOSS_SCALE_INIT  # G's step was clean
        for before, after in zip(d_before, gan.discriminator.trainable_variables):
            np.testing.assert_array_equal(before, after.numpy())

        poison.armed = False
        assert step() == 0.0
        assert float(gan.d_optimizer.dynamic_scale) == LOSS_SCALE_INIT / 2
        assert any(not np.array_equal(b, a.numpy())
                   for b, a in zip(d_before, gan.discriminator.trainable_variables))
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("precision", ["fp32", "bfloat16", "float16"])
def test_tensorflow_float16_on_a_onednn_cpu_runs_without_the_remappers_fused_matmul(precision):
    """Where a CPU has AVX512-FP16, TensorFlow 2.21's oneDNN runs Grappler's fused float16
    MatMul+BiasAdd with its reference kernel (the vanilla GAN's step 1.6 s instead of 21 ms on
    an Intel Xeon with AMX), so setup() turns the remapper off for float16 where oneDNN runs
    and on for everything else. Each case starts from the other setting, so setup() must set it."""
    import tensorflow as tf

    from common.tensorflow.runtime import onednn_enabled, setup

    cfg = RunConfig(model="vanilla_gan", framework="tensorflow", amp=precision != "fp32",
                    amp_dtype="auto" if precision == "fp32" else precision, device="cpu")
    remapper_off = precision == "float16" and bool(onednn_enabled())
    tf.config.optimizer.set_experimental_options({"remapping": remapper_off})
    setup(cfg, log=lambda *_: None)
    assert tf.config.optimizer.get_experimental_options()["remapping"] is not remapper_off
