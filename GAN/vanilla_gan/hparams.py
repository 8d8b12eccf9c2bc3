"""The vanilla GAN's hyperparameters: the one source both framework scripts read.

As in the classic single-file collection: z of 100, one hidden layer of 128, Adam 1e-3,
batch 64. Change a value here and both twins change together.
"""
Z_DIM = 100
HIDDEN = 128  # the width (--width): units of G's and D's hidden layer
LEAKY_SLOPE = 0.2  # D's LeakyReLU; set explicitly (torch defaults to 0.01, Keras to 0.3)
PIXEL_RANGE = (-1.0, 1.0)  # images are scaled to the range of G's tanh

# Defaults of the shared flags (common/config.py); the command line overrides them.
DEFAULTS = dict(
    width=HIDDEN,
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
