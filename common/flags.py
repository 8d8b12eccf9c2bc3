"""The argument parser every script builds, and the flag values they share.

Bad flags end as one line, `PROG: error: ... (see --help)`, and exit status 2, in the model
scripts and the helper scripts alike; a value that cannot work (a seed numpy refuses, an
output path under a file) is refused here, before any data is loaded or anything trained.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import struct
import sys
from pathlib import Path

from common.errors import escaped_line_breaks

MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; we want one line and exit 2.
    --help still prints the full help."""

    def error(self, message: str):  # noqa: D401 - argparse API
        sys.stderr.write(escaped_line_breaks(f"{self.prog}: error: {message} (see --help)") + "\n")
        sys.exit(2)


def first_paragraph(docstring: str) -> str:
    """A script's --help description: its docstring's first paragraph, as one line."""
    return " ".join(docstring.split("\n\n")[0].split())


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


# The largest count a run records (a checkpoint's int64): past it, a run's own summary.json
# read as damaged.
MAX_COUNT = 2**63 - 1


def bounded_int(text: str) -> int:
    """An integer no larger than MAX_COUNT (its sign is the caller's to check)."""
    value = integer(text)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most 2**63 - 1, got {text}")
    return value


def positive_int(text: str) -> int:
    value = bounded_int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = bounded_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a positive integer, got {text}")
    return value


def int_in(low: int, high: int):
    """An integer flag from `low` to `high`: the bound keeps an absurd value (a typo, an extra
    zero) from ending in an allocation of hundreds of GiB instead of a message."""

    def parse(text: str) -> int:
        value = integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low:,} to {high:,}, got {text}")
        return value

    return parse


def off_or_int_in(low: int, high: int):
    """0 (off) or an integer from `low` to `high`: a count that means nothing below `low`."""
    within = int_in(low, high)

    def parse(text: str) -> int:
        if integer(text) == 0:
            return 0
        try:
            return within(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be 0 (off) or from {low:,} to {high:,}, got {text}") from None

    return parse


seed = int_in(0, MAX_SEED)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0 or math.isinf(value):  # `not >` also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def positive_float_up_to(high: float, shown: str | None = None, zero_is_off: bool = False):
    """A positive float flag up to `high` (or 0, with `zero_is_off`): as int_in's bound, it
    turns an absurd value into a message, here before a framework fails to convert it to
    float32 deep in a step."""

    def parse(text: str) -> float:
        value = non_negative_float(text) if zero_is_off else positive_float(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be {'0 (off) or ' if zero_is_off else ''}a positive number "
                                             f"up to {shown or f'{high:g}'}, got {text}")
        return value

    return parse


def float_in(low: float, high: float, shown: str):
    """A float flag from `low` to `high` (`shown` says so in the message)."""

    def parse(text: str) -> float:
        value = _number(text)
        if not low <= value <= high:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be from {shown}, got {text}")
        return value

    return parse


def as_float32(value: float) -> float:
    """`value` rounded to float32, as the frameworks hold a flag's value on the device."""
    return struct.unpack("f", struct.pack("f", value))[0]


def unit_interval(text: str) -> float:
    """A rate in [0, 1) that stays below 1 in float32: Adam's betas and the average's decay.
    From 1 - 2**-25 float32 rounds it to 1, where Keras' Adam divides by a bias correction of 0
    (its updates are 0) and the average stops moving, while PyTorch, in float64, trains on."""
    value = _number(text)
    if not 0 <= value < 1:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    if as_float32(value) == 1:
        raise argparse.ArgumentTypeError(f"must stay below 1 in float32 (below 1 - 2**-25), got {text}")
    return abs(value)  # -0.0 too reads as 0


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value == 0:
        return 0.0
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a positive finite number, got {text}")
    return value


def path_text(text: str) -> str:
    """A path as given; an empty one (an unset shell variable) would mean the default or "."."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a path, got an empty or blank string")
    return text


def absolute_path_text(text: str) -> str:
    """A path made absolute against the working folder it was typed in: what a run records,
    so that --resume or scripts/evaluate.py from another folder reads the same files."""
    return absolute(path_text(text))


def shell_word(path: Path | str) -> str:
    """`path` as a word to paste into a shell: quoted where needed, "./" before a leading "-"."""
    text = str(path)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)


def absolute(text: str) -> str:
    """`text` against the working folder, a "~" that no shell expanded expanded too."""
    return os.path.abspath(os.path.expanduser(text))


def path(text: str) -> Path:
    """type= of a flag naming a path to read (a Path); an empty one is refused."""
    return Path(path_text(text))


def output_problem(path: Path, folder: bool) -> str | None:
    """Why `path` cannot be written (as a folder, or as a file), or None when it can: checked
    when the flags are read, so that a typo ends before training, not after it."""
    if os.path.exists(path):
        if folder != os.path.isdir(path):
            return f"{path} is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
    # A file is written beside its target and renamed over it, which would put a plain file
    # where a link, a device (/dev/null) or a pipe stood: refuse those instead.
    if not folder and (os.path.islink(path) or (os.path.exists(path) and not os.path.isfile(path))):
        return f"{path} is {'a link' if os.path.islink(path) else 'not a regular file'}: name a plain file to write"
    # The nearest folder that exists is where the first file or folder will be created.
    start = path if folder else path.parent
    nearest = next(p for p in (start, *start.parents) if os.path.exists(p) or os.path.islink(p))
    if not os.path.exists(nearest):  # a link to nothing: creating the folder failed after the work
        return f"{nearest} is a link to {os.readlink(nearest)}, which does not exist"
    if not os.path.isdir(nearest):
        return f"{nearest} is a file, so {path} cannot be created under it"
    if not os.access(nearest, os.W_OK):
        return f"{nearest} is not writable (read-only or another user's)"
    return None


def output_files_problem(folder: Path, names) -> str | None:
    """The first of the files a script writes into `folder` at its end that cannot be written
    (a folder in its place, a read-only parent): checked at its start, so that the mistake
    ends it before its hour of runs, not after them with the results unwritten."""
    return next(filter(None, (output_problem(folder / name, folder=False) for name in names)), None)


def repeated_values_problem(flag: str, values: list) -> str | None:
    """A list flag that names a value twice: what it names would be measured and tabled twice."""
    repeated = list(dict.fromkeys(str(value) for value in values if values.count(value) > 1))
    if not repeated:
        return None
    return f"{flag} names {', '.join(repeated)} more than once: it would be measured and tabled twice"


def _output(folder: bool):
    def parse(text: str) -> Path:
        problem = output_problem(Path(path_text(text)), folder)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return Path(text)

    return parse


output_folder = _output(folder=True)  # type= of a flag naming a folder to write into (a Path)
output_file = _output(folder=False)   # type= of a flag naming a file to write (a Path)
