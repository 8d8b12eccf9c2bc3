"""Measure the quality of a trained run of either framework and write it into its summary.json.

    python scripts/evaluate.py runs/dcgan/pytorch-fp32                 # 10,000 samples
    python scripts/evaluate.py runs/vanilla_vae/tensorflow-amp-bf16 --iwae-k 5000
    python scripts/evaluate.py --floor                                 # MNIST train vs test

The run's own script reopens the run from its last checkpoint (`--resume` with nothing left to
train, in a fresh process, under the run's precision) and, with `--evaluate N`, generates N
samples from noise drawn from the run's seed and measures them with common/evaluation.py:
FID, precision and recall against MNIST test in the MNIST feature net's features, classes
covered; modes covered on the 2-D mixtures; test ELBO and IWAE for the VAE. The same thing
happens at the end of training when a script is given `--evaluate N`.

--floor measures 10,000 MNIST training images against the 10,000 test images the same way:
the real-data floor every generator's numbers are read against.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common.config import MODELS, REPO, RESUME_KEYS, script_path
from common.errors import UsageError, UserError, exit_on_user_error

FLAG_KEYS = [key for key in RESUME_KEYS if key not in ("model", "framework")] + ["amp_dtype", "device"]


def rerun_flags(config: dict, step: int) -> list[str]:
    """The flags that reopen this run exactly as it was trained."""
    flags = ["--amp"] if config.get("amp") else []
    for key in FLAG_KEYS:
        value = config.get(key)
        if value is None or (key == "amp_dtype" and not config.get("amp")):
            continue
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return [*flags, "--iters", str(step)]


def evaluate_run(folder: Path, samples: int, iwae_k: int | None) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
        summary = json.loads((folder / "summary.json").read_text())
    except FileNotFoundError as error:
        raise UserError(f"{folder} is not a finished run (no {Path(error.filename).name})") from None
    except ValueError as error:
        raise UserError(f"{folder} has an unreadable config.json or summary.json ({error})") from None
    if config.get("model") not in MODELS:
        raise UserError(f"{folder}: unknown model {config.get('model')!r}")
    command = [sys.executable, str(script_path(config["model"], config["framework"])),
               *rerun_flags(config, summary["step"]), "--out", str(folder), "--resume",
               "--evaluate", str(samples), *(["--iwae-k", str(iwae_k)] if iwae_k else [])]
    print(f"evaluate: {' '.join(command[1:])}", flush=True)
    status = subprocess.run(command, cwd=REPO).returncode
    if status != 0:
        raise UserError(f"evaluating {folder} failed (exit {status}); its output is above")
    return json.loads((folder / "summary.json").read_text()).get("metrics", {})


@exit_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run folders")
    parser.add_argument("--samples", type=int, default=10_000, help="generated samples per run")
    parser.add_argument("--iwae-k", type=int, help="VAE: importance samples per test image")
    parser.add_argument("--floor", action="store_true", help="MNIST train vs test, the real-data floor")
    args = parser.parse_args(argv)
    if not args.runs and not args.floor:
        raise UsageError("name at least one run folder, or --floor")
    if args.samples < 10 or (args.iwae_k is not None and args.iwae_k < 1):
        raise UsageError("--samples must be at least 10 and --iwae-k at least 1")
    if args.floor:
        from common import evaluation

        floor = evaluation.real_data_floor(args.samples)
        print(f"real-data floor, MNIST train ({args.samples}) vs test: "
              + ", ".join(f"{k} {v:.4g}" for k, v in floor.items()))
    for folder in args.runs:
        results = evaluate_run(folder, args.samples, args.iwae_k)
        print(f"{folder}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
