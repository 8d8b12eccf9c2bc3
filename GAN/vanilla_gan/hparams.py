"""The vanilla GAN's hyperparameters: the one source both framework scripts read.

MLPs as in the widely copied PyTorch-GAN collection (eriklindernoren/PyTorch-GAN, gan.py):
G z -> 256 -> 512 -> 1024 -> data, D data -> 512 -> 256 -> logit, LeakyReLU 0.2 throughout,
Adam 2e-4 with beta1 0.5 (the DCGAN paper's), batch 64; without that collection's first hidden
layer of 128 in G, and without its batch norm in G, which would make data-parallel replicas
normalise their own halves. The classic
single-file version (one hidden layer of 128, Adam 1e-3) scored FID 475-527 on MNIST; these
networks 35-37 at 20,000 iterations in PyTorch, 22.5 from the average of G (README, "what moved
the FID"). Change a value here and both twins change together.
"""
Z_DIM = 100
# The width (--width): G's hidden layers have 1, 2 and 4 times it, D's 2 and 1 times it.
WIDTH = 256
G_HIDDEN = (1, 2, 4)
D_HIDDEN = (2, 1)
LEAKY_SLOPE = 0.2  # set explicitly: torch defaults to 0.01, Keras to 0.3
PIXEL_RANGE = (-1.0, 1.0)  # images are scaled to the range of G's tanh
# On the 2-D mixtures D judges pairs of samples (PacGAN, Lin et al., 2018): a G that collapses
# onto one mode yields pairs that are never from two modes, which D learns to spot. Without it
# these networks covered 0 of the ring's 8 modes in 20,000 iterations (README, "what moved the FID").
POINT_PACK = 2

# Defaults of the shared flags (common/config.py); the command line overrides them.
DEFAULTS = dict(
    width=WIDTH,
    iters=20000,
    batch_size=64,
    lr=2e-4,
    beta1=0.5,
    beta2=0.999,
    dataset="mnist",
    sample_every=2000,
    log_every=100,
    checkpoint_every=5000,
    # Sample and evaluate from the average of G's weights (training is unchanged): on MNIST it
    # took PyTorch's FID from 37.2 to 22.5 at 20,000 iterations and from 59.0 to 41.7 at 12,000
    # (make demo's budget); TensorFlow scores 21.9 from the average at 20,000 (README; its
    # pairs in "what moved the FID" were measured with Keras' own Adam, before 12aaa7a).
    ema_decay=0.999,
)

# The 2-D mixtures train longer: each mode's samples must land within 3 sd (0.03 on the ring),
# and G's last steps wobble by more, which the average of G smooths out. On the
# ring (PyTorch, float32) the average took the samples within 3 sd from 16-20% to 42% (LSGAN)
# and 81% (vanilla GAN); half the learning rate then LSGAN's to 68%, and batches of 128 to 76%
# (vanilla GAN 86%; TensorFlow's LSGAN from 54% to 74%; LSGAN now takes 256, its hparams.py).
# On the grid half the rate found 8 of 25 modes in 30,000 iterations where 2e-4 found all 25
# (README).
DATASET_DEFAULTS = {
    "ring8": dict(iters=30000, batch_size=128, lr=1e-4, sample_every=5000),
    "grid25": dict(iters=30000, sample_every=5000),
}


def pack(data_shape: tuple) -> int:
    """How many samples D judges at once: POINT_PACK on 2-D points, 1 on images. (Points come
    from POINT_DATASETS only, which batch_division and validate below name.)"""
    return POINT_PACK if len(data_shape) == 1 else 1


def batch_division(cfg) -> tuple[int, int]:
    """(parts, pack) of the batch among data-parallel replicas: on the mixtures each replica's
    share divides into D's packs (common/config.batch_division reads it for the parser's check
    and both sessions)."""
    from common.config import POINT_DATASETS

    return 1, POINT_PACK if cfg.dataset in POINT_DATASETS else 1


def validate(cfg) -> None:
    """The model's own check of the flags (common/config.parse_args calls it)."""
    from common.config import POINT_DATASETS
    from common.errors import UsageError

    if cfg.dataset in POINT_DATASETS and cfg.batch_size % POINT_PACK:
        raise UsageError(f"--batch-size {cfg.batch_size} is not a multiple of {POINT_PACK}: on the 2-D "
                         f"mixtures D judges samples in packs of {POINT_PACK}")
