"""WGAN-GP's hyperparameters (Gulrajani et al., 2017): the one source both framework scripts read.

The paper's settings: a critic without batch norm, gradient penalty weight lambda = 10, five
critic updates per generator update, Adam(1e-4, beta1 0, beta2 0.9). On the 2-D mixtures
lambda is 0.1, as in the authors' own code for them (POINT_LAMBDA).

One iteration (--iters counts them) is one generator iteration of the paper's Algorithm 1:
the loop hands the step --batch-size real examples, which it splits into CRITIC_STEPS critic
batches, one critic update on each, then one generator update on a fresh noise batch of the
critic-batch size. So --batch-size counts the examples of one generator iteration: 5 critic
batches of 64 by default, and it must be a multiple of 5 (validate() refuses others).

Networks: for images, DCGAN's generator (GAN/dcgan, with batch norm and its 3x3
convolutions) and, as the critic, the DCGAN paper's discriminator without batch norm (biases
instead), its geometry and N(0, 0.02) init. The critic leaves out GAN/dcgan's 3x3
convolutions: they triple its forward pass (3.4 -> 10.6 MFLOP an image at width 32), which
an iteration runs 16 times, each with a backward pass (real, fake and the penalty's points in
each of 5 critic updates, then G's). For the 2-D mixtures, MLPs of 3 hidden layers of ReLU
units, as the paper's toy models.
"""
from GAN.dcgan import hparams as dcgan

Z_DIM = dcgan.Z_DIM  # 100, for images and points alike
CRITIC_STEPS = 5
LAMBDA = 10.0  # weight of the gradient penalty on images
# On the 2-D mixtures, the weight the authors' own toy code uses (gan_toy.py of the WGAN-GP
# release: "smaller lambda seems to help for toy tasks specifically"). At 10 the MLPs covered
# 0-1 of the ring's 8 modes in 1,000 iterations and 0 in 4,000; at 0.1, 4-5 in 1,000 and 7-8
# in 2,000 (both at Adam 1e-4, beta1 0; README, "WGAN-GP").
POINT_LAMBDA = 0.1
NORM_EPSILON = 1e-12  # inside the square root of the gradient norm: sqrt(0) has no gradient
LEAKY_SLOPE = dcgan.LEAKY_SLOPE  # the convolutional critic's LeakyReLU (0.2)
INIT_STD = dcgan.INIT_STD  # convolution weights ~ N(0, 0.02), biases 0
PIXEL_RANGE = (-1.0, 1.0)  # images are scaled to the range of G's tanh

# The width (--width): for images, DCGAN's base channels (G's last hidden layer, the critic's
# first); for the 2-D mixtures, the MLPs' hidden units are POINT_UNITS_PER_WIDTH times it.
# At the default 32: 32 base channels (DCGAN's CPU default) and 512 hidden units (the paper's).
WIDTH = 32
POINT_UNITS_PER_WIDTH = 16
POINT_HIDDEN_LAYERS = 3

# Adam 7e-4 rather than the paper's 1e-4 (its beta1 0 and beta2 0.9 kept), for as many
# iterations as a default run's 15-minute budget allowed (3,500: 13 min 53 s in PyTorch on a
# 2-core Zen 4; 11 min 9 s since the end layers are matmuls; estimated on an AVX2-only CPU,
# about 13.5-15 in PyTorch and 14-17 in TensorFlow). MNIST's FID at 3,500 iterations, float32,
# seed 0, PyTorch / TensorFlow: 62.2 / 54.5 at 3e-4, 52.5 / 45.5 at 5e-4, 39.8 / 32.5 at 7e-4
# (README, "WGAN-GP"). Samples come from G itself: the average of G's weights (--ema-decay
# 0.999) moved those six FIDs by -2.8 to +4.0, +0.8 on the mean, so the other GANs' default is
# not taken here.
DEFAULTS = dict(
    width=WIDTH,
    iters=3500,
    batch_size=CRITIC_STEPS * 64,
    lr=7e-4,
    beta1=0.0,
    beta2=0.9,
    dataset="mnist",
    sample_every=500,
    log_every=50,
    checkpoint_every=1000,
)

# The 2-D mixtures train 8,000 iterations at Adam 3e-4 with the authors' toy code's beta1 0.5.
# Against the paper's 1e-4 and beta1 0 for 2,000 iterations (float32, seed 0, PyTorch /
# TensorFlow), the samples within 3 sd of a mode went from 0.8% to 40% / 27% on the ring (AMP
# 43% / 23%, 8 of 8 modes in all four), and on the grid from 2.0% / 1.6% with 22 / 18 of 25
# modes to 4.6% / 7.5% with 24 / 25 (AMP 5.4% / 7.0%, 25 / 24 modes; README, "WGAN-GP").
MIXTURE_DEFAULTS = dict(iters=8000, lr=3e-4, beta1=0.5, sample_every=2000)
DATASET_DEFAULTS = {"ring8": MIXTURE_DEFAULTS, "grid25": MIXTURE_DEFAULTS}


def penalty_weight(data_shape: tuple) -> float:
    """lambda for data of this shape: LAMBDA on images, POINT_LAMBDA on 2-D points."""
    return POINT_LAMBDA if len(data_shape) == 1 else LAMBDA


def point_units(width: int) -> int:
    """Hidden units of the 2-D mixtures' MLPs at this --width."""
    return POINT_UNITS_PER_WIDTH * width


def batch_division(cfg) -> tuple[int, int]:
    """(parts, pack) of the batch among data-parallel replicas: each critic batch is sharded on
    its own (common/config.batch_division reads it for the parser's check and both sessions)."""
    return CRITIC_STEPS, 1


def validate(cfg) -> None:
    """The model's own check of the flags (common/config.parse_args calls it)."""
    from common.errors import UsageError

    if cfg.batch_size % CRITIC_STEPS:
        lower = max(CRITIC_STEPS, cfg.batch_size // CRITIC_STEPS * CRITIC_STEPS)
        raise UsageError(f"--batch-size {cfg.batch_size} is not a multiple of {CRITIC_STEPS}: "
                         f"WGAN-GP splits it into {CRITIC_STEPS} critic batches per generator "
                         f"iteration; use e.g. --batch-size {lower} (among N data-parallel replicas, "
                         f"a multiple of {CRITIC_STEPS}N)")
    if cfg.compile:  # at once, not after the data is loaded and the compile has failed
        raise UsageError("--compile: torch.compile cannot differentiate twice (aot_autograd has no double "
                         "backward), and the gradient penalty does; train WGAN-GP eagerly in PyTorch "
                         "(TensorFlow's --xla compiles it)")
