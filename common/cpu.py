"""What kind of x86 CPU this is, as far as mixed precision cares: benchmarks and reports name it.

bfloat16 is native with AVX512-BF16 (dot products) and AMX (tile matrix multiplies); on an
AVX2-only CPU the frameworks emulate it and AMP runs slower than float32.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

BF16_FEATURES = ("avx512_bf16", "amx_bf16")


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None  # not Linux


def describe() -> dict:
    """{'model': ..., 'avx512_bf16': bool|None, 'amx_bf16': bool|None, 'cores': int}; None: unknown."""
    text = _cpuinfo()
    model = platform.processor() or platform.machine()
    flags: set[str] | None = None  # an ARM CPU's /proc/cpuinfo has "Features", no x86 "flags"
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = (flags or set()) | set(value.split())
    return {"model": model, "cores": os.cpu_count(),
            **{feature: (feature in flags) if flags is not None else None for feature in BF16_FEATURES}}


def native_bf16() -> bool | None:
    """AVX512-BF16 or AMX: True or False; None where it cannot be told (no /proc/cpuinfo, or
    one without x86 flags: an ARM CPU, some of which compute bfloat16 natively)."""
    info = describe()
    if info["amx_bf16"] is None:
        return None
    return bool(info["avx512_bf16"] or info["amx_bf16"])


def has_native_bf16() -> bool:
    """native_bf16(), True where it cannot be told: a warning of emulation does not guess."""
    return native_bf16() is not False


def demo_precision_flag() -> str:
    """`make demo`'s precision: --amp where bfloat16 is known to be native, float32 ("")
    elsewhere, an unknown CPU included (an Intel Mac emulates it, 11.6x slower in PyTorch)."""
    return "--amp" if native_bf16() else ""


def summary(info: dict | None = None) -> str:
    """One line: 'Intel(R) Xeon(R) ..., 2 cores, avx512_bf16 yes, amx_bf16 no'."""
    info = describe() if info is None else info
    marks = {True: "yes", False: "no", None: "unknown"}
    return f"{info['model']}, {info['cores']} cores, " + ", ".join(
        f"{feature} {marks[info[feature]]}" for feature in BF16_FEATURES)


NOT_RECORDED = "not recorded (a run from before summary.json kept it)"


def recorded(info) -> str:
    """summary() of a run's recorded "cpu", or what is wrong with it (an edited file)."""
    if info is None:
        return NOT_RECORDED
    if (not isinstance(info, dict) or not isinstance(info.get("model"), str)
            or not isinstance(info.get("cores"), (int, type(None)))
            or not all(feature in info and isinstance(info[feature], (bool, type(None))) for feature in BF16_FEATURES)):
        return "unreadable (summary.json's \"cpu\" is not what a run writes)"
    return summary(info)


def gpu_part(gpu) -> str:
    """'; GPU: name' for a run's recorded GPU, on one line; '' for none (a CPU run)."""
    return f"; GPU: {' '.join(gpu.split())}" if isinstance(gpu, str) else ""


def machine(record: dict) -> str:
    """'CPU: ...' of a run's summary.json (its "cpu"), with '; GPU: name' when it ran on one."""
    return f"CPU: {recorded(record.get('cpu'))}{gpu_part(record.get('gpu'))}"


def measured_on(runs: list[tuple[str, dict]]) -> list[str]:
    """machine() lines for (run, its summary.json, or a dict with its "cpu" and "gpu") pairs:
    one line when the runs share a machine, else one per machine naming its runs."""
    machines: dict[str, list[str]] = {}
    for run, record in runs:
        machines.setdefault(machine(record), []).append(run)
    return [line + (f" ({', '.join(names)})" if len(machines) > 1 else "") for line, names in machines.items()]
