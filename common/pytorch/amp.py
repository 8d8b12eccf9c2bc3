"""Mixed precision in PyTorch is two independent pieces, both used in the training steps
(GAN/gan_step_pytorch.py, GAN/wgan_gp/wgan_gp_pytorch.py, VAE/vanilla_vae/vae_pytorch.py) as
the PyTorch docs write them:

- `torch.autocast(device_type, dtype)` runs matmuls and convolutions in float16 or bfloat16
  while the weights stay float32;
- `torch.amp.GradScaler(device)` multiplies the loss so that float16 gradients do not
  underflow (`scaler.scale(loss).backward()`), unscales them in `scaler.step(optimizer)`, or
  first in `scaler.unscale_(optimizer)` when they are clipped, skips the step when a gradient
  is inf/NaN, and adjusts the scale in `scaler.update()`. bfloat16 has float32's exponent
  range and needs no scaling: the scaler is enabled for float16 only (disabled, its calls
  pass the loss and the step through unchanged).

This module builds the scaler, keeps chosen layers in float32, reads the scale on the device,
and tells whether a step's updates were skipped.
"""
from __future__ import annotations

import torch
from torch import nn

from common.config import RunConfig

COMPUTE_DTYPES = {"fp32": None, "amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}


def make_grad_scaler(cfg: RunConfig, device_type: str, precision: str) -> torch.amp.GradScaler:
    # The device is passed: GradScaler() means CUDA, and disables itself on a CPU-only build.
    return torch.amp.GradScaler(device_type, init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
                                backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval,
                                enabled=precision == "amp-fp16")


class FullPrecision(nn.Module):
    """Run the wrapped layer in float32 even inside autocast (output layers, VAE heads):
    the Keras twin is `layer(..., dtype="float32")`."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        # no autocast to leave: skips the context's ~7 us a call
        if x.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
            return self.layer(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.layer(x.float())


def scale_on_device(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor | None:
    """A copy of the current loss scale as a device tensor, or None when the scaler is off:
    the documented `scaler.get_scale()` as a tensor. get_scale() returns a Python float, which
    would make the host wait for the device at every step."""
    if not scaler.is_enabled():
        return None
    if scaler._scale is None:  # the scaler creates its scale tensor at its first scale() call
        return torch.tensor(scaler.get_scale(), device=device)
    return scaler._scale.clone()


def scale_went_down(scaler: torch.amp.GradScaler, scale_before: torch.Tensor) -> torch.Tensor:
    """1.0 (a device tensor, no sync) when update() has backed the scale off since
    `scale_before`, which it does after an optimizer step it skipped. Exact across one
    update() only: over several, a growth (the growth interval reached) and a backoff cancel
    out, so a step of several updates uses SkippedUpdates."""
    return (scaler._scale < scale_before).float()


class SkippedUpdates:
    """Whether any of a training step's several optimizer updates was skipped, as a device
    tensor (no host sync): WGAN-GP's 5 critic updates and 1 generator update share one
    GradScaler, whose scale may grow at one update of an iteration and back off at another.
    Comparing the scale before and after the whole step would then miss the skip, so the scale
    is compared around each update: call `after_update()` after every `scaler.update()`, and
    return `metrics()` with the step's metrics (the session counts its "skipped")."""

    def __init__(self, scaler: torch.amp.GradScaler, device: torch.device):
        self.scaler = scaler
        self.scale = scale_on_device(scaler, device)  # None when the scaler is off
        self.flag = None if self.scale is None else torch.zeros((), device=device)

    def after_update(self):
        if self.scale is None:
            return
        self.flag = torch.maximum(self.flag, scale_went_down(self.scaler, self.scale))
        self.scale = self.scaler._scale.clone()  # update() changes the scale in place

    def metrics(self) -> dict[str, torch.Tensor]:
        """{"skipped": 1.0 when an update was skipped, else 0.0}; {} when the scaler is off."""
        return {} if self.flag is None else {"skipped": self.flag}


def loss_scale(scaler: torch.amp.GradScaler) -> float:
    """The current scale as a float (a host sync: for log points only); 1.0 when off."""
    return float(scaler.get_scale()) if scaler.is_enabled() else 1.0
