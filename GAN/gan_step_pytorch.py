"""The GAN training step in PyTorch, with automatic mixed precision, shared by the vanilla GAN,
LSGAN and DCGAN: they differ only in their networks and their two loss functions. The
TensorFlow twin is gan_step_tensorflow.py. WGAN-GP (GAN/wgan_gp) subclasses GAN for its
networks, optimizers and samples and writes its own step.

One iteration:
    1. generate one fake batch under autocast;
    2. update D on real vs. that fake batch, detached so no gradient reaches G;
    3. update G through the just-updated D on the same fake batch, attached (as the PyTorch
       DCGAN example does: G runs once per iteration, not twice);
    4. one GradScaler for both networks (`torch.amp.GradScaler(device_type, enabled=float16)`,
       made in common/pytorch/amp.py), as the PyTorch AMP examples do for "multiple models,
       losses and optimizers": scale each loss, step each optimizer (each skips its own step
       on inf/NaN gradients), update the scale once per iteration. The session adds the
       "skipped" metric: whether update() backed the scale off (common/pytorch/session.py).
Under bfloat16 and float32 the scaler is disabled and its calls pass everything through.

Under torchrun the updates run through DDP wrappers (common/pytorch/runtime.py), which
average each network's gradients over the replicas during its backward pass; G's loss runs
through the plain D, whose gradients it does not need, so nothing is all-reduced for them.
Each replica trains on its share of the global batch and of the noise drawn for it.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common import sampling
from common.config import MIXTURE_SAMPLES
from common.pytorch.data import load_data, to_numpy_images
from common.pytorch.ema import ExponentialMovingAverage
from common.pytorch.optimizers import make_optimizer
from common.pytorch.runtime import Runtime, setup
from common.pytorch.session import fit


class GAN:
    """One GAN as common/pytorch/session.py's fit() trains it: G and D with their optimizers
    (and G's weight average), `train_step` (the iteration laid out at the top of this file),
    and the samples drawn from the run's fixed noise. `modules`, `optimizers` and `averages`
    are what checkpoints hold."""

    def __init__(self, generator: nn.Module, discriminator: nn.Module, discriminator_loss,
                 generator_loss, z_dim: int, cfg, runtime: Runtime, data):
        self.generator, self.discriminator = runtime.place(generator), runtime.place(discriminator)
        self.discriminator_loss, self.generator_loss = discriminator_loss, generator_loss
        self.z_dim, self.cfg, self.data = z_dim, cfg, data
        # Under torchrun, DDP wrappers that average the gradients over the replicas; in one
        # process, the networks themselves.
        self.replicas = runtime.replicas
        self.parallel_generator = runtime.data_parallel(self.generator)
        self.parallel_discriminator = runtime.data_parallel(self.discriminator)
        self.g_optimizer = make_optimizer(cfg, self.generator.parameters())
        self.d_optimizer = make_optimizer(cfg, self.discriminator.parameters())
        # AMP: autocast's device and 16-bit dtype (off in float32), and one GradScaler.
        self.device, self.autocast_dtype = runtime.device, runtime.compute_dtype
        self.autocast_on = self.autocast_dtype is not None
        self.scaler, self.clip_grad_norm = runtime.scaler, runtime.clip_grad_norm
        self.modules = {"generator": self.generator, "discriminator": self.discriminator}
        self.optimizers = {"generator": self.g_optimizer, "discriminator": self.d_optimizer}
        # --ema-decay: samples and evaluation from an average of G's weights (common/ema.py)
        self.average = ExponentialMovingAverage(self.generator, cfg.ema_decay) if cfg.ema_decay else None
        self.averages = {"generator": self.average} if self.average else {}
        self.title = f"{cfg.model} pytorch {runtime.precision}"
        self.noise_shape = (sampling.GRID_IMAGES if data.kind == "image" else MIXTURE_SAMPLES, z_dim)
        self._fixed_noise = None

    def train_step(self, real: torch.Tensor) -> dict:
        z = self.replicas.randn(real.shape[0], self.z_dim, device=real.device)  # torch.randn in one process

        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on):
            fake = self.parallel_generator(z)
            d_loss = self.discriminator_loss(self.parallel_discriminator(real),
                                             self.parallel_discriminator(fake.detach()))
        self.d_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(d_loss).backward()
        if self.clip_grad_norm:
            self.scaler.unscale_(self.d_optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(self.discriminator.parameters(), self.clip_grad_norm)
        self.scaler.step(self.d_optimizer)

        # G's loss needs gradients through D, not for D's weights: skip computing those.
        self.discriminator.requires_grad_(False)
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on):
            g_loss = self.generator_loss(self.discriminator(fake))
        self.g_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(g_loss).backward()
        self.discriminator.requires_grad_(True)
        if self.clip_grad_norm:
            self.scaler.unscale_(self.g_optimizer)
            nn.utils.clip_grad_norm_(self.generator.parameters(), self.clip_grad_norm)
        self.scaler.step(self.g_optimizer)
        if self.average:
            self.average.update(self.generator)

        self.scaler.update()
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}

    def generate(self, z: torch.Tensor) -> torch.Tensor:
        """G(z) in float32 (the session runs it in eval mode, under the run's precision), from
        the average of G's weights under --ema-decay."""
        return (self.average.module if self.average else self.generator)(z).float()

    def sample(self, z: np.ndarray) -> np.ndarray:
        """Samples for common/evaluation.py: NHWC images in [0, 1], or 2-D points."""
        fake = self.generate(torch.from_numpy(z).to(self.device))
        if self.data.kind == "image":
            return sampling.to_unit_range(to_numpy_images(fake), self.data.value_range)
        return fake.cpu().numpy()

    def write_samples(self, run, step: int):
        """A grid (or a scatter plot) from the run's fixed noise, the same in both frameworks."""
        if self._fixed_noise is None:
            noise = sampling.fixed_noise(run.path, *self.noise_shape, self.cfg.seed)
            self._fixed_noise = torch.from_numpy(noise).to(self.device)
        fake = self.generate(self._fixed_noise)
        if self.data.kind == "image":
            sampling.save_image_grid(to_numpy_images(fake), run.sample_path(step), self.data.value_range)
        else:
            sampling.save_scatter(fake.cpu().numpy(), run.sample_path(step),
                                  real=self.data.dataset.x[:MIXTURE_SAMPLES], title=f"{self.title} step {step}")


def train(cfg, hparams, build_networks, discriminator_loss, generator_loss) -> dict:
    """A GAN script's main() after its flags: set up the device and precision, load the data
    in the range of the model's hparams.PIXEL_RANGE, build G and D for it
    (`build_networks(data_shape, width)`), and train."""
    runtime = setup(cfg)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    networks = build_networks(data.sample_shape, cfg.width)
    gan = GAN(networks["generator"], networks["discriminator"], discriminator_loss, generator_loss,
              hparams.Z_DIM, cfg, runtime, data)
    return fit(cfg, runtime, gan, data)
