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
The TensorFlow twin is vae_tensorflow.py; the hyperparameters of both are in hparams.py.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common import data as datasets
from common import sampling
from common import torch_backend as backend
from common.config import parse_args, require_image_dataset
from common.errors import exit_on_user_error
from VAE.vanilla_vae import hparams


class Encoder(nn.Module):
    """image -> 400 (ReLU) -> mean and log-variance of q(z|x), both heads in float32."""

    def __init__(self, data_shape: tuple):
        super().__init__()
        self.hidden = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(data_shape), hparams.HIDDEN),
            nn.ReLU(),
        )
        self.mean = backend.FullPrecision(nn.Linear(hparams.HIDDEN, hparams.LATENT))
        self.logvar = backend.FullPrecision(nn.Linear(hparams.HIDDEN, hparams.LATENT))
        backend.init_like_keras_dense(self)

    def forward(self, x):
        h = self.hidden(x)
        return self.mean(h), self.logvar(h)


class Decoder(nn.Module):
    """z -> 400 (ReLU) -> one Bernoulli logit per pixel, computed in float32."""

    def __init__(self, data_shape: tuple):
        super().__init__()
        self.data_shape = data_shape
        self.hidden = nn.Sequential(nn.Linear(hparams.LATENT, hparams.HIDDEN), nn.ReLU())
        self.out = backend.FullPrecision(nn.Linear(hparams.HIDDEN, math.prod(data_shape)))
        backend.init_like_keras_dense(self)

    def forward(self, z):
        return self.out(self.hidden(z)).view(-1, *self.data_shape)


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
    """The training step and the sample grids; common/torch_backend.py's Session drives it."""

    def __init__(self, encoder: Encoder, decoder: Decoder, cfg, runtime: backend.Runtime):
        self.encoder = runtime.place(encoder)
        self.decoder = runtime.place(decoder)
        self.cfg, self.runtime = cfg, runtime
        self.z_dim = hparams.LATENT
        self.optimizer = backend.make_optimizer(
            cfg, [*self.encoder.parameters(), *self.decoder.parameters()])
        self.modules = {"encoder": self.encoder, "decoder": self.decoder}
        self.optimizers = {"vae": self.optimizer}
        self._fixed_noise = self._test_images = None

    def train_step(self, x: torch.Tensor) -> dict:
        with self.runtime.autocast():
            mean, logvar = self.encoder(x)
            z = reparameterize(mean, logvar, torch.randn_like(mean, dtype=torch.float32))
            logits = self.decoder(z)
        loss, recon, kl = vae_loss(x, logits, mean, logvar)

        self.optimizer.zero_grad(set_to_none=True)
        self.runtime.scaler.scale(loss).backward()  # the scaler is a no-op unless float16
        self.runtime.step(self.optimizer)

        metrics = {"loss": loss.detach(), "recon": recon.detach(), "kl": kl.detach()}
        skipped = self.runtime.update_scaler()
        if skipped is not None:
            metrics["skipped"] = skipped
        return metrics

    # --- evaluation (common/evaluation.py): numpy in, numpy out, NHWC images in [0, 1] ---
    def sample(self, z):
        with self.runtime.autocast():
            logits = self.decoder(torch.from_numpy(z).to(self.runtime.device))
        return backend.to_numpy_images(torch.sigmoid(logits.float()))

    def encode(self, x):
        images = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(self.runtime.device)
        with self.runtime.autocast():
            mean, logvar = self.encoder(images)
        return mean.float().cpu().numpy(), logvar.float().cpu().numpy()

    def decode_logits(self, z):
        """Flattened in (H, W, C) order, as the images they score."""
        with self.runtime.autocast():
            logits = self.decoder(torch.from_numpy(z).to(self.runtime.device))
        return backend.to_numpy_images(logits.float()).reshape(len(z), -1)

    def write_samples(self, run, step: int):
        """Decode the run's fixed prior noise, and reconstruct fixed test images from their
        posterior means (no sampling, so successive grids differ only by training)."""
        device = self.runtime.device
        if self._fixed_noise is None:
            noise = sampling.fixed_noise(run.path, hparams.SAMPLE_COUNT, hparams.LATENT,
                                         self.cfg.seed)
            self._fixed_noise = torch.from_numpy(noise).to(device)
            images = datasets.fixed_test_images(self.cfg, hparams.RECONSTRUCTION_COUNT)  # NHWC
            self._test_images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device)
        with self.runtime.autocast():
            samples = torch.sigmoid(self.decoder(self._fixed_noise).float())
            mean, _ = self.encoder(self._test_images)
            reconstructions = torch.sigmoid(self.decoder(mean).float())
        sampling.save_image_grid(backend.to_numpy_images(samples), run.sample_path(step),
                                 value_range=hparams.PIXEL_RANGE)
        sampling.save_reconstruction_grid(backend.to_numpy_images(self._test_images),
                                          backend.to_numpy_images(reconstructions),
                                          run.sample_path(step, "_recon"),
                                          value_range=hparams.PIXEL_RANGE)


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("vanilla_vae", "pytorch", hparams.DEFAULTS, argv)
    require_image_dataset(cfg, "the VAE models images with a Bernoulli decoder")
    runtime = backend.setup(cfg)
    data = backend.load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    vae = VAE(Encoder(data.sample_shape), Decoder(data.sample_shape), cfg, runtime)
    return backend.fit(cfg, runtime, vae, data)


if __name__ == "__main__":
    main()
