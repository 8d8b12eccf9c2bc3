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
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
        from torch.utils.tensorboard import SummaryWriter
    finally:
        tensorboard.compat.tf = lazy_tf
    if not getattr(threading.excepthook, "quiets_event_thread", False):
        threading.excepthook = _quiet_event_thread(threading.excepthook, _AsyncWriterThread)
    return SummaryWriter


def _quiet_event_thread(hook, event_thread: type):
    """threading.excepthook, less the traceback of the writer's own thread: that thread keeps
    its error (a full disk) for the next write, which raises it, and the run says it in one
    warning (common/tensorboard.py's Board). Other threads' exceptions go to `hook`."""

    def excepthook(args):
        if not isinstance(args.thread, event_thread):
            hook(args)

    excepthook.quiets_event_thread = True
    return excepthook


class Writer:
    """One SummaryWriter on the run folder. `purge_step`: TensorBoard drops the events an
    earlier process wrote from this step on (a SessionLog START event at that step)."""

    def __init__(self, folder: Path, purge_step: int):
        self.writer = summary_writer_class()(str(folder), purge_step=purge_step)

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
