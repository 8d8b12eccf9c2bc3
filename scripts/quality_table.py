"""Train every model in both frameworks in float32 and under AMP at its default budget, measure
each run's quality, and print one table: is AMP's quality as good as float32's?

    python scripts/quality_table.py                                   # everything (hours on a CPU)
    python scripts/quality_table.py --models dcgan vanilla_vae        # some models
    python scripts/quality_table.py --models dcgan --iters 200 --samples 1000   # a quick look
    python scripts/quality_table.py --precisions fp32                 # AMP rows left out
    python scripts/quality_table.py --models vanilla_gan --seeds 0 1 2 3   # spread against precision
    python scripts/quality_table.py --models dcgan --lr 3e-4 --iters 14000 --runs runs/quality-3e-4   # a former default

Runs go to <runs>/<model>/<dataset>/<framework>-<precision> (default --runs runs/quality; seeds
other than 0 add -seed<S>), one fresh process each, trained with the model's own defaults and
`--evaluate N`. Run it again and finished runs are reused, stopped ones continued (--resume),
finished ones without metrics measured (scripts/evaluate.py); --overwrite trains everything
again. The GANs with MLPs also train on the 2-D mixtures (ring8, grid25), where mode coverage
is the metric. The first row is the real-data floor (MNIST train vs test). The table is
printed and written to <runs>/quality_table.md and .json; the "FID vs fp32" column is AMP's FID
over float32's (with --precisions amp alone, over the float32 run of the same settings measured
before, if any).
With more than one --seeds, each pair's rows are followed by their mean and standard deviation
over the seeds, and that row's "FID vs fp32" is the ratio of the mean FIDs: one GAN run's FID
moves by about 10% from seed to seed, as much as the 10% AMP is allowed, so one pair cannot
tell AMP's cost from chance.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import cpu, flags, models
from common.config import MAX_EVALUATE, MAX_IWAE_K, MIN_EVALUATE, POINT_DATASETS, RESUME_KEYS, learning_rate, parse_args
from common.errors import UsageError, UserError, escaped_line_breaks, exit_on_user_error, run_child
from common.evaluation import evaluate_run, iwae_flags, sample_count
from common.runs import (
    atomic_write,
    continue_flags,
    markdown_row,
    read_json,
    refuse_inside_a_run,
    settings_as_today,
    strict_json,
    text_bytes,
    where_a_stopped_run_stands,
)

DATASETS = ("mnist", *POINT_DATASETS)
AGAIN = "; delete its folder to train that run again (--overwrite would retrain every run of the command)"
COLUMNS = (("fid", "FID", 2), ("precision", "precision", 3), ("recall", "recall", 3),
           ("classes_covered", "classes", 0), ("modes_covered", "modes", 0),
           ("high_quality", "high quality", 3), ("test_elbo", "test ELBO", 1))


def run_folder(runs: Path, model: str, dataset: str, framework: str, amp: bool, seed: int = 0) -> Path:
    # The folder names the precision AMP gets on this machine's CPU; config.json says which ran.
    return runs / model / dataset / f"{framework}-{'amp' if amp else 'fp32'}{f'-seed{seed}' if seed else ''}"


def overrides(args) -> list[str]:
    """The flags that override every model's defaults (--iters, --lr), as the runs are given them."""
    return [*(["--iters", str(args.iters)] if args.iters else []), *(["--lr", str(args.lr)] if args.lr else [])]


def training_settings(model: str, dataset: str, framework: str, amp: bool, args, seed: int = 0) -> dict:
    """What shapes the weights of the run `ensure` would start (the settings --resume holds
    fixed, and --iters): the model's and the dataset's defaults under this script's flags. A
    run that differs in one (another --iters or --lr, or a default changed since it ran) is not
    reused."""
    cfg = parse_args(model, framework, ["--dataset", dataset, "--seed", str(seed), *(["--amp"] if amp else []),
                                        *overrides(args)])
    return {name: getattr(cfg, name) for name in ("iters", *RESUME_KEYS)}


def settings_differences(config: dict, wanted: dict) -> list[str]:
    config = settings_as_today(config)  # what older runs recorded, in today's flags
    return [f"{name} {config.get(name)}, not {value}" for name, value in wanted.items() if config.get(name) != value]


def measured_float32_fid(folder: Path, wanted: dict, samples: int) -> float | None:
    """The FID of a finished float32 run of these settings measured before on `samples`
    samples (FID shrinks as the count grows), or None: what AMP's "FID vs fp32" is divided by
    when this call trains no float32 run (--precisions amp)."""
    try:
        config = read_json(folder / "config.json")
        summary = read_json(folder / "summary.json")
    except UserError:  # none, or damaged: this call has no float32 FID to divide by
        return None
    if settings_differences(config, wanted) or summary.get("step") != config.get("iters"):
        return None
    metrics = summary.get("metrics", {})
    return metrics.get("fid") if metrics.get("samples") == samples else None


def why_not_tabled(folder: Path, summary: dict, wanted: dict, samples: int) -> str | None:
    """Why --table-only leaves out a run with this summary, or None to table it."""
    measured = summary.get("metrics") and not summary.get("stopped_early")
    if not measured:
        return "not measured" if not summary.get("stopped_early") else f"stopped early, at step {summary['step']}"
    # measured on this call's --samples: the floor beside it is, and FID shrinks as they grow
    if summary["metrics"].get("samples") != samples:
        return f"measured on {summary['metrics'].get('samples')} samples, not {samples}"
    config = read_json(folder / "config.json", hint=AGAIN)
    if summary["step"] != config.get("iters"):  # stopped early (an older version's evaluation forgot it)
        return f"stopped at step {summary['step']} of {config.get('iters')}"
    differences = settings_differences(config, wanted)
    return f"other settings ({'; '.join(differences)})" if differences else None


def ensure(folder: Path, model: str, dataset: str, framework: str, amp: bool, args, seed: int = 0) -> dict | None:
    """Train and/or evaluate one run as needed; return its summary (with --table-only: the
    summary of a finished, measured run of today's settings, else None)."""
    summary_path = folder / "summary.json"
    if args.table_only:
        if not summary_path.exists():
            if (folder / "config.json").exists():
                args.not_tabled.append(f"{folder}: no summary.json (a run not finished)")
            return None
        summary = read_json(summary_path, ("step",), AGAIN)
        reason = why_not_tabled(folder, summary, training_settings(model, dataset, framework, amp, args, seed),
                                sample_count(dataset, args.samples))
        if reason:
            args.not_tabled.append(f"{folder}: {reason}")
        return None if reason else summary
    extra = []
    if folder.exists() and any(folder.iterdir()):
        if args.overwrite:
            extra = ["--overwrite"]
        else:
            config = read_json(folder / "config.json", ("iters",), AGAIN)
            differences = settings_differences(config, training_settings(model, dataset, framework, amp, args, seed))
            if differences:
                raise UsageError(f"{folder} holds a run of other settings ({'; '.join(differences)}); "
                                 f"--runs for another folder{AGAIN}")
            done = read_json(summary_path, ("step",), AGAIN) if summary_path.exists() else {}
            if done.get("step") == config["iters"]:
                if done.get("metrics", {}).get("samples") != sample_count(dataset, args.samples):
                    evaluate_run(folder, args.samples, args.iwae_k)
                return read_json(summary_path, ("step",), AGAIN)
            extra = continue_flags(folder, done, AGAIN)
    # --out=FOLDER: a folder that starts with "-" (--runs ./-q) is the flag's value, not a flag
    command = [sys.executable, str(models.MODELS[model].script(framework)), f"--out={folder}",
               "--dataset", dataset, "--seed", str(seed), "--evaluate", str(args.samples), *extra,
               *(["--amp"] if amp else []), *overrides(args),
               *iwae_flags(model, args.iwae_k)]
    print(f"quality_table: {' '.join(command[1:])}", flush=True)
    status = run_child(command, lambda: where_a_stopped_run_stands(folder, str(folder), "the same command",
                                                                    args.overwrite)).returncode
    if status != 0:
        raise UserError(f"the run in {folder} failed (exit {status}); its output is above")
    return read_json(summary_path, ("step",), AGAIN)


def seed_runs(model: str, dataset: str, framework: str, args) -> tuple[list[dict], dict[int, float]]:
    """A row for each run of one model, dataset and framework (each seed's float32, then AMP),
    trained and measured as needed; and float32's FID per seed, of this call's runs or, under
    --precisions amp alone, of those measured before."""
    rows, fp32_fids = [], {}
    for seed in args.seeds:
        if "fp32" not in args.precisions:
            fid = measured_float32_fid(run_folder(args.runs, model, dataset, framework, False, seed),
                                       training_settings(model, dataset, framework, False, args, seed),
                                       sample_count(dataset, args.samples))
            if fid:
                fp32_fids[seed] = fid
        for amp in (False, True):
            if ("amp" if amp else "fp32") not in args.precisions:
                continue
            folder = run_folder(args.runs, model, dataset, framework, amp, seed)
            summary = ensure(folder, model, dataset, framework, amp, args, seed)
            if summary is None:
                continue
            config = read_json(folder / "config.json", ("precision",), AGAIN)
            metrics = summary.get("metrics", {})
            row = {"model": model, "dataset": dataset, "framework": framework, "precision": config["precision"],
                   "seed": seed, "folder": str(folder), "steps": summary["step"], "metrics": metrics,
                   "cpu": summary.get("cpu"), "gpu": summary.get("gpu")}
            if amp and fp32_fids.get(seed) and metrics.get("fid") is not None:
                row["fid_ratio"] = metrics["fid"] / fp32_fids[seed]
            if not amp and metrics.get("fid"):
                fp32_fids[seed] = metrics["fid"]
            rows.append(row)
    return rows, fp32_fids


def seed_means(seed_rows: list[dict], fp32_fids: dict[int, float]) -> list[dict]:
    """One row per precision: each metric's mean and standard deviation ("spread") over the
    seeds, and under AMP its mean FID over float32's. Where some seeds have an FID in both
    precisions, only those count, so that the ratio is that of the means shown; a precision
    left with fewer than two seeds gets no row."""
    amp_seeds = {row["seed"] for row in seed_rows if row["precision"] != "fp32" and row["metrics"].get("fid")}
    paired = amp_seeds & set(fp32_fids)
    means = []
    for precision in dict.fromkeys(row["precision"] for row in seed_rows):
        runs = [row for row in seed_rows if row["precision"] == precision and (not paired or row["seed"] in paired)]
        if len(runs) < 2:
            continue
        numbers = [key for key, value in runs[0]["metrics"].items() if isinstance(value, (int, float))
                   and all(isinstance(row["metrics"].get(key), (int, float)) for row in runs)]
        values = {key: [row["metrics"][key] for row in runs] for key in numbers}
        mean = {"model": runs[0]["model"], "dataset": runs[0]["dataset"], "framework": runs[0]["framework"],
                "precision": precision, "seed": None, "seeds": [row["seed"] for row in runs],
                "metrics": {key: seeds_mean(v) for key, v in values.items()},
                "spread": {key: seeds_spread(v) for key, v in values.items()}}
        if precision != "fp32" and paired:
            fp32_fid = seeds_mean([fp32_fids[seed] for seed in mean["seeds"]])
            with np.errstate(all="ignore"):
                mean["fid_ratio"] = float(np.float64(mean["metrics"]["fid"]) / fp32_fid)
        means.append(mean)
    return means


# NaN or inf where a seed's value is (a metric that was inf/NaN is null in summary.json):
# statistics.stdev raised on them. As float64: two integers of an edited file near float's
# largest (10**308) made an object array whose sum float() refused (OverflowError).
def seeds_mean(values: list[float]) -> float:
    with np.errstate(all="ignore"):
        return float(np.mean(np.asarray(values, np.float64)))


def seeds_spread(values: list[float]) -> float:
    """The sample standard deviation of the seeds' values."""
    with np.errstate(all="ignore"):
        return float(np.std(np.asarray(values, np.float64), ddof=1))


def cell(value, digits: int, spread=None) -> str:
    if value is None:
        return "-"
    if spread is None:
        return f"{value:.{digits}f}"
    digits = max(digits, 1)  # a mean of counts (modes 24 and 25) has a half
    return f"{value:.{digits}f} ± {spread:.{digits}f}"


def seed_cell(row: dict) -> str:
    if row.get("seeds"):
        return f"mean of {len(row['seeds'])}"
    return "-" if row.get("seed") is None else str(row["seed"])


def markdown(rows: list[dict], seed_column: bool = False) -> str:
    iwae = sorted({k for row in rows for k in row["metrics"] if k.startswith("test_iwae")})
    header = ["model", "data", "framework", "precision", *(["seed"] if seed_column else []),
              *(title for _, title, _ in COLUMNS), *(k.replace("test_iwae_", "IWAE ") for k in iwae), "FID vs fp32"]
    lines = [markdown_row(header), "|" + "---|" * len(header)]
    for row in rows:
        metrics, spread = row["metrics"], row.get("spread", {})
        cells = [row["model"], row["dataset"], row["framework"], row["precision"],
                 *([seed_cell(row)] if seed_column else []),
                 *(cell(metrics.get(key), digits, spread.get(key)) for key, _, digits in COLUMNS),
                 *(cell(metrics.get(key), 1, spread.get(key)) for key in iwae), cell(row.get("fid_ratio"), 2)]
        lines.append(markdown_row(cells))
    return "\n".join(lines)


@exit_on_user_error
def main(argv=None) -> int:
    parser = flags.OneLineErrorParser(description=flags.first_paragraph(__doc__))
    parser.add_argument("--models", nargs="+", choices=models.NAMES, default=list(models.MODELS))
    parser.add_argument("--frameworks", nargs="+", choices=models.FRAMEWORKS, default=list(models.FRAMEWORKS))
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS),
                        help="those each model takes: the 2-D mixtures only where the model does")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "amp"), default=["fp32", "amp"],
                        help="fp32 alone where AMP is slow to train (bfloat16 emulated on an AVX2-only CPU)")
    parser.add_argument("--iters", type=flags.positive_int, help="override every model's default budget")
    parser.add_argument("--lr", type=learning_rate,
                        help="override every model's default learning rate (with --iters: a former default)")
    parser.add_argument("--seeds", nargs="+", type=flags.seed, default=[0],
                        help="train each run once per seed; with two or more, their means and spread follow")
    parser.add_argument("--samples", type=flags.int_in(MIN_EVALUATE, MAX_EVALUATE), default=10_000,
                        help="generated samples per run")
    parser.add_argument("--iwae-k", type=flags.int_in(1, MAX_IWAE_K), help="VAE: importance samples per test image")
    parser.add_argument("--runs", type=flags.output_folder, default="runs/quality")
    parser.add_argument("--overwrite", action="store_true", help="train every run again")
    parser.add_argument("--table-only", action="store_true",
                        help="train and measure nothing: tabulate the measured runs there are")
    args = parser.parse_args(argv)
    args.not_tabled = []  # --table-only: the runs found and left out, and why
    if args.table_only and args.overwrite:
        raise UsageError("--table-only and --overwrite contradict each other: --table-only trains nothing")
    for name in ("frameworks", "datasets", "precisions", "seeds"):
        if problem := flags.repeated_values_problem(f"--{name}", getattr(args, name)):
            raise UsageError(problem)
    refuse_inside_a_run(args.runs, "--runs")
    if problem := flags.output_files_problem(args.runs, ("quality_table.md", "quality_table.json")):
        raise UsageError(f"--runs: {problem}")  # now, not after the runs

    chosen = list(dict.fromkeys(models.get(name).key for name in args.models))  # an alias once
    takes = {model: ("mnist",) if models.MODELS[model].images_only else DATASETS for model in chosen}
    if not any(dataset in args.datasets for model in chosen for dataset in takes[model]):
        # the table would hold the real-data row alone, written over the one there
        takers = " ".join(model for model, entry in models.MODELS.items() if not entry.images_only)
        raise UsageError(f"--models {' '.join(chosen)}: MNIST images only, no --datasets "
                         f"{' '.join(args.datasets)}; add mnist, or a model that takes them ({takers})")

    from common import evaluation

    rows = []
    for model in chosen:
        for dataset in (d for d in takes[model] if d in args.datasets):
            for framework in args.frameworks:
                runs, fp32_fids = seed_runs(model, dataset, framework, args)
                rows += runs
                if len(args.seeds) > 1:
                    rows += seed_means(runs, fp32_fids)
    if args.table_only and not rows:
        found = ""  # the first run left out, and why
        if args.not_tabled:
            first, more = args.not_tabled[0], len(args.not_tabled) - 1
            found = f" ({first}, and {more} more)" if more else f" ({first})"
        raise UserError(f"no runs of these settings measured on --samples {args.samples} under {args.runs}"
                        f"{found}: --table-only trains and measures nothing; leave it out to do so")
    for left_out in args.not_tabled:  # beside a table of the others, or it reads as complete
        print(escaped_line_breaks(f"note: left out of the table: {left_out}"))
    floor = evaluation.real_data_floor(args.samples)
    rows.insert(0, {"model": "real data (MNIST train vs test)", "dataset": "mnist", "framework": "-",
                    "precision": "-", "metrics": floor})
    table = markdown(rows, seed_column=args.seeds != [0])
    machines = cpu.measured_on([(row["folder"], row) for row in rows if "folder" in row])
    if machines:  # the runs' CPUs, apart from the table
        table += "\n\n" + "\n".join(machines)
    args.runs.mkdir(parents=True, exist_ok=True)
    atomic_write(args.runs / "quality_table.md", lambda f: f.write(text_bytes(table + "\n")))
    atomic_write(args.runs / "quality_table.json",
                 lambda f: f.write(strict_json({"argv": argv if argv is not None else sys.argv[1:],
                                                "rows": rows}, indent=2).encode()))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
