"""How far is an AMP gradient from the float32 one, weight by weight, in each framework?

    python scripts/amp_gradients.py                        # the vanilla GAN, both frameworks
    python scripts/amp_gradients.py --model dcgan --batches 4

From the same weights (PyTorch's initialisation, ported into the Keras twin) and the same
batches (MNIST training images in the model's range, N(0, I) noise), the GAN step's two
gradients are computed in float32 and under AMP (bfloat16 autocast / the mixed_bfloat16
policy, AMP on a CPU): D's, of its loss on a real and a fake batch, and G's, of its loss
through D. Printed per weight: ||g_amp - g_fp32|| / ||g_fp32||, the mean over --batches. The
two frameworks' float32 gradients are compared too, as sorted values (which a layout's
transposition keeps): within 3e-3 here, batch norm amplifying float32's rounding; over 5e-2 the
script stops, the twins' weights not paired as it assumes. So what the two AMP columns differ by
is each framework's 16-bit arithmetic. On the CPU (TensorFlow's ops placed there too), eagerly:
TensorFlow's bfloat16 MatMul rounds the same in tf.function (scripts/bf16_rounding.py). One step
from the initial weights, D not updated before G's gradient: a look at the arithmetic, not a
training run; how far a gradient errs does not by itself say what AMP costs a whole training
(README, "What --amp does").
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import keras
import numpy as np
import tensorflow as tf
import torch

from common import data as datasets
from common import models
from common.errors import UsageError, exit_on_user_error
from common.flags import OneLineErrorParser
from scripts.parity import torch_to_keras

# The GANs whose step is D's loss on a real and a fake batch, then G's through D (WGAN-GP's critic
# loss has a gradient penalty, a second derivative, that this step does not compute).
GAN_MODELS = ("vanilla_gan", "lsgan", "dcgan")
FLOAT32_LIMIT = 5e-2  # past this, the two frameworks' float32 gradients are of different weights


def relative_error(approximate: np.ndarray, exact: np.ndarray) -> float:
    """||approximate - exact|| / ||exact||; NaN where the exact gradient is 0."""
    norm = np.linalg.norm(exact)
    return float(np.linalg.norm(approximate - exact) / norm) if norm else float("nan")


def layout_free_gap(keras_gradient: np.ndarray, torch_gradient: np.ndarray) -> float:
    """How far two gradients of one weight, each in its framework's layout, are apart: compared
    as sorted values, which a transposition keeps and another weight's would not."""
    return relative_error(np.sort(keras_gradient, axis=None), np.sort(torch_gradient, axis=None))


def pytorch_gradients(script, networks: dict, real: np.ndarray, z: np.ndarray, amp: bool) -> list[np.ndarray]:
    """D's gradients, then G's, as the training step computes them (gan_step_pytorch.py)."""
    generator, discriminator = networks["generator"], networks["discriminator"]
    real_batch = torch.from_numpy(real).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        fake = generator(torch.from_numpy(z))
        d_loss = script.discriminator_loss(discriminator(real_batch), discriminator(fake.detach()))
    d_gradients = torch.autograd.grad(d_loss, list(discriminator.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        g_loss = script.generator_loss(discriminator(fake))
    g_gradients = torch.autograd.grad(g_loss, list(generator.parameters()))
    return [g.double().numpy() for g in (*d_gradients, *g_gradients)]


def tensorflow_gradients(script, networks: dict, real: np.ndarray, z: np.ndarray) -> list[np.ndarray]:
    """D's gradients, then G's, under the policy the networks were built with (gan_step_tensorflow.py)."""
    generator, discriminator = networks["generator"], networks["discriminator"]
    with tf.GradientTape(persistent=True) as tape:
        fake = generator(tf.constant(z), training=True)
        d_loss = script.discriminator_loss(discriminator(tf.constant(real), training=True),
                                           discriminator(fake, training=True))
        g_loss = script.generator_loss(discriminator(fake, training=True))
    gradients = [*tape.gradient(d_loss, discriminator.trainable_variables),
                 *tape.gradient(g_loss, generator.trainable_variables)]
    return [np.asarray(g, np.float64) for g in gradients]


def keras_networks(script, image_shape_hwc: tuple, width: int, policy: str, torch_networks: dict) -> dict:
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        networks = script.build_networks(image_shape_hwc, width)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    for name, network in networks.items():
        torch_to_keras(torch_networks[name], network, image_shape_hwc)
    return networks


def measure(model: str, width: int | None, batch_size: int, batches: int, seed: int = 0) -> dict:
    """Per weight (D's, then G's): its name and shape in PyTorch, and the mean relative error of
    each framework's AMP gradient; and how far apart the two frameworks' float32 gradients are
    at most (layout_free_gap)."""
    entry = models.get(model)
    torch_script, keras_script = entry.module("pytorch"), entry.module("tensorflow")
    width = width or entry.hparams.DEFAULTS["width"]
    train = datasets.load_dataset("mnist", limit=batch_size * batches)
    low, high = entry.hparams.PIXEL_RANGE
    images = (datasets.to_unit_range(train.x) * (high - low) + low).astype(np.float32)
    if len(images) < batch_size * batches:
        raise UsageError(f"--batch-size {batch_size} x --batches {batches} is more than MNIST's {len(images)} images")
    torch.manual_seed(seed)
    image_shape_chw = (images.shape[3], *images.shape[1:3])
    torch_networks = {name: network.to(memory_format=torch.channels_last)
                      for name, network in torch_script.build_networks(image_shape_chw, width).items()}
    keras_fp32 = keras_networks(keras_script, images.shape[1:], width, "float32", torch_networks)
    keras_amp = keras_networks(keras_script, images.shape[1:], width, "mixed_bfloat16", torch_networks)
    names = [(network, name, tuple(p.shape)) for network in ("discriminator", "generator")
             for name, p in torch_networks[network].named_parameters()]
    noise = np.random.default_rng(seed).standard_normal((batches, batch_size, entry.hparams.Z_DIM), np.float32)
    errors = {"pytorch": np.zeros(len(names)), "tensorflow": np.zeros(len(names))}
    float32_gap = 0.0
    for index in range(batches):
        real, z = images[index * batch_size:(index + 1) * batch_size], noise[index]
        torch_fp32 = pytorch_gradients(torch_script, torch_networks, real, z, amp=False)
        torch_amp = pytorch_gradients(torch_script, torch_networks, real, z, amp=True)
        keras_fp32_gradients = tensorflow_gradients(keras_script, keras_fp32, real, z)
        keras_amp_gradients = tensorflow_gradients(keras_script, keras_amp, real, z)
        if [g.size for g in keras_fp32_gradients] != [g.size for g in torch_fp32]:
            raise RuntimeError(f"{model}: the two twins' weights do not pair up one to one")
        errors["pytorch"] += [relative_error(a, e) for a, e in zip(torch_amp, torch_fp32)]
        errors["tensorflow"] += [relative_error(a, e) for a, e in zip(keras_amp_gradients, keras_fp32_gradients)]
        gaps = [layout_free_gap(k, t) for k, t in zip(keras_fp32_gradients, torch_fp32)]
        float32_gap = max([float32_gap, *(gap for gap in gaps if not np.isnan(gap))])
        if float32_gap > FLOAT32_LIMIT:
            raise RuntimeError(f"{model}: the twins' float32 gradients differ by {float32_gap:.1e}: "
                               "their weights do not pair up in the order this script assumes")
    return {"weights": [{"network": network, "name": name, "shape": shape,
                         "pytorch": errors["pytorch"][i] / batches, "tensorflow": errors["tensorflow"][i] / batches}
                        for i, (network, name, shape) in enumerate(names)],
            "float32_gap": float32_gap}


def table(result: dict) -> str:
    def error(value: float) -> str:
        return "-" if np.isnan(value) else f"{value:.4f}"  # "-": a float32 gradient of 0

    lines = ["| network | weight (PyTorch's name) | shape | PyTorch | TensorFlow |", "|---|---|---|---|---|"]
    for row in result["weights"]:
        lines.append(f"| {row['network']} | {row['name']} | {'x'.join(map(str, row['shape']))} "
                     f"| {error(row['pytorch'])} | {error(row['tensorflow'])} |")
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None) -> dict:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=GAN_MODELS, default="vanilla_gan")
    parser.add_argument("--width", type=int, help="the networks' width (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8, help="batches the errors are averaged over")
    args = parser.parse_args(argv)
    # DCGAN's batch norm needs two examples to normalise over
    if args.batch_size < 2 or args.batches < 1 or (args.width is not None and args.width < 1):
        raise UsageError("--batch-size must be at least 2, --batches and --width at least 1")
    with tf.device("/CPU:0"):  # beside PyTorch's CPU computation, also where a GPU is
        result = measure(args.model, args.width, args.batch_size, args.batches)
    print(f"{args.model}: ||g_amp - g_fp32|| / ||g_fp32|| of one step's gradients, bfloat16, mean of "
          f"{args.batches} batches of {args.batch_size}, from the same weights in both frameworks")
    print(table(result))
    print(f"float32 gradients, PyTorch against TensorFlow (sorted values): largest relative difference "
          f"{result['float32_gap']:.1e}")
    return result


if __name__ == "__main__":
    main()
