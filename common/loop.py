"""The training loop, written once for both frameworks.

A framework backend hands in a `session` with these methods (see torch_backend/tf_backend):

    upload_indices(np.ndarray) -> device tensor     once per epoch, not per step
    train_step(batch_indices) -> dict of device scalars (summed between log points)
    fetch(metrics) -> dict of floats                the only host<->device sync on the hot path
    loss_scale() -> float; synchronize()
    write_samples(run, step); save_checkpoint(path, meta); restore(path) -> meta
    peak_memory_mb() -> float; profile_start(dir); profile_stop(dir)
    evaluate(cfg) -> dict                           quality metrics (--evaluate N), at the end
"""
from __future__ import annotations

import signal
import statistics
import sys
import time

from tqdm.auto import tqdm

from common.config import RunConfig
from common.runs import BatchOrder, RunFolder

PROFILE_WARMUP = 5  # steps after the start before the profiled window (tracing, allocator)
PROFILE_STEPS = 10


class _StopRequest:
    """First Ctrl-C: finish the current step, checkpoint, exit. Second: stop at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave the default behaviour
            self._previous = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        sys.stderr.write("\ninterrupt: finishing this step and saving a checkpoint "
                         "(Ctrl-C again to quit at once)\n")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


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
    totals, steps_in_interval = None, 0
    interval_ms, last_row = [], {}
    profile_at = start_step + PROFILE_WARMUP if cfg.profile else None
    stopped_early = False

    if start_step == 0 and cfg.sample_every:
        session.write_samples(run, 0)  # the starting point: equal in both frameworks under --init-from
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
            metrics = session.train_step(permutation[offset:offset + cfg.batch_size])
            totals = metrics if totals is None else {k: totals[k] + v for k, v in metrics.items()}
            steps_in_interval += 1
            step += 1
            if profile_at is not None and step == profile_at + PROFILE_STEPS:
                session.synchronize()
                io_start = time.perf_counter()
                session.profile_stop(run.path / "profile")
                io_seconds += time.perf_counter() - io_start

            finishing = step == cfg.iters or stop.requested
            if step % cfg.log_every == 0 or finishing:
                means = {k: v / steps_in_interval for k, v in session.fetch(totals).items()}
                elapsed = time.perf_counter() - interval_start - io_seconds
                skipped = int(round(means.pop("skipped", 0.0) * steps_in_interval))
                skipped_total += skipped
                step_ms = 1000.0 * elapsed / steps_in_interval
                interval_ms.append(step_ms)
                last_row = {"step": step, **means, "loss_scale": session.loss_scale(),
                            "skipped": skipped, "skipped_total": skipped_total,
                            "step_ms": step_ms}
                run.append_history(last_row)
                progress.set_postfix({k: f"{v:.3g}" for k, v in means.items()}
                                     | {"scale": f"{last_row['loss_scale']:g}"}, refresh=False)
                progress.update(step - progress.n)
                if progress.disable and (step % quiet_every == 0 or finishing):
                    shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items())
                    log(f"step {step:>7}/{cfg.iters}  {shown}  scale {last_row['loss_scale']:g}"
                        f"  skipped {skipped_total}  {step_ms:.2f} ms/step")
                totals, steps_in_interval = None, 0
                interval_start, io_seconds = time.perf_counter(), 0.0

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
        "final": {k: v for k, v in last_row.items() if k not in ("step", "step_ms")},
        "stopped_early": stopped_early,
    }
    if step == start_step and (run.path / "summary.json").exists():
        # Nothing trained in this process (say, evaluating a finished run): keep its figures.
        summary = {**run.read_summary(), "stopped_early": False}
    if cfg.evaluate and not stopped_early:
        summary["metrics"] = session.evaluate(cfg)
    run.write_summary(summary)
    if stopped_early:
        log(f"stopped at step {step}, checkpoint saved; continue with the same command "
            "and --resume")
        sys.exit(130)  # the shell's status for a Ctrl-C
    elif median_ms is not None:
        log(f"done: step {step}, median {median_ms:.2f} ms/step "
            f"({summary['samples_per_s']:.0f} samples/s), peak memory "
            f"{summary['peak_memory_mb']:.0f} MB, {skipped_total} skipped steps; "
            f"samples in {run.samples}")
    return summary
