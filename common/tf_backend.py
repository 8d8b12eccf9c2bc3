"""Everything TensorFlow/Keras-specific that is not about one model: device, AMP policy, data
on the device, optimizers, checkpoints, profiling, and the session the shared loop drives.

AMP in Keras 3 is a global dtype policy set before the models are built:
`mixed_float16` / `mixed_bfloat16` compute in 16 bits and keep float32 variables. Layers
built with `dtype="float32"` (output layers, VAE heads) stay in float32. float16 needs loss
scaling: `keras.optimizers.LossScaleOptimizer` wraps each optimizer, `opt.scale_loss(loss)`
scales inside the tape, and `apply_gradients` unscales, skips the step on inf/NaN gradients
and halves the scale. (Keras 3 removed `get_scaled_loss`/`get_unscaled_gradients`, which most
tutorials still show.) A plain optimizer's `scale_loss` returns the loss unchanged, so one
training step serves every precision.
"""
from __future__ import annotations

import collections
import re
import resource
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from common import data as datasets
from common import evaluation, loop, porting
from common.config import (
    RunConfig,
    describe_precision,
    resolve_precision,
    warn_if_bf16_emulated,
)
from common.errors import CheckpointError, UsageError
from common.runs import RunFolder, atomic_write

_GPUS = tf.config.list_physical_devices("GPU")

ADAM_EPS = 1e-8  # as in PyTorch; Keras' default is 1e-7
CHECKPOINT_FORMAT = 1
POLICIES = {"fp32": "float32", "amp-fp16": "mixed_float16", "amp-bf16": "mixed_bfloat16"}


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
        capability = tf.config.experimental.get_device_details(_GPUS[0]).get(
            "compute_capability", (0, 0))
        bf16_supported = capability >= (8, 0)
    precision = resolve_precision(cfg, device_type, bf16_supported)

    keras.utils.set_random_seed(cfg.seed)  # Python, numpy and TensorFlow
    tf.config.experimental.enable_op_determinism()  # makes --resume bit-exact
    keras.mixed_precision.set_global_policy(POLICIES[precision])
    warn_if_bf16_emulated(precision, device_type, log)
    log(f"{cfg.model} | tensorflow {tf.__version__} (keras {keras.__version__}) | "
        f"{device_type} | {describe_precision(precision, device_type)} | "
        f"policy {POLICIES[precision]}")
    return Runtime(device_type, precision)


def make_optimizer(cfg: RunConfig, runtime: Runtime) -> keras.optimizers.Optimizer:
    """Adam/AdamW with PyTorch's epsilon, wrapped for loss scaling under float16.

    --clip-grad-norm is the inner optimizer's `global_clipnorm`: the LossScaleOptimizer
    unscales the gradients before it hands them on, so the clip sees the true gradients."""
    clip = dict(global_clipnorm=cfg.clip_grad_norm) if cfg.clip_grad_norm else {}
    if cfg.optimizer == "adamw":
        inner = keras.optimizers.AdamW(cfg.lr, weight_decay=cfg.weight_decay, beta_1=cfg.beta1,
                                       beta_2=cfg.beta2, epsilon=ADAM_EPS, **clip)
    else:
        inner = keras.optimizers.Adam(cfg.lr, beta_1=cfg.beta1, beta_2=cfg.beta2,
                                      epsilon=ADAM_EPS, **clip)
    if not runtime.loss_scaling:
        return inner
    return keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=cfg.init_scale, dynamic_growth_steps=cfg.growth_interval)


def apply_gradients(optimizer, gradients, variables) -> tf.Tensor:
    """Apply one update; returns 1.0 when a LossScaleOptimizer skipped it (inf/NaN gradient),
    which shows as its `iterations` counter not advancing."""
    before = tf.identity(optimizer.iterations)
    optimizer.apply_gradients(zip(gradients, variables))
    return tf.cast(tf.equal(optimizer.iterations, before), tf.float32)


class DeviceData:
    """The whole training set resident on the device as uint8 NHWC; a batch is a gather plus a
    scale to the model's range inside the compiled step, with no host copy per step."""

    def __init__(self, dataset: datasets.Dataset, value_range):
        self.dataset = dataset
        self.kind = dataset.kind
        self.x = tf.constant(dataset.x)
        self.sample_shape = tuple(dataset.x.shape[1:])
        if self.kind == "image":
            low, high = value_range
            self.scale, self.shift = (high - low) / 255.0, low

    def __len__(self):
        return int(self.x.shape[0])

    def batch(self, indices: tf.Tensor) -> tf.Tensor:
        return self.to_model(tf.gather(self.x, indices))

    def to_model(self, rows: tf.Tensor) -> tf.Tensor:
        """uint8 images -> float in the model's range (points pass through)."""
        if self.kind == "image":
            return tf.cast(rows, tf.float32) * self.scale + self.shift
        return rows


class HostLoader(DeviceData):
    """--workers N: a tf.data pipeline gathers and scales the batches on the host with N
    parallel map calls and prefetches them (AUTOTUNE), in the same BatchOrder as the resident
    path, so both train on identical batches."""

    def __init__(self, dataset: datasets.Dataset, value_range, workers: int):
        with tf.device("/CPU:0"):
            super().__init__(dataset, value_range)
        self.workers, self.iterator = workers, None

    def start(self, order, start_step: int, stop_step: int):
        steps = np.stack(list(order.batches(start_step, stop_step)))
        with tf.device("/CPU:0"):
            pipeline = (tf.data.Dataset.from_tensor_slices(steps)
                        .map(self.batch, num_parallel_calls=self.workers, deterministic=True)
                        .prefetch(tf.data.AUTOTUNE))
        self.iterator = iter(pipeline)


def load_data(cfg: RunConfig, runtime: Runtime, value_range=(-1.0, 1.0)) -> DeviceData:
    dataset = datasets.load_training_set(cfg)
    if cfg.workers:
        return HostLoader(dataset, value_range, cfg.workers)
    return DeviceData(dataset, value_range)


class Session:
    """Adapts a model's trainer (its `modules`, `optimizers`, `noise` generator,
    `train_step(real)` and `write_samples(run, step)`) to the shared loop in common/loop.py."""

    checkpoint_suffix = "npz"

    def __init__(self, trainer, data: DeviceData, runtime: Runtime, jit_compile=False):
        self.trainer, self.data, self.runtime = trainer, data, runtime
        self._step = tf.function(lambda idx: trainer.train_step(data.batch(idx)),
                                 jit_compile=jit_compile)
        self._step_on_batch = tf.function(trainer.train_step, jit_compile=jit_compile)

    def start(self, order, start_step: int, stop_step: int):
        if isinstance(self.data, HostLoader):
            self.data.start(order, start_step, stop_step)

    def upload_indices(self, permutation: np.ndarray) -> tf.Tensor:
        return tf.constant(permutation)

    def train_step(self, indices) -> dict:
        if isinstance(self.data, HostLoader):  # the next prefetched batch is the one `indices` names
            return self._step_on_batch(next(self.data.iterator))
        return self._step(indices)

    def precision_report(self, indices) -> list[tuple]:
        """The dtype every layer's output has under the global policy, read from a model that
        returns all of them, run on zeros (inference mode; training is untouched)."""
        rows = []
        for name, model in self.trainer.modules.items():
            layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
            probe = keras.Model(model.inputs, [layer.output for layer in layers])
            inputs = [np.zeros((2, *x.shape[1:]), np.float32) for x in model.inputs]
            outputs = probe(inputs if len(inputs) > 1 else inputs[0], training=False)
            for layer, output in zip(layers, outputs if isinstance(outputs, (list, tuple)) else [outputs]):
                dtype = keras.backend.standardize_dtype
                weights = dtype(layer.weights[0].dtype) if layer.weights else "-"
                rows.append((f"{name}.{layer.name}", type(layer).__name__, weights, dtype(output.dtype)))
        return rows

    def fetch(self, metrics: dict) -> dict:
        values = tf.stack([tf.cast(v, tf.float32) for v in metrics.values()]).numpy()
        return dict(zip(metrics, values.tolist()))

    def loss_scale(self) -> float:
        """The smallest of the optimizers' scales (each LossScaleOptimizer has its own)."""
        if not self.runtime.loss_scaling:
            return 1.0
        return min(float(o.dynamic_scale) for o in self.trainer.optimizers.values())

    def synchronize(self):
        pass  # eager results are materialised by .numpy(); nothing is queued between calls

    def write_samples(self, run: RunFolder, step: int):
        self.trainer.write_samples(run, step)

    def evaluate(self, cfg: RunConfig) -> dict:
        return evaluation.evaluate(cfg, self.trainer)

    # --- checkpoints: one .npz of every variable, in the order the models create them ---
    def _variables(self) -> dict[str, list]:
        groups = {f"module/{k}": m.weights for k, m in self.trainer.modules.items()}
        groups.update({f"optimizer/{k}": o.variables for k, o in self.trainer.optimizers.items()})
        groups["rng/noise"] = [self.trainer.noise.state]
        return groups

    def save_checkpoint(self, path: Path, meta: dict):
        arrays = {"format": np.array(CHECKPOINT_FORMAT),
                  "meta/step": np.array(meta["step"]),
                  "meta/skipped_total": np.array(meta["skipped_total"]),
                  "meta/precision": np.array(self.runtime.precision)}
        for group, variables in self._variables().items():
            for index, variable in enumerate(variables):
                arrays[f"{group}/{index:04d}"] = variable.numpy()
        atomic_write(path, lambda file: np.savez(file, **arrays))

    def restore(self, path: Path) -> dict:
        try:
            with np.load(path, allow_pickle=False) as stored:
                arrays = {key: stored[key] for key in stored.files}
        except Exception as error:  # zip/format errors have many types; all mean "unreadable"
            raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}); "
                                  "delete it to resume from the one before") from None
        if arrays.get("format") is None or int(arrays["format"]) != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not a checkpoint of this repository")
        for group, variables in self._variables().items():
            saved = sorted(k for k in arrays if k.startswith(group + "/"))
            if len(saved) != len(variables):
                raise CheckpointError(f"checkpoint {path} does not fit this model: {group} has "
                                      f"{len(saved)} tensors, the model {len(variables)}")
            for key, variable in zip(saved, variables):
                if tuple(arrays[key].shape) != tuple(variable.shape):
                    raise CheckpointError(f"checkpoint {path} does not fit this model: {key} is "
                                          f"{arrays[key].shape}, expected {variable.shape}")
                variable.assign(arrays[key])
        return {"step": int(arrays["meta/step"]),
                "skipped_total": int(arrays["meta/skipped_total"])}

    # --- measurement -------------------------------------------------------------------
    def peak_memory_mb(self) -> float:
        if self.runtime.device_type == "cuda":
            return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    def profile_start(self, folder: Path):
        tf.profiler.experimental.start(str(folder))

    def profile_stop(self, folder: Path) -> tuple[list, str]:
        tf.profiler.experimental.stop()
        trace = max(folder.glob("plugins/profile/*/*.xplane.pb"), key=lambda path: path.stat().st_mtime)
        return (host_operations(trace),
                f"TensorBoard trace in {folder} (tensorboard --logdir {folder}, Profile tab; "
                "needs tensorboard-plugin-profile)")


def host_operations(trace: Path) -> list[tuple[str, int, float]]:
    """(operation, calls, self ms) of what the host ran in a TensorFlow profiler trace.

    The trace is an XSpace protobuf (its schema ships with TensorFlow). Executor threads hold
    one event per op run, named "scope/op_name:OpType"; under --xla, the compiled step's HLO
    instructions ("convolution.1", "MatMul_1") run inside ThunkExecutor::Execute spans and
    are counted by kind ("XLA convolution"). An event's time inside another counted event
    (an op calling a function, a loop's body) is taken off the outer one. On a GPU these are
    the host's times; the kernels are in the trace itself.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    calls, self_ps = collections.Counter(), collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":
                continue
            enclosing = []  # (end, label or None, is an XLA executor) of the open events
            for event in sorted(line.events, key=lambda e: (e.offset_ps, -e.duration_ps)):
                while enclosing and enclosing[-1][0] <= event.offset_ps:
                    enclosing.pop()
                metadata = plane.event_metadata[event.metadata_id]
                name, op_type = metadata.name, metadata.display_name
                if op_type and name.endswith(":" + op_type):
                    label = op_type
                elif "::" not in name and any(executor for _, _, executor in enclosing):
                    label = "XLA " + re.sub(r"[._]\d+$", "", name)  # "MatMul_1", "fusion.3": by kind
                else:
                    label = None  # executor bookkeeping
                if label:
                    outer = next((outer for _, outer, _ in reversed(enclosing) if outer), None)
                    if outer:
                        self_ps[outer] -= event.duration_ps
                    calls[label] += 1
                    self_ps[label] += event.duration_ps
                enclosing.append((event.offset_ps + event.duration_ps, label,
                                  name == "ThunkExecutor::Execute"))
    return [(label, calls[label], self_ps[label] / 1e9) for label in calls]


def fit(cfg: RunConfig, runtime: Runtime, trainer, data: DeviceData, log=print) -> dict:
    """Start from --init-from's weights if given, prepare the run folder, save the initial
    weights there (in the layout both frameworks read), and hand the trainer to the loop."""
    shape = data.dataset.sample_shape
    if cfg.init_from and not cfg.resume:
        source = porting.start_from(cfg.init_from, trainer.modules, porting.keras_import, shape)
        log(f"initial weights from {source}")
    run = RunFolder.prepare(cfg, runtime.precision, {
        "device": runtime.device_type,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "numpy": np.__version__}})
    log(f"run folder: {run.path}")
    if not cfg.resume:
        porting.save_initial_weights(
            run.path, {name: porting.keras_export(model) for name, model in trainer.modules.items()},
            {"model": cfg.model, "framework": "tensorflow", "seed": cfg.seed,
             "sample_shape": list(shape)})
    return loop.train(cfg, run, Session(trainer, data, runtime, jit_compile=cfg.xla), len(data), log=log)
