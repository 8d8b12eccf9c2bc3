"""Layer initialisation shared by the Keras models (common/pytorch/layers.py is the twin)."""

# Glorot-uniform weights, zero biases: Keras' Dense defaults, spelled out because the PyTorch
# twins set the same (init_like_keras_dense), so both start from the same distribution.
DENSE_INIT = dict(kernel_initializer="glorot_uniform", bias_initializer="zeros")
