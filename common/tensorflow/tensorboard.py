"""TensorBoard events of a TensorFlow run, written with tf.summary into the run folder: the tags
and steps common/tensorboard.py decides. common/pytorch/tensorboard.py is the twin
(torch.utils.tensorboard)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.hparams.summary_v2 import hparams_pb


class Writer:
    """One tf.summary file writer on the run folder. `purge_step`: TensorBoard drops the events
    an earlier process wrote from this step on (a SessionLog START event at that step, what
    torch's SummaryWriter(purge_step=...) writes)."""

    def __init__(self, folder: Path, purge_step: int):
        self.writer = tf.summary.create_file_writer(os.fsencode(folder))  # bytes: a name's undecodable byte too
        restart = event_pb2.Event(step=purge_step, wall_time=time.time(),
                                  session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
        # tf.summary has no call for a raw event: the writer's own op writes it into its file
        # (tf.summary's import_event does the same with the default writer's handle).
        tf.raw_ops.ImportEvent(writer=self.writer._resource, event=restart.SerializeToString())

    def scalars(self, values: dict[str, float], step: int):
        with self.writer.as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, value)

    def image(self, tag: str, image: np.ndarray, step: int):
        with self.writer.as_default(step=step):
            tf.summary.image(tag, image[np.newaxis])

    def text(self, tag: str, text: str, step: int):
        with self.writer.as_default(step=step):
            tf.summary.text(tag, text)

    def hparams(self, values: dict, step: int):
        with self.writer.as_default(step=step):
            tf.summary.experimental.write_raw_pb(hparams_pb(values).SerializeToString())

    def close(self):
        self.writer.close()
