"""The vanilla VAE's hyperparameters: the one source both framework scripts read.

The PyTorch examples' VAE (pytorch/examples vae/main.py), after Kingma & Welling: one hidden
layer of 400 ReLU units in the encoder and in the decoder, a 20-dimensional latent space, Adam
1e-3, batch 128. (The paper's MNIST runs used 500 tanh units, Adagrad and batches of 100.)
Change a value here and both twins change together.
"""
WIDTH = 400  # the width (--width): units of the encoder's and the decoder's hidden layer
LATENT = 20

# The decoder's outputs are Bernoulli probabilities, so the data are scaled to [0, 1].
PIXEL_RANGE = (0.0, 1.0)

# Sample grids: decodes of 64 fixed prior draws, as many as the GANs' grids (sampling.GRID_IMAGES;
# the run's fixed_noise.npy, the same z in both frameworks) and reconstructions of the first 32 test images.
RECONSTRUCTION_COUNT = 32

# Defaults of the shared flags (common/config.py); the command line overrides them.
DEFAULTS = dict(
    width=WIDTH,
    iters=10000,
    batch_size=128,
    lr=1e-3,
    beta1=0.9,
    beta2=0.999,
    dataset="mnist",
    sample_every=2000,
    log_every=100,
    checkpoint_every=5000,
)
