"""The convolutions from and to a 1x1 map (common/tensorflow/layers.py and its twin
common/pytorch/layers.py): DCGAN's G's first layer and D's last, computed as the matmuls they
are. The same function, gradients and weights as the frameworks' own layers, no convolution
op left for the CPU kernels to run over a zero-padded map, and the frameworks' own path for
every other input."""
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

from common.pytorch import layers as torch_layers
from common.tensorflow.layers import Conv2D, Conv2DTranspose
from GAN.dcgan import dcgan_pytorch, dcgan_tensorflow
from scripts import end_layers

CONVOLUTION_OPS = {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"}

# (ours, Keras' own, an input it takes as a matmul): with a bias and an activation, so every
# part of the layer's call is compared
CASES = {
    "transposed from 1x1": (Conv2DTranspose, keras.layers.Conv2DTranspose, (5, 1, 1, 10),
                            dict(filters=4, kernel_size=7, strides=1, padding="valid")),
    "convolution to 1x1": (Conv2D, keras.layers.Conv2D, (5, 7, 7, 6),
                           dict(filters=3, kernel_size=7, strides=1, padding="valid")),
    "transposed from 1x1, stride 2": (Conv2DTranspose, keras.layers.Conv2DTranspose, (5, 1, 1, 10),
                                      dict(filters=4, kernel_size=4, strides=2, padding="valid")),
    "convolution to 1x1, stride 2": (Conv2D, keras.layers.Conv2D, (5, 4, 4, 6),
                                     dict(filters=3, kernel_size=4, strides=2, padding="valid")),
}


def pair(ours, keras_own, input_shape, config):
    """Our layer and Keras' own with the same (random) weights."""
    layer = ours(**config, use_bias=True, bias_initializer="random_normal", activation="tanh")
    layer.build(input_shape)
    reference = keras_own.from_config(layer.get_config())
    reference.build(input_shape)
    reference.set_weights(layer.get_weights())
    return layer, reference


def forward_and_gradients(layer, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * tf.sin(tf.stop_gradient(y)))  # unequal weights on the outputs
    return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]


@pytest.mark.parametrize("case", CASES)
def test_the_same_function_and_gradients_as_keras_own_layer(case):
    ours, keras_own, input_shape, config = CASES[case]
    layer, reference = pair(ours, keras_own, input_shape, config)
    x = tf.random.stateless_normal(input_shape, seed=(1, 2))
    for got, expected in zip(forward_and_gradients(layer, x), forward_and_gradients(reference, x), strict=True):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_no_convolution_op_runs_forward_or_back(case):
    """Why the layers exist: TensorFlow's CPU kernels convolve a 1x1 map (or its 1x1
    gradient) zero-padded to 13x13, 49x the multiply-adds of the matmul."""
    ours, keras_own, input_shape, config = CASES[case]
    layer, reference = pair(ours, keras_own, input_shape, config)

    def op_types(network):
        step = tf.function(lambda x: forward_and_gradients(network, x))
        graph = step.get_concrete_function(tf.TensorSpec(input_shape)).graph.as_graph_def()
        return ({node.op for node in graph.node}
                | {node.op for function in graph.library.function for node in function.node_def})

    assert not op_types(layer) & CONVOLUTION_OPS
    assert op_types(reference) & CONVOLUTION_OPS  # the check sees them where they are


STRIDED = dict(filters=2, kernel_size=4, strides=2, padding="same")
FULL_SAME = dict(filters=2, kernel_size=7, padding="same")


@pytest.mark.parametrize("ours, keras_own, input_shape, config", [
    (Conv2DTranspose, keras.layers.Conv2DTranspose, (2, 3, 3, 4), STRIDED),
    (Conv2DTranspose, keras.layers.Conv2DTranspose, (2, 1, 1, 4), STRIDED),  # 1x1, but "same"
    (Conv2D, keras.layers.Conv2D, (2, 8, 8, 3), STRIDED),
    (Conv2D, keras.layers.Conv2D, (2, 7, 7, 3), FULL_SAME),                  # the kernel's size, but "same"
    # a 1x1 map, "valid", but an output larger than the kernel: a stride above it, a dilation,
    # output padding
    (Conv2DTranspose, keras.layers.Conv2DTranspose, (2, 1, 1, 4), dict(filters=2, kernel_size=2, strides=3)),
    (Conv2DTranspose, keras.layers.Conv2DTranspose, (2, 1, 1, 4), dict(filters=2, kernel_size=4, dilation_rate=2)),
    (Conv2DTranspose, keras.layers.Conv2DTranspose, (2, 1, 1, 4),
     dict(filters=2, kernel_size=4, strides=2, output_padding=1)),
    (Conv2D, keras.layers.Conv2D, (2, 7, 7, 4), dict(filters=4, kernel_size=7, groups=2)),  # grouped
    # channels_first, its (C, H) the kernel's size (mutation round 9: the data_format check dropped
    # from Conv2D's guard went unseen)
    (Conv2D, keras.layers.Conv2D, (2, 3, 3, 3), dict(filters=2, kernel_size=3, data_format="channels_first")),
    # channels_first from one channel on a 1x1 map (mutation round 9: the data_format check dropped
    # from Conv2DTranspose's guard went unseen)
    (Conv2DTranspose, keras.layers.Conv2DTranspose, (2, 1, 1, 1),
     dict(filters=2, kernel_size=3, data_format="channels_first")),
])
def test_every_other_input_takes_keras_own_path(ours, keras_own, input_shape, config):
    layer, reference = pair(ours, keras_own, input_shape, config)
    x = tf.random.stateless_normal(input_shape, seed=(3, 4))
    expected, got = outcome(reference, x), outcome(layer, x)
    if isinstance(expected, str):  # Keras' own path is refused on this CPU: ours must be, alike
        assert isinstance(got, str) and got == expected
    else:
        np.testing.assert_array_equal(got, expected)


def outcome(layer, x):
    """The layer's output, or the error of the op that refused it, its message whole:
    TensorFlow's own CPU kernels (where oneDNN is off, as on AVX2-only CPUs) refuse a dilated
    transposed convolution ("Current CPU implementations do not yet support dilation rates
    larger than 1. [Op:Conv2DBackpropInput]")."""
    try:
        return layer(x).numpy()
    except tf.errors.OpError as error:
        refusal = re.search(r"\}\} (.*?\[Op:\w+\])", str(error), re.DOTALL)  # the op's own words
        return f"{type(error).__name__}: {refusal.group(1) if refusal else error}"


def test_computes_in_the_policys_dtype():
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    layers = [Conv2DTranspose(4, 7, 1, "valid"), Conv2D(3, 7, 1, "valid")]
    outputs = [layers[0](tf.ones((2, 1, 1, 10))), layers[1](tf.ones((2, 7, 7, 6)))]
    assert [y.dtype for y in outputs] == [tf.bfloat16, tf.bfloat16]
    assert [layer.kernel.dtype for layer in layers] == ["float32", "float32"]


def test_dcgans_keras_networks_use_them_at_the_ends():
    networks = dcgan_tensorflow.build_networks((28, 28, 1), 8)
    first = next(layer for layer in networks["generator"].layers if "conv" in layer.name)
    last = [layer for layer in networks["discriminator"].layers if "conv" in layer.name][-1]
    assert type(first) is Conv2DTranspose and type(last) is Conv2D
    assert tuple(first.kernel.shape) == (7, 7, 16, 100) and tuple(last.kernel.shape) == (7, 7, 16, 1)


# --- the PyTorch twins' layers (common/pytorch/layers.py) ---------------------------------------

TORCH_CASES = {
    "transposed from 1x1": (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (5, 10, 1, 1), (10, 4, 7)),
    "convolution to 1x1": (torch_layers.Conv2d, torch.nn.Conv2d, (5, 6, 7, 7), (6, 3, 7)),
    "transposed from 1x1, stride 3": (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (5, 10, 1, 1),
                                      (10, 4, 2, 3)),  # PyTorch's output is the kernel's size whatever the stride
    "convolution to 1x1, stride 2": (torch_layers.Conv2d, torch.nn.Conv2d, (5, 6, 4, 4), (6, 3, 4, 2)),
}


def torch_pair(ours, torch_own, arguments, options=None):
    torch.manual_seed(0)
    layer = ours(*arguments, **(options or {}))
    reference = torch_own(*arguments, **(options or {}))
    reference.load_state_dict(layer.state_dict())
    return layer, reference


def torch_forward_and_gradients(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * y.detach().sin()).sum().backward()
    return [y, x.grad, layer.weight.grad, layer.bias.grad]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("case", TORCH_CASES)
def test_pytorch_the_same_function_and_gradients_as_its_own_layer(case, memory_format):
    """In both layouts: the models keep weights and images channels_last."""
    ours, torch_own, input_shape, arguments = TORCH_CASES[case]
    layer, reference = (net.to(memory_format=memory_format) for net in torch_pair(ours, torch_own, arguments))
    x = torch.randn(input_shape).contiguous(memory_format=memory_format)
    got, expected = torch_forward_and_gradients(layer, x), torch_forward_and_gradients(reference, x)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", TORCH_CASES)
def test_pytorch_no_convolution_runs_forward_or_back(case):
    ours, torch_own, input_shape, arguments = TORCH_CASES[case]

    def aten_ops(layer):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            torch_forward_and_gradients(layer, torch.randn(input_shape))
        return {event.name for event in profile.events()}

    layer, reference = torch_pair(ours, torch_own, arguments)
    assert not {"aten::convolution", "aten::convolution_backward"} & aten_ops(layer)
    assert "aten::convolution" in aten_ops(reference)


@pytest.mark.parametrize("ours, torch_own, input_shape, arguments, options", [
    (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (2, 4, 3, 3), (4, 2, 4, 2, 1), {}),
    (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (2, 4, 1, 1), (4, 2, 4, 2, 1), {}),  # padded
    (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (2, 4, 1, 1), (4, 2, 4), dict(dilation=2)),
    (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (2, 4, 1, 1), (4, 2, 4, 2), dict(output_padding=1)),
    (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (4, 1, 1), (4, 2, 4), {}),  # unbatched
    # grouped (mutation round 9: the groups check dropped from its guard went unseen)
    (torch_layers.ConvTranspose2d, torch.nn.ConvTranspose2d, (2, 4, 1, 1), (4, 2, 4), dict(groups=2)),
    (torch_layers.Conv2d, torch.nn.Conv2d, (2, 3, 8, 8), (3, 2, 4, 2, 1), {}),
    (torch_layers.Conv2d, torch.nn.Conv2d, (2, 3, 7, 7), (3, 2, 7, 1, 3), {}),  # the kernel's size, padded
    (torch_layers.Conv2d, torch.nn.Conv2d, (2, 4, 7, 7), (4, 4, 7), dict(groups=2)),
    (torch_layers.Conv2d, torch.nn.Conv2d, (4, 7, 7), (4, 2, 7), {}),  # unbatched
])
def test_pytorch_every_other_input_takes_its_own_path(ours, torch_own, input_shape, arguments, options):
    layer, reference = torch_pair(ours, torch_own, arguments, options)
    x = torch.randn(input_shape)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)


def test_pytorch_a_dilated_kernel_the_size_of_the_map_is_refused_as_its_own_layer_refuses_it():
    """Dilated, the 3x3 kernel spans 5x5, past the 3x3 map: PyTorch's Conv2d refuses it, and
    the matmul must not compute something in its place (mutation round 9: the dilation check
    dropped from Conv2d's guard went unseen)."""
    layer, reference = torch_pair(torch_layers.Conv2d, torch.nn.Conv2d, (4, 2, 3), dict(dilation=2))
    x = torch.randn(2, 4, 3, 3)
    with pytest.raises(RuntimeError, match="Kernel size can't be greater than actual input size"):
        reference(x)
    with pytest.raises(RuntimeError, match="Kernel size can't be greater than actual input size"):
        layer(x)


def test_pytorch_computes_in_autocasts_dtype():
    layers = [torch_layers.ConvTranspose2d(10, 4, 7), torch_layers.Conv2d(6, 3, 7)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = [layers[0](torch.ones(2, 10, 1, 1)), layers[1](torch.ones(2, 6, 7, 7))]
    assert [y.dtype for y in outputs] == [torch.bfloat16, torch.bfloat16]


def test_dcgans_pytorch_networks_use_them_at_the_ends():
    networks = dcgan_pytorch.build_networks((1, 28, 28), 8)
    convolutions = {name: [m for m in network.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))]
                    for name, network in networks.items()}
    assert type(convolutions["generator"][0]) is torch_layers.ConvTranspose2d
    assert type(convolutions["discriminator"][-1]) is torch_layers.Conv2d


def test_the_timing_script_runs_both_ways_in_both_frameworks(capsys):
    """scripts/end_layers.py, the README's figures: one paired call each, tiny networks."""
    assert end_layers.main(["--calls", "1", "--width", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ratios = [float(line.split("paired ratio ")[1].split()[0]) for line in lines if "paired ratio" in line]
    assert [line.split()[0] for line in lines[1:]] == ["pytorch", "tensorflow"]
    assert len(ratios) == 2 and all(r > 0 for r in ratios), lines  # one per framework


def test_wgan_gps_critic_ends_with_them_too():
    """WGAN-GP's G is DCGAN's; its critic's last layer is a matmul in both frameworks (the
    gradient penalty differentiates through it twice: tests/test_twins_train_alike.py)."""
    from GAN.wgan_gp import wgan_gp_pytorch, wgan_gp_tensorflow

    keras_critic = wgan_gp_tensorflow.make_critic((28, 28, 1), 8)
    torch_critic = wgan_gp_pytorch.Critic((1, 28, 28), 8)
    assert type([layer for layer in keras_critic.layers if "conv" in layer.name][-1]) is Conv2D
    assert type(torch_critic.out.layer) is torch_layers.Conv2d
