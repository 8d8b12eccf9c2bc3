"""Weights cross between the PyTorch and Keras twins exactly, and the twins then compute the
same function (float32 differences at or below 1e-5) for every model."""
import numpy as np
import pytest
import torch

from common import models
from scripts import parity

SHAPES = [(28, 28, 1), (32, 32, 3)]  # 3 channels exercises the (C,H,W) <-> (H,W,C) reorder


def state(module):
    return {k: v.clone() for k, v in module.state_dict().items() if v.dtype.is_floating_point}


@pytest.mark.parametrize("model", models.MODELS)
@pytest.mark.parametrize("shape", SHAPES, ids=["28x28x1", "32x32x3"])
def test_porting_round_trips_exactly(model, shape):
    rng = np.random.default_rng(0)
    for name, make_torch, make_keras, _ in parity.networks(model, shape):
        torch.manual_seed(0)
        original = make_torch()
        parity.randomize_batch_norm(original, rng)
        keras_net = make_keras()
        parity.torch_to_keras(original, keras_net, shape)
        torch.manual_seed(1)
        back = make_torch()
        parity.keras_to_torch(keras_net, back, shape)
        expected, got = state(original), state(back)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), f"{model} {name} {key}"

        again = make_keras()
        parity.torch_to_keras(back, again, shape)
        for a, b in zip(keras_net.weights, again.weights):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("model", models.MODELS)
@pytest.mark.parametrize("shape", SHAPES, ids=["28x28x1", "32x32x3"])
def test_twins_compute_the_same_function_in_float32(model, shape):
    images = np.random.default_rng(1).uniform(0, 1, (parity.BATCH, *shape)).astype(np.float32)
    rows = parity.parity_rows(model, shape, images, precisions=("fp32",))
    assert {(r["network"], r["direction"]) for r in rows} == {
        (name, direction) for name, *_ in parity.networks(model, shape)
        for direction in ("pytorch->keras", "keras->pytorch")}
    for row in rows:
        assert row["max_abs"] <= parity.FLOAT32_TARGET, row


def test_amp_differences_are_reported_not_hidden():
    shape = (28, 28, 1)
    images = np.random.default_rng(1).uniform(0, 1, (parity.BATCH, *shape)).astype(np.float32)
    rows = parity.parity_rows("vanilla_gan", shape, images, precisions=("fp32", "amp-bf16"))
    fp32 = max(r["max_abs"] for r in rows if r["precision"] == "fp32")
    bf16 = [r["max_abs"] for r in rows if r["precision"] == "amp-bf16"]
    assert len(bf16) == 4 and all(np.isfinite(bf16))
    assert min(bf16) > 10 * fp32  # 16-bit arithmetic really ran on both sides


def test_networks_that_are_not_twins_are_refused():
    from GAN.dcgan import dcgan_tensorflow
    from GAN.vanilla_gan import gan_pytorch

    with pytest.raises(ValueError, match="pairs with Dense, found Conv2DTranspose|not twins"):
        parity.torch_to_keras(gan_pytorch.Generator((1, 28, 28), 128),
                               dcgan_tensorflow.make_generator((28, 28, 1), 32))


def test_parity_script_prints_every_row_and_passes(capsys):
    assert parity.main(["--model", "dcgan"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| dcgan")]
    assert len(table) == 2 * 2 * 2  # networks x directions x precisions
