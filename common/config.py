"""One argument parser and one run configuration for every script in both frameworks.

The defaults come from the model's `hparams.py` (the single source both frameworks read),
found through the registry (common/models.py); the flags themselves are identical everywhere,
so `gan_pytorch.py --amp --iters 500` and `gan_tensorflow.py --amp --iters 500` mean the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from common import cpu, distributed, flags, models
from common.errors import UsageError

DATASET_CHOICES = ("mnist", "fashion-mnist", "cifar10", "folder", "ring8", "grid25")
POINT_DATASETS = ("ring8", "grid25")
MIXTURE_SAMPLES = 2500  # their scatter plots and scores, whatever --evaluate asks: the VEEGAN/PacGAN protocol's count
ADAM_EPSILON = 1e-8  # PyTorch's default, set in both frameworks: Keras' is 1e-7

# Dynamic loss scaling (float16 only), the same in both frameworks: start at 2**16, halve on
# an inf/NaN gradient (and skip that step), double after 2000 clean steps. These are
# GradScaler's defaults; Keras' LossScaleOptimizer starts at 2**15 unless told otherwise, and
# always doubles and halves (its factors are not settable).
LOSS_SCALE_INIT = 2.0**16
LOSS_SCALE_GROWTH_INTERVAL = 2000
LOSS_SCALE_GROWTH_FACTOR, LOSS_SCALE_BACKOFF_FACTOR = 2.0, 0.5
SCALE_WARN_WINDOW = 200  # steps the loss scale may stay below --min-loss-scale before a warning

# Upper bounds of the flags that size memory, so that a typo (an extra zero) ends in a message
# instead of an allocation of hundreds of GiB. Past them nothing fits a single machine anyway.
MAX_WIDTH = 4096          # about 10x the largest default (the VAE's 400)
MAX_REPLICAS = 64         # --replicas: 8 GPUs to a machine; logical CPU devices past that only queue
MAX_WORKERS = 64          # --workers: N forked DataLoader processes (PyTorch) or N tf.data map calls;
                          # past a machine's cores they only queue, each a process or thread to start
MAX_IMAGE_SIZE = 512      # DCGAN takes up to 64; an MLP's first layer grows with the square
# FID-50k, the most GAN papers report; precision and recall's nearest neighbours cost the square
# of it (44 s at 50,000 on 2 cores; 1,000,000 would take hours)
MAX_EVALUATE = 50_000
AMP_DTYPES = ("auto", "float16", "bfloat16")  # --amp-dtype's choices
MIN_EVALUATE = 10  # precision and recall compare each sample with its 3 nearest neighbours
MAX_EVAL_DRAWS = 20  # 20 evaluations of 10,000 samples: minutes (rank 0's alone: no replica waits)
MAX_IWAE_K = 10_000       # IWAE's paper evaluates with k = 5,000
MAX_GROWTH_INTERVAL = 2**31 - 1  # the loss scalers count clean steps in 32 (PyTorch) and 64 bits (Keras)
# ... and of the flags a framework turns into float32 scalars, whose overflow raised deep in a step.
MAX_LR = 1e6              # far past any useful rate (a test drives a run to inf with it); PyTorch's Adam
                          # fails once lr / (1 - beta1) leaves float32's range, near 3e38
# A loss scale from 2**-64 to 2**64 (2**48 times the default 2**16): float32 overflows at 2**128
# (a cast failed deep in the step) and rounds 1e-50 to 0 (every float16 step was skipped).
MIN_LOSS_SCALE, MAX_LOSS_SCALE = 2.0**-64, 2.0**64
# A gradient-norm clip or weight decay far past any use: Keras' float32 copy of 1e39 overflowed
# to inf and the losses were NaN from the first step (with the clip, PyTorch trained).
MAX_CLIP_OR_DECAY = 1e6
clip_or_decay = flags.positive_float_up_to(MAX_CLIP_OR_DECAY, "10**6", zero_is_off=True)  # type= of both
learning_rate = flags.positive_float_up_to(MAX_LR, "10**6")  # type= of every script's --lr
loss_scale = flags.float_in(MIN_LOSS_SCALE, MAX_LOSS_SCALE, "2**-64 to 2**64")


@dataclasses.dataclass
class RunConfig:
    model: str
    framework: str
    amp: bool = False
    amp_dtype: str = "auto"
    tf32: str = "auto"              # CUDA float32: TensorFloat-32 matmuls/convolutions (auto: framework default)
    iters: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    optimizer: str = "adam"
    weight_decay: float = 0.0
    seed: int = 0
    dataset: str = "mnist"
    data_dir: str | None = None
    data_limit: int | None = None
    image_size: int | None = None
    out: str | None = None
    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    sample_every: int = 1000
    log_every: int = 100
    checkpoint_every: int = 1000
    profile: bool = False
    init_from: str | None = None
    evaluate: int = 0
    iwae_k: int = 100
    eval_draws: int = 1
    save_samples: bool = False      # with --evaluate: write its samples to eval_samples.npz
    init_scale: float = LOSS_SCALE_INIT
    growth_factor: float = LOSS_SCALE_GROWTH_FACTOR
    backoff_factor: float = LOSS_SCALE_BACKOFF_FACTOR
    growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL
    min_loss_scale: float = 16.0
    nonfinite_patience: int = 200
    clip_grad_norm: float = 0.0
    ema_decay: float = 0.0          # GANs: G's weights averaged for sampling and evaluation (0: off)
    precision_report: bool = False
    xla: bool = False
    compile: bool = False
    workers: int = 0
    width: int = 64
    tensorboard: bool = True
    sync_bn: bool = False
    distribute: str | None = None   # TensorFlow: "mirrored" | "multi-worker"
    replicas: int | None = None     # TensorFlow --distribute mirrored: how many devices

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


# Settings that must match for --resume to continue a run bit-exactly; --iters may grow.
RESUME_KEYS = ("model", "framework", "width", "batch_size", "lr", "beta1", "beta2", "optimizer",
               "weight_decay", "ema_decay", "seed", "dataset", "data_dir", "data_limit", "image_size")


def build_parser(model: str, framework: str, defaults: dict) -> argparse.ArgumentParser:
    """The shared parser; `defaults` (from the model's hparams.py) override the fallbacks."""
    base = RunConfig(model=model, framework=framework)
    parser = flags.OneLineErrorParser(
        prog=Path(sys.argv[0]).name if sys.argv and sys.argv[0] else f"{model}_{framework}",
        description=f"Train {model} in {framework}, optionally with automatic mixed precision.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    precision = parser.add_argument_group("mixed precision")
    precision.add_argument("--amp", action="store_true",
                           help="automatic mixed precision: float16 + loss scaling on CUDA, "
                                "bfloat16 (no scaling) on CPU")
    precision.add_argument("--amp-dtype", choices=AMP_DTYPES,
                           help="override the AMP compute dtype (needs --amp)")
    precision.add_argument("--tf32", choices=("auto", "on", "off"),
                           help="NVIDIA GPUs since Ampere: float32 matmuls and convolutions in "
                                "TensorFloat-32 (10-bit mantissa, float32 range). auto = the "
                                "framework's default (PyTorch: matmuls off, cuDNN convolutions on; "
                                "TensorFlow: on); no effect on a CPU")
    precision.add_argument("--precision-report", action="store_true",
                           help="print, per layer, its weights' dtype and the dtype its output "
                                "actually had in the first training step")
    precision.add_argument("--init-scale", type=loss_scale,
                           help="float16: first loss scale")
    precision.add_argument("--growth-factor", type=flags.positive_float,
                           help="float16: scale multiplier after --growth-interval clean steps "
                                "(PyTorch only; Keras always doubles)")
    precision.add_argument("--backoff-factor", type=flags.positive_float,
                           help="float16: scale multiplier on an overflow (PyTorch only; Keras "
                                "always halves)")
    precision.add_argument("--growth-interval", type=flags.int_in(1, MAX_GROWTH_INTERVAL),
                           help="float16: clean steps before the scale grows: updates of PyTorch's "
                                "one scaler, steps of each Keras optimizer (a WGAN-GP iteration "
                                "counts 6 in PyTorch, 5 for Keras' critic and 1 for its G)")
    precision.add_argument("--min-loss-scale", type=loss_scale,
                           help="float16: warn once when the scale stays below this for "
                                f"{SCALE_WARN_WINDOW} steps")
    precision.add_argument("--nonfinite-patience", type=flags.positive_int,
                           help="stop (with a checkpoint) when the losses have been inf/NaN for "
                                "this many steps, checked at each --log-every step (where the losses "
                                "are read from the device)")

    model_group = parser.add_argument_group("model")
    model_group.add_argument("--width", type=flags.int_in(1, MAX_WIDTH),
                             help="the networks' width: the VAE's hidden units; the vanilla GAN's and LSGAN's "
                                  "smallest hidden layer (the others are multiples of it); WGAN-GP's "
                                  "MLPs have 16x it; DCGAN's and WGAN-GP's image base channels "
                                  "(G's last hidden layer, D's first)")

    training = parser.add_argument_group("training")
    training.add_argument("--iters", type=flags.positive_int, help="training iterations")
    training.add_argument("--batch-size", type=flags.positive_int, help="examples per iteration")
    training.add_argument("--lr", type=learning_rate, help="learning rate")
    training.add_argument("--beta1", type=flags.unit_interval, help="Adam beta1")
    training.add_argument("--beta2", type=flags.unit_interval, help="Adam beta2")
    training.add_argument("--optimizer", choices=("adam", "adamw"), help="optimizer")
    training.add_argument("--weight-decay", type=clip_or_decay,
                          help="decoupled weight decay (adamw only)")
    training.add_argument("--xla", action="store_true",
                          help="TensorFlow: compile the training step with XLA (jit_compile)")
    training.add_argument("--compile", action="store_true",
                          help="PyTorch: compile the networks with torch.compile (static shapes; "
                               "the first steps are slow while it compiles)")
    training.add_argument("--clip-grad-norm", type=clip_or_decay,
                          help="clip the global gradient norm of each network (0: off); under "
                               "float16 the gradients are unscaled first")
    training.add_argument("--ema-decay", type=flags.unit_interval, metavar="DECAY",
                          help="GANs: sample and evaluate with an exponential moving average of "
                               "G's weights, e.g. 0.999 (0: off, G itself)")
    training.add_argument("--seed", type=flags.seed, help="seeds Python, numpy and the framework (0 to 2**32 - 1)")
    training.add_argument("--init-from", type=flags.absolute_path_text, metavar="RUN_DIR|WEIGHTS.npz",
                          help="start from the initial weights of another run, of either "
                               "framework (its initial_weights.npz), instead of a fresh init; "
                               "--resume continues from the checkpoint instead")
    training.add_argument("--device", choices=("auto", "cpu", "cuda"),
                          help="auto = CUDA when available, else CPU")

    parallel = parser.add_argument_group(
        "data parallel", "PyTorch: launch with torchrun --nproc-per-node N; TensorFlow: --distribute; "
                         "--batch-size is the global batch")
    parallel.add_argument("--distribute", choices=("mirrored", "multi-worker"),
                          help="TensorFlow: MirroredStrategy (the local GPUs, or --replicas N logical "
                               "CPUs), or MultiWorkerMirroredStrategy (the cluster in TF_CONFIG)")
    parallel.add_argument("--replicas", type=flags.int_in(1, MAX_REPLICAS),
                          help="TensorFlow --distribute mirrored: N replicas (on a CPU, N logical "
                               "devices; on GPUs, the first N; default: every GPU)")
    parallel.add_argument("--sync-bn", action="store_true",
                          help="synchronise batch-norm statistics across the replicas "
                               "(PyTorch: SyncBatchNorm, CUDA only; TensorFlow: synchronized=True); "
                               "default: each replica its own")

    data = parser.add_argument_group("data")
    data.add_argument("--dataset", choices=DATASET_CHOICES, help="training data")
    data.add_argument("--data-dir", type=flags.absolute_path_text,
                      help="folder with the dataset's files (mnist without it: the embedded copy)")
    data.add_argument("--data-limit", type=flags.positive_int,
                      help="use only the first N training examples")
    data.add_argument("--workers", type=flags.int_in(0, MAX_WORKERS),
                      help="0: the dataset stays on the device; N: a host loader with N worker "
                           f"processes (PyTorch DataLoader) or N parallel map calls (tf.data); at most {MAX_WORKERS}")
    data.add_argument("--image-size", type=flags.int_in(1, MAX_IMAGE_SIZE),
                      help="resize images to N x N (image folders, or 28 -> 32 for conv nets)")

    output = parser.add_argument_group("run folder and logging")
    output.add_argument("--out", type=flags.path_text,
                        help="run folder (default runs/<model>/<framework>-<precision>, then -<dataset> but for MNIST)")
    output.add_argument("--resume", action="store_true",
                        help="continue the run in the run folder from its latest checkpoint")
    output.add_argument("--overwrite", action="store_true",
                        help="start over in a run folder that already holds a run")
    output.add_argument("--sample-every", type=flags.non_negative_int,
                        help="save a sample grid every N iterations (0: only at the end)")
    output.add_argument("--log-every", type=flags.positive_int,
                        help="read losses from the device every N iterations")
    output.add_argument("--checkpoint-every", type=flags.non_negative_int,
                        help="checkpoint every N iterations (0: only at the end)")
    output.add_argument("--evaluate", type=flags.off_or_int_in(MIN_EVALUATE, MAX_EVALUATE), metavar="N",
                        help="after training, measure quality on N generated samples (FID, "
                             "precision/recall, modes; VAE: test ELBO/IWAE) into summary.json")
    output.add_argument("--eval-draws", type=flags.int_in(1, MAX_EVAL_DRAWS), metavar="N",
                        help="with --evaluate: measure the samples' metrics on N draws of noise (the "
                             "first is the run's own) and record each, to see how much the figures move with the noise")
    output.add_argument("--save-samples", action="store_true",
                        help="with --evaluate: write its samples (the first draw) to eval_samples.npz "
                             "in the run folder, to score them with other tools")
    output.add_argument("--iwae-k", type=flags.int_in(1, MAX_IWAE_K),
                        help="importance samples per test image for the VAE's IWAE bound")
    output.add_argument("--profile", action="store_true",
                        help="profile a short window of steps and write a trace to the run folder")
    output.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                        help="write TensorBoard events into the run folder (--no-tensorboard: none)")

    fallbacks = {f.name: getattr(base, f.name) for f in dataclasses.fields(RunConfig)}
    unknown = set(defaults) - set(fallbacks)
    if unknown:
        raise ValueError(f"hparams name unknown run settings: {sorted(unknown)}")
    fallbacks.update(defaults)
    parser.set_defaults(**{k: v for k, v in fallbacks.items() if k not in ("model", "framework")})
    return parser


def parse_args(model: str, framework: str, argv=None) -> RunConfig:
    """The flags of a model's script in one framework, over the defaults of its hparams.py."""
    entry = models.get(model)
    parser = build_parser(entry.key, framework, entry.hparams.DEFAULTS)
    # A dataset's own defaults (hparams.DATASET_DEFAULTS, e.g. the 2-D mixtures') sit between
    # the model's defaults and the command line, so the dataset is read first.
    dataset = parser.parse_known_args(argv)[0].dataset
    dataset_defaults = getattr(entry.hparams, "DATASET_DEFAULTS", {}).get(dataset, {})
    unknown = set(dataset_defaults) - {f.name for f in dataclasses.fields(RunConfig)}
    if unknown:
        raise ValueError(f"hparams.DATASET_DEFAULTS name unknown run settings: {sorted(unknown)}")
    parser.set_defaults(**dataset_defaults)
    args = parser.parse_args(argv)
    cfg = RunConfig(model=entry.key, framework=framework, **vars(args))
    if cfg.resume and "iters" not in named_settings(parser, argv):
        # the run's own budget, not the model's default: a run of 5,000 went on to 20,000 unsaid
        cfg.iters = recorded_iters(cfg) or cfg.iters
    validate(cfg)
    if entry.images_only and cfg.dataset in POINT_DATASETS:
        raise UsageError(f"{entry.images_only}; --dataset {cfg.dataset} is 2-D points: use mnist, "
                         "fashion-mnist, cifar10 or folder (the MLP GANs take the mixtures)")
    if cfg.replicas:  # now, not after N devices and their networks are built (fit checks it again)
        check_batch_among_replicas(cfg, cfg.replicas)
    if hasattr(entry.hparams, "validate"):  # a model's own checks (WGAN-GP: the batch splits in 5)
        entry.hparams.validate(cfg)
    return cfg


def batch_division(cfg: RunConfig) -> tuple[int, int]:
    """(parts, pack): the model's parts of a batch, each sharded among the replicas on its own
    (WGAN-GP's 5 critic batches), and the samples its D judges at once (the MLP GANs' PacGAN
    packs on the 2-D mixtures); (1, 1) for a model whose hparams.py says nothing of it."""
    hparams = models.get(cfg.model).hparams
    return hparams.batch_division(cfg) if hasattr(hparams, "batch_division") else (1, 1)


def check_batch_among_replicas(cfg: RunConfig, count: int, quiet: bool = False) -> None:
    """One UsageError line unless the run's batch divides among `count` replicas, into the
    model's parts and packs too (WGAN-GP: 64 among 8 replicas, a multiple of 40, not 5)."""
    parts, pack = batch_division(cfg)
    distributed.check_batch(cfg.batch_size, count, parts, quiet=quiet, pack=pack)


def named_settings(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The settings the command line names, as opposed to those left to their defaults."""
    unset = object()
    probe = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    parser.parse_args(argv, namespace=probe)  # defaults fill only what the namespace lacks
    return {name for name, value in vars(probe).items() if value is not unset}


def recorded_iters(cfg: RunConfig) -> int | None:
    """The --iters in the config.json of the run --resume names (--out, or the default folder
    of a precision the flags may resolve to); None where no run's says it, and the resume's own
    checks then say what is wrong. Two such runs of different --iters are one UsageError, and
    so is an iters that is no count of iterations (an edited file): the model's default in its
    place trained a run of 2 iterations on to 20,000."""
    if cfg.out:
        folders = [Path(cfg.out)]
    else:
        precisions = ["fp32"]
        if cfg.amp:  # auto: bfloat16 on a CPU, float16 on CUDA; --device auto may be either
            precisions = [precision for precision, dtype, device in (("amp-bf16", "bfloat16", "cpu"),
                                                                      ("amp-fp16", "float16", "cuda"))
                          if cfg.amp_dtype == dtype or (cfg.amp_dtype == "auto" and cfg.device in (device, "auto"))]
        folders = [run_dir_for(cfg, precision) for precision in precisions]
    found = {}
    for folder in folders:
        path = folder / "config.json"
        try:  # a regular file only: a FIFO would block the read
            saved = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(saved, dict) or "iters" not in saved:
            continue
        iters = saved["iters"]
        if type(iters) is not int or not 0 < iters <= flags.MAX_COUNT:
            shown = repr(iters) if isinstance(iters, (int, float)) else repr(str(iters)[:40])
            raise UsageError(f"--resume: {path} records iters {shown}, not a count of iterations "
                             "(an edited file?); name --iters, or mend the file")
        found.setdefault(iters, folder)
    if len(found) > 1:  # --amp --device auto: the run this machine resolves to is not known yet
        runs = " and ".join(f"{folder} (--iters {iters})" for iters, folder in found.items())
        raise UsageError(f"--resume: two runs could be the one meant, {runs}; "
                         "name --iters, --device or --amp-dtype")
    return next(iter(found), None)


def validate(cfg: RunConfig) -> None:
    """Checks across flags; each failure is one UsageError line naming the fix."""
    if cfg.amp_dtype != "auto" and not cfg.amp:
        raise UsageError(f"--amp-dtype {cfg.amp_dtype} needs --amp")
    if cfg.eval_draws > 1 and not cfg.evaluate:
        raise UsageError(f"--eval-draws {cfg.eval_draws} needs --evaluate N (the samples per draw)")
    if cfg.save_samples and not cfg.evaluate:
        raise UsageError("--save-samples needs --evaluate N (the samples to write)")
    if cfg.resume and cfg.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: pick one")
    if cfg.xla and cfg.framework != "tensorflow":
        raise UsageError("--xla is TensorFlow's compiler; PyTorch's is --compile")
    if cfg.compile and cfg.framework != "pytorch":
        raise UsageError("--compile is PyTorch's compiler (torch.compile); TensorFlow's is --xla")
    if cfg.framework == "pytorch" and (cfg.distribute or cfg.replicas):
        raise UsageError(f"--{'distribute' if cfg.distribute else 'replicas'} is TensorFlow's; PyTorch "
                         "runs data parallel under torchrun: torchrun --standalone --nproc-per-node N SCRIPT")
    if cfg.replicas and cfg.distribute != "mirrored":
        raise UsageError("--replicas N goes with --distribute mirrored (multi-worker: one replica per "
                         "worker's device, the workers listed in TF_CONFIG)")
    if cfg.sync_bn and cfg.framework == "tensorflow" and not cfg.distribute:
        raise UsageError("--sync-bn synchronises batch norm across replicas: add --distribute")
    if cfg.xla and cfg.distribute:
        raise UsageError("--xla under --distribute is not supported (XLA-compiled steps under a "
                         "tf.distribute strategy crash in Keras 3: keras#21366)")
    if cfg.growth_factor <= 1:
        raise UsageError(f"--growth-factor {cfg.growth_factor} must be above 1 (the scale grows)")
    if not 0 < cfg.backoff_factor < 1:
        raise UsageError(f"--backoff-factor {cfg.backoff_factor} must be between 0 and 1 (the scale shrinks)")
    if cfg.framework == "tensorflow" and (cfg.growth_factor, cfg.backoff_factor) != (
            LOSS_SCALE_GROWTH_FACTOR, LOSS_SCALE_BACKOFF_FACTOR):
        raise UsageError("Keras' LossScaleOptimizer always doubles and halves its scale: "
                         "--growth-factor and --backoff-factor are PyTorch-only")
    if cfg.ema_decay and models.get(cfg.model).family != "GAN":
        raise UsageError("--ema-decay averages a GAN's generator; the VAE has none")
    if cfg.weight_decay and cfg.optimizer != "adamw":
        raise UsageError("--weight-decay needs --optimizer adamw (Adam's L2 penalty is not offered)")
    if cfg.image_size and cfg.dataset in POINT_DATASETS:
        raise UsageError(f"--image-size resizes images; --dataset {cfg.dataset} is 2-D points: leave it out")
    if cfg.data_dir and cfg.dataset in POINT_DATASETS:  # they are sampled, not read: the path was recorded unused
        raise UsageError(f"--data-dir names the files of an image dataset; --dataset {cfg.dataset} is 2-D points "
                         "sampled in memory: leave it out")
    if cfg.dataset in ("fashion-mnist", "cifar10", "folder") and not cfg.data_dir:
        raise UsageError(f"--dataset {cfg.dataset} needs --data-dir (no embedded copy)")
    if cfg.out and (problem := flags.output_problem(Path(cfg.out), folder=True)):
        raise UsageError(f"--out: {problem}")
    if cfg.dataset == "folder" and cfg.data_dir and (inside := run_folder_inside_data(cfg)):
        where = f"--out {cfg.out}" if cfg.out else f"the default run folder ({inside}/...)"
        raise UsageError(f"{where} lies inside --data-dir {cfg.data_dir}, whose every visible folder --dataset "
                         "folder reads as a class: the run would become data; give an --out outside it "
                         "(a run already there: move it out first)")
    if cfg.data_limit is not None and cfg.data_limit < cfg.batch_size:
        raise UsageError(f"--data-limit {cfg.data_limit} is smaller than --batch-size "
                         f"{cfg.batch_size}: not one full batch")


def run_folder_inside_data(cfg: RunConfig) -> str | None:
    """The run folder (--out, or runs/<model> of the default) where it lies inside --dataset
    folder's --data-dir, below a visible entry of it: one that data.py reads as a class folder
    (a hidden one, .runs/, it skips). None elsewhere, or where the paths cannot be resolved."""
    out = Path(cfg.out) if cfg.out else Path("runs") / cfg.model
    try:
        below = Path(flags.absolute(str(out))).resolve().relative_to(Path(flags.absolute(cfg.data_dir)).resolve())
    except (ValueError, OSError, RuntimeError):  # not inside it; RuntimeError: a link loop (Python 3.11)
        return None
    return str(out) if not below.parts or not below.parts[0].startswith(".") else None


def resolve_precision(cfg: RunConfig, device_type: str, bf16_supported: bool = True) -> str:
    """Map --amp/--amp-dtype and the device to 'fp32', 'amp-fp16' or 'amp-bf16'.

    auto picks float16 on CUDA (tensor cores, needs loss scaling) and bfloat16 on CPU, where
    float16 matmuls are emulated and run 10-20x slower than float32.
    """
    if not cfg.amp:
        return "fp32"
    dtype = cfg.amp_dtype
    if dtype == "auto":
        dtype = "float16" if device_type == "cuda" else "bfloat16"
    if dtype == "bfloat16" and not bf16_supported:
        raise UsageError(f"--amp-dtype bfloat16 is not supported on this {device_type} device; "
                         "use --amp-dtype float16")
    return "amp-fp16" if dtype == "float16" else "amp-bf16"


def describe_precision(precision: str, device_type: str) -> str:
    return {
        "fp32": "float32 (AMP off)",
        "amp-fp16": "AMP float16 with dynamic loss scaling",
        "amp-bf16": "AMP bfloat16 (same exponent range as float32: no loss scaling)",
    }[precision] + (" -- float16 is emulated on CPU and runs slowly"
                    if precision == "amp-fp16" and device_type == "cpu" else "")


def warn_if_bf16_emulated(precision: str, device_type: str, log=print) -> None:
    if precision == "amp-bf16" and device_type == "cpu" and not cpu.has_native_bf16():
        log("note: this CPU has no native bfloat16 (no AVX512-BF16/AMX), so bf16 matmuls are "
            "emulated and AMP runs slower than float32 here; see the README's benchmark")


LOSS_SCALING_FLAGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_loss_scale")


def unused_flags(cfg: RunConfig, precision: str, device_type: str) -> list[str]:
    """The flags set away from their defaults that this run never reads, each with why. Every
    script takes the same flags (benchmark.py hands its others to every configuration), so they
    are accepted; a note says they did nothing, where silence would pass for an effect."""
    # the defaults the parser had: the model's, the dataset's (none for scripts/train_feature_net.py's
    # classifier, which is no model of the registry)
    entry = models.MODELS.get(cfg.model)
    hparams = entry.hparams if entry else None
    defaults = {**dataclasses.asdict(RunConfig(model=cfg.model, framework=cfg.framework)),
                **getattr(hparams, "DEFAULTS", {}), **getattr(hparams, "DATASET_DEFAULTS", {}).get(cfg.dataset, {})}
    changed = {name for name, value in dataclasses.asdict(cfg).items() if value != defaults[name]}
    notes = []
    scaling = [f"--{name.replace('_', '-')}" for name in LOSS_SCALING_FLAGS if name in changed]
    if scaling and precision != "amp-fp16":
        notes.append(f"{', '.join(scaling)}: only float16 scales its loss, and this run is "
                     f"{'float32' if precision == 'fp32' else 'bfloat16'}")
    if "iwae_k" in changed and (entry is None or entry.family != "VAE"):
        notes.append("--iwae-k: the VAE's likelihood bound; a GAN has none")
    elif "iwae_k" in changed and not cfg.evaluate:
        notes.append("--iwae-k: the IWAE bound is measured under --evaluate N only")
    if cfg.sync_bn and entry is not None and not entry.batch_norm:
        notes.append(f"--sync-bn: {cfg.model} has no batch norm to synchronise")
    if "tf32" in changed and device_type != "cuda":
        notes.append(f"--tf32 {cfg.tf32}: TensorFloat-32 is an NVIDIA GPU's; a CPU computes float32 in full")
    return notes


def note_unused_flags(cfg: RunConfig, precision: str, device_type: str, log=print) -> None:
    for note in unused_flags(cfg, precision, device_type):
        log(f"note: {note}: ignored")


def run_dir_for(cfg: RunConfig, precision: str) -> Path:
    if cfg.out:
        return Path(cfg.out)
    return Path("runs") / cfg.model / run_name(cfg, precision)


def run_name(cfg: RunConfig, precision: str) -> str:
    """A run's default folder name, e.g. pytorch-fp32. Another dataset's run is named for it:
    the README's MNIST and 2-D mixture commands, one after the other, met in one folder."""
    return f"{cfg.framework}-{precision}{dataset_suffix(cfg)}"


def dataset_suffix(cfg: RunConfig) -> str:
    return "" if cfg.dataset == RunConfig.dataset else f"-{cfg.dataset}"
