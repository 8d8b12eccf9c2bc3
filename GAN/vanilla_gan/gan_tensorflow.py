"""Vanilla GAN (Goodfellow et al., 2014) in TensorFlow/Keras, with automatic mixed precision.

    python GAN/vanilla_gan/gan_tensorflow.py --amp            # MNIST, mixed_bfloat16 on CPU
    python GAN/vanilla_gan/gan_tensorflow.py --dataset ring8  # 2-D ring of 8 Gaussians

Two MLPs (sizes in hparams.py). D returns logits and the losses take logits, computed in float32;
the output layers are built with dtype="float32" so they stay in float32 under the policy.

The training step, with its GradientTape, scale_loss and apply_gradients calls, is
GAN/gan_step_tensorflow.py, shared with LSGAN and DCGAN. The PyTorch twin is gan_pytorch.py;
the hyperparameters of both are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import math

import keras
import tensorflow as tf
from keras import layers

from common.config import parse_args
from common.errors import exit_on_user_error
from common.tensorflow.layers import DENSE_INIT
from GAN import gan_step_tensorflow as gan_step
from GAN.vanilla_gan import hparams


def hidden_layers(widths: list[int]) -> list[layers.Layer]:
    """Dense + LeakyReLU for each width in turn."""
    return [layer for units in widths
            for layer in (layers.Dense(units, **DENSE_INIT), layers.LeakyReLU(negative_slope=hparams.LEAKY_SLOPE))]


def make_generator(data_shape: tuple, width: int) -> keras.Model:
    """z -> 256 -> 512 -> 1024 (LeakyReLU; at the default --width) -> data: tanh for images in
    [-1, 1], linear for 2-D points."""
    squash = len(data_shape) == 3  # (H, W, C) images
    return keras.Sequential([
        keras.Input((hparams.Z_DIM,)),
        *hidden_layers([width * k for k in hparams.G_HIDDEN]),
        layers.Dense(math.prod(data_shape), dtype="float32", **DENSE_INIT),
        layers.Activation("tanh" if squash else "linear", dtype="float32"),
        layers.Reshape(data_shape, dtype="float32"),
    ], name="generator")


class PackSamples(layers.Layer):
    """(batch, ...) -> (batch / pack, pack * features): consecutive samples side by side, so D
    judges `pack` of them at once (PacGAN, Lin et al., 2018). pack 1 is a plain flatten."""

    def __init__(self, pack: int, **kwargs):
        super().__init__(**kwargs)
        self.pack = pack

    def call(self, x):
        return tf.reshape(x, (tf.shape(x)[0] // self.pack, self.pack * math.prod(x.shape[1:])))

    def compute_output_shape(self, input_shape):
        return (None, self.pack * math.prod(input_shape[1:]))

    def get_config(self):  # Keras rebuilds a layer from its config (clone_model, saving)
        return {**super().get_config(), "pack": self.pack}


def make_discriminator(data_shape: tuple, width: int) -> keras.Model:
    """data -> 512 -> 256 (LeakyReLU; at the default --width) -> one logit, computed in float32.
    On 2-D points it judges hparams.POINT_PACK samples together (one logit each pack), which
    keeps G from collapsing."""
    return keras.Sequential([
        keras.Input(data_shape),
        PackSamples(hparams.pack(data_shape)),
        *hidden_layers([width * k for k in hparams.D_HIDDEN]),
        layers.Dense(1, dtype="float32", **DENSE_INIT),
    ], name="discriminator")


def build_networks(data_shape: tuple, width: int) -> dict[str, keras.Model]:
    """G and D for data of this shape, (H, W, C) or (2,): what main() trains, scripts/parity.py ports."""
    return {"generator": make_generator(data_shape, width), "discriminator": make_discriminator(data_shape, width)}


# Non-saturating GAN losses on logits, in float32.
def discriminator_loss(real_logits, fake_logits):
    real_logits, fake_logits = tf.cast(real_logits, tf.float32), tf.cast(fake_logits, tf.float32)
    return (tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.ones_like(real_logits), logits=real_logits))
            + tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.zeros_like(fake_logits), logits=fake_logits)))


def generator_loss(fake_logits):
    fake_logits = tf.cast(fake_logits, tf.float32)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.ones_like(fake_logits), logits=fake_logits))


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("vanilla_gan", "tensorflow", argv)
    return gan_step.train(cfg, hparams, build_networks, discriminator_loss, generator_loss)


if __name__ == "__main__":
    main()
