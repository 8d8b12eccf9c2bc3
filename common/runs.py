"""The run folder every script writes, and the batch order both frameworks share.

runs/<model>/<framework>-<precision>[-<dataset>]/   (the dataset's name for any but MNIST)
    config.json          the flags, the resolved precision and device, library versions (and earlier ones)
    history.jsonl        one JSON object per logged step (a loss that went inf/NaN: null)
    fixed_noise.npy      the noise every sample grid is drawn from
    initial_weights.npz  the step-0 weights, in the form --init-from reads in either framework
    samples/             step_XXXXXX.png (and the VAE's step_XXXXXX_recon.png)
    checkpoints/         step_XXXXXX.pt (PyTorch) or step_XXXXXX.npz (TensorFlow), last two kept
    summary.json         median step time, samples/s, peak memory, final losses, --evaluate's metrics
    eval_samples.npz     --save-samples: --evaluate's samples (images as uint8 NHWC, 2-D points as float32)
    events.out.tfevents.*  TensorBoard's (common/tensorboard.py); profile/ under --profile
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import sys
import weakref
from pathlib import Path
from typing import Protocol

import numpy as np

from common import flags, models
from common.config import POINT_DATASETS, RESUME_KEYS, RunConfig, run_dir_for
from common.errors import CheckpointError, UsageError, UserError, escaped_line_breaks, first_line

CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})\.(pt|npz)$")
KEEP_CHECKPOINTS = 2
# what a history row holds besides the losses: step, loss scaling, time, and (float16) the
# steps a scaler skipped and those whose losses were not finite
NOT_LOSSES = ("step", "loss_scale", "skipped", "skipped_total", "step_ms", "skipped_at", "nonfinite_steps")
# What a run writes in its folder (the listing above, and the temporary files of atomic_write,
# and of sampling.fixed_noise before it used atomic_write): what --overwrite deletes.
RUN_ENTRY = re.compile(r"(config\.json|history\.jsonl|summary\.json|fixed_noise\.npy|initial_weights\.npz"
                       r"|eval_samples\.npz|samples|checkpoints|profile|events\.out\.tfevents\..+|fixed_noise\.npy\.tmp"
                       r"|\.(config\.json|history\.jsonl|summary\.json|initial_weights\.npz|fixed_noise\.npy"
                       r"|eval_samples\.npz)\.tmp-\d+)")
# ... and what it writes inside its samples/ and checkpoints/ (with atomic_write's temporary files)
FOLDER_ENTRY = {"samples": re.compile(r"step_\d{6,}(_recon)?\.png|\.step_\d{6,}(_recon)?\.png\.tmp-\d+"),
                "checkpoints": re.compile(r"(diverged_)?step_\d{6,}\.(pt|npz)"
                                          r"|\.(diverged_)?step_\d{6,}\.(pt|npz)\.tmp-\d+")}
BATCH_STREAM = 11  # numpy stream for the batch order, apart from the fixed noise's


def _new_file(name, flags: int) -> int:
    """open()'s opener for a file that must not exist yet: never written through a link,
    whose target, outside the folder, would get the bytes."""
    return os.open(name, flags | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def atomic_write(path: Path, write, durable: bool = True) -> None:
    """Write through `write(file)` to a temporary file, then rename over `path`.

    A crash leaves either the old file or the new one, never a half-written file; `durable`
    (fsync) keeps it so through a power cut too, which a figure that can be drawn again from
    the run does not need.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a link left at that name (a run folder from elsewhere) included
    try:
        with open(tmp, "wb", opener=_new_file) as file:
            write(file)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as error:
        if not error.filename:  # a failed write (a full disk) names no file: the one asked for
            error.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def finite_or_null(value):
    """`value` with every inf, -inf and NaN float in it (through dicts, lists and tuples) as
    None. JSON has no such numbers: Python's json writes bare NaN/Infinity, which strict parsers
    (jq, JavaScript's JSON.parse) refuse; null is what pandas' to_json writes for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def strict_json(value, **options) -> str:
    """The JSON text of `value` with its non-finite floats as null (finite_or_null): what every
    JSON file of a run folder and of the scripts' tables is written with. allow_nan=False makes
    one that got past it (in a type finite_or_null does not walk) an error, not invalid JSON."""
    return json.dumps(finite_or_null(value), allow_nan=False, **options)


def one_line(text) -> str:
    """`text` as one printable line: its line breaks as spaces, and a lone surrogate (a JSON
    "\\ud800", a folder name's undecodable byte) as its \\u escape, where print() and
    str.encode() raised UnicodeEncodeError. For what a file or folder name puts in our output."""
    return " ".join(str(text).splitlines()).encode("utf-8", "backslashreplace").decode("utf-8")


def run_folder_around(path: Path) -> Path | None:
    """The run folder that `path` is, or lies inside, if any: where a tool's report, table or
    runs would mix with a run's files (a --result-json named summary.json replaced its own)."""
    return next((folder for spelling in spellings(path) for folder in (spelling, *spelling.parents)
                 if RunFolder(folder).read_config() is not None), None)


def spellings(path: Path) -> tuple[Path, ...]:
    """`path` as named and with its links resolved (a link to a run's samples/ leads inside
    the run): where a path lies is checked on both."""
    return tuple(dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))))


def lies_within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it, either spelled as named or resolved."""
    return any(inner == outer or outer in inner.parents for inner in spellings(path) for outer in spellings(folder))


def refuse_inside_a_run(path: Path, flag: str) -> None:
    if (run := run_folder_around(path)) is not None:
        where = "a run's folder" if run == Path(os.path.abspath(path)) else f"inside the run folder {run}"
        raise UsageError(f"{flag} {path} is {where}; name a path outside it")


def text_bytes(text: str) -> bytes:
    """A text file's content as UTF-8, a folder name's undecodable byte (a lone surrogate) as
    its \\u escape, where str.encode() raised UnicodeEncodeError after the work was done."""
    return text.encode("utf-8", "backslashreplace")


def markdown_row(cells) -> str:
    """A row of a GitHub markdown table, each cell one_line() with its `|` escaped: a run's
    field or folder name holding `|` or a line break (an edit) opened a column or ended the row."""
    return "| " + " | ".join(one_line(cell).replace("|", r"\|") for cell in cells) + " |"


def null_as_nan(value):
    """`value` with every None in it (through dicts and lists) as NaN: where a loss or a metric
    was inf/NaN its file holds null (strict_json), read back as the NaN the arithmetic, plots
    and tables downstream have always met there. A file from before, with bare NaN, reads as it
    did (json.loads takes it)."""
    if value is None:
        return math.nan
    if isinstance(value, dict):
        return {key: null_as_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [null_as_nan(item) for item in value]
    return value


def not_a_folder(folder: Path) -> UserError | None:
    """The error for one of a run's folders (samples/, checkpoints/) that exists as something
    else: a file, a dangling link (damage, exit status 1, not a flag's error)."""
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        return UserError(f"{folder} is not a folder, where the run keeps its {folder.name}: move it "
                          "out of the run folder, or use --out for a new run")
    return None


# What --profile writes in profile/: files it replaces, and folders the profilers write into
PROFILE_FILES = ("top_ops.txt", "trace.json")        # ours; PyTorch's Chrome trace
PROFILE_FOLDERS = ("plugins", "plugins/profile")     # TensorFlow's trace, one folder per window


def profile_folder_problem(folder: Path) -> UserError | None:
    """The error for a profile/ that a --profile window would fail on when it ends, its steps
    since the last checkpoint lost with it (a folder where a file goes, a file where a folder
    goes), or write through, outside the run (a link)."""
    if folder.is_symlink():  # a link to a folder passes not_a_folder, and would take every file outside
        return UserError(f"{folder} is a link, where --profile writes its traces: move it out of the run "
                         "folder, or use --out for a new run")
    if problem := not_a_folder(folder):
        return problem
    for name, want_folder in (*((name, False) for name in PROFILE_FILES), *((name, True) for name in PROFILE_FOLDERS)):
        path = folder / name
        if path.is_symlink() or (path.exists() and path.is_dir() != want_folder):
            what = "a link" if path.is_symlink() else "a folder" if path.is_dir() else "not a folder"
            return UserError(f"{path} is {what}, where --profile writes its {'traces' if want_folder else name}: "
                             "move it out of the run folder, or use --out for a new run")
    return None


def continue_flags(folder: Path, summary: dict, again: str) -> list[str]:
    """How a script that drives the model scripts (compare.py --reuse, quality_table.py) takes
    an unfinished run with `summary` ({} without one) on toward its --iters:
    --resume from its latest checkpoint; --overwrite, training it again, when it has none and
    nothing to lose (killed before its first); refused when its checkpoints are gone but its
    results are there (deleted to save space), as the model script alone refuses."""
    if RunFolder(folder).latest_checkpoint() is not None:
        return ["--resume"]
    step = summary.get("step", 0)
    if step > 0:
        # a run stopped on inf/NaN says so; its diverged_step_* state is not one to go on from
        cause = f"it stopped: {summary['stopped']}" if isinstance(summary.get("stopped"), str) else "deleted?"
        raise UsageError(f"cannot continue {folder}: it holds results up to step {step} but no checkpoint "
                         f"to continue from ({cause}){again}, or --runs for another folder")
    return ["--overwrite"]


def where_a_stopped_run_stands(folder: Path, run: str, goes_on: str, starting_over: bool) -> str:
    """What a script that drives the model scripts (compare.py, quality_table.py) says of `run`,
    in `folder`, stopped by a signal: whether it holds a checkpoint that `goes_on` (the way on:
    "--reuse", "the same command") continues from. Looked at once the run has ended: a Ctrl-C
    while its script still imported had been said to have saved one."""
    if starting_over:  # --overwrite: a checkpoint there may still be the run it replaces
        return f"{run} was being trained again (--overwrite); the same command starts it over"
    try:
        held = RunFolder(folder).latest_checkpoint() is not None
    except UserError as problem:  # checkpoints/ a file or a dangling link: the way on refuses it too
        return f"{run}: {problem}"
    if held:
        return f"{run} holds a checkpoint; {goes_on} continues it"
    return f"{run} stopped before its first checkpoint; {goes_on} trains it from the start"


def same_path(typed, recorded) -> bool:
    """Two paths as typed (`src`, `./src/`, `~/src`) naming the same place from the working folder."""
    return isinstance(typed, str) and isinstance(recorded, str) and flags.absolute(typed) == flags.absolute(recorded)


MAX_COUNT = flags.MAX_COUNT


def _is_number(value) -> bool:
    """A number a float holds: an integer past float's range (a hand-edited 1 and 400 zeros)
    raised OverflowError wherever the scripts did arithmetic or drew a plot with it."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (isinstance(value, float) or abs(value) <= sys.float_info.max))


def _is_count(value) -> bool:
    """A whole number from 0 to 2**63 - 1 (what a checkpoint's int64 holds): numpy integers come
    from a TensorFlow checkpoint's arrays; bool is an int too, not a count."""
    return (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
            and 0 <= value <= MAX_COUNT)


# The fields of the run folder's JSON files that their readers use, each of the kind a run
# writes: a hand-edited value of another kind is damage, said when the file is read, rather
# than a TypeError in whichever table or plot meets it.
KINDS = {
    "a count": _is_count,
    "a number or null": lambda value: value is None or _is_number(value),
    "text": lambda value: isinstance(value, str),
    "text or null": lambda value: value is None or isinstance(value, str),
    "an object of numbers": lambda value: isinstance(value, dict) and all(map(_is_number, value.values())),
    # FID is a squared distance (metrics.frechet_distance clamps rounding's -1e-12 to 0): a
    # negative one is an edit, and a mean of them could be 0, which AMP's FID is divided by
    "an object of numbers, its fid not negative": lambda value: (
        KINDS["an object of numbers"](value) and not value.get("fid", 0) < 0),
}
FIELDS = {
    "summary.json": {"step": "a count", "iters": "a count", "batch_size": "a count", "replicas": "a count",
                     "skipped_steps": "a count", "median_step_ms": "a number or null",
                     "samples_per_s": "a number or null", "peak_memory_mb": "a number or null",
                     "model": "text", "framework": "text", "stopped": "text", "gpu": "text or null",
                     "final": "an object of numbers", "metrics": "an object of numbers, its fid not negative"},
    "config.json": {"model": "text", "framework": "text", "precision": "text", "device": "text", "iters": "a count"},
}
# The objects of a run folder's JSON files whose numbers may have been inf/NaN, written as null:
# read back as NaN (null_as_nan). Elsewhere null keeps its own meaning (no median step time).
NULL_AS_NAN = {"summary.json": ("final", "metrics", "metrics_over_draws")}


def _is_history_row(row) -> bool:
    """What a run logs: a step, numbers (losses, loss scale, step time) and the steps skipped.
    (A loss that was inf/NaN is null in the file, and NaN here: read_history reads it so.)"""
    return (isinstance(row, dict) and _is_count(row.get("step"))
            and all(_is_number(value) or (key == "skipped_at" and isinstance(value, list)
                                          and all(map(_is_count, value)))
                    for key, value in row.items()))


def read_json(path: Path, keys: tuple[str, ...] = (), hint: str = "") -> dict:
    """A run folder's JSON object (config.json, summary.json) holding `keys`, its FIELDS of
    their kinds; one UserError line naming the file, and `hint` (what to do), when it is
    missing, unreadable or damaged."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise UserError(f"{path} is not a regular file{hint}")
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path.parent} has no {path.name}{hint}") from None
    except OSError as error:
        raise UserError(f"{path} is unreadable ({error.strerror or error}){hint}") from None
    except (ValueError, RecursionError) as error:  # not JSON (a run stopped mid-write, an edit), or not text
        raise UserError(f"{path} is damaged: not valid JSON ({first_line(error)}){hint}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is damaged: a JSON {type(value).__name__}, not an object{hint}")
    for key in NULL_AS_NAN.get(path.name, ()):
        if isinstance(value.get(key), dict):
            value[key] = null_as_nan(value[key])
    missing = [key for key in keys if key not in value]
    if missing:
        raise UserError(f"{path} is damaged: no {', '.join(map(repr, missing))}{hint}")
    for key, kind in FIELDS.get(path.name, {}).items():
        if key in value and not KINDS[kind](value[key]):
            raise UserError(f"{path} is damaged: its {key} is {json.dumps(value[key])[:40]}, not {kind}{hint}")
    return value


def check_regular_file(path: Path, what: str, fix: str = "remove it or name another") -> None:
    """Refuse anything but a regular file before opening it: a FIFO (or a device) named like a
    checkpoint or weights file would block the read forever."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{what} {path} is not a regular file; {fix}")


def check_meta(path: Path, meta, model: str) -> dict:
    """The meta a checkpoint was saved with, checked before anything trusts it: a dict whose
    step and skipped-step count (and inf/NaN streak, if recorded) are non-negative integers, and
    whose model, if recorded, is `model`, the run's. One CheckpointError line otherwise."""
    def count(key):
        value = meta.get(key)
        if not _is_count(value):
            raise CheckpointError(f"checkpoint {path} has no valid {key} (found {value!r}); "
                                  "delete it to resume from the one before")
        return int(value)

    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} has no valid meta (found {type(meta).__name__}); "
                              "delete it to resume from the one before")
    checked = {key: value for key, value in meta.items() if key not in ("step", "skipped_total")}
    checked.update(step=count("step"), skipped_total=count("skipped_total"))
    if "nonfinite_streak" in meta:  # older checkpoints record none
        checked["nonfinite_streak"] = count("nonfinite_streak")
    if not isinstance(checked.get("model", ""), str):
        raise CheckpointError(f"checkpoint {path} has no valid model name (found {checked['model']!r})")
    # Checked before the tensors: another model's can have the same shapes (LSGAN and the
    # vanilla GAN), and where they differ the first mismatch would not say why. Older
    # checkpoints record no model.
    if checked.get("model", model) != model:
        raise CheckpointError(f"checkpoint {path} is of model {checked['model']}, this run is "
                              f"{model}; resume with the model's own script")
    return checked


class Checkpoints(Protocol):
    """A framework's checkpoints of a run (common/pytorch/checkpoint.py,
    common/tensorflow/checkpoint.py): the whole training state in one file."""

    suffix: str  # "pt" | "npz"

    def save(self, path: Path, meta: dict) -> None:
        """Write atomically; `meta` holds the step, the skipped-step count and the model."""

    def nonfinite(self) -> str | None:
        """Where the live state (weights, optimizer state, averages) first holds inf/NaN, or None."""

    def restore(self, path: Path, model: str) -> dict:
        """Load the state; returns the meta it was saved with, checked by `check_meta` (and
        "warning", a line to print, for an older checkpoint that loads with a caveat, and
        "nonfinite", where the state first holds inf/NaN, if anywhere: --resume refuses to
        train on from it, evaluate.py may measure it). One
        CheckpointError line for a file that is unreadable, is not a regular file, or does not
        fit the model (shapes, types and ranges of everything it holds)."""


def setting_changes(saved: dict, config: dict) -> str:
    """The settings --resume keeps that `config` (a command's) changes from `saved` (a run's),
    as "key: old -> new, ..."; empty when there are none."""
    shown = lambda value: "unset" if value is None else repr(value)
    return ", ".join(f"{key}: {shown(saved.get(key))} -> {shown(config.get(key))}"
                     for key in (*RESUME_KEYS, "precision") if saved.get(key) != config.get(key))


def settings_as_today(saved: dict) -> dict:
    """A run's recorded settings in today's flags, for reopening it: runs recorded what has
    changed since."""
    if saved.get("dataset") in POINT_DATASETS:  # --image-size, --data-dir: ignored for points, refused since
        saved = {**saved, "image_size": None, "data_dir": None}
    if "ema_decay" not in saved:  # runs from before --ema-decay kept no average
        saved = {**saved, "ema_decay": 0.0}
    if isinstance(saved.get("data_dir"), str) and not os.path.isabs(saved["data_dir"]):
        # older runs recorded it as typed: read against the working folder, as they were then
        saved = {**saved, "data_dir": flags.absolute(saved["data_dir"])}
    return saved


class _FolderLock:
    """An exclusive flock on a run folder, held while a RunFolder of this process holds it."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{path} is in use by another process (a run training or being evaluated there): "
                            "wait for it to end, or use another --out") from None
        except OSError as error:  # NFS without local locks (EBADF: it wants a file open for writing), Lustre
            os.close(fd)
            print(escaped_line_breaks(f"warning: {path} cannot be locked ({error.strerror}): a second run "
                                      "started in it at once would not be refused"), file=sys.stderr, flush=True)
            return
        weakref.finalize(self, os.close, fd)  # released with the last RunFolder that holds it, or at exit


# This process's locks, by folder: a second run in one process (a test, a resume after a refusal)
# shares the lock the first may still hold; another process is refused.
_FOLDER_LOCKS: weakref.WeakValueDictionary[str, _FolderLock] = weakref.WeakValueDictionary()


class RunFolder:
    def __init__(self, path: Path, writable: bool = True):
        self.path = Path(path)
        # False on the data-parallel replicas other than rank 0: they read (checkpoints to
        # resume from), and what they would write, rank 0 writes.
        self.writable = writable
        self.version_change = None  # under --resume: the libraries' versions, when they changed
        self.resumed_config = None  # under --resume: config.json to write once the checkpoint has loaded
        self._lock = None
        self.samples = self.path / "samples"
        self.checkpoints = self.path / "checkpoints"
        self.history_file = self.path / "history.jsonl"
        self.eval_samples = self.path / "eval_samples.npz"

    @classmethod
    def prepare(cls, cfg: RunConfig, precision: str, details: dict) -> "RunFolder":
        """Create (or, with --resume, reopen) the run folder; never clobber a run silently, nor
        share it with another process: two at once interleaved their history rows (both exit 0)."""
        run = cls(run_dir_for(cfg, precision))
        try:
            return run._prepare(cfg, {**json.loads(cfg.to_json()), "precision": precision, **details})
        except BaseException:
            run.unlock()  # now, not when the error's traceback lets the RunFolder go
            raise

    def _prepare(self, cfg: RunConfig, config: dict) -> "RunFolder":
        if self.path.is_dir():  # before anything in it is read
            self.lock()
        if cfg.resume:
            for folder in (self.samples, self.checkpoints):  # before anything is read or written
                if problem := not_a_folder(folder):
                    raise problem
            config = self._check_resumable(config)
        elif self.path.exists() and not self.path.is_dir():
            raise UsageError(f"--out {self.path} is not a folder; name a folder for the run")
        elif any(self.path.iterdir() if self.path.exists() else ()):
            # --overwrite replaces a run and nothing else: pointed at a folder of other files
            # (a typo, a parent folder), it would delete them.
            if self.read_config() is None:
                raise UsageError(f"{self.path} is not empty and holds no run (no config.json a run "
                                 "wrote): --overwrite only replaces a run; name a new or empty --out")
            if not cfg.overwrite and self.latest_checkpoint() is None:  # --resume could not continue it
                raise UsageError(f"{self.path} already holds a run with no checkpoint left (stopped before its "
                                 "first, or they were deleted): pass --overwrite to start it over, deleting its "
                                 "results, or --out for a new folder")
            if not cfg.overwrite and (changes := setting_changes(settings_as_today(self.read_config()), config)):
                raise UsageError(f"{self.path} already holds a run of other settings ({changes}): --out for a "
                                 "new folder, or --overwrite to start over, deleting its results")
            if not cfg.overwrite:
                raise UsageError(f"{self.path} already holds a run: pass --resume to continue it, "
                                 "--overwrite to start over, or --out for a new folder")
            self.clear()
        # config.json first: a run killed right after it is still known as a run. Under --resume
        # it waits until the checkpoint, history and noise have been read (write_resumed_config): a
        # resume refused for one of them would have left the command's flags (its --iters) on a
        # run that never ran them.
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileNotFoundError as error:  # a folder no file can go in (/proc/x): no path to create
            raise UsageError(f"cannot make the run folder {self.path} ({error.strerror}); choose another --out") \
                from None
        self.lock()
        if cfg.resume:
            self.resumed_config = config
        else:
            self.write_config(config)
        self.samples.mkdir(exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        return self

    def lock(self) -> None:
        if self._lock is None:
            key = os.path.realpath(self.path)
            self._lock = _FOLDER_LOCKS.get(key) or _FOLDER_LOCKS.setdefault(key, _FolderLock(key))

    def unlock(self) -> None:
        """Let the lock go (with no other RunFolder of this process holding it, it is released)."""
        self._lock = None

    def write_config(self, config: dict) -> None:
        atomic_write(self.path / "config.json",
                     lambda f: f.write(json.dumps(config, indent=2, sort_keys=True).encode()))

    def write_resumed_config(self, step: int, iters: int) -> None:
        """Under --resume, once the run's files have been read (its checkpoint is of `step`): the
        command's settings.
        A resume with nothing left to train (scripts/evaluate.py measuring a run) keeps the
        ones the training wrote: its --iters and the flags it was not given would replace the
        run's own, and compare.py --reuse or quality_table.py would then refuse or retrain it."""
        if self.writable and self.resumed_config is not None and step < iters:
            self.write_config(self.resumed_config)

    def read_config(self) -> dict | None:
        """The config.json a run of this repository wrote here, or None when there is none
        (missing, not a regular file, unreadable, or not a run's): what marks a run folder."""
        path = self.path / "config.json"
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        if (not isinstance(config, dict) or not isinstance(config.get("model"), str)
                or not isinstance(config.get("framework"), str) or config["model"] not in models.MODELS
                or config["framework"] not in models.FRAMEWORKS or "precision" not in config):
            return None
        return config

    def clear(self) -> None:
        """Delete what a run writes, keeping the folder itself (it may be a symlink to another
        disk, which rmtree refuses) and anything else in it: --overwrite replaces a run, not
        the data or notes a user keeps beside it."""
        kept = []
        for child in sorted(self.path.iterdir()):
            if not RUN_ENTRY.fullmatch(child.name):
                kept.append(child.name)
            elif child.name in FOLDER_ENTRY and child.is_dir() and not child.is_symlink():
                for entry in sorted(child.iterdir()):  # a file the user put there stays too
                    if FOLDER_ENTRY[child.name].fullmatch(entry.name) and not entry.is_dir():
                        entry.unlink()
                    else:
                        kept.append(f"{child.name}/{entry.name}")
                if not any(child.iterdir()):
                    child.rmdir()
            elif child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        if kept:
            print(f"--overwrite: kept {', '.join(kept)} in {self.path} (not written by a run)", flush=True)

    @classmethod
    def replica_view(cls, cfg: RunConfig, precision: str) -> "RunFolder":
        """The run folder rank 0 has prepared, as the other replicas see it: read-only."""
        return cls(run_dir_for(cfg, precision), writable=False)

    def _check_resumable(self, config: dict) -> dict:
        """The config to write, once the saved one is found to be of this run's settings."""
        saved_path = self.path / "config.json"
        if not saved_path.exists():
            if (before := self._default_folder_before(config)) is not None:
                raise CheckpointError(f"nothing to resume in {self.path}: no config.json; the run of "
                                      f"{config['dataset']} in {before} is in its default folder of before "
                                      f"(without -{config['dataset']}): --out {before}, or move it here")
            raise CheckpointError(f"nothing to resume in {self.path}: no config.json; "
                                  "start without --resume")
        check_regular_file(saved_path, "run settings")
        try:
            saved = json.loads(saved_path.read_text())
        except (OSError, ValueError, RecursionError) as error:
            raise CheckpointError(f"{saved_path} is unreadable ({first_line(error)})") from None
        if not isinstance(saved, dict):
            raise CheckpointError(f"{saved_path} is not a run's settings (a JSON {type(saved).__name__})")
        saved = settings_as_today(saved)
        if changes := setting_changes(saved, config):
            raise CheckpointError(f"--resume with other settings than the run in {self.path} "
                                  f"({changes}); use the run's settings or a new --out")
        # --init-from says where a run started: a resumed one goes on from its checkpoint and
        # keeps it (compare.py --reuse reads it), whether the command repeats it or leaves it out.
        if config.get("init_from") is None or same_path(config["init_from"], saved.get("init_from")):
            config = {**config, "init_from": saved.get("init_from")}
        else:
            raise UsageError(f"--resume with --init-from {config['init_from']}, but the run in {self.path} started "
                             f"from {saved.get('init_from') or 'its own initialisation'}: a resumed run goes on "
                             "from its checkpoint; leave --init-from out")
        if self.latest_checkpoint() is None:
            raise CheckpointError(f"nothing to resume in {self.path}: no checkpoint left (it stopped before its "
                                  "first, or they were deleted); start it over with --overwrite instead of "
                                  "--resume (it deletes the run's results), or use --out for a new run")
        return self._keep_earlier_versions(saved, config)

    def _default_folder_before(self, config: dict) -> Path | None:
        """Where this run's default folder was before a dataset other than MNIST had its name
        added (runs/<model>/<framework>-<precision>), if a run of this dataset is there."""
        suffix = f"-{config['dataset']}"
        if config.get("out") is not None or not self.path.name.endswith(suffix):
            return None
        before = self.path.with_name(self.path.name.removesuffix(suffix))
        saved = RunFolder(before).read_config()
        return before if saved is not None and saved.get("dataset") == config["dataset"] else None

    def _keep_earlier_versions(self, saved: dict, config: dict) -> dict:
        """The config to write on resume: a run resumed under other library versions keeps the
        ones it ran under before in "earlier_versions" (its bit-exact resume holds within one
        set of versions), and says so."""
        before, now = saved.get("versions"), config.get("versions")
        earlier = saved.get("earlier_versions")
        earlier = earlier if isinstance(earlier, list) else []
        if isinstance(before, dict) and isinstance(now, dict) and before != now:
            earlier = [*earlier, before]
            changes = ", ".join(f"{name} {before.get(name)} -> {version}" for name, version in now.items()
                                if before.get(name) != version)
            self.version_change = (f"warning: resumed under other library versions ({changes}): the steps from "
                                   "here may differ in the last bits from the same run without a pause")
        return {**config, "earlier_versions": earlier} if earlier else config

    # --- checkpoints -------------------------------------------------------------------
    def checkpoint_path(self, step: int, suffix: str) -> Path:
        return self.checkpoints / f"step_{step:06d}.{suffix}"

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """The checkpoints by step. A checkpoints/ that is a file or a dangling link (a disk not
        mounted) is an error, not a run with none: compare.py and quality_table.py would have
        started it over, deleting its results."""
        if problem := not_a_folder(self.checkpoints):
            raise problem
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
        # The whole line in one write(2) to a file opened O_APPEND, so a process killed at any
        # point leaves the row written or not (buffered text I/O may split it in two writes);
        # a full disk or a power cut can still cut it short, which read_history tolerates.
        line = (strict_json(row) + "\n").encode()
        try:  # never appended through a link (to a file outside the run)
            fd = os.open(self.history_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EMLINK):  # Linux and macOS, FreeBSD
                raise UserError(f"{self.history_file} is a link; a run's history is a file of its own: "
                                "remove the link") from None
            raise
        try:
            os.write(fd, line)
        except OSError as error:  # a bare descriptor's error names no file (a full disk)
            raise OSError(error.errno, error.strerror, str(self.history_file)) from None
        finally:
            os.close(fd)

    def read_history(self) -> list[dict]:
        """The logged rows, a loss that was inf/NaN (null in the file; bare NaN in one from
        before) as NaN. A last line cut short (a crash mid-append on an older version, a
        full disk) is dropped: the run resumes from its checkpoint anyway. Anything else that is
        not a row is one UserError line naming the file."""
        if not self.history_file.exists():
            return []
        check_regular_file(self.history_file, "history")
        try:
            text = self.history_file.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"{self.history_file} is unreadable ({type(error).__name__}); "
                            "delete it to start its history over") from None
        lines = text.splitlines()
        while lines and not lines[-1]:
            lines.pop()
        rows = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                if number == len(lines):  # the last line, cut short
                    break
                row = None
            if isinstance(row, dict):  # the counts (the step, skipped_at's steps) stay null: no row
                row = {key: value if key in ("step", "skipped_at") else null_as_nan(value)
                       for key, value in row.items()}
            if not _is_history_row(row):
                raise UserError(f"{self.history_file} line {number} is not a history row "
                                f"({line[:40]!r}); delete that line or the file")
            rows.append(row)
        return rows

    def truncate_history(self, last_step: int) -> None:
        """Drop rows logged after the checkpoint a resumed run restarts from (and a line cut
        short by a crash)."""
        if not self.writable:
            return
        rows = [row for row in self.read_history() if row["step"] <= last_step]
        atomic_write(self.history_file,
                     lambda f: f.write("".join(strict_json(r) + "\n" for r in rows).encode()))

    def write_summary(self, summary: dict) -> None:
        if not self.writable:
            return
        atomic_write(self.path / "summary.json",
                     lambda f: f.write(strict_json(summary, indent=2, sort_keys=True).encode()))

    def write_eval_samples(self, samples: np.ndarray, step: int, seed: int) -> Path:
        """--save-samples: the evaluation's samples as other tools read them, images as the
        uint8 NHWC pixels a PNG of them holds, 2-D points as float32; with the step and seed
        they came from (the noise is common/evaluation.py's evaluation_noise of that seed)."""
        if samples.ndim == 4:
            samples = np.round(np.clip(samples, 0.0, 1.0) * 255).astype(np.uint8)
        else:
            samples = samples.astype(np.float32)
        atomic_write(self.eval_samples,
                     lambda f: np.savez_compressed(f, samples=samples, step=np.int64(step), seed=np.int64(seed)))
        return self.eval_samples

    def read_finished(self, hint: str = "") -> tuple[dict, dict]:
        """config.json and summary.json of a finished run (its framework, precision and step);
        one UserError line, ending in `hint` (what to do), otherwise."""
        if (self.path.exists() or self.path.is_symlink()) and not self.path.is_dir():  # its config.json, say
            raise UserError(f"{self.path} is not a folder: name the run's folder")
        for name in ("config.json", "summary.json"):
            if not (self.path / name).exists():
                raise UserError(f"{self.path} is not a finished run (no {name})")
        config = read_json(self.path / "config.json", ("framework", "precision"), hint)
        summary = read_json(self.path / "summary.json", ("step",), hint)
        return config, summary

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
        host loader prefetches (the resident path splits the same permutations itself, common/loop.py's Batches)."""
        epoch, permutation = None, None
        for step in range(start_step, stop_step):
            batch_epoch, offset = self.locate(step)
            if batch_epoch != epoch:
                epoch, permutation = batch_epoch, self.permutation(batch_epoch)
            yield permutation[offset:offset + self.batch_size]

    def permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, BATCH_STREAM, epoch])
        return rng.permutation(self.num_examples).astype(np.int32)
