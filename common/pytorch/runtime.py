"""What a PyTorch run runs on: seeds, device, precision and the loss scaler, set up once."""
from __future__ import annotations

import os
import random
import resource
from dataclasses import dataclass

import numpy as np
import torch

from common.config import RunConfig, describe_precision, resolve_precision, warn_if_bf16_emulated
from common.errors import UsageError
from common.pytorch import amp


@dataclass
class Runtime:
    device: torch.device
    precision: str                      # "fp32" | "amp-fp16" | "amp-bf16"
    compute_dtype: torch.dtype | None   # autocast's dtype; None: autocast off (float32)
    scaler: torch.amp.GradScaler        # one per run; enabled for float16 only
    clip_grad_norm: float = 0.0         # 0: off

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
    """Seed everything, pick the device and the precision, build the (one) GradScaler."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; use --device cpu")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    precision = resolve_precision(cfg, device.type,
                                  bf16_supported=not use_cuda or torch.cuda.is_bf16_supported())

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
        # MKL's float32 GEMM sums in an order that depends on the threads it uses, and it may
        # use fewer than asked for when the machine is busy: the same run could end with other
        # weights. Strict CNR mode sums the same way at any thread count; it is read at MKL's
        # first call, which comes after this. A value the user set wins.
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

    warn_if_bf16_emulated(precision, device.type, log)
    log(f"{cfg.model} | pytorch {torch.__version__} | {device} | "
        f"{describe_precision(precision, device.type)}")
    return Runtime(device, precision, amp.COMPUTE_DTYPES[precision],
                   amp.make_grad_scaler(cfg, device.type, precision), cfg.clip_grad_norm)
