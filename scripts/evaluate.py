"""Measure the quality of a trained run of either framework and write it into its summary.json.

    python scripts/evaluate.py runs/dcgan/pytorch-fp32                   # 10,000 samples
    python scripts/evaluate.py runs/vanilla_vae/tensorflow-amp-bf16 --iwae-k 5000
    python scripts/evaluate.py --draws 5 runs/dcgan/pytorch-fp32         # and 4 other draws of z
    python scripts/evaluate.py --floor                                   # MNIST train vs test
    python scripts/evaluate.py --device cpu runs/dcgan/pytorch-amp-fp16  # trained on a GPU, measured here
    python scripts/evaluate.py --save-samples runs/dcgan/pytorch-fp32     # and keep them: eval_samples.npz

The run's own script reopens the run from its last checkpoint (`--resume` with nothing left to
train, in a fresh process, under the run's precision; a run whose last checkpoint is not at its
summary's step, as one stopped on inf/NaN losses, is refused, as reopening it would train) and,
with `--evaluate N`, generates N samples from noise drawn from the run's seed and measures them
with common/evaluation.py:
FID, precision and recall against MNIST test in the MNIST feature net's features, classes
covered; modes covered on the 2-D mixtures; test ELBO and IWAE for the VAE. The same thing
happens at the end of training when a script is given `--evaluate N`.

After runs measured on MNIST, and alone with --floor, it prints the real-data floor: as many
MNIST training images as --samples against as many test images, measured the same way, the
reference every generator's numbers are read against (FID depends on the sample count); past
10,000 (MNIST's test set), 10,000 of each.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import evaluation, flags
from common.config import MAX_EVAL_DRAWS, MAX_EVALUATE, MAX_IWAE_K, MIN_EVALUATE, RunConfig
from common.errors import UsageError, exit_on_user_error


@exit_on_user_error
def main(argv=None) -> int:
    parser = flags.OneLineErrorParser(description=flags.first_paragraph(__doc__))
    parser.add_argument("runs", nargs="*", type=flags.path, help="run folders")
    parser.add_argument("--samples", type=flags.int_in(MIN_EVALUATE, MAX_EVALUATE), default=10_000,
                        help="generated samples per run (default 10,000); for the VAE also the test images "
                             "its ELBO and IWAE bounds take")
    parser.add_argument("--iwae-k", type=flags.int_in(1, MAX_IWAE_K),
                        help=f"VAE: importance samples per test image (default {RunConfig.iwae_k}, the scripts' "
                             "default, whatever the run was measured with: the bound's key, test_iwae_kK, names it)")
    parser.add_argument("--draws", type=flags.int_in(1, MAX_EVAL_DRAWS), default=1,
                        help="also measure on N-1 other draws of noise and print each metric's mean "
                             "and range over the N (the first draw is the run's own; default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="reopen the runs on this device, not the one each trained on (a run trained on "
                             "a GPU, evaluated where there is none: the same z, the device's rounding)")
    parser.add_argument("--save-samples", action="store_true",
                        help="write each run's samples (the first draw) to eval_samples.npz in its folder: "
                             "images as uint8 NHWC, 2-D points as float32, to score with other tools")
    parser.add_argument("--floor", action="store_true", help="MNIST train vs test, the real-data floor")
    args = parser.parse_args(argv)
    if not args.runs and not args.floor:
        raise UsageError("name at least one run folder, or --floor")
    given = [name for name, value in (("--iwae-k", args.iwae_k), ("--draws", args.draws > 1),
                                      ("--device", args.device), ("--save-samples", args.save_samples)) if value]
    if given and not args.runs:  # silence would pass for an effect
        print(f"note: {', '.join(given)}: a run's evaluation reads {'them' if len(given) > 1 else 'it'}, and --floor "
              "names no run: ignored")
    measured_images = measured_bounds = False
    for folder in args.runs:  # all of them before the first is measured
        evaluation.check_evaluable(folder)
    for folder in args.runs:
        results = evaluation.evaluate_run(folder, args.samples, args.iwae_k, args.draws, args.device,
                                              args.save_samples)
        draws = results.pop("draws", None)
        print(f"{folder}: " + ", ".join(f"{k} {evaluation.figure(v)}" for k, v in results.items()))
        if draws:
            print(f"{folder}, mean (range) over {args.draws} draws: {evaluation.describe_draws(draws)}")
        elif args.draws > 1:
            print(f"{folder}: no draws recorded (no sample metric, or a draw's samples held inf/NaN: see above)")
        measured_images |= "fid" in results
        measured_bounds |= "test_elbo" in results
    if args.iwae_k and args.runs and not measured_bounds:
        print("note: --iwae-k: the VAE's likelihood bound; none of these runs is a VAE: ignored")
    if args.floor or measured_images:  # every FID is read against the floor at its sample count
        floor = evaluation.real_data_floor(args.samples)
        print(f"real-data floor, {floor['samples']} MNIST training images vs as many test images: "
              + ", ".join(f"{k} {evaluation.figure(v)}" for k, v in floor.items() if k != "samples"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
