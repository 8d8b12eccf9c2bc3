"""How does each framework round its bfloat16 results on this machine? One line per op, then
one per layer.

    python scripts/bf16_rounding.py                        # both frameworks
    python scripts/bf16_rounding.py --frameworks pytorch   # one (TensorFlow takes ~10 s to import)
    python scripts/bf16_rounding.py --batch 256            # the layers at another batch size

AMP computes the layers in bfloat16: each matmul or convolution sums in float32 and rounds the
sum to bfloat16's 8-bit mantissa. Rounded to nearest (IEEE's default), the error has mean zero;
rounded toward zero (the 16 low bits dropped), every result is pulled toward zero, by about
0.3% of its size on average, in every layer, forward and backward, the same way every step.

Each op here computes, from inputs that are exact in bfloat16, x1 * 1 + x2 * c for 200,000
pairs of standard-normal x1, x2 (a matmul or a 1x1 convolution over two channels; a cast and
an add for comparison); the exact result is known in float64. The table gives the mean
absolute error and the mean error toward the result's sign, both over the mean magnitude:
about 1.4e-3 and 0 for rounding to nearest, twice that and its negative for rounding toward
zero. What a CPU does depends on its kernels (oneDNN or Eigen, native bfloat16 or not), so the
table names the CPU.

A layer's products sum many terms: a 3x3 convolution's output 9 x channels, its weight gradient
batch x height x width. A kernel that sums them in float32 rounds once, as the ops above do;
one that keeps partial sums in bfloat16 (one per example, say) rounds again at each. The second
table runs the models' layers in bfloat16, forward and backward, from inputs exact in bfloat16,
and gives each product's mean relative error against the framework's own float64 result, as a
multiple of rounding that exact result once to bfloat16: 1.0x is a single rounding, what no
bfloat16 result can beat; 3x is three times its error.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import cpu, models, quiet
from common.errors import UsageError, exit_on_user_error
from common.flags import OneLineErrorParser, first_paragraph, int_in, repeated_values_problem

SECOND_WEIGHT = 0.333984375  # 1/3 to bfloat16's precision: exact in bfloat16, so only the sum is rounded
# Bounds of --count and --batch: an absurd value (an extra zero) ends in a message, not numpy's traceback
MIN_COUNT = 1000        # fewer sums cannot tell the roundings apart
MAX_COUNT = 10**8       # 500x the default; a few GiB of pairs and results per op already
MAX_BATCH = 16_384      # 256x the models' 64: a 32x14x14 activation is then 0.8 GiB in float64, one of several


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32."""
    bits = np.asarray(values, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def sample_pairs(count: int = 200_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(pairs [count, 2] exact in bfloat16, float64 exact x1 + x2 * SECOND_WEIGHT)."""
    pairs = to_bfloat16(np.random.default_rng(seed).standard_normal((count, 2)).astype(np.float32))
    return pairs, pairs[:, 0].astype(np.float64) + pairs[:, 1].astype(np.float64) * SECOND_WEIGHT


def rounding(result: np.ndarray, exact: np.ndarray) -> dict:
    """Mean |error| and mean error toward the sign of the exact value, over mean |exact|; a verdict."""
    error = np.asarray(result, np.float64).ravel() - exact
    scale = np.abs(exact).mean()
    size, toward_sign = np.abs(error).mean() / scale, np.mean(error * np.sign(exact)) / scale
    if size == 0:
        verdict = "exact"
    elif abs(toward_sign) < 0.2 * size:
        verdict = "to nearest"
    elif toward_sign < -0.9 * size:
        verdict = "toward zero"
    else:
        verdict = "biased"
    return {"error": size, "toward_sign": toward_sign, "verdict": verdict}


def pytorch_ops(pairs: np.ndarray) -> dict:
    import torch
    x = torch.from_numpy(pairs).bfloat16()
    weight = torch.tensor([[1.0, SECOND_WEIGHT]]).bfloat16()
    image = x.T.reshape(1, 2, -1, 1)  # [1, 2 channels, count, 1]
    return {
        "cast (float32 sum -> bfloat16)": lambda: (x[:, 0].float() + x[:, 1].float() * SECOND_WEIGHT).bfloat16(),
        "add (x1 + x2*c, elementwise)": lambda: x[:, 0] + x[:, 1] * SECOND_WEIGHT,
        "matmul (nn.Linear)": lambda: torch.nn.functional.linear(x, weight),
        "conv2d 1x1": lambda: torch.nn.functional.conv2d(image, weight.reshape(1, 2, 1, 1)),
        "matmul under autocast": torch.autocast("cpu", dtype=torch.bfloat16)(
            lambda: torch.nn.functional.linear(x.float(), weight.float())),
    }


def tensorflow_ops(pairs: np.ndarray) -> dict:
    quiet.quiet_tensorflow_start()
    import tensorflow as tf
    x = tf.constant(pairs, tf.bfloat16)
    weight = tf.constant([[1.0], [SECOND_WEIGHT]], tf.bfloat16)
    image = tf.reshape(x, (1, -1, 1, 2))  # NHWC, 2 channels
    matmul = lambda a, b: tf.matmul(a, b)  # noqa: E731
    return {
        "cast (float32 sum -> bfloat16)": lambda: tf.cast(tf.cast(x[:, 0], tf.float32)
                                                          + tf.cast(x[:, 1], tf.float32) * SECOND_WEIGHT, tf.bfloat16),
        "add (x1 + x2*c, elementwise)": lambda: x[:, 0] + x[:, 1] * tf.constant(SECOND_WEIGHT, tf.bfloat16),
        "matmul (tf.matmul, Dense)": lambda: matmul(x, weight),
        "matmul, tf.function": lambda: tf.function(matmul)(x, weight),
        "matmul, tf.function(jit_compile=True) (XLA)": lambda: tf.function(matmul, jit_compile=True)(x, weight),
        "conv2d 1x1": lambda: tf.nn.conv2d(image, tf.reshape(weight, (1, 1, 2, 1)), 1, "VALID"),
    }


def measure(framework: str, pairs: np.ndarray, exact: np.ndarray) -> list[dict]:
    ops = (pytorch_ops if framework == "pytorch" else tensorflow_ops)(pairs)
    rows = []
    for name, op in ops.items():
        result = op()
        values = result.float().numpy() if framework == "pytorch" else np.asarray(result, np.float32)
        rows.append({"framework": framework, "op": name, **rounding(values, exact)})
    return rows


# --- whole layers: forward, input gradient, weight gradient -------------------------------

# name -> (kind, input shape, weight shape), PyTorch's layouts: the vanilla GAN's first layer of
# D, DCGAN's 3x3 convolutions at 14x14 and G's transposed convolution from 7x7 to 14x14.
LAYERS = {
    "Dense 784->512": ("dense", (784,), (512, 784)),
    "conv 3x3, 32 channels, 14x14": ("conv", (32, 14, 14), (32, 32, 3, 3)),
    "transposed conv 4x4/2, 64->32 channels, 7x7->14x14": ("transposed", (64, 7, 7), (64, 32, 4, 4)),
}
PRODUCTS = ("forward", "input gradient", "weight gradient")


def output_shape(kind: str, input_shape: tuple, weight_shape: tuple) -> tuple:
    if kind == "dense":
        return (weight_shape[0],)
    _, height, width = input_shape
    if kind == "conv":  # stride 1, "same" padding
        return (weight_shape[0], height, width)
    return (weight_shape[1], 2 * height, 2 * width)  # stride 2, doubles the side


def layer_arrays(kind: str, input_shape: tuple, weight_shape: tuple, batch: int, seed: int = 0) -> list[np.ndarray]:
    """(input, weight, gradient of the output), float32 exact in bfloat16, in PyTorch's layout."""
    rng = np.random.default_rng(seed)
    shapes_and_scales = (((batch, *input_shape), 1.0), (weight_shape, 0.05),
                         ((batch, *output_shape(kind, input_shape, weight_shape)), 1.0))
    return [to_bfloat16(rng.standard_normal(shape).astype(np.float32) * scale) for shape, scale in shapes_and_scales]


def pytorch_layer(kind: str, arrays: list[np.ndarray], dtype: str) -> list[np.ndarray]:
    """The layer's output and the gradients of its input and weight, in `dtype`, as float64."""
    import torch
    import torch.nn.functional as F
    layer = {"dense": F.linear, "conv": lambda x, w: F.conv2d(x, w, padding=1),
             "transposed": lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1)}[kind]
    layout = torch.contiguous_format if kind == "dense" else torch.channels_last  # as the models store them
    inputs, weight, output_gradient = (
        torch.from_numpy(array).to(getattr(torch, dtype)).contiguous(memory_format=layout) for array in arrays)
    inputs.requires_grad_(True), weight.requires_grad_(True)
    output = layer(inputs, weight)
    output.backward(output_gradient)
    return [tensor.detach().double().numpy() for tensor in (output, inputs.grad, weight.grad)]


def tensorflow_layer(kind: str, arrays: list[np.ndarray], dtype: str, xla: bool = False) -> list[np.ndarray]:
    """pytorch_layer's products in TensorFlow (NHWC, Keras' kernel layouts), eager or under XLA."""
    quiet.quiet_tensorflow_start()
    import tensorflow as tf
    inputs, weight, output_gradient = arrays
    if kind == "dense":
        weight = weight.T  # (out, in) -> Keras' (in, out)
    else:  # NCHW -> NHWC; (out, in, k, k) or (in, out, k, k) -> (k, k, in, out) or (k, k, out, in)
        inputs, output_gradient = inputs.transpose(0, 2, 3, 1), output_gradient.transpose(0, 2, 3, 1)
        weight = weight.transpose(2, 3, 1, 0)
    layer = {"dense": tf.matmul, "conv": lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"),
             "transposed": lambda x, w: tf.nn.conv2d_transpose(x, w, output_gradient.shape, 2, "SAME")}[kind]

    def products(inputs, weight, output_gradient):
        with tf.GradientTape() as tape:
            tape.watch([inputs, weight])
            output = layer(inputs, weight)
        return [output, *tape.gradient(output, [inputs, weight], output_gradients=output_gradient)]

    tensors = [tf.constant(array, getattr(tf, dtype)) for array in (inputs, weight, output_gradient)]
    if not xla:
        return [np.asarray(tf.cast(tensor, tf.float64)) for tensor in products(*tensors)]
    # One compiled function per layer and dtype, each traced once: TensorFlow's warning about
    # functions that retrace often counts them all together, so it is muted meanwhile.
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")
    try:
        return [np.asarray(tf.cast(tensor, tf.float64)) for tensor in tf.function(products, jit_compile=True)(*tensors)]
    finally:
        logger.setLevel(level)


def in_roundings(result: np.ndarray, exact: np.ndarray) -> float:
    """Mean relative error of `result` as a multiple of that of `exact` rounded once to bfloat16."""
    once = rounding(to_bfloat16(exact.astype(np.float32)), exact.ravel())["error"]
    return rounding(result, exact.ravel())["error"] / once


def measure_layers(framework: str, dtype: str = "bfloat16", batch: int = 64) -> list[dict]:
    """One row per layer and way of running it: each product's error in single roundings."""
    runners = {"pytorch": {"eager": pytorch_layer},
               "tensorflow": {"eager": tensorflow_layer,
                              "XLA": lambda kind, arrays, dtype: tensorflow_layer(kind, arrays, dtype, xla=True)}}
    rows = []
    for how, run in runners[framework].items():
        for name, (kind, input_shape, weight_shape) in LAYERS.items():
            arrays = layer_arrays(kind, input_shape, weight_shape, batch)
            exact, results = run(kind, arrays, "float64"), run(kind, arrays, dtype)
            rows.append({"framework": framework, "run": how, "layer": name,
                         **{product: in_roundings(result, reference)
                            for product, result, reference in zip(PRODUCTS, results, exact)}})
    return rows


def layer_table(rows: list[dict], batch: int) -> str:
    lines = [f"| framework | run | layer (batch {batch}) | forward | input gradient | weight gradient |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['framework']} | {r['run']} | {r['layer']} | "
              + " | ".join(f"{r[product]:.1f}x" for product in PRODUCTS) + " |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| framework | bfloat16 op | mean abs error | mean error toward the sign | rounds |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['framework']} | {r['op']} | {r['error']:.2e} | {r['toward_sign']:+.2e} | {r['verdict']} |"
              for r in rows]
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None) -> int:
    parser = OneLineErrorParser(description=first_paragraph(__doc__))
    parser.add_argument("--frameworks", nargs="+", choices=models.FRAMEWORKS, default=list(models.FRAMEWORKS))
    parser.add_argument("--count", type=int_in(MIN_COUNT, MAX_COUNT), default=200_000,
                        help=f"sums per op ({MIN_COUNT:,} to {MAX_COUNT:,}: fewer cannot tell the roundings apart)")
    parser.add_argument("--batch", type=int_in(1, MAX_BATCH), default=64,
                        help=f"the layers' batch (the models' default: 64; at most {MAX_BATCH:,})")
    args = parser.parse_args(argv)
    if problem := repeated_values_problem("--frameworks", args.frameworks):  # every row twice
        raise UsageError(problem)
    pairs, exact = sample_pairs(args.count)
    rows = [row for framework in args.frameworks for row in measure(framework, pairs, exact)]
    print(f"CPU: {cpu.summary()}\n")
    print(table(rows))
    print("\nWhole layers in bfloat16, each product's error in single roundings (1.0x: rounded once):\n")
    layer_rows = [row for framework in args.frameworks for row in measure_layers(framework, batch=args.batch)]
    print(layer_table(layer_rows, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
