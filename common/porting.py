"""Copy weights between a PyTorch network and its Keras twin, in either direction, and keep
them in a file either framework can read.

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

The neutral form in between is Keras': per network, a list of (layer kind, arrays as Keras'
`get_weights()` returns them). A weights file (`save_weights`/`load_weights`, a plain .npz)
holds that form for every network of a model, which is how `--init-from` starts a run of one
framework from the initial weights of a run of the other. TensorFlow processes import this
file too, so torch is imported only inside the functions that handle PyTorch modules.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.errors import CheckpointError
from common.runs import atomic_write

KERAS_KIND = {"Linear": "Dense", "Conv2d": "Conv2D", "ConvTranspose2d": "Conv2DTranspose",
              "BatchNorm2d": "BatchNormalization"}
WEIGHTS_FORMAT = 1

LayerWeights = tuple[str, list[np.ndarray]]  # (Keras layer kind, arrays in Keras layout)


# --- Keras side: the neutral form is Keras' own ---------------------------------------------
def keras_layers(model) -> list:
    return [layer for layer in model.layers if layer.weights]


def keras_export(model) -> list[LayerWeights]:
    return [(type(layer).__name__, [np.asarray(v) for v in layer.get_weights()])
            for layer in keras_layers(model)]


def keras_import(model, layers: list[LayerWeights]) -> None:
    targets = keras_layers(model)
    _check_kinds([kind for kind, _ in layers], [type(t).__name__ for t in targets])
    for index, (target, (kind, values)) in enumerate(zip(targets, layers)):
        expected = [tuple(w.shape) for w in target.weights]
        if expected != [v.shape for v in values]:
            raise ValueError(f"layer {index} ({kind}): shapes {[v.shape for v in values]}, "
                             f"the model has {expected}")
        target.set_weights(values)


# --- PyTorch side ----------------------------------------------------------------------------
def _torch_layers(module) -> list:
    return [m for m in module.modules() if type(m).__name__ in KERAS_KIND]


def _hwc_order(image_shape_hwc) -> np.ndarray | None:
    """Keras flat position j holds PyTorch flat position order[j]; None when they agree."""
    if image_shape_hwc is None or len(image_shape_hwc) != 3 or image_shape_hwc[-1] == 1:
        return None
    height, width, channels = image_shape_hwc
    return np.arange(channels * height * width).reshape(channels, height, width) \
        .transpose(1, 2, 0).reshape(-1)


def torch_export(module, image_shape_hwc=None) -> list[LayerWeights]:
    """Every weight and batch-norm statistic of `module`, in the neutral (Keras) layout."""
    order = _hwc_order(image_shape_hwc)
    flat = None if order is None else order.size
    numpy = lambda tensor: tensor.detach().cpu().float().numpy()
    layers = []
    for layer in _torch_layers(module):
        kind = type(layer).__name__
        if kind == "Linear":
            kernel, bias = numpy(layer.weight).T, numpy(layer.bias)
            if flat and kernel.shape[0] == flat:       # flattens an image
                kernel = kernel[order]
            if flat and kernel.shape[1] == flat:       # produces an image
                kernel, bias = kernel[:, order], bias[order]
            values = [kernel, bias]
        elif kind == "BatchNorm2d":
            values = [numpy(layer.weight), numpy(layer.bias),
                      numpy(layer.running_mean), numpy(layer.running_var)]
        else:  # Conv2d and ConvTranspose2d share the permutation
            values = [numpy(layer.weight).transpose(2, 3, 1, 0)]
            if layer.bias is not None:
                values.append(numpy(layer.bias))
        layers.append((KERAS_KIND[kind], [np.ascontiguousarray(v) for v in values]))
    return layers


def torch_import(module, layers: list[LayerWeights], image_shape_hwc=None) -> None:
    """Load neutral-layout weights into `module` (exactly: float32 values are copied)."""
    import torch

    targets = _torch_layers(module)
    _check_kinds([kind for kind, _ in layers], [KERAS_KIND[type(t).__name__] for t in targets])
    order = _hwc_order(image_shape_hwc)
    inverse = None if order is None else np.argsort(order)
    flat = None if order is None else order.size
    with torch.no_grad():
        for layer, (kind, values) in zip(targets, layers):
            if kind == "Dense":
                kernel, bias = values
                if flat and kernel.shape[0] == flat:
                    kernel = kernel[inverse]
                if flat and kernel.shape[1] == flat:
                    kernel, bias = kernel[:, inverse], bias[inverse]
                pairs = [(layer.weight, kernel.T), (layer.bias, bias)]
            elif kind == "BatchNormalization":
                pairs = list(zip((layer.weight, layer.bias, layer.running_mean, layer.running_var),
                                 values))
            else:
                pairs = [(layer.weight, values[0].transpose(3, 2, 0, 1))]
                if layer.bias is not None:
                    pairs.append((layer.bias, values[1]))
            for target, value in pairs:
                if tuple(target.shape) != value.shape:
                    raise ValueError(f"{type(layer).__name__}: PyTorch shape "
                                     f"{tuple(target.shape)}, the weights give {value.shape}")
                target.copy_(torch.from_numpy(np.ascontiguousarray(value)))


def _check_kinds(given: list[str], expected: list[str]) -> None:
    if len(given) != len(expected):
        raise ValueError(f"{len(given)} layers with weights but the model has {len(expected)}: "
                         "not twins")
    for index, (have, want) in enumerate(zip(given, expected)):
        if have != want:
            raise ValueError(f"layer {index}: the model's {want} cannot take {have} weights")


def torch_to_keras(module, model, image_shape_hwc=None) -> None:
    """Copy every weight and batch-norm statistic of `module` into its Keras twin `model`."""
    keras_import(model, torch_export(module, image_shape_hwc))


def keras_to_torch(model, module, image_shape_hwc=None) -> None:
    """Copy every weight and batch-norm statistic of the Keras `model` into `module`."""
    torch_import(module, keras_export(model), image_shape_hwc)


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
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {key: stored[key] for key in stored.files}
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
                layers.append((kind, [arrays[k] for k in slots]))
            networks[network] = layers
    except FileNotFoundError:
        raise CheckpointError(f"no weights file at {path}") from None
    except Exception as error:  # zip, key and JSON errors all mean "not a weights file"
        raise CheckpointError(f"{path} is not a readable weights file of this repository "
                              f"({type(error).__name__})") from None
    return networks, meta


# --- --init-from: a run starts from another run's initial weights -----------------------------
INITIAL_WEIGHTS = "initial_weights.npz"  # every fresh run writes its step-0 weights here


def save_initial_weights(run_path: Path, networks: dict[str, list[LayerWeights]], meta: dict):
    save_weights(Path(run_path) / INITIAL_WEIGHTS, networks, meta)


def start_from(source: str, modules: dict, import_into, sample_shape: tuple) -> Path:
    """Load the weights of `source` (a run folder, or a weights file) into `modules` with
    `import_into(module, layers)`; every mismatch is one CheckpointError line."""
    path = Path(source)
    if path.is_dir():
        path = path / INITIAL_WEIGHTS
    networks, meta = load_weights(path)
    if set(networks) != set(modules):
        raise CheckpointError(f"--init-from {path} holds {', '.join(sorted(networks))}; "
                              f"this model has {', '.join(sorted(modules))}")
    if tuple(meta.get("sample_shape", ())) != tuple(sample_shape):
        raise CheckpointError(f"--init-from {path} was made for data shaped "
                              f"{tuple(meta.get('sample_shape', ()))}, this run's data is "
                              f"{tuple(sample_shape)}")
    for name, module in modules.items():
        try:
            import_into(module, networks[name])
        except ValueError as error:
            raise CheckpointError(f"--init-from {path} does not fit this model's {name}: "
                                  f"{error}") from None
    return path
