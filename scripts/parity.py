"""Do the PyTorch and TensorFlow twins compute the same function? Port one's weights into the
other and compare their outputs on the same inputs.

    python scripts/parity.py --model dcgan
    python scripts/parity.py --model all --image-size 32 --channels 3
    python scripts/parity.py --points          # the 2-D mixtures' MLPs, of the models that take them

For every network of the model (G and D, or the VAE's encoder and decoder), in both porting
directions: build both twins, give the source random weights and random batch-norm statistics
(so that those are tested too), port them, and run both in inference mode on the same inputs:
fixed N(0, I) noise, or the first MNIST test images in the model's range (ring8's first test
points with --points). Printed per row:
the largest absolute difference of the outputs, and the same divided by the largest output
magnitude. Rows are in float32 and under AMP (bfloat16 autocast vs. the mixed_bfloat16 policy,
the CPU's AMP), whose differences are those of two 16-bit computations and are reported, not
judged. Target for float32: every difference at or below 1e-5.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed
from common.quiet import quiet_tensorflow_start

quiet_tensorflow_start()  # before TensorFlow loads: one line of ours instead of its C++ start-up notices

import keras
import numpy as np
import torch

from common import data as datasets
from common import models
from common.errors import UsageError, exit_on_user_error
from common.flags import OneLineErrorParser, first_paragraph
from common.pytorch import porting as torch_porting
from common.tensorflow import porting as keras_porting
from GAN.dcgan import hparams as dcgan_hparams

FLOAT32_TARGET = 1e-5
BATCH = 64


def torch_to_keras(module: torch.nn.Module, model: keras.Model, image_shape_hwc=None) -> None:
    """Copy every weight and batch-norm statistic of `module` into its Keras twin `model`."""
    keras_porting.import_weights(model, torch_porting.export_weights(module, image_shape_hwc))


def keras_to_torch(model: keras.Model, module: torch.nn.Module, image_shape_hwc=None) -> None:
    """Copy every weight and batch-norm statistic of the Keras `model` into its twin `module`."""
    torch_porting.import_weights(module, keras_porting.export_weights(model), image_shape_hwc)


def networks(model: str, data_shape: tuple, width: int | None = None) -> list[tuple]:
    """(name, make_torch(), make_keras(), input) for each network of the model, built by the
    `build_networks` of its two scripts at `width` (default: the model's) for data of
    `data_shape`, (H, W, C) images or (2,) points; input is ("noise", dim) or ("data",
    value_range), read from the Keras network's input shape and the model's hparams."""
    entry = models.get(model)
    width = width or entry.hparams.DEFAULTS["width"]
    torch_shape = data_shape if len(data_shape) == 1 else (data_shape[2], data_shape[0], data_shape[1])
    torch_script, keras_script = entry.module("pytorch"), entry.module("tensorflow")
    found = []
    for name, keras_net in keras_script.build_networks(data_shape, width).items():
        input_shape = tuple(keras_net.inputs[0].shape[1:])
        spec = (("data", entry.hparams.PIXEL_RANGE) if input_shape == tuple(data_shape)
                else ("noise", input_shape[0]))
        found.append((name, lambda name=name: torch_script.build_networks(torch_shape, width)[name],
                      lambda name=name: keras_script.build_networks(data_shape, width)[name], spec))
    return found


def randomize_batch_norm(module: torch.nn.Module, rng: np.random.Generator) -> None:
    """Trained-looking statistics, so a mis-ported running mean or variance shows."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.BatchNorm2d):
                size = layer.num_features
                layer.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.2, size)))
                layer.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, size)))
                layer.bias.copy_(torch.from_numpy(rng.normal(0, 0.1, size)))


def inputs_for(spec: tuple, samples: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    kind, detail = spec
    if kind == "noise":
        return rng.standard_normal((BATCH, detail)).astype(np.float32)
    if samples.ndim == 2:  # points, as the models take them
        return samples.astype(np.float32)
    low, high = detail
    return (samples * (high - low) + low).astype(np.float32)  # images in [0, 1], to the model's range


def run_torch(module, x: np.ndarray, amp: bool) -> list[np.ndarray]:
    tensor = torch.from_numpy(x if x.ndim == 2 else x.transpose(0, 3, 1, 2).copy())
    module.eval()
    with torch.no_grad(), torch.amp.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        outputs = module(tensor)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [o.float().numpy().transpose(0, 2, 3, 1) if o.ndim == 4 else o.float().numpy()
            for o in outputs]


def run_keras(model, x: np.ndarray) -> list[np.ndarray]:
    outputs = model(x, training=False)
    outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
    return [np.asarray(keras.ops.convert_to_numpy(o), dtype=np.float32) for o in outputs]


def compare(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, float]:
    worst_abs = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    scale = max(float(np.abs(y).max()) for y in b)
    return worst_abs, worst_abs / max(scale, 1e-12)


def parity_rows(model: str, data_shape: tuple, samples: np.ndarray,
                precisions=("fp32", "amp-bf16"), seed: int = 0) -> list[dict]:
    rows = []
    try:
        for precision in precisions:
            amp = precision != "fp32"
            keras.mixed_precision.set_global_policy("mixed_bfloat16" if amp else "float32")
            for name, make_torch, make_keras, spec in networks(model, data_shape):
                for direction in ("pytorch->keras", "keras->pytorch"):
                    rng = np.random.default_rng(seed)
                    torch.manual_seed(seed)
                    keras.utils.set_random_seed(seed)
                    torch_net, keras_net = make_torch(), make_keras()
                    if direction == "pytorch->keras":
                        randomize_batch_norm(torch_net, rng)
                        torch_to_keras(torch_net, keras_net, data_shape)
                    else:
                        source = make_torch()  # other random weights, then carried through Keras
                        randomize_batch_norm(source, rng)
                        torch_to_keras(source, keras_net, data_shape)
                        torch.manual_seed(seed + 1)
                        torch_net = make_torch()  # fresh weights, overwritten by the port
                        keras_to_torch(keras_net, torch_net, data_shape)
                    x = inputs_for(spec, samples, rng)
                    worst_abs, worst_rel = compare(run_torch(torch_net, x, amp), run_keras(keras_net, x))
                    rows.append({"model": model, "network": name, "direction": direction,
                                 "precision": precision, "max_abs": worst_abs, "max_rel": worst_rel})
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return rows


def ring_points() -> np.ndarray:
    """The first points of ring8's test split, float32 (N, 2)."""
    return datasets.load_dataset("ring8", split="test", limit=BATCH).x


def mnist_images(image_size: int | None, channels: int) -> np.ndarray:
    """The first MNIST test images in [0, 1], NHWC, resized; with 3 channels, the image, its
    transpose and its negative (1 - x): a port that mixed the channels of a pixel (D's first
    kernel, the encoder's) passed with the image repeated in each."""
    test = datasets.load_dataset("mnist", split="test", limit=BATCH, image_size=image_size)
    gray = datasets.to_unit_range(test.x)
    if channels == 1:
        return gray
    return np.concatenate([gray, gray.transpose(0, 2, 1, 3), 1 - gray], axis=-1)


@exit_on_user_error
def main(argv=None) -> int:
    parser = OneLineErrorParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", choices=(*models.NAMES, "all"), default="all")
    parser.add_argument("--image-size", type=int, choices=sorted(dcgan_hparams.GEOMETRY), default=28)
    parser.add_argument("--channels", type=int, choices=(1, 3), default=1)
    parser.add_argument("--points", action="store_true",
                        help="the networks for 2-D points (ring8's), instead of images")
    args = parser.parse_args(argv)
    chosen = list(models.MODELS.values()) if args.model == "all" else [models.get(args.model)]
    if args.points:
        if args.model != "all" and chosen[0].images_only:
            raise UsageError(f"--points: {chosen[0].key} has no networks for points ({chosen[0].images_only})")
        if args.image_size != 28 or args.channels != 1:
            raise UsageError("--points takes no --image-size or --channels: the points are 2-D")
        samples = ring_points()
        chosen = [model for model in chosen if not model.images_only]
        described = "2-D points (ring8)"
    else:
        samples = mnist_images(args.image_size if args.image_size != 28 else None, args.channels)
        described = "images {}x{}x{}".format(*samples.shape[1:])
    rows = [row for model in chosen for row in parity_rows(model.key, samples.shape[1:], samples)]
    print(f"{described}, batch {BATCH}; float32 target: max abs difference <= {FLOAT32_TARGET:g}")
    print("| model | network | direction | precision | max abs diff | max rel diff |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['network']} | {row['direction']} | {row['precision']} "
              f"| {row['max_abs']:.2e} | {row['max_rel']:.2e} |")
    failed = [r for r in rows if r["precision"] == "fp32" and r["max_abs"] > FLOAT32_TARGET]
    if failed:
        print(f"{len(failed)} float32 rows above {FLOAT32_TARGET:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
