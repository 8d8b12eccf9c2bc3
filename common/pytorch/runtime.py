"""What a PyTorch run runs on: seeds, device, precision and the loss scaler, set up once, and
the data-parallel replicas it is one of (common/tensorflow/runtime.py is the twin).

Data parallel:
    torchrun --standalone --nproc-per-node N GAN/dcgan/dcgan_pytorch.py [flags]
    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT ...

torchrun starts one process per replica and tells each its rank (RANK, WORLD_SIZE,
LOCAL_RANK). Each process drives one GPU (NCCL), or a CPU (gloo); every process builds the
same networks from the same seed, and DistributedDataParallel (DDP) averages the gradients
of each backward pass over the replicas, so the optimizers take identical steps everywhere.
AMP is unchanged: one GradScaler per process, and since the gradients it checks are the
averaged ones, every replica skips the same steps. Batch norm keeps per-replica statistics
(broadcast_buffers off: DDP would otherwise overwrite them in place between D's two forward
passes), or is synchronised across GPUs with --sync-bn.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import random
import re
import resource
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common import distributed, models
from common.config import RunConfig, describe_precision, note_unused_flags, resolve_precision, warn_if_bf16_emulated
from common.errors import UsageError, UserError, clipped, first_line
from common.pytorch import amp

# How long a replica waits for the others at a collective before it gives up with one line
# (a replica that dies closes its connections, and the others learn of it at once).
REPLICA_TIMEOUT = timedelta(minutes=10)
JOIN_NOTICE_S = distributed.JOIN_NOTICE_S  # a join slower than this says what it waits for
# How long a replica's exit waits for the collectives' threads to let go of its tensors (below):
# a moment, but one that waits on a stuck collective (a replica that hangs) gives up.
RETURN_TIMEOUT_S = 5.0

# The tensors this process has handed to collectives. The gloo thread that ran one lets go of
# them a moment after it returns, and freeing a tensor that Python knows takes the GIL: had the
# interpreter begun to finalize by then (a replica that exits on what it gathered), Python 3.11
# ended that thread from inside a C++ destructor, and the process with it: "terminate called
# without an active exception", SIGABRT (gdb: AsyncBarrierWork's destructor in
# ProcessGroupGloo::runLoop; 7 of 36 runs of the --resume refusal under load). So the exit
# waits until the threads have let go of them (_leave).
_LENT: dict[int, weakref.ref] = {}  # by id (a WeakSet compares tensors with ==, elementwise)


def _lend(tensor: torch.Tensor) -> torch.Tensor:
    key = id(tensor)
    _LENT[key] = weakref.ref(tensor, lambda _, key=key: _LENT.pop(key, None))
    return tensor


def wait_for_lent_tensors(timeout_s: float = RETURN_TIMEOUT_S) -> bool:
    """Wait, the GIL free, until the collectives' threads have let go of every tensor handed to
    them; False if some were still held after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while len(_LENT):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def launched_by_torchrun() -> bool:
    """WORLD_SIZE > 1, with RANK set, and RANK and LOCAL_RANK (0 if unset, as one process per
    machine may leave it) in range: torchrun sets all three. Set by hand, a rank past the world
    would wait for replicas that never come, and a word raise deep inside."""
    world_size = _environment_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return False
    if "RANK" not in os.environ:  # joining said only "environment variable RANK expected, but not set"
        raise UsageError(f"WORLD_SIZE is {world_size}, but RANK is not set: launch with torchrun, which sets both "
                         "(a WORLD_SIZE left in this shell: unset it)")
    rank, local_rank = _environment_int("RANK", 0), _environment_int("LOCAL_RANK", 0)
    if not (0 <= rank < world_size and 0 <= local_rank < world_size):
        raise UsageError(f"RANK {rank} and LOCAL_RANK {local_rank} must be from 0 to WORLD_SIZE - 1 "
                         f"({world_size - 1}): launch with torchrun, which sets them")
    return True


def _environment_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    try:
        return default if text is None else int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not an integer: launch with torchrun, which sets it") from None


@dataclass
class Replicas:
    """The `Replicas` of common/distributed.py. One process: rank 0 of 1, and every method a
    pass-through."""

    rank: int = 0
    count: int = 1
    local_rank: int = 0
    control_group: Any = None  # gloo, on the CPU: for the stop flags, which must not sync a GPU
    _pending_stop: tuple | None = field(default=None, repr=False)

    noun = "replicas"

    @property
    def writer(self) -> bool:
        return self.rank == 0

    # --- what the training steps use --------------------------------------------------
    def randn(self, rows: int, *shape, device) -> torch.Tensor:
        """This replica's `rows` of standard normal noise drawn for the rows of every replica:
        the same draws, from the same generator, as one process would make."""
        return self.shard(torch.randn(rows * self.count, *shape, device=device))

    def rand(self, rows: int, *shape, device) -> torch.Tensor:
        """As randn, uniform on [0, 1)."""
        return self.shard(torch.rand(rows * self.count, *shape, device=device))

    def shard(self, rows: torch.Tensor, parts: int = 1) -> torch.Tensor:
        return distributed.shard(rows, self.rank, self.count, parts)

    def data_parallel(self, module: torch.nn.Module) -> torch.nn.Module:
        """DDP around a network (its gradients averaged over the replicas at each backward);
        in one process, the network itself."""
        if self.count == 1:
            return module
        device_ids = [module_device(module).index] if module_device(module).type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **_PER_REPLICA_BUFFERS)

    # --- what the loop uses -----------------------------------------------------------
    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over the replicas (the logged losses): one all-reduce."""
        if self.count == 1:
            return values
        with translate_failures():
            dist.all_reduce(_lend(values))
        return values / self.count

    def stop_signal(self, signum: int) -> int:
        """Agreed one step late, so that no step waits for it: each call starts an all-reduce
        of this replica's signal and returns the one the call before started (finished by now)."""
        if self.count == 1:
            return signum
        agreed = self._agreed_stop()
        flag = _lend(torch.tensor([signum], dtype=torch.int64))
        with translate_failures():
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        self._pending_stop = (work, flag)
        return agreed

    def _agreed_stop(self) -> int:
        if self._pending_stop is None:
            return 0
        work, flag = self._pending_stop
        self._pending_stop = None
        with translate_failures():
            work.wait()
        return int(flag.item())

    def wait_for_writer(self):
        if self.count > 1:
            self._agreed_stop()
            with translate_failures():
                dist.barrier(group=self.control_group)

    def writer_first(self, action):
        if self.count == 1:
            return action()
        result = None
        if self.writer:
            try:
                result = action()
            except UserError as error:
                self._writers_outcome(str(error))
                raise
        failure = self._writers_outcome(None)
        if failure is not None:
            raise distributed.ReplicaFailed(f"rank 0 stopped: {failure}", quiet=True)
        return result

    def _writers_outcome(self, failure: str | None) -> str | None:
        """What the writer failed with (None: it did not), learnt by every replica."""
        # surrogateescape: a path's undecodable bytes, as Python holds them, travel as they were
        writers = self.gather([] if failure is None else [1, *failure.encode(errors="surrogateescape")])[0]
        return bytes(writers[1:]).decode(errors="surrogateescape") if writers else None

    def gather(self, values: list[int]) -> list[list[int]]:
        """(Here int64s, and their number may differ between replicas: writer_first's does.)"""
        if self.count == 1:
            return [list(values)]
        with translate_failures():
            lengths = [row[0] for row in self._all_gather(torch.tensor([len(values)], dtype=torch.int64))]
            row = torch.zeros(max(*lengths, 1), dtype=torch.int64)
            row[:len(values)] = torch.tensor(values, dtype=torch.int64)
            rows = self._all_gather(row)
            # every replica through the gather before any leaves on what it gathered
            dist.barrier(group=self.control_group)
        return [row[:length] for row, length in zip(rows, lengths)]

    def _all_gather(self, row: torch.Tensor) -> list[list[int]]:
        rows = [_lend(torch.empty_like(row)) for _ in range(self.count)]
        dist.all_gather(rows, _lend(row), group=self.control_group)
        return [gathered.tolist() for gathered in rows]


# torch 2.13 renamed broadcast_buffers to forward_sync_buffers (deprecated, with a warning);
# older releases (CUDA machines run 2.11) know only the first.
_PER_REPLICA_BUFFERS = ({"forward_sync_buffers": False}
                        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                        else {"broadcast_buffers": False})


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


# How gloo and NCCL word a peer that went away, when they raise a bare RuntimeError.
_TRANSPORT_FAILURES = ("gloo", "nccl", "connection", "closed by peer", "broken pipe", "timed out")


@contextlib.contextmanager
def translate_failures():
    """A collective that fails because another replica is gone becomes one line; any other
    error keeps its traceback."""
    try:
        yield
    except (dist.DistError, RuntimeError) as error:
        text = str(error).strip()
        if not isinstance(error, dist.DistError) and not any(word in text.lower() for word in _TRANSPORT_FAILURES):
            raise
        reason = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error))  # gloo's [file:line] prefix
        raise distributed.ReplicaFailed(
            f"lost contact with another replica ({clipped(reason, 80)}): it stopped or died, so this "
            "one stops too; --resume continues from the last checkpoint") from None


def start_replicas(device_type: str, sync_bn: bool, batch_norm: bool = True) -> Replicas:
    """Join the other replicas when torchrun started this process; else a single replica.
    `batch_norm`: the model has some, which --sync-bn on a CPU cannot synchronise (a model
    without is noted as ignoring the flag, as in TensorFlow)."""
    if not launched_by_torchrun():
        if sync_bn:
            raise UsageError("--sync-bn synchronises batch norm across replicas: launch with torchrun")
        return Replicas()
    if sync_bn and batch_norm and device_type != "cuda":
        raise UsageError("--sync-bn needs CUDA GPUs (SyncBatchNorm refuses CPU tensors); "
                         "on CPU each replica keeps its own batch-norm statistics")
    local_rank = _environment_int("LOCAL_RANK", 0)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    # torchrun starts every replica at once and they join within seconds; a longer wait is for
    # replicas that may never come (WORLD_SIZE left in the environment, a launch on one machine
    # of two), and it said nothing for 10 minutes.
    world_size = _environment_int("WORLD_SIZE", 1)
    started, said = time.monotonic(), threading.Event()  # a join that ends after the notice says so too

    def say_what_it_waits_for():
        said.set()
        print(f"waiting for the other {world_size - 1} replica(s) at {os.environ.get('MASTER_ADDR')}:"
              f"{os.environ.get('MASTER_PORT')} (WORLD_SIZE {world_size} in the environment: torchrun's, or "
              f"left over?); up to {int(REPLICA_TIMEOUT.total_seconds()) // 60} minutes, Ctrl-C stops it",
              file=sys.stderr, flush=True)

    notice = threading.Timer(JOIN_NOTICE_S, say_what_it_waits_for)
    notice.daemon = True
    notice.start()
    try:
        with _signals_end_the_join(say=_environment_int("RANK", 0) == 0):
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=REPLICA_TIMEOUT)
    except (dist.DistError, RuntimeError, ValueError) as error:
        raise UserError(f"could not join the other replicas ({first_line(error)})") from None
    finally:
        notice.cancel()
        notice.join()  # a notice already being said is said before the join's outcome
    if said.is_set():
        print(f"joined the other {world_size - 1} replica(s) after {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)
    control_group = dist.new_group(backend="gloo") if device_type == "cuda" else None
    replicas = Replicas(dist.get_rank(), dist.get_world_size(), local_rank, control_group)
    atexit.register(_leave, replicas)
    return replicas


@contextlib.contextmanager
def _signals_end_the_join(say: bool):
    """Ctrl-C or SIGTERM ends the process with one line (`say`: on rank 0 only, as torchrun's
    terminal is every replica's) while it joins. The join waits in C++, where Python's handlers
    run only once it returns, up to 10 minutes later; the interpreter's C handler still writes
    the signal to the wakeup fd, which a thread watches. Nothing is trained yet to be lost."""
    if threading.current_thread() is not threading.main_thread():  # the signals are the main thread's
        yield
        return
    signals_read, signals_written = os.pipe()
    os.set_blocking(signals_written, False)  # as set_wakeup_fd requires

    def watch():
        while received := os.read(signals_read, 64):  # b"": the join has ended
            for signum in set(received) & {signal.SIGINT, signal.SIGTERM}:
                try:
                    if say:
                        print(f"error: interrupted ({signal.Signals(signum).name}) while joining the other "
                              "replicas; nothing was trained", file=sys.stderr, flush=True)
                except OSError:  # a reader gone from stderr (`| tee`, ended by the same Ctrl-C)
                    pass
                finally:
                    os._exit(128 + signum)

    # the C handler writes the fd only for signals that have a Python handler
    previous = {signum: signal.signal(signum, lambda *args: None) for signum in (signal.SIGINT, signal.SIGTERM)}
    previous_fd = signal.set_wakeup_fd(signals_written, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="join-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        os.close(signals_written)
        watcher.join()
        os.close(signals_read)
        for signum, handler in previous.items():  # None: one set outside Python; the default ends the process
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _leave(replicas: Replicas):
    """At exit, while Python can still run every thread: the collectives' tensors freed (_LENT),
    then the process group."""
    replicas._pending_stop = None  # a stop flag never waited for: gloo lets go of it when done
    # an uncaught error's traceback, which Python keeps, holds the frames of a failed collective
    sys.last_type = sys.last_value = sys.last_traceback = None
    wait_for_lent_tensors()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


@dataclass
class Runtime:
    device: torch.device
    precision: str                      # "fp32" | "amp-fp16" | "amp-bf16"
    compute_dtype: torch.dtype | None   # autocast's dtype; None: autocast off (float32)
    scaler: torch.amp.GradScaler        # one per run; enabled for float16 only
    clip_grad_norm: float = 0.0         # 0: off
    replicas: Replicas = field(default_factory=Replicas)  # torchrun's processes; one by default
    sync_bn: bool = False

    @property
    def log(self):
        """print on the replica that writes the run folder; the others keep quiet."""
        return print if self.replicas.writer else _silent

    def data_parallel(self, module: torch.nn.Module) -> torch.nn.Module:
        """What a training step runs a placed network through: under torchrun, DDP, which
        averages its gradients over the replicas at each backward pass (its batch norm
        synchronised across GPUs under --sync-bn); in one process, the network itself."""
        if self.sync_bn:
            module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        return self.replicas.data_parallel(module)

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move a network to the device, convolution weights stored channels_last (NHWC): the
        layout tensor cores and oneDNN's CPU kernels run fastest (DCGAN at 28x28 on a 2-core
        AVX512 CPU: 48.3 -> 41.4 ms/step in float32); no effect on Linear layers."""
        return module.to(self.device, memory_format=torch.channels_last)

    def peak_memory_mb(self) -> float:
        """The CUDA allocator's peak on a GPU; on a CPU the process's peak resident set
        (libraries and data included: compare runs only in fresh processes)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def setup(cfg: RunConfig, log=print) -> Runtime:
    """Join torchrun's other replicas (if any), seed everything (alike in every replica), pick
    the device and the precision, build the (one) GradScaler."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; use --device cpu")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    entry = models.MODELS.get(cfg.model)  # None: train_feature_net.py's classifier, never under torchrun
    batch_norm = entry is None or entry.batch_norm
    replicas = start_replicas("cuda" if use_cuda else "cpu", cfg.sync_bn, batch_norm)
    distributed.check_same_flags(cfg, replicas)
    device = torch.device("cuda", replicas.local_rank) if use_cuda else torch.device("cpu")
    if not replicas.writer:
        log = _silent
    precision = resolve_precision(cfg, device.type,
                                  bf16_supported=not use_cuda or torch.cuda.is_bf16_supported())

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    tf32 = set_tf32(cfg.tf32)
    if use_cuda:
        # Set, not assumed: a CPU run earlier in the same process turned determinism on, and
        # CUDA's cuBLAS refuses it without CUBLAS_WORKSPACE_CONFIG.
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick the fastest kernels
        torch.cuda.reset_peak_memory_stats(device)  # this run's peak, whatever ran before in the process
    else:
        torch.use_deterministic_algorithms(True)  # makes --resume bit-exact
        # ...but without its debugging aid of NaN-filling every new tensor, which made the
        # DCGAN step 10x slower on CPU (aten::fill_ took a third of the time).
        torch.utils.deterministic.fill_uninitialized_memory = False
        # MKL's float32 GEMM sums in an order that depends on the threads it uses, and it may
        # use fewer than asked for when the machine is busy: the same run could end with other
        # weights. Strict CNR mode sums the same way at any thread count; it is read at MKL's
        # first call, which comes after this. A value the user set wins.
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

    warn_if_bf16_emulated(precision, device.type, log)
    note_unused_flags(cfg, precision, device.type, log)
    across = f" | {replicas.count} replicas (DDP, {'NCCL' if use_cuda else 'gloo'})" if replicas.count > 1 else ""
    log(f"{cfg.model} | pytorch {torch.__version__} | {device} | "
        f"{describe_precision(precision, device.type)}{f' | {tf32}' if use_cuda else ''}{across}")
    return Runtime(device, precision, amp.COMPUTE_DTYPES[precision],
                   amp.make_grad_scaler(cfg, device.type, precision), cfg.clip_grad_norm,
                   replicas, cfg.sync_bn and batch_norm)


def set_tf32(mode: str) -> str:
    """--tf32: let CUDA's float32 matmuls and cuDNN's convolutions round their inputs to
    TensorFloat-32 ("on"), or not ("off"); "auto" keeps PyTorch's defaults (matmuls IEEE
    float32, convolutions TF32). The settings are the process's; a CPU ignores them.
    Returns what holds now, for the log line."""
    if mode != "auto":
        # torch >= 2.9's API; mixing it with the older allow_tf32 flags is an error
        precision = "tf32" if mode == "on" else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision
    backends = torch.backends
    # "none" defers to the level above; at the top, PyTorch's defaults
    matmul = _first_set(backends.cuda.matmul.fp32_precision, backends.fp32_precision, default="ieee")
    conv = _first_set(backends.cudnn.conv.fp32_precision, backends.cudnn.fp32_precision, backends.fp32_precision,
                      default="tf32")
    return f"float32 matmuls {matmul}, convolutions {conv}"


def _first_set(*levels: str, default: str) -> str:
    return next((level for level in levels if level != "none"), default)


def _silent(*args, **kwargs):
    pass
