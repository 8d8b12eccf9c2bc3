"""Vanilla GAN (Goodfellow et al., 2014) in PyTorch, with automatic mixed precision.

    python GAN/vanilla_gan/gan_pytorch.py --amp            # MNIST, bfloat16 on CPU
    python GAN/vanilla_gan/gan_pytorch.py --dataset ring8  # 2-D ring of 8 Gaussians

Two MLPs (sizes in hparams.py). D returns logits, and the losses take logits: sigmoid + BCELoss
raises under CUDA autocast (it is unsafe in float16), BCE-with-logits is fused and stable.

The training step, with its autocast and GradScaler calls, is GAN/gan_step_pytorch.py, shared
with LSGAN and DCGAN. The TensorFlow twin is gan_tensorflow.py; the hyperparameters of both
are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed

import math

import torch
import torch.nn.functional as F
from torch import nn

from common.config import parse_args
from common.errors import exit_on_user_error
from common.pytorch.amp import FullPrecision
from common.pytorch.layers import init_like_keras_dense
from GAN import gan_step_pytorch as gan_step
from GAN.vanilla_gan import hparams


def hidden_layers(units_in: int, widths: list[int]) -> list[nn.Module]:
    """Linear + LeakyReLU for each width in turn."""
    layers = []
    for units in widths:
        layers += [nn.Linear(units_in, units), nn.LeakyReLU(hparams.LEAKY_SLOPE)]
        units_in = units
    return layers


class Generator(nn.Module):
    """z -> 256 -> 512 -> 1024 (LeakyReLU; at the default --width) -> data: tanh for images in
    [-1, 1], linear for 2-D points."""

    def __init__(self, data_shape: tuple, width: int):
        super().__init__()
        self.data_shape, self.squash = data_shape, len(data_shape) == 3  # (C, H, W) images
        widths = [width * k for k in hparams.G_HIDDEN]
        self.hidden = nn.Sequential(*hidden_layers(hparams.Z_DIM, widths))
        self.out = FullPrecision(nn.Linear(widths[-1], math.prod(data_shape)))
        init_like_keras_dense(self)

    def forward(self, z):
        x = self.out(self.hidden(z))
        if self.squash:
            x = torch.tanh(x)
        return x.view(-1, *self.data_shape)


class PackSamples(nn.Module):
    """(batch, ...) -> (batch / pack, pack * features): consecutive samples side by side, so D
    judges `pack` of them at once (PacGAN, Lin et al., 2018). pack 1 is a plain flatten."""

    def __init__(self, pack: int):
        super().__init__()
        self.pack = pack

    def forward(self, x):
        return x.reshape(x.shape[0] // self.pack, -1)


class Discriminator(nn.Module):
    """data -> 512 -> 256 (LeakyReLU; at the default --width) -> one logit, computed in float32.
    On 2-D points it judges hparams.POINT_PACK samples together (one logit each pack), which
    keeps G from collapsing."""

    def __init__(self, data_shape: tuple, width: int):
        super().__init__()
        pack = hparams.pack(data_shape)
        widths = [width * k for k in hparams.D_HIDDEN]
        self.hidden = nn.Sequential(PackSamples(pack), *hidden_layers(pack * math.prod(data_shape), widths))
        self.out = FullPrecision(nn.Linear(widths[-1], 1))
        init_like_keras_dense(self)

    def forward(self, x):
        return self.out(self.hidden(x))


def build_networks(data_shape: tuple, width: int) -> dict[str, nn.Module]:
    """G and D for data of this shape, (C, H, W) or (2,): what main() trains, scripts/parity.py ports."""
    return {"generator": Generator(data_shape, width), "discriminator": Discriminator(data_shape, width)}


# Non-saturating GAN losses on logits, in float32.
def discriminator_loss(real_logits, fake_logits):
    real_logits, fake_logits = real_logits.float(), fake_logits.float()
    return (F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits))
            + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits)))


def generator_loss(fake_logits):
    fake_logits = fake_logits.float()
    return F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("vanilla_gan", "pytorch", argv)
    return gan_step.train(cfg, hparams, build_networks, discriminator_loss, generator_loss)


if __name__ == "__main__":
    main()
