"""Side-by-side reports of finished runs (numpy + matplotlib, no framework): the sample grids
of each run at matching steps, overlaid loss curves (and loss-scale curves under float16), and
a table of speed, memory and stability, as markdown and as JSON. scripts/compare.py writes one.

Every run's grids come from its own fixed_noise.npy, drawn from --seed alone, so runs with the
same seed show the same z in the same cell: the two frameworks, or FP32 and AMP, side by side.
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from common import cpu  # noqa: E402
from common.config import POINT_DATASETS  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.evaluation import figure  # noqa: E402
from common.runs import NOT_LOSSES, RunFolder, atomic_write, markdown_row, strict_json, text_bytes  # noqa: E402

SAMPLE_NAME = re.compile(r"^step_(\d{6,})\.png$")  # prior samples, not the VAE's _recon grids


@dataclass
class Side:
    """One finished run as the report sees it."""

    label: str
    run: RunFolder
    config: dict
    summary: dict
    history: list[dict]

    @property
    def shows_images(self) -> bool:
        return self.config.get("dataset") not in POINT_DATASETS

    def sample_steps(self) -> list[int]:
        if not self.run.samples.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.run.samples.iterdir()
                      if (m := SAMPLE_NAME.match(p.name)))


def load_side(path: Path, label: str | None = None) -> Side:
    """Read a run folder; one UserError line when it is not a finished run or a file of it is
    damaged."""
    run = RunFolder(path)
    config, summary = run.read_finished(hint="; train the run again (compare.py --overwrite)")
    label = label or f"{config['framework']} {config['precision']}"
    return Side(label, run, config, summary, run.read_history())


def matching_steps(sides: list[Side], most: int = 4) -> list[int]:
    """Up to `most` sample steps every side has, spread from the first to the last."""
    common = sorted(set.intersection(*(set(side.sample_steps()) for side in sides)))
    if len(common) <= most:
        return common
    picks = np.linspace(0, len(common) - 1, most).round().astype(int)
    return [common[i] for i in sorted(set(picks))]


def read_png(path: Path) -> np.ndarray:
    """A saved sample grid; one UserError line when the file is not a readable PNG."""
    path = Path(path)
    try:
        if path.exists() and not path.is_file():  # a FIFO would block the read forever
            raise UserError(f"{path} is not a regular file, where the run keeps a sample grid; "
                            "delete it or train the run again")
        # Image.open reads the header alone and refuses dimensions past Pillow's
        # MAX_IMAGE_PIXELS (a grid holds a few megapixels at most): plt.imread skips that
        # check and would allocate what a damaged header claims
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path):
                pass
        return plt.imread(path)
    # Pillow's "not a PNG file" is a SyntaxError; its bomb error and warning are neither OSError
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise UserError(f"{path} is not a readable PNG image ({error}); delete it or train the "
                        "run again") from None


def read_grid(side: Side, step: int) -> np.ndarray:
    """A saved grid as float RGB in [0, 1]."""
    image = read_png(side.run.sample_path(step))
    if image.ndim == 2:  # a grayscale PNG
        image = np.stack([image] * 3, axis=-1)
    return image[..., :3].astype(np.float64)


def sample_drift(sides: list[Side], steps: list[int]) -> dict[int, float]:
    """Mean absolute pixel difference (0-1 scale) between two image runs' grids per step:
    0 at step 0 when both start from the same weights, then how far the trainings drift."""
    if len(sides) != 2 or not all(side.shows_images for side in sides):
        return {}
    drift = {}
    for step in steps:
        first, second = read_grid(sides[0], step), read_grid(sides[1], step)
        if first.shape != second.shape:  # the runs write equal grids: one was replaced
            paths = [side.run.sample_path(step) for side in sides]
            raise UserError(f"{paths[0]} and {paths[1]} are grids of other sizes ({first.shape[1]}x"
                            f"{first.shape[0]}, {second.shape[1]}x{second.shape[0]}): one is not its run's; "
                            "delete it or train the run again")
        drift[step] = float(np.abs(first - second).mean())
    return drift


def sample_figure(sides: list[Side], steps: list[int], path: Path) -> None:
    """Rows: matching steps; columns: the runs."""
    fig, axes = plt.subplots(len(steps), len(sides), squeeze=False,
                             figsize=(3.2 * len(sides), 3.2 * len(steps)))
    for row, step in enumerate(steps):
        for column, side in enumerate(sides):
            axis = axes[row][column]
            axis.imshow(read_png(side.run.sample_path(step)))
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(side.label, fontsize=10, parse_math=False)
            if column == 0:
                axis.set_ylabel(f"step {step}", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda file: fig.savefig(file, format="png", dpi=100), durable=False)
    plt.close(fig)


# Past float32's largest, a value is no finite loss a run logged (they are float32): an edited
# history's 1e308 and -1e308 on one axis ended the report in matplotlib's traceback. inf is
# left out too, as a plot leaves it out.
LARGEST_LOSS = float(np.finfo(np.float32).max)
MAX_LOSS_PANELS = 8  # a run logs at most 5 (WGAN-GP's 4 and the loss scale); an edited history's 2,000 took minutes


def _is_value(value) -> bool:
    """One number per step, within float32's range, which a curve can show (a list of steps,
    or a bool, is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not abs(value) > LARGEST_LOSS


def loss_panels(sides: list[Side]) -> list[str]:
    """The logged losses, plus the loss scale when any run scaled its loss (float16). Every row
    counts, not only the first: a float16 run adds skipped_at and nonfinite_steps to the rows
    of the intervals that had such steps. At most MAX_LOSS_PANELS, the loss scale kept."""
    names = list(dict.fromkeys(key for side in sides for row in side.history for key, value in row.items()
                               if key not in NOT_LOSSES and _is_value(value)))
    scaled = any(row.get("loss_scale", 1.0) != 1.0 for side in sides for row in side.history)
    return names[:MAX_LOSS_PANELS - scaled] + (["loss_scale"] if scaled else [])


def loss_figure(sides: list[Side], path: Path) -> None:
    """One panel per loss_panels() entry, the runs overlaid; the loss scale on a log axis."""
    panels = loss_panels(sides)
    fig, axes = plt.subplots(1, max(len(panels), 1), squeeze=False,
                             figsize=(4.5 * max(len(panels), 1), 3.4))
    for axis, name in zip(axes[0], panels):
        for side in sides:
            rows = [row for row in side.history if _is_value(row.get(name))]
            axis.plot([row["step"] for row in rows], [row[name] for row in rows],
                      label=side.label, linewidth=1.2)
        # Titles and legends as written (matplotlib reads the text between two $ as TeX: an
        # edited run's key "$\foo{$" ended the report in its parser's traceback); the log
        # axis' tick labels stay TeX, which is how they are drawn as powers of 2.
        axis.set_title(name, parse_math=False)
        axis.set_xlabel("step")
        if name == "loss_scale":
            axis.set_yscale("log", base=2)
        for text in axis.legend(fontsize=8).get_texts():
            text.set_parse_math(False)
    fig.tight_layout()
    atomic_write(path, lambda file: fig.savefig(file, format="png", dpi=100), durable=False)
    plt.close(fig)


def table_rows(sides: list[Side]) -> list[dict]:
    rows = []
    for side in sides:
        summary = side.summary
        final = {k: v for k, v in summary.get("final", {}).items() if k not in NOT_LOSSES}
        rows.append({
            "run": side.label, "folder": str(side.run.path),
            "framework": side.config["framework"], "precision": side.config["precision"],
            "device": side.config.get("device"), "cpu": summary.get("cpu"), "gpu": summary.get("gpu"),
            "steps": summary["step"],
            "median_step_ms": summary.get("median_step_ms"),
            "samples_per_s": summary.get("samples_per_s"),
            "peak_memory_mb": summary.get("peak_memory_mb"),
            "skipped_steps": summary.get("skipped_steps"),
            "final_losses": final, "metrics": summary.get("metrics", {}),
        })
    return rows


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    metric_names = sorted({name for row in rows for name in row["metrics"]})
    header = ["run", "device", "steps", "median ms/step", "samples/s", "peak MB", "skipped",
              "final losses", *metric_names]
    lines = [markdown_row(header), "|" + "---|" * len(header)]
    for row in rows:
        losses = ", ".join(f"{k} {v:.3f}" for k, v in row["final_losses"].items()) or "-"
        cells = [row["run"], str(row["device"]), str(row["steps"]),
                 _number(row["median_step_ms"], 2), _number(row["samples_per_s"], 0),
                 _number(row["peak_memory_mb"], 0), str(row["skipped_steps"]), losses,
                 *("-" if row["metrics"].get(name) is None else figure(row["metrics"][name], ".4f")
                   for name in metric_names)]
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def sample_count_note(rows: list[dict]) -> str | None:
    """A line under the table when the runs' metrics were measured on different numbers of
    samples (FID shrinks as they grow, so the two would not compare)."""
    counts = list(dict.fromkeys(row["metrics"]["samples"] for row in rows if row["metrics"].get("samples")))
    if len(counts) < 2:
        return None
    return (f"the runs' metrics were measured on different numbers of samples ({' and '.join(map(str, counts))}): "
            "they do not compare; compare.py's --reuse --evaluate N measures both on N and tables them")


REPORT_FILES = ("report.md", "samples.png", "losses.png", "table.md", "table.json")  # what write_report writes
REPORT_MARK = ("title", "command", "rows", "sample_steps")  # the keys of its table.json, written first


def files_of_others(folder: Path) -> list[str]:
    """The REPORT_FILES in `folder` that write_report would replace and did not write: all
    those present, unless its table.json is one write_report wrote (a report being redone)."""
    present = [name for name in REPORT_FILES if (Path(folder) / name).exists() or (Path(folder) / name).is_symlink()]
    table = Path(folder) / "table.json"
    if not present or not table.is_file() or table.stat().st_size > 2**24:
        return present
    try:
        written = json.loads(table.read_bytes())
    except (OSError, ValueError, RecursionError):
        return present
    return [] if isinstance(written, dict) and all(key in written for key in REPORT_MARK) else present


def write_report(sides: list[Side], folder: Path, title: str, command: str) -> dict:
    """Write samples.png, losses.png, table.md, table.json and report.md into `folder`;
    return what table.json holds."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    steps = matching_steps(sides)
    if not steps:
        raise UserError("the runs have no sample grid at a common step; give them the same "
                        "--sample-every and --iters")
    rows = table_rows(sides)
    drift = sample_drift(sides, steps)
    table = markdown_table(rows)
    report = {"title": title, "command": command, "rows": rows, "sample_steps": steps,
              "sample_drift": {str(k): v for k, v in drift.items()}}
    # first: it marks the folder as a report's (files_of_others), should a figure fail after it
    atomic_write(folder / "table.json", lambda f: f.write(strict_json(report, indent=2).encode()))
    sample_figure(sides, steps, folder / "samples.png")
    loss_figure(sides, folder / "losses.png")
    first, second = rows[0], rows[-1]
    lines = [f"# {title}", "", f"    {command}", "", table, ""]
    if first["median_step_ms"] and second["median_step_ms"]:
        lines.append(f"{second['run']} takes {second['median_step_ms'] / first['median_step_ms']:.2f}x "
                     f"the step time of {first['run']}.")
    if note := sample_count_note(rows):
        lines += ["", note[0].upper() + note[1:] + "."]
    lines += ["", *cpu.measured_on([(row["run"], row) for row in rows]), ""]  # the figures' machine
    if drift:
        lines.append("Mean absolute difference of the two sample grids (pixels in [0, 1]): "
                     + ", ".join(f"step {step} {value:.4f}" for step, value in drift.items()) + ".")
    lines += ["", "![samples](samples.png)", "", "![losses](losses.png)", ""]
    atomic_write(folder / "table.md", lambda f: f.write(text_bytes(table + "\n")))
    atomic_write(folder / "report.md", lambda f: f.write(text_bytes("\n".join(lines))))
    return report
