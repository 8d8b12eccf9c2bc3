"""The optimizers both frameworks build alike (common/pytorch/optimizers.py is the twin)."""
from __future__ import annotations

import keras

from common.config import ADAM_EPSILON, RunConfig
from common.tensorflow import amp


def make_optimizer(cfg: RunConfig, runtime) -> keras.optimizers.Optimizer:
    """Adam/AdamW with PyTorch's epsilon, wrapped for loss scaling under float16.

    --clip-grad-norm is the inner optimizer's `global_clipnorm`: the LossScaleOptimizer
    unscales the gradients before it hands them on, so the clip sees the true gradients."""
    clip = dict(global_clipnorm=cfg.clip_grad_norm) if cfg.clip_grad_norm else {}
    if cfg.optimizer == "adamw":
        inner = keras.optimizers.AdamW(cfg.lr, weight_decay=cfg.weight_decay, beta_1=cfg.beta1,
                                       beta_2=cfg.beta2, epsilon=ADAM_EPSILON, **clip)
    else:
        inner = keras.optimizers.Adam(cfg.lr, beta_1=cfg.beta1, beta_2=cfg.beta2, epsilon=ADAM_EPSILON, **clip)
    return amp.loss_scale_optimizer(inner, cfg) if runtime.loss_scaling else inner
