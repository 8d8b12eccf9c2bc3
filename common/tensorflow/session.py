"""The TensorFlow session the shared loop drives (the `Session` contract of common/loop.py),
and `fit`, the last call of every TensorFlow model's main(). common/pytorch/session.py is the
twin.

Under --distribute the compiled step runs the model's training step on every replica
(`strategy.run`), each on its rows of the global batch, and averages the metrics over them."""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Protocol

import keras
import numpy as np
import tensorflow as tf

from common import evaluation, loop
from common.config import RunConfig, batch_division, check_batch_among_replicas
from common.runs import BatchOrder, RunFolder
from common.tensorflow import amp
from common.tensorflow import porting as keras_porting
from common.tensorflow.checkpoint import Checkpoints
from common.tensorflow.data import DeviceData, HostLoader
from common.tensorflow.ema import ExponentialMovingAverage
from common.tensorflow.precision_report import precision_report
from common.tensorflow.profiling import Profiler
from common.tensorflow.runtime import Noise, Runtime, synchronize_batch_norm, translate_failures
from common.tensorflow.tensorboard import Writer


class Trainer(Protocol):
    """What a model hands to the session: its networks and optimizers (checkpointed by name),
    its training noise (whose draw counter is checkpointed too), the averaged copies of its
    networks under --ema-decay (by the network's name; checkpointed too), its training step (compiled here
    with tf.function), and its sample grids. Generators also have `sample(z)`, the VAE
    `encode(x)` and `decode_logits(z)`, for common/evaluation.py."""

    modules: dict[str, keras.Model]
    optimizers: dict[str, keras.optimizers.Optimizer]
    noise: Noise
    averages: dict[str, ExponentialMovingAverage]
    cfg: RunConfig  # its flags: the session reads how its batch divides (config.batch_division)
    z_dim: int
    noise_shape: tuple[int, int]  # the sample grids' fixed noise: (rows, width)

    def train_step(self, batch: tf.Tensor) -> dict[str, tf.Tensor]: ...

    def write_samples(self, run: RunFolder, step: int) -> None: ...


class Session:
    def __init__(self, trainer: Trainer, data: DeviceData, runtime: Runtime, jit_compile=False):
        self.trainer, self.data, self.runtime = trainer, data, runtime
        self.precision = runtime.precision
        self.checkpoints = Checkpoints(trainer, runtime)
        self.noise_shape = trainer.noise_shape
        self.profiler = Profiler()
        self.replicas = runtime.replicas
        self.batch_parts = batch_division(trainer.cfg)[0]  # WGAN-GP: its critic batches
        if runtime.sync_bn:
            for module in trainer.modules.values():
                synchronize_batch_norm(module)
        if not isinstance(data, HostLoader):  # the resident set, a copy on each replica's device
            self._examples = self.replicas.local_copies(data.x)
        self._step = self._compile(self._train_on_indices, jit_compile)
        self._step_on_batch = self._compile(self._train_on_batch, jit_compile)

    def _compile(self, replica_step, jit_compile):
        if self.replicas.count == 1:
            return tf.function(replica_step, jit_compile=jit_compile)
        return tf.function(lambda *args: self.replicas.run(replica_step, *args), jit_compile=jit_compile)

    def _train_on_indices(self, examples, indices):
        rows = tf.gather(examples, self.replicas.shard(indices, self.batch_parts))
        return self.train_on(self.data.to_model(rows))

    def _train_on_batch(self, batch):
        return self.train_on(self.replicas.shard(batch, self.batch_parts))

    def train_on(self, batch) -> dict:
        """The model's training step on a batch, plus "skipped" under float16: the step's own
        flag where it reports one (WGAN-GP, whose several updates amp.SkippedUpdates watches),
        else whether a scale went down over the step, exact for one update per optimizer
        (what tf.function compiles; called directly, it runs eagerly)."""
        optimizers = list(self.trainer.optimizers.values())
        scales = amp.scales_now(optimizers) if self.runtime.loss_scaling else None
        metrics = self.trainer.train_step(batch)
        if scales is not None and "skipped" not in metrics:
            metrics = {**metrics, "skipped": amp.any_scale_went_down(optimizers, scales)}
        return metrics

    def start(self, order: BatchOrder, start_step: int, stop_step: int):
        if isinstance(self.data, HostLoader):
            self.data.start(order, start_step, stop_step)

    def stop_loading(self):
        if isinstance(self.data, HostLoader):
            self.data.stop()

    def upload_batches(self, batches: np.ndarray) -> list[tf.Tensor]:
        return tf.unstack(tf.constant(batches))

    def train_step(self, indices) -> dict:
        with translate_failures():  # multi-worker: a worker that went away ends this one with a line
            if isinstance(self.data, HostLoader):  # the next prefetched batch is the one `indices` names
                return self._step_on_batch(next(self.data.iterator))
            return self._step(self._examples, indices)

    def fetch(self, metrics: dict) -> dict:
        values = tf.stack([tf.cast(v, tf.float32) for v in metrics.values()]).numpy()
        return dict(zip(metrics, values.tolist()))

    def stop_signal(self, signum: int) -> int:
        return self.replicas.stop_signal(signum)

    def loss_scale(self) -> float:
        return amp.loss_scale(self.trainer.optimizers.values())

    def synchronize(self):
        # A GPU runs its kernels asynchronously: the step clock waits for the queued steps
        # before it stops, as torch.cuda.synchronize() in the twin. A CPU's eager ops have
        # finished when they return; it costs nothing there, and the CPU tests run it.
        self.replicas.synchronize()

    def precision_report(self, indices) -> list[tuple]:
        return precision_report(self.trainer)

    def write_samples(self, run: RunFolder, step: int):
        self.trainer.write_samples(run, step)

    def evaluate(self, cfg: RunConfig, keep=None) -> dict:
        return evaluation.evaluate(cfg, self.trainer, keep=keep)

    def open_tensorboard(self, folder: Path, purge_step: int) -> Writer:
        return Writer(folder, purge_step)

    def peak_memory_mb(self) -> float:
        if self.runtime.device_type == "cuda":
            return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    def gpu_name(self) -> str | None:
        if self.runtime.device_type != "cuda":
            return None
        gpu = tf.config.list_physical_devices("GPU")[0]
        return tf.config.experimental.get_device_details(gpu).get("device_name", "a GPU that reports no name")


def fit(cfg: RunConfig, runtime: Runtime, trainer: Trainer, data: DeviceData) -> dict:
    """Open the run folder (with --init-from's weights, if given) and hand the trainer to the
    shared loop, which runs the step compiled by tf.function (with XLA under --xla). Under
    --distribute multi-worker only worker 0 writes and prints."""
    replicas = runtime.replicas
    check_batch_among_replicas(cfg, replicas.count, quiet=not replicas.writer)
    run = loop.open_run(
        cfg, runtime.precision, {"device": runtime.device_type, "replicas": replicas.count,
                                 "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                                              "numpy": np.__version__}},
        trainer.modules, export_weights=keras_porting.export_weights, import_weights=keras_porting.import_weights,
        sample_shape=data.dataset.sample_shape, replicas=replicas, log=runtime.log)
    for name, average in trainer.averages.items():  # a resumed run's checkpoint then overwrites it
        average.start_from(trainer.modules[name])
    return loop.train(cfg, run, Session(trainer, data, runtime, jit_compile=cfg.xla), len(data), log=runtime.log)
