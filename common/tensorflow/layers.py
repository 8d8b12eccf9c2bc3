"""Layers shared by the Keras models (common/pytorch/layers.py is the twin)."""
from __future__ import annotations

import keras
import tensorflow as tf

from common.tensorflow.runtime import onednn_enabled

# Glorot-uniform weights, zero biases: Keras' Dense defaults, spelled out because the PyTorch
# twins set the same (init_like_keras_dense), so both start from the same distribution.
DENSE_INIT = dict(kernel_initializer="glorot_uniform", bias_initializer="zeros")


@keras.saving.register_keras_serializable(package="amp_generative")
class BatchNormalization(keras.layers.BatchNormalization):
    """Keras' batch norm, trained as PyTorch's BatchNorm2d is: one fused kernel, and the
    running variance moved by the unbiased batch variance (Keras' own moves it by the biased one).

    Keras 3 builds batch norm from a dozen float32 ops (moments, then scale and shift, and as
    many again in the gradient); TensorFlow's FusedBatchNormV3 is one op each way and takes
    16-bit inputs as they are. With oneDNN's kernels (by default on CPUs with AVX512
    features) that took DCGAN's TensorFlow step from 57.5 to 51.0 ms in float32 and from 46.9
    to 37.2 under AMP (2-core Zen 4; README, "DCGAN"). TensorFlow's own CPU kernel, which runs
    where oneDNN is off (AVX2-only CPUs), was slower than Keras' ops (90.9 against 85.9), so
    there the layer computes the same function from ops, as --sync-bn (`synchronized`) does
    with the statistics of the global batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.use_fused_kernel = bool(onednn_enabled() or tf.config.get_visible_devices("GPU"))

    def call(self, inputs, training=None, mask=None):
        if (not (training and self.trainable) or self.renorm or mask is not None
                or len(inputs.shape) != 4 or self.axis not in (-1, 3) or not (self.scale and self.center)):
            return super().call(inputs, training=training, mask=mask)  # the running statistics
        x = tf.cast(inputs, self.compute_dtype)
        gamma, beta = tf.cast(self.gamma, tf.float32), tf.cast(self.beta, tf.float32)
        if self.use_fused_kernel and not self.synchronized:  # NHWC; the batch mean and unbiased variance
            empty = tf.constant([], tf.float32)
            y, mean, variance, *_ = tf.raw_ops.FusedBatchNormV3(
                x=x, scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=self.epsilon,
                exponential_avg_factor=1.0, data_format="NHWC", is_training=True)
        else:
            x = tf.cast(x, tf.float32)  # as Keras computes it, 16-bit inputs too
            # under --sync-bn the global batch's moments, all-reduced over the replicas
            mean, biased_variance = keras.ops.moments(x, axes=[0, 1, 2], synchronized=self.synchronized)
            y = tf.cast(tf.nn.batch_normalization(x, mean, biased_variance, beta, gamma, self.epsilon),
                        self.compute_dtype)
            count = tf.cast(tf.size(x) // tf.shape(x)[-1], tf.float32)
            replicas = tf.distribute.get_replica_context()
            if self.synchronized and replicas:  # the replicas' batches are equal shares of the global one
                count *= replicas.num_replicas_in_sync
            variance = biased_variance * count / tf.maximum(count - 1.0, 1.0)
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return y
