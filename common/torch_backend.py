"""Everything PyTorch-specific that is not about one model: device, AMP, data on the device,
optimizers, checkpoints, profiling, and the session the shared training loop drives.

AMP in PyTorch is two independent pieces:
- `torch.amp.autocast(device, dtype)` runs matmuls/convolutions in float16 or bfloat16 while
  the weights stay float32;
- `torch.amp.GradScaler(device)` multiplies the loss so float16 gradients do not underflow,
  unscales before the optimizer step, and skips the step when a gradient is inf/NaN.
  bfloat16 has float32's exponent range, so it needs no scaler: ours is enabled for float16 only.
"""
from __future__ import annotations

import contextlib
import copy
import random
import resource
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common import data as datasets
from common import evaluation, loop, porting
from common.config import (
    RunConfig,
    describe_precision,
    resolve_precision,
    warn_if_bf16_emulated,
)
from common.errors import CheckpointError, UsageError
from common.runs import RunFolder, atomic_write

ADAM_EPS = 1e-8  # set on both frameworks: Keras' default is 1e-7
CHECKPOINT_FORMAT = 1


@dataclass
class Runtime:
    device: torch.device
    precision: str                      # "fp32" | "amp-fp16" | "amp-bf16"
    compute_dtype: torch.dtype | None   # None: autocast off
    scaler: torch.amp.GradScaler
    clip_grad_norm: float = 0.0        # 0: off

    def autocast(self):
        """The mixed-precision region; a no-op context in float32 runs."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.amp.autocast(self.device.type, dtype=self.compute_dtype)

    def place(self, module: nn.Module) -> nn.Module:
        """Move a network to the device; on CUDA, store convolution weights channels_last
        (NHWC), the layout tensor cores run fastest (no effect on Linear layers)."""
        module = module.to(self.device)
        if self.device.type == "cuda":
            module = module.to(memory_format=torch.channels_last)
        return module

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`scaler.step(optimizer)`, clipping the gradient norm first when asked. The clip must
        see the true gradients: under float16 they are still multiplied by the loss scale, so
        they are unscaled in place first (step() then does not unscale them again)."""
        if self.clip_grad_norm:
            self.scaler.unscale_(optimizer)
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm)
        self.scaler.step(optimizer)

    def update_scaler(self) -> torch.Tensor | None:
        """`scaler.update()` once per iteration; returns 1.0 (on the device, no sync) when this
        iteration skipped an optimizer step, which shows as the scale going down."""
        if not self.scaler.is_enabled():
            return None
        before = self.scaler._scale.clone()  # the scale tensor itself; get_scale() would sync
        self.scaler.update()
        return (self.scaler._scale < before).float()


def setup(cfg: RunConfig, log=print) -> Runtime:
    """Seed everything, pick the device and the precision, build the (one) GradScaler."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; use --device cpu")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    precision = resolve_precision(
        cfg, device.type, bf16_supported=not use_cuda or torch.cuda.is_bf16_supported())

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if use_cuda:
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick the fastest kernels
    else:
        torch.use_deterministic_algorithms(True)  # makes --resume bit-exact
        # ...but without its debugging aid of NaN-filling every new tensor, which made the
        # DCGAN step 10x slower on CPU (aten::fill_ took a third of the time).
        torch.utils.deterministic.fill_uninitialized_memory = False

    compute_dtype = {"fp32": None, "amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                  growth_factor=cfg.growth_factor,
                                  backoff_factor=cfg.backoff_factor,
                                  growth_interval=cfg.growth_interval,
                                  enabled=precision == "amp-fp16")
    warn_if_bf16_emulated(precision, device.type, log)
    log(f"{cfg.model} | pytorch {torch.__version__} | {device} | "
        f"{describe_precision(precision, device.type)}")
    return Runtime(device, precision, compute_dtype[precision], scaler, cfg.clip_grad_norm)


class FullPrecision(nn.Module):
    """Run the wrapped layer in float32 even inside autocast (output layers, VAE heads):
    the Keras twin is `layer(..., dtype="float32")`."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        with torch.amp.autocast(x.device.type, enabled=False):
            return self.layer(x.float())


def init_like_keras_dense(module: nn.Module):
    """Glorot-uniform weights and zero biases for every Linear layer: Keras' Dense defaults,
    which the TensorFlow twins set explicitly, so both start from the same distribution."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)


def make_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=ADAM_EPS,
                                 weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=ADAM_EPS)


class DeviceData:
    """The whole training set resident on the device (MNIST is 47 MB as uint8); a batch is
    an index gather plus a scale to the model's range, with no host copy per step."""

    def __init__(self, dataset: datasets.Dataset, device: torch.device, value_range):
        self.dataset = dataset
        self.kind = dataset.kind
        array = dataset.x
        if self.kind == "image":
            array = np.ascontiguousarray(array.transpose(0, 3, 1, 2))  # NHWC -> NCHW
            low, high = value_range
            self.scale, self.shift = (high - low) / 255.0, low
        self.x = torch.from_numpy(array).to(device)
        self.sample_shape = tuple(self.x.shape[1:])
        self.channels_last = self.kind == "image" and device.type == "cuda"

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        return self.to_model(self.x[indices])

    lookup = batch  # the batch of these indices, outside the training sequence

    def to_model(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float in the model's range (points pass through)."""
        if self.kind != "image":
            return rows
        images = rows.float().mul_(self.scale).add_(self.shift)
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images


class _Rows(torch.utils.data.Dataset):
    """A host array a DataLoader worker slices one whole batch at a time."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self):
        return len(self.array)

    def __getitems__(self, indices):
        return torch.from_numpy(self.array[np.asarray(indices)])


def _as_is(batch):
    return batch


class HostLoader(DeviceData):
    """--workers N: the dataset stays in host memory; N persistent DataLoader processes gather
    the batches ahead of the loop (into pinned memory on CUDA, so the copy overlaps compute),
    in the same BatchOrder as the resident path, so both train on identical batches."""

    def __init__(self, dataset: datasets.Dataset, device: torch.device, value_range, workers: int):
        super().__init__(dataset, torch.device("cpu"), value_range)  # host copy, NCHW
        self.device, self.workers = device, workers
        self.channels_last = self.kind == "image" and device.type == "cuda"
        self._batches = None

    def start(self, order, start_step: int, stop_step: int):
        loader = torch.utils.data.DataLoader(
            _Rows(self.x.numpy()), batch_sampler=list(order.batches(start_step, stop_step)),
            collate_fn=_as_is, num_workers=self.workers, persistent_workers=True,
            pin_memory=self.device.type == "cuda", prefetch_factor=4,
            generator=torch.Generator())  # its worker seed must not be drawn from the training RNG
        self._batches = iter(loader)

    def batch(self, indices) -> torch.Tensor:
        """The next prefetched batch: the one `indices` names, as the order is shared."""
        return self.to_model(next(self._batches).to(self.device, non_blocking=True))

    def lookup(self, indices) -> torch.Tensor:
        return self.to_model(self.x[indices.cpu()].to(self.device))


def load_data(cfg: RunConfig, runtime: Runtime, value_range=(-1.0, 1.0)) -> DeviceData:
    dataset = datasets.load_training_set(cfg)
    if cfg.workers:
        return HostLoader(dataset, runtime.device, value_range, cfg.workers)
    return DeviceData(dataset, runtime.device, value_range)


def to_numpy_images(images: torch.Tensor) -> np.ndarray:
    """NCHW device tensor -> NHWC float32 numpy, for sample grids."""
    return images.detach().float().permute(0, 2, 3, 1).cpu().numpy()


class Session:
    """Adapts a model's trainer (its `modules`, `optimizers`, `train_step(real)` and
    `write_samples(run, step)`) to the shared loop in common/loop.py."""

    checkpoint_suffix = "pt"

    def __init__(self, trainer, data: DeviceData, runtime: Runtime):
        self.trainer, self.data, self.runtime = trainer, data, runtime
        self._profiler = None

    def upload_indices(self, permutation: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(permutation.astype(np.int64)).to(self.runtime.device)

    def start(self, order, start_step: int, stop_step: int):
        if isinstance(self.data, HostLoader):
            self.data.start(order, start_step, stop_step)

    def train_step(self, indices: torch.Tensor) -> dict:
        return self.trainer.train_step(self.data.batch(indices))

    def precision_report(self, indices) -> list[tuple]:
        """The dtypes every leaf layer's output had in one forward-and-backward of the real
        training step, recorded by forward hooks; the weights are restored afterwards, so
        the run trains exactly as without the report."""
        rows, hooks = [], []
        for name, module in self.trainer.modules.items():
            for layer_name, layer in module.named_modules():
                if next(layer.children(), None) is not None:
                    continue  # containers: their leaves are reported
                weights = next(layer.parameters(recurse=False), None)
                label = f"{name}.{layer_name}" if layer_name else name

                def record(layer, inputs, output, label=label, weights=weights):
                    output = output[0] if isinstance(output, tuple) else output
                    rows.append((label, type(layer).__name__,
                                 str(weights.dtype).replace("torch.", "") if weights is not None else "-",
                                 str(output.dtype).replace("torch.", "")))
                hooks.append(layer.register_forward_hook(record))
        saved = {k: {n: t.clone() for n, t in m.state_dict().items()} for k, m in self.trainer.modules.items()}
        # state_dict() hands out the live moment tensors, which the probe step updates in place
        optimizers = {k: copy.deepcopy(o.state_dict()) for k, o in self.trainer.optimizers.items()}
        scaler, rng = self.runtime.scaler.state_dict(), torch.get_rng_state()
        cuda = self.runtime.device.type == "cuda"
        cuda_rng = torch.cuda.get_rng_state(self.runtime.device) if cuda else None
        try:
            # Eager: hooks see every layer (a compiled graph fuses them); leaves a host loader's queue alone.
            with torch.compiler.set_stance("force_eager"):
                self.trainer.train_step(self.data.lookup(indices))
        finally:
            for hook in hooks:
                hook.remove()
        for key, module in self.trainer.modules.items():
            module.load_state_dict(saved[key])
        for key, optimizer in self.trainer.optimizers.items():
            optimizer.load_state_dict(optimizers[key])
        if self.runtime.scaler.is_enabled():
            self.runtime.scaler.load_state_dict(scaler)
        torch.set_rng_state(rng)
        if cuda:
            torch.cuda.set_rng_state(cuda_rng, self.runtime.device)
        seen, unique = set(), []
        for row in rows:  # D runs twice per GAN step (real, fake): one row per layer
            if row[0] not in seen:
                seen.add(row[0])
                unique.append(row)
        return unique

    def fetch(self, metrics: dict) -> dict:
        values = torch.stack([v.detach().float() for v in metrics.values()]).tolist()  # one sync
        return dict(zip(metrics, values))

    def loss_scale(self) -> float:
        return float(self.runtime.scaler.get_scale()) if self.runtime.scaler.is_enabled() else 1.0

    def synchronize(self):
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def _inference(self):
        """Eval mode (batch norm on its running statistics) and no autograd, then back."""
        for module in self.trainer.modules.values():
            module.eval()
        try:
            # Under --compile, sample grids and evaluation (other batch sizes, eval mode) run
            # eagerly rather than compiling graphs used once.
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                yield
        finally:
            for module in self.trainer.modules.values():
                module.train()

    def write_samples(self, run: RunFolder, step: int):
        with self._inference():
            self.trainer.write_samples(run, step)

    def evaluate(self, cfg: RunConfig) -> dict:
        with self._inference():
            return evaluation.evaluate(cfg, self.trainer)

    # --- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path: Path, meta: dict):
        state = {
            "format": CHECKPOINT_FORMAT,
            "meta": dict(meta, precision=self.runtime.precision),
            "modules": {k: m.state_dict() for k, m in self.trainer.modules.items()},
            "optimizers": {k: o.state_dict() for k, o in self.trainer.optimizers.items()},
            "scaler": self.runtime.scaler.state_dict(),
            "rng": {"cpu": torch.get_rng_state()},
        }
        if self.runtime.device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.runtime.device)
        atomic_write(path, lambda file: torch.save(state, file))

    def restore(self, path: Path) -> dict:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # zip/pickle errors have many types; all mean "unreadable"
            raise CheckpointError(f"checkpoint {path} is unreadable ({type(error).__name__}); "
                                  "delete it to resume from the one before") from None
        try:
            if state.get("format") != CHECKPOINT_FORMAT:
                raise ValueError("not a checkpoint of this repository")
            for name, module in self.trainer.modules.items():
                module.load_state_dict(state["modules"][name])
            for name, optimizer in self.trainer.optimizers.items():
                optimizer.load_state_dict(state["optimizers"][name])
            if self.runtime.scaler.is_enabled():
                self.runtime.scaler.load_state_dict(state["scaler"])
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and self.runtime.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.runtime.device)
            return state["meta"]
        except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise CheckpointError(f"checkpoint {path} does not fit this model "
                                  f"({type(error).__name__}: {first_line})") from None

    # --- measurement -------------------------------------------------------------------
    def peak_memory_mb(self) -> float:
        if self.runtime.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.runtime.device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    def profile_start(self, folder: Path):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.runtime.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def profile_stop(self, folder: Path) -> tuple[list, str]:
        self._profiler.stop()
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / "trace.json"
        self._profiler.export_chrome_trace(str(trace))
        # Self time, so that the shares add up: on CUDA the kernels' device time, on a CPU the ops'.
        cuda = self.runtime.device.type == "cuda"
        rows = [(event.key, event.count,
                 (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1000)
                for event in self._profiler.key_averages()]
        self._profiler = None
        return ([row for row in rows if row[2] > 0],
                f"Chrome trace in {trace} (open in https://ui.perfetto.dev or chrome://tracing)")


def fit(cfg: RunConfig, runtime: Runtime, trainer, data: DeviceData, log=print) -> dict:
    """Start from --init-from's weights if given, prepare the run folder, save the initial
    weights there (in the layout both frameworks read), and hand the trainer to the loop."""
    shape = data.dataset.sample_shape
    if cfg.init_from and not cfg.resume:
        source = porting.start_from(cfg.init_from, trainer.modules,
                                    lambda module, layers: porting.torch_import(module, layers, shape),
                                    shape)
        log(f"initial weights from {source}")
    run = RunFolder.prepare(cfg, runtime.precision, {
        "device": str(runtime.device), "versions": {"torch": torch.__version__,
                                                    "numpy": np.__version__}})
    log(f"run folder: {run.path}")
    if not cfg.resume:
        porting.save_initial_weights(
            run.path, {name: porting.torch_export(module, shape)
                       for name, module in trainer.modules.items()},
            {"model": cfg.model, "framework": "pytorch", "seed": cfg.seed,
             "sample_shape": list(shape)})
    if cfg.compile:
        for module in trainer.modules.values():
            # In place (nn.Module.compile): state_dict keys, hence checkpoints and porting, stay
            # as they are. Static shapes: one graph per input shape (sampling and evaluation run
            # eagerly, see Session._inference).
            module.compile(dynamic=False)
    return loop.train(cfg, run, Session(trainer, data, runtime), len(data), log=log)
