"""Layers shared by the PyTorch models (common/tensorflow/layers.py is the twin)."""
from __future__ import annotations

import torch
from torch import nn


def init_like_keras_dense(module: nn.Module):
    """Glorot-uniform weights and zero biases for every Linear layer: Keras' Dense defaults,
    which the TensorFlow twins set explicitly, so both start from the same distribution."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)


class ConvTranspose2d(nn.ConvTranspose2d):
    """PyTorch's transposed convolution, computed from a 1x1 map (DCGAN's z -> 7x7x64) as the
    matmul it is: out[n, o, i, j] = sum_c z[n, c] * weight[c, o, i, j], the same weights.
    The Keras twins' Conv2DTranspose does the same. With Conv2d below, one DCGAN iteration's
    network work (forward and backward passes, no optimizer) ran 1.06x as fast with oneDNN held
    to AVX2 and 1.08-1.11x as fast under AMP on a Xeon with AMX (README, "DCGAN"). Any other
    input takes PyTorch's own path."""

    def forward(self, x, output_size=None):
        if not (x.dim() == 4 and x.shape[-2:] == (1, 1) and self.padding == (0, 0) and self.output_padding == (0, 0)
                and self.dilation == (1, 1) and self.groups == 1 and output_size is None):
            return super().forward(x, output_size)
        # in (C, kH, kW, O) order, which is how a channels_last weight is stored: no copies, and
        # the output comes out channels_last too
        weight = self.weight.permute(0, 2, 3, 1)
        out = torch.matmul(x.flatten(1), weight.flatten(1)).unflatten(1, weight.shape[1:]).permute(0, 3, 1, 2)
        return out if self.bias is None else out + self.bias.to(out.dtype)[:, None, None]  # autocast's dtype


class Conv2d(nn.Conv2d):
    """PyTorch's convolution, computed where its kernel covers the whole map with no padding
    (DCGAN's D: 7x7x64 -> one logit) as the matmul it is, as the Keras twins' layer of the
    same name does. Any other input takes PyTorch's own path."""

    def forward(self, x):
        if not (x.dim() == 4 and x.shape[-2:] == self.kernel_size and self.padding in ((0, 0), "valid")
                and self.dilation == (1, 1) and self.groups == 1):
            return super().forward(x)
        # summed in (kH, kW, C) order, how channels_last tensors are stored: no copies
        def hwc(tensor):
            return tensor.permute(0, 2, 3, 1).flatten(1)
        return nn.functional.linear(hwc(x), hwc(self.weight), self.bias)[:, :, None, None]
