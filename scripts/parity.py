"""Do the PyTorch and TensorFlow twins compute the same function? Port one's weights into the
other and compare their outputs on the same inputs.

    python scripts/parity.py --model dcgan
    python scripts/parity.py --model all --image-size 32 --channels 3

For every network of the model (G and D, or the VAE's encoder and decoder), in both porting
directions: build both twins, give the source random weights and random batch-norm statistics
(so that those are tested too), port them, and run both in inference mode on the same inputs:
fixed N(0, I) noise, or the first MNIST test images in the model's range. Printed per row:
the largest absolute difference of the outputs, and the same divided by the largest output
magnitude. Rows are in float32 and under AMP (bfloat16 autocast vs. the mixed_bfloat16 policy,
the CPU's AMP), whose differences are those of two 16-bit computations and are reported, not
judged. Target for float32: every difference at or below 1e-5.
"""
from __future__ import annotations

import argparse
import sys

import keras
import numpy as np
import torch

from common import data as datasets
from common import porting
from GAN.dcgan import dcgan_pytorch, dcgan_tensorflow
from GAN.dcgan import hparams as dcgan_hparams
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
from GAN.vanilla_gan import hparams as gan_hparams
from VAE.vanilla_vae import hparams as vae_hparams
from VAE.vanilla_vae import vae_pytorch, vae_tensorflow

MODELS = ("vanilla_gan", "lsgan", "dcgan", "vanilla_vae")
FLOAT32_TARGET = 1e-5
BATCH = 64


def networks(model: str, image_shape_hwc: tuple) -> list[tuple]:
    """(name, make_torch(), make_keras(), input) for each network; input is ("noise", dim) or
    ("image", value_range)."""
    height, width, channels = image_shape_hwc
    chw = (channels, height, width)
    if model in ("vanilla_gan", "lsgan"):  # LSGAN uses the vanilla GAN's networks
        return [("generator", lambda: gan_pytorch.Generator(chw, squash=True),
                 lambda: gan_tensorflow.make_generator(image_shape_hwc, squash=True),
                 ("noise", gan_hparams.Z_DIM)),
                ("discriminator", lambda: gan_pytorch.Discriminator(chw),
                 lambda: gan_tensorflow.make_discriminator(image_shape_hwc), ("image", (-1, 1)))]
    if model == "dcgan":
        return [("generator", lambda: dcgan_pytorch.Generator(chw),
                 lambda: dcgan_tensorflow.make_generator(image_shape_hwc),
                 ("noise", dcgan_hparams.Z_DIM)),
                ("discriminator", lambda: dcgan_pytorch.Discriminator(chw),
                 lambda: dcgan_tensorflow.make_discriminator(image_shape_hwc), ("image", (-1, 1)))]
    if model == "vanilla_vae":
        return [("encoder", lambda: vae_pytorch.Encoder(chw),
                 lambda: vae_tensorflow.make_encoder(image_shape_hwc), ("image", (0, 1))),
                ("decoder", lambda: vae_pytorch.Decoder(chw),
                 lambda: vae_tensorflow.make_decoder(image_shape_hwc),
                 ("noise", vae_hparams.LATENT))]
    raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")


def randomize_batch_norm(module: torch.nn.Module, rng: np.random.Generator) -> None:
    """Trained-looking statistics, so a mis-ported running mean or variance shows."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.BatchNorm2d):
                size = layer.num_features
                layer.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.2, size)))
                layer.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, size)))
                layer.bias.copy_(torch.from_numpy(rng.normal(0, 0.1, size)))


def inputs_for(spec: tuple, images_hwc: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    kind, detail = spec
    if kind == "noise":
        return rng.standard_normal((BATCH, detail)).astype(np.float32)
    low, high = detail
    return (images_hwc * (high - low) + low).astype(np.float32)  # images_hwc is in [0, 1]


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


def parity_rows(model: str, image_shape_hwc: tuple, images_hwc: np.ndarray,
                precisions=("fp32", "amp-bf16"), seed: int = 0) -> list[dict]:
    rows = []
    try:
        for precision in precisions:
            amp = precision != "fp32"
            keras.mixed_precision.set_global_policy("mixed_bfloat16" if amp else "float32")
            for name, make_torch, make_keras, spec in networks(model, image_shape_hwc):
                for direction in ("pytorch->keras", "keras->pytorch"):
                    rng = np.random.default_rng(seed)
                    torch.manual_seed(seed)
                    keras.utils.set_random_seed(seed)
                    torch_net, keras_net = make_torch(), make_keras()
                    if direction == "pytorch->keras":
                        randomize_batch_norm(torch_net, rng)
                        porting.torch_to_keras(torch_net, keras_net, image_shape_hwc)
                    else:
                        source = make_torch()  # other random weights, then carried through Keras
                        randomize_batch_norm(source, rng)
                        porting.torch_to_keras(source, keras_net, image_shape_hwc)
                        torch.manual_seed(seed + 1)
                        torch_net = make_torch()  # fresh weights, overwritten by the port
                        porting.keras_to_torch(keras_net, torch_net, image_shape_hwc)
                    x = inputs_for(spec, images_hwc, rng)
                    worst_abs, worst_rel = compare(run_torch(torch_net, x, amp), run_keras(keras_net, x))
                    rows.append({"model": model, "network": name, "direction": direction,
                                 "precision": precision, "max_abs": worst_abs, "max_rel": worst_rel})
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return rows


def mnist_images(image_size: int | None, channels: int) -> np.ndarray:
    """The first MNIST test images in [0, 1], NHWC, resized and repeated to `channels`."""
    test = datasets.load_dataset("mnist", split="test", limit=BATCH, image_size=image_size)
    return np.repeat(datasets.to_unit_range(test.x), channels, axis=-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument("--image-size", type=int, choices=sorted(dcgan_hparams.GEOMETRY), default=28)
    parser.add_argument("--channels", type=int, choices=(1, 3), default=1)
    args = parser.parse_args(argv)
    images = mnist_images(args.image_size if args.image_size != 28 else None, args.channels)
    shape = images.shape[1:]
    rows = [row for model in (MODELS if args.model == "all" else (args.model,))
            for row in parity_rows(model, shape, images)]
    print(f"images {shape[0]}x{shape[1]}x{shape[2]}, batch {BATCH}; "
          f"float32 target: max abs difference <= {FLOAT32_TARGET:g}")
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
