"""Layer initialisation shared by the PyTorch models (common/tensorflow/layers.py is the twin)."""
from __future__ import annotations

from torch import nn


def init_like_keras_dense(module: nn.Module):
    """Glorot-uniform weights and zero biases for every Linear layer: Keras' Dense defaults,
    which the TensorFlow twins set explicitly, so both start from the same distribution."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
