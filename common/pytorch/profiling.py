"""--profile in PyTorch: torch.profiler over the window common/loop.py chooses, a Chrome
trace, and the operations' self times for the table (common/profiling.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from common.profiling import OperationRow


class Profiler:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.clock = "CUDA kernel time" if self.cuda else "CPU time"
        self._profiler = None

    def start(self, folder: Path):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def stop(self, folder: Path) -> tuple[list[OperationRow], str]:
        self._profiler.stop()
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / "trace.json"
        self._profiler.export_chrome_trace(str(trace))
        # Self time, so that the shares add up: on CUDA the kernels' device time, on a CPU the
        # ops'. On CUDA the op that launched a kernel carries the kernel's time too: kernels only,
        # without the GPU spans of annotated regions (the optimizer's step), which hold kernels.
        device = torch.autograd.DeviceType.CUDA if self.cuda else torch.autograd.DeviceType.CPU
        rows = [(event.key, event.count,
                 (event.self_device_time_total if self.cuda else event.self_cpu_time_total) / 1000)
                for event in self._profiler.key_averages()
                if event.device_type == device and not (self.cuda and event.is_user_annotation)]
        self._profiler = None
        return ([row for row in rows if row[2] > 0],
                f"Chrome trace in {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
