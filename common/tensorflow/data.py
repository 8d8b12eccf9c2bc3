"""The training set on the device, or behind a host loader (--workers), in TensorFlow
(common/pytorch/data.py is the twin)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from common import data as datasets
from common import distributed
from common.config import RunConfig


class DeviceData:
    """The whole training set resident on the device as uint8 NHWC; a batch is a gather plus a
    scale to the model's range inside the compiled step, with no host copy per step."""

    def __init__(self, dataset: datasets.Dataset, value_range):
        self.dataset = dataset
        self.kind = dataset.kind
        self.value_range = value_range  # the model's, which samples are mapped back from
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

    # The batches' indices go in as tensor slices, a pipeline per this many steps (2.5 MB at
    # batch 64). One pipeline for the whole run listed every batch before step 1: 4,557 MB at
    # --iters 3,000,000. from_generator would not: under op determinism (runtime.py) it made
    # the parallel map run sequentially, with a C++ error line.
    steps_per_pipeline = 10_000

    def __init__(self, dataset: datasets.Dataset, value_range, workers: int):
        with tf.device("/CPU:0"):
            super().__init__(dataset, value_range)
        self.workers, self.iterator = workers, None

    def start(self, order, start_step: int, stop_step: int):
        self.iterator = self._batches(order, start_step, stop_step)

    def _batches(self, order, start_step: int, stop_step: int):
        for first in range(start_step, stop_step, self.steps_per_pipeline):
            last = min(first + self.steps_per_pipeline, stop_step)
            with tf.device("/CPU:0"):
                pipeline = (tf.data.Dataset.from_tensor_slices(np.stack(list(order.batches(first, last))))
                            .map(self.batch, num_parallel_calls=self.workers, deterministic=True)
                            .prefetch(tf.data.AUTOTUNE))
            yield from pipeline

    def stop(self):
        """Let the pipeline go (its map threads are this process's: nothing else to end)."""
        self.iterator = None


def load_data(cfg: RunConfig, runtime, value_range: tuple[float, float]) -> DeviceData:
    """The training set, resident on TensorFlow's default device (its first GPU, if any: where
    tf.constant puts it and the compiled step reads it), or a host loader under --workers;
    across workers they first check they all hold the same one, before networks are built
    from its shape."""
    dataset = datasets.load_training_set(cfg)
    distributed.check_same_data(dataset.x, runtime.replicas)
    if cfg.workers:
        return HostLoader(dataset, value_range, cfg.workers)
    return DeviceData(dataset, value_range)
