"""The exponential moving average of G's weights (--ema-decay), written once for both
frameworks; common/pytorch/ema.py and common/tensorflow/ema.py apply it to their networks.

GANs sample and are evaluated with the average of G's weights over the last steps rather than
G itself: the average smooths the oscillation of adversarial training (Yazici et al. 2019,
"The Unusual Effectiveness of Averaging in GAN Training"; Karras et al.'s Progressive GAN and
StyleGAN sample from such an average). It starts as a copy of G at step 0 and moves after
every G update:

    average <- average + (1 - d_n) * (G - average),   d_n = min(decay, (1 + n) / (10 + n))

at the n-th update: the warm-up of tf.train.ExponentialMovingAverage's `num_updates`, so that
the first steps' averages do not hold on to the random initial weights (with decay 0.999 a
plain average would still weigh them 13% after 2,000 steps). Every weight is averaged, batch
norm's running statistics too, in float32 whatever the precision of the training step.
"""
from __future__ import annotations


def decay_at(update, decay, minimum=min):
    """d_n for the n-th update (n >= 1): Python numbers, or a framework's tensors with its
    `minimum` (TensorFlow computes it inside the compiled step)."""
    return minimum(decay, (1.0 + update) / (10.0 + update))
