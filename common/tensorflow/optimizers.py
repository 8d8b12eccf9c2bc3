"""The optimizers both frameworks build alike (common/pytorch/optimizers.py is the twin)."""
from __future__ import annotations

import keras
import tensorflow as tf
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


class PyTorchClipping:
    """--clip-grad-norm (`global_clipnorm`) as torch.nn.utils.clip_grad_norm_ computes it: the
    gradients times min(1, max_norm / (norm + 1e-6)). Keras divides by the norm alone, which
    left its gradient 5% longer than PyTorch's at a norm of 2e-5 and a clip of 1e-5, 50% at
    2e-6 and 1e-6. An inf norm gives 0 (inf gradients NaN), a NaN norm NaN, as in PyTorch."""

    def _clip_gradients(self, grads):
        if not (self.global_clipnorm and self.global_clipnorm > 0):
            return super()._clip_gradients(grads)
        norm = ops.sqrt(ops.sum(ops.stack([ops.sum(ops.square(g)) for g in grads if g is not None])))
        scale = ops.minimum(self.global_clipnorm / (norm + 1e-6), 1.0)
        return [None if g is None else g * ops.cast(scale, g.dtype) for g in grads]


class SumsReplicasFirst:
    """Under --distribute, the replicas' gradients summed as they arrive, before anything looks
    at them, as PyTorch's DDP all-reduces them before clip_grad_norm_ and the optimizer.

    Keras sums them in its last step (`_backend_update_step`), after `global_clipnorm` has
    clipped each replica's share: at 2 replicas --clip-grad-norm 0.01 gave a gradient of
    norm 0.016-0.018 where one process and PyTorch clip to 0.0100. Here `apply` sums first (one
    all-reduce, as Keras' own) and Keras' later sum is skipped. One replica: unchanged."""

    def apply(self, grads, trainable_variables=None):
        super().apply(sum_over_replicas(grads), trainable_variables)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return list(grads_and_vars)  # summed in apply (one process: there is nothing to sum)


def sum_over_replicas(gradients):
    """In a replica's context, every replica's gradients summed (None stays None)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return gradients
    present = [gradient for gradient in gradients if gradient is not None]
    summed = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present) if present else [])
    return [None if gradient is None else next(summed) for gradient in gradients]


class Adam(SumsReplicasFirst, PyTorchClipping, PyTorchEpsilon, keras.optimizers.Adam):
    pass


class AdamW(SumsReplicasFirst, PyTorchClipping, PyTorchEpsilon, keras.optimizers.AdamW):
    """Keras applies the decoupled weight decay (variable -= lr * wd * variable) before the
    update, as torch.optim.AdamW does."""


def make_optimizer(cfg: RunConfig, runtime) -> keras.optimizers.Optimizer:
    """Adam/AdamW as PyTorch computes them (its epsilon and where it adds it, its clipping),
    wrapped for loss scaling under float16.

    --clip-grad-norm is the inner optimizer's `global_clipnorm` (PyTorchClipping): the LossScaleOptimizer
    unscales the gradients before it hands them on, so the clip sees the true gradients, and
    under --distribute the inner optimizer sums the replicas' gradients before it clips
    (SumsReplicasFirst), so the clip sees the global batch's gradient."""
    clip = dict(global_clipnorm=cfg.clip_grad_norm) if cfg.clip_grad_norm else {}
    if cfg.optimizer == "adamw":
        inner = AdamW(cfg.lr, weight_decay=cfg.weight_decay, beta_1=cfg.beta1, beta_2=cfg.beta2,
                      epsilon=ADAM_EPSILON, **clip)
    else:
        inner = Adam(cfg.lr, beta_1=cfg.beta1, beta_2=cfg.beta2, epsilon=ADAM_EPSILON, **clip)
    return amp.loss_scale_optimizer(inner, cfg) if runtime.loss_scaling else inner
