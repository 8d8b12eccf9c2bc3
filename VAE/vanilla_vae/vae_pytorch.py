"""Variational autoencoder (Kingma & Welling, 2014) in PyTorch, with automatic mixed precision.

    python VAE/vanilla_vae/vae_pytorch.py          # MNIST, float32
    python VAE/vanilla_vae/vae_pytorch.py --amp    # bfloat16 on CPU, float16 + loss scaling on CUDA

An MLP encoder gives the mean and log-variance of q(z|x), a diagonal Gaussian; z is drawn by
reparameterisation, z = mean + exp(logvar / 2) * eps, and an MLP decoder turns z into one
Bernoulli logit per pixel. The loss is the negative ELBO per example, averaged over the batch:
the reconstruction term (BCE-with-logits summed over pixels) plus KL(q(z|x) || N(0, I)).

Under AMP the hidden layers run in 16 bits, but the heads (mean, log-variance, logits) run in
float32, and the reparameterisation and the KL are computed from float32 values: CPU autocast
does not upcast `exp`, and exp(logvar) overflows float16 as soon as logvar passes ~11.
The training step, with its autocast and GradScaler calls, is VAE.train_step below. The
TensorFlow twin is vae_tensorflow.py; the hyperparameters of both are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common import data as datasets
from common import sampling
from common.config import parse_args
from common.errors import exit_on_user_error
from common.pytorch.amp import FullPrecision
from common.pytorch.data import load_data, to_numpy_images
from common.pytorch.layers import init_like_keras_dense
from common.pytorch.optimizers import make_optimizer
from common.pytorch.runtime import Runtime, setup
from common.pytorch.session import fit
from VAE.vanilla_vae import hparams


class Encoder(nn.Module):
    """image -> width (400, ReLU) -> mean and log-variance of q(z|x), both heads in float32."""

    def __init__(self, data_shape: tuple, width: int):
        super().__init__()
        self.hidden = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(data_shape), width),
            nn.ReLU(),
        )
        self.mean = FullPrecision(nn.Linear(width, hparams.LATENT))
        self.logvar = FullPrecision(nn.Linear(width, hparams.LATENT))
        init_like_keras_dense(self)

    def forward(self, x):
        h = self.hidden(x)
        return self.mean(h), self.logvar(h)


class Decoder(nn.Module):
    """z -> width (400, ReLU) -> one Bernoulli logit per pixel, computed in float32."""

    def __init__(self, data_shape: tuple, width: int):
        super().__init__()
        self.data_shape = data_shape
        self.hidden = nn.Sequential(nn.Linear(hparams.LATENT, width), nn.ReLU())
        self.out = FullPrecision(nn.Linear(width, math.prod(data_shape)))
        init_like_keras_dense(self)

    def forward(self, z):
        return self.out(self.hidden(z)).view(-1, *self.data_shape)


def build_networks(data_shape: tuple, width: int) -> dict[str, nn.Module]:
    """The encoder and decoder for images of this (C, H, W) shape: what main() trains,
    scripts/parity.py ports."""
    return {"encoder": Encoder(data_shape, width), "decoder": Decoder(data_shape, width)}


def reparameterize(mean, logvar, eps):
    """z = mean + sigma * eps, in float32: exp(logvar / 2) overflows float16 from logvar ~22."""
    return mean.float() + torch.exp(0.5 * logvar.float()) * eps.float()


def vae_loss(x, logits, mean, logvar):
    """Negative ELBO per example, averaged over the batch, in float32: (loss, recon, kl).

    recon = sum over pixels of BCE(x, sigmoid(logits)), taken on the logits (fused and stable,
            and allowed under CUDA autocast, unlike sigmoid + BCELoss);
    kl    = KL(N(mean, exp(logvar)) || N(0, I)) = -1/2 sum(1 + logvar - mean^2 - exp(logvar)).
    """
    x, logits = x.float(), logits.float()
    mean, logvar = mean.float(), logvar.float()
    bce = F.binary_cross_entropy_with_logits(logits, x, reduction="none")
    recon = bce.flatten(1).sum(1).mean()
    kl = (-0.5 * (1 + logvar - mean.square() - logvar.exp()).sum(1)).mean()
    return recon + kl, recon, kl


class VAE:
    """The training step and the sample grids; common/pytorch/session.py drives it."""

    def __init__(self, encoder: Encoder, decoder: Decoder, cfg, runtime: Runtime):
        self.encoder, self.decoder = runtime.place(encoder), runtime.place(decoder)
        # Under torchrun, DDP wrappers that average the gradients over the replicas (each
        # trains on its share of the global batch, and of the noise drawn for it); in one
        # process, the networks themselves.
        self.replicas = runtime.replicas
        self.parallel_encoder = runtime.data_parallel(self.encoder)
        self.parallel_decoder = runtime.data_parallel(self.decoder)
        self.cfg = cfg
        self.z_dim = hparams.LATENT
        self.noise_shape = (sampling.GRID_IMAGES, hparams.LATENT)  # the grids' prior draws
        self.params = [*self.encoder.parameters(), *self.decoder.parameters()]
        self.optimizer = make_optimizer(cfg, self.params)
        # AMP: autocast's device and 16-bit dtype (off in float32), and the GradScaler
        # (enabled for float16 only: bfloat16 has float32's range).
        self.device, self.autocast_dtype = runtime.device, runtime.compute_dtype
        self.autocast_on = self.autocast_dtype is not None
        self.scaler, self.clip_grad_norm = runtime.scaler, runtime.clip_grad_norm
        self.modules = {"encoder": self.encoder, "decoder": self.decoder}
        self.optimizers = {"vae": self.optimizer}
        self.averages = {}  # --ema-decay averages GANs' generators
        self._fixed_noise = self._test_images = None

    def train_step(self, x: torch.Tensor) -> dict:
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on):
            mean, logvar = self.parallel_encoder(x)
            eps = self.replicas.randn(mean.shape[0], hparams.LATENT, device=mean.device)  # torch.randn in one process
            z = reparameterize(mean, logvar, eps)
            logits = self.parallel_decoder(z)
        loss, recon, kl = vae_loss(x, logits, mean, logvar)

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        self.scaler.step(self.optimizer)  # skipped if a gradient is inf/NaN
        self.scaler.update()
        return {"loss": loss.detach(), "recon": recon.detach(), "kl": kl.detach()}

    # --- evaluation (common/evaluation.py): numpy in, numpy out, NHWC images in [0, 1]; the
    # session runs these, and write_samples, in eval mode under the run's precision ---
    def sample(self, z):
        logits = self.decoder(torch.from_numpy(z).to(self.device))
        return to_numpy_images(torch.sigmoid(logits.float()))

    def encode(self, x):
        images = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(self.device)
        mean, logvar = self.encoder(images)
        return mean.float().cpu().numpy(), logvar.float().cpu().numpy()

    def decode_logits(self, z):
        """Flattened in (H, W, C) order, as the images they score."""
        logits = self.decoder(torch.from_numpy(z).to(self.device))
        return to_numpy_images(logits.float()).reshape(len(z), -1)

    def write_samples(self, run, step: int):
        """Decode the run's fixed prior noise, and reconstruct fixed test images from their
        posterior means (no sampling, so successive grids differ only by training)."""
        device = self.device
        if self._fixed_noise is None:
            noise = sampling.fixed_noise(run.path, *self.noise_shape, self.cfg.seed)
            self._fixed_noise = torch.from_numpy(noise).to(device)
            images = datasets.fixed_test_images(self.cfg, hparams.RECONSTRUCTION_COUNT)  # NHWC
            self._test_images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device)
        samples = torch.sigmoid(self.decoder(self._fixed_noise).float())
        mean, _ = self.encoder(self._test_images)
        reconstructions = torch.sigmoid(self.decoder(mean).float())
        sampling.save_reconstruction_grid(to_numpy_images(self._test_images),
                                          to_numpy_images(reconstructions),
                                          run.sample_path(step, "_recon"),
                                          value_range=hparams.PIXEL_RANGE)
        # the samples' grid last: its file tells --resume that the step's grids were written
        sampling.save_image_grid(to_numpy_images(samples), run.sample_path(step),
                                 value_range=hparams.PIXEL_RANGE)


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("vanilla_vae", "pytorch", argv)
    runtime = setup(cfg)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    networks = build_networks(data.sample_shape, cfg.width)
    vae = VAE(networks["encoder"], networks["decoder"], cfg, runtime)
    return fit(cfg, runtime, vae, data)


if __name__ == "__main__":
    main()
