"""How does each framework round its bfloat16 results on this machine? One line per op.

    python scripts/bf16_rounding.py                        # both frameworks
    python scripts/bf16_rounding.py --frameworks pytorch   # one (TensorFlow takes ~10 s to import)

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
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import cpu, models, quiet
from common.errors import UsageError, exit_on_user_error

SECOND_WEIGHT = 0.333984375  # 1/3 to bfloat16's precision: exact in bfloat16, so only the sum is rounded


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


def table(rows: list[dict]) -> str:
    lines = ["| framework | bfloat16 op | mean abs error | mean error toward the sign | rounds |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['framework']} | {r['op']} | {r['error']:.2e} | {r['toward_sign']:+.2e} | {r['verdict']} |"
              for r in rows]
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", choices=models.FRAMEWORKS, default=list(models.FRAMEWORKS))
    parser.add_argument("--count", type=int, default=200_000, help="sums per op (at least 1,000)")
    args = parser.parse_args(argv)
    if args.count < 1000:
        raise UsageError("--count must be at least 1,000: fewer sums cannot tell the roundings apart")
    pairs, exact = sample_pairs(args.count)
    rows = [row for framework in args.frameworks for row in measure(framework, pairs, exact)]
    print(f"CPU: {cpu.summary()}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
