"""WGAN-GP (Gulrajani et al., 2017) in TensorFlow/Keras, with automatic mixed precision.

    python GAN/wgan_gp/wgan_gp_tensorflow.py --amp                     # MNIST, convolutional
    python GAN/wgan_gp/wgan_gp_tensorflow.py --dataset ring8 --iters 1000  # 2-D ring, MLPs

A critic f scores real examples high and fake ones low; it minimises
    E[f(G(z))] - E[f(x)] + lambda * E[(||grad f(x_hat)|| - 1)^2],
with x_hat = eps * x + (1 - eps) * G(z), eps ~ U(0, 1) per example, and the gradient's norm
taken per example over all its pixels. G minimises -E[f(G(z))]. Images: DCGAN's generator
and, as the critic, the DCGAN paper's discriminator without batch norm; 2-D points: MLPs of
3 hidden ReLU layers. The last layer of each is built with dtype="float32"; losses are float32.

--batch-size counts the examples of one generator iteration: 5 critic batches. Each
iteration splits the loop's batch into hparams.CRITIC_STEPS critic batches and updates the
critic once on each (fresh noise each time), then G once on a fresh noise batch of the
critic-batch size, as the paper's Algorithm 1.

The gradient penalty under AMP, as a TensorFlow maintainer gave it (tensorflow#48662), in
Keras 3's names: an inner tape differentiates the critic's output scaled by the critic's
LossScaleOptimizer (`scale_loss`), the gradients are cast to float32 and divided by its
current `dynamic_scale`, the penalty is computed from them; the outer tape records all of it,
and the critic's loss is scaled again and applied through the LossScaleOptimizer, which
unscales, skips the step on inf/NaN and adjusts the scale. Under bfloat16 and float32 the
optimizers are plain ones: nothing is scaled. Each optimizer has a scale of its own: the
critic's counts 5 updates an iteration towards --growth-interval, G's 1 (the PyTorch twin's
one GradScaler counts 6), and the history's loss_scale is the smaller of the two.
The training step, with its GradientTape, scale_loss and apply_gradients calls, is
WGANGP.train_step below. The PyTorch twin is wgan_gp_pytorch.py; the hyperparameters of both
are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import keras
import tensorflow as tf
from keras import layers

from common.config import parse_args
from common.errors import exit_on_user_error
from common.tensorflow.amp import SkippedUpdates
from common.tensorflow.data import load_data
from common.tensorflow.layers import DENSE_INIT, Conv2D
from common.tensorflow.runtime import Runtime, setup
from common.tensorflow.session import fit
from GAN.dcgan import hparams as dcgan_hparams
from GAN.dcgan.dcgan_tensorflow import make_generator
from GAN.gan_step_tensorflow import GAN
from GAN.wgan_gp import hparams


def conv_init() -> dict:
    """N(0, 0.02) weights as DCGAN's, zero biases; a fresh initializer per layer, made after
    --seed is set."""
    return dict(kernel_initializer=keras.initializers.RandomNormal(0.0, hparams.INIT_STD),
                bias_initializer="zeros")


def make_critic(image_shape: tuple, width: int) -> keras.Model:
    """The DCGAN paper's discriminator without batch norm (biases instead; hparams.py says why
    it leaves out GAN/dcgan's 3x3 convolutions): strided convolutions with
    LeakyReLU 0.2 down to one unbounded score, the last layer in float32."""
    height, image_width, _ = image_shape
    base, downsamplings = dcgan_hparams.geometry(height, image_width)
    features = width
    # 28x28x1 -> 14x14x32
    stack = [keras.Input(image_shape), layers.Conv2D(features, 4, 2, "same", **conv_init()),
             layers.LeakyReLU(negative_slope=hparams.LEAKY_SLOPE)]
    for _ in range(downsamplings - 1):  # 14x14x32 -> 7x7x64: each halves the side, doubles the channels
        stack += [layers.Conv2D(features * 2, 4, 2, "same", **conv_init()),
                  layers.LeakyReLU(negative_slope=hparams.LEAKY_SLOPE)]
        features *= 2
    # 7x7x64 -> 1x1x1, one score in float32 (a matmul: common/tensorflow/layers.py, as DCGAN's D)
    stack += [Conv2D(1, base, 1, "valid", dtype="float32", **conv_init()), layers.Flatten(dtype="float32")]
    return keras.Sequential(stack, name="critic")


def make_mlp(inputs: int, units: int, outputs: int, name: str) -> keras.Model:
    """The 2-D mixtures' networks: inputs -> 3 x (units, ReLU) -> outputs, the last in float32
    (G: z -> a point; the critic: a point -> one score)."""
    stack = [keras.Input((inputs,))]
    stack += [layers.Dense(units, activation="relu", **DENSE_INIT) for _ in range(hparams.POINT_HIDDEN_LAYERS)]
    stack += [layers.Dense(outputs, dtype="float32", **DENSE_INIT)]
    return keras.Sequential(stack, name=name)


def build_networks(data_shape: tuple, width: int) -> dict[str, keras.Model]:
    """G and the critic (named "discriminator", as in every GAN's checkpoints) for data of this
    shape, (H, W, C) images or (2,) points: what main() trains, scripts/parity.py ports."""
    if len(data_shape) == 3:
        return {"generator": make_generator(data_shape, width), "discriminator": make_critic(data_shape, width)}
    units = hparams.point_units(width)
    return {"generator": make_mlp(hparams.Z_DIM, units, data_shape[0], "generator"),
            "discriminator": make_mlp(data_shape[0], units, 1, "critic")}


# --- losses, in float32 ----------------------------------------------------------------------
def gradient_penalty(critic: keras.Model, real, fake, eps, optimizer):
    """E[(||grad critic(x_hat)|| - 1)^2], the norm per example over all pixels, in float32.

    Under float16 the critic's output is scaled by the critic's LossScaleOptimizer before
    differentiating, as the loss will be, so small gradients do not underflow; the gradients
    are then divided by its current scale. A plain optimizer (float32, bfloat16) scales by 1."""
    x_hat = eps * real + (1.0 - eps) * fake
    with tf.GradientTape() as tape:
        tape.watch(x_hat)
        scaled_scores = optimizer.scale_loss(critic(x_hat, training=True))
    gradients = tf.cast(tape.gradient(scaled_scores, x_hat), tf.float32)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        gradients = gradients / tf.cast(optimizer.dynamic_scale, tf.float32)
    gradients = tf.reshape(gradients, [tf.shape(gradients)[0], -1])
    norm = tf.sqrt(tf.reduce_sum(tf.square(gradients), axis=1) + hparams.NORM_EPSILON)
    return tf.reduce_mean(tf.square(norm - 1.0))


def critic_loss(real_scores, fake_scores, penalty, penalty_weight):
    """E[f(G(z))] - E[f(x)] + lambda * penalty: the critic's estimate of the Wasserstein
    distance, negated, plus the penalty (lambda: hparams.penalty_weight)."""
    return (tf.reduce_mean(tf.cast(fake_scores, tf.float32)) - tf.reduce_mean(tf.cast(real_scores, tf.float32))
            + penalty_weight * tf.cast(penalty, tf.float32))


def generator_loss(fake_scores):
    return -tf.reduce_mean(tf.cast(fake_scores, tf.float32))


class WGANGP(GAN):
    """The shared GAN's networks, optimizers, noise, samples and evaluation
    (GAN/gan_step_tensorflow.py), with WGAN-GP's own training step. The critic is the GAN's
    discriminator, and each optimizer a LossScaleOptimizer under float16."""

    def __init__(self, generator: keras.Model, critic: keras.Model, cfg, runtime: Runtime, data):
        # No loss functions for GAN's step: train_step below calls critic_loss and generator_loss.
        super().__init__(generator, critic, None, None, hparams.Z_DIM, cfg, runtime, data)
        self.critic, self.critic_optimizer = self.discriminator, self.d_optimizer
        self.penalty_weight = hparams.penalty_weight(data.sample_shape)  # lambda: 10 on images, 0.1 on points

    def train_step(self, real):
        generator, critic = self.generator, self.critic
        c_variables, g_variables = critic.trainable_variables, generator.trainable_variables
        eps_shape = (1,) * (len(real.shape) - 1)  # one eps per example, broadcast over its pixels
        totals = tf.zeros(3)  # critic loss, penalty, Wasserstein estimate
        # Under float16, whether any of the 6 updates was skipped (the scales are compared around
        # each update: over the iteration the critic's doubling and halving would cancel out).
        skips = SkippedUpdates([self.critic_optimizer, self.g_optimizer])
        # Under --distribute each critic batch was sharded on its own (hparams.batch_division),
        # so part i here is this replica's share of critic batch i, as in one process.
        for real_part in tf.split(real, hparams.CRITIC_STEPS):  # unrolled by tf.function
            count = tf.shape(real_part)[0]
            z = self.replicas.normal(self.noise, count, self.z_dim)  # noise.normal in one process
            eps = self.replicas.uniform(self.noise, count, *eps_shape)
            fake = generator(z, training=True)  # outside the tape: no gradient through G
            with tf.GradientTape() as critic_tape:
                real_scores, fake_scores = critic(real_part, training=True), critic(fake, training=True)
                penalty = gradient_penalty(critic, real_part, fake, eps, self.critic_optimizer)
                c_loss = critic_loss(real_scores, fake_scores, penalty, self.penalty_weight)
                scaled_c_loss = self.critic_optimizer.scale_loss(self.replicas.share(c_loss))
            c_gradients = critic_tape.gradient(scaled_c_loss, c_variables)
            self.critic_optimizer.apply_gradients(zip(c_gradients, c_variables))  # unscales; skips on inf/NaN
            skips.after_update()
            wasserstein = (tf.reduce_mean(tf.cast(real_scores, tf.float32))
                           - tf.reduce_mean(tf.cast(fake_scores, tf.float32)))
            totals += tf.stack([c_loss, penalty, wasserstein])

        # G's update: a fresh noise batch of the critic-batch size, through the updated critic.
        z = self.replicas.normal(self.noise, tf.shape(real)[0] // hparams.CRITIC_STEPS, self.z_dim)
        with tf.GradientTape() as g_tape:
            g_loss = generator_loss(critic(generator(z, training=True), training=True))
            scaled_g_loss = self.g_optimizer.scale_loss(self.replicas.share(g_loss))
        g_gradients = g_tape.gradient(scaled_g_loss, g_variables)
        self.g_optimizer.apply_gradients(zip(g_gradients, g_variables))
        skips.after_update()
        if self.average:
            self.average.update(generator)

        d_loss, penalty, wasserstein = tf.unstack(totals / hparams.CRITIC_STEPS)  # means over the critic steps
        return {"d_loss": d_loss, "g_loss": g_loss, "penalty": penalty, "wasserstein": wasserstein,
                **skips.metrics()}  # "skipped" under float16


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("wgan_gp", "tensorflow", argv)  # refuses a --batch-size not a multiple of 5
    runtime = setup(cfg)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    with runtime.strategy.scope():  # under --distribute: variables mirrored on every replica
        networks = build_networks(data.sample_shape, cfg.width)
        wgan = WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
    return fit(cfg, runtime, wgan, data)


if __name__ == "__main__":
    main()
