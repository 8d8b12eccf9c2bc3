"""How far is an AMP gradient from the float32 one, weight by weight, in each framework?

    python scripts/amp_gradients.py                        # the vanilla GAN, both frameworks
    python scripts/amp_gradients.py --model dcgan --batches 4
    python scripts/amp_gradients.py --weights runs/lsgan/tensorflow-fp32   # a trained run's weights

From the same weights (PyTorch's initialisation, or with --weights a run's last checkpoint, of
either framework, ported into the other twin) and the same batches (MNIST training images in
the model's range, N(0, I) noise), the GAN step's two gradients are computed in float32 and
under AMP (bfloat16 autocast / the mixed_bfloat16 policy, AMP on a CPU): D's, of its loss on a
real and a fake batch, and G's, of its loss through D. Printed per weight and per network:
||g_amp - g_fp32|| / ||g_fp32||, the mean over --batches; beside it, as the yardstick, how far
one batch's float32 gradient is from the previous batch's (the minibatch noise every step has
anyway). The two frameworks' float32 gradients are compared too, as sorted values (which a
layout's transposition keeps): within 3e-3 at the initialisation, 2e-2 at DCGAN's trained
weights, batch norm amplifying float32's rounding; over 5e-2 the script stops, the twins'
weights not paired as it assumes (at --weights' checkpoint, gradients at float32's limits:
refused in one line, as are inf/NaN weights). So what the two AMP columns differ by is each
framework's 16-bit arithmetic. On the CPU (TensorFlow's ops placed there too), eagerly:
TensorFlow's bfloat16 MatMul rounds the same in tf.function (scripts/bf16_rounding.py). One
step at fixed weights, D not updated before G's gradient: a look at the arithmetic, not a
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
from common import flags, models
from common.config import MAX_WIDTH
from common.errors import CheckpointError, UsageError, UserError, described, exit_on_user_error
from common.flags import OneLineErrorParser
from common.pytorch.checkpoint import first_nonfinite, load_tensors
from common.runs import RunFolder, check_regular_file
from scripts.parity import keras_to_torch, torch_to_keras

# The GANs whose step is D's loss on a real and a fake batch, then G's through D (WGAN-GP's critic
# loss has a gradient penalty, a second derivative, that this step does not compute).
GAN_MODELS = ("vanilla_gan", "lsgan", "dcgan")
FLOAT32_LIMIT = 5e-2  # past this, the two frameworks' float32 gradients are of different weights
MNIST_TRAIN_IMAGES = 60_000  # the batches' source: --batch-size x --batches must fit in it (measure checks the product)


def relative_error(approximate: np.ndarray, exact: np.ndarray) -> float:
    """||approximate - exact|| / ||exact||; inf where the approximation holds inf/NaN (an AMP
    gradient that overflowed is no gradient), NaN where the exact gradient is 0."""
    if not np.all(np.isfinite(approximate)):
        return float("inf")
    norm = np.linalg.norm(exact)
    return float(np.linalg.norm(approximate - exact) / norm) if norm else float("nan")


def layout_free_gap(keras_gradient: np.ndarray, torch_gradient: np.ndarray) -> float:
    """How far two gradients of one weight, each in its framework's layout, are apart: compared
    as sorted values, which a transposition keeps and another weight's would not."""
    return relative_error(np.sort(keras_gradient, axis=None), np.sort(torch_gradient, axis=None))


def network_error(approximate: list[np.ndarray], exact: list[np.ndarray]) -> float:
    """relative_error of a network's gradients taken together, as one vector."""
    return relative_error(np.concatenate([g.ravel() for g in approximate]),
                          np.concatenate([g.ravel() for g in exact]))


def trained_run(folder: Path, model: str | None, width: int | None) -> tuple[dict, int, Path]:
    """A finished MNIST run's config and its last checkpoint (step, path); one UserError line
    when it is not one, or not of the --model and --width asked."""
    run = RunFolder(folder)
    config, _ = run.read_finished()
    if config.get("model") not in GAN_MODELS:
        raise UsageError(f"--weights {folder} is a run of {config.get('model')!r}; this script measures "
                         f"{', '.join(GAN_MODELS)}")
    # an edited width of -1 or 10**30 built no network: a traceback from the framework
    if (config["framework"] not in ("pytorch", "tensorflow") or type(config.get("width")) is not int
            or not 1 <= config["width"] <= MAX_WIDTH):
        raise UserError(f"{folder / 'config.json'} is damaged: framework {config['framework']!r}, "
                        f"width {config.get('width')!r}")
    if model not in (None, config["model"]) or width not in (None, config["width"]):
        raise UsageError(f"--weights {folder} is {config['model']} at width {config['width']}: leave "
                         "--model and --width out, or give the run's")
    if config.get("dataset") != "mnist" or config.get("image_size") not in (None, 28) or config.get("data_dir"):
        raise UsageError(f"--weights {folder} was trained on {config.get('dataset')!r}, not the embedded "
                         "MNIST at 28x28 this script measures on")
    latest = run.latest_checkpoint()
    if latest is None:
        raise UserError(f"--weights {folder} has no checkpoint to take the weights from")
    return config, *latest


def load_checkpoint_weights(path: Path, framework: str, keras_script, torch_networks: dict,
                            image_shape_hwc: tuple, width: int) -> None:
    """The networks of a checkpoint (not its averages or optimizers) into `torch_networks`:
    loaded as they are from a PyTorch one, ported from a TensorFlow one. Read as the runs'
    own restore reads them: no pickled code (weights_only, allow_pickle=False)."""
    try:  # both frameworks' refusals say which flag they are about
        if framework == "pytorch":
            state = load_tensors(path)
        else:
            check_regular_file(path, "checkpoint")
    except CheckpointError as error:
        raise CheckpointError(f"--weights: {error}") from None
    try:
        if framework == "pytorch":
            modules = state["modules"]
            for name, network in torch_networks.items():
                network.load_state_dict(modules[name])
        else:
            arrays = datasets.read_npz_arrays(path, keep=lambda key: key.startswith("module/"))
            for name, network in keras_script.build_networks(image_shape_hwc, width).items():
                keys = sorted(key for key in arrays if key.startswith(f"module/{name}/"))
                # Keras' set_weights casts what it is given: strings of digits became weights
                if odd := next((key for key in keys if arrays[key].dtype.kind != "f"), None):
                    raise ValueError(f"{odd} holds {arrays[odd].dtype.str}, not floating-point weights")
                network.set_weights([arrays[key] for key in keys])
                keras_to_torch(network, torch_networks[name], image_shape_hwc)
    except Exception as error:  # unpickling, zip and shape errors have many types; all mean "not these networks"
        raise CheckpointError(f"--weights: checkpoint {path} does not hold this model's networks "
                              f"({described(error)[:200]})") from None
    # checked as the networks hold them, a TensorFlow checkpoint's too (a float64 1e300 is inf in
    # float32): every gradient would be NaN, float32's too, leaving nothing to measure against
    for name, network in torch_networks.items():  # the weights: training mode reads no running statistics
        found = first_nonfinite(dict(network.named_parameters()), name)
        if found:
            raise CheckpointError(f"--weights: checkpoint {path} holds inf/NaN in {found} (PyTorch's name): "
                                  "its gradients are NaN, there is nothing to measure")


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


def measure(model: str | None, width: int | None, batch_size: int, batches: int, seed: int = 0,
            weights: Path | None = None) -> dict:
    """Per weight (D's, then G's) and per network: its name and shape in PyTorch, the mean
    relative error of each framework's AMP gradient, and the minibatch noise (float32, batch
    against the previous batch; NaN with one batch); and how far apart the two frameworks'
    float32 gradients are at most (layout_free_gap). From PyTorch's initialisation, or the last
    checkpoint of the run folder `weights`."""
    source = "PyTorch's initialisation"
    if weights is not None:
        config, step, checkpoint = trained_run(weights, model, width)
        model, width = config["model"], config["width"]
        source = f"{checkpoint}, step {step}, trained in {config['framework']}"
    model = model or "vanilla_gan"
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
    if weights is not None:
        load_checkpoint_weights(checkpoint, config["framework"], keras_script, torch_networks, images.shape[1:], width)
    keras_fp32 = keras_networks(keras_script, images.shape[1:], width, "float32", torch_networks)
    keras_amp = keras_networks(keras_script, images.shape[1:], width, "mixed_bfloat16", torch_networks)
    names = [(network, name, tuple(p.shape)) for network in ("discriminator", "generator")
             for name, p in torch_networks[network].named_parameters()]
    noise = np.random.default_rng(seed).standard_normal((batches, batch_size, entry.hparams.Z_DIM), np.float32)
    errors = {"pytorch": np.zeros(len(names)), "tensorflow": np.zeros(len(names))}
    noise_errors = np.zeros(len(names))
    discriminator_weights = len(list(torch_networks["discriminator"].parameters()))
    split = {"discriminator": slice(0, discriminator_weights), "generator": slice(discriminator_weights, None)}
    totals = {(network, column): 0.0 for network in split for column in ("pytorch", "tensorflow", "noise")}
    float32_gap, worst, previous = 0.0, None, None
    for index in range(batches):
        real, z = images[index * batch_size:(index + 1) * batch_size], noise[index]
        torch_fp32 = pytorch_gradients(torch_script, torch_networks, real, z, amp=False)
        torch_amp = pytorch_gradients(torch_script, torch_networks, real, z, amp=True)
        keras_fp32_gradients = tensorflow_gradients(keras_script, keras_fp32, real, z)
        keras_amp_gradients = tensorflow_gradients(keras_script, keras_amp, real, z)
        if [g.size for g in keras_fp32_gradients] != [g.size for g in torch_fp32]:
            raise RuntimeError(f"{model}: the two twins' weights do not pair up one to one")
        if weights is not None:  # finite weights too large (x1e37): their NaN errors printed as "-"
            check_finite_reference(checkpoint, names, torch_fp32, keras_fp32_gradients)
        errors["pytorch"] += [relative_error(a, e) for a, e in zip(torch_amp, torch_fp32)]
        errors["tensorflow"] += [relative_error(a, e) for a, e in zip(keras_amp_gradients, keras_fp32_gradients)]
        for network, part in split.items():
            totals[network, "pytorch"] += network_error(torch_amp[part], torch_fp32[part])
            totals[network, "tensorflow"] += network_error(keras_amp_gradients[part], keras_fp32_gradients[part])
            if previous is not None:
                totals[network, "noise"] += network_error(torch_fp32[part], previous[part])
        if previous is not None:
            noise_errors += [relative_error(a, e) for a, e in zip(torch_fp32, previous)]
        previous = torch_fp32
        for k, t, (network, name, _) in zip(keras_fp32_gradients, torch_fp32, names):
            gap = layout_free_gap(k, t)
            if gap > float32_gap:  # False for NaN, a float32 gradient of 0
                float32_gap, worst = gap, f"{network}/{name}"
        if float32_gap > FLOAT32_LIMIT:
            if weights is not None:
                # The pairing is the code's, the same at any weights, and checked at the
                # initialisation: at a checkpoint's, the cause is the weights, e.g. a D whose output
                # barely depends on its input, its gradients so small that TensorFlow flushes them
                # to 0 (subnormal) where PyTorch does not
                raise CheckpointError(f"--weights: at the weights of {checkpoint}, the two frameworks' float32 "
                                      f"gradients differ by {float32_gap:.1e} (in {worst}, PyTorch's name): "
                                      "gradients at float32's limits, no reference to measure AMP's against")
            raise RuntimeError(f"{model}: the twins' float32 gradients differ by {float32_gap:.1e}: "
                               "their weights do not pair up in the order this script assumes")
    def mean(total, count):
        return total / count if count else float("nan")

    pairs = batches - 1  # of consecutive batches, for the noise
    return {"model": model, "width": width, "source": source,
            "weights": [{"network": network, "name": name, "shape": shape,
                         "pytorch": errors["pytorch"][i] / batches, "tensorflow": errors["tensorflow"][i] / batches,
                         "noise": mean(noise_errors[i], pairs)}
                        for i, (network, name, shape) in enumerate(names)],
            "networks": {network: {column: mean(totals[network, column], pairs if column == "noise" else batches)
                                   for column in ("pytorch", "tensorflow", "noise")} for network in split},
            "float32_gap": float32_gap}


def check_finite_reference(checkpoint: Path, names: list, *float32_gradients: list[np.ndarray]):
    """The float32 gradients AMP's are measured against, finite in both frameworks."""
    for gradients in float32_gradients:
        for gradient, (network, name, _) in zip(gradients, names):
            if not np.all(np.isfinite(gradient)):
                raise CheckpointError(f"--weights: at the weights of {checkpoint}, the float32 gradient of "
                                      f"{network}/{name} (PyTorch's name) holds inf/NaN: no reference "
                                      "to measure AMP's against")


def table(result: dict) -> str:
    def error(value: float) -> str:
        return "-" if np.isnan(value) else f"{value:.4f}"  # "-": a float32 gradient of 0

    lines = ["| network | weight (PyTorch's name) | shape | PyTorch AMP | TensorFlow AMP | minibatch noise |",
             "|---|---|---|---|---|---|"]
    for row in result["weights"]:
        lines.append(f"| {row['network']} | {row['name']} | {'x'.join(map(str, row['shape']))} "
                     f"| {error(row['pytorch'])} | {error(row['tensorflow'])} | {error(row['noise'])} |")
    for network, row in result["networks"].items():
        lines.append(f"| {network} | all its weights | | {error(row['pytorch'])} | {error(row['tensorflow'])} "
                     f"| {error(row['noise'])} |")
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None) -> dict:
    parser = OneLineErrorParser(description=flags.first_paragraph(__doc__))
    parser.add_argument("--model", type=lambda name: models.get(name).key if name in models.NAMES else name,
                        choices=GAN_MODELS, help="default: vanilla_gan, or --weights' model (aliases as elsewhere)")
    parser.add_argument("--width", type=flags.int_in(1, MAX_WIDTH),
                        help=f"the networks' width (default: the model's, or --weights' run's; at most {MAX_WIDTH})")
    parser.add_argument("--weights", type=flags.path, metavar="RUN_DIR",
                        help="the networks of a finished MNIST run's last checkpoint, either framework "
                             "(default: PyTorch's initialisation)")
    # at least 2: DCGAN's batch norm needs two examples to normalise over
    parser.add_argument("--batch-size", type=flags.int_in(2, MNIST_TRAIN_IMAGES), default=64)
    parser.add_argument("--batches", type=flags.int_in(1, MNIST_TRAIN_IMAGES // 2), default=8,
                        help="batches the errors are averaged over")
    args = parser.parse_args(argv)
    with tf.device("/CPU:0"):  # beside PyTorch's CPU computation, also where a GPU is
        result = measure(args.model, args.width, args.batch_size, args.batches, weights=args.weights)
    print(f"{result['model']}, width {result['width']}: ||g_amp - g_fp32|| / ||g_fp32|| of one step's gradients, "
          f"bfloat16, mean of {args.batches} batches of {args.batch_size}, from the same weights in both "
          f"frameworks ({result['source']}); minibatch noise: ||g_fp32 - g_fp32 of the previous batch|| / "
          "||g_fp32 of the previous batch||, PyTorch")
    print(table(result))
    print(f"float32 gradients, PyTorch against TensorFlow (sorted values): largest relative difference "
          f"{result['float32_gap']:.1e}")
    return result


if __name__ == "__main__":
    main()
