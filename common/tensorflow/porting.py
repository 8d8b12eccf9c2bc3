"""A Keras network's weights to the neutral form of common/porting.py and back; the neutral
form is Keras' own (common/pytorch/porting.py is the twin)."""
from __future__ import annotations

import keras
import numpy as np

from common.porting import LayerWeights, check_kinds


def _layers(model: keras.Model) -> list:
    return [layer for layer in model.layers if layer.weights]


def export_weights(model: keras.Model) -> list[LayerWeights]:
    """Every weight and batch-norm statistic of `model`, in the neutral (Keras) layout."""
    return [(type(layer).__name__, [np.asarray(v) for v in layer.get_weights()])
            for layer in _layers(model)]


def import_weights(model: keras.Model, layers: list[LayerWeights]) -> None:
    """Load neutral-layout weights into `model` (exactly: float32 values are copied)."""
    targets = _layers(model)
    check_kinds([kind for kind, _ in layers], [type(t).__name__ for t in targets])
    for index, (target, (kind, values)) in enumerate(zip(targets, layers)):
        expected = [tuple(w.shape) for w in target.weights]
        if expected != [v.shape for v in values]:
            raise ValueError(f"layer {index} ({kind}): shapes {[v.shape for v in values]}, "
                             f"the model has {expected}")
        target.set_weights(values)
