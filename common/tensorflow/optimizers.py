"""The optimizers both frameworks build alike (common/pytorch/optimizers.py is the twin)."""
from __future__ import annotations

import keras
from keras import ops

from common.config import ADAM_EPSILON, RunConfig
from common.tensorflow import amp


class PyTorchEpsilon:
    """Adam's update with epsilon where PyTorch adds it: to the bias-corrected sqrt(v_hat).

    Both compute m_hat / (sqrt(v_hat) + eps), but Keras folds the bias correction into the
    step size and adds eps to the uncorrected sqrt(v), so its eps is in effect
    eps / sqrt(1 - beta2^t): 32x PyTorch's at the first step with beta2 = 0.999, still 1.3x
    after 1,000. That changes the first updates of weights with tiny gradients, and the twins
    drift apart from the same weights (tests/test_twins_train_alike.py trains both from the
    same weights)."""

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - self.beta_2))
        # torch.optim.Adam: p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
        step_size = ops.cast(learning_rate, dtype) / (1 - ops.power(ops.cast(self.beta_1, dtype), step))
        bias_correction2_sqrt = ops.sqrt(1 - ops.power(ops.cast(self.beta_2, dtype), step))
        denominator = ops.add(ops.divide(ops.sqrt(v), bias_correction2_sqrt), self.epsilon)
        self.assign_sub(variable, ops.divide(ops.multiply(m, step_size), denominator))


class Adam(PyTorchEpsilon, keras.optimizers.Adam):
    pass


class AdamW(PyTorchEpsilon, keras.optimizers.AdamW):
    """Keras applies the decoupled weight decay (variable -= lr * wd * variable) before the
    update, as torch.optim.AdamW does."""


def make_optimizer(cfg: RunConfig, runtime) -> keras.optimizers.Optimizer:
    """Adam/AdamW as PyTorch computes them (its epsilon and where it adds it), wrapped for loss scaling under float16.

    --clip-grad-norm is the inner optimizer's `global_clipnorm`: the LossScaleOptimizer
    unscales the gradients before it hands them on, so the clip sees the true gradients."""
    clip = dict(global_clipnorm=cfg.clip_grad_norm) if cfg.clip_grad_norm else {}
    if cfg.optimizer == "adamw":
        inner = AdamW(cfg.lr, weight_decay=cfg.weight_decay, beta_1=cfg.beta1, beta_2=cfg.beta2,
                      epsilon=ADAM_EPSILON, **clip)
    else:
        inner = Adam(cfg.lr, beta_1=cfg.beta1, beta_2=cfg.beta2, epsilon=ADAM_EPSILON, **clip)
    return amp.loss_scale_optimizer(inner, cfg) if runtime.loss_scaling else inner
