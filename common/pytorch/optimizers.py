"""The optimizers both frameworks build alike (common/tensorflow/optimizers.py is the twin)."""
from __future__ import annotations

import torch

from common.config import ADAM_EPSILON, RunConfig


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=ADAM_EPSILON,
                                 weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=ADAM_EPSILON)
