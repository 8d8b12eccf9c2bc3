"""Data-parallel training, the part both frameworks share: which rows of the global batch a
replica trains on, what every replica must share (its flags, training data, --init-from
weights and --resume checkpoint, compared as they start), and what the loop asks of the
replicas (the Replicas of common/pytorch/runtime.py and common/tensorflow/runtime.py fulfil
it). It imports no framework.

--batch-size is the global batch. Each of N replicas trains on batch/N of its examples and
on its rows of the noise drawn for the whole batch from the run's seed (PyTorch: the same
seeded generator in every replica; TensorFlow: one counter-based draw outside the replicas),
so N replicas see exactly what one process would. A model whose step splits its
batch (WGAN-GP: 5 critic batches) names the parts, and each part is sharded on its own.
"""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import zlib
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import numpy as np

from common.errors import CheckpointError, DataError, UsageError, UserError

T = TypeVar("T")


def shard(rows, rank: int, count: int, parts: int = 1):
    """Replica `rank`'s rows of a global batch (a numpy array or a torch tensor): of each of
    the batch's `parts` consecutive parts, the rank-th of `count` equal slices."""
    if count == 1:
        return rows
    return rows.reshape(parts, count, -1, *rows.shape[1:])[:, rank].reshape(-1, *rows.shape[1:])


def check_batch(batch_size: int, count: int, parts: int = 1, quiet: bool = False, pack: int = 1) -> None:
    """One UsageError line (printed by one replica, `quiet` on the others) for a global batch
    that does not divide; `pack`: each replica's rows must also divide into D's packs (PacGAN)."""
    unit = count * parts * pack
    if batch_size % unit:
        what = (f"{count} replica{'s' * (count != 1)}" + (f" x {parts} parts of each step's batch" if parts > 1 else "")
                + (f" x packs of {pack} samples" if pack > 1 else ""))
        raise UsageError(f"--batch-size {batch_size} does not divide among {what}: use a multiple "
                         f"of {unit} (the global batch; each replica trains on batch / {count})", quiet=quiet)


# A join slower than this says what it waits for (TensorFlow's, or a quarter of its wait if
# sooner): the replicas start within seconds, so a longer wait is for one that may never come.
JOIN_NOTICE_S = 20


# What a replica's own machine decides: where it finds the data, the run and the weights to
# start from (a shared folder mounted at another path; what they hold is compared, below), and
# its loader threads. Every other flag must be the same on every replica: a different --iters
# ended TensorFlow's workers in a traceback, a different --batch-size trained on unequal
# shards, a different --lr would step the replicas apart.
PER_MACHINE_FLAGS = ("data_dir", "out", "init_from", "workers")


def shared_flags(cfg) -> dict:
    """The settings of a run (a RunConfig) that every replica must share, by name."""
    return {name: value for name, value in sorted(dataclasses.asdict(cfg).items())
            if name not in PER_MACHINE_FLAGS}


def flags_fingerprint(cfg) -> list[int]:
    """One number per shared setting, a 31-bit CRC of its value (an int32 for TensorFlow's
    collectives), in name order: what the replicas gather and compare as they start."""
    return [_crc(json.dumps(value).encode()) for value in shared_flags(cfg).values()]


def check_same_flags(cfg, replicas: "Replicas") -> None:
    """One UsageError line on every replica (printed by the writer) unless every replica was
    started with the same flags but those of PER_MACHINE_FLAGS: it names the flags that
    differ, and this replica's values of them."""
    settings = shared_flags(cfg)
    # the flags' names first: other code on another machine would compare numbers unpaired
    if len({row[0] for row in replicas.gather([_crc(json.dumps(list(settings)).encode())])}) > 1:
        raise UsageError(f"the {replicas.noun} run different versions of this code (their flags differ): check "
                         "out the same commit on every machine", quiet=not replicas.writer)
    fingerprints = replicas.gather(flags_fingerprint(cfg))
    apart = [name for index, name in enumerate(settings) if len({replica[index] for replica in fingerprints}) > 1]
    if apart:
        flags = ", ".join(_as_flag(name) for name in apart)
        here = ", ".join(_as_flag(name, settings[name]) for name in apart)
        may_differ = ", ".join(_as_flag(name) for name in PER_MACHINE_FLAGS)
        raise UsageError(f"the {replicas.noun} were started with different {flags} (here: {here}): start every one "
                         f"with the same flags (only {may_differ} may differ)", quiet=not replicas.writer)


def check_same_data(x: np.ndarray, replicas: "Replicas") -> None:
    """One DataError line on every replica (printed by the writer) unless every replica holds
    the same training set (its count, shape and a CRC of its bytes): each reads its own
    --data-dir, which only names the files, and other files trained in silence on other data
    (or, of another image size, ended in a traceback)."""
    if replicas.count == 1:
        return
    here = [len(x), _crc(f"{x.shape} {x.dtype}".encode()), _crc(np.ascontiguousarray(x).data)]
    if any(row != here for row in replicas.gather(here)):
        raise DataError(f"the {replicas.noun} hold different training data (here: {len(x):,} examples of "
                        f"{x.shape[1:]}, {x.dtype}): every one must read the same files (its own --data-dir may "
                        "name them at another path)", quiet=not replicas.writer)


def check_same_checkpoint(latest: tuple[int, Path] | None, replicas: "Replicas") -> None:
    """--resume: one CheckpointError line on every replica (printed by the writer) unless every
    replica resumes from the same checkpoint: of the same step, and the same file (a CRC of its
    bytes). Each reads the latest in its own --out (`latest`: its step and path; None: none
    there): one that held none ended in a traceback, one that held an older run's trained on
    from other weights and wrote a checkpoint before the collectives came apart, and another
    run's of the same step trained the replicas apart in silence."""
    if replicas.count == 1:
        return
    if latest is None:
        step, contents = -1, 0
    else:
        step, contents = latest[0], _file_crc(latest[1], "checkpoint", "delete it to resume from the one before")
    gathered = replicas.gather([step, contents])
    steps = [row[0] for row in gathered]
    if len(set(steps)) > 1:
        found = ", ".join(f"{rank}: {f'step {at}' if at >= 0 else 'none'}" for rank, at in enumerate(steps))
        raise CheckpointError(f"--resume: the {replicas.noun}' run folders hold different latest checkpoints "
                              f"({replicas.noun[:-1]} {found}): each reads its own --out, which must hold the one "
                              "run (a file system the machines share)", quiet=not replicas.writer)
    if len({row[1] for row in gathered}) > 1:
        raise CheckpointError(f"--resume: the {replicas.noun}' latest checkpoints are of the same step ({step}) but "
                              f"not the same file (here: {latest[1]}): each reads its own --out, which must hold the "
                              "one run (a file system the machines share)", quiet=not replicas.writer)


def check_same_start(weights_file, replicas: "Replicas") -> None:
    """--init-from: one CheckpointError line on every replica (printed by the writer) unless
    every replica loaded the same file (a CRC of its bytes). Each names its own path, and the
    weights are loaded after DDP's broadcast of the initial ones, so other files would train
    the replicas apart."""
    if replicas.count == 1:
        return
    here = _file_crc(weights_file, "--init-from weights", "name another")
    if len({row[0] for row in replicas.gather([here])}) > 1:
        raise CheckpointError(f"the {replicas.noun} loaded different --init-from weights (here: {weights_file}): "
                              "every one must load the same file (its own --init-from may name it at another path)",
                              quiet=not replicas.writer)


def _crc(data) -> int:
    return zlib.crc32(data) >> 1


def _file_crc(path, what: str, fix: str) -> int:
    """_crc of a file's bytes, read a MiB at a time (a checkpoint may be large); one
    CheckpointError line for a file that cannot be read (a dangling link, one just removed)
    or is not a regular file (a FIFO named like a checkpoint: its read would block forever,
    so it is opened without waiting for a writer and looked at first)."""
    crc = 0
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise CheckpointError(f"{what} {path} is not a regular file; {fix}")
            while chunk := file.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
    except OSError as error:
        raise CheckpointError(f"{what} {path} is unreadable ({error.strerror or error}); {fix}") from None
    return crc >> 1


_MISSING = object()


def _as_flag(name: str, value=_MISSING) -> str:
    """A setting as its flag (`value`: as set), "--no-tensorboard" for TensorBoard's; the model
    is the script's own."""
    if name == "model":
        return "scripts" if value is _MISSING else f"{value}'s script"
    if name == "tensorboard":
        return "--no-tensorboard" if value is _MISSING or not value else "TensorBoard on"
    flag = "--" + name.replace("_", "-")
    if value is _MISSING or value is True:
        return flag
    return f"no {flag}" if value is None or value is False else f"{flag} {value}"


class ReplicaFailed(UserError):
    """Another replica stopped or died: this one ends too, with one line."""


class Replicas(Protocol):
    """The replicas of a run as the loop sees them; one process is a single replica."""

    rank: int   # 0 writes the run folder
    count: int
    noun: str   # what messages call them: "replicas" (torchrun's), "workers" (TF_CONFIG's processes)

    @property
    def writer(self) -> bool:
        """This replica writes the run folder (config, history, samples, checkpoints, TensorBoard)."""

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every replica's `values` (int32s, as many on each: TensorFlow's gather needs both; it
        gives every worker's), in rank order: the same answer on every replica."""

    def writer_first(self, action: Callable[[], T]) -> T | None:
        """Run `action` on the writer while the others wait; a UserError it raises ends every
        replica (the writer prints it; the others end quietly)."""

    def stop_signal(self, signum: int) -> int:
        """The signal any replica has received (0: none), the same answer on every replica."""

    def wait_for_writer(self) -> None:
        """Hold every replica here until the writer arrives, its files written (a replica
        that exits early with an error status makes torchrun stop the others)."""


class OneProcess:
    """The `Replicas` of a run in one process (the loop's default, and the tests')."""

    rank, count, writer, noun = 0, 1, True, "replicas"

    def gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def writer_first(self, action):
        return action()

    def stop_signal(self, signum: int) -> int:
        return signum

    def wait_for_writer(self) -> None:
        pass
