"""Mixed precision in Keras 3 is a global dtype policy set before the models are built, and,
for float16, a LossScaleOptimizer around each optimizer; both are used in the training steps
(GAN/gan_step_tensorflow.py, VAE/vanilla_vae/vae_tensorflow.py) as the Keras docs write them:

- `mixed_float16` / `mixed_bfloat16` compute in 16 bits and keep float32 variables; layers
  built with `dtype="float32"` (output layers, VAE heads) stay in float32;
- inside the tape, `scaled = opt.scale_loss(loss)`; then `opt.apply_gradients(zip(
  tape.gradient(scaled, variables), variables))` unscales, skips the step on inf/NaN
  gradients and halves the scale. (Keras 3 removed `get_scaled_loss` /
  `get_unscaled_gradients`, which most tutorials still show.) A plain optimizer's
  `scale_loss` returns the loss unchanged, so one training step serves every precision.

This module names the policies, wraps an optimizer for loss scaling, and reads the scales.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from common.config import RunConfig

POLICIES = {"fp32": "float32", "amp-fp16": "mixed_float16", "amp-bf16": "mixed_bfloat16"}


def loss_scale_optimizer(inner: keras.optimizers.Optimizer, cfg: RunConfig) -> keras.optimizers.LossScaleOptimizer:
    """Dynamic loss scaling: Keras doubles and halves (its factors are not settable)."""
    return keras.optimizers.LossScaleOptimizer(inner, initial_scale=cfg.init_scale,
                                               dynamic_growth_steps=cfg.growth_interval)


def step_counts(optimizers) -> list[tf.Tensor]:
    """Each optimizer's `iterations` now: a LossScaleOptimizer does not advance it on a step
    it skips, so comparing before and after a training step finds the skipped ones."""
    return [tf.identity(optimizer.iterations) for optimizer in optimizers]


def any_skipped(optimizers, counts_before: list[tf.Tensor]) -> tf.Tensor:
    """1.0 when an optimizer skipped its update since `counts_before`, on the device."""
    stood_still = [tf.equal(optimizer.iterations, before) for optimizer, before in zip(optimizers, counts_before)]
    return tf.cast(tf.reduce_any(tf.stack(stood_still)), tf.float32)


def loss_scale(optimizers) -> float:
    """The smallest of the optimizers' scales (each LossScaleOptimizer has its own); 1.0
    when nothing is scaled."""
    scales = [float(o.dynamic_scale) for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]
    return min(scales) if scales else 1.0
