"""What a run shows in TensorBoard, decided once for both frameworks.

Every run writes TensorBoard events into its own run folder, so `tensorboard --logdir
runs/<model>` overlays PyTorch and TensorFlow, float32 and AMP, each folder a run of its own.
The tags, the same in both frameworks at the same steps:

    loss/<name>          each loss of the training step, the mean over the --log-every interval
                         (the history row's keys: d_loss, g_loss; the VAE's loss, recon, kl)
    amp/loss_scale       the loss scale at the log point (1 when nothing is scaled)
    amp/skipped_steps    steps a float16 loss scaler has skipped so far
    speed/ms_per_step    wall time per step over the interval
    speed/samples_per_s  examples per second over the interval
    optimizer/lr         the learning rate
    quality/<metric>     --evaluate's metrics (scripts/evaluate.py's too), at the step measured
    samples              the grid drawn from the run's fixed noise (an image), every sample step
    run/config           flags, precision, device and versions (text), and as hparams

The scalars come from the history row the loop builds once per interval, after its one device
sync, and the image from the PNG the run has just saved: writing adds no sync and writes
nothing between log points. common/pytorch/tensorboard.py (torch.utils.tensorboard) and
common/tensorflow/tensorboard.py (tf.summary) do the writing, one writer per process.

A writer opens with a restart marker at the step after the one it starts from. TensorBoard drops
whatever an earlier process logged from that step on, so a resumed run continues its curves
from its checkpoint without duplicate steps, as history.jsonl is truncated there.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from PIL import Image

from common.config import RunConfig
from common.errors import described
from common.runs import RunFolder, markdown_row, text_bytes

SAMPLES_TAG = "samples"
CONFIG_TAG = "run/config"


class Writer(Protocol):
    """A framework's event writer on one run folder (common/pytorch/tensorboard.py,
    common/tensorflow/tensorboard.py), opened by `Writer(folder, purge_step)`."""

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def image(self, tag: str, image: np.ndarray, step: int) -> None:
        """`image`: height x width x 3, uint8."""

    def text(self, tag: str, text: str, step: int) -> None:
        """Markdown, as TensorBoard's text dashboard renders it."""

    def hparams(self, values: dict, step: int) -> None:
        """Settings for TensorBoard's HParams dashboard (bool, number or str values)."""

    def close(self) -> None: ...


def interval_scalars(row: dict, losses: dict[str, float], batch_size: int, lr: float) -> dict[str, float]:
    """The scalars of one history row; `losses` are the interval's mean losses."""
    return {**{f"loss/{name}": value for name, value in losses.items()},
            "amp/loss_scale": row["loss_scale"], "amp/skipped_steps": row["skipped_total"],
            "speed/ms_per_step": row["step_ms"], "speed/samples_per_s": batch_size * 1000.0 / row["step_ms"],
            "optimizer/lr": lr}


def metric_scalars(metrics: dict) -> dict[str, float]:
    return {f"quality/{name}": float(value) for name, value in metrics.items()
            if name != "samples" and isinstance(value, (int, float))}


def settings(config: dict) -> dict:
    """config.json flattened ("versions.torch"): what run/config shows. A path's undecodable
    byte (a lone surrogate in Python) is written as its escape: events hold UTF-8 only, and
    the writer failed on it, ending the run's events."""
    flat = {}
    for key, value in sorted(config.items()):
        if isinstance(value, dict):
            flat.update({f"{key}.{name}": inner for name, inner in sorted(value.items())})
        else:
            flat[key] = value
    return {key: text_bytes(value).decode() if isinstance(value, str) else value for key, value in flat.items()}


def config_text(config: dict) -> str:
    title = f"{config['model']}, {config['framework']}, {config['precision']} on {config['device']}"
    rows = [markdown_row((key, value)) for key, value in settings(config).items()]  # a path may hold "|"
    return "\n".join([f"**{title}**", "", "| setting | value |", "|---|---|", *rows])


def hparams(config: dict) -> dict:
    """The settings the HParams dashboard takes: bool, number or str (no None)."""
    return {key: value for key, value in settings(config).items() if isinstance(value, (bool, int, float, str))}


def grid_image(path: Path) -> np.ndarray:
    """The sample grid (or scatter plot) PNG as height x width x 3 uint8, as both frameworks
    write it."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


class Board:
    """The run's TensorBoard: the loop hands it each history row, sample grid and evaluation;
    it writes them through the framework's writer. With --no-tensorboard it writes nothing; a
    failed write (a full disk, say) ends the writing with one warning, never the training."""

    def __init__(self, cfg: RunConfig, run: RunFolder, open_writer: Callable[[Path, int], Writer],
                 start_step: int, log=print, enabled: bool = True):
        self.cfg, self.run, self.log = cfg, run, log
        self.writer = None
        # Opened at the first write: a finished run reopened with nothing to evaluate leaves no
        # empty events file behind. enabled: False on data-parallel ranks but 0.
        self.open_writer = (lambda: open_writer(run.path, start_step + 1)) if cfg.tensorboard and enabled else None
        if self.open_writer and start_step < cfg.iters:  # not a finished run reopened for --evaluate
            # a resume's settings are the command's, written to config.json only once its checkpoint has loaded
            config = run.resumed_config or json.loads((run.path / "config.json").read_text())
            self._write(lambda writer: writer.text(CONFIG_TAG, config_text(config), start_step))
            self._write(lambda writer: writer.hparams(hparams(config), start_step))

    def _write(self, write: Callable[[Writer], None]):
        """One write, after opening the writer if this is the first; any error ends the writing
        with one warning (whichever framework's error: the training goes on)."""
        if self.writer is None and self.open_writer is None:
            return
        try:
            if self.writer is None:
                self.writer, self.open_writer = self.open_writer(), None
            write(self.writer)
        except Exception as error:
            self.writer = self.open_writer = None
            self.log(f"warning: TensorBoard events could not be written ({described(error)}); "
                     "the run goes on without them")

    def interval(self, row: dict, losses: dict[str, float]):
        self._write(lambda writer: writer.scalars(
            interval_scalars(row, losses, self.cfg.batch_size, self.cfg.lr), row["step"]))

    def samples(self, step: int):
        self._write(lambda writer: writer.image(SAMPLES_TAG, grid_image(self.run.sample_path(step)), step))

    def metrics(self, metrics: dict, step: int):
        self._write(lambda writer: writer.scalars(metric_scalars(metrics), step))

    def close(self):
        if self.writer is not None:
            self._write(lambda writer: writer.close())
        self.writer = self.open_writer = None
