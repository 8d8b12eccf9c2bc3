"""Vanilla GAN (Goodfellow et al., 2014) in TensorFlow/Keras, with automatic mixed precision.

    python GAN/vanilla_gan/gan_tensorflow.py --amp            # MNIST, mixed_bfloat16 on CPU
    python GAN/vanilla_gan/gan_tensorflow.py --dataset ring8  # 2-D ring of 8 Gaussians

Two one-hidden-layer MLPs. D returns logits and the losses take logits, computed in float32;
the output layers are built with dtype="float32" so they stay in float32 under the policy.
The PyTorch twin is gan_pytorch.py; the hyperparameters of both are in hparams.py.
"""
import math

import keras
import tensorflow as tf
from keras import layers

from common import tf_gan
from common.config import parse_args
from common.errors import exit_on_user_error
from GAN.vanilla_gan import hparams

# Glorot-uniform weights, zero biases (Keras' defaults, set here because the twin sets them).
DENSE_INIT = dict(kernel_initializer="glorot_uniform", bias_initializer="zeros")


def make_generator(data_shape: tuple, squash: bool) -> keras.Model:
    """z -> 128 (ReLU) -> data. tanh for images in [-1, 1]; linear for 2-D points."""
    return keras.Sequential([
        keras.Input((hparams.Z_DIM,)),
        layers.Dense(hparams.HIDDEN, activation="relu", **DENSE_INIT),
        layers.Dense(math.prod(data_shape), dtype="float32", **DENSE_INIT),
        layers.Activation("tanh" if squash else "linear", dtype="float32"),
        layers.Reshape(data_shape),
    ], name="generator")


def make_discriminator(data_shape: tuple) -> keras.Model:
    """data -> 128 (LeakyReLU) -> one logit, computed in float32."""
    return keras.Sequential([
        keras.Input(data_shape),
        layers.Flatten(),
        layers.Dense(hparams.HIDDEN, **DENSE_INIT),
        layers.LeakyReLU(negative_slope=hparams.LEAKY_SLOPE),
        layers.Dense(1, dtype="float32", **DENSE_INIT),
    ], name="discriminator")


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
    cfg = parse_args("vanilla_gan", "tensorflow", hparams.DEFAULTS, argv)
    return tf_gan.train(
        cfg,
        generator_for=lambda data: make_generator(data.sample_shape, squash=data.kind == "image"),
        discriminator_for=lambda data: make_discriminator(data.sample_shape),
        discriminator_loss=discriminator_loss, generator_loss=generator_loss,
        z_dim=hparams.Z_DIM)


if __name__ == "__main__":
    main()
