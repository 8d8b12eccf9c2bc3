"""Least-squares GAN (Mao et al., 2017) in TensorFlow/Keras, with automatic mixed precision.

    python GAN/least_squares_gan/lsgan_tensorflow.py --amp

The vanilla GAN's networks and training step with least-squares losses in place of the
cross-entropy ones: D regresses real to 1 and fake to 0, G pushes D's score of its fakes to 1.
D's output is an unbounded score (no sigmoid), squared in float32.

The training step, with its GradientTape, scale_loss and apply_gradients calls, is
GAN/gan_step_tensorflow.py, shared with the vanilla GAN and DCGAN. The PyTorch twin is
lsgan_pytorch.py; the hyperparameters of both are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import tensorflow as tf

from common.config import parse_args
from common.errors import exit_on_user_error
from GAN import gan_step_tensorflow as gan_step
from GAN.least_squares_gan import hparams
from GAN.vanilla_gan.gan_tensorflow import build_networks  # the vanilla GAN's networks


def discriminator_loss(real_scores, fake_scores):
    """0.5 E[(D(x) - 1)^2] + 0.5 E[D(G(z))^2]"""
    real_scores, fake_scores = tf.cast(real_scores, tf.float32), tf.cast(fake_scores, tf.float32)
    return 0.5 * tf.reduce_mean((real_scores - 1) ** 2) + 0.5 * tf.reduce_mean(fake_scores ** 2)


def generator_loss(fake_scores):
    """0.5 E[(D(G(z)) - 1)^2]"""
    return 0.5 * tf.reduce_mean((tf.cast(fake_scores, tf.float32) - 1) ** 2)


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("lsgan", "tensorflow", argv)
    return gan_step.train(cfg, hparams, build_networks, discriminator_loss, generator_loss)


if __name__ == "__main__":
    main()
