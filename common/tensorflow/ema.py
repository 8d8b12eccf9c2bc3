"""--ema-decay in TensorFlow: an averaged copy of a network, moved after every update
(common/ema.py has the rule; common/pytorch/ema.py is the twin)."""
from __future__ import annotations

import keras
import tensorflow as tf

from common import ema


class ExponentialMovingAverage:
    """`module`: the averaged copy (sample and evaluate with it); `update(network)` in the
    training step, after each of the network's optimizer steps. Build it in the strategy's
    scope, with the network. (Keras' own `use_ema` averages the trainable weights only, not
    batch norm's moving statistics, and not under the LossScaleOptimizer's control.)"""

    def __init__(self, network: keras.Model, decay: float):
        self.module = keras.models.clone_model(network)
        self.module.trainable = False
        self.decay = decay
        self.updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="ema_updates")

    @property
    def variables(self) -> list[tf.Variable]:
        """What a checkpoint saves: the averaged weights, then the count of updates."""
        return [*self.module.weights, self.updates]

    def start_from(self, network: keras.Model) -> None:
        """The average of no update: the network's current weights (after --init-from)."""
        for averaged, current in zip(self.module.weights, network.weights):
            averaged.assign(current)
        self.updates.assign(0)

    def update(self, network: keras.Model) -> None:
        """In the compiled step. Under --distribute every replica holds the same network, and
        the average is moved once, outside the replicas (`merge_call`)."""
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            context.merge_call(lambda strategy: self._move(network))
        else:
            self._move(network)

    def _move(self, network: keras.Model) -> None:
        updates = tf.cast(self.updates.assign_add(1), tf.float64)  # float64, as PyTorch's twin computes it in Python
        weight = 1.0 - ema.decay_at(updates, tf.constant(self.decay, tf.float64), minimum=tf.minimum)
        for averaged, current in zip(self.module.weights, network.weights):
            averaged.assign(averaged + tf.cast(weight, averaged.dtype) * (current - averaged))
