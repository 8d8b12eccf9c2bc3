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


@keras.saving.register_keras_serializable(package="amp_generative")
class Conv2DTranspose(keras.layers.Conv2DTranspose):
    """Keras' transposed convolution, computed from a 1x1 map (DCGAN's z -> 7x7x64) as the
    matmul it is: out[n, i, j, o] = sum_c z[n, c] * kernel[i, j, o, c], the same weights.

    TensorFlow's own CPU kernels (Eigen's, where oneDNN is off: AVX2-only CPUs) convolve the
    1x1 map zero-padded to 13x13, 49x the multiply-adds. With Conv2D below, DCGAN's network
    work an iteration was 1.07-1.08x faster there (README, "DCGAN"). Any other input takes Keras'
    own path."""

    def call(self, inputs):
        # (a stride above the kernel's size would make Keras' output stride x stride)
        if not (inputs.shape[1] == inputs.shape[2] == 1 and self.padding == "valid"
                and self.data_format == "channels_last" and self.output_padding is None
                and tuple(self.dilation_rate) == (1, 1)
                and all(stride <= size for stride, size in zip(self.strides, self.kernel_size))):
            return super().call(inputs)
        outputs = keras.ops.einsum("nc,hwoc->nhwo", inputs[:, 0, 0, :], self.kernel)
        if self.use_bias:
            outputs = keras.ops.add(outputs, self.bias)
        return outputs if self.activation is None else self.activation(outputs)


@keras.saving.register_keras_serializable(package="amp_generative")
class Conv2D(keras.layers.Conv2D):
    """Keras' convolution, computed where its kernel covers the whole map with "valid" padding
    (DCGAN's D: 7x7x64 -> one logit) as the matmul it is: out[n, 0, 0, o] =
    sum_ijc x[n, i, j, c] * kernel[i, j, c, o], the same weights. Its input gradient is then
    a matmul too, where TensorFlow's own CPU kernel convolves the 1x1 gradient zero-padded to
    13x13. Any other input takes Keras' own path."""

    def call(self, inputs):
        if not (tuple(inputs.shape[1:3]) == tuple(self.kernel_size) and self.padding == "valid"
                and self.data_format == "channels_last" and self.groups == 1
                and tuple(self.dilation_rate) == (1, 1)):
            return super().call(inputs)
        outputs = keras.ops.einsum("nijc,ijco->no", inputs, self.kernel)[:, None, None, :]
        if self.use_bias:
            outputs = keras.ops.add(outputs, self.bias)
        return outputs if self.activation is None else self.activation(outputs)
