"""What does AMP buy on this machine? Median step time, samples/s, speedup over float32 and
peak memory for every model x framework x precision, each configuration in a fresh process.

    python scripts/benchmark.py                                   # everything, this machine
    python scripts/benchmark.py --models dcgan --iters 300        # one model
    python scripts/benchmark.py --precisions fp32 amp-fp16 amp-bf16   # on CUDA: both 16-bit types
    python scripts/benchmark.py --compiled                        # also torch.compile / XLA rows
    python scripts/benchmark.py --models vanilla_gan --repeat 3   # median of 3 runs, with the range
    python scripts/benchmark.py --workers 2                       # also rows with the host loader
    python scripts/benchmark.py --preset paper-dcgan              # DCGAN at the paper's size (below)
    python scripts/benchmark.py --models vanilla_gan --replicas 2  # also 2 data-parallel replicas

The paper-dcgan preset is the DCGAN of Radford et al. and of the PyTorch DCGAN example:
64x64 images (MNIST resized), width 64 (ngf = ndf = 64), batch 64, 40 steps; flags given
after it win (`--preset paper-dcgan --batch-size 256`).

A configuration is the model's own script run with `--iters N --log-every W` and no sampling
or checkpointing until the end; its summary.json gives the median of the per-interval step
times, leaving out the first interval (graph tracing, allocator and cuDNN warm-up). Peak
memory is the CUDA allocator's peak on a GPU and the process's peak resident set on a CPU
(libraries included). The load average before each configuration is recorded: another
process on the machine slows PyTorch's CPU threads sharply, so take figures on a quiet one.
The CPU is recorded too (model, cores, AVX512-BF16 and AMX present or not): what bfloat16
costs depends on it more than on anything else.
--replicas N adds, for each configuration, a row of N data-parallel replicas at the same
global batch (PyTorch: torchrun, DDP, N processes; TensorFlow: --distribute mirrored
--replicas N, one process: N GPUs, or N logical CPU devices); "scaling" is its throughput
over N times the one-replica row's. On a CPU every PyTorch process then runs one thread and
every TensorFlow op one thread, in the one-replica rows too, so the figure is the cost of the
all-reduces on this machine; on GPUs it is the scaling efficiency. XLA is not measured
under --distribute (the scripts refuse it).
Other flags go to every configuration, checked first as the model scripts read them (a typo
is one line before anything runs); those that would change what a row is named for (--amp,
--amp-dtype, --tf32, --compile, --xla, --distribute) are refused: --precisions, --compiled
and --replicas set them.
A configuration that fails (on CUDA, PyTorch 2.11 cannot compile DCGAN's step: README), or
that its script refuses when the flags are read (WGAN-GP under torch.compile), says why at
once and is not run again (under --repeat its earlier runs still make its row); the
others are measured, the table lists the failures under it, and the benchmark ends with exit
status 1. If every configuration fails, the last table stays as it was.
Written: <out>/benchmark.md and benchmark.json (default --out runs/benchmark).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import cpu, flags, models
from common.config import MAX_REPLICAS, MAX_WORKERS, build_parser, check_batch_among_replicas, parse_args
from common.errors import Interrupted, UsageError, UserError, escaped_line_breaks, exit_on_user_error, run_child
from common.runs import RunFolder, atomic_write, refuse_inside_a_run, strict_json, text_bytes

# Every row names TensorFloat-32 (a GPU's float32 matmuls and convolutions with a 10-bit
# mantissa): off, so that fp32 is IEEE float32 and the AMP rows differ from it by autocast
# alone, except fp32-tf32's, the float32 a GPU gives by default in TensorFlow (in PyTorch, its
# convolutions). A CPU ignores it.
PRECISION_FLAGS = {"fp32": ["--tf32", "off"], "fp32-tf32": ["--tf32", "on"],
                   "amp-bf16": ["--amp", "--amp-dtype", "bfloat16", "--tf32", "off"],
                   "amp-fp16": ["--amp", "--amp-dtype", "float16", "--tf32", "off"]}
COMPILERS = {"pytorch": ("torch.compile", "--compile"), "tensorflow": ("XLA", "--xla")}
# What each row is named for, set per configuration: given among the other flags, they won
# (the last value does) and a row named fp32 measured AMP.
OWN_FLAGS = {"--amp": "--precisions", "--amp-dtype": "--precisions", "--tf32": "--precisions (fp32-tf32)",
             "--compile": "--compiled", "--xla": "--compiled", "--distribute": "--replicas",
             "--out": "--out (the benchmark's folder)", "--overwrite": "nothing (each run starts over)",
             "--resume": "nothing (each run starts over)"}
# What would add its own work to the measurements, its output not kept: the peak memory (a row
# with both peaked at 482 MB against 400), and --profile's to the steps it traces (5 to 15,
# timed unless --log-every puts them in the first interval, which the median leaves out).
UNTIMED_FLAGS = ("--profile", "--precision-report")
# Bounds of the counts below, far past any use: a typo (an extra zero) ends in a message, not in
# a benchmark that runs for days. Each configuration is a fresh process, 300 steps by default.
MAX_REPEAT = 100          # runs of every configuration; the median settles within a few
MAX_ITERS = 1_000_000     # steps of each run: hours even for the fastest configuration
PRESETS = {
    "paper-dcgan": dict(models=["dcgan"], iters=40, log_every=10,
                        flags=["--image-size", "64", "--width", "64", "--batch-size", "64"]),
}


def run_folder(model: str, framework: str, precision: str, compiled: bool, workers: int, replicas: int,
               args) -> Path:
    return args.out / model / (f"{framework}-{precision}{'-compiled' if compiled else ''}"
                               f"{f'-workers{workers}' if workers else ''}"
                               f"{f'-replicas{replicas}' if args.replicas else ''}")


# A configuration's folder has the layout of a training run's (runs/<model>/<framework>-<precision>),
# and the script is run with --overwrite there: `--out runs` would delete trained runs. So the
# benchmark marks the runs it makes ("benchmark": true in config.json) and replaces no other.
def check_replaceable(folder: Path) -> None:
    """One UserError line unless `folder` is new, empty, or holds a run a benchmark made."""
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return
    config = RunFolder(folder).read_config()
    if config is None or config.get("benchmark") is not True:
        held = "a run the benchmark did not make" if config else "files that are not a run"
        raise UserError(f"{folder} holds {held}, which the benchmark would delete; "
                        "pass another --out (default runs/benchmark)")


def mark_as_benchmark(folder: Path) -> None:
    config = RunFolder(folder).read_config()
    if config is not None and config.get("benchmark") is not True:
        atomic_write(folder / "config.json", lambda f: f.write(
            json.dumps({**config, "benchmark": True}, indent=2, sort_keys=True).encode()))


def configuration_name(model: str, framework: str, precision: str, compiled: bool, workers: int,
                       replicas: int) -> str:
    compiler = COMPILERS[framework][0]
    return (f"{model} {framework} {precision}{f' {compiler}' if compiled else ''}"
            f"{f' {workers} workers' if workers else ''}{f' x{replicas}' if replicas > 1 else ''}")


def script_flags(model: str, framework: str, precision: str, compiled: bool, workers: int, replicas: int,
                 args) -> list[str]:
    """A configuration's flags to its model script, the user's other flags last."""
    tf_replicas = replicas > 1 and framework == "tensorflow"  # PyTorch's run under torchrun (measure)
    distribute = ["--distribute", "mirrored", "--replicas", str(replicas)] if tf_replicas else []
    # --sync-bn is the replica rows': one replica has nothing to synchronise, and both scripts refuse it there
    others = args.flags if replicas > 1 else [flag for flag in args.flags if flag != "--sync-bn"]
    return ["--iters", str(args.iters), "--log-every", str(args.log_every), "--sample-every", "0",
            "--checkpoint-every", "0", *PRECISION_FLAGS[precision], *([COMPILERS[framework][1]] if compiled else []),
            "--workers", str(workers), *distribute, *others]


@functools.cache
def torch_sees_a_gpu() -> bool:
    """Asked only for --device cuda: each PyTorch configuration's process started, loaded its
    data and failed in turn (TensorFlow, which the CPU build of PyTorch does not speak for,
    answers in its own runs)."""
    import torch

    return torch.cuda.is_available()


def check_other_flags(configurations: list[tuple], args) -> dict[tuple, str]:
    """The flags handed on, checked before the first run as each model script reads them: a
    typo made every configuration fail in turn, and the empty table replaced the last one.
    Returns the configurations a script refuses (WGAN-GP under torch.compile) with why: the
    others are still measured, unless none is left."""
    entry = models.get(configurations[0][0])
    script_options = build_parser(entry.key, configurations[0][1], entry.hparams.DEFAULTS)._option_string_actions
    for flag in args.flags:
        name = flag.split("=")[0]  # a prefix names a flag (--amp-d for --amp-dtype), in the scripts as here
        meant = {full for full in script_options if name.startswith("--") and full.startswith(name)}
        refused_here = (*OWN_FLAGS, *UNTIMED_FLAGS)
        own = [full for full in refused_here if full in meant]
        # an ambiguous prefix (--d: --device, --distribute, ...) is the script's parser's to refuse
        if own and (name in refused_here or meant <= set(refused_here)):
            typed = f" (typed {name})" if name != own[0] else ""
            if own[0] in UNTIMED_FLAGS:
                raise UsageError(f"{own[0]}{typed} would add its own work to the measurements (the peak memory, "
                                 "and the steps --profile traces): use it on a model script")
            raise UsageError(f"{own[0]}{typed} is set for each configuration by the benchmark; use {OWN_FLAGS[own[0]]}")
    refused = {}
    for configuration in configurations:
        try:  # an unknown flag or a bad value: the script's parser's one line, exit 2, at once
            cfg = parse_args(*configuration[:2], script_flags(*configuration, args))
            _, framework, *_, replicas = configuration
            if cfg.device == "cuda" and framework == "pytorch" and not torch_sees_a_gpu():
                raise UsageError("--device cuda, but PyTorch sees no CUDA GPU; use --device cpu")
            if replicas > 1 and framework == "pytorch":  # torchrun's replicas: the script checks once started
                check_batch_among_replicas(cfg, replicas)
        except UsageError as error:
            refused[configuration] = f"{configuration_name(*configuration)} refused: {error}"
    if refused and len(refused) == len(configurations):
        raise UsageError(next(iter(refused.values())))
    return refused


def measure(model: str, framework: str, precision: str, compiled: bool, workers: int, replicas: int, args) -> dict:
    compiler = COMPILERS[framework][0] if compiled else "-"
    loader = f"{workers} workers" if workers else "resident"
    folder = run_folder(model, framework, precision, compiled, workers, replicas, args)  # main() checked it
    launcher = [sys.executable]
    if replicas > 1 and framework == "pytorch":
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(replicas)]
    environment = dict(os.environ)
    if args.replicas:  # in both rows: PyTorch one thread per process (torchrun's default), TensorFlow per op
        environment.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
    # absolute: a folder that starts with "-" (--out ./-b) would be read as a flag
    command = [*launcher, str(models.MODELS[model].script(framework)), "--out", os.path.abspath(folder), "--overwrite",
               *script_flags(model, framework, precision, compiled, workers, replicas, args)]
    load = os.getloadavg()[0]
    name = configuration_name(model, framework, precision, compiled, workers, replicas)
    print(f"benchmark: {name} (load average {load:.2f})", flush=True)
    try:
        result = run_child(command, f"the benchmark stopped at {name}; no table was written",
                           capture_output=True, text=True, errors="backslashreplace", env=environment)
    finally:  # a failed or interrupted run too: the next benchmark may replace it
        mark_as_benchmark(folder)
    if result.returncode != 0:  # the script's own line; torchrun's report of a failed child comes after it
        lines = result.stderr.strip().splitlines() or ["no output"]
        reason = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1])
        raise UserError(f"{name} failed (exit {result.returncode}): {reason.removeprefix('error: ')}")
    summary = json.loads((folder / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    # the configuration's name for it (fp32-tf32 is fp32 in config.json): each row says what it measured
    return {"model": model, "framework": framework, "precision": precision,
            "tf32": config["tf32"] if config["device"].startswith("cuda") else "-", "compiler": compiler,
            "data": loader, "replicas": replicas,
            "device": config["device"], "gpu": summary.get("gpu"), "median_step_ms": summary["median_step_ms"],
            "samples_per_s": summary["samples_per_s"], "peak_memory_mb": summary["peak_memory_mb"],
            "skipped_steps": summary["skipped_steps"], "load_average_before": load}


def markdown(rows: list[dict], machine: dict) -> str:
    gpus = "".join(map(cpu.gpu_part, dict.fromkeys(row.get("gpu") for row in rows)))
    lines = [f"CPU: {cpu.summary(machine['cpu'])}{gpus}; flags: {' '.join(machine['flags']) or '-'}", "",
             "| model | framework | precision | TF32 | compiler | data | replicas | device | median ms/step "
             "| samples/s | speedup vs fp32 | scaling | peak MB | skipped |", "|" + "---|" * 14]
    for row in rows:
        speedup = f"{row['speedup']:.2f}x" if row.get("speedup") else "-"
        scaling = f"{row['scaling']:.0%}" if row.get("scaling") else "-"
        runs = row["step_ms_runs"]
        spread = f" ({runs[0]:.2f}-{runs[-1]:.2f})" if len(runs) > 1 else ""
        lines.append(f"| {row['model']} | {row['framework']} | {row['precision']} | {row['tf32']} | {row['compiler']} "
                     f"| {row['data']} | {row['replicas']} | {row['device']} "
                     f"| {row['median_step_ms']:.2f}{spread} | {row['samples_per_s']:.0f} | {speedup} | {scaling} "
                     f"| {row['peak_memory_mb']:.0f} | {row['skipped_steps']} |")
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None) -> int:
    parser = flags.OneLineErrorParser(description=flags.first_paragraph(__doc__),
                                      epilog="Other flags (--batch-size, --device, --dataset, ...) "
                                             "go to every configuration.")
    parser.add_argument("--models", nargs="+", choices=models.NAMES, default=list(models.MODELS))
    parser.add_argument("--frameworks", nargs="+", choices=models.FRAMEWORKS, default=list(models.FRAMEWORKS))
    parser.add_argument("--precisions", nargs="+", choices=tuple(PRECISION_FLAGS),
                        default=["fp32", "amp-bf16"],
                        help="amp-fp16 is for CUDA (emulated on CPU); fp32 is IEEE float32 and "
                             "fp32-tf32 float32 with TensorFloat-32 (on a GPU; the same as fp32 on a CPU)")
    parser.add_argument("--compiled", action="store_true",
                        help="also measure every configuration compiled: PyTorch --compile, TensorFlow --xla")
    parser.add_argument("--repeat", type=flags.int_in(1, MAX_REPEAT), default=1,
                        help="runs per configuration, round robin; the table gives the median run (of an even "
                             f"count the slower middle one: use an odd count) and the range (1 to {MAX_REPEAT})")
    # the model scripts' own bounds, checked here before the first configuration runs
    parser.add_argument("--workers", type=flags.int_in(0, MAX_WORKERS), default=0,
                        help=f"also measure every configuration with the host loader of N workers (1 to {MAX_WORKERS}; "
                             "0: off)")
    parser.add_argument("--replicas", type=flags.off_or_int_in(2, MAX_REPLICAS), default=0,
                        help="also measure every configuration with N data-parallel replicas "
                             f"(torchrun; TensorFlow: --distribute mirrored; 2 to {MAX_REPLICAS}; 0: off)")
    parser.add_argument("--iters", type=flags.int_in(2, MAX_ITERS), default=300)
    parser.add_argument("--log-every", type=flags.int_in(1, MAX_ITERS), default=50, help="steps per timed interval")
    parser.add_argument("--preset", choices=tuple(PRESETS),
                        help="a named configuration (its models, steps and flags; yours win)")
    parser.add_argument("--out", type=flags.output_folder, default=Path("runs/benchmark"))
    preset = PRESETS.get(parser.parse_known_args(argv)[0].preset, {})
    parser.set_defaults(**{key: value for key, value in preset.items() if key != "flags"})
    args, args.flags = parser.parse_known_args(argv)
    args.flags = [*preset.get("flags", []), *args.flags]  # a model script takes a flag's last value
    args.models = list(dict.fromkeys(models.get(name).key for name in args.models))  # an alias once
    for name in ("frameworks", "precisions"):  # a configuration twice read as one run --repeat 2
        if problem := flags.repeated_values_problem(f"--{name}", getattr(args, name)):
            raise UsageError(problem)
    if args.iters < 2 * args.log_every:
        raise UsageError("--iters must cover at least two --log-every intervals "
                         "(the first is warm-up and not counted)")
    configurations = [(model, framework, precision, compiled, workers, replicas)
                      for model in args.models for framework in args.frameworks
                      for precision in args.precisions
                      for compiled in ((False, True) if args.compiled else (False,))
                      for workers in ((0, args.workers) if args.workers else (0,))
                      for replicas in ((1, args.replicas) if args.replicas else (1,))
                      if not (framework == "tensorflow" and compiled and replicas > 1)]
    refuse_inside_a_run(args.out, "--out")  # the table and the configurations' runs would go inside it
    refused = check_other_flags(configurations, args)
    for configuration in configurations:  # before the first run, not an hour into them
        check_replaceable(run_folder(*configuration, args))
    if problem := flags.output_files_problem(args.out, ("benchmark.md", "benchmark.json")):
        raise UsageError(f"--out: {problem}")
    runs = {configuration: [] for configuration in configurations}
    failed = dict(refused)  # a configuration that failed once (refused, or failed in a run): not run again
    for error in refused.values():
        print(escaped_line_breaks(f"error: {error}"), file=sys.stderr, flush=True)
    for _ in range(args.repeat):  # round robin: a slow spell of the machine hits every configuration
        for configuration in configurations:
            if configuration in failed:
                continue
            try:
                runs[configuration].append(measure(*configuration, args))
            except Interrupted:  # a UserError too, but the user's: the benchmark stops, no table
                raise
            except UserError as error:  # the others' rows are still worth having
                failed[configuration] = str(error)
                print(escaped_line_breaks(f"error: {error}"), file=sys.stderr, flush=True)
    rows = {}  # configuration: its median run
    for configuration, measured in runs.items():
        if not measured:  # it failed in the first round; one that failed later keeps the runs it made
            continue
        measured = sorted(measured, key=lambda row: row["median_step_ms"])
        # the median run; of an even count the slower middle one (--help says so)
        rows[configuration] = {**measured[len(measured) // 2], "step_ms_runs": [r["median_step_ms"] for r in measured]}
    # the rows the others are compared with, all of them first: --precisions may list fp32 last
    baselines = {(model, framework): row["median_step_ms"]
                 for (model, framework, precision, compiled, workers, replicas), row in rows.items()
                 if precision == "fp32" and not compiled and not workers and replicas == 1}
    for (model, framework, precision, compiled, workers, replicas), row in rows.items():
        if replicas == 1 and (model, framework) in baselines and (precision, compiled, workers) != ("fp32", False, 0):
            row["speedup"] = baselines[model, framework] / row["median_step_ms"]
        alone = rows.get((model, framework, precision, compiled, workers, 1))
        if replicas > 1 and alone:  # throughput over N one-replica ones
            row["scaling"] = row["samples_per_s"] / (replicas * alone["samples_per_s"])
    rows = list(rows.values())
    machine = {"platform": platform.platform(), "cpu": cpu.describe(), "iters": args.iters,
               "log_every": args.log_every, "preset": args.preset, "flags": args.flags}
    failures = [{"configuration": configuration_name(*configuration), "error": error}
                for configuration, error in failed.items()]
    if not rows:  # the table of the last benchmark stays
        raise UserError(f"all {len(configurations)} configurations failed (above); nothing written to {args.out}")
    table = markdown(rows, machine) + "".join(f"\n\nFailed: {failure['error']}" for failure in failures)
    print(table, flush=True)  # first: the measurements outlive a failed write of their files
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out / "benchmark.md", lambda f: f.write(text_bytes(table + "\n")))
    atomic_write(args.out / "benchmark.json", lambda f: f.write(
        strict_json({"machine": machine, "rows": rows, "failed": failures}, indent=2).encode()))
    if failures:
        raise UserError(f"{len(failures)} of {len(configurations)} configurations failed (above); "
                        f"the others are in {args.out / 'benchmark.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
