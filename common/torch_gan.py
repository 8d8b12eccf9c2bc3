"""The GAN training iteration in PyTorch, shared by the vanilla GAN, LSGAN and DCGAN: they
differ only in their networks and their two loss functions.

One iteration, with AMP:
    1. generate one fake batch under autocast;
    2. update D on real vs. that fake batch, detached so no gradient reaches G;
    3. update G through the just-updated D on the same fake batch, attached (as the PyTorch
       DCGAN example does: G runs once per iteration, not twice);
    4. one GradScaler for both: scale each loss, step each optimizer (each skips its own step
       on inf/NaN gradients), update the scale once.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common import sampling
from common import torch_backend as backend
from common.torch_backend import Runtime, make_optimizer, to_numpy_images

SCATTER_POINTS = 2500  # the 2-D mixture protocol's sample count
GRID_IMAGES = 64


class GAN:
    def __init__(self, generator: nn.Module, discriminator: nn.Module, discriminator_loss,
                 generator_loss, z_dim: int, cfg, runtime: Runtime, data):
        self.generator = runtime.place(generator)
        self.discriminator = runtime.place(discriminator)
        self.discriminator_loss, self.generator_loss = discriminator_loss, generator_loss
        self.z_dim, self.cfg, self.runtime, self.data = z_dim, cfg, runtime, data
        self.g_optimizer = make_optimizer(cfg, self.generator.parameters())
        self.d_optimizer = make_optimizer(cfg, self.discriminator.parameters())
        self.modules = {"generator": self.generator, "discriminator": self.discriminator}
        self.optimizers = {"generator": self.g_optimizer, "discriminator": self.d_optimizer}
        self._fixed_noise = None

    def train_step(self, real: torch.Tensor) -> dict:
        scaler = self.runtime.scaler
        z = torch.randn(real.shape[0], self.z_dim, device=real.device)

        with self.runtime.autocast():
            fake = self.generator(z)
            d_loss = self.discriminator_loss(self.discriminator(real),
                                             self.discriminator(fake.detach()))
        self.d_optimizer.zero_grad(set_to_none=True)
        scaler.scale(d_loss).backward()
        self.runtime.step(self.d_optimizer)

        # G's loss needs gradients through D, not for D's weights: skip computing those.
        self.discriminator.requires_grad_(False)
        with self.runtime.autocast():
            g_loss = self.generator_loss(self.discriminator(fake))
        self.g_optimizer.zero_grad(set_to_none=True)
        scaler.scale(g_loss).backward()
        self.discriminator.requires_grad_(True)
        self.runtime.step(self.g_optimizer)

        metrics = {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}
        skipped = self.runtime.update_scaler()
        if skipped is not None:
            metrics["skipped"] = skipped
        return metrics

    def sample(self, z: np.ndarray) -> np.ndarray:
        """Generated samples for evaluation (eval mode, the run's precision): NHWC images in
        [0, 1], or 2-D points."""
        with self.runtime.autocast():
            fake = self.generator(torch.from_numpy(z).to(self.runtime.device)).float()
        if self.data.kind == "image":
            return (to_numpy_images(fake) + 1.0) / 2.0
        return fake.cpu().numpy()

    def write_samples(self, run, step: int):
        """Generate from the run's fixed noise (in eval mode, under the run's precision)."""
        count = GRID_IMAGES if self.data.kind == "image" else SCATTER_POINTS
        if self._fixed_noise is None:
            noise = sampling.fixed_noise(run.path, count, self.z_dim, self.cfg.seed)
            self._fixed_noise = torch.from_numpy(noise).to(self.runtime.device)
        with self.runtime.autocast():
            fake = self.generator(self._fixed_noise).float()
        if self.data.kind == "image":
            sampling.save_image_grid(to_numpy_images(fake), run.sample_path(step))
        else:
            real = self.data.dataset.x[:SCATTER_POINTS]
            sampling.save_scatter(fake.cpu().numpy(), run.sample_path(step), real=real,
                                  title=f"{self.cfg.model} pytorch {self.runtime.precision} "
                                        f"step {step}")


def train(cfg, generator_for, discriminator_for, discriminator_loss, generator_loss,
          z_dim: int) -> dict:
    """Set up the device and precision, load the data, build G and D for it
    (`generator_for(data)`, `discriminator_for(data)`), and train: a GAN script's main()."""
    runtime = backend.setup(cfg)
    data = backend.load_data(cfg, runtime)
    gan = GAN(generator_for(data), discriminator_for(data), discriminator_loss, generator_loss,
              z_dim, cfg, runtime, data)
    return backend.fit(cfg, runtime, gan, data)
