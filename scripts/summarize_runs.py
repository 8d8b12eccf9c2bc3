"""Print a markdown table of the summary.json of every run folder under the given folders.

    python scripts/summarize_runs.py runs/vanilla_gan

The figures are the runs' own: median step time over the logged intervals (the first
interval, which includes graph tracing and warm-up, is left out), samples/s at that median,
peak memory (CPU: peak resident set of the process; CUDA: allocator peak).
"""
import argparse
import json
import sys
from pathlib import Path

COLUMNS = ("run", "precision", "device", "steps", "median ms/step", "samples/s",
           "peak MB", "skipped", "final losses")
NOT_LOSSES = ("loss_scale", "skipped", "skipped_total")


def rows(folders):
    for folder in folders:
        for summary_path in sorted(Path(folder).rglob("summary.json")):
            run = summary_path.parent
            summary = json.loads(summary_path.read_text())
            config = json.loads((run / "config.json").read_text())
            losses = ", ".join(f"{k} {v:.3f}" for k, v in summary.get("final", {}).items()
                               if k not in NOT_LOSSES)
            yield (f"{summary['model']} {summary['framework']}", config["precision"],
                   config["device"], str(summary["step"]), f"{summary['median_step_ms']:.2f}",
                   f"{summary['samples_per_s']:.0f}", f"{summary['peak_memory_mb']:.0f}",
                   str(summary["skipped_steps"]), losses or "-")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="folders holding run folders")
    found = list(rows(parser.parse_args(argv).folders))
    if not found:
        sys.stderr.write("error: no summary.json under those folders; train a model first\n")
        return 1
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in found:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
