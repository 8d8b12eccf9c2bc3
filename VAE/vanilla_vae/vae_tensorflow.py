"""Variational autoencoder (Kingma & Welling, 2014) in TensorFlow/Keras, with automatic mixed
precision.

    python VAE/vanilla_vae/vae_tensorflow.py          # MNIST, float32
    python VAE/vanilla_vae/vae_tensorflow.py --amp    # mixed_bfloat16 on CPU, mixed_float16 on CUDA

An MLP encoder gives the mean and log-variance of q(z|x), a diagonal Gaussian; z is drawn by
reparameterisation, z = mean + exp(logvar / 2) * eps, and an MLP decoder turns z into one
Bernoulli logit per pixel. The loss is the negative ELBO per example, averaged over the batch:
the reconstruction term (BCE-with-logits summed over pixels) plus KL(q(z|x) || N(0, I)).

Under AMP the hidden layers run in 16 bits, but the heads (mean, log-variance, logits) are
built with dtype="float32", and the reparameterisation and the KL cast to float32 first:
exp(logvar) overflows float16 as soon as logvar passes ~11.
The training step, with its GradientTape, scale_loss and apply_gradients calls, is
VAE.train_step below. The PyTorch twin is vae_pytorch.py; the hyperparameters of both are in
hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import math

import keras
import tensorflow as tf
from keras import layers

from common import data as datasets
from common import sampling
from common.config import parse_args
from common.errors import exit_on_user_error
from common.tensorflow.data import load_data
from common.tensorflow.layers import DENSE_INIT
from common.tensorflow.optimizers import make_optimizer
from common.tensorflow.runtime import Noise, Runtime, setup
from common.tensorflow.session import fit
from VAE.vanilla_vae import hparams


def make_encoder(data_shape: tuple, width: int) -> keras.Model:
    """image -> width (400, ReLU) -> mean and log-variance of q(z|x), both heads in float32."""
    x = keras.Input(data_shape)
    h = layers.Flatten()(x)
    h = layers.Dense(width, activation="relu", **DENSE_INIT)(h)
    mean = layers.Dense(hparams.LATENT, dtype="float32", name="mean", **DENSE_INIT)(h)
    logvar = layers.Dense(hparams.LATENT, dtype="float32", name="logvar", **DENSE_INIT)(h)
    return keras.Model(x, [mean, logvar], name="encoder")


def make_decoder(data_shape: tuple, width: int) -> keras.Model:
    """z -> width (400, ReLU) -> one Bernoulli logit per pixel, computed in float32."""
    return keras.Sequential([
        keras.Input((hparams.LATENT,)),
        layers.Dense(width, activation="relu", **DENSE_INIT),
        layers.Dense(math.prod(data_shape), dtype="float32", **DENSE_INIT),
        layers.Reshape(data_shape, dtype="float32"),
    ], name="decoder")


def build_networks(data_shape: tuple, width: int) -> dict[str, keras.Model]:
    """The encoder and decoder for images of this (H, W, C) shape: what main() trains,
    scripts/parity.py ports."""
    return {"encoder": make_encoder(data_shape, width), "decoder": make_decoder(data_shape, width)}


def reparameterize(mean, logvar, eps):
    """z = mean + sigma * eps, in float32: exp(logvar / 2) overflows float16 from logvar ~22."""
    mean, logvar, eps = (tf.cast(t, tf.float32) for t in (mean, logvar, eps))
    return mean + tf.exp(0.5 * logvar) * eps


def vae_loss(x, logits, mean, logvar):
    """Negative ELBO per example, averaged over the batch, in float32: (loss, recon, kl).

    recon = sum over pixels of BCE(x, sigmoid(logits)), taken on the logits (fused and stable);
    kl    = KL(N(mean, exp(logvar)) || N(0, I)) = -1/2 sum(1 + logvar - mean^2 - exp(logvar)).
    """
    x, logits, mean, logvar = (tf.cast(t, tf.float32) for t in (x, logits, mean, logvar))
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=x, logits=logits)
    recon = tf.reduce_mean(tf.reduce_sum(tf.reshape(bce, [tf.shape(bce)[0], -1]), axis=1))
    kl = tf.reduce_mean(-0.5 * tf.reduce_sum(1.0 + logvar - tf.square(mean) - tf.exp(logvar),
                                             axis=1))
    return recon + kl, recon, kl


class VAE:
    """The training step and the sample grids; common/tensorflow/session.py drives it (and
    compiles train_step with tf.function)."""

    def __init__(self, encoder: keras.Model, decoder: keras.Model, cfg, runtime: Runtime):
        self.encoder, self.decoder = encoder, decoder
        self.cfg = cfg
        self.replicas = runtime.replicas  # --distribute's; one by default
        self.z_dim = hparams.LATENT
        self.noise_shape = (sampling.GRID_IMAGES, hparams.LATENT)  # the grids' prior draws
        self.variables = encoder.trainable_variables + decoder.trainable_variables
        self.optimizer = make_optimizer(cfg, runtime)  # a LossScaleOptimizer under float16
        self.optimizer.build(self.variables)  # built now: checkpoints need its slots, scale_loss its scale
        self.noise = Noise(cfg.seed)  # eps; saved in checkpoints
        self.modules = {"encoder": encoder, "decoder": decoder}
        self.optimizers = {"vae": self.optimizer}
        self.averages = {}  # --ema-decay averages GANs' generators
        self._fixed_noise = self._test_images = None

    def train_step(self, x):
        with tf.GradientTape() as tape:
            mean, logvar = self.encoder(x, training=True)
            eps = self.replicas.normal(self.noise, tf.shape(mean)[0], hparams.LATENT)  # noise.normal in one process
            z = reparameterize(mean, logvar, eps)
            logits = self.decoder(z, training=True)
            loss, recon, kl = vae_loss(x, logits, mean, logvar)
            # Under --distribute the optimizer sums the replicas' gradients: each counts its
            # share of the global mean. scale_loss: unchanged unless float16.
            scaled_loss = self.optimizer.scale_loss(self.replicas.share(loss))
        gradients = tape.gradient(scaled_loss, self.variables)
        self.optimizer.apply_gradients(zip(gradients, self.variables))  # unscales; skips on inf/NaN
        return {"loss": loss, "recon": recon, "kl": kl}

    # --- evaluation (common/evaluation.py): numpy in, numpy out, NHWC images in [0, 1] ---
    def sample(self, z):
        return tf.sigmoid(tf.cast(self.decoder(z, training=False), tf.float32)).numpy()

    def encode(self, x):
        mean, logvar = self.encoder(x, training=False)
        return tf.cast(mean, tf.float32).numpy(), tf.cast(logvar, tf.float32).numpy()

    def decode_logits(self, z):
        logits = tf.cast(self.decoder(z, training=False), tf.float32).numpy()
        return logits.reshape(len(z), -1)

    def write_samples(self, run, step: int):
        """Decode the run's fixed prior noise, and reconstruct fixed test images from their
        posterior means (no sampling, so successive grids differ only by training)."""
        if self._fixed_noise is None:
            self._fixed_noise = tf.constant(sampling.fixed_noise(run.path, *self.noise_shape, self.cfg.seed))
            self._test_images = tf.constant(
                datasets.fixed_test_images(self.cfg, hparams.RECONSTRUCTION_COUNT))
        samples = tf.sigmoid(tf.cast(self.decoder(self._fixed_noise, training=False), tf.float32))
        mean, _ = self.encoder(self._test_images, training=False)
        reconstructions = tf.sigmoid(tf.cast(self.decoder(mean, training=False), tf.float32))
        sampling.save_reconstruction_grid(self._test_images.numpy(), reconstructions.numpy(),
                                          run.sample_path(step, "_recon"),
                                          value_range=hparams.PIXEL_RANGE)
        # the samples' grid last: its file tells --resume that the step's grids were written
        sampling.save_image_grid(samples.numpy(), run.sample_path(step),
                                 value_range=hparams.PIXEL_RANGE)


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("vanilla_vae", "tensorflow", argv)
    runtime = setup(cfg)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    with runtime.strategy.scope():  # under --distribute: variables mirrored on every replica
        networks = build_networks(data.sample_shape, cfg.width)
        vae = VAE(networks["encoder"], networks["decoder"], cfg, runtime)
    return fit(cfg, runtime, vae, data)


if __name__ == "__main__":
    main()
