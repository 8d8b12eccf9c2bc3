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


def scales_now(optimizers) -> list[tf.Tensor]:
    """Each LossScaleOptimizer's scale now, on the device."""
    return [tf.identity(o.dynamic_scale) for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]


def any_skipped(optimizers, scales_before: list[tf.Tensor]) -> tf.Tensor:
    """1.0 when a scale went down since `scales_before`, on the device: a LossScaleOptimizer
    halves its scale on every update it skips, so this finds one skipped update among many in
    a training step (WGAN-GP's five critic updates) as PyTorch's scale_went_down does."""
    scaled = [o for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]
    went_down = [tf.less(o.dynamic_scale, before) for o, before in zip(scaled, scales_before)]
    return tf.cast(tf.reduce_any(tf.stack(went_down)), tf.float32)


def loss_scale(optimizers) -> float:
    """The smallest of the optimizers' scales (each LossScaleOptimizer has its own); 1.0
    when nothing is scaled."""
    scales = [float(o.dynamic_scale) for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]
    return min(scales) if scales else 1.0
