"""Train two runs of one model and put them side by side: PyTorch against TensorFlow (the
default), or float32 against AMP in one framework.

    python scripts/compare.py --model dcgan                        # PyTorch vs TensorFlow, float32
    python scripts/compare.py --model dcgan --amp --same-init      # under AMP, from the same weights
    python scripts/compare.py --model dcgan --fp32-vs-amp pytorch  # float32 vs AMP in PyTorch
    python scripts/compare.py --model dcgan --fp32-vs-amp pytorch --amp-dtype float16  # AMP's dtype
    python scripts/compare.py --model vae --iters 500 --batch-size 64   # any training flag

Each side is the model's own script, run in a fresh process (so one does not tax the other's
timing), one after the other, into its normal run folder <runs>/<model>/<framework>-<precision>
(-<dataset> after it for any dataset but MNIST).
Both sides get the same data, seed (hence the same fixed noise and batch order) and flags,
except --amp-dtype, which only the AMP runs get (with --fp32-vs-amp, not the float32 one): it
names the folder too (amp-fp16 or amp-bf16), so float16 on a CPU or bfloat16 on CUDA are runs
of their own.
With --same-init the TensorFlow side starts from the PyTorch side's initial weights
(`--init-from`), so the sample grids agree at step 0 and show how far the trainings drift.
A folder that already holds a run is reused with --reuse when its settings match (and
continued with --resume when it stopped short of --iters), or retrained with --overwrite.

The report folder (default <runs>/<model>/compare-...) gets samples.png (the grids from the
same fixed noise at matching steps), losses.png (overlaid loss curves, plus the loss scale
under float16), table.md / table.json (median step time, samples/s, peak memory, skipped
steps, final losses, and quality metrics once a run has them) and report.md with all of it;
--report names another folder, refused if it holds files of these names that compare.py did
not write.
Each run also wrote TensorBoard events into its folder (unless --no-tensorboard): `tensorboard
--logdir <runs>/<model>` overlays them (the last line printed says so, naming the tensorboard
beside this Python, as .venv/bin/tensorboard, when none is on the PATH, or that no run wrote any).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import models, report
from common.config import AMP_DTYPES, RESUME_KEYS, dataset_suffix, parse_args, resolve_precision, run_name
from common.errors import UsageError, UserError, escaped_line_breaks, exit_on_user_error, run_child
from common.evaluation import check_evaluable, sample_count
from common.flags import OneLineErrorParser, absolute, first_paragraph, output_files_problem, output_folder, shell_word
from common.runs import (
    continue_flags,
    lies_within,
    read_json,
    refuse_inside_a_run,
    same_path,
    settings_as_today,
    where_a_stopped_run_stands,
)

# compare sets these itself; each with what to use instead
OWN_FLAGS = {"--out": "use --runs, --reuse or --overwrite", "--resume": "use --runs, --reuse or --overwrite",
             "--init-from": "use --same-init (TensorFlow starts from PyTorch's initial weights)"}
# what a run's results depend on: the settings --resume keeps, and those a run may change
# between pauses that shape its training (clipping, loss scaling) or its step time (compilers);
# "precision" is the dtype that ran, so --amp-dtype auto and bfloat16 on a CPU are one run
MATCHING = (*RESUME_KEYS, "precision", "init_from", "clip_grad_norm", "init_scale", "growth_interval",
            "growth_factor", "backoff_factor", "xla", "compile")


def device_type(device: str) -> str:
    if device != "auto":
        return device
    import torch  # only to learn whether "auto" means CUDA here

    return "cuda" if torch.cuda.is_available() else "cpu"


class Plan:
    """One side: the script, its flags (without compare's own) and its run folder."""

    def __init__(self, model: str, framework: str, amp: bool, flags: list[str], runs: Path,
                 device: str, amp_dtype: str | None = None):
        self.framework = framework
        # --amp-dtype is the AMP side's alone: a float32 run refuses it (it needs --amp)
        dtype = ["--amp-dtype", amp_dtype] if amp and amp_dtype else []
        self.flags = [*flags, *(["--amp", *dtype] if amp else [])]
        self.model = models.get(model)
        # The script's own parser: bad flags end here with its one-line error, before training.
        self.config = parse_args(model, framework, self.flags)
        self.precision = resolve_precision(self.config, device_type(device))
        self.folder = runs / model / run_name(self.config, self.precision)
        self.init_from: Path | None = None
        self.label = f"{framework} {self.precision}"

    def command(self, extra: list[str]) -> list[str]:
        # --flag=PATH: a folder that starts with "-" (--runs ./-r) is the flag's value, not a flag
        init = [f"--init-from={self.init_from}"] if self.init_from else []
        # --iters always: a --resume without it keeps the run's own
        return [sys.executable, str(self.model.script(self.framework)), *self.flags,
                f"--iters={self.config.iters}", f"--out={self.folder}", *init, *extra]

    def expected(self) -> dict:
        return {**json.loads(self.config.to_json()), "precision": self.precision,
                "init_from": absolute(str(self.init_from)) if self.init_from else None}


def decide(plan: Plan, reuse: bool, overwrite: bool) -> list[str] | None:
    """The extra flags to train this side with, or None to use the finished run as it is."""
    folder = plan.folder
    if not folder.exists() or not any(folder.iterdir()):
        return []
    if overwrite:
        return ["--overwrite"]
    if not reuse:
        raise UsageError(f"{folder} already holds a run: --reuse to use it (if its settings match) "
                         "or --overwrite to train both sides again")
    # --overwrite retrains both sides: a damaged one alone is retrained by deleting its folder
    again = f"; delete {folder} to train this side again (--overwrite would retrain both)"
    saved = settings_as_today(read_json(folder / "config.json", hint=again))  # older runs, in today's flags
    expected = plan.expected()
    # --init-from: recorded absolute (a run of an older version: as typed), so --runs may be typed
    # another way, or from another folder
    differing = [k for k in MATCHING if saved.get(k) != expected.get(k)
                 and not (k == "init_from" and same_path(saved.get(k), expected.get(k)))]
    if differing:
        changes = ", ".join(f"{k}: {saved.get(k)!r} here, {expected.get(k)!r} asked" for k in differing)
        raise UsageError(f"cannot reuse {folder}: other settings ({changes}); --runs for another folder"
                         f"{again}")
    summary_path = folder / "summary.json"
    summary = read_json(summary_path, ("step",), again) if summary_path.exists() else {"step": 0}
    done = summary["step"]
    if done == plan.config.iters:
        asked = plan.config.evaluate and sample_count(plan.config.dataset, plan.config.evaluate)
        measured = summary.get("metrics") or {}
        if asked and measured.get("samples") != asked:  # --resume with nothing to train measures it
            # ...only at a checkpoint of the summary's step: else it would train, and rewrite the run
            check_evaluable(folder, remedy=again.removeprefix("; "))
            print(f"compare: {folder} is not measured on {asked} samples: evaluating it", flush=True)
            return ["--resume"]
        return None
    if done > plan.config.iters:
        raise UsageError(f"cannot reuse {folder}: it trained {done} iterations, --iters asks for "
                         f"{plan.config.iters}{again}")
    extra = continue_flags(folder, summary, again)
    if extra == ["--overwrite"]:  # stopped before its first checkpoint: nothing to keep
        print(f"compare: {folder} holds no checkpoint yet: training it from the start", flush=True)
    return extra


def train(plan: Plan, extra: list[str], starting_over: bool = False) -> None:
    """`starting_over`: --overwrite, the run in its folder to be replaced."""
    command = plan.command(extra)
    print(f"compare: {plan.label}: {' '.join(command[1:])}", flush=True)
    status = run_child(command, lambda: where_a_stopped_run_stands(plan.folder, f"the {plan.label} run", "--reuse",
                                                                    starting_over)).returncode
    if status != 0:
        raise UserError(f"the {plan.label} run failed (exit {status}); its output is above")


def parse(argv):
    parser = OneLineErrorParser(
        description=first_paragraph(__doc__),
        epilog="Any other flag (--iters, --batch-size, --lr, --seed, --dataset, --data-dir, "
               "--sample-every, ...) goes to both runs unchanged.")
    parser.add_argument("--model", required=True, choices=models.NAMES)
    parser.add_argument("--fp32-vs-amp", choices=models.FRAMEWORKS, metavar="FRAMEWORK",
                        help="compare float32 with AMP in this framework instead of the frameworks")
    parser.add_argument("--amp", action="store_true", help="both frameworks under AMP")
    parser.add_argument("--amp-dtype", choices=AMP_DTYPES,
                        help="the AMP runs' compute dtype (default auto: float16 on CUDA, bfloat16 "
                             "on a CPU); with --fp32-vs-amp the float32 run does not get it")
    parser.add_argument("--same-init", action="store_true",
                        help="TensorFlow starts from PyTorch's initial weights")
    parser.add_argument("--reuse", action="store_true",
                        help="use runs that already exist with the same settings")
    parser.add_argument("--overwrite", action="store_true", help="train existing runs again")
    parser.add_argument("--runs", type=output_folder, default="runs", help="root of the run folders")
    parser.add_argument("--report", type=output_folder,
                        help="report folder (default <runs>/<model>/compare-...)")
    args, flags = parser.parse_known_args(argv)
    for flag in flags:
        name = flag.split("=")[0]
        # argparse takes a prefix for the whole flag (--ou for --out), in the scripts as here
        own = [full for full in OWN_FLAGS if len(name) > 2 and name.startswith("--") and full.startswith(name)]
        if own:
            typed = f" (typed {name})" if name != own[0] else ""
            raise UsageError(f"{own[0]}{typed} is set by compare.py itself; {OWN_FLAGS[own[0]]}")
    if args.reuse and args.overwrite:
        raise UsageError("--reuse and --overwrite contradict each other: pick one")
    if args.fp32_vs_amp and (args.amp or args.same_init):
        raise UsageError("--fp32-vs-amp compares precisions in one framework: drop --amp/--same-init")
    if args.amp_dtype not in (None, "auto") and not (args.amp or args.fp32_vs_amp):
        raise UsageError(f"--amp-dtype {args.amp_dtype} needs --amp (both frameworks) or "
                         "--fp32-vs-amp FRAMEWORK")
    args.model = models.get(args.model).key
    return args, flags


def tensorboard_command(logdir: Path) -> str:
    """The command that opens TensorBoard on `logdir`: `tensorboard` when it is on the PATH, else
    the one installed beside this Python (after `make demo`, .venv/bin/tensorboard, which is on
    no PATH until the virtual environment is activated), relative to the working folder when
    it lies under it."""
    program = "tensorboard"
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "tensorboard")
    if shutil.which("tensorboard") is None and os.path.isfile(beside):
        here = os.path.abspath(os.getcwd())
        program = os.path.relpath(beside, here) if beside.startswith(here + os.sep) else beside
        if os.sep not in program:  # a shell looks for a bare name on the PATH alone
            program = os.path.join(".", program)
    return f"{shell_word(program)} --logdir {shell_word(logdir)}"


@exit_on_user_error
def main(argv=None) -> int:
    args, flags = parse(argv)
    runs = Path(args.runs)
    # validated again per side; with the AMP flags, which the scripts check against each other
    amp_flags = ["--amp", *(["--amp-dtype", args.amp_dtype] if args.amp_dtype else [])]
    device = parse_args(args.model, "pytorch",
                        [*flags, *(amp_flags if args.amp or args.fp32_vs_amp else [])]).device
    if args.fp32_vs_amp:
        plans = [Plan(args.model, args.fp32_vs_amp, amp, flags, runs, device, args.amp_dtype)
                 for amp in (False, True)]
        name = f"compare-fp32-vs-{plans[1].precision}-{args.fp32_vs_amp}{dataset_suffix(plans[0].config)}"
        title = f"{args.model}: float32 vs {plans[1].precision} in {args.fp32_vs_amp}"
    else:
        plans = [Plan(args.model, framework, args.amp, flags, runs, device, args.amp_dtype)
                 for framework in models.FRAMEWORKS]
        if args.same_init:
            plans[1].init_from = plans[0].folder
            plans[1].folder = plans[1].folder.with_name(plans[1].folder.name + "-init-pytorch")
            plans[1].label += " (PyTorch's init)"
        name = (f"compare-pytorch-vs-tensorflow-{plans[0].precision}{dataset_suffix(plans[0].config)}"
                + ("-same-init" if args.same_init else ""))
        title = f"{args.model}: PyTorch vs TensorFlow, {plans[0].precision}" + (
            ", same initial weights" if args.same_init else "")

    folder = Path(args.report) if args.report else runs / args.model / name
    refuse_inside_a_run(runs, "--runs")
    refuse_inside_a_run(folder, "--report")
    for plan in plans:  # a run this command is about to make is no run folder yet
        if lies_within(folder, plan.folder):
            raise UsageError(f"--report {folder} is, or is inside, the run folder {plan.folder} this command "
                             "trains into; name a path outside it")
    if problem := output_files_problem(folder, report.REPORT_FILES):
        raise UsageError(f"the report: {problem}")  # now, not after training both runs
    if others := report.files_of_others(folder):  # a folder of the user's own, named by --report
        raise UsageError(f"--report {folder} already holds {', '.join(others)}, not written by compare.py, "
                         "which the report would replace; name a new or empty folder")
    decisions = [decide(plan, args.reuse, args.overwrite) for plan in plans]  # all checks first
    for plan, extra in zip(plans, decisions):
        if extra is None:
            print(f"compare: {plan.label}: reusing {plan.folder}", flush=True)
        else:
            train(plan, extra, starting_over=args.overwrite)

    sides = [report.load_side(plan.folder, plan.label) for plan in plans]
    command = shlex.join(["python", "scripts/compare.py", *(argv if argv is not None else sys.argv[1:])])
    written = report.write_report(sides, folder, title, command)
    print(report.markdown_table(written["rows"]))
    if note := report.sample_count_note(written["rows"]):
        print(escaped_line_breaks(f"note: {note}"))
    print(escaped_line_breaks(f"compare: report in {folder} ({', '.join(report.REPORT_FILES)})"))
    with_events = [plan.label for plan in plans if any(plan.folder.glob("events.out.tfevents.*"))]
    if not with_events:
        print("compare: neither run wrote TensorBoard events (they trained with --no-tensorboard)")
    else:
        shown = "both runs" if len(with_events) == len(plans) else f"the {with_events[0]} run (the other wrote none)"
        print(f"compare: {shown} in TensorBoard, over the model's other runs: {tensorboard_command(runs / args.model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
