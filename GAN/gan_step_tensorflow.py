"""The GAN training step in TensorFlow/Keras, with automatic mixed precision, shared by the
vanilla GAN, LSGAN and DCGAN: they differ only in their networks and their two loss
functions. The PyTorch twin is gan_step_pytorch.py. WGAN-GP (GAN/wgan_gp) subclasses GAN
for its networks, optimizers and samples and writes its own step.

One iteration (compiled once by tf.function in common/tensorflow/session.py):
    1. generate one fake batch;
    2. update D on real vs. that fake batch, under a tape that sees only D's weights;
    3. update G through the just-updated D on the same fake batch, whose forward pass the
       outer tape recorded (G runs once per iteration, as in the PyTorch twin);
    4. each optimizer, a LossScaleOptimizer under float16 (Keras' own, whose replicas skip
       together: common/tensorflow/amp.py; made in common/tensorflow/optimizers.py), scales
       its loss (`scale_loss`), and in `apply_gradients` unscales the gradients, skips its
       own step on inf/NaN and adjusts its scale. Each optimizer has a scale of its own,
       where the PyTorch twin's one GradScaler serves both (the logged loss scale is the
       smaller). Under bfloat16 and float32 the optimizers are plain ones, whose `scale_loss`
       returns the loss unchanged.
The policy set before the networks were built (`keras.mixed_precision.set_global_policy(
"mixed_float16")` or "mixed_bfloat16", in common/tensorflow/runtime.py's setup) makes their
layers compute in 16 bits; the output layers were built with dtype="float32".

Under --distribute (common/tensorflow/runtime.py) the networks and optimizers are built in
the strategy's scope, and every replica runs this step on its share of the global batch and
of the noise drawn for it; `apply_gradients` sums the replicas' gradients, so each replica
scales its loss by its share of the global mean (`replicas.share`). The optimizers made in
common/tensorflow/optimizers.py sum them before clipping, and their LossScaleOptimizers skip
a step on every replica when any replica's gradients overflow, as PyTorch's DDP replicas do.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from common import sampling
from common.config import MIXTURE_SAMPLES
from common.tensorflow.data import load_data
from common.tensorflow.ema import ExponentialMovingAverage
from common.tensorflow.optimizers import make_optimizer
from common.tensorflow.runtime import Noise, Runtime, setup
from common.tensorflow.session import fit


class GAN:
    """One GAN as common/tensorflow/session.py's fit() trains it: G and D with their optimizers
    (and G's weight average), `train_step` (the iteration laid out at the top of this file),
    and the samples drawn from the run's fixed noise. `modules`, `optimizers`, `averages` and
    the draw counter of `noise` are what checkpoints hold."""

    def __init__(self, generator: keras.Model, discriminator: keras.Model, discriminator_loss,
                 generator_loss, z_dim: int, cfg, runtime: Runtime, data):
        self.generator, self.discriminator = generator, discriminator
        self.discriminator_loss, self.generator_loss = discriminator_loss, generator_loss
        self.z_dim, self.cfg, self.data = z_dim, cfg, data
        self.replicas = runtime.replicas
        self.g_optimizer = make_optimizer(cfg, runtime)
        self.d_optimizer = make_optimizer(cfg, runtime)
        # built now: checkpoints need the slots, and an unbuilt LossScaleOptimizer's scale_loss
        # would use its initial scale, not the dynamic one
        self.g_optimizer.build(generator.trainable_variables)
        self.d_optimizer.build(discriminator.trainable_variables)
        self.noise = Noise(cfg.seed)
        self.modules = {"generator": generator, "discriminator": discriminator}
        self.optimizers = {"generator": self.g_optimizer, "discriminator": self.d_optimizer}
        # --ema-decay: samples and evaluation from an average of G's weights (common/ema.py)
        self.average = ExponentialMovingAverage(generator, cfg.ema_decay) if cfg.ema_decay else None
        self.averages = {"generator": self.average} if self.average else {}
        self.title = f"{cfg.model} tensorflow {runtime.precision}"
        self.noise_shape = (sampling.GRID_IMAGES if data.kind == "image" else MIXTURE_SAMPLES, z_dim)
        self._fixed_noise = None

    def train_step(self, real):
        generator, discriminator = self.generator, self.discriminator
        z = self.replicas.normal(self.noise, tf.shape(real)[0], self.z_dim)  # noise.normal in one process

        with tf.GradientTape() as g_tape:
            fake = generator(z, training=True)
            with g_tape.stop_recording():  # D's update is not part of G's gradient
                with tf.GradientTape() as d_tape:
                    d_loss = self.discriminator_loss(discriminator(real, training=True),
                                                     discriminator(fake, training=True))
                    scaled_d_loss = self.d_optimizer.scale_loss(self.replicas.share(d_loss))
                d_variables = discriminator.trainable_variables
                d_gradients = d_tape.gradient(scaled_d_loss, d_variables)
                self.d_optimizer.apply_gradients(zip(d_gradients, d_variables))
            g_loss = self.generator_loss(discriminator(fake, training=True))
            scaled_g_loss = self.g_optimizer.scale_loss(self.replicas.share(g_loss))
        g_variables = generator.trainable_variables
        g_gradients = g_tape.gradient(scaled_g_loss, g_variables)
        self.g_optimizer.apply_gradients(zip(g_gradients, g_variables))
        if self.average:
            self.average.update(generator)

        return {"d_loss": d_loss, "g_loss": g_loss}

    def generate(self, z) -> tf.Tensor:
        """G(z) in float32, under the run's policy, in inference mode, from the average of G's
        weights under --ema-decay."""
        return tf.cast((self.average.module if self.average else self.generator)(z, training=False), tf.float32)

    def sample(self, z):
        """Samples for common/evaluation.py: NHWC images in [0, 1], or 2-D points."""
        fake = self.generate(z).numpy()
        return sampling.to_unit_range(fake, self.data.value_range) if self.data.kind == "image" else fake

    def write_samples(self, run, step: int):
        """A grid (or a scatter plot) from the run's fixed noise, the same in both frameworks."""
        if self._fixed_noise is None:
            self._fixed_noise = tf.constant(sampling.fixed_noise(run.path, *self.noise_shape, self.cfg.seed))
        fake = self.generate(self._fixed_noise).numpy()
        if self.data.kind == "image":
            sampling.save_image_grid(fake, run.sample_path(step), self.data.value_range)
        else:
            sampling.save_scatter(fake, run.sample_path(step), real=self.data.dataset.x[:MIXTURE_SAMPLES],
                                  title=f"{self.title} step {step}")


def train(cfg, hparams, build_networks, discriminator_loss, generator_loss) -> dict:
    """A GAN script's main() after its flags: set up the device and precision (the global
    policy, before any layer is built), load the data in the range of the model's
    hparams.PIXEL_RANGE, build G and D for it (`build_networks(data_shape, width)`) and their
    optimizers in the strategy's scope, and train."""
    runtime = setup(cfg)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    with runtime.strategy.scope():  # under --distribute: variables mirrored on every replica
        networks = build_networks(data.sample_shape, cfg.width)
        gan = GAN(networks["generator"], networks["discriminator"], discriminator_loss, generator_loss,
                  hparams.Z_DIM, cfg, runtime, data)
    return fit(cfg, runtime, gan, data)
