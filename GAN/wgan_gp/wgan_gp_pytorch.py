"""WGAN-GP (Gulrajani et al., 2017) in PyTorch, with automatic mixed precision.

    python GAN/wgan_gp/wgan_gp_pytorch.py --amp                     # MNIST, convolutional
    python GAN/wgan_gp/wgan_gp_pytorch.py --dataset ring8 --iters 1000  # 2-D ring, MLPs

A critic f scores real examples high and fake ones low; it minimises
    E[f(G(z))] - E[f(x)] + lambda * E[(||grad f(x_hat)|| - 1)^2],
with x_hat = eps * x + (1 - eps) * G(z), eps ~ U(0, 1) per example, and the gradient's norm
taken per example over all its pixels. G minimises -E[f(G(z))]. Images: DCGAN's generator
and, as the critic, the DCGAN paper's discriminator without batch norm; 2-D points: MLPs of
3 hidden ReLU layers. The last layer of each runs in float32 under autocast; losses are float32.

--batch-size counts the examples of one generator iteration: 5 critic batches. Each
iteration splits the loop's batch into hparams.CRITIC_STEPS critic batches and updates the
critic once on each (fresh noise each time), then G once on a fresh noise batch of the
critic-batch size, as the paper's Algorithm 1.

The gradient penalty under AMP, as the PyTorch AMP examples write it: the critic's output,
computed under autocast, is scaled (`scaler.scale`) before `torch.autograd.grad(...,
create_graph=True)`, which runs with autocast off (a backward pass under autocast would run the
float32 last layer's gradient in 16 bits), so its float16 gradients do not underflow; those
gradients are divided by the current scale (they belong to no optimizer, so `unscale_` is not
the tool), and the penalty is computed from them in float32; then the whole loss is scaled,
backpropagated and stepped as usual.
The training step, with its autocast and GradScaler calls, is WGANGP.train_step below. The
TensorFlow twin is wgan_gp_tensorflow.py; the hyperparameters of both are in hparams.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's code, whatever is installed

import torch
from torch import nn

from common.config import parse_args
from common.errors import exit_on_user_error
from common.pytorch.amp import FullPrecision, SkippedUpdates, scale_on_device
from common.pytorch.data import load_data
from common.pytorch.layers import Conv2d, init_like_keras_dense
from common.pytorch.runtime import Runtime, setup
from common.pytorch.session import fit
from GAN.dcgan import hparams as dcgan_hparams
from GAN.dcgan.dcgan_pytorch import Generator
from GAN.gan_step_pytorch import GAN
from GAN.wgan_gp import hparams


class Critic(nn.Module):
    """The DCGAN paper's discriminator without batch norm (biases instead; hparams.py says why
    it leaves out GAN/dcgan's 3x3 convolutions): strided convolutions with
    LeakyReLU 0.2 down to one unbounded score, the last layer in float32."""

    def __init__(self, image_shape: tuple, width: int):
        super().__init__()
        channels, height, image_width = image_shape
        base, downsamplings = dcgan_hparams.geometry(height, image_width)
        features = width
        # 28x28x1 -> 14x14x32
        layers = [nn.Conv2d(channels, features, 4, 2, 1), nn.LeakyReLU(hparams.LEAKY_SLOPE)]
        for _ in range(downsamplings - 1):  # 14x14x32 -> 7x7x64: each halves the side, doubles the channels
            layers += [nn.Conv2d(features, features * 2, 4, 2, 1), nn.LeakyReLU(hparams.LEAKY_SLOPE)]
            features *= 2
        self.body = nn.Sequential(*layers)
        # 7x7x64 -> 1x1x1, one score in float32 (a matmul: common/pytorch/layers.py, as DCGAN's D)
        self.out = FullPrecision(Conv2d(features, 1, base, 1, 0))
        for layer in self.modules():  # N(0, 0.02) weights as DCGAN's, zero biases as Keras'
            if isinstance(layer, nn.Conv2d):
                nn.init.normal_(layer.weight, 0.0, hparams.INIT_STD)
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        return self.out(self.body(x)).view(-1, 1)


class MLP(nn.Module):
    """The 2-D mixtures' networks: inputs -> 3 x (units, ReLU) -> outputs, the last in float32
    (G: z -> a point; the critic: a point -> one score)."""

    def __init__(self, inputs: int, units: int, outputs: int):
        super().__init__()
        layers = []
        for index in range(hparams.POINT_HIDDEN_LAYERS):
            layers += [nn.Linear(inputs if index == 0 else units, units), nn.ReLU()]
        self.hidden = nn.Sequential(*layers)
        self.out = FullPrecision(nn.Linear(units, outputs))
        init_like_keras_dense(self)

    def forward(self, x):
        return self.out(self.hidden(x))


def build_networks(data_shape: tuple, width: int) -> dict[str, nn.Module]:
    """G and the critic (named "discriminator", as in every GAN's checkpoints) for data of this
    shape, (C, H, W) images or (2,) points: what main() trains, scripts/parity.py ports."""
    if len(data_shape) == 3:
        return {"generator": Generator(data_shape, width), "discriminator": Critic(data_shape, width)}
    units = hparams.point_units(width)
    return {"generator": MLP(hparams.Z_DIM, units, data_shape[0]), "discriminator": MLP(data_shape[0], units, 1)}


# --- losses, in float32 ----------------------------------------------------------------------
def gradient_penalty(critic: nn.Module, real, fake, eps, scaler: torch.amp.GradScaler):
    """E[(||grad critic(x_hat)|| - 1)^2], the norm per example over all pixels, in float32.

    Under float16 the critic's output is scaled before differentiating, as the loss will be,
    so small gradients do not underflow; the gradients are then divided by that scale, read on
    the device (no host sync). With the scaler off (float32, bfloat16) nothing is scaled.
    Called under autocast, it differentiates with autocast off, as the AMP examples do: each
    backward op then runs in the dtype its forward op ran in."""
    x_hat = (eps * real + (1.0 - eps) * fake).detach().requires_grad_(True)
    scaled_scores = scaler.scale(critic(x_hat))  # unchanged when the scaler is off
    with torch.autocast(device_type=x_hat.device.type, enabled=False):
        (gradients,) = torch.autograd.grad(scaled_scores, x_hat, grad_outputs=torch.ones_like(scaled_scores),
                                           create_graph=True)
    scale = scale_on_device(scaler, x_hat.device)  # after scale(): the scale it just used
    if scale is not None:
        gradients = gradients / scale
    gradients = gradients.float().flatten(1)
    norm = torch.sqrt(gradients.square().sum(1) + hparams.NORM_EPSILON)
    return (norm - 1.0).square().mean()


def critic_loss(real_scores, fake_scores, penalty, penalty_weight):
    """E[f(G(z))] - E[f(x)] + lambda * penalty: the critic's estimate of the Wasserstein
    distance, negated, plus the penalty (lambda: hparams.penalty_weight)."""
    return fake_scores.float().mean() - real_scores.float().mean() + penalty_weight * penalty.float()


def generator_loss(fake_scores):
    return -fake_scores.float().mean()


class WGANGP(GAN):
    """The shared GAN's networks, optimizers, samples and evaluation (GAN/gan_step_pytorch.py),
    with WGAN-GP's own training step. The critic is the GAN's discriminator."""

    def __init__(self, generator: nn.Module, critic: nn.Module, cfg, runtime: Runtime, data):
        # No loss functions for GAN's step: train_step below calls critic_loss and generator_loss.
        super().__init__(generator, critic, None, None, hparams.Z_DIM, cfg, runtime, data)
        self.critic, self.critic_optimizer = self.discriminator, self.d_optimizer
        self.parallel_critic = self.parallel_discriminator  # DDP under torchrun (GAN.__init__)
        self.penalty_weight = hparams.penalty_weight(data.sample_shape)  # lambda: 10 on images, 0.1 on points

    def train_step(self, real: torch.Tensor) -> dict:
        device = real.device
        eps_shape = (1,) * (real.dim() - 1)  # one eps per example, broadcast over its pixels
        totals = torch.zeros(3, device=device)  # critic loss, penalty, Wasserstein estimate
        # Under float16, whether any of the 6 updates was skipped (the scale is compared around
        # each update(): over the whole iteration a growth and a backoff would cancel out).
        skips = SkippedUpdates(self.scaler, device)
        # Under torchrun each critic batch was sharded on its own (hparams.batch_division), so
        # part i here is this replica's share of critic batch i, as in one process.
        for real_part in torch.chunk(real, hparams.CRITIC_STEPS):
            count = real_part.shape[0]
            # torch.randn and torch.rand in one process; under torchrun this replica's share
            z = self.replicas.randn(count, self.z_dim, device=device)
            eps = self.replicas.rand(count, *eps_shape, device=device)
            with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on):
                with torch.no_grad():  # the critic's update needs no gradient through G
                    fake = self.generator(z)
                real_scores, fake_scores = self.parallel_critic(real_part), self.parallel_critic(fake)
                penalty = gradient_penalty(self.parallel_critic, real_part, fake, eps, self.scaler)
                c_loss = critic_loss(real_scores, fake_scores, penalty, self.penalty_weight)
            self.critic_optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(c_loss).backward()
            if self.clip_grad_norm:
                self.scaler.unscale_(self.critic_optimizer)  # clip the true gradients, not the scaled ones
                nn.utils.clip_grad_norm_(self.critic.parameters(), self.clip_grad_norm)
            self.scaler.step(self.critic_optimizer)  # skipped if a gradient is inf/NaN
            # update() after every step(), not once per iteration: each critic update is an
            # optimizer step of its own (GradScaler refuses a second step() of an optimizer
            # before update()), and after an overflow the next critic step must run at the
            # halved scale. So the scale's growth interval counts 6 updates per iteration.
            self.scaler.update()
            skips.after_update()
            wasserstein = real_scores.detach().float().mean() - fake_scores.detach().float().mean()
            totals += torch.stack([c_loss.detach(), penalty.detach(), wasserstein])

        # G's update: a fresh noise batch of the critic-batch size, through the updated critic,
        # whose weights need no gradient here.
        z = self.replicas.randn(real.shape[0] // hparams.CRITIC_STEPS, self.z_dim, device=device)
        self.critic.requires_grad_(False)
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on):
            g_loss = generator_loss(self.critic(self.parallel_generator(z)))
        self.g_optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(g_loss).backward()
        self.critic.requires_grad_(True)
        if self.clip_grad_norm:
            self.scaler.unscale_(self.g_optimizer)
            nn.utils.clip_grad_norm_(self.generator.parameters(), self.clip_grad_norm)
        self.scaler.step(self.g_optimizer)
        if self.average:
            self.average.update(self.generator)
        self.scaler.update()
        skips.after_update()

        d_loss, penalty, wasserstein = totals / hparams.CRITIC_STEPS  # means over the critic steps
        return {"d_loss": d_loss, "g_loss": g_loss.detach(), "penalty": penalty, "wasserstein": wasserstein,
                **skips.metrics()}  # "skipped" under float16


@exit_on_user_error
def main(argv=None):
    cfg = parse_args("wgan_gp", "pytorch", argv)  # refuses a --batch-size not a multiple of 5
    runtime = setup(cfg)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    networks = build_networks(data.sample_shape, cfg.width)
    wgan = WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
    return fit(cfg, runtime, wgan, data)


if __name__ == "__main__":
    main()
