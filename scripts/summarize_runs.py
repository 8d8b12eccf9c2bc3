"""Print a markdown table of the summary.json of every run folder under the given folders.

    python scripts/summarize_runs.py runs/vanilla_gan

The figures are the runs' own: median step time over the logged intervals (the first
interval, which includes graph tracing and warm-up, is left out), samples/s at that median,
peak memory (CPU: peak resident set of the process; CUDA: allocator peak). Below the table,
the CPU each run's figures were measured on (each run's summary.json records it).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import cpu, flags
from common.errors import UserError, exit_on_user_error
from common.flags import OneLineErrorParser
from common.runs import NOT_LOSSES, markdown_row, one_line, read_json

COLUMNS = ("run folder", "model", "data", "precision", "device", "steps", "median ms/step", "samples/s",
           "peak MB", "skipped", "final losses")


def number(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def run_folders(folders: list[Path]) -> list[tuple[Path, Path]]:
    """(the folder named, a run folder under it) for each run once, in path order: a folder
    inside another named one adds no second row. Links to folders are not followed (a link
    to / would walk the disk); the error for finding none says so."""
    found, seen, links = [], set(), []
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"{folder} is not a folder (name folders holding run folders)")
        for where, subfolders, files in sorted(os.walk(folder), key=lambda entry: Path(entry[0]).parts):
            links += [Path(where, name) for name in subfolders if os.path.islink(os.path.join(where, name))]
            has_summary = "summary.json" in files or "summary.json" in subfolders  # a folder: "damaged"
            if has_summary and os.path.realpath(where) not in seen:
                seen.add(os.path.realpath(where))
                found.append((folder, Path(where)))
    if not found:
        skipped = f" (links to folders are not followed: name {links[0]} itself)" if links else ""
        raise UserError(f"no summary.json under those folders{skipped}; train a model first")
    return found


def rows(folders: list[Path]):
    """Each run's table row, with (its folder, its summary.json); with two or more folders
    named, each run's folder as given, so that runs of two of them are told apart."""
    for folder, run in run_folders(folders):
        summary_path = run / "summary.json"
        # a tool that only reads: the damaged file is the run's, and the rest of it may be sound
        summary = read_json(summary_path, ("model", "framework", "step"),
                            "; its script's --resume (with the run's settings) writes it again, "
                            "then evaluate.py measures it")
        config = read_json(run / "config.json", ("precision", "device"),
                           "; the run cannot be resumed without it: move the folder aside to table the others")
        losses = ", ".join(f"{k} {number(v, 3)}" for k, v in summary.get("final", {}).items()
                           if k not in NOT_LOSSES)
        # what tells apart runs of one model and precision: the folder, the data, a stop
        replicas = summary.get("replicas")
        data = str(config.get("dataset", "-")) + (f", {replicas} replicas" if isinstance(replicas, int)
                                                 and replicas > 1 else "")
        steps = str(summary["step"])
        if summary.get("stopped_early") and isinstance(config.get("iters"), int):
            steps = f"{steps}/{config['iters']} (stopped)"
        if len(folders) > 1:
            label = str(run)
        else:
            label = str(run.relative_to(folder)) if run != folder else run.name
        yield (label,
               f"{summary['model']} {summary['framework']}", data, config["precision"],
               config["device"], steps, number(summary.get("median_step_ms"), 2),
               number(summary.get("samples_per_s"), 0), number(summary.get("peak_memory_mb"), 0),
               str(summary.get("skipped_steps", "-")), losses or "-"), (str(run), summary)


@exit_on_user_error
def main(argv=None):
    parser = OneLineErrorParser(description=flags.first_paragraph(__doc__))
    parser.add_argument("folders", nargs="+", type=flags.path, help="folders holding run folders")
    found = list(rows(parser.parse_args(argv).folders))
    print(markdown_row(COLUMNS))
    print("|" + "---|" * len(COLUMNS))
    for row, _ in found:
        print(markdown_row(row))
    print("\n" + "\n".join(map(one_line, cpu.measured_on([machine for _, machine in found]))))  # apart from the table
    return 0


if __name__ == "__main__":
    sys.exit(main())
