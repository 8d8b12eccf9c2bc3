"""The GAN training iteration in TensorFlow/Keras, shared by the vanilla GAN, LSGAN and DCGAN:
they differ only in their networks and their two loss functions. Twin of common/torch_gan.py.

One iteration (compiled once by tf.function), with AMP:
    1. generate one fake batch;
    2. update D on real vs. that fake batch, under a tape that sees only D's weights;
    3. update G through the just-updated D on the same fake batch, whose forward pass the
       outer tape recorded (G runs once per iteration, as in the PyTorch twin);
    4. each optimizer, a LossScaleOptimizer under float16, scales its loss, unscales its
       gradients and skips its own step on inf/NaN.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from common import sampling
from common import tf_backend as backend
from common.tf_backend import Runtime, apply_gradients, make_optimizer

SCATTER_POINTS = 2500  # the 2-D mixture protocol's sample count
GRID_IMAGES = 64


class GAN(keras.Model):
    def __init__(self, generator: keras.Model, discriminator: keras.Model, discriminator_loss,
                 generator_loss, z_dim: int, cfg, runtime: Runtime, data):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator
        self.discriminator_loss, self.generator_loss = discriminator_loss, generator_loss
        self.z_dim, self.cfg, self.runtime, self.data = z_dim, cfg, runtime, data
        self.g_optimizer = make_optimizer(cfg, runtime)
        self.d_optimizer = make_optimizer(cfg, runtime)
        self.g_optimizer.build(generator.trainable_variables)  # checkpoints need the slots now
        self.d_optimizer.build(discriminator.trainable_variables)
        self.noise = tf.random.Generator.from_seed(cfg.seed)
        self.modules = {"generator": generator, "discriminator": discriminator}
        self.optimizers = {"generator": self.g_optimizer, "discriminator": self.d_optimizer}
        self._fixed_noise = None

    def train_step(self, real):
        generator, discriminator = self.generator, self.discriminator
        z = self.noise.normal((tf.shape(real)[0], self.z_dim))

        with tf.GradientTape() as g_tape:
            fake = generator(z, training=True)
            with g_tape.stop_recording():  # D's update is not part of G's gradient
                with tf.GradientTape() as d_tape:
                    d_loss = self.discriminator_loss(discriminator(real, training=True),
                                                     discriminator(fake, training=True))
                    scaled_d_loss = self.d_optimizer.scale_loss(d_loss)
                d_variables = discriminator.trainable_variables
                d_skipped = apply_gradients(self.d_optimizer,
                                            d_tape.gradient(scaled_d_loss, d_variables),
                                            d_variables)
            g_loss = self.generator_loss(discriminator(fake, training=True))
            scaled_g_loss = self.g_optimizer.scale_loss(g_loss)
        g_variables = generator.trainable_variables
        g_skipped = apply_gradients(self.g_optimizer, g_tape.gradient(scaled_g_loss, g_variables),
                                    g_variables)

        metrics = {"d_loss": d_loss, "g_loss": g_loss}
        if self.runtime.loss_scaling:
            metrics["skipped"] = tf.maximum(d_skipped, g_skipped)
        return metrics

    def sample(self, z):
        """Generated samples for evaluation (inference mode, the run's policy): NHWC images in
        [0, 1], or 2-D points."""
        fake = tf.cast(self.generator(z, training=False), tf.float32).numpy()
        return (fake + 1.0) / 2.0 if self.data.kind == "image" else fake

    def write_samples(self, run, step: int):
        """Generate from the run's fixed noise (inference mode, under the run's policy)."""
        count = GRID_IMAGES if self.data.kind == "image" else SCATTER_POINTS
        if self._fixed_noise is None:
            self._fixed_noise = tf.constant(
                sampling.fixed_noise(run.path, count, self.z_dim, self.cfg.seed))
        fake = tf.cast(self.generator(self._fixed_noise, training=False), tf.float32).numpy()
        if self.data.kind == "image":
            sampling.save_image_grid(fake, run.sample_path(step))
        else:
            real = self.data.dataset.x[:SCATTER_POINTS]
            sampling.save_scatter(fake, run.sample_path(step), real=real,
                                  title=f"{self.cfg.model} tensorflow {self.runtime.precision} "
                                        f"step {step}")


def train(cfg, generator_for, discriminator_for, discriminator_loss, generator_loss,
          z_dim: int) -> dict:
    """Set up the device and precision, load the data, build G and D for it
    (`generator_for(data)`, `discriminator_for(data)`), and train: a GAN script's main()."""
    runtime = backend.setup(cfg)
    data = backend.load_data(cfg, runtime)
    gan = GAN(generator_for(data), discriminator_for(data), discriminator_loss, generator_loss,
              z_dim, cfg, runtime, data)
    return backend.fit(cfg, runtime, gan, data)
