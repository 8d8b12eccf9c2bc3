"""Copy weights between a PyTorch network and its Keras twin, in either direction.

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
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

PAIRS = ((nn.Linear, "Dense"), (nn.Conv2d, "Conv2D"), (nn.ConvTranspose2d, "Conv2DTranspose"),
         (nn.BatchNorm2d, "BatchNormalization"))
TORCH_KINDS = tuple(kind for kind, _ in PAIRS)


def paired_layers(module: nn.Module, model) -> list[tuple[nn.Module, object]]:
    """(torch layer, keras layer) pairs in build order; raises ValueError if they differ."""
    torch_layers = [m for m in module.modules() if isinstance(m, TORCH_KINDS)]
    keras_layers = [layer for layer in model.layers if layer.weights]
    if len(torch_layers) != len(keras_layers):
        raise ValueError(f"{len(torch_layers)} PyTorch layers with weights but "
                         f"{len(keras_layers)} Keras ones: not twins")
    for index, (torch_layer, keras_layer) in enumerate(zip(torch_layers, keras_layers)):
        expected = dict(PAIRS)[type(torch_layer)]
        if type(keras_layer).__name__ != expected:
            raise ValueError(f"layer {index}: {type(torch_layer).__name__} pairs with "
                             f"{expected}, found {type(keras_layer).__name__}")
    return list(zip(torch_layers, keras_layers))


def _hwc_order(image_shape_hwc) -> np.ndarray | None:
    """Keras flat position j holds PyTorch flat position order[j]; None when they agree."""
    if image_shape_hwc is None or image_shape_hwc[-1] == 1:
        return None
    height, width, channels = image_shape_hwc
    return np.arange(channels * height * width).reshape(channels, height, width) \
        .transpose(1, 2, 0).reshape(-1)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().float().numpy()


def torch_to_keras(module: nn.Module, model, image_shape_hwc=None) -> None:
    """Copy every weight and batch-norm statistic of `module` into its Keras twin `model`."""
    order = _hwc_order(image_shape_hwc)
    flat = None if order is None else order.size
    for torch_layer, keras_layer in paired_layers(module, model):
        if isinstance(torch_layer, nn.Linear):
            kernel, bias = _numpy(torch_layer.weight).T, _numpy(torch_layer.bias)
            if flat and kernel.shape[0] == flat:       # flattens an image
                kernel = kernel[order]
            if flat and kernel.shape[1] == flat:       # produces an image
                kernel, bias = kernel[:, order], bias[order]
            values = [kernel, bias]
        elif isinstance(torch_layer, nn.BatchNorm2d):
            values = [_numpy(torch_layer.weight), _numpy(torch_layer.bias),
                      _numpy(torch_layer.running_mean), _numpy(torch_layer.running_var)]
        else:  # Conv2d and ConvTranspose2d share the permutation
            values = [_numpy(torch_layer.weight).transpose(2, 3, 1, 0)]
            if torch_layer.bias is not None:
                values.append(_numpy(torch_layer.bias))
        keras_layer.set_weights(values)


def keras_to_torch(model, module: nn.Module, image_shape_hwc=None) -> None:
    """Copy every weight and batch-norm statistic of the Keras `model` into `module`."""
    order = _hwc_order(image_shape_hwc)
    inverse = None if order is None else np.argsort(order)
    flat = None if order is None else order.size
    with torch.no_grad():
        for torch_layer, keras_layer in paired_layers(module, model):
            values = [np.asarray(v) for v in keras_layer.get_weights()]
            if isinstance(torch_layer, nn.Linear):
                kernel, bias = values
                if flat and kernel.shape[0] == flat:
                    kernel = kernel[inverse]
                if flat and kernel.shape[1] == flat:
                    kernel, bias = kernel[:, inverse], bias[inverse]
                targets = [(torch_layer.weight, kernel.T), (torch_layer.bias, bias)]
            elif isinstance(torch_layer, nn.BatchNorm2d):
                targets = list(zip((torch_layer.weight, torch_layer.bias,
                                    torch_layer.running_mean, torch_layer.running_var), values))
            else:
                targets = [(torch_layer.weight, values[0].transpose(3, 2, 0, 1))]
                if torch_layer.bias is not None:
                    targets.append((torch_layer.bias, values[1]))
            for target, value in targets:
                if tuple(target.shape) != value.shape:
                    raise ValueError(f"{type(torch_layer).__name__}: PyTorch shape "
                                     f"{tuple(target.shape)}, Keras gives {value.shape}")
                target.copy_(torch.from_numpy(np.ascontiguousarray(value)))
