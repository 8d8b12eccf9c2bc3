"""float16 loss scaling really skips a poisoned step and backs off, in both frameworks, and the
session reports the skipped step.

Runs the shared GAN step with float16 AMP on CPU (slow there, fine for a tiny MLP on 2-D
points) and makes the discriminator's loss infinite for exactly one step.
"""
import numpy as np
import pytest

from common.config import LOSS_SCALE_INIT, RunConfig
from tests.conftest import REPO, cuda_param


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


# Run in a process of its own: two logical CPU devices must be set before TensorFlow starts.
ONE_REPLICA_OVERFLOWS = '''
import json
import sys

sys.path.insert(0, sys.argv[1])
import keras
import numpy as np
import tensorflow as tf

from common.config import RunConfig
from common.tensorflow.optimizers import make_optimizer
from common.tensorflow.runtime import setup

cfg = RunConfig(model="vanilla_gan", framework="tensorflow", amp=True, amp_dtype="float16", device="cpu",
                distribute="mirrored", replicas=2, batch_size=16, seed=1)
runtime = setup(cfg, log=lambda *_: None)
strategy = runtime.strategy
with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    optimizer = make_optimizer(cfg, runtime)
    optimizer.build(model.trainable_variables)


def replica_step(x):  # the models' step: scale_loss, then apply_gradients
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
        scaled_loss = optimizer.scale_loss(runtime.replicas.share(loss))
    gradients = tape.gradient(scaled_loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))


@tf.function
def step(x):
    strategy.run(replica_step, args=(x,))


def on_each_replica(variable):
    return [v.numpy() for v in strategy.experimental_local_results(getattr(variable, "value", variable))]


clean = np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32)
outlier = clean.copy()
outlier[12] = [3000.0, 3000.0]  # in replica 1's rows (8-15) only: its float16 gradients overflow
report = {}
for name, rows in [("outlier", outlier), ("clean", clean)]:
    before = [on_each_replica(v) for v in model.trainable_variables]
    step(strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(rows[8 * context.replica_id_in_sync_group:][:8])))
    after = [on_each_replica(v) for v in model.trainable_variables]
    report[name] = {
        "scales": [float(scale) for scale in on_each_replica(optimizer.dynamic_scale)],
        "updates": [int(count) for count in on_each_replica(optimizer.iterations)],
        "finite": all(bool(np.isfinite(weights).all()) for each in after for weights in each),
        "replicas_equal": all(np.array_equal(each[0], each[1]) for each in after),
        "moved": any(not np.array_equal(b[r], a[r]) for b, a in zip(before, after) for r in range(2)),
    }
print(json.dumps(report))
'''


def test_mirrored_replicas_skip_together_when_one_replicas_gradients_overflow(tmp_path):
    """--distribute mirrored, float16: only replica 1's batch holds an outlier, whose float16
    gradients overflow. As under PyTorch DDP (the gradients are summed before GradScaler checks
    them) every replica must skip the step and halve its scale. Keras alone checks each
    replica's gradients and took the first replica's answer: both replicas applied the sum,
    NaN, and kept the scale."""
    import json
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(ONE_REPLICA_OVERFLOWS)
    result = subprocess.run([sys.executable, str(probe), str(REPO)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    outlier, clean = report["outlier"], report["clean"]
    assert outlier == {"scales": [LOSS_SCALE_INIT / 2] * 2, "updates": [0, 0], "finite": True,
                       "replicas_equal": True, "moved": False}, outlier
    # the next, clean, step is applied alike on both replicas
    assert clean == {"scales": [LOSS_SCALE_INIT / 2] * 2, "updates": [1, 1], "finite": True,
                     "replicas_equal": True, "moved": True}, clean


def test_tensorflow_logs_the_smallest_of_its_optimizers_loss_scales():
    """Keras keeps a scale per optimizer, PyTorch one GradScaler: the history's loss_scale is
    the smallest, the one an overflow (D's, say) brought down. Runs whose G and D scales stay
    equal could not tell the smallest from the largest."""
    import keras

    from common.tensorflow import amp

    discriminator = amp.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=2.0**10)
    generator = amp.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=2.0**15)
    for optimizer in (discriminator, generator):
        optimizer.build([keras.Variable([0.0, 0.0])])  # the scale is a variable of the built optimizer
    assert amp.loss_scale([generator, discriminator, keras.optimizers.Adam()]) == 2.0**10
    assert amp.loss_scale([keras.optimizers.Adam()]) == 1.0


@pytest.mark.parametrize("model", ["vanilla_gan", "wgan_gp", "vanilla_vae"])  # the GAN step, WGAN-GP's, the VAE's
def test_tensorflow_float16_steps_scale_every_loss_whose_gradients_they_unscale(model, tmp_path):
    """apply_gradients divides the gradients by the loss scale, so each loss must go through
    scale_loss first: one that did not (D's in the GAN step, G's in WGAN-GP's, the VAE's)
    gave gradients 1/scale of float32's, which Adam's first steps hide (a step is about lr
    whatever the gradient's size) and no run-level test saw. Adam's moments after one step
    are the gradients' own: in float16 as large as in float32."""
    import importlib

    from common import models

    def moments_by_optimizer(precision_flags):
        out = tmp_path / "-".join(["run", *precision_flags])
        script = importlib.import_module(str(models.get(model).script("tensorflow").relative_to(REPO))[:-3]
                                         .replace("/", "."))
        script.main(["--out", str(out), "--iters", "1", "--batch-size", "10", "--width", "8", "--data-limit", "64",
                     "--no-tensorboard", "--sample-every", "0", "--seed", "0", *precision_flags])
        largest = {}
        with np.load(out / "checkpoints" / "step_000001.npz") as stored:
            for key in stored.files:
                if key.startswith("optimizer/") and stored[key].size > 1:  # moments, not counters or scales
                    name = key.split("/")[1]
                    largest[name] = max(largest.get(name, 0.0), float(np.abs(stored[key]).max()))
        return largest

    float32 = moments_by_optimizer([])
    float16 = moments_by_optimizer(["--amp", "--amp-dtype", "float16", "--init-scale", "1024"])
    assert float32.keys() == float16.keys() and float32
    for name in float32:
        assert 0.5 < float16[name] / float32[name] < 2, (name, float16[name], float32[name])
