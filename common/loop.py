"""The training loop, written once for both frameworks.

It drives a `Session` (the contract below; common/pytorch/session.py and
common/tensorflow/session.py fulfil it) through the iterations of a run: the batch order,
reading the losses every --log-every steps, sample grids and checkpoints, what goes to
TensorBoard (common/tensorboard.py), the profiled window, resume, Ctrl-C, and the summary. It
imports no framework.
"""
from __future__ import annotations

import contextlib
import math
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from common import cpu, porting, sampling
from common.config import SCALE_WARN_WINDOW, RunConfig
from common.distributed import OneProcess, Replicas, check_same_checkpoint, check_same_start
from common.errors import CheckpointError, Interrupted, UserError, escaped_line_breaks
from common.precision_report import LayerRow, format_precision_report
from common.profiling import PROFILED_STEPS, WARMUP_STEPS, Profiler, format_top_ops
from common.runs import BatchOrder, Checkpoints, RunFolder, atomic_write, profile_folder_problem, read_json, text_bytes
from common.tensorboard import Board, Writer


class Session(Protocol):
    """Everything the loop touches of a framework. Device values (indices, metrics) are the
    framework's tensors; the loop only passes them back to the session."""

    precision: str            # "fp32" | "amp-fp16" | "amp-bf16"
    checkpoints: Checkpoints  # the training state in one file per checkpoint
    profiler: Profiler        # --profile's window
    replicas: Replicas        # data-parallel replicas (common/distributed.py); one by default
    noise_shape: tuple[int, int]  # the fixed noise's (rows, width): what fixed_noise.npy holds

    def start(self, order: BatchOrder, start_step: int, stop_step: int) -> None:
        """Before the first step: a host loader starts gathering batches in this order."""

    def stop_loading(self) -> None:
        """After the last step, a stop or an error: a host loader's workers end (PyTorch's
        processes hold the run folder's lock too, inherited)."""

    def upload_batches(self, batches: np.ndarray) -> Sequence[Any]:
        """One epoch's batches of example indices (steps x batch size) onto the device at
        once, as one tensor per step: a step picks its own by position, no device op."""

    def train_step(self, indices: Any) -> dict[str, Any]:
        """One iteration on the examples at `indices`; returns its metrics as device scalars,
        with "skipped" (1.0 when a loss scaler skipped the update) when the loss is scaled."""

    def fetch(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Device scalars to floats, averaged over the replicas: the only host<->device sync
        of the hot path."""

    def stop_signal(self, signum: int) -> int:
        """The stop signal any replica has received (0: none), agreed by all of them."""

    def loss_scale(self) -> float:
        """The current loss scale (1.0 when nothing is scaled)."""

    def synchronize(self) -> None:
        """Wait for queued device work, so a clock reading covers it."""

    def write_samples(self, run: RunFolder, step: int) -> None: ...

    def peak_memory_mb(self) -> float: ...

    def gpu_name(self) -> str | None:
        """The name of the GPU the run trains on (the first, with several), None on the CPU."""

    def precision_report(self, indices: Any) -> list[LayerRow]:
        """Per layer, the dtype of its weights and of its output in a real training step
        (which leaves the training as it was)."""

    def evaluate(self, cfg: RunConfig, keep: Callable[[Any], None] | None = None) -> dict:
        """Quality metrics of the trained model (--evaluate N); `keep(samples)` is handed the
        samples they were measured on (common/evaluation.py's evaluate)."""

    def open_tensorboard(self, folder: Path, purge_step: int) -> Writer:
        """The framework's TensorBoard writer on the run folder (common/tensorboard.py)."""


class TrainingDiverged(UserError):
    """The losses stayed inf/NaN for --nonfinite-patience steps."""


class StopRequest:
    """First Ctrl-C (or SIGTERM, as a scheduler or `kill` sends): finish the current step,
    checkpoint, exit. A second one: stop at once. One that follows the first within
    RELAY_WINDOW_S is the same request relayed (torchrun passes on the Ctrl-C the terminal has
    already delivered to every replica), not a second one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    RELAY_WINDOW_S = 2.0

    def __init__(self):
        self.requested = None  # the signal number once one arrived
        self._at = None
        self._previous = {}

    def __enter__(self):
        try:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        except ValueError:  # not the main thread: leave the default behaviour
            self._previous = {}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self._at < self.RELAY_WINDOW_S:
                return
            raise KeyboardInterrupt
        self.requested, self._at = signum, time.monotonic()
        again = "Ctrl-C again" if signum == signal.SIGINT else "another signal"
        sys.stderr.write(f"\n{signal.Signals(signum).name}: finishing this step and saving a "
                         f"checkpoint ({again} to quit at once)\n")

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        return False


def finite(row: dict) -> bool:
    """A step's losses are all finite ("skipped", a loss scaler's flag, is no loss)."""
    return all(math.isfinite(v) for key, v in row.items() if key != "skipped")


class Monitor:
    """Reads the per-step values of each log interval: which steps a loss scaler skipped,
    how long the losses have been inf/NaN (a run that stays so is stopped), and how long the
    float16 loss scale has stayed below --min-loss-scale (warned about once)."""

    def __init__(self, cfg: RunConfig, log):
        self.cfg, self.log = cfg, log
        self.nonfinite_streak, self.nonfinite_since = 0, None
        self.low_scale_since, self.warned = None, False
        self.withheld_checkpoint = False

    def resume(self, step: int, nonfinite_streak: int) -> None:
        """The inf/NaN streak a checkpoint recorded, which ends at its step: --nonfinite-patience
        counts the steps before a stop and a --resume together."""
        self.nonfinite_streak = nonfinite_streak
        self.nonfinite_since = step - nonfinite_streak + 1 if nonfinite_streak else None

    def streak_after(self, rows: list[dict]) -> int:
        """The inf/NaN streak once `rows`, the steps after the observed ones, are counted too."""
        streak = self.nonfinite_streak
        for row in rows:
            streak = 0 if finite(row) else streak + 1
        return streak

    def observe(self, first_step: int, rows: list[dict], loss_scale: float) -> dict:
        """`rows[i]` holds the values of step first_step + i; returns the history fields."""
        fields = {}
        skipped_at = [first_step + i for i, row in enumerate(rows) if row.get("skipped", 0) > 0.5]
        if skipped_at:
            fields["skipped_at"] = skipped_at
        nonfinite = 0
        for i, row in enumerate(rows):
            if finite(row):
                self.nonfinite_streak = 0
                continue
            nonfinite += 1
            if self.nonfinite_streak == 0:
                self.nonfinite_since = first_step + i
            self.nonfinite_streak += 1
        if nonfinite:
            fields["nonfinite_steps"] = nonfinite

        scaling = "skipped" in rows[0]  # only a float16 run scales its loss
        last_step = first_step + len(rows) - 1
        if scaling and loss_scale < self.cfg.min_loss_scale:
            self.low_scale_since = first_step if self.low_scale_since is None else self.low_scale_since
            if not self.warned and last_step - self.low_scale_since + 1 >= SCALE_WARN_WINDOW:
                self.warned = True
                self.log(f"warning: the loss scale has stayed below {self.cfg.min_loss_scale:g} for "
                         f"{last_step - self.low_scale_since + 1} steps (now {loss_scale:g}): float16 "
                         f"gradients keep overflowing: {divergence_remedies('amp-fp16')}")
        else:
            self.low_scale_since = None
        return fields

    @property
    def diverged(self) -> bool:
        return self.nonfinite_streak >= self.cfg.nonfinite_patience

    def checkpoint_withheld(self, step: int, where: str) -> None:
        """Said once: the state of a run whose losses stay finite can hold inf/NaN too (batch-norm
        statistics after one float16 overflow), and its checkpoints would stop without a word."""
        if not self.withheld_checkpoint:
            self.withheld_checkpoint = True
            self.log(f"warning: the state at step {step} holds inf/NaN in {where}: no checkpoint is written "
                     "until it is finite again, but at the last step; the last good one stays for --resume")


# --- the parts of a run -------------------------------------------------------------------

def open_run(cfg: RunConfig, precision: str, details: dict, networks: dict, export_weights, import_weights,
             sample_shape: tuple, replicas: Replicas = OneProcess(), log=print) -> RunFolder:
    """The run folder to train in (reopened under --resume). A fresh run first loads
    --init-from's weights into `networks` (`import_weights(network, layers)`), then saves its
    initial weights there in the layout both frameworks read (`export_weights(network)`).
    Data parallel: every replica loads --init-from; rank 0 prepares the folder while the
    others wait, and they see it read-only."""
    if cfg.init_from and not cfg.resume:
        source = porting.start_from(cfg.init_from, cfg.model, networks, import_weights, sample_shape)
        check_same_start(source, replicas)
        log(f"initial weights from {source}")

    def prepare() -> RunFolder:
        run = RunFolder.prepare(cfg, precision, details)
        log(f"run folder: {run.path}")
        if run.version_change:
            log(run.version_change)
        if cfg.resume:
            try:
                porting.check_resumed_data(run.path, sample_shape)
            except UserError:
                run.unlock()  # now, as RunFolder.prepare's own refusals do
                raise
        else:
            porting.save_initial_weights(
                run.path, {name: export_weights(network) for name, network in networks.items()},
                {"model": cfg.model, "framework": cfg.framework, "seed": cfg.seed,
                 "sample_shape": list(sample_shape)})
        return run

    run = replicas.writer_first(prepare)
    return run if replicas.writer else RunFolder.replica_view(cfg, precision)


def resume(cfg: RunConfig, run: RunFolder, session: Session, monitor: Monitor, log) -> tuple[int, int]:
    """(step, skipped steps so far) to start from: the latest checkpoint under --resume,
    with the history rows logged after it dropped and its inf/NaN streak back in `monitor`;
    else (0, 0)."""
    if not cfg.resume:
        return 0, 0
    latest = run.latest_checkpoint()  # None: only a replica's own --out can hold none (the writer's was checked)
    check_same_checkpoint(latest, session.replicas)
    named_step, path = latest
    meta = session.checkpoints.restore(path, cfg.model)  # of another model: refused by name
    # The file's name picks it as the latest: a step inside it that says otherwise (an edited
    # or misplaced file) would truncate the history, or skip training, at the wrong step.
    if meta["step"] != named_step:
        raise CheckpointError(f"checkpoint {path} holds step {meta['step']}, not the step its name "
                              "says; delete it to resume from the one before")
    # Evaluating a run whose last steps went NaN is allowed (its samples say so); training on is not.
    if meta.get("nonfinite") and meta["step"] < cfg.iters:
        raise CheckpointError(f"checkpoint {path} holds inf/NaN in {meta['nonfinite']}: training on from it "
                              "cannot recover; delete it to resume from the one before")
    streak = meta.get("nonfinite_streak", 0)  # older checkpoints record none
    if streak > meta["step"]:  # a count (checkpoints.restore checked it), of the steps so far at most
        raise CheckpointError(f"checkpoint {path} has no valid nonfinite_streak (found {streak!r}); "
                              "delete it to resume from the one before")
    monitor.resume(meta["step"], streak)
    run.truncate_history(meta["step"])
    log(f"resumed from {path} at step {meta['step']}")
    if "warning" in meta:  # either framework's, naming the checkpoint: one line whatever the path holds
        log(escaped_line_breaks(meta["warning"]))
    if meta["step"] >= cfg.iters:
        log(f"nothing to do: the run is at step {meta['step']} and --iters is {cfg.iters}")
    return meta["step"], meta.get("skipped_total", 0)


class Batches:
    """The indices of each step's batch, on the device: the epoch's permutation goes up once,
    already split into its batches. (Sliced at each step, TensorFlow's eager slice took 0.15 ms,
    about 2% of its vanilla GAN's 8 ms step on 2-D points, 2-core Xeon: inside that step
    time's run-to-run spread, but work done once where it can be.)"""

    def __init__(self, order: BatchOrder, session: Session):
        self.order, self.session = order, session
        self.epoch, self.batches = None, None

    def indices(self, step: int):
        epoch, offset = self.order.locate(step)
        if epoch != self.epoch:
            size, steps = self.order.batch_size, self.order.steps_per_epoch
            permutation = self.order.permutation(epoch)[:steps * size]  # the short last batch left out
            self.epoch, self.batches = epoch, self.session.upload_batches(permutation.reshape(steps, size))
        return self.batches[offset // self.order.batch_size]


class StepClock:
    """Wall time per training step: what passes between restarts, less the time spent in
    outputs (samples, checkpoints, the profiler's table). A pause first waits for the device
    work queued before it; a reading comes after the interval's fetch, which waits too."""

    def __init__(self, session: Session):
        self.session = session
        self.restart()

    def restart(self):
        self.started, self.excluded = time.perf_counter(), 0.0
        self.warm = None

    def mark_warm(self):
        """After a process's first step (tracing, compiling, allocator warm-up): the first
        interval's steady rate is read from here, for a run too short for a second interval."""
        self.session.synchronize()
        self.warm = (time.perf_counter(), self.excluded)

    @contextlib.contextmanager
    def paused(self):
        self.session.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - started

    def ms_per_step(self, steps: int) -> float:
        return 1000.0 * (time.perf_counter() - self.started - self.excluded) / steps

    def ms_per_step_since_warm(self, steps: int) -> float | None:
        if self.warm is None or steps < 1:
            return None
        started, excluded_before = self.warm
        return 1000.0 * (time.perf_counter() - started - (self.excluded - excluded_before)) / steps


class Progress:
    """A tqdm bar on a terminal; else (a log file, CI) a plain line about ten times a run."""

    def __init__(self, cfg: RunConfig, start_step: int, log, shown: bool = True):
        self.cfg, self.log = cfg, log
        # disable=None: a bar on a terminal only; none on the replicas that do not write, nor
        # where stderr is closed (`2>&-`: tqdm failed on it)
        shown = shown and sys.stderr is not None
        self.bar = tqdm(total=cfg.iters, initial=start_step, disable=None if shown else True, dynamic_ncols=True,
                        desc=f"{cfg.model} {cfg.framework}", leave=True)
        # a multiple of the rows' interval: max(log_every, iters // 10) met a row only at their
        # common multiples (--iters 1234 --log-every 100: one line, at the end)
        self.quiet_every = cfg.log_every * max(1, round(cfg.iters / 10 / cfg.log_every))

    def show(self, row: dict, means: dict, finishing: bool):
        step, scale = row["step"], row["loss_scale"]
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in means.items()} | {"scale": f"{scale:g}"}, refresh=False)
        self.bar.update(step - self.bar.n)
        if self.bar.disable and (step % self.quiet_every == 0 or finishing):
            shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items())
            self.log(f"step {step:>7}/{self.cfg.iters}  {shown}  scale {scale:g}"
                     f"  skipped {row['skipped_total']}  {row['step_ms']:.2f} ms/step")

    def close(self):
        self.bar.close()


class IntervalLog:
    """The per-step metrics of one log interval, kept on the device until the interval
    closes; then one sync reads them all, and the interval becomes a history row (with the
    monitor's findings), TensorBoard scalars and a progress line."""

    def __init__(self, cfg: RunConfig, run: RunFolder, session: Session, clock: StepClock,
                 progress: Progress, board: Board, skipped_total: int, monitor: Monitor):
        self.cfg, self.run, self.session, self.clock, self.progress = cfg, run, session, clock, progress
        self.board = board
        self.skipped_total = skipped_total
        self.monitor = monitor
        self.steps: list[dict] = []  # still on the device
        self.step_ms: list[float] = []  # one per closed interval
        self.warm_step_ms = None  # the first interval's, less the process's first step
        self.last_row: dict = {}

    def add(self, metrics: dict):
        self.steps.append(metrics)

    def due(self, step: int, finishing: bool) -> bool:
        return step % self.cfg.log_every == 0 or finishing

    def close(self, step: int, finishing: bool):
        rows = self.read_steps()
        step_ms = self.clock.ms_per_step(len(rows))
        if not self.step_ms:
            self.warm_step_ms = self.clock.ms_per_step_since_warm(len(rows) - 1)
        self.step_ms.append(step_ms)
        means = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
        skipped = int(round(means.pop("skipped", 0.0) * len(rows)))
        self.skipped_total += skipped
        loss_scale = self.session.loss_scale()
        self.last_row = {"step": step, **means, "loss_scale": loss_scale, "skipped": skipped,
                         "skipped_total": self.skipped_total, "step_ms": step_ms,
                         **self.monitor.observe(step - len(rows) + 1, rows, loss_scale)}
        self.run.append_history(self.last_row)
        self.board.interval(self.last_row, means)
        self.progress.show(self.last_row, means, finishing)
        self.steps = []
        self.clock.restart()

    def so_far(self) -> tuple[int, int]:
        """The skipped steps and the inf/NaN streak up to now, the open interval's steps too:
        a checkpoint between two log steps records them, or a resume from it would lose them."""
        rows = self.read_steps() if self.steps else []
        skipped = int(round(sum(row.get("skipped", 0.0) for row in rows)))
        return self.skipped_total + skipped, self.monitor.streak_after(rows)

    def read_steps(self) -> list[dict]:
        """Every step's device scalars of the interval, read in one host<->device sync."""
        flat = self.session.fetch({f"{i}/{key}": value for i, row in enumerate(self.steps)
                                   for key, value in row.items()})
        values = [{} for _ in self.steps]
        for name, value in flat.items():
            index, key = name.split("/", 1)
            values[int(index)][key] = value
        return values

    @property
    def diverged(self) -> bool:
        return self.monitor.diverged

    def median_step_ms(self) -> float | None:
        """The median over the process's intervals but its first, which includes graph tracing
        and allocator warm-up; with one interval (a short run, a resume near the end), that
        interval's steps after the first (None for a one-step process: no steady figure)."""
        if len(self.step_ms) > 1:
            return statistics.median(self.step_ms[1:])
        return self.warm_step_ms


class ProfileWindow:
    """--profile: PROFILED_STEPS steps, WARMUP_STEPS after the start, traced by the
    framework's profiler; the top operations are printed and saved as profile/top_ops.txt.
    Used as a context around the loop: a run that ends inside the window (at its last step,
    on a Ctrl-C or a divergence) reports the steps it profiled, and one that ends on an error
    stops the profiler (left running, it crashed PyTorch at exit)."""

    def __init__(self, cfg: RunConfig, run: RunFolder, session: Session, clock: StepClock, start_step: int, log):
        self.run, self.session, self.clock, self.log = run, session, clock, log
        self.first = start_step + WARMUP_STEPS if cfg.profile and run.writable else None
        self.step, self.running = start_step, False
        if self.first is not None and self.first >= cfg.iters:
            if start_step < cfg.iters:  # a resume with nothing to train has nothing to profile
                log(f"--profile: nothing profiled: {cfg.iters - start_step} steps to go, and the window "
                    f"starts {WARMUP_STEPS} steps in (tracing, warm-up); --iters "
                    f"{self.first + PROFILED_STEPS} profiles all of it")
            self.first = None
        # now, not when the window ends: its steps since the last checkpoint were lost with it
        if self.first is not None and (problem := profile_folder_problem(run.path / "profile")):
            raise problem

    def before(self, step: int):
        if step == self.first:
            self.session.profiler.start(self.run.path / "profile")
            self.running = True

    def after(self, step: int):
        self.step = step
        if self.running and step == self.first + PROFILED_STEPS:
            self.finish()

    def finish(self):
        """Stop the profiler and report the steps since the window's first; nothing when it
        is not running."""
        if not self.running:
            return
        self.running = False
        with self.clock.paused():
            folder = self.run.path / "profile"
            operations, trace = self.session.profiler.stop(folder)
            table = format_top_ops(operations, self.step - self.first, self.session.profiler.clock)
            atomic_write(folder / "top_ops.txt", lambda file: file.write(text_bytes(table + "\n")), durable=False)
            self.log(f"{table}\nprofile: {trace}")

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        if error_type is None:
            self.finish()
        elif self.running:
            self.running = False
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                self.session.profiler.stop(self.run.path / "profile")


def write_outputs(cfg: RunConfig, run: RunFolder, session: Session, board: Board, step: int,
                  log_interval: IntervalLog, finishing: bool, clock: StepClock):
    """Checkpoints every --checkpoint-every (the last two kept), sample grids (also to
    TensorBoard) every --sample-every steps, and both at the last step. A state whose weights
    or optimizer have gone inf/NaN is checkpointed only at the last step (evaluate.py measures
    it; --resume refuses to train on from it): before, it would have pruned the good
    checkpoints --resume needs after a divergence (stop_diverged). A grid that cannot be
    written costs no training while a checkpoint still can be: the checkpoint comes first, and
    a grid between two checkpoints that fails is followed by one of its step before its error
    ends the run; --resume draws the grid. (On a full disk that checkpoint usually fails too.)"""
    wants_samples = finishing or (cfg.sample_every and step % cfg.sample_every == 0)
    wants_checkpoint = finishing or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
    if not (wants_samples or wants_checkpoint):
        return
    # Read on every replica, before rank 0 goes on alone: under torchrun the read is an all-reduce.
    skipped_total, nonfinite_streak = log_interval.so_far()
    if not run.writable:
        return

    def save_checkpoint():
        withheld = None if finishing else session.checkpoints.nonfinite()
        if withheld:
            log_interval.monitor.checkpoint_withheld(step, withheld)
            return
        session.checkpoints.save(run.checkpoint_path(step, session.checkpoints.suffix),
                                 {"step": step, "skipped_total": skipped_total,
                                  "nonfinite_streak": nonfinite_streak, "model": cfg.model})
        run.prune_checkpoints()

    with clock.paused():
        if wants_checkpoint:
            save_checkpoint()
        if wants_samples:
            try:
                session.write_samples(run, step)
            except OSError as grid_error:
                if not wants_checkpoint:
                    try:
                        # the steps since the last row, in the history (its read is an all-reduce
                        # under torchrun, where rank 0 is alone here)
                        if log_interval.steps and session.replicas.count == 1:
                            log_interval.close(step, finishing=True)
                        save_checkpoint()
                    except OSError:
                        raise grid_error from None  # the grid's error names the cause, not a temp file
                raise
            board.samples(step)


def summarize(cfg: RunConfig, session: Session, step: int, log_interval: IntervalLog,
              stopped_early: bool, start_step: int) -> dict:
    median_ms = log_interval.median_step_ms()
    return {
        "model": cfg.model, "framework": cfg.framework, "step": step, "iters": cfg.iters,
        "batch_size": cfg.batch_size, "median_step_ms": median_ms,
        "samples_per_s": cfg.batch_size * 1000.0 / median_ms if median_ms else None,
        # the timing and the peak memory are this process's: a resumed run's since it resumed
        "timed_from_step": start_step,
        "peak_memory_mb": session.peak_memory_mb(), "skipped_steps": log_interval.skipped_total,
        "final": final_figures(log_interval.last_row),
        "replicas": session.replicas.count,
        "cpu": cpu.describe(),  # the timings', and a seed's bit-exact results, hold on this kind of CPU
        "gpu": session.gpu_name(),  # on CUDA the timings hold on this GPU (results are not bit-exact there)
        "stopped_early": stopped_early,
    }


def final_figures(row: dict) -> dict:
    """A summary's "final": the last history row's losses and counts, without its place and timing."""
    return {k: v for k, v in row.items() if k not in ("step", "step_ms", "skipped_at")}


def history_figures(rows: list[dict], step: int, batch_size: int) -> dict:
    """A summary's training figures as the run's history recorded them, for a summary written
    again (none, or damaged) by a process that trained nothing, whose own figures are no
    training's (a DCGAN's: final losses {}, no step time, peak memory 374 MB against 422): the
    losses of the row at `step`, the median step time of the intervals but the first (a
    resume's first, with its warm-up, counts too), and no peak memory, nor the machine and
    replicas the steps were timed on (the history records none of them)."""
    rows = [row for row in rows if row.get("step", 0) <= step]
    last = rows[-1] if rows and rows[-1].get("step") == step else {}
    times = [row["step_ms"] for row in rows[1:] if isinstance(row.get("step_ms"), (int, float))
             and math.isfinite(row["step_ms"])]
    median_ms = statistics.median(times) if times else None
    return {"final": final_figures(last),
            "median_step_ms": median_ms, "samples_per_s": batch_size * 1000.0 / median_ms if median_ms else None,
            "timed_from_step": 0, "peak_memory_mb": None, "cpu": None, "gpu": None, "replicas": None}


def evaluate_command(cfg: RunConfig, run: RunFolder) -> str:
    """scripts/evaluate.py measuring `run` as its --evaluate, --eval-draws and --save-samples asked."""
    from common.evaluation import iwae_flags

    draws = ["--draws", str(cfg.eval_draws)] if cfg.eval_draws > 1 else []
    return shlex.join(["python", "scripts/evaluate.py", str(run.path), "--samples", str(cfg.evaluate),
                       *iwae_flags(cfg.model, cfg.iwae_k), *draws, *(["--save-samples"] if cfg.save_samples else [])])


def new_run_remedies(precision: str) -> str:
    """What may keep the losses finite but --resume refuses: it keeps the learning rate
    (config.RESUME_KEYS) and the precision (RunFolder checks it), and so diverges again, bit for
    bit; --clip-grad-norm it takes."""
    return "a lower --lr" + (" or --amp-dtype bfloat16" if precision == "amp-fp16" else "")


def divergence_remedies(precision: str) -> str:
    return (f"--clip-grad-norm N, which --resume takes, or {new_run_remedies(precision)} in a new run "
            "(another --out, or --overwrite)")


def stop_diverged(cfg: RunConfig, run: RunFolder, session: Session, step: int, log_interval: IntervalLog,
                  start_step: int):
    """Save the state the losses went inf/NaN in (under a name --resume does not pick), write
    the summary, and end the run with one line."""
    monitor = log_interval.monitor
    path = run.checkpoints / f"diverged_step_{step:06d}.{session.checkpoints.suffix}"
    if run.writable:
        session.checkpoints.save(path, {"step": step, "skipped_total": log_interval.skipped_total,
                                        "nonfinite_streak": monitor.nonfinite_streak, "model": cfg.model})
    summary = summarize(cfg, session, step, log_interval, stopped_early=False, start_step=start_step)
    run.write_summary({**summary, "stopped": f"losses inf/NaN since step {monitor.nonfinite_since}"})
    good = run.latest_checkpoint()
    new_run = new_run_remedies(session.precision)
    advice = (f"--resume --clip-grad-norm N continues from the last good checkpoint (step {good[0]}); "
              f"{new_run} needs a new run (another --out, or --overwrite)" if good
              else f"no earlier checkpoint to resume from: train again (--overwrite) with {new_run} "
                   "or --clip-grad-norm N")
    raise TrainingDiverged(
        f"the losses have been inf/NaN since step {monitor.nonfinite_since} "
        f"({monitor.nonfinite_streak} steps): stopped at step {step}, state saved in {path}; {advice}",
        quiet=not run.writable)  # data parallel: rank 0 says it


# --- the run --------------------------------------------------------------------------------

def train(cfg: RunConfig, run: RunFolder, session: Session, num_examples: int, log=print) -> dict:
    """Run iterations until cfg.iters (or a Ctrl-C); return the summary written to the run."""
    monitor = Monitor(cfg, log)
    start_step, skipped_total = resume(cfg, run, session, monitor, log)
    board = Board(cfg, run, session.open_tensorboard, start_step, log, enabled=run.writable)
    try:
        return train_from(cfg, run, session, num_examples, board, start_step, skipped_total, monitor, log)
    finally:
        session.stop_loading()
        board.close()  # the last events reach the file after a Ctrl-C, a divergence or an error too
        run.unlock()


def train_from(cfg: RunConfig, run: RunFolder, session: Session, num_examples: int, board: Board,
               start_step: int, skipped_total: int, monitor: Monitor, log) -> dict:
    order = BatchOrder(num_examples, cfg.batch_size, cfg.seed)
    batches = Batches(order, session)
    clock, progress = StepClock(session), Progress(cfg, start_step, log, shown=run.writable)
    log_interval = IntervalLog(cfg, run, session, clock, progress, board, skipped_total, monitor)
    profile = ProfileWindow(cfg, run, session, clock, start_step, log)

    if run.writable:
        sampling.check_fixed_noise(run.path, *session.noise_shape)  # now, not at the first grid, steps later
        run.write_resumed_config(start_step, cfg.iters)  # a resume found sound: the command's settings
    if start_step == 0 and cfg.sample_every and run.writable:
        session.write_samples(run, 0)  # the starting point: equal in both frameworks under --init-from
        board.samples(0)
    elif (run.writable and (start_step == cfg.iters or (cfg.sample_every and start_step % cfg.sample_every == 0))
          and not run.sample_path(start_step).exists()):
        session.write_samples(run, start_step)  # a grid that failed after its step's checkpoint
        board.samples(start_step)
    session.start(order, start_step, cfg.iters)
    session.synchronize()
    clock.restart()
    step, stopped_early, diverged = start_step, False, False
    with StopRequest() as stop, profile:
        while step < cfg.iters:
            profile.before(step)
            indices = batches.indices(step)
            if cfg.precision_report and step == start_step:
                log(format_precision_report(session.precision_report(indices), session.precision))
            log_interval.add(session.train_step(indices))
            if step == start_step:
                clock.mark_warm()
            step += 1
            profile.after(step)
            stop_signal = session.stop_signal(stop.requested or 0)  # the same on every replica
            finishing = step == cfg.iters or bool(stop_signal)
            if log_interval.due(step, finishing):
                log_interval.close(step, finishing)
                if log_interval.diverged:
                    diverged = True
                    break
            write_outputs(cfg, run, session, board, step, log_interval, finishing, clock)
            # `finishing`, not stop.requested: a signal that arrives after it was read (during
            # the outputs above) stops the loop one step later, with that step checkpointed.
            if finishing and step < cfg.iters:
                stopped_early = True
                break
    progress.close()

    if diverged:
        try:
            stop_diverged(cfg, run, session, step, log_interval, start_step)
        finally:
            session.replicas.wait_for_writer()
    # said by the process that trained (a resume with nothing to train, as evaluate.py's, is silent)
    if monitor.nonfinite_streak and step > start_step and run.writable:
        advice = divergence_remedies(session.precision)
        if stopped_early:  # its checkpoint records the streak
            log(f"warning: the losses have been inf/NaN since step {monitor.nonfinite_since} "
                f"({monitor.nonfinite_streak} steps; --resume counts on toward --nonfinite-patience "
                f"{cfg.nonfinite_patience}): {advice}")
        else:  # inf/NaN for too few steps to stop it
            log(f"warning: the run ends with its losses inf/NaN since step {monitor.nonfinite_since} "
                f"({monitor.nonfinite_streak} steps, fewer than --nonfinite-patience {cfg.nonfinite_patience}, "
                f"which would have stopped it): {advice}")
    summary = summarize(cfg, session, step, log_interval, stopped_early, start_step)
    if step == start_step:  # nothing trained in this process (say, evaluating a finished run)
        try:
            previous = read_json(run.path / "summary.json")
        except UserError:  # none, or damaged
            previous = {}
        if previous.get("step") == step:  # the figures of the process that trained up to here
            # and whether it stopped before its --iters: evaluating a run stopped with Ctrl-C
            # measures it where it stands, and it stays unfinished (quality_table.py skips it)
            summary = dict(previous)
        else:  # what the history kept of the training: this process's own figures are no training's
            summary.update(history_figures(run.read_history(), step, cfg.batch_size))
    # The training's figures are written, and the other replicas let go, before the evaluation:
    # it is the writer's alone, and one that outlasted the replicas' wait (10 minutes) ended
    # the run without a summary; one that fails leaves the training's.
    run.write_summary(summary)
    session.replicas.wait_for_writer()
    if stopped_early:
        log(f"stopped at step {step}, checkpoint saved; continue with the same command and --resume")
        sys.exit(128 + stop_signal)  # the shell's status for that signal: 130 for Ctrl-C
    if cfg.evaluate and run.writable:
        def keep(samples):
            log(f"evaluation samples in {run.write_eval_samples(samples, step, cfg.seed)}")
        if cfg.save_samples:  # an earlier evaluation's, which samples with inf/NaN would leave behind
            run.eval_samples.unlink(missing_ok=True)
        try:
            summary["metrics"] = session.evaluate(cfg, keep if cfg.save_samples else None)
        except KeyboardInterrupt:
            if step == start_step:  # nothing trained here (evaluate.py's child): its caller says what to do
                raise
            raise Interrupted(f"interrupted while evaluating; the run is saved at step {step}: "
                              f"{evaluate_command(cfg, run)} measures it") from None
        summary.pop("metrics_over_draws", None)  # an earlier evaluation's
        if "draws" in summary["metrics"]:  # --eval-draws: each draw's figures
            summary["metrics_over_draws"] = summary["metrics"].pop("draws")
        board.metrics(summary["metrics"], step)
        run.write_summary(summary)
    if log_interval.step_ms:  # this process trained: the figures are its own
        speed = ("no steady step time (one step)" if summary["median_step_ms"] is None else
                 f"median {summary['median_step_ms']:.2f} ms/step ({summary['samples_per_s']:.0f} samples/s)")
        log(f"done: step {step}, {speed}, peak memory "
            f"{summary['peak_memory_mb']:.0f} MB, {summary['skipped_steps']} skipped steps; "
            f"samples in {run.samples}")
    return summary
