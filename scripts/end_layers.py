"""What do DCGAN's end layers as matmuls save? Paired timing of one iteration's network work.

    python scripts/end_layers.py                                  # both frameworks, float32
    python scripts/end_layers.py --frameworks tensorflow --amp    # bfloat16 on a CPU
    TF_ENABLE_ONEDNN_OPTS=0 python scripts/end_layers.py --frameworks tensorflow   # Eigen's kernels
    ONEDNN_MAX_CPU_ISA=AVX2 python scripts/end_layers.py --frameworks pytorch       # oneDNN held to AVX2

G's first layer (z as a 1x1 map -> 7x7x64) and D's last (7x7x64 -> one logit) are convolutions
whose input or output is a single position: each is a matmul. common/pytorch/layers.py and
common/tensorflow/layers.py compute them as one; this script builds DCGAN's networks both ways
with the same weights (the frameworks' own convolutions there) and times G's forward pass, D's
gradients on a real and a fake batch and G's gradient through D, without the optimizers,
alternating the two call by call so that a machine's drift hits both alike. It prints the
medians and the median of the paired ratios (above 1: the matmuls are faster).
"""
from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

from common import cpu, models, quiet
from common.config import MAX_WIDTH
from common.errors import UsageError, exit_on_user_error
from common.flags import OneLineErrorParser, first_paragraph, int_in, repeated_values_problem

BATCH, IMAGE = 64, 28
MAX_CALLS = 100_000  # 1,000x the default: hours of timing at tens of ms a call, where 100 settle the medians


def paired(first, second, calls: int) -> tuple[float, float, float]:
    """Median ms of each and the median ratio first/second, calls alternated."""
    for _ in range(3):
        first(), second()
    times = np.empty((calls, 2))
    for row in times:
        for column, call in enumerate((first, second)):
            start = time.perf_counter()
            call()
            row[column] = time.perf_counter() - start
    return 1e3 * np.median(times[:, 0]), 1e3 * np.median(times[:, 1]), float(np.median(times[:, 0] / times[:, 1]))


def pytorch_steps(width: int, amp: bool):
    import torch
    from torch import nn

    from GAN.dcgan import dcgan_pytorch, hparams

    torch.manual_seed(0)
    matmuls = [net.to(memory_format=torch.channels_last)
               for net in dcgan_pytorch.build_networks((1, IMAGE, IMAGE), width).values()]
    convolutions = copy.deepcopy(matmuls)
    generator, discriminator = convolutions
    for parent, name, own in [(generator.body, "0", nn.ConvTranspose2d), (discriminator.out, "layer", nn.Conv2d)]:
        layer = getattr(parent, name)
        plain = own(layer.in_channels, layer.out_channels, layer.kernel_size, bias=False)
        plain.load_state_dict(layer.state_dict())
        setattr(parent, name, plain.to(memory_format=torch.channels_last))
    z = torch.randn(BATCH, hparams.Z_DIM)
    real = torch.randn(BATCH, 1, IMAGE, IMAGE).contiguous(memory_format=torch.channels_last)

    def step(generator, discriminator):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            fake = generator(z)
            (discriminator(real).float().mean() + discriminator(fake.detach()).float().mean()).backward()
            discriminator.requires_grad_(False)  # G's gradient through D, as GAN/gan_step_pytorch.py
            discriminator(fake).float().mean().backward()
            discriminator.requires_grad_(True)
    return (lambda: step(*convolutions)), (lambda: step(*matmuls))


def tensorflow_steps(width: int, amp: bool):
    quiet.quiet_tensorflow_start()
    import keras
    import tensorflow as tf

    from GAN.dcgan import dcgan_tensorflow, hparams

    keras.mixed_precision.set_global_policy("mixed_bfloat16" if amp else "float32")
    keras.utils.set_random_seed(0)
    matmuls = dcgan_tensorflow.build_networks((IMAGE, IMAGE, 1), width)
    ours = dcgan_tensorflow.Conv2DTranspose, dcgan_tensorflow.Conv2D
    dcgan_tensorflow.Conv2DTranspose, dcgan_tensorflow.Conv2D = keras.layers.Conv2DTranspose, keras.layers.Conv2D
    try:
        convolutions = dcgan_tensorflow.build_networks((IMAGE, IMAGE, 1), width)
    finally:
        dcgan_tensorflow.Conv2DTranspose, dcgan_tensorflow.Conv2D = ours
    for name, network in convolutions.items():
        network.set_weights(matmuls[name].get_weights())
    z, real = tf.random.normal((BATCH, hparams.Z_DIM)), tf.random.normal((BATCH, IMAGE, IMAGE, 1))

    def step_of(networks):
        generator, discriminator = networks["generator"], networks["discriminator"]

        def mean(logits):
            return tf.reduce_mean(tf.cast(logits, tf.float32))

        @tf.function
        def step():
            with tf.GradientTape() as g_tape:
                fake = generator(z, training=True)
                with tf.GradientTape() as d_tape:
                    d_loss = (mean(discriminator(real, training=True))
                              + mean(discriminator(tf.stop_gradient(fake), training=True)))
                d_gradients = d_tape.gradient(d_loss, discriminator.trainable_variables)
                g_loss = mean(discriminator(fake, training=True))
            g_gradients = g_tape.gradient(g_loss, generator.trainable_variables)
            return tf.add_n([tf.reduce_sum(g) for g in d_gradients + g_gradients])
        return lambda: step().numpy()  # .numpy(): the call ends when the work does
    return step_of(convolutions), step_of(matmuls)


@exit_on_user_error
def main(argv=None) -> int:
    parser = OneLineErrorParser(description=first_paragraph(__doc__))
    parser.add_argument("--frameworks", nargs="+", choices=models.FRAMEWORKS, default=list(models.FRAMEWORKS))
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast / mixed_bfloat16 policy")
    parser.add_argument("--calls", type=int_in(1, MAX_CALLS), default=100,
                        help=f"timed calls of each (1 to {MAX_CALLS:,})")
    parser.add_argument("--width", type=int_in(1, MAX_WIDTH), default=32,
                        help=f"DCGAN's width (the default: 32; at most {MAX_WIDTH}, as the model scripts' --width)")
    args = parser.parse_args(argv)
    if problem := repeated_values_problem("--frameworks", args.frameworks):  # each measured twice
        raise UsageError(problem)
    print(f"CPU: {cpu.summary()}")
    for framework in args.frameworks:
        steps = {"pytorch": pytorch_steps, "tensorflow": tensorflow_steps}[framework](args.width, args.amp)
        own, matmul, ratio = paired(*steps, args.calls)
        print(f"{framework} {'bfloat16' if args.amp else 'float32'}: own convolutions {own:.2f} ms, "
              f"matmuls {matmul:.2f} ms, paired ratio {ratio:.3f} (median of {args.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
