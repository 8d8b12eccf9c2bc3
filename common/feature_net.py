"""A small MNIST classifier whose penultimate layer stands in for Inception in FID and
precision/recall (PyTorch). Inception weights cannot be downloaded here; this net is trained
by scripts/train_feature_net.py and its weights are committed in common/assets/, so every run
measures with the same features. Numbers computed with it are comparable only with numbers
computed with it, never with published Inception FIDs.

Input: 28x28x1 images, NHWC, either uint8 pixels (0..255) or floats in [0, 1]. Generators that
emit tanh-range images must be mapped to [0, 1] first ((x + 1) / 2); to_network_input refuses
floats below 0 rather than measuring the wrong thing.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.errors import CheckpointError

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "assets" / "mnist_feature_net.npz"
IMAGE_SHAPE = (28, 28, 1)
FEATURE_DIM = 128
NUM_CLASSES = 10
RETRAIN = "python scripts/train_feature_net.py"
_RANGE_SLACK = 1e-3  # floats from a sigmoid or a resize may stray this far outside [0, 1]


class MnistFeatureNet(nn.Module):
    """LeNet-style classifier: two 5x5 conv + max-pool blocks, a 128-unit ReLU layer (the
    features), and a linear layer to 10 class logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5)  # 28 -> 24, pooled to 12
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)  # 12 -> 8, pooled to 4
        self.fc1 = nn.Linear(64 * 4 * 4, FEATURE_DIM)
        self.fc2 = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, 28, 28) in [0, 1] -> (N, 128) post-ReLU activations of the feature layer."""
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return torch.relu(self.fc1(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))


def to_network_input(images: np.ndarray) -> torch.Tensor:
    """The one place images become network input: NHWC uint8 (0..255) or float ([0, 1]) ->
    float32 NCHW tensor in [0, 1]."""
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
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)))


def state_to_arrays(net: MnistFeatureNet) -> dict[str, np.ndarray]:
    """The weights as plain float32 arrays, the format of the committed .npz file."""
    return {name: tensor.detach().cpu().numpy().astype(np.float32) for name, tensor in net.state_dict().items()}


def load_feature_net(path: str | Path = DEFAULT_WEIGHTS) -> MnistFeatureNet:
    """The trained feature net in eval mode on the CPU; CheckpointError naming the fix if the
    weights file is missing, corrupt or from a different architecture."""
    path = Path(path)
    net = MnistFeatureNet()
    expected = {name: tuple(tensor.shape) for name, tensor in net.state_dict().items()}
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files if name in expected}
    except FileNotFoundError:
        raise CheckpointError(f"feature net weights {path} do not exist; create them with {RETRAIN}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"feature net weights {path} are unreadable ({reason}); "
                              f"recreate them with {RETRAIN}") from None
    problems = [f"{name} missing" for name in expected if name not in arrays]
    problems += [f"{name} has shape {arrays[name].shape}, expected {shape}"
                 for name, shape in expected.items() if name in arrays and arrays[name].shape != shape]
    problems += [f"{name} is not finite" for name, array in arrays.items()
                 if not np.issubdtype(array.dtype, np.floating) or not np.isfinite(array).all()]
    if problems:
        raise CheckpointError(f"feature net weights {path} do not fit the network ({'; '.join(problems[:3])}); "
                              f"recreate them with {RETRAIN}")
    net.load_state_dict({name: torch.from_numpy(np.asarray(array, dtype=np.float32)) for name, array in arrays.items()})
    return net.eval()


@functools.lru_cache(maxsize=1)
def _default_net() -> MnistFeatureNet:
    return load_feature_net(DEFAULT_WEIGHTS)


def features_and_logits(images: np.ndarray, batch_size: int = 500,
                        net: MnistFeatureNet | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(N, 128) features for FID and precision/recall and (N, 10) class logits for class
    coverage, both float64, of NHWC images (see to_network_input for the accepted ranges).
    Uses the committed weights unless net is given."""
    net = _default_net() if net is None else net
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    features, logits = [], []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            batch_features = net.features(to_network_input(images[start:start + batch_size]))
            features.append(batch_features.numpy().astype(np.float64))
            logits.append(net.fc2(batch_features).numpy().astype(np.float64))
    if not features:
        return np.empty((0, FEATURE_DIM)), np.empty((0, NUM_CLASSES))
    return np.concatenate(features), np.concatenate(logits)
