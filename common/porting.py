"""Weights that cross between the frameworks: the neutral form both read, the weights file
that holds it, and --init-from. The framework halves (common/pytorch/porting.py,
common/tensorflow/porting.py) turn a network's weights into the neutral form and back.

The twins are built layer for layer alike, so their parametric layers pair up in order:
    Linear (out, in)                 <-> Dense kernel (in, out)               transpose
    Conv2d (O, I, kH, kW)            <-> Conv2D kernel (kH, kW, I, O)         permute(2, 3, 1, 0)
    ConvTranspose2d (I, O, kH, kW)   <-> Conv2DTranspose kernel (kH, kW, O, I) permute(2, 3, 1, 0)
    BatchNorm2d weight, bias, running_mean, running_var
                                     <-> gamma, beta, moving_mean, moving_variance
Images are NCHW in PyTorch and NHWC in Keras, so where an MLP flattens an image (the first
Linear of D or of the VAE encoder) or produces one (the last Linear of G or of the decoder),
the flattened axis is reordered from (C, H, W) to (H, W, C). For one channel the two orders
coincide.

The neutral form is Keras': per network, a list of (layer kind, arrays as Keras'
`get_weights()` returns them). A weights file (`save_weights`/`load_weights`, a plain .npz)
holds that form for every network of a model, which is how `--init-from` starts a run of one
framework from the initial weights of a run of the other.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.data import read_npz_arrays
from common.errors import CheckpointError, UserError, described
from common.runs import atomic_write, check_regular_file

WEIGHTS_FORMAT = 1
FLOAT32_MAX = float(np.finfo(np.float32).max)

LayerWeights = tuple[str, list[np.ndarray]]  # (Keras layer kind, arrays in Keras layout)


def check_kinds(given: list[str], expected: list[str]) -> None:
    """The layer kinds of saved weights against a network's: the same list, or a ValueError."""
    if len(given) != len(expected):
        raise ValueError(f"{len(given)} layers with weights but the model has {len(expected)}: "
                         "not twins")
    for index, (have, want) in enumerate(zip(given, expected)):
        if have != want:
            raise ValueError(f"layer {index}: the model's {want} cannot take {have} weights")


def native_byte_order(value: np.ndarray) -> np.ndarray:
    """`value` in this machine's byte order (a view of it when it already is)."""
    return np.asarray(value, dtype=value.dtype.newbyteorder("="))


# --- weights files ---------------------------------------------------------------------------
def save_weights(path: Path, networks: dict[str, list[LayerWeights]], meta: dict) -> None:
    """One .npz for every network of a model, in the neutral layout, plus a JSON `meta`."""
    arrays = {"format": np.array(WEIGHTS_FORMAT), "meta": np.array(json.dumps(meta))}
    for network, layers in networks.items():
        arrays[f"kinds/{network}"] = np.array([kind for kind, _ in layers])
        for index, (_, values) in enumerate(layers):
            for slot, value in enumerate(values):
                arrays[f"layers/{network}/{index:03d}/{slot}"] = value
    atomic_write(path, lambda file: np.savez(file, **arrays))


def load_weights(path: Path) -> tuple[dict[str, list[LayerWeights]], dict]:
    """Read a file `save_weights` wrote; one CheckpointError line for anything else."""
    path = Path(path)
    check_regular_file(path, "weights file")
    try:
        arrays = read_npz_arrays(path)
        if int(arrays["format"]) != WEIGHTS_FORMAT:
            raise ValueError(f"format {int(arrays['format'])}")
        meta = json.loads(str(arrays["meta"]))
        networks = {}
        for key in sorted(k for k in arrays if k.startswith("kinds/")):
            network = key.split("/", 1)[1]
            layers = []
            for index, kind in enumerate(arrays[key].tolist()):
                prefix = f"layers/{network}/{index:03d}/"
                slots = sorted((k for k in arrays if k.startswith(prefix)),
                               key=lambda k: int(k[len(prefix):]))
                # in native byte order: a big-endian ('>f4') file loads in both twins alike
                # (torch.from_numpy refuses the other order; Keras converts it)
                layers.append((kind, [native_byte_order(arrays[k]) for k in slots]))
            networks[network] = layers
    except FileNotFoundError:
        raise CheckpointError(f"no weights file at {path}") from None
    except Exception as error:  # zip, key and JSON errors all mean "not a weights file"
        raise CheckpointError(f"{path} is not a readable weights file of this repository "
                              f"({described(error)[:200]})") from None
    for network, layers in networks.items():
        for index, (_, values) in enumerate(layers):
            if any(value.dtype.kind not in "fiu" for value in values):  # strings would reach torch.from_numpy
                raise CheckpointError(f"{path} is not a weights file of this repository: layer {index} "
                                      f"of {network} holds {', '.join(str(v.dtype) for v in values)}, not numbers")
            # inf/NaN, or past float32's range: the run would train on NaN (its checkpoints
            # then refused by --resume), as checkpoints holding them are refused
            if any(value.size and not (np.abs(value.astype(np.float64)) <= FLOAT32_MAX).all() for value in values):
                raise CheckpointError(f"{path} holds inf/NaN or values past float32's range in layer {index} "
                                      f"of {network}: weights a run cannot start from")
            # gamma, beta, mean, variance: samples divide by the variance's square root
            if kind == "BatchNormalization" and len(values) == 4 and (values[3] < 0).any():
                raise CheckpointError(f"{path} holds a negative running variance in layer {index} of {network} "
                                      "(a batch norm): weights a run cannot start from")
    return networks, meta


# --- --init-from: a run starts from another run's initial weights -----------------------------
INITIAL_WEIGHTS = "initial_weights.npz"  # every fresh run writes its step-0 weights here


def save_initial_weights(run_path: Path, networks: dict[str, list[LayerWeights]], meta: dict):
    save_weights(Path(run_path) / INITIAL_WEIGHTS, networks, meta)


def check_resumed_data(run_path: Path, sample_shape: tuple) -> None:
    """Under --resume, the data's shape against the one the run started on (its initial
    weights record it): images that changed channels or size failed in the checkpoint's
    restore, as a checkpoint that "does not fit this model", worded by each framework."""
    path = Path(run_path) / INITIAL_WEIGHTS
    if not path.is_file():  # a run from before they were saved (or a FIFO, which would block the read)
        return
    try:  # the meta alone; a file that cannot tell is left to the checkpoint's restore, as before
        meta = json.loads(str(read_npz_arrays(path, keep=lambda key: key == "meta")["meta"]))
    except Exception:  # noqa: BLE001 - damaged or not this format: zip, key and JSON errors alike
        return
    started_on = meta.get("sample_shape") if isinstance(meta, dict) else None
    if isinstance(started_on, list) and tuple(started_on) != tuple(sample_shape):
        raise UserError(f"--resume: the data is shaped {tuple(sample_shape)}, and the run in {run_path} started on "
                        f"{tuple(started_on)}: its images changed (channels or size); resume on the run's data, "
                        "or train a new run (another --out)")


def start_from(source: str, model: str, modules: dict, import_into, sample_shape: tuple) -> Path:
    """Load the weights of `source` (a run folder, or a weights file, of `model` in either
    framework) into `modules` with `import_into(module, layers)`; every mismatch is one
    CheckpointError line."""
    path = Path(source)
    if path.is_dir():
        path = path / INITIAL_WEIGHTS
    try:
        networks, meta = load_weights(path)
    except CheckpointError as error:
        if "is not a readable weights file" not in str(error):
            raise
        if path.name == INITIAL_WEIGHTS:  # a run's own, named so: damaged, not a checkpoint given instead
            raise CheckpointError(f"{error}; it is damaged (cut short?): copy it again, or train that run "
                                  "again") from None
        # a checkpoint (the step's training state, in one framework's format) is the likeliest
        raise CheckpointError(f"{error}; --init-from takes a run folder or its {INITIAL_WEIGHTS} "
                              "(the step-0 weights, in either framework), not a checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"--init-from {path} has no valid meta (a JSON {type(meta).__name__})")
    # The model first: another model's weights fail every later check too, and those would
    # name the data or a layer, not the cause. Some fit (the vanilla GAN and LSGAN's networks
    # have the same shapes) and would train as the wrong model's start.
    if meta.get("model") != model:
        raise CheckpointError(f"--init-from {path} holds weights of model {meta.get('model')!r}, "
                              f"this run is {model!r}: start from a run of the same model "
                              "(either framework)")
    if set(networks) != set(modules):
        raise CheckpointError(f"--init-from {path} holds {', '.join(sorted(networks))}; "
                              f"this model has {', '.join(sorted(modules))}")
    saved_shape = meta.get("sample_shape")
    if not isinstance(saved_shape, list) or not all(type(n) is int for n in saved_shape):
        raise CheckpointError(f"--init-from {path} records no valid sample_shape (found {saved_shape!r})")
    if tuple(saved_shape) != tuple(sample_shape):
        raise CheckpointError(f"--init-from {path} was made for data shaped "
                              f"{tuple(saved_shape)}, this run's data is {tuple(sample_shape)}")
    for name, module in modules.items():
        try:
            import_into(module, networks[name])
        except ValueError as error:
            raise CheckpointError(f"--init-from {path} does not fit this model's {name}: "
                                  f"{error}") from None
    return path
