"""DCGAN (Radford et al., 2016) in PyTorch, with automatic mixed precision.

    python GAN/dcgan/dcgan_pytorch.py --amp                                  # MNIST, 28x28
    python GAN/dcgan/dcgan_pytorch.py --dataset cifar10 --data-dir DATA      # 32x32x3
    python GAN/dcgan/dcgan_pytorch.py --dataset folder --data-dir DIR --image-size 64

G: z as a 1x1 map -> one transposed convolution to the smallest map (7x7 for 28x28), then
transposed convolutions of stride 2, each doubling the side; every layer but the last is
followed by batch norm, ReLU and a 3x3 convolution at its resolution, the last by tanh -> image.
D: the mirror image, strided convolutions (batch norm on all but the first) and LeakyReLU, each
followed by a 3x3 convolution -> one logit.
The last layer of each runs in float32 under autocast; weights and images are stored
channels_last (NHWC), the layout oneDNN's CPU kernels and CUDA's tensor cores run fastest.
G's first and D's last layer, the convolutions from and to a 1x1 map, are
common/pytorch/layers.py's, computed as the matmuls they are.
Shapes below are (H x W x channels) for 28x28 MNIST at the default width.

The training step, with its autocast and GradScaler calls, is GAN/gan_step_pytorch.py, shared
with the other GANs. The TensorFlow twin is dcgan_tensorflow.py; the hyperparameters of both
are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed

import torch
from torch import nn

from common.config import parse_args
from common.errors import exit_on_user_error
from common.pytorch.amp import FullPrecision
from common.pytorch.layers import Conv2d, ConvTranspose2d
from GAN import gan_step_pytorch as gan_step
from GAN.dcgan import hparams
from GAN.vanilla_gan.gan_pytorch import discriminator_loss, generator_loss


def batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, momentum=hparams.BN_MOMENTUM, eps=hparams.BN_EPSILON)


def refine(channels: int, activation) -> list[nn.Module]:
    """hparams.REFINE_CONVS 3x3 convolutions (batch norm, `activation()`) that keep the size
    and the channels."""
    return [layer for _ in range(hparams.REFINE_CONVS)
            for layer in (nn.Conv2d(channels, channels, 3, 1, 1, bias=False), batch_norm(channels), activation())]


def leaky_relu() -> nn.LeakyReLU:
    return nn.LeakyReLU(hparams.LEAKY_SLOPE)


def init_weights(module: nn.Module):
    """Convolutions ~ N(0, 0.02) (the DCGAN paper); batch-norm scale ~ N(1, 0.02), shift 0 (the
    PyTorch DCGAN example's weights_init)."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(layer.weight, 0.0, hparams.INIT_STD)
        elif isinstance(layer, nn.BatchNorm2d):
            nn.init.normal_(layer.weight, 1.0, hparams.INIT_STD)
            nn.init.zeros_(layer.bias)


class Generator(nn.Module):
    def __init__(self, image_shape: tuple, width: int):
        super().__init__()
        channels, height, image_width = image_shape
        base, upsamplings = hparams.geometry(height, image_width)
        features = width * 2 ** (upsamplings - 1)
        # z as 1x1x100 -> 7x7x64: one transposed convolution as large as the smallest map (a matmul)
        layers = [ConvTranspose2d(hparams.Z_DIM, features, base, 1, 0, bias=False),
                  batch_norm(features), nn.ReLU(), *refine(features, nn.ReLU)]  # 7x7x64 -> 7x7x64
        for _ in range(upsamplings - 1):  # 7x7x64 -> 14x14x32: each doubles the side, halves the channels
            layers += [nn.ConvTranspose2d(features, features // 2, 4, 2, 1, bias=False),
                       batch_norm(features // 2), nn.ReLU(), *refine(features // 2, nn.ReLU)]
            features //= 2
        self.body = nn.Sequential(*layers)
        # 14x14x32 -> 28x28x1, in float32
        self.out = FullPrecision(nn.ConvTranspose2d(features, channels, 4, 2, 1, bias=False))
        init_weights(self)

    def forward(self, z):
        return torch.tanh(self.out(self.body(z.view(z.shape[0], -1, 1, 1))))


class Discriminator(nn.Module):
    def __init__(self, image_shape: tuple, width: int):
        super().__init__()
        channels, height, image_width = image_shape
        base, downsamplings = hparams.geometry(height, image_width)
        features = width
        # 28x28x1 -> 14x14x32, no batch norm on the input
        layers = [nn.Conv2d(channels, features, 4, 2, 1, bias=False), leaky_relu(),
                  *refine(features, leaky_relu)]  # 14x14x32 -> 14x14x32
        for _ in range(downsamplings - 1):  # 14x14x32 -> 7x7x64: each halves the side, doubles the channels
            layers += [nn.Conv2d(features, features * 2, 4, 2, 1, bias=False),
                       batch_norm(features * 2), leaky_relu(), *refine(features * 2, leaky_relu)]
            features *= 2
        self.body = nn.Sequential(*layers)
        # 7x7x64 -> 1x1x1, one logit in float32 (a matmul)
        self.out = FullPrecision(Conv2d(features, 1, base, 1, 0, bias=False))
        init_weights(self)

    def forward(self, x):
        return self.out(self.body(x)).view(-1, 1)


def build_networks(data_shape: tuple, width: int) -> dict[str, nn.Module]:
    """G and D for images of this (C, H, W) shape: what main() trains, scripts/parity.py ports."""
    return {"generator": Generator(data_shape, width), "discriminator": Discriminator(data_shape, width)}


# The losses are the vanilla GAN's: non-saturating BCE on logits, in float32.

@exit_on_user_error
def main(argv=None):
    cfg = parse_args("dcgan", "pytorch", argv)
    return gan_step.train(cfg, hparams, build_networks, discriminator_loss, generator_loss)


if __name__ == "__main__":
    main()
