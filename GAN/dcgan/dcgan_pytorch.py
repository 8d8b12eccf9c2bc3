"""DCGAN (Radford et al., 2016) in PyTorch, with automatic mixed precision.

    python GAN/dcgan/dcgan_pytorch.py --amp                                  # MNIST, 28x28
    python GAN/dcgan/dcgan_pytorch.py --dataset cifar10 --data-dir DATA      # 32x32x3
    python GAN/dcgan/dcgan_pytorch.py --dataset folder --data-dir DIR --image-size 64

G: z as a 1x1 map -> transposed convolutions (stride 2, batch norm, ReLU) -> tanh image.
D: the mirror image, strided convolutions with batch norm and LeakyReLU -> one logit.
The last layer of each runs in float32 under autocast; on CUDA the convolutions use the
channels_last layout, which tensor cores want. The TensorFlow twin is dcgan_tensorflow.py;
the hyperparameters of both are in hparams.py.
"""
import torch
from torch import nn

from common import torch_backend as backend
from common import torch_gan
from common.config import parse_args, require_image_dataset
from common.errors import exit_on_user_error
from GAN.dcgan import hparams
from GAN.vanilla_gan.gan_pytorch import discriminator_loss, generator_loss


def batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, momentum=hparams.BN_MOMENTUM, eps=hparams.BN_EPSILON)


def init_weights(module: nn.Module):
    """Convolutions ~ N(0, 0.02); batch-norm scale ~ N(1, 0.02), shift 0 (the DCGAN paper)."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(layer.weight, 0.0, hparams.INIT_STD)
        elif isinstance(layer, nn.BatchNorm2d):
            nn.init.normal_(layer.weight, 1.0, hparams.INIT_STD)
            nn.init.zeros_(layer.bias)


class Generator(nn.Module):
    def __init__(self, image_shape: tuple):
        super().__init__()
        channels, height, width = image_shape
        base, upsamplings = hparams.geometry(height, width)
        features = hparams.G_FEATURES * 2 ** (upsamplings - 1)
        layers = [nn.ConvTranspose2d(hparams.Z_DIM, features, base, 1, 0, bias=False),  # 1 -> base
                  batch_norm(features), nn.ReLU()]
        for _ in range(upsamplings - 1):  # each doubles the side, halves the channels
            layers += [nn.ConvTranspose2d(features, features // 2, 4, 2, 1, bias=False),
                       batch_norm(features // 2), nn.ReLU()]
            features //= 2
        self.body = nn.Sequential(*layers)
        self.out = backend.FullPrecision(nn.ConvTranspose2d(features, channels, 4, 2, 1,
                                                            bias=False))
        init_weights(self)

    def forward(self, z):
        return torch.tanh(self.out(self.body(z.view(z.shape[0], -1, 1, 1))))


class Discriminator(nn.Module):
    def __init__(self, image_shape: tuple):
        super().__init__()
        channels, height, width = image_shape
        base, downsamplings = hparams.geometry(height, width)
        features = hparams.D_FEATURES
        layers = [nn.Conv2d(channels, features, 4, 2, 1, bias=False),  # no batch norm on input
                  nn.LeakyReLU(hparams.LEAKY_SLOPE)]
        for _ in range(downsamplings - 1):  # each halves the side, doubles the channels
            layers += [nn.Conv2d(features, features * 2, 4, 2, 1, bias=False),
                       batch_norm(features * 2), nn.LeakyReLU(hparams.LEAKY_SLOPE)]
            features *= 2
        self.body = nn.Sequential(*layers)
        self.out = backend.FullPrecision(nn.Conv2d(features, 1, base, 1, 0, bias=False))  # -> 1x1
        init_weights(self)

    def forward(self, x):
        return self.out(self.body(x)).view(-1, 1)


# The losses are the vanilla GAN's: non-saturating BCE on logits, in float32.

@exit_on_user_error
def main(argv=None):
    cfg = parse_args("dcgan", "pytorch", hparams.DEFAULTS, argv)
    require_image_dataset(cfg, "DCGAN is convolutional")
    return torch_gan.train(
        cfg,
        generator_for=lambda data: Generator(data.sample_shape),
        discriminator_for=lambda data: Discriminator(data.sample_shape),
        discriminator_loss=discriminator_loss, generator_loss=generator_loss,
        z_dim=hparams.Z_DIM)


if __name__ == "__main__":
    main()
