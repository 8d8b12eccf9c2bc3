"""The PyTorch session the shared loop drives (the `Session` contract of common/loop.py),
and `fit`, the last call of every PyTorch model's main(). common/tensorflow/session.py is the
twin."""
from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from common import evaluation, loop
from common.config import RunConfig, batch_division, check_batch_among_replicas
from common.errors import UserError, described, file_system_problem, out_of_memory_problem
from common.pytorch import amp
from common.pytorch import porting as torch_porting
from common.pytorch.checkpoint import Checkpoints
from common.pytorch.data import DeviceData, HostLoader
from common.pytorch.ema import ExponentialMovingAverage
from common.pytorch.precision_report import precision_report
from common.pytorch.profiling import Profiler
from common.pytorch.runtime import Runtime, translate_failures
from common.pytorch.tensorboard import Writer
from common.runs import BatchOrder, RunFolder


class Trainer(Protocol):
    """What a model hands to the session: its networks and optimizers (checkpointed by name),
    the averaged copies of its networks under --ema-decay (by the network's name; checkpointed
    too), its training step, and its sample grids. Generators also have `sample(z)`, the VAE
    `encode(x)` and `decode_logits(z)`, for common/evaluation.py."""

    modules: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    averages: dict[str, ExponentialMovingAverage]
    cfg: RunConfig  # its flags: the session reads how its batch divides (config.batch_division)
    z_dim: int
    noise_shape: tuple[int, int]  # the sample grids' fixed noise: (rows, width)

    def train_step(self, batch: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def write_samples(self, run: RunFolder, step: int) -> None: ...


class Session:
    def __init__(self, trainer: Trainer, data: DeviceData, runtime: Runtime):
        self.trainer, self.data, self.runtime = trainer, data, runtime
        self.precision = runtime.precision
        self.checkpoints = Checkpoints(trainer, runtime)
        self.noise_shape = trainer.noise_shape
        self.profiler = Profiler(runtime.device)
        self.replicas = runtime.replicas
        self.batch_parts = batch_division(trainer.cfg)[0]  # WGAN-GP: its critic batches

    def _local(self, indices):
        """This replica's examples of the global batch (all of them in one process)."""
        return self.replicas.shard(indices, self.batch_parts)

    def start(self, order: BatchOrder, start_step: int, stop_step: int):
        if isinstance(self.data, HostLoader):
            self.data.start(order, start_step, stop_step, self._local)

    def stop_loading(self):
        if isinstance(self.data, HostLoader):
            self.data.stop()

    def upload_batches(self, batches: np.ndarray) -> tuple[torch.Tensor, ...]:
        return torch.from_numpy(batches.astype(np.int64)).to(self.runtime.device).unbind()

    def train_step(self, indices: torch.Tensor) -> dict:
        if self.replicas.count == 1:
            return self.train_on(self.data.batch(indices))
        with translate_failures():  # DDP's all-reduce, inside backward, finds a replica gone
            return self.train_on(self.data.batch(self._local(indices)))

    def train_on(self, batch: torch.Tensor) -> dict:
        """The model's training step on a batch, plus "skipped" under float16: the step's own
        flag where it reports one (WGAN-GP, whose several updates amp.SkippedUpdates
        watches), else whether the scale went down over the step, exact for one update()."""
        scale_before = amp.scale_on_device(self.runtime.scaler, self.runtime.device)
        metrics = self.trainer.train_step(batch)
        if scale_before is not None and "skipped" not in metrics:  # update() backs off after a skip
            metrics = {**metrics, "skipped": amp.scale_went_down(self.runtime.scaler, scale_before)}
        return metrics

    def fetch(self, metrics: dict) -> dict:
        values = self.replicas.mean(torch.stack([v.detach().float() for v in metrics.values()]))
        return dict(zip(metrics, values.tolist()))  # one sync

    def stop_signal(self, signum: int) -> int:
        return self.replicas.stop_signal(signum)

    def loss_scale(self) -> float:
        return amp.loss_scale(self.runtime.scaler)

    def synchronize(self):
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize()

    def precision_report(self, indices) -> list[tuple]:
        # lookup(): the batch without taking it from a host loader's queue
        return precision_report(self.trainer, self.runtime, self.data.lookup(self._local(indices)))

    @contextlib.contextmanager
    def _inference(self):
        """Eval mode (batch norm on its running statistics), no autograd, and the run's
        precision (autocast, as in the training step), then back to training."""
        modules = [*self.trainer.modules.values(), *(a.module for a in self.trainer.averages.values())]
        for module in modules:
            module.eval()
        dtype = self.runtime.compute_dtype
        try:
            # Under --compile, sample grids and evaluation (other batch sizes, eval mode) run
            # eagerly rather than compiling graphs used once.
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), \
                    torch.autocast(device_type=self.runtime.device.type, dtype=dtype, enabled=dtype is not None):
                yield
        finally:
            for module in modules:
                module.train()

    def write_samples(self, run: RunFolder, step: int):
        with self._inference():
            self.trainer.write_samples(run, step)

    def evaluate(self, cfg: RunConfig, keep=None) -> dict:
        with self._inference():
            return evaluation.evaluate(cfg, self.trainer, keep=keep)

    def peak_memory_mb(self) -> float:
        return self.runtime.peak_memory_mb()

    def gpu_name(self) -> str | None:
        device = self.runtime.device
        return torch.cuda.get_device_name(device) if device.type == "cuda" else None

    def open_tensorboard(self, folder: Path, purge_step: int) -> Writer:
        return Writer(folder, purge_step)


def fit(cfg: RunConfig, runtime: Runtime, trainer: Trainer, data: DeviceData) -> dict:
    """Open the run folder (with --init-from's weights, if given), compile the networks under
    --compile, and hand the trainer to the shared loop. Under torchrun only rank 0 writes
    and prints."""
    shape = data.dataset.sample_shape
    replicas = runtime.replicas
    check_batch_among_replicas(cfg, replicas.count, quiet=not replicas.writer)
    run = loop.open_run(
        cfg, runtime.precision, {"device": str(runtime.device), "replicas": replicas.count,
                                 "versions": {"torch": torch.__version__, "numpy": np.__version__}},
        trainer.modules, export_weights=lambda module: torch_porting.export_weights(module, shape),
        import_weights=lambda module, layers: torch_porting.import_weights(module, layers, shape),
        sample_shape=shape, replicas=replicas, log=runtime.log)
    for name, average in trainer.averages.items():  # a resumed run's checkpoint then overwrites it
        average.start_from(trainer.modules[name])
    if cfg.compile:
        for module in trainer.modules.values():
            # In place (nn.Module.compile): state_dict keys, hence checkpoints and porting, stay
            # as they are. Static shapes: one graph per input shape (sampling and evaluation run
            # eagerly, see Session._inference).
            module.compile(dynamic=False)
    with compiler_failures(cfg.compile, quiet=not replicas.writer):
        return loop.train(cfg, run, Session(trainer, data, runtime), len(data), log=runtime.log)


# Where torch.compile's errors come from: its tracer, AOT autograd, inductor and the code
# inductor generated (a file under torchinductor_<user>/, or under TORCHINDUCTOR_CACHE_DIR).
COMPILER_FRAMES = ("/torch/_dynamo/", "/torch/_functorch/", "/torch/_inductor/", "/torchinductor_")


@contextlib.contextmanager
def compiler_failures(compiling: bool, quiet: bool = False):
    """Under --compile, an error of torch.compile's own is one line naming the compiler, not
    the compiler's traceback. PyTorch 2.11's inductor, for one, mispredicts the strides of a
    transposed convolution's weight gradient on CUDA (pytorch/pytorch#171622) and fails
    DCGAN's first step (in float32; at 64x64 in float16 too). An error the model's own code
    raises inside a compiled network keeps its traceback."""
    try:
        yield
    except Exception as error:
        if (not compiling or isinstance(error, UserError) or out_of_memory_problem(error)
                or file_system_problem(error) or not raised_by_compiler(error)):
            raise
        raise UserError(f"torch.compile failed in PyTorch {torch.__version__} ({described(error)[:200]}); "
                        "train without --compile", quiet=quiet) from error


def raised_by_compiler(error: BaseException) -> bool:
    """Dynamo's own exceptions (a backend that failed to compile, say), or an error raised in
    the compiler's code or the code it generated: the innermost frame, not any frame, since
    every call of a compiled network passes through Dynamo's."""
    from torch._dynamo.exc import TorchDynamoException

    frames = traceback.extract_tb(error.__traceback__)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # a folder of any name
    parts = COMPILER_FRAMES + ((os.path.join(os.path.abspath(cache), "").replace("\\", "/"),) if cache else ())
    return isinstance(error, TorchDynamoException) or bool(
        frames and any(part in frames[-1].filename.replace("\\", "/") for part in parts))
