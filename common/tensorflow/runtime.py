"""What a TensorFlow run runs on: seeds, device and precision (the global dtype policy), set
up once (common/pytorch/runtime.py is the twin)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import keras
import tensorflow as tf

from common import quiet
from common.config import RunConfig, describe_precision, resolve_precision, warn_if_bf16_emulated
from common.errors import UsageError
from common.tensorflow import amp

_GPUS = tf.config.list_physical_devices("GPU")


def describe_tensorflow() -> str:
    """"tensorflow 2.21.0 (keras 3.15.1), sees 1 CPU + 1 GPU, oneDNN on, C++ log level 1 (...)":
    what a run's first line says in place of TensorFlow's start-up log (common/quiet.py)."""
    found = Counter(device.device_type for device in tf.config.list_physical_devices())
    devices = " + ".join(f"{count} {kind}" for kind, count in found.items())
    try:
        from tensorflow.python.util import _pywrap_util_port  # what port.cc's notice used to say
        onednn = "on" if _pywrap_util_port.IsMklEnabled() else "off"
    except (ImportError, AttributeError):
        onednn = "?"
    return (f"tensorflow {tf.__version__} (keras {keras.__version__}), sees {devices}, oneDNN {onednn}, "
            f"{quiet.describe_log_level()}")


@dataclass
class Runtime:
    device_type: str   # "cpu" | "cuda"
    precision: str     # "fp32" | "amp-fp16" | "amp-bf16"

    @property
    def loss_scaling(self) -> bool:
        return self.precision == "amp-fp16"


def setup(cfg: RunConfig, log=print) -> Runtime:
    """Seed everything, pick the device, set the global dtype policy."""
    if cfg.device == "cuda" and not _GPUS:
        raise UsageError("--device cuda, but TensorFlow sees no GPU; use --device cpu")
    if cfg.device == "cpu" and _GPUS:
        tf.config.set_visible_devices([], "GPU")
    device_type = "cuda" if _GPUS and cfg.device != "cpu" else "cpu"
    bf16_supported = True
    if device_type == "cuda":
        capability = tf.config.experimental.get_device_details(_GPUS[0]).get("compute_capability", (0, 0))
        bf16_supported = capability >= (8, 0)
    precision = resolve_precision(cfg, device_type, bf16_supported)

    keras.utils.set_random_seed(cfg.seed)  # Python, numpy and TensorFlow
    tf.config.experimental.enable_op_determinism()  # makes --resume bit-exact
    keras.mixed_precision.set_global_policy(amp.POLICIES[precision])  # before any layer is built
    warn_if_bf16_emulated(precision, device_type, log)
    log(f"{cfg.model} | {describe_tensorflow()} | "
        f"{device_type} | {describe_precision(precision, device_type)} | "
        f"policy {amp.POLICIES[precision]}")
    return Runtime(device_type, precision)
