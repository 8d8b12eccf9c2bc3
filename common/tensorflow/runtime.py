"""What a TensorFlow run runs on: seeds, device and precision (the global dtype policy), and
the tf.distribute strategy whose replicas it trains on, set up once
(common/pytorch/runtime.py is the twin).

Data parallel:
    python GAN/dcgan/dcgan_tensorflow.py --distribute mirrored              # every local GPU
    python GAN/dcgan/dcgan_tensorflow.py --distribute mirrored --replicas 2 # 2 logical CPUs
    TF_CONFIG='{"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker",
    "index": 0}}' python GAN/dcgan/dcgan_tensorflow.py --distribute multi-worker   # on each host

MirroredStrategy runs one replica per local device in one process; MultiWorkerMirroredStrategy
one process per machine (its devices each a replica), the cluster read from TF_CONFIG. The
networks and optimizers are built inside `strategy.scope()`, which mirrors their variables on
every replica; each replica runs the training step on its share of the batch, and the
optimizers sum the replicas' gradients before they clip and apply them (as PyTorch's DDP
does; common/tensorflow/optimizers.py, SumsReplicasFirst), so each replica's loss is its
share of the global mean (`Replicas.share`) and --clip-grad-norm clips the global gradient.
Keras' LossScaleOptimizer checks each replica's own gradients for inf/NaN; the one
common/tensorflow/amp.py builds makes the replicas agree (one all-reduce of the flag), so an
overflow on any replica skips the step, and halves the scale, on every replica. Batch norm
keeps per-replica statistics, or all-reduces them with --sync-bn
(`BatchNormalization(synchronized=True)`).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import keras
import tensorflow as tf
from tensorflow.python.eager import context as eager_context  # what sync_devices itself uses
from tensorflow.python.framework import config as framework_config
from tensorflow.python.ops import gen_sync_ops

from common import distributed, quiet
from common.config import RunConfig, describe_precision, note_unused_flags, resolve_precision, warn_if_bf16_emulated
from common.errors import UsageError, UserError, clipped, first_line
from common.tensorflow import amp

_GPUS = tf.config.list_physical_devices("GPU")

# How long a worker waits for the others to join at the start ($AMPGEN_JOIN_TIMEOUT_S overrides):
# TensorFlow's own wait has no end, holds the GIL (no Python timer fires) and takes SIGTERM for a
# pre-emption notice. Its collectives get no timeout of their own (CommunicationOptions'
# timeout_seconds): TensorFlow starts a thread per collective op that waits out the timeout, so
# at 10 minutes each worker gained ~11 threads a step and aborted near 14,000 (std::system_error,
# "Resource temporarily unavailable") after 1,500 steps of the vanilla GAN. A worker that dies
# breaks its connections, and one that stops answering misses the coordination service's
# heartbeats: either way the collectives fail and the others end with one line (10 s after a
# SIGSTOP on the 2-core CPU).
JOIN_TIMEOUT_S = 600
JOIN_NOTICE_S = distributed.JOIN_NOTICE_S  # or a quarter of the wait if sooner

# A process beside the joining worker: unless the worker closes the pipe (joined, or gone) in
# time, it says so in one line and kills the worker. It takes Ctrl-C and SIGTERM for the worker
# too, which cannot act on them while it joins (it waited on: SIGTERM forever, once the signal
# had killed its watchdog): from the process group (a terminal, `timeout`, a scheduler) they
# reach the watchdog itself; a Ctrl-C sent to the worker alone reaches it through the worker's
# signal wakeup fd (written by the interpreter's C handler, no GIL needed). A SIGTERM to the
# worker alone does not: the join installs TensorFlow's pre-emption handler in Python's place.
_JOIN_WATCHDOG = """
import os, select, signal, sys, time
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
signals, notice, notice_s = int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
def say(line):  # after the kill: a reader gone from stderr (`| tee`, ended by the same Ctrl-C) must not stop it
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
def interrupted(signum, frame=None):
    os.kill(pid, signal.SIGKILL)
    say(f"error: interrupted ({signal.Signals(signum).name}) while joining the other workers; nothing was trained")
    sys.exit(0)
signal.signal(signal.SIGINT, interrupted)
signal.signal(signal.SIGTERM, interrupted)
started = time.monotonic()
deadline, watched = started + seconds, [sys.stdin, signals]
notice_at = started + min(notice_s, seconds / 4)  # a join that takes longer says what it waits for
while True:
    wake = deadline if notice_at is None else notice_at
    ready = select.select(watched, [], [], max(0.0, wake - time.monotonic()))[0]
    if sys.stdin in ready:  # joined ("j" written), or gone
        if sys.stdin.buffer.read(1) == b"j" and notice_at is None:
            say(f"joined the other workers after {time.monotonic() - started:.0f} s")
        break
    if not ready and notice_at is not None:
        say(notice)
        notice_at = None
        continue
    if not ready:
        os.kill(pid, signal.SIGKILL)
        say(message)
        break
    received = os.read(signals, 64)
    if not received:  # the worker closed its end: it has joined
        watched.remove(signals)
    for signum in received:
        if signum in (signal.SIGINT, signal.SIGTERM):
            interrupted(signum)
"""


def describe_tensorflow() -> str:
    """"tensorflow 2.21.0 (keras 3.15.1), sees 1 CPU device (2 cores) + 1 GPU, oneDNN on, C++ log
    level 1 (...)": what a run's first line says in place of TensorFlow's start-up log
    (common/quiet.py). TensorFlow's one CPU device holds every core the process may use."""
    found = Counter(device.device_type for device in tf.config.list_physical_devices())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    devices = " + ".join(f"{count} CPU device{'s' * (count > 1)} ({cores} cores)"
                         if kind == "CPU" else f"{count} {kind}" for kind, count in found.items())
    onednn = {True: "on", False: "off", None: "?"}[onednn_enabled()]
    return (f"tensorflow {tf.__version__} (keras {keras.__version__}), sees {devices}, oneDNN {onednn}, "
            f"{quiet.describe_log_level()}")


def onednn_enabled() -> bool | None:
    """Whether TensorFlow's CPU kernels are oneDNN's (what port.cc's start-up notice used to
    say): by default on CPUs with AVX512 features, off on AVX2-only ones, and
    TF_ENABLE_ONEDNN_OPTS=0/1 decides. None where this build does not say."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


class Noise:
    """A run's training noise, counter-based: the run's k-th draw (k from 1), normal or
    uniform, is Philox's `stateless_normal` or `stateless_uniform` with seed (seed, k), and its
    only state is k, a variable the checkpoints save. Build it in the strategy's scope, with
    the networks: every replica then holds k.

    Why not a seeded tf.random.Generator: under MirroredStrategy with synchronized batch
    norm, DCGAN's G drifted from one process's weights (4e-4 after one step, 1e-3 after 20)
    with it, and matches to 2e-7 with these counted seeds; the cause inside TensorFlow was not
    found."""

    def __init__(self, seed: int):
        self.seed = tf.constant(seed, tf.int64)
        self.draws = tf.Variable(0, dtype=tf.int64, trainable=False, name="noise_draws")

    def normal(self, shape) -> tf.Tensor:
        return tf.random.stateless_normal(shape, seed=self._next_seed(), alg="philox")

    def uniform(self, shape) -> tf.Tensor:
        return tf.random.stateless_uniform(shape, seed=self._next_seed(), alg="philox")

    def _next_seed(self) -> tf.Tensor:
        return tf.stack([self.seed, self.draws.assign_add(1)])


@dataclass
class Replicas:
    """The `Replicas` of common/distributed.py over a tf.distribute strategy. Without
    --distribute: the default strategy, one replica, and every method a pass-through."""

    strategy: tf.distribute.Strategy = field(default_factory=tf.distribute.get_strategy)
    rank: int = 0      # this worker's index in TF_CONFIG (--distribute multi-worker); 0 writes
    workers: int = 1   # processes

    def __post_init__(self):
        if self.workers > 1:  # the stop requests travel with the training steps (stop_signal)
            self._stop_request = tf.Variable(0, dtype=tf.int32, trainable=False)
            self._agreed_stop = tf.Variable(0, dtype=tf.int32, trainable=False)
            self._sent_stop = 0  # what _stop_request holds: assigned again only when it changes

    @property
    def count(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def writer(self) -> bool:
        return self.rank == 0

    @property
    def noun(self) -> str:
        return "workers" if self.workers > 1 else "replicas"

    def synchronize(self):
        """Wait for the kernels queued on this process's devices (a GPU runs them asynchronously),
        as tf.test.experimental.sync_devices does for every logical device: under
        MultiWorkerMirroredStrategy those include the other workers', and it failed there
        ("Haven't set up remote eager worker")."""
        own = f"/task:{self.rank}/"
        for device in tf.config.list_logical_devices():
            if "/job:" not in device.name or own in device.name:
                with tf.device(device.name):
                    gen_sync_ops.SyncDevice()
        eager_context.async_wait()

    # --- what the training steps use (in a replica's context) -------------------------
    def share(self, loss: tf.Tensor) -> tf.Tensor:
        """This replica's share of the global batch's mean loss: the optimizers sum the
        replicas' gradients, so a replica's mean over its rows counts 1 / replicas."""
        return loss if self.count == 1 else loss / self.count

    def normal(self, noise: Noise, rows, *shape) -> tf.Tensor:
        """This replica's `rows` of standard normal noise drawn for the rows of every replica:
        the same draws as one process would make."""
        return self._draw_for_all(lambda count: noise.normal((rows * count, *shape)))

    def uniform(self, noise: Noise, rows, *shape) -> tf.Tensor:
        """As normal, uniform on [0, 1)."""
        return self._draw_for_all(lambda count: noise.uniform((rows * count, *shape)))

    def _draw_for_all(self, draw) -> tf.Tensor:
        if self.count == 1:
            return draw(1)
        # merge_call runs `draw` once, outside the replicas, and hands its result to each.
        noise = tf.distribute.get_replica_context().merge_call(lambda strategy: draw(self.count))
        return self.shard(noise)

    def shard(self, rows: tf.Tensor, parts: int = 1) -> tf.Tensor:
        """This replica's rows of a global batch (common/distributed.py's `shard`, in the graph)."""
        if self.count == 1:
            return rows
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grouped = tf.reshape(rows, [parts, self.count, -1, *rows.shape[1:]])
        return tf.reshape(tf.gather(grouped, replica, axis=1), [-1, *rows.shape[1:]])

    # --- what the session and the loop use (outside the replicas) ---------------------
    def run(self, replica_step, *args) -> dict[str, tf.Tensor]:
        """`replica_step(*args)` on every replica; its metrics averaged over them. Across
        workers the step also carries each worker's stop request to the others."""
        if self.workers == 1:
            metrics = self.strategy.run(replica_step, args=args)
        else:
            def step_and_vote(*step_args):
                return replica_step(*step_args), _vote(self._stop_request)
            metrics, votes = self.strategy.run(step_and_vote, args=args)
            self._agreed_stop.assign(_highest_vote(self.strategy.experimental_local_results(votes)[0]))
        return {name: self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
                for name, value in metrics.items()}

    def local_copies(self, tensor: tf.Tensor):
        """A copy of `tensor` on each replica's device (the resident training set): gathers
        then read their own device's memory, not another GPU's."""
        if self.count == 1:
            return tensor
        return self.strategy.experimental_distribute_values_from_function(lambda context: tf.identity(tensor))

    def stop_signal(self, signum: int) -> int:
        """One process (--distribute mirrored too) receives its own signals. Workers agree one
        step late, with no collective of its own: `signum` goes out with the next step's
        collectives, and the answer is the largest request the step just run carried. Reading
        it waits for that step (PyTorch's replicas read an asynchronous all-reduce instead):
        36 us a step on the 2-core CPU; an assign of an unchanged request cost 46 more."""
        if self.workers == 1:
            return signum
        agreed = int(self._agreed_stop.numpy())
        if signum != self._sent_stop:
            self._stop_request.assign(signum)
            self._sent_stop = signum
        return agreed

    def wait_for_writer(self) -> None:
        if self.workers > 1:
            self._all_max(0)

    def writer_first(self, action):
        if self.workers == 1:
            return action()
        result = None
        if self.writer:
            try:
                result = action()
            except UserError:
                self._all_max(1)  # tell the others, then say it
                raise
        if self._all_max(0):
            raise distributed.ReplicaFailed("worker 0 stopped (its error is in its output)", quiet=True)
        return result

    def gather(self, values: list[int]) -> list[list[int]]:
        """Across workers; one process (--distribute mirrored too) holds one answer."""
        if self.workers == 1:
            return [list(values)]
        with translate_failures():
            rows = _gather(self.strategy, tf.constant(values, tf.int32)).numpy().tolist()
        return rows[::self.count // self.workers]  # a row per replica, worker by worker: the first of each

    def _all_max(self, value: int) -> int:
        """The largest of the workers' `value`s (a signal number, or 0/1)."""
        with translate_failures():
            return int(_all_max(self.strategy, tf.constant(value, tf.int32)))


_LARGEST = 64  # signal numbers fit


def _vote(value) -> tf.Tensor:
    """In a replica: tf.distribute reduces by SUM or MEAN only, so the workers sum one-hot
    vectors of their values..."""
    return tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, tf.one_hot(value, _LARGEST + 1, dtype=tf.int32))


def _highest_vote(counts: tf.Tensor) -> tf.Tensor:
    """...and take the highest value any worker sent."""
    return tf.reduce_max(tf.where(counts > 0, tf.range(_LARGEST + 1), 0))


@tf.function
def _all_max(strategy, value):
    """The largest of the workers' values, in a collective of its own."""
    votes = strategy.run(_vote, args=(value,))
    return _highest_vote(strategy.experimental_local_results(votes)[0])


@tf.function
def _gather(strategy, values):
    """Every replica's `values`, one row each, in a collective of its own."""
    rows = strategy.run(lambda own: tf.distribute.get_replica_context().all_gather(own[tf.newaxis], axis=0),
                        args=(values,))
    return strategy.experimental_local_results(rows)[0]


class translate_failures:
    """A worker that went away surfaces as an UnavailableError, a DeadlineExceeded or a
    cancelled collective in the others: end with one line instead of TensorFlow's report."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None and issubclass(kind, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                                                  tf.errors.CancelledError, tf.errors.AbortedError)):
            raise distributed.ReplicaFailed(f"lost contact with another worker "
                                            f"({clipped(first_line(error, announced=True), 200)})") \
                from None
        return False


def start_replicas(cfg: RunConfig, device_type: str) -> Replicas:
    """The strategy --distribute names; before TensorFlow initialises its devices."""
    if cfg.distribute is None:
        return Replicas()
    if cfg.distribute == "mirrored":
        if device_type == "cpu":
            if not cfg.replicas:
                raise UsageError("--distribute mirrored on a CPU needs --replicas N (N logical CPU devices)")
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * cfg.replicas)
            devices = [device.name for device in tf.config.list_logical_devices("CPU")]
        else:
            devices = [device.name for device in tf.config.list_logical_devices("GPU")][:cfg.replicas]
        return Replicas(tf.distribute.MirroredStrategy(devices))
    cluster = _read_tf_config()
    try:
        with _given_up_after(_join_timeout_s(), len(cluster["cluster"]["worker"])):
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        own = cluster["cluster"]["worker"][cluster["task"]["index"]]
        hint = (f"; is {own} in use, by another worker given this task index, or another program?"
                if "gRPC server" in str(error) else "")
        raise UserError(f"could not join the other workers ({first_line(error)}){hint}") from None
    return Replicas(strategy, rank=cluster["task"]["index"], workers=len(cluster["cluster"]["worker"]))


def _join_timeout_s() -> float:
    text = os.environ.get("AMPGEN_JOIN_TIMEOUT_S", "")
    try:
        seconds = float(text) if text else JOIN_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e7:
        raise UsageError(f"AMPGEN_JOIN_TIMEOUT_S must be a number of seconds above 0, got {text!r}")
    return seconds


@contextlib.contextmanager
def _given_up_after(seconds: float, workers: int):
    message = (f"error: the {workers} workers of TF_CONFIG did not all join within {seconds:g} s (each one "
               "started, with its own index and a free port?); AMPGEN_JOIN_TIMEOUT_S waits longer")
    notice = (f"waiting for the other {workers - 1} worker(s) of TF_CONFIG (each started with --distribute "
              f"multi-worker and its own index?); up to {seconds:g} s (AMPGEN_JOIN_TIMEOUT_S), Ctrl-C stops it")
    signals_read, signals_written = os.pipe()
    os.set_blocking(signals_written, False)  # as set_wakeup_fd requires
    watchdog = subprocess.Popen([sys.executable, "-c", _JOIN_WATCHDOG, str(os.getpid()), str(seconds), message,
                                 str(signals_read), notice, str(JOIN_NOTICE_S)], stdin=subprocess.PIPE,
                                pass_fds=(signals_read,))
    os.close(signals_read)
    try:
        previous = signal.set_wakeup_fd(signals_written, warn_on_full_buffer=False)
    except ValueError:  # not the main thread, whose signals these are: the group's reach the watchdog still
        previous = None
    joined = False
    try:
        yield
        joined = True
    finally:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(signals_written)
        with contextlib.suppress(OSError):  # a watchdog gone: it killed this worker, or was killed
            if joined:  # which its notice, if said, follows with how long the join took
                watchdog.stdin.write(b"j")
            watchdog.stdin.close()
        watchdog.wait()


_CLUSTER_FORM = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}'


def _read_tf_config() -> dict:
    text = os.environ.get("TF_CONFIG")
    if not text or not text.strip():
        raise UsageError(f"--distribute multi-worker reads the cluster from TF_CONFIG, which is "
                         f"{'not set' if text is None else 'empty'}: {_CLUSTER_FORM}")
    try:
        cluster = json.loads(text)
    except (ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else first_line(error)
        raise UsageError(f"TF_CONFIG is not JSON ({clipped(reason, 80)}): expected {_CLUSTER_FORM}") from None
    problem = _cluster_problem(cluster)
    if problem:
        raise UsageError(f"TF_CONFIG {problem}: expected {_CLUSTER_FORM}")
    workers, index = cluster["cluster"]["worker"], cluster["task"]["index"]
    if not 0 <= index < len(workers):
        raise UsageError(f"TF_CONFIG's task index {index} names no worker: the cluster lists {len(workers)} "
                         f"worker{'s' * (len(workers) != 1)}, whose indices are 0 to {len(workers) - 1}")
    for address in workers:  # TensorFlow's C++ printed its own errors first, then failed to join
        host, _, port = address.rpartition(":")
        if not (host and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
            raise UsageError(f"TF_CONFIG's worker {address!r} is not host:port (a port from 1 to 65535): "
                             f"expected {_CLUSTER_FORM}")
    repeated = sorted({address for address in workers if workers.count(address) > 1})
    if repeated:  # two workers cannot both listen there: the join waited out its timeout
        raise UsageError(f"TF_CONFIG lists {', '.join(repeated)} more than once: each worker needs its own "
                         "host:port")
    others = sorted(set(cluster["cluster"]) - {"worker"})
    if others:  # a chief would take worker 0's place, a parameter server wait for a strategy not used
        raise UsageError(f"TF_CONFIG names {', '.join(others)} besides the workers: --distribute multi-worker "
                         f"takes workers only, worker 0 writing the run: {_CLUSTER_FORM}")
    return cluster


def _cluster_problem(cluster) -> str | None:
    """What keeps a parsed TF_CONFIG from being a cluster of workers and this process's task
    in it, as words after "TF_CONFIG" (values shown as JSON, as the user wrote them); None:
    nothing."""
    shown = lambda value: clipped(json.dumps(value), 40)  # noqa: E731
    if not isinstance(cluster, dict) or not isinstance(cluster.get("cluster"), dict):
        return 'has no "cluster" object'
    workers = cluster["cluster"].get("worker")
    if not isinstance(workers, list) or not workers:
        return 'lists no workers in cluster.worker (a list of "host:port" strings)'
    odd = next((address for address in workers if not isinstance(address, str)), None)
    if odd is not None:
        return f'lists worker {shown(odd)}, not a "host:port" string'
    task = cluster.get("task")
    if not isinstance(task, dict):
        return 'has no "task" object, this process\'s type and index'
    for key in ("type", "index"):
        if key not in task:
            return f"names no task {key} for this process"
    if task["type"] != "worker":
        return f"names this process's task type {shown(task['type'])}, not \"worker\""
    if type(task["index"]) is not int:  # a string "0" trained without ever writing: no worker was worker 0
        return f"names this process's task index {shown(task['index'])}, not an integer"
    return None


def synchronize_batch_norm(model: keras.Model) -> None:
    """--sync-bn: every BatchNormalization layer all-reduces its batch statistics over the
    replicas (Keras' `synchronized=True`, set before the first step is traced)."""
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.synchronized = True


@dataclass
class Runtime:
    device_type: str   # "cpu" | "cuda"
    precision: str     # "fp32" | "amp-fp16" | "amp-bf16"
    replicas: Replicas = field(default_factory=Replicas)  # --distribute's; one by default
    sync_bn: bool = False

    @property
    def loss_scaling(self) -> bool:
        return self.precision == "amp-fp16"

    @property
    def strategy(self) -> tf.distribute.Strategy:
        """Build the networks and optimizers inside `runtime.strategy.scope()`: under
        --distribute their variables are mirrored on every replica."""
        return self.replicas.strategy

    @property
    def log(self):
        """print on the worker that writes the run folder; the others keep quiet."""
        return print if self.replicas.writer else _silent


def setup(cfg: RunConfig, log=print) -> Runtime:
    """Pick the device, start the replicas (--distribute), seed everything, set the global
    dtype policy."""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1"):  # torchrun's: each process trained the whole
        # job alone, all of them into one run folder. Said by rank 0 alone under torchrun (which
        # sets TORCHELASTIC_RUN_ID); a WORLD_SIZE and RANK left in a shell exited 2 saying nothing.
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        raise UsageError("torchrun launches PyTorch's replicas; run a TensorFlow script once, with --distribute "
                         "mirrored --replicas N, or --distribute multi-worker under TF_CONFIG"
                         + ("" if under_torchrun else " (WORLD_SIZE is set in this shell: unset it)"),
                         quiet=under_torchrun and os.environ.get("RANK", "0") != "0")
    if cfg.device == "cuda" and not _GPUS:
        raise UsageError("--device cuda, but TensorFlow sees no GPU; use --device cpu")
    if cfg.device == "cpu" and _GPUS:
        tf.config.set_visible_devices([], "GPU")
    device_type = "cuda" if _GPUS and cfg.device != "cpu" else "cpu"
    replicas = start_replicas(cfg, device_type)
    distributed.check_same_flags(cfg, replicas)
    if not replicas.writer:
        log = _silent
    bf16_supported = True
    if device_type == "cuda":
        capability = tf.config.experimental.get_device_details(_GPUS[0]).get("compute_capability", (0, 0))
        bf16_supported = capability >= (8, 0)
    precision = resolve_precision(cfg, device_type, bf16_supported)

    if cfg.tf32 != "auto":  # TensorFloat-32 on NVIDIA GPUs since Ampere (TensorFlow's default: on)
        tf.config.experimental.enable_tensor_float_32_execution(cfg.tf32 == "on")
    keras.utils.set_random_seed(cfg.seed)  # Python, numpy and TensorFlow
    if device_type == "cpu":
        tf.config.experimental.enable_op_determinism()  # makes --resume bit-exact
    else:
        # On a GPU, as the PyTorch twin there (cudnn.benchmark): the fastest kernels, not bit-exact
        # ones, which are slower and which some GPU ops lack; a speed comparison needs both
        # alike. Set, not assumed: a CPU run earlier in the process turned determinism on.
        framework_config.disable_op_determinism()
    keras.mixed_precision.set_global_policy(amp.POLICIES[precision])  # before any layer is built
    tf.config.optimizer.set_experimental_options({"remapping": not fuses_float16_slowly(precision, device_type)})
    warn_if_bf16_emulated(precision, device_type, log)
    note_unused_flags(cfg, precision, device_type, log)
    if os.environ.get("TF_CONFIG") and cfg.distribute != "multi-worker":  # a cluster's worker that trains alone
        log("note: TF_CONFIG is set, but only --distribute multi-worker reads it: this process trains alone")
    across = (f" | {replicas.count} replica{'s' * (replicas.count != 1)} ({type(replicas.strategy).__name__}"
              f"{f', {replicas.workers} workers' if replicas.workers > 1 else ''})" if cfg.distribute else "")
    log(f"{cfg.model} | {describe_tensorflow()} | "
        f"{device_type} | {describe_precision(precision, device_type)} | "
        f"{f'TF32 {tf32_state()} | ' if device_type == 'cuda' else ''}"
        f"policy {amp.POLICIES[precision]}{across}")
    return Runtime(device_type, precision, replicas, cfg.sync_bn)


def fuses_float16_slowly(precision: str, device_type: str) -> bool:
    """Whether Grappler's remapper, which fuses a Dense layer's MatMul and BiasAdd into one op,
    would hand a float16 one to oneDNN's reference kernel: on a CPU with AVX512-FP16 (an Intel
    Xeon with AMX) TensorFlow 2.21's oneDNN has no optimized float16 inner product, and the
    vanilla GAN's float16 step took 1,587 ms fused, 21 ms unfused (README, "What --amp does").
    setup() turns the remapper off for float16 on a oneDNN CPU, and on for everything else."""
    return precision == "amp-fp16" and device_type == "cpu" and bool(onednn_enabled())


def tf32_state() -> str:
    return "on" if tf.config.experimental.tensor_float_32_execution_enabled() else "off"


def _silent(*args, **kwargs):
    pass
