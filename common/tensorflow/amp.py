"""Mixed precision in Keras 3 is a global dtype policy set before the models are built, and,
for float16, a LossScaleOptimizer around each optimizer; both are used in the training steps
(GAN/gan_step_tensorflow.py, GAN/wgan_gp/wgan_gp_tensorflow.py,
VAE/vanilla_vae/vae_tensorflow.py) as the Keras docs write them:

- `mixed_float16` / `mixed_bfloat16` compute in 16 bits and keep float32 variables; layers
  built with `dtype="float32"` (output layers, VAE heads) stay in float32;
- inside the tape, `scaled = opt.scale_loss(loss)`; then `opt.apply_gradients(zip(
  tape.gradient(scaled, variables), variables))` unscales, skips the step on inf/NaN
  gradients and halves the scale. (Keras 3 removed `get_scaled_loss` /
  `get_unscaled_gradients`, which most tutorials still show.) A plain optimizer's
  `scale_loss` returns the loss unchanged, so one training step serves every precision.

Under --distribute every replica must take the same branch, as PyTorch's replicas do (DDP
all-reduces and averages the gradients before GradScaler looks at them):
`LossScaleOptimizer` below makes the replicas agree on whether the step's gradients are finite.

This module names the policies, wraps an optimizer for loss scaling, reads the scales, and
tells whether a step's updates were skipped.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from common.config import RunConfig

POLICIES = {"fp32": "float32", "amp-fp16": "mixed_float16", "amp-bf16": "mixed_bfloat16"}


class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras' LossScaleOptimizer, whose replicas skip together.

    Keras 3.15 checks each replica's own gradients for inf/NaN before the inner optimizer sums
    them, and under a strategy takes the first replica's answer for all (its comment assumes
    the gradients were summed already): an overflow in another replica's share went into the
    sum, and every replica applied NaN weights instead of skipping the step. Here a replica's
    gradients count as finite only when every replica's are (one all-reduce of a flag), so
    every replica skips the same steps and halves its scale. One replica: Keras' check as is."""

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflowed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32))
        return tf.equal(overflowed, 0.0)


def loss_scale_optimizer(inner: keras.optimizers.Optimizer, cfg: RunConfig) -> keras.optimizers.LossScaleOptimizer:
    """Dynamic loss scaling: Keras doubles and halves (its factors are not settable)."""
    return LossScaleOptimizer(inner, initial_scale=cfg.init_scale, dynamic_growth_steps=cfg.growth_interval)


def scales_now(optimizers) -> list[tf.Tensor]:
    """Each LossScaleOptimizer's scale now, on the device."""
    return [tf.identity(o.dynamic_scale) for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]


def any_scale_went_down(optimizers, scales_before: list[tf.Tensor]) -> tf.Tensor:
    """1.0 when a scale went down since `scales_before`, on the device: a LossScaleOptimizer
    halves its scale on an update it skips, as PyTorch's scale_went_down. Exact when each
    optimizer updated once since: over several updates of one optimizer a doubling (its growth
    steps reached) and a halving cancel out, so a step of several updates uses SkippedUpdates."""
    scaled = [o for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]
    went_down = [tf.less(o.dynamic_scale, before) for o, before in zip(scaled, scales_before)]
    return tf.cast(tf.reduce_any(tf.stack(went_down)), tf.float32) if went_down else tf.constant(0.0)


class SkippedUpdates:
    """Whether any of a training step's several optimizer updates was skipped, on the device
    (inside tf.function, on every replica alike): WGAN-GP's critic LossScaleOptimizer updates 5
    times per iteration and may double its scale at one update and halve it at another, which
    a comparison over the whole step would miss. The scales are compared around each update:
    call `after_update()` after every `apply_gradients`, and return `metrics()` with the step's
    metrics (the session counts its "skipped"). Plain optimizers (float32, bfloat16): {}."""

    def __init__(self, optimizers):
        self.optimizers = [o for o in optimizers if isinstance(o, keras.optimizers.LossScaleOptimizer)]
        self.scales = scales_now(self.optimizers)
        self.flag = tf.constant(0.0)

    def after_update(self):
        if self.optimizers:
            self.flag = tf.maximum(self.flag, any_scale_went_down(self.optimizers, self.scales))
            self.scales = scales_now(self.optimizers)

    def metrics(self) -> dict[str, tf.Tensor]:
        """{"skipped": 1.0 when an update was skipped, else 0.0}; {} when nothing is scaled."""
        return {"skipped": self.flag} if self.optimizers else {}


def loss_scale(optimizers) -> float:
    """The smallest of the optimizers' scales (each LossScaleOptimizer has its own); 1.0
    when nothing is scaled. Read as a tensor: under --distribute the scale is a
    MirroredVariable, which float() refuses (every replica holds the same value)."""
    scales = [float(tf.convert_to_tensor(o.dynamic_scale.value)) for o in optimizers
              if isinstance(o, keras.optimizers.LossScaleOptimizer)]
    return min(scales) if scales else 1.0
