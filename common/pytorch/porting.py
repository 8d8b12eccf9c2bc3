"""A PyTorch network's weights to the neutral form of common/porting.py and back
(common/tensorflow/porting.py is the twin)."""
from __future__ import annotations

import numpy as np
import torch

from common.porting import LayerWeights, check_kinds, native_byte_order

KERAS_KIND = {"Linear": "Dense", "Conv2d": "Conv2D", "ConvTranspose2d": "Conv2DTranspose",
              "BatchNorm2d": "BatchNormalization"}


def _layers(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if type(m).__name__ in KERAS_KIND]


def _hwc_order(image_shape_hwc) -> np.ndarray | None:
    """Keras flat position j holds PyTorch flat position order[j]; None when they agree."""
    if image_shape_hwc is None or len(image_shape_hwc) != 3 or image_shape_hwc[-1] == 1:
        return None
    height, width, channels = image_shape_hwc
    return np.arange(channels * height * width).reshape(channels, height, width) \
        .transpose(1, 2, 0).reshape(-1)


def export_weights(module: torch.nn.Module, image_shape_hwc=None) -> list[LayerWeights]:
    """Every weight and batch-norm statistic of `module`, in the neutral (Keras) layout."""
    order = _hwc_order(image_shape_hwc)
    flat = None if order is None else order.size
    numpy = lambda tensor: tensor.detach().cpu().float().numpy()
    layers = []
    for layer in _layers(module):
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


def _neutral_shapes(layer: torch.nn.Module) -> list[tuple]:
    """The shapes of `layer`'s arrays in the neutral (Keras) layout, as export_weights gives them."""
    kind = type(layer).__name__
    if kind == "Linear":
        return [tuple(layer.weight.shape[::-1]), tuple(layer.bias.shape)]
    if kind == "BatchNorm2d":
        return [tuple(layer.weight.shape)] * 4
    out_or_in, in_or_out, height, width = layer.weight.shape  # Conv2d, ConvTranspose2d
    return [(height, width, in_or_out, out_or_in)] + ([] if layer.bias is None else [tuple(layer.bias.shape)])


def import_weights(module: torch.nn.Module, layers: list[LayerWeights], image_shape_hwc=None) -> None:
    """Load neutral-layout weights into `module` (exactly: float32 values are copied)."""
    targets = _layers(module)
    check_kinds([kind for kind, _ in layers], [KERAS_KIND[type(t).__name__] for t in targets])
    order = _hwc_order(image_shape_hwc)
    inverse = None if order is None else np.argsort(order)
    flat = None if order is None else order.size
    with torch.no_grad():
        for index, (layer, (kind, values)) in enumerate(zip(targets, layers)):
            arrays = {"Dense": 2, "BatchNormalization": 4}.get(kind, 1 if layer.bias is None else 2)
            if len(values) != arrays:  # zip() below would drop the extra ones, or index past the end
                raise ValueError(f"{type(layer).__name__}: PyTorch holds {arrays} arrays, "
                                 f"the weights give {len(values)}")
            # checked in the neutral layout before any reordering indexes them, in the words
            # of the Keras twin's refusal (common/tensorflow/porting.py)
            expected = _neutral_shapes(layer)
            if [value.shape for value in values] != expected:
                raise ValueError(f"layer {index} ({kind}): shapes {[value.shape for value in values]}, "
                                 f"the model has {expected}")
            values = [native_byte_order(value) for value in values]  # torch.from_numpy refuses the other
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
            for target, value in pairs:  # the shapes fit: checked above
                target.copy_(torch.from_numpy(np.ascontiguousarray(value)))
