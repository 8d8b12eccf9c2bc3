"""TensorBoard events of a PyTorch run, written with torch.utils.tensorboard into the run folder:
the tags and steps common/tensorboard.py decides. common/tensorflow/tensorboard.py is the twin
(tf.summary)."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from tensorboard.plugins.hparams.summary_v2 import hparams_pb
from tensorboard.plugins.text.summary_v2 import text_pb


def summary_writer_class():
    """torch.utils.tensorboard, imported so that it never loads TensorFlow.

    torch's writer reaches files through `tensorboard.compat.tf`, a lazy module that becomes
    TensorFlow itself when TensorFlow is installed (seconds and hundreds of MB in a PyTorch
    run), and already on import. While it is imported, that name points at TensorBoard's own
    TensorFlow-free stub (enough to write local files); then it is put back, so TensorFlow's
    tf.summary, in a process that trains both frameworks, still finds TensorFlow."""
    import tensorboard.compat
    from tensorboard.compat import tensorflow_stub

    lazy_tf, tensorboard.compat.tf = tensorboard.compat.tf, tensorflow_stub
    try:
        from torch.utils.tensorboard import SummaryWriter
    finally:
        tensorboard.compat.tf = lazy_tf
    return SummaryWriter


def quiet_event_thread_errors() -> None:
    """Install, once per process, a threading.excepthook that skips the traceback of the event
    writer's own thread: that thread keeps its error (a full disk) for the next write, which
    raises it, and the run says it in one warning (common/tensorboard.py's Board). Other
    threads' exceptions go to the hook there was. (The thread's class is TensorBoard's private
    _AsyncWriterThread: if it is renamed, the traceback shows again, nothing else changes.)"""
    from tensorboard.summary.writer import event_file_writer  # loaded by summary_writer_class()

    event_thread = getattr(event_file_writer, "_AsyncWriterThread", None)
    previous = threading.excepthook
    if event_thread is None or getattr(previous, "quiets_event_thread", False):
        return

    def excepthook(args):
        if not isinstance(args.thread, event_thread):
            previous(args)

    excepthook.quiets_event_thread = True
    threading.excepthook = excepthook


class Writer:
    """One SummaryWriter on the run folder. `purge_step`: TensorBoard drops the events an
    earlier process wrote from this step on (a SessionLog START event at that step)."""

    def __init__(self, folder: Path, purge_step: int):
        writer_class = summary_writer_class()
        quiet_event_thread_errors()
        self.writer = writer_class(str(folder), purge_step=purge_step)

    def scalars(self, values: dict[str, float], step: int):
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def image(self, tag: str, image: np.ndarray, step: int):
        self.writer.add_image(tag, image, step, dataformats="HWC")

    def text(self, tag: str, text: str, step: int):
        # add_text would name the tag "<tag>/text_summary"; this is tf.summary.text's summary
        self.writer.file_writer.add_summary(text_pb(tag, text), step)

    def hparams(self, values: dict, step: int):
        # In this run's own file: add_hparams would write a run of its own in a new subfolder
        self.writer.file_writer.add_summary(hparams_pb(values), step)

    def close(self):
        self.writer.close()
