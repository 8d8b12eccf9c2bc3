"""The run folder every script writes, and the batch order both frameworks share.

runs/<model>/<framework>-<precision>/
    config.json      the flags, the resolved precision and device, library versions
    history.jsonl    one JSON object per logged step
    fixed_noise.npy  the noise every sample grid is drawn from
    samples/         step_XXXXXX.png
    checkpoints/     step_XXXXXX.pt (PyTorch) or step_XXXXXX.npz (TensorFlow), last two kept
    summary.json     median step time, samples/s, peak memory, final losses
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Protocol

import numpy as np

from common.config import RESUME_KEYS, RunConfig, run_dir_for
from common.errors import CheckpointError, UsageError, UserError

CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})\.(pt|npz)$")
KEEP_CHECKPOINTS = 2
BATCH_STREAM = 11  # numpy stream for the batch order, apart from the fixed noise's


def atomic_write(path: Path, write) -> None:
    """Write through `write(file)` to a temporary file, then rename over `path`.

    A crash leaves either the old file or the new one, never a half-written file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Checkpoints(Protocol):
    """A framework's checkpoints of a run (common/pytorch/checkpoint.py,
    common/tensorflow/checkpoint.py): the whole training state in one file."""

    suffix: str  # "pt" | "npz"

    def save(self, path: Path, meta: dict) -> None:
        """Write atomically; `meta` holds the step and the skipped-step count."""

    def restore(self, path: Path) -> dict:
        """Load the state; returns the meta it was saved with (and "warning", a line to
        print, for an older checkpoint that loads with a caveat). One CheckpointError line for
        a file that is unreadable or does not fit the model."""


class RunFolder:
    def __init__(self, path: Path, writable: bool = True):
        self.path = Path(path)
        # False on the data-parallel replicas other than rank 0: they read (checkpoints to
        # resume from), and what they would write, rank 0 writes.
        self.writable = writable
        self.samples = self.path / "samples"
        self.checkpoints = self.path / "checkpoints"
        self.history_file = self.path / "history.jsonl"

    @classmethod
    def prepare(cls, cfg: RunConfig, precision: str, details: dict) -> "RunFolder":
        """Create (or, with --resume, reopen) the run folder; never clobber a run silently."""
        run = cls(run_dir_for(cfg, precision))
        config = {**json.loads(cfg.to_json()), "precision": precision, **details}
        if cfg.resume:
            run._check_resumable(config)
        elif run.path.exists() and any(run.path.iterdir()):
            if not cfg.overwrite:
                raise UsageError(f"{run.path} already holds a run: pass --resume to continue it, "
                                 "--overwrite to start over, or --out for a new folder")
            shutil.rmtree(run.path)
        run.samples.mkdir(parents=True, exist_ok=True)
        run.checkpoints.mkdir(parents=True, exist_ok=True)
        atomic_write(run.path / "config.json",
                     lambda f: f.write(json.dumps(config, indent=2, sort_keys=True).encode()))
        return run

    @classmethod
    def replica_view(cls, cfg: RunConfig, precision: str) -> "RunFolder":
        """The run folder rank 0 has prepared, as the other replicas see it: read-only."""
        return cls(run_dir_for(cfg, precision), writable=False)

    def _check_resumable(self, config: dict) -> None:
        saved_path = self.path / "config.json"
        if not saved_path.exists():
            raise CheckpointError(f"nothing to resume in {self.path}: no config.json; "
                                  "start without --resume")
        try:
            saved = json.loads(saved_path.read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{saved_path} is unreadable ({error})") from None
        differing = [key for key in (*RESUME_KEYS, "precision")
                     if saved.get(key) != config.get(key)]
        if differing:
            changes = ", ".join(f"{k}: {saved.get(k)!r} -> {config.get(k)!r}" for k in differing)
            raise CheckpointError(f"--resume with other settings than the run in {self.path} "
                                  f"({changes}); use the run's settings or a new --out")
        if self.latest_checkpoint() is None:
            raise CheckpointError(f"nothing to resume in {self.path}: no checkpoint yet; "
                                  "start without --resume")

    # --- checkpoints -------------------------------------------------------------------
    def checkpoint_path(self, step: int, suffix: str) -> Path:
        return self.checkpoints / f"step_{step:06d}.{suffix}"

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        found = []
        if self.checkpoints.is_dir():
            for path in self.checkpoints.iterdir():
                match = CHECKPOINT_NAME.match(path.name)
                if match:
                    found.append((int(match.group(1)), path))
        return sorted(found)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        found = self.list_checkpoints()
        return found[-1] if found else None

    def prune_checkpoints(self) -> None:
        if not self.writable:
            return
        for _, path in self.list_checkpoints()[:-KEEP_CHECKPOINTS]:
            path.unlink(missing_ok=True)

    # --- history and summary -----------------------------------------------------------
    def append_history(self, row: dict) -> None:
        if not self.writable:
            return
        with open(self.history_file, "a") as file:
            file.write(json.dumps(row) + "\n")

    def read_history(self) -> list[dict]:
        if not self.history_file.exists():
            return []
        return [json.loads(line) for line in self.history_file.read_text().splitlines() if line]

    def truncate_history(self, last_step: int) -> None:
        """Drop rows logged after the checkpoint a resumed run restarts from."""
        if not self.writable:
            return
        rows = [row for row in self.read_history() if row["step"] <= last_step]
        atomic_write(self.history_file,
                     lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))

    def write_summary(self, summary: dict) -> None:
        if not self.writable:
            return
        atomic_write(self.path / "summary.json",
                     lambda f: f.write(json.dumps(summary, indent=2, sort_keys=True).encode()))

    def read_summary(self) -> dict:
        return json.loads((self.path / "summary.json").read_text())

    def read_finished(self) -> tuple[dict, dict]:
        """config.json and summary.json of a finished run; one UserError line otherwise."""
        try:
            return (json.loads((self.path / "config.json").read_text()), self.read_summary())
        except FileNotFoundError as error:
            raise UserError(f"{self.path} is not a finished run (no {Path(error.filename).name})") from None
        except ValueError as error:
            raise UserError(f"{self.path} has an unreadable config.json or summary.json ({error})") from None

    def sample_path(self, step: int, tag: str = "") -> Path:
        return self.samples / f"step_{step:06d}{tag}.png"


class BatchOrder:
    """Which examples form batch `step`: a fresh permutation each epoch, drawn from
    (seed, epoch) alone, so a resumed run and both frameworks see the same batches."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = num_examples // batch_size

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, offset of the batch in that epoch's permutation)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        return epoch, position * self.batch_size

    def batches(self, start_step: int, stop_step: int):
        """The example indices of every batch from start_step to stop_step, in order: what a
        host loader prefetches (the resident path slices the same permutations itself)."""
        epoch, permutation = None, None
        for step in range(start_step, stop_step):
            batch_epoch, offset = self.locate(step)
            if batch_epoch != epoch:
                epoch, permutation = batch_epoch, self.permutation(batch_epoch)
            yield permutation[offset:offset + self.batch_size]

    def permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, BATCH_STREAM, epoch])
        return rng.permutation(self.num_examples).astype(np.int32)
