"""DCGAN (Radford et al., 2016) in TensorFlow/Keras, with automatic mixed precision.

    python GAN/dcgan/dcgan_tensorflow.py --amp                                  # MNIST, 28x28
    python GAN/dcgan/dcgan_tensorflow.py --dataset cifar10 --data-dir DATA      # 32x32x3
    python GAN/dcgan/dcgan_tensorflow.py --dataset folder --data-dir DIR --image-size 64

G: z as a 1x1 map -> one transposed convolution to the smallest map (7x7 for 28x28), then
transposed convolutions of stride 2, each doubling the side; every layer but the last is
followed by batch norm, ReLU and a 3x3 convolution at its resolution, the last by tanh -> image.
D: the mirror image, strided convolutions (batch norm on all but the first) and LeakyReLU, each
followed by a 3x3 convolution -> one logit.
The last layer of each is built with dtype="float32"; images stay NHWC, TensorFlow's native
layout. Batch norm is common/tensorflow/layers.py's: TensorFlow's fused kernel where oneDNN
or a GPU runs it (Keras' ops elsewhere), with the running variance moved as PyTorch moves
it; so are G's first and D's last layer, the convolutions from and to a 1x1 map, computed
there as the matmuls they are. Shapes below are (H x W x channels) for 28x28 MNIST at the
default width.

The training step, with its GradientTape, scale_loss and apply_gradients calls, is
GAN/gan_step_tensorflow.py, shared with the other GANs. The PyTorch twin is dcgan_pytorch.py;
the hyperparameters of both are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import keras
from keras import layers

from common.config import parse_args
from common.errors import exit_on_user_error
from common.tensorflow.layers import BatchNormalization, Conv2D, Conv2DTranspose
from GAN import gan_step_tensorflow as gan_step
from GAN.dcgan import hparams
from GAN.vanilla_gan.gan_tensorflow import discriminator_loss, generator_loss


# Convolutions ~ N(0, 0.02) (the DCGAN paper); batch-norm scale ~ N(1, 0.02), shift 0 (the
# PyTorch DCGAN example's weights_init).
def conv_init() -> dict:
    """A fresh initializer per layer, made after --seed is set: one made at import time
    would draw its seed before seeding (a different init every run) and give layers of the
    same shape the same weights."""
    return dict(use_bias=False, kernel_initializer=keras.initializers.RandomNormal(0.0, hparams.INIT_STD))


def batch_norm() -> BatchNormalization:
    return BatchNormalization(
        momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON,
        gamma_initializer=keras.initializers.RandomNormal(1.0, hparams.INIT_STD))


def refine(channels: int, activation) -> list[layers.Layer]:
    """hparams.REFINE_CONVS 3x3 convolutions (batch norm, `activation()`) that keep the size
    and the channels."""
    return [layer for _ in range(hparams.REFINE_CONVS)
            for layer in (layers.Conv2D(channels, 3, 1, "same", **conv_init()), batch_norm(), activation())]


def leaky_relu() -> layers.LeakyReLU:
    return layers.LeakyReLU(negative_slope=hparams.LEAKY_SLOPE)


def make_generator(image_shape: tuple, width: int) -> keras.Model:
    height, image_width, channels = image_shape
    base, upsamplings = hparams.geometry(height, image_width)
    features = width * 2 ** (upsamplings - 1)
    # z as 1x1x100 -> 7x7x64: one transposed convolution as large as the smallest map (a matmul)
    stack = [keras.Input((hparams.Z_DIM,)), layers.Reshape((1, 1, hparams.Z_DIM)),
             Conv2DTranspose(features, base, 1, "valid", **conv_init()),
             batch_norm(), layers.ReLU(), *refine(features, layers.ReLU)]  # 7x7x64 -> 7x7x64
    for _ in range(upsamplings - 1):  # 7x7x64 -> 14x14x32: each doubles the side, halves the channels
        stack += [layers.Conv2DTranspose(features // 2, 4, 2, "same", **conv_init()),
                  batch_norm(), layers.ReLU(), *refine(features // 2, layers.ReLU)]
        features //= 2
    # 14x14x32 -> 28x28x1, in float32
    stack += [layers.Conv2DTranspose(channels, 4, 2, "same", dtype="float32", **conv_init()),
              layers.Activation("tanh", dtype="float32")]
    return keras.Sequential(stack, name="generator")


def make_discriminator(image_shape: tuple, width: int) -> keras.Model:
    height, image_width, _ = image_shape
    base, downsamplings = hparams.geometry(height, image_width)
    features = width
    # 28x28x1 -> 14x14x32, no batch norm on the input
    stack = [keras.Input(image_shape),
             layers.Conv2D(features, 4, 2, "same", **conv_init()), leaky_relu(),
             *refine(features, leaky_relu)]  # 14x14x32 -> 14x14x32
    for _ in range(downsamplings - 1):  # 14x14x32 -> 7x7x64: each halves the side, doubles the channels
        stack += [layers.Conv2D(features * 2, 4, 2, "same", **conv_init()),
                  batch_norm(), leaky_relu(), *refine(features * 2, leaky_relu)]
        features *= 2
    # 7x7x64 -> 1x1x1, one logit in float32 (a matmul)
    stack += [Conv2D(1, base, 1, "valid", dtype="float32", **conv_init()),
              layers.Flatten(dtype="float32")]
    return keras.Sequential(stack, name="discriminator")


def build_networks(data_shape: tuple, width: int) -> dict[str, keras.Model]:
    """G and D for images of this (H, W, C) shape: what main() trains, scripts/parity.py ports."""
    return {"generator": make_generator(data_shape, width), "discriminator": make_discriminator(data_shape, width)}


# The losses are the vanilla GAN's: non-saturating BCE on logits, in float32.

@exit_on_user_error
def main(argv=None):
    cfg = parse_args("dcgan", "tensorflow", argv)
    return gan_step.train(cfg, hparams, build_networks, discriminator_loss, generator_loss)


if __name__ == "__main__":
    main()
