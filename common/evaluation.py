"""Quality of a trained model, computed the same way for both frameworks: the framework only
maps numpy in to numpy out (a trainer's `sample(z)`, and for the VAE `encode(x)` and
`decode_logits(z)`); the noise, the features and every metric are numpy (common/metrics.py)
plus the MNIST feature net (common/feature_net.py, numpy): scoring a run imports no framework
but the run's own.

    images of 28x28 MNIST   FID, precision and recall (k=3) against MNIST test, in the
                            feature net's features; classes covered and KL to uniform of the
                            classifier's labels for the samples
    2-D mixtures            high-quality fraction and modes covered (VEEGAN/PacGAN protocol)
    VAE                     test ELBO and importance-weighted bound (IWAE, k samples), in nats
                            per image on the [0, 1] pixels the VAE trains on (not binarised)

The real-data floor (`real_data_floor`) measures MNIST train against MNIST test the same way,
so every number has its reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from common import data as datasets
from common import feature_net, metrics, models
from common.config import MIXTURE_SAMPLES, POINT_DATASETS, RESUME_KEYS
from common.errors import UserError, run_child
from common.runs import RunFolder, read_json, settings_as_today

EVAL_STREAM = 23  # numpy stream for evaluation noise, apart from the training streams
DRAW_STREAM = 2   # under EVAL_STREAM: --eval-draws' further draws (1 is the VAE bounds' noise)
CHUNK = 1000      # examples per framework call
MNIST_TEST_IMAGES = 10_000  # the most test images a measurement (and the floor's training images) can use


def sample_count(dataset: str, asked: int) -> int:
    """How many samples a run of `dataset` is measured on when `asked` for."""
    return min(asked, MIXTURE_SAMPLES) if dataset in POINT_DATASETS else asked


def evaluation_noise(count: int, dim: int, seed: int, draw: int = 0) -> np.ndarray:
    """N(0, I) noise drawn from --seed alone: both frameworks evaluate the same z. Draw 0 is
    the run's own; --eval-draws measures on more (1, 2, ...), each from a stream of its own."""
    stream = [seed, EVAL_STREAM] if draw == 0 else [seed, EVAL_STREAM, DRAW_STREAM, draw]
    return np.random.default_rng(stream).standard_normal((count, dim)).astype(np.float32)


def in_chunks(function, array: np.ndarray) -> np.ndarray:
    return np.concatenate([function(array[i:i + CHUNK]) for i in range(0, len(array), CHUNK)])


def measures_images(dataset: str, sample_shape: tuple) -> bool:
    """The feature net knows 28x28 grayscale MNIST digits only. Decided from the shape of the
    samples, not from the flags: MNIST-format files under --data-dir may hold other sizes."""
    return dataset == "mnist" and tuple(sample_shape) == feature_net.IMAGE_SHAPE


def figure(value, form: str = ".4g") -> str:
    """A metric as printed: counts (samples, classes_covered, modes_covered) whole, not 1e+04;
    the rest in `form` (4 significant digits; the report's table takes 4 places)."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return str(int(value))
    return f"{value:{form}}"


def mnist_subset(split: str, count: int) -> np.ndarray:
    """`count` MNIST images drawn at random (fixed seed), not the first ones: the test set is
    ordered by writer population (its first half is the cleaner one), so its first 1,000
    images alone sit 35 FID away from the training set, all 10,000 only 2.4."""
    return random_subset(datasets.load_dataset("mnist", split=split).x, count)


def random_subset(images: np.ndarray, count: int) -> np.ndarray:
    """`count` of `images` drawn at random with a fixed seed, in their order; all if fewer."""
    if count >= len(images):
        return images
    chosen = np.random.default_rng([EVAL_STREAM, 2]).choice(len(images), count, replace=False)
    return images[np.sort(chosen)]


def image_metrics(samples: np.ndarray, reference: np.ndarray | None = None) -> dict:
    """FID, precision/recall and class coverage of NHWC samples in [0, 1] against `reference`
    (default: as many MNIST test images as samples, at most all 10,000)."""
    if reference is None:
        reference = mnist_subset("test", len(samples))
    fake_features, fake_logits = feature_net.features_and_logits(samples)
    real_features, _ = feature_net.features_and_logits(reference)
    quality = metrics.precision_recall(real_features, fake_features, k=3)
    coverage = metrics.class_coverage(fake_logits)
    return {"fid": metrics.fid(real_features, fake_features),
            "precision": quality["precision"], "recall": quality["recall"],
            "classes_covered": coverage["classes_covered"], "class_kl": coverage["kl_to_uniform"]}


def point_metrics(samples: np.ndarray, dataset: str) -> dict:
    quality = metrics.mixture_quality_for(dataset, samples)
    return {"modes_covered": quality["modes_covered"],
            "high_quality": quality["high_quality_fraction"]}


def vae_bounds(encode, decode_logits, images: np.ndarray, k: int, seed: int) -> dict:
    """Mean test ELBO and IWAE bound (nats per image; higher is better), both estimated from
    the same k posterior samples per image."""
    rng = np.random.default_rng([seed, EVAL_STREAM, 1])
    flat = images.reshape(len(images), -1).astype(np.float64)
    per_call = max(1, CHUNK * 10 // k)  # images per decoder call: about 10,000 decodes
    elbos, iwaes = [], []
    for start in range(0, len(images), per_call):
        x = images[start:start + per_call]
        mean, logvar = (np.asarray(a, np.float64) for a in encode(x))
        eps = rng.standard_normal((k, *mean.shape))
        z = mean + np.exp(0.5 * logvar) * eps
        logits = in_chunks(decode_logits, z.reshape(-1, mean.shape[1]).astype(np.float32))
        logits = logits.reshape(k, len(x), -1).astype(np.float64)
        log_px = metrics.log_bernoulli_logits(flat[start:start + len(x)], logits)
        log_pz = metrics.log_standard_normal(z)
        log_qz = metrics.log_normal_diag(z, mean, logvar)
        elbos.append(metrics.elbo(log_px, log_pz, log_qz))
        iwaes.append(metrics.iwae_bound(log_px, log_pz, log_qz))
    return {"test_elbo": float(np.concatenate(elbos).mean()),
            f"test_iwae_k{k}": float(np.concatenate(iwaes).mean())}


def evaluate(cfg, trainer, log=print, keep=None) -> dict:
    """Every metric that applies to this run; `trainer.sample(z)` returns NHWC images in
    [0, 1] or 2-D points for z of `trainer.z_dim` dimensions. `keep(samples)`, if given, is
    handed the run's own draw of samples (--save-samples) when they are finite.

    Under --eval-draws N the sample metrics are measured on N draws of noise, the first the
    run's own: "draws" holds each one's N values (the figures beside it are the first draw's),
    to read a difference between two runs against what another draw of samples moves."""
    count = sample_count(cfg.dataset, cfg.evaluate)
    first = sample_metrics(cfg, trainer, count, 0, log, keep)
    results = {"samples": count, **first}
    if "finite_samples" in first:
        return results
    bounds_on = ""
    if hasattr(trainer, "decode_logits"):
        # drawn at random, as for FID: MNIST's first 1,000 test images scored a bound 5 nats
        # better than all 10,000 (the test set's first half is its cleaner writers). "folder"
        # has no test split: the images the run trained on (--data-limit's), drawn alike; its
        # first ones alone were its first classes, and past --data-limit, images never trained on.
        pool = (cfg.data_limit or None) if cfg.dataset == "folder" else MNIST_TEST_IMAGES
        test = random_subset(datasets.fixed_test_images(cfg, pool), count)
        if len(test) < count:  # a --data-dir with fewer test images: the bounds say on how many
            results["bound_images"] = len(test)
        results.update(vae_bounds(trainer.encode, trainer.decode_logits, test, cfg.iwae_k, cfg.seed))
        if cfg.dataset == "folder":
            bounds_on = " (bounds on the training images: a folder has no test split)"
    shown = ", ".join(f"{k} {figure(v)}" for k, v in results.items() if k != "samples") + bounds_on
    if shown:  # none where no sample metric applies (said above)
        log(f"evaluation ({count} samples): {shown}")
    if cfg.eval_draws > 1 and first:
        draws = [first, *(sample_metrics(cfg, trainer, count, draw, log) for draw in range(1, cfg.eval_draws))]
        if not any("finite_samples" in figures for figures in draws):
            results["draws"] = {name: [figures[name] for figures in draws] for name in draws[0]}
            log(f"evaluation over {len(draws)} draws of {count} samples: {describe_draws(results['draws'])}")
    return results


def sample_metrics(cfg, trainer, count: int, draw: int, log, keep=None) -> dict:
    """The metrics of `count` samples from draw `draw` of the evaluation noise."""
    samples = in_chunks(trainer.sample, evaluation_noise(count, trainer.z_dim, cfg.seed, draw))
    if not np.isfinite(samples).all():
        log(f"evaluation: the samples{f' of draw {draw}' if draw else ''} hold inf/NaN; no metrics"
            f"{', none saved' if keep else ''}")
        return {"finite_samples": 0.0}
    if keep is not None:
        keep(samples)
    if cfg.dataset in POINT_DATASETS:
        return point_metrics(samples, cfg.dataset)
    if measures_images(cfg.dataset, samples.shape[1:]):
        return image_metrics(samples)
    if draw == 0:
        size = "x".join(map(str, samples.shape[1:]))
        log(f"evaluation: no sample metric for --dataset {cfg.dataset} of {size} images "
            "(the feature net knows 28x28x1 MNIST)")
    return {}


def describe_draws(draws: dict[str, list[float]]) -> str:
    """'fid 5.64 (5.40-6.07), ...': each metric's mean over the draws and its range."""
    return ", ".join(f"{name} {np.mean(values):.4g} ({min(values):.4g}-{max(values):.4g})"
                     for name, values in draws.items())


def real_data_floor(count: int = MNIST_TEST_IMAGES) -> dict:
    """`count` MNIST training images against as many test images, at most the test set's
    10,000 ("samples" says how many): the best a generator can hope for at that sample count
    (FID shrinks as the count grows)."""
    count = min(count, MNIST_TEST_IMAGES)
    return {"samples": count, **image_metrics(mnist_subset("train", count), reference=mnist_subset("test", count))}


# --- finished runs: scripts/evaluate.py and scripts/quality_table.py ---------------------
FLAG_KEYS = [key for key in RESUME_KEYS if key not in ("model", "framework")] + ["amp_dtype", "device"]


# the --amp-dtype that gives each 16-bit precision (config.AMP_DTYPES are that flag's choices)
PRECISION_AMP_DTYPE = {"amp-fp16": "float16", "amp-bf16": "bfloat16"}


def rerun_flags(config: dict, step: int, device: str | None = None) -> list[str]:
    """The flags that reopen this run exactly as it was trained; on `device` ("cpu", "cuda")
    instead of its own, if given (a run trained on a GPU, evaluated where there is none)."""
    config = settings_as_today(config)
    if device:
        config = {**config, "device": device}
        if config.get("precision") in PRECISION_AMP_DTYPE:  # "auto" would pick another 16-bit type there
            config["amp_dtype"] = PRECISION_AMP_DTYPE[config["precision"]]
    flags = ["--amp"] if config.get("amp") else []
    for key in FLAG_KEYS:
        value = config.get(key)
        if value is None or (key == "amp_dtype" and not config.get("amp")):
            continue
        if key == "device":  # PyTorch records the device it ran on, "cuda:0"; the flag names its kind
            value = str(value).split(":")[0]
        flags += [f"--{key.replace('_', '-')}", str(value)]
    if config.get("tensorboard") is False:  # its metrics go where its curves went: nowhere
        flags.append("--no-tensorboard")
    return [*flags, "--iters", str(step)]


def check_evaluable(folder: Path, remedy: str | None = None) -> None:
    """The run's script is reopened with --resume up to its summary's step: that trains nothing
    only when the last checkpoint is at that step. A run stopped on inf/NaN losses (its last
    good checkpoint is earlier) or one whose last checkpoint is gone would be retrained there,
    its history, summary and checkpoints rewritten. One UserError line instead, ending in
    `remedy` where the caller has its own (compare.py sets --resume itself)."""
    run = RunFolder(folder)
    _, summary = run.read_finished()
    if "stopped" in summary:
        raise UserError(f"{folder} stopped at step {summary['step']} ({summary['stopped']}): it has no "
                        f"trained model to evaluate; {remedy or 'continue it with --resume --clip-grad-norm N'}")
    latest = run.latest_checkpoint()
    if latest is None:  # a finished run writes one at its last step: these were deleted
        raise UserError(f"{folder} has no checkpoint left (its summary is at step {summary['step']}): there "
                        f"is no trained model to reopen; {remedy or 'train it again with --overwrite'}")
    if latest[0] != summary["step"]:
        raise UserError(f"{folder} has no checkpoint at the step of its summary ({summary['step']}; "
                        f"last checkpoint: {latest[0]}), so evaluating it would train it; "
                        f"{remedy or 'continue it with --resume first'}")


def iwae_flags(model: str, iwae_k: int | None) -> list[str]:
    """--iwae-k K for the VAE, whose likelihood bound it sets; none for a GAN, which has no
    bound (its script would note the flag ignored)."""
    return ["--iwae-k", str(iwae_k)] if iwae_k and models.get(model).family == "VAE" else []


def evaluate_run(folder: Path, samples: int, iwae_k: int | None, draws: int = 1, device: str | None = None,
                 save_samples: bool = False) -> dict:
    """Reopen a finished run with its own script (a fresh process, `--resume` with nothing
    left to train; on `device` instead of its own, if given) and `--evaluate samples`; return
    the metrics it wrote to summary.json, with "draws" as `evaluate` returns them under
    --eval-draws. `save_samples`: the script's --save-samples."""
    check_evaluable(folder)
    config, summary = RunFolder(folder).read_finished()
    if config.get("model") not in models.MODELS or config.get("framework") not in models.FRAMEWORKS:
        raise UserError(f"{folder}: not a run of this repository (model {config.get('model')!r}, "
                        f"framework {config.get('framework')!r})")
    command = [sys.executable, str(models.MODELS[config["model"]].script(config["framework"])),
               *rerun_flags(config, summary["step"], device), f"--out={folder}", "--resume",
               "--evaluate", str(samples), *iwae_flags(config["model"], iwae_k),
               *(["--eval-draws", str(draws)] if draws > 1 else []), *(["--save-samples"] if save_samples else [])]
    print(f"evaluate: {' '.join(command[1:])}", flush=True)
    status = run_child(command, f"{folder} was not evaluated; the same command measures it").returncode
    if status != 0:
        raise UserError(f"evaluating {folder} failed (exit {status}); its output is above")
    summary = read_json(folder / "summary.json", ("step",))  # a metric that was inf/NaN (null) as NaN
    over_draws = {"draws": summary["metrics_over_draws"]} if "metrics_over_draws" in summary else {}
    return {**summary.get("metrics", {}), **over_draws}
