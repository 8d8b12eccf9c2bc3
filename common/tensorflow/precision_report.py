"""--precision-report in TensorFlow: the dtype every layer's output has under the global
policy, read from a model that returns all of them, run on zeros in inference mode, so the
training is untouched. common/precision_report.py prints the rows."""
from __future__ import annotations

import keras
import numpy as np

from common.precision_report import LayerRow


def precision_report(trainer) -> list[LayerRow]:
    rows = []
    dtype_name = keras.backend.standardize_dtype
    for name, model in trainer.modules.items():
        layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        probe = keras.Model(model.inputs, [layer.output for layer in layers])
        inputs = [np.zeros((2, *x.shape[1:]), np.float32) for x in model.inputs]
        outputs = probe(inputs, training=False)  # a list, as the probe's inputs are (else Keras warns)
        for layer, output in zip(layers, outputs if isinstance(outputs, (list, tuple)) else [outputs]):
            weights = dtype_name(layer.weights[0].dtype) if layer.weights else "-"
            rows.append((f"{name}.{layer.name}", type(layer).__name__, weights, dtype_name(output.dtype)))
    return rows
