"""--ema-decay in PyTorch: an averaged copy of a network, moved after every update
(common/ema.py has the rule; common/tensorflow/ema.py is the twin)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from common import ema


class ExponentialMovingAverage:
    """`module`: the averaged copy (sample and evaluate with it); `update(network)` after each
    of the network's optimizer steps. The step count is a Python int, so an update never waits
    for the GPU (torch.optim.swa_utils.AveragedModel tests a device counter every update)."""

    def __init__(self, network: nn.Module, decay: float):
        self.module = copy.deepcopy(network).requires_grad_(False)
        self.decay, self.updates = decay, 0
        self._pairs = None  # (network, its tensors, the average's), gathered at the first update

    @torch.no_grad()
    def start_from(self, network: nn.Module) -> None:
        """The average of no update: the network's current weights (after --init-from)."""
        for averaged, current in zip(_averaged_tensors(self.module), _averaged_tensors(network)):
            averaged.copy_(current)
        self.updates = 0

    @torch.no_grad()
    def update(self, network: nn.Module) -> None:
        self.updates += 1
        weight = 1.0 - ema.decay_at(self.updates, self.decay)
        if self._pairs is None or self._pairs[0] is not network:
            # once, not after every optimizer step: loading a checkpoint copies into these
            # tensors (a later .to() would replace batch norm's buffers: the networks are
            # placed before the average is built)
            self._pairs = (network, _averaged_tensors(network), _averaged_tensors(self.module))
        _, current, averaged = self._pairs
        torch._foreach_lerp_(averaged, current, weight)  # averaged + weight * (current - averaged)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def _averaged_tensors(network: nn.Module) -> list[torch.Tensor]:
    """Every weight and floating-point buffer (batch norm's running statistics; not its
    integer count of batches)."""
    return [*network.parameters(), *(b for b in network.buffers() if b.is_floating_point())]
