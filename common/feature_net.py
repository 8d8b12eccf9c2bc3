"""A small MNIST classifier whose penultimate layer stands in for Inception in FID and
precision/recall, run in numpy. Inception weights cannot be downloaded here; this net is
trained (in PyTorch) by scripts/train_feature_net.py and its weights are committed in
common/assets/, so every run measures with the same features. Numbers computed with it are
comparable only with numbers computed with it, never with published Inception FIDs.

Why numpy: scoring a run, PyTorch or TensorFlow, should import neither framework, so the
forward pass is written here in numpy (im2col convolutions, float32) from the same weights
file. It matches the PyTorch definition in scripts/train_feature_net.py to float32 rounding
(tests/test_feature_net.py checks both on real MNIST).

The network: conv 5x5 (1 -> 32) + ReLU + 2x2 max-pool, conv 5x5 (32 -> 64) + ReLU + 2x2
max-pool, flatten in PyTorch's (C, H, W) order, fc 1024 -> 128 + ReLU (the features), fc
128 -> 10 (the class logits). Convolutions are cross-correlations, as PyTorch's Conv2d.

Input: 28x28x1 images, NHWC, either uint8 pixels (0..255) or floats in [0, 1]. Generators that
emit tanh-range images must be mapped to [0, 1] first ((x + 1) / 2); to_network_input refuses
floats below 0 rather than measuring the wrong thing.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import numpy as np

from common.data import read_npz_arrays
from common.errors import CheckpointError
from common.runs import check_regular_file

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "assets" / "mnist_feature_net.npz"
IMAGE_SHAPE = (28, 28, 1)
FEATURE_DIM = 128
NUM_CLASSES = 10
RETRAIN = "python scripts/train_feature_net.py"
_RANGE_SLACK = 1e-3  # floats from a sigmoid or a resize may stray this far outside [0, 1]
KERNEL = 5  # both convolutions are 5x5, unpadded, stride 1
# Images per pass: the im2col working set (about 20 MB) then stays in cache, which made the
# forward pass twice as fast as 500 at a time; it also bounds memory however many are scored.
IMAGES_PER_PASS = 64

# The arrays of the weights file: PyTorch's state_dict names and shapes, in its order (the
# training script saves the state_dict as it is; Conv2d weights are (out, in, kh, kw)).
WEIGHT_SHAPES = {
    "conv1.weight": (32, 1, KERNEL, KERNEL), "conv1.bias": (32,),  # 28 -> 24, pooled to 12
    "conv2.weight": (64, 32, KERNEL, KERNEL), "conv2.bias": (64,),  # 12 -> 8, pooled to 4
    "fc1.weight": (FEATURE_DIM, 64 * 4 * 4), "fc1.bias": (FEATURE_DIM,),
    "fc2.weight": (NUM_CLASSES, FEATURE_DIM), "fc2.bias": (NUM_CLASSES,),
}


def _conv_max_pool_relu(images: np.ndarray, kernel_matrix: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Unpadded KERNELxKERNEL convolution, ReLU and 2x2 max-pool of NHWC float32 images, as im2col
    + one matmul. kernel_matrix is (KERNEL * KERNEL * in_channels, out_channels) in (kh, kw, in)
    order, the order in which the windows below are flattened."""
    count, height, width, channels = images.shape
    out_height, out_width = height - KERNEL + 1, width - KERNEL + 1
    # (N, out_h, out_w, C, kh, kw) view -> (kh, kw, C) rows: C innermost keeps the copy contiguous
    windows = np.lib.stride_tricks.sliding_window_view(images, (KERNEL, KERNEL), axis=(1, 2))
    columns = windows.transpose(0, 1, 2, 4, 5, 3).reshape(count * out_height * out_width, -1)
    maps = (columns @ kernel_matrix).reshape(count, out_height, out_width, -1)
    pooled = np.maximum(np.maximum(maps[:, 0::2, 0::2], maps[:, 0::2, 1::2]),
                        np.maximum(maps[:, 1::2, 0::2], maps[:, 1::2, 1::2]))
    # Bias and ReLU after the pool, on a quarter of the values: adding a per-channel constant
    # and ReLU are monotone, so max-pool commutes with both, exactly even in float32.
    return np.maximum(pooled + bias, 0.0)


class FeatureNet:
    """The forward pass of the PyTorch MnistFeatureNet (scripts/train_feature_net.py) in numpy,
    float32, from its state_dict arrays (names and shapes as in WEIGHT_SHAPES)."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        weights = {name: np.asarray(arrays[name], dtype=np.float32) for name in WEIGHT_SHAPES}
        # (out, in, kh, kw) kernels -> (kh * kw * in, out) matrices, matching the im2col rows.
        # No flip: PyTorch's Conv2d is a cross-correlation, and so is the im2col product.
        self.conv1_matrix = np.ascontiguousarray(weights["conv1.weight"].transpose(2, 3, 1, 0).reshape(-1, 32))
        self.conv2_matrix = np.ascontiguousarray(weights["conv2.weight"].transpose(2, 3, 1, 0).reshape(-1, 64))
        self.conv1_bias, self.conv2_bias = weights["conv1.bias"], weights["conv2.bias"]
        self.fc1_matrix, self.fc1_bias = np.ascontiguousarray(weights["fc1.weight"].T), weights["fc1.bias"]
        self.fc2_matrix, self.fc2_bias = np.ascontiguousarray(weights["fc2.weight"].T), weights["fc2.bias"]

    def features(self, pixels: np.ndarray) -> np.ndarray:
        """(N, 28, 28, 1) float32 in [0, 1] (to_network_input) -> (N, 128) float32 post-ReLU
        activations of the feature layer. NHWC: channels innermost for the im2col rows."""
        images = _conv_max_pool_relu(pixels, self.conv1_matrix, self.conv1_bias)  # (N, 12, 12, 32)
        images = _conv_max_pool_relu(images, self.conv2_matrix, self.conv2_bias)  # (N, 4, 4, 64)
        flat = images.transpose(0, 3, 1, 2).reshape(len(images), -1)  # (C, H, W), as fc1 was trained on
        return np.maximum(flat @ self.fc1_matrix + self.fc1_bias, 0.0)

    def logits(self, features: np.ndarray) -> np.ndarray:
        """(N, 128) features -> (N, 10) float32 class logits."""
        return features @ self.fc2_matrix + self.fc2_bias


def to_network_input(images: np.ndarray) -> np.ndarray:
    """The one place images become network input: NHWC uint8 (0..255) or float ([0, 1]) ->
    float32 NHWC in [0, 1]."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(f"the feature net takes NHWC images of shape (N, 28, 28, 1), got {images.shape}; "
                         "resize to 28x28 grayscale first")
    if images.dtype == np.uint8:
        pixels = images.astype(np.float32) / 255.0
    elif np.issubdtype(images.dtype, np.floating):
        low, high = float(images.min(initial=0.0)), float(images.max(initial=0.0))
        if low < -_RANGE_SLACK or high > 1.0 + _RANGE_SLACK:
            raise ValueError(f"float images must lie in [0, 1], got values in [{low:.3g}, {high:.3g}]; "
                             "map tanh outputs with (x + 1) / 2")
        pixels = np.clip(images, 0.0, 1.0).astype(np.float32)
    else:
        raise ValueError(f"images must be uint8 or float, got {images.dtype}")
    return pixels


def load_feature_net(path: str | Path = DEFAULT_WEIGHTS) -> FeatureNet:
    """The trained feature net; CheckpointError naming the fix if the weights file is missing,
    not a regular file, corrupt or from a different architecture."""
    path = Path(path)
    # a FIFO in place of the committed file blocked the evaluation forever in open(); no flag
    # names another file, so the fix is the file itself
    check_regular_file(path, "feature net weights file", fix=f"remove it and recreate it with {RETRAIN}")
    try:
        arrays = read_npz_arrays(path, keep=lambda name: name in WEIGHT_SHAPES)
    except FileNotFoundError:
        raise CheckpointError(f"feature net weights {path} do not exist; create them with {RETRAIN}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"feature net weights {path} are unreadable ({reason}); "
                              f"recreate them with {RETRAIN}") from None
    problems = [f"{name} missing" for name in WEIGHT_SHAPES if name not in arrays]
    problems += [f"{name} has shape {arrays[name].shape}, expected {shape}"
                 for name, shape in WEIGHT_SHAPES.items() if name in arrays and arrays[name].shape != shape]
    problems += [f"{name} is not finite" for name, array in arrays.items()
                 if not np.issubdtype(array.dtype, np.floating) or not np.isfinite(array).all()]
    if problems:
        raise CheckpointError(f"feature net weights {path} do not fit the network ({'; '.join(problems[:3])}); "
                              f"recreate them with {RETRAIN}")
    return FeatureNet(arrays)


@functools.lru_cache(maxsize=1)
def _default_net() -> FeatureNet:
    return load_feature_net(DEFAULT_WEIGHTS)


def features_and_logits(images: np.ndarray, batch_size: int = IMAGES_PER_PASS,
                        net: FeatureNet | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(N, 128) features for FID and precision/recall and (N, 10) class logits for class
    coverage, both float64, of NHWC images (see to_network_input for the accepted ranges).
    Uses the committed weights unless net is given; batch_size images go through at a time."""
    net = _default_net() if net is None else net
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    features, logits = [], []
    for start in range(0, len(images), batch_size):
        batch_features = net.features(to_network_input(images[start:start + batch_size]))
        features.append(batch_features.astype(np.float64))
        logits.append(net.logits(batch_features).astype(np.float64))
    if not features:
        return np.empty((0, FEATURE_DIM)), np.empty((0, NUM_CLASSES))
    return np.concatenate(features), np.concatenate(logits)
