"""The optimizers both frameworks build alike (common/tensorflow/optimizers.py is the twin)."""
from __future__ import annotations

import torch

from common.config import ADAM_EPSILON, RunConfig


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    """Adam/AdamW with the multi-tensor `foreach` update, which PyTorch picks by default only on
    CUDA: on a CPU its default is one small op per parameter per moment. `foreach` computes
    the same numbers, bit for bit (tests/test_amp_toolkit.py), in fewer, larger ops. (`fused` is
    faster still but rounds differently, which would change every measured run.)"""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=ADAM_EPSILON,
                                 weight_decay=cfg.weight_decay, foreach=True)
    return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=ADAM_EPSILON, foreach=True)
