"""The training set on the device, or behind a host loader (--workers), in PyTorch
(common/tensorflow/data.py is the twin)."""
from __future__ import annotations

import atexit
import signal

import numpy as np
import torch

from common import data as datasets
from common import distributed
from common.config import RunConfig


class DeviceData:
    """The whole training set resident on the device (MNIST is 47 MB as uint8); a batch is
    an index gather plus a scale to the model's range, with no host copy per step."""

    def __init__(self, dataset: datasets.Dataset, device: torch.device, value_range):
        self.dataset = dataset
        self.kind = dataset.kind
        self.value_range = value_range  # the model's, which samples are mapped back from
        array = dataset.x
        if self.kind == "image":
            array = np.ascontiguousarray(array.transpose(0, 3, 1, 2))  # NHWC -> NCHW
            low, high = value_range
            self.scale, self.shift = (high - low) / 255.0, low
        self.x = torch.from_numpy(array).to(device)
        self.sample_shape = tuple(self.x.shape[1:])

    def __len__(self):
        return self.x.shape[0]

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        return self.to_model(self.x[indices])

    lookup = batch  # the batch of these indices, outside the training sequence

    def to_model(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float in the model's range, channels_last like the networks'
        weights (Runtime.place); points pass through."""
        if self.kind != "image":
            return rows
        return rows.float().mul_(self.scale).add_(self.shift).contiguous(memory_format=torch.channels_last)


class _Rows(torch.utils.data.Dataset):
    """A host array a DataLoader worker slices one whole batch at a time."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self):
        return len(self.array)

    def __getitems__(self, indices):
        return torch.from_numpy(self.array[np.asarray(indices)])


class _BatchSampler:
    """The order's batches from start to stop, each drawn as the loader asks for it: a list of
    them all, made before the first step, grew with --iters (780 MB and 4.5 s at 2,000,000)."""

    def __init__(self, order, start_step: int, stop_step: int, local):
        self.order, self.start_step, self.stop_step, self.local = order, start_step, stop_step, local

    def __len__(self):
        return max(0, self.stop_step - self.start_step)

    def __iter__(self):
        return (self.local(batch) for batch in self.order.batches(self.start_step, self.stop_step))


def _as_is(batch):
    return batch


def _leave_stop_signals_to_the_loop(worker_id: int) -> None:
    """Ctrl-C and SIGTERM reach the workers too: from a terminal or `kill -TERM -- -PGID` (the
    process group), and from a stop that signals every process (systemd, Slurm's scancel). A
    worker one killed made the DataLoader raise at once, mid-step (PyTorch's SIGCHLD handler),
    with a traceback and no checkpoint. The workers ignore both; the loop, which gets them too,
    finishes its step, checkpoints, and stops the loader (HostLoader.stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class HostLoader(DeviceData):
    """--workers N: the dataset stays in host memory; N persistent DataLoader processes gather
    the batches ahead of the loop (into pinned memory on CUDA, so the copy overlaps compute),
    in the same BatchOrder as the resident path, so both train on identical batches."""

    def __init__(self, dataset: datasets.Dataset, device: torch.device, value_range, workers: int):
        super().__init__(dataset, torch.device("cpu"), value_range)  # host copy, NCHW
        self.device, self.workers = device, workers
        self._batches = None

    def start(self, order, start_step: int, stop_step: int, local=lambda indices: indices):
        """`local`: a global batch's indices -> this replica's (data-parallel runs)."""
        loader = torch.utils.data.DataLoader(
            _Rows(self.x.numpy()), batch_sampler=_BatchSampler(order, start_step, stop_step, local),
            collate_fn=_as_is, num_workers=self.workers, persistent_workers=True,
            pin_memory=self.device.type == "cuda", prefetch_factor=4,
            worker_init_fn=_leave_stop_signals_to_the_loop,
            generator=torch.Generator())  # its worker seed must not be drawn from the training RNG
        self._batches = iter(loader)
        # before multiprocessing's own exit handler (registered earlier, so run later), which would
        # end the workers with SIGTERM, which they ignore, and then wait for them
        atexit.register(self.stop)

    def stop(self):
        """Shut the workers down, as the loader's iterator does when it is collected."""
        atexit.unregister(self.stop)
        batches, self._batches = self._batches, None
        if batches is None:
            return
        try:
            batches._shutdown_workers()  # PyTorch's own (private) shutdown: a done event, then a join
        finally:  # cut short (a second Ctrl-C): the workers ignore SIGTERM, and exit would wait for them
            for worker in getattr(batches, "_workers", []):
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=10)

    def batch(self, indices) -> torch.Tensor:
        """The next prefetched batch: the one `indices` names, as the order is shared."""
        return self.to_model(next(self._batches).to(self.device, non_blocking=True))

    def lookup(self, indices) -> torch.Tensor:
        return self.to_model(self.x[indices.cpu()].to(self.device))


def load_data(cfg: RunConfig, runtime, value_range: tuple[float, float]) -> DeviceData:
    """The training set, resident on the device (or a host loader under --workers); under
    torchrun the replicas first check they all hold the same one, before networks are built
    from its shape."""
    dataset = datasets.load_training_set(cfg)
    distributed.check_same_data(dataset.x, runtime.replicas)
    if cfg.workers:
        return HostLoader(dataset, runtime.device, value_range, cfg.workers)
    return DeviceData(dataset, runtime.device, value_range)


def to_numpy_images(images: torch.Tensor) -> np.ndarray:
    """NCHW device tensor -> NHWC float32 numpy, for sample grids."""
    return images.detach().float().permute(0, 2, 3, 1).cpu().numpy()
