"""DCGAN's hyperparameters (Radford et al., 2016): the one source both framework scripts read.

Every kernel/stride/padding in the two scripts has a PyTorch and a Keras form that compute the
same function: Conv2d(4, 2, padding=1) == Conv2D(4, 2, "same") and ConvTranspose2d(4, 2, 1) ==
Conv2DTranspose(4, 2, "same") on even sizes, and a k x k "valid" (transposed) convolution
between 1x1 and k x k. (k=3 or 5 with stride 2 does not match: TF pads bottom/right.)
"""
Z_DIM = 100
# The width (--width): channels of G's last hidden layer and D's first, doubled at each lower
# resolution (ngf = ndf of the PyTorch DCGAN example). The example uses 64 for 64x64 images on
# a GPU; 32 is plenty for MNIST and a quarter of 64's FLOPs (64 took 2.5x the CPU step time, README).
WIDTH = 32
# 3x3 convolutions (stride 1, batch norm, then G's ReLU or D's LeakyReLU) after each hidden
# layer of G and of D, at its resolution. DCGAN's G has one transposed convolution per
# resolution, too little to shape a stroke: one more convolution per resolution, as
# Progressive GAN and StyleGAN have, took MNIST's FID from 154 to 76 at 2,000 iterations
# (README, "what moved the FID").
REFINE_CONVS = 1
LEAKY_SLOPE = 0.2
PIXEL_RANGE = (-1.0, 1.0)  # images are scaled to the range of G's tanh
INIT_STD = 0.02        # conv weights ~ N(0, 0.02); batch-norm gamma ~ N(1, 0.02), beta = 0
BN_MOMENTUM = 0.1      # PyTorch's convention; Keras' momentum is 1 - this (0.9)
BN_EPSILON = 1e-5      # PyTorch's default; Keras' is 1e-3

# Image side -> (side of the smallest feature map, number of stride-2 layers).
GEOMETRY = {28: (7, 2), 32: (4, 3), 64: (4, 4)}

# 10,000 iterations (about 11 epochs of MNIST) at Adam 7e-4 rather than the paper's 2e-4: over
# four seeds in each framework and precision (three draws of samples each), FID 4.3-4.9 on the
# mean, precision 0.708-0.739, AMP 0.95x float32's FID in PyTorch and 1.05x in TensorFlow. The
# former 5e-4 scored FID 4.5-5.6, TensorFlow's AMP precision 0.704 on the same draws (two of its
# six seeds under 0.7 on five draws); 3e-4 needed 14,000 iterations for 5e-4's quality; 2e-4
# scored 9.6 and 11.6 with precision 0.665 and 0.637 (README, "what moved the FID"). The budget
# is a default run's 15 minutes on a 2-core CPU in float32: 8.7-12.1 minutes where the CPU has
# AVX512-BF16; on an AVX2-only one about 13-14 in PyTorch and, by estimate, 15-17 in TensorFlow
# (README, "DCGAN").
# Samples and evaluation come from an average of G's weights (--ema-decay): 8.4 against G's own
# 12.4 at 10,000 iterations and lr 2e-4 in PyTorch.
DEFAULTS = dict(
    width=WIDTH,
    iters=10000,
    batch_size=64,
    lr=7e-4,
    beta1=0.5,
    beta2=0.999,
    ema_decay=0.999,
    dataset="mnist",
    sample_every=2000,
    log_every=100,
    checkpoint_every=2000,
)


def geometry(height: int, width: int) -> tuple[int, int]:
    """(smallest feature-map side, stride-2 layers) for an image size, or a clear refusal."""
    from common.errors import UsageError

    if height != width or height not in GEOMETRY:
        sizes = ", ".join(f"{side}x{side}" for side in GEOMETRY)
        raise UsageError(f"DCGAN takes {sizes} images, not {height}x{width}; "
                         "pass --image-size 32 or 64 to resize")
    return GEOMETRY[height]
