"""LSGAN's hyperparameters: the one source both framework scripts read.

LSGAN trains with the vanilla GAN's networks (their sizes live in GAN/vanilla_gan/hparams.py)
and the vanilla GAN's training settings (the 2-D mixtures' too), so the two models differ only
in their losses.
"""
from GAN.vanilla_gan.hparams import (  # noqa: F401  (re-exported on purpose)
    DATASET_DEFAULTS,
    DEFAULTS,
    PIXEL_RANGE,
    Z_DIM,
    pack,
    validate,
)
