"""LSGAN's hyperparameters: the one source both framework scripts read.

The networks are the vanilla GAN's MLPs (their sizes live in GAN/vanilla_gan/hparams.py):
LSGAN changes only the losses, so the two models can be compared on the same architecture.
"""
DEFAULTS = dict(
    iters=20000,
    batch_size=64,
    lr=1e-3,
    beta1=0.9,
    beta2=0.999,
    dataset="mnist",
    sample_every=2000,
    log_every=100,
    checkpoint_every=5000,
)
