"""LSGAN's hyperparameters: the one source both framework scripts read.

LSGAN trains with the vanilla GAN's networks (their sizes live in GAN/vanilla_gan/hparams.py)
and the vanilla GAN's training settings, so on MNIST and the grid of 25 the two models differ
only in their losses. On the ring of 8 LSGAN takes larger batches for fewer iterations (below).
"""
from GAN.vanilla_gan.hparams import DATASET_DEFAULTS as VANILLA_DATASET_DEFAULTS
from GAN.vanilla_gan.hparams import (  # noqa: F401  (re-exported on purpose)
    DEFAULTS,
    PIXEL_RANGE,
    Z_DIM,
    batch_division,
    pack,
    validate,
)

# The least-squares loss leaves more of G's samples on the ring's arcs than the vanilla GAN's:
# in batches of 128 for 30,000 iterations TensorFlow's seeds 0-4 had 74.6% of them within 3 sd
# on average, seed 0 68.5%. Batches of 256 for 25,000 iterations (1.3x the time): 76.4%, every
# seed over 70% (20,000: 73.7%; 30,000: 77.5%, but an estimated 16.5 minutes on an AVX2 CPU,
# over a default run's 15-minute budget; README, "what moved the FID").
DATASET_DEFAULTS = {
    **VANILLA_DATASET_DEFAULTS,
    "ring8": dict(VANILLA_DATASET_DEFAULTS["ring8"], iters=25000, batch_size=256),
}
