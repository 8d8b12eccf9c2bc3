"""The Keras twins' batch norm (common/tensorflow/layers.py) trains as PyTorch's BatchNorm2d
does, through TensorFlow's fused kernel and through the ops that run where oneDNN is off:
the same outputs and gradients, and running statistics moved by the unbiased variance."""
import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

from common.tensorflow.layers import BatchNormalization
from GAN.dcgan import dcgan_tensorflow, hparams

# 4 images of 3x3: 36 values a channel, so the unbiased variance is 36/35 of the biased one
SHAPE = (4, 3, 3, 5)
STEPS = 3


def torch_training(images, gamma, beta):
    """PyTorch's outputs, gradients and running statistics after STEPS training calls."""
    layer = torch.nn.BatchNorm2d(SHAPE[-1], eps=hparams.BN_EPSILON, momentum=hparams.BN_MOMENTUM)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(gamma))
        layer.bias.copy_(torch.from_numpy(beta))
    for batch in images:
        x = torch.from_numpy(batch).permute(0, 3, 1, 2).requires_grad_()
        y = layer(x)
        (y * y.detach().sin()).sum().backward()  # any loss with unequal weights on the outputs
    return dict(y=y.detach().permute(0, 2, 3, 1).numpy(), dx=x.grad.permute(0, 2, 3, 1).numpy(),
                dgamma=layer.weight.grad.numpy() / STEPS, dbeta=layer.bias.grad.numpy() / STEPS,
                mean=layer.running_mean.numpy(), variance=layer.running_var.numpy())


def keras_training(images, gamma, beta, fused: bool):
    layer = BatchNormalization(momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    layer.build(SHAPE)
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)
    layer.use_fused_kernel = fused
    dgamma, dbeta = 0.0, 0.0
    for batch in images:
        x = tf.constant(batch)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(tf.stop_gradient(y)))
        dx, dg, db = tape.gradient(loss, [x, layer.gamma, layer.beta])
        dgamma, dbeta = dgamma + dg.numpy() / STEPS, dbeta + db.numpy() / STEPS
    return dict(y=y.numpy(), dx=dx.numpy(), dgamma=dgamma, dbeta=dbeta,
                mean=layer.moving_mean.numpy(), variance=layer.moving_variance.numpy())


@pytest.fixture
def batches():
    rng = np.random.default_rng(0)
    images = (rng.standard_normal((STEPS, *SHAPE)) * 3 + 2).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, SHAPE[-1]).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, SHAPE[-1]).astype(np.float32)
    return images, gamma, beta


@pytest.mark.parametrize("fused", [True, False], ids=["fused kernel", "ops"])
def test_batch_norm_trains_as_pytorchs_does(batches, fused):
    expected = torch_training(*batches)
    got = keras_training(*batches, fused=fused)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-5, err_msg=key)


def test_keras_own_batch_norm_moves_the_running_variance_by_the_biased_one(batches):
    """What the class changes: Keras' layer is 35/36 of PyTorch's running variance's move here."""
    images, gamma, beta = batches
    expected = torch_training(images, gamma, beta)
    layer = keras.layers.BatchNormalization(momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    for batch in images:
        layer(tf.constant(batch), training=True)
    moved, expected_move = 1 - layer.moving_variance.numpy(), 1 - expected["variance"]
    assert not np.allclose(moved, expected_move, rtol=1e-3)


@pytest.mark.parametrize("fused", [True, False], ids=["fused kernel", "ops"])
def test_batch_norm_takes_bfloat16_inputs_and_gives_bfloat16_outputs(batches, fused):
    images, gamma, beta = batches
    expected = keras_training(images[:1], gamma, beta, fused=fused)
    layer = BatchNormalization(momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON,
                               dtype="mixed_bfloat16")
    layer.build(SHAPE)
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)
    layer.use_fused_kernel = fused
    y = layer(tf.cast(images[0], tf.bfloat16), training=True)
    assert y.dtype == tf.bfloat16 and layer.moving_variance.dtype == "float32"
    # the inputs' bfloat16 rounding (2^-8 relative) and the outputs'
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy(), expected["y"], atol=0.05)
    np.testing.assert_allclose(layer.moving_variance.numpy(), expected["variance"], rtol=1e-2)


def test_one_value_a_channel_leaves_the_running_variance_finite_through_the_ops():
    """A single value a channel has no unbiased variance: the ops' count - 1 is held at 1, so
    the running variance decays toward 0 rather than turning NaN (mutation round 9: the
    tf.maximum(count - 1, 1) dropped, a 0/0, went unseen)."""
    layer = BatchNormalization(momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    layer.build((1, 1, 1, 5))
    layer.use_fused_kernel = False
    layer(tf.constant(np.arange(5, dtype=np.float32).reshape(1, 1, 1, 5)), training=True)
    np.testing.assert_allclose(layer.moving_variance.numpy(), np.full(5, 1 - hparams.BN_MOMENTUM), rtol=1e-6)
    np.testing.assert_allclose(layer.moving_mean.numpy(), np.arange(5) * hparams.BN_MOMENTUM, rtol=1e-6)


def test_batch_norm_over_another_axis_trains_as_keras_own_does(batches):
    """Only channels-last batch norm is computed by the class: over axis 1 it is Keras' own
    layer (mutation round 9: the axis check dropped, which normalised over the wrong axes,
    went unseen)."""
    images, _, _ = batches
    x = tf.constant(images[0])  # (4, 3, 3, 5), normalised over axis 1: 3 channels
    ours = BatchNormalization(axis=1, momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    own = keras.layers.BatchNormalization(axis=1, momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    y, expected = ours(x, training=True).numpy(), own(x, training=True).numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.moving_variance.numpy(), own.moving_variance.numpy(), rtol=1e-6)


@pytest.mark.parametrize("learned", [dict(scale=False), dict(center=False)], ids=["no scale", "no center"])
def test_batch_norm_without_a_scale_or_a_center_trains_as_keras_own_does(batches, learned):
    """Without gamma or beta the class is Keras' own layer (mutation round 9: the check for
    both dropped from its guard went unseen)."""
    images, _, _ = batches
    x = tf.constant(images[0])
    ours = BatchNormalization(**learned, momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    own = keras.layers.BatchNormalization(**learned, momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    np.testing.assert_allclose(ours(x, training=True).numpy(), own(x, training=True).numpy(), rtol=1e-5, atol=1e-5)


def test_inference_normalises_by_the_running_statistics(batches):
    images, _, _ = batches
    layer = BatchNormalization(epsilon=hparams.BN_EPSILON)
    layer.build(SHAPE)
    layer.moving_mean.assign(np.full(SHAPE[-1], 2.0, np.float32))
    layer.moving_variance.assign(np.full(SHAPE[-1], 4.0, np.float32))
    y = layer(tf.constant(images[0]), training=False).numpy()
    np.testing.assert_allclose(y, (images[0] - 2.0) / np.sqrt(4.0 + hparams.BN_EPSILON), rtol=1e-5, atol=1e-6)


def test_sync_bn_trains_as_pytorch_too(batches):
    """--sync-bn takes the all-reduced moments (tests/test_tf_distribute.py trains on two
    replicas); with one replica they are the batch's own, and the running variance moves by the
    unbiased one, as in PyTorch's SyncBatchNorm, where Keras' own synchronized layer moves it by
    the biased one. It computes from the ops whether or not the fused kernel is on: that kernel
    takes no all-reduced moments."""
    expected = torch_training(*batches)
    layer = BatchNormalization(momentum=1 - hparams.BN_MOMENTUM, epsilon=hparams.BN_EPSILON)
    layer.use_fused_kernel = True
    layer.synchronized = True
    layer.build(SHAPE)
    layer.gamma.assign(batches[1])
    layer.beta.assign(batches[2])
    for batch in batches[0]:
        y = layer(tf.constant(batch), training=True)
    np.testing.assert_allclose(y.numpy(), expected["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), expected["variance"], rtol=1e-6)


def test_dcgans_keras_networks_use_it():
    networks = dcgan_tensorflow.build_networks((28, 28, 1), 8)
    norms = [layer for network in networks.values() for layer in network.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 7 and all(isinstance(layer, BatchNormalization) for layer in norms)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_sample_grids_and_evaluation_leave_training_as_it_was(framework, tmp_path):
    """G itself samples (--ema-decay 0) in inference mode, on its running statistics, and
    training carries on in training mode: a DCGAN run that writes a grid at every step and
    evaluates at the end ends with the weights and statistics of one that writes no grid.
    PyTorch's networks left in eval mode after a grid would train on running statistics; a
    TensorFlow grid drawn in training mode would move G's running statistics."""
    from conftest import checkpoint_arrays

    from GAN.dcgan import dcgan_pytorch

    script = {"pytorch": dcgan_pytorch, "tensorflow": dcgan_tensorflow}[framework]
    tiny = ["--iters", "3", "--width", "4", "--batch-size", "16", "--data-limit", "64", "--ema-decay", "0",
            "--log-every", "1", "--checkpoint-every", "3", "--seed", "2"]
    script.main([*tiny, "--out", str(tmp_path / "grids"), "--sample-every", "1", "--evaluate", "100"])
    script.main([*tiny, "--out", str(tmp_path / "none"), "--sample-every", "0"])
    suffix = "pt" if framework == "pytorch" else "npz"
    with_grids, without = (checkpoint_arrays(tmp_path / run / "checkpoints" / f"step_000003.{suffix}")
                           for run in ("grids", "none"))
    assert with_grids.keys() == without.keys()
    assert sum("generator" in key for key in without) >= 10  # G's layers, batch norm's statistics too
    for key in without:
        np.testing.assert_array_equal(with_grids[key], without[key], err_msg=key)
    assert len(list((tmp_path / "grids" / "samples").glob("*.png"))) == 4  # steps 0 to 3


def test_grids_of_the_average_of_g_leave_its_running_statistics_as_they_were_pytorch(tmp_path):
    """Under --ema-decay the grids and the evaluation sample the average of G, which the session
    puts in inference mode with the networks: left in training mode, each grid was normalised
    by its own batch's statistics and moved the average's running ones. (Mutation round 8:
    leaving the average out of Session._inference's eval() went unseen; the test above runs
    --ema-decay 0.)"""
    from common.config import parse_args
    from common.pytorch.data import load_data
    from common.pytorch.runtime import setup
    from common.pytorch.session import Session
    from common.runs import RunFolder
    from GAN import gan_step_pytorch
    from GAN.dcgan import dcgan_pytorch

    cfg = parse_args("dcgan", "pytorch", ["--ema-decay", "0.5", "--width", "4", "--batch-size", "16",
                                          "--data-limit", "64"])
    runtime = setup(cfg, log=lambda *_: None)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    networks = dcgan_pytorch.build_networks(data.sample_shape, cfg.width)
    gan = gan_step_pytorch.GAN(networks["generator"], networks["discriminator"], dcgan_pytorch.discriminator_loss,
                               dcgan_pytorch.generator_loss, hparams.Z_DIM, cfg, runtime, data)
    gan.average.start_from(gan.generator)
    session = Session(gan, data, runtime)
    session.train_step(session.upload_batches(np.arange(16)[None])[0])
    statistics = {key: tensor.clone() for key, tensor in gan.average.module.state_dict().items() if "running" in key}
    assert len(statistics) >= 4
    run = RunFolder(tmp_path)
    run.samples.mkdir(parents=True)
    session.write_samples(run, 1)
    assert run.sample_path(1).is_file()
    after = gan.average.module.state_dict()
    for key, tensor in statistics.items():
        assert torch.equal(after[key], tensor), key
