"""The training loop, written once for both frameworks.

A framework backend hands in a `session` with these methods (see torch_backend/tf_backend):

    upload_indices(np.ndarray) -> device tensor     once per epoch, not per step
    train_step(batch_indices) -> dict of device scalars (summed between log points)
    fetch(metrics) -> dict of floats                the only host<->device sync on the hot path
    loss_scale() -> float; synchronize()
    write_samples(run, step); save_checkpoint(path, meta); restore(path) -> meta
    peak_memory_mb() -> float; profile_start(dir)
    profile_stop(dir) -> (rows, trace)              rows: (operation, calls, self ms) in the window
    precision_report(first_indices) -> rows        (--precision-report) before the first step
    evaluate(cfg) -> dict                           quality metrics (--evaluate N), at the end
    start(order, start_step, stop_step)             (optional) before the first step: host loaders
"""
from __future__ import annotations

import math
import signal
import statistics
import sys
import time

from tqdm.auto import tqdm

from common.config import SCALE_WARN_WINDOW, RunConfig
from common.errors import UserError
from common.runs import BatchOrder, RunFolder

PROFILE_WARMUP = 5  # steps after the start before the profiled window (tracing, allocator)
PROFILE_STEPS = 10
TOP_OPS = 15  # rows of the profile's operations table


class _StopRequest:
    """First Ctrl-C (or SIGTERM, as a scheduler or `kill` sends): finish the current step,
    checkpoint, exit. A second one: stop at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = None  # the signal number once one arrived
        self._previous = {}

    def __enter__(self):
        try:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        except ValueError:  # not the main thread: leave the default behaviour
            self._previous = {}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name}: finishing this step and saving a "
                         "checkpoint (Ctrl-C again to quit at once)\n")

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        return False


class TrainingDiverged(UserError):
    """The losses stayed inf/NaN for --nonfinite-patience steps."""


class Monitor:
    """Reads the per-step values of each log interval: which steps a loss scaler skipped,
    how long the losses have been inf/NaN (a run that stays so is stopped), and how long the
    float16 loss scale has stayed below --min-loss-scale (warned about once)."""

    def __init__(self, cfg: RunConfig, log):
        self.cfg, self.log = cfg, log
        self.nonfinite_streak, self.nonfinite_since = 0, None
        self.low_scale_since, self.warned = None, False

    def observe(self, first_step: int, rows: list[dict], loss_scale: float) -> dict:
        """`rows[i]` holds the values of step first_step + i; returns the history fields."""
        fields = {}
        skipped_at = [first_step + i for i, row in enumerate(rows) if row.get("skipped", 0) > 0.5]
        if skipped_at:
            fields["skipped_at"] = skipped_at
        nonfinite = 0
        for i, row in enumerate(rows):
            if all(math.isfinite(v) for key, v in row.items() if key != "skipped"):
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
                         "gradients keep overflowing; try --amp-dtype bfloat16, a lower --lr or "
                         "--clip-grad-norm")
        else:
            self.low_scale_since = None
        return fields

    @property
    def diverged(self) -> bool:
        return self.nonfinite_streak >= self.cfg.nonfinite_patience


def format_precision_report(rows: list[tuple[str, str, str, str]], precision: str) -> str:
    """rows: (layer, kind, weight dtype or "-", output dtype)."""
    width = max(len(f"{layer} ({kind})") for layer, kind, _, _ in rows)
    lines = [f"precision report ({precision}): layer, weight dtype, output dtype"]
    lines += [f"  {f'{layer} ({kind})':<{width}}  {weights:<9} {output}"
              for layer, kind, weights, output in rows]
    return "\n".join(lines)


def format_top_ops(rows: list[tuple[str, int, float]], steps: int) -> str:
    """rows: (operation, calls, self milliseconds) over `steps` profiled steps, any order."""
    if not rows:
        return f"the profiler recorded no operations over {steps} steps (see the trace)"
    rows = sorted(rows, key=lambda row: -row[2])
    total = sum(ms for _, _, ms in rows)
    shown = [(name if len(name) <= 60 else name[:57] + "...", calls, ms) for name, calls, ms in rows[:TOP_OPS]]
    width = max([len(name) for name, _, _ in shown] + [len("operation")])
    lines = [f"top operations by self time over {steps} profiled steps "
             f"({total / steps:.2f} ms/step in operations)",
             f"  {'operation':<{width}}  {'calls/step':>10}  {'ms/step':>8}  {'share':>6}"]
    lines += [f"  {name:<{width}}  {calls / steps:>10.1f}  {ms / steps:>8.3f}  {ms / total:>6.1%}"
              for name, calls, ms in shown]
    return "\n".join(lines)


def read_rows(session, rows: list[dict]) -> list[dict]:
    """Every step's device scalars of one log interval, read in one host<->device sync."""
    flat = session.fetch({f"{i}/{key}": value for i, row in enumerate(rows) for key, value in row.items()})
    values = [{} for _ in rows]
    for name, value in flat.items():
        index, key = name.split("/", 1)
        values[int(index)][key] = value
    return values


def train(cfg: RunConfig, run: RunFolder, session, num_examples: int, log=print) -> dict:
    """Run iterations until cfg.iters (or a Ctrl-C); return the summary written to the run."""
    start_step, skipped_total = 0, 0
    if cfg.resume:
        step, path = run.latest_checkpoint()
        meta = session.restore(path)
        start_step, skipped_total = meta["step"], meta.get("skipped_total", 0)
        run.truncate_history(start_step)
        log(f"resumed from {path} at step {start_step}")
    if start_step >= cfg.iters:
        log(f"nothing to do: the run is at step {start_step} and --iters is {cfg.iters}")

    order = BatchOrder(num_examples, cfg.batch_size, cfg.seed)
    progress = tqdm(total=cfg.iters, initial=start_step, disable=None, dynamic_ncols=True,
                    desc=f"{cfg.model} {cfg.framework}", leave=True)
    quiet_every = max(cfg.log_every, cfg.iters // 10)  # plain lines when there is no terminal
    epoch, permutation = None, None
    interval = []  # this log interval's per-step metrics, still on the device
    interval_ms, last_row = [], {}
    profile_at = start_step + PROFILE_WARMUP if cfg.profile else None
    stopped_early, diverged_path = False, None
    monitor = Monitor(cfg, log)

    if start_step == 0 and cfg.sample_every:
        session.write_samples(run, 0)  # the starting point: equal in both frameworks under --init-from
    if hasattr(session, "start"):
        session.start(order, start_step, cfg.iters)
    session.synchronize()
    interval_start, io_seconds = time.perf_counter(), 0.0
    with _StopRequest() as stop:
        step = start_step
        while step < cfg.iters:
            if step == profile_at:
                session.profile_start(run.path / "profile")
            batch_epoch, offset = order.locate(step)
            if batch_epoch != epoch:
                epoch = batch_epoch
                permutation = session.upload_indices(order.permutation(epoch))
            if cfg.precision_report and step == start_step:
                rows = session.precision_report(permutation[offset:offset + cfg.batch_size])
                log(format_precision_report(rows, session.runtime.precision))
            interval.append(session.train_step(permutation[offset:offset + cfg.batch_size]))
            step += 1
            if profile_at is not None and step == profile_at + PROFILE_STEPS:
                session.synchronize()
                io_start = time.perf_counter()
                operations, trace = session.profile_stop(run.path / "profile")
                table = format_top_ops(operations, PROFILE_STEPS)
                (run.path / "profile" / "top_ops.txt").write_text(table + "\n")
                log(f"{table}\nprofile: {trace}")
                io_seconds += time.perf_counter() - io_start

            finishing = step == cfg.iters or stop.requested
            if step % cfg.log_every == 0 or finishing:
                rows = read_rows(session, interval)
                elapsed = time.perf_counter() - interval_start - io_seconds
                means = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
                skipped = int(round(means.pop("skipped", 0.0) * len(rows)))
                skipped_total += skipped
                step_ms = 1000.0 * elapsed / len(rows)
                interval_ms.append(step_ms)
                loss_scale = session.loss_scale()
                last_row = {"step": step, **means, "loss_scale": loss_scale,
                            "skipped": skipped, "skipped_total": skipped_total,
                            "step_ms": step_ms, **monitor.observe(step - len(rows) + 1, rows, loss_scale)}
                run.append_history(last_row)
                progress.set_postfix({k: f"{v:.3g}" for k, v in means.items()}
                                     | {"scale": f"{last_row['loss_scale']:g}"}, refresh=False)
                progress.update(step - progress.n)
                if progress.disable and (step % quiet_every == 0 or finishing):
                    shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items())
                    log(f"step {step:>7}/{cfg.iters}  {shown}  scale {last_row['loss_scale']:g}"
                        f"  skipped {skipped_total}  {step_ms:.2f} ms/step")
                interval = []
                interval_start, io_seconds = time.perf_counter(), 0.0
                if monitor.diverged:
                    diverged_path = run.checkpoints / f"diverged_step_{step:06d}.{session.checkpoint_suffix}"
                    session.save_checkpoint(diverged_path, {"step": step, "skipped_total": skipped_total})
                    break

            wants_samples = cfg.sample_every and step % cfg.sample_every == 0
            wants_checkpoint = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
            if wants_samples or wants_checkpoint or finishing:
                session.synchronize()
                io_start = time.perf_counter()
                if wants_samples or finishing:
                    session.write_samples(run, step)
                if wants_checkpoint or finishing:
                    session.save_checkpoint(run.checkpoint_path(step, session.checkpoint_suffix),
                                            {"step": step, "skipped_total": skipped_total})
                    run.prune_checkpoints()
                io_seconds += time.perf_counter() - io_start
            if stop.requested and step < cfg.iters:
                stopped_early = True
                break
    progress.close()

    # The first interval of a process includes graph tracing and allocator warm-up.
    steady = interval_ms[1:] if len(interval_ms) > 1 else interval_ms
    median_ms = statistics.median(steady) if steady else None
    summary = {
        "model": cfg.model, "framework": cfg.framework, "step": step, "iters": cfg.iters,
        "batch_size": cfg.batch_size, "median_step_ms": median_ms,
        "samples_per_s": cfg.batch_size * 1000.0 / median_ms if median_ms else None,
        "peak_memory_mb": session.peak_memory_mb(), "skipped_steps": skipped_total,
        "final": {k: v for k, v in last_row.items() if k not in ("step", "step_ms", "skipped_at")},
        "stopped_early": stopped_early,
    }
    if diverged_path is not None:
        summary["stopped"] = f"losses inf/NaN since step {monitor.nonfinite_since}"
        run.write_summary(summary)
        good = run.latest_checkpoint()
        advice = (f"--resume continues from the last good checkpoint (step {good[0]})" if good
                  else "no earlier checkpoint to resume from")
        raise TrainingDiverged(
            f"the losses have been inf/NaN since step {monitor.nonfinite_since} "
            f"({monitor.nonfinite_streak} steps): stopped at step {step}, state saved in "
            f"{diverged_path}; lower --lr, try --clip-grad-norm or --amp-dtype bfloat16; {advice}")
    if step == start_step and (run.path / "summary.json").exists():
        # Nothing trained in this process (say, evaluating a finished run): keep its figures.
        summary = {**run.read_summary(), "stopped_early": False}
    if cfg.evaluate and not stopped_early:
        summary["metrics"] = session.evaluate(cfg)
    run.write_summary(summary)
    if stopped_early:
        log(f"stopped at step {step}, checkpoint saved; continue with the same command "
            "and --resume")
        sys.exit(128 + stop.requested)  # the shell's status for that signal: 130 for Ctrl-C
    elif median_ms is not None:
        log(f"done: step {step}, median {median_ms:.2f} ms/step "
            f"({summary['samples_per_s']:.0f} samples/s), peak memory "
            f"{summary['peak_memory_mb']:.0f} MB, {skipped_total} skipped steps; "
            f"samples in {run.samples}")
    return summary
