"""From the same weights, batch and noise, the PyTorch and TensorFlow twins take the same
training step: every model's losses, weights and averaged weights agree in float32, and so do
the next step's losses, on MNIST and, for the models that take them, on the 2-D mixtures.
(tests/test_porting.py checks the networks' forward passes; this checks the losses, the
backward passes (the gradients, in Adam's first moments), the optimizers and the weight
averages too.)"""
import copy

import numpy as np
import pytest
import tensorflow as tf
import torch

from common import models
from common.config import parse_args
from common.pytorch import data as torch_data
from common.pytorch import porting as torch_porting
from common.pytorch import runtime as torch_runtime
from common.tensorflow import data as keras_data
from common.tensorflow import porting as keras_porting
from common.tensorflow import runtime as keras_runtime
from common.tensorflow.optimizers import Adam, AdamW
from tests.conftest import available_cores

BATCH = 20  # divisible by WGAN-GP's 5 critic steps and by the MLP GANs' packs of 2 points
SHAPE = (28, 28, 1)  # single-channel images and points: the porting reorders nothing
# every model on MNIST, and the MLPs of the models that take the 2-D mixtures on ring8
CASES = [(model, "mnist") for model in models.MODELS] + [
    (model, "ring8") for model, entry in models.MODELS.items() if not entry.images_only]


@pytest.fixture(scope="module", autouse=True)
def _pytorch_on_every_core():
    """The tolerances below hold for PyTorch at a run's thread count (every core), not at the
    one thread tests/conftest.py gives each pytest worker: at one thread its kernels round some
    sums differently, and DCGAN's G met a ReLU input of -2.2e-7 there (+4.6e-7 at two threads),
    whose gradient then passed in one twin only, 5.5e-4 of the norm apart in the layers below."""
    threads = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    yield
    torch.set_num_threads(threads)


class SharedNoise:
    """A replica set whose noise comes from a queue of numpy draws both twins share, in the
    order the training step asks for it; everything else is the real one's."""

    def __init__(self, replicas, draws: list):
        self._replicas, self._draws = replicas, draws

    def __getattr__(self, name):
        return getattr(self._replicas, name)

    def _next(self, rows, shape, framework):
        values = self._draws.pop(0)
        assert values.shape == (int(rows), *shape), "the twins ask for noise in another order"
        return torch.from_numpy(values) if framework == "pytorch" else tf.constant(values)

    def randn(self, rows, *shape, device):
        return self._next(rows, shape, "pytorch").to(device)

    rand = randn

    def normal(self, noise, rows, *shape):
        return self._next(rows, shape, "tensorflow")

    uniform = normal


def noise_for_one_step(model: str, hparams, rng, dataset: str) -> list:
    normal = lambda rows, width: rng.standard_normal((rows, width)).astype(np.float32)
    eps_shape = (1,) if dataset == "ring8" else (1, 1, 1)  # one eps per example
    if model == "vanilla_vae":
        return [normal(BATCH, hparams.LATENT)]
    if model == "wgan_gp":
        rows = BATCH // hparams.CRITIC_STEPS
        draws = []
        for _ in range(hparams.CRITIC_STEPS):  # each critic step: z, then the interpolation weights
            draws += [normal(rows, hparams.Z_DIM), rng.uniform(size=(rows, *eps_shape)).astype(np.float32)]
        return draws + [normal(rows, hparams.Z_DIM)]
    return [normal(BATCH, hparams.Z_DIM)]


def trainer(model: str, framework: str, networks: dict, cfg, runtime, data):
    """The training object the model's main() builds around its networks."""
    module = models.get(model).module(framework)
    hparams = models.get(model).hparams
    if model == "vanilla_vae":
        return module.VAE(networks["encoder"], networks["decoder"], cfg, runtime)
    if model == "wgan_gp":
        return module.WGANGP(networks["generator"], networks["discriminator"], cfg, runtime, data)
    from GAN import gan_step_pytorch, gan_step_tensorflow

    step = gan_step_pytorch if framework == "pytorch" else gan_step_tensorflow
    return step.GAN(networks["generator"], networks["discriminator"], module.discriminator_loss,
                    module.generator_loss, hparams.Z_DIM, cfg, runtime, data)


def twins(model: str, dataset: str):
    """Both frameworks' trainers, TensorFlow's networks holding PyTorch's initial weights."""
    flags = ["--width", "8", "--batch-size", str(BATCH), "--data-limit", "64", "--seed", "3", "--dataset", dataset]
    built = {}
    for framework, runtime_module, data_module in (("pytorch", torch_runtime, torch_data),
                                                    ("tensorflow", keras_runtime, keras_data)):
        cfg = parse_args(model, framework, flags)
        runtime = runtime_module.setup(cfg, log=lambda *_: None)
        data = data_module.load_data(cfg, runtime, models.get(model).hparams.PIXEL_RANGE)
        networks = models.get(model).module(framework).build_networks(data.sample_shape, cfg.width)
        built[framework] = (cfg, runtime, data, networks)
    torch_networks, keras_networks = built["pytorch"][3], built["tensorflow"][3]
    for name, network in torch_networks.items():
        keras_porting.import_weights(keras_networks[name], torch_porting.export_weights(network, SHAPE))
    pair = {}
    for framework, (cfg, runtime, data, networks) in built.items():
        step = trainer(model, framework, networks, cfg, runtime, data)
        for name, average in step.averages.items():  # as a session starts a fresh run
            average.start_from(step.modules[name])
        pair[framework] = (step, data)
    return pair


def exported(framework: str, network) -> list[tuple[str, list]]:
    return (torch_porting.export_weights(network, SHAPE) if framework == "pytorch"
            else keras_porting.export_weights(network))


def weights(framework: str, network) -> list[np.ndarray]:
    """Every weight, batch-norm running statistics included, copied."""
    return [np.array(values) for _, layer in exported(framework, network) for values in layer]


def running_statistics(framework: str, network) -> list[np.ndarray]:
    """Batch norm's running means and variances, copied."""
    return [np.array(values) for kind, layer in exported(framework, network)
            if kind == "BatchNormalization" for values in layer[2:]]


def first_moments(framework: str, step, network) -> list[np.ndarray]:
    """Adam's first moment of each of the network's trained weights, in the neutral (Keras)
    layout, copied: after one step (1 - beta1) x the gradient the optimizer applied. PyTorch's
    exp_avg is laid out as the network is (exported through a copy of it that holds the
    moments, less batch norm's running statistics); Keras' inner optimizer (inside a
    LossScaleOptimizer under float16) holds one momentum per trainable variable."""
    if framework == "pytorch":
        state = {parameter: slots for optimizer in step.optimizers.values()
                 for parameter, slots in optimizer.state.items()}
        holder = copy.deepcopy(network)
        with torch.no_grad():
            for parameter, slot in zip(network.parameters(), holder.parameters()):
                slot.copy_(state[parameter]["exp_avg"])
        return [np.array(values) for kind, layer in torch_porting.export_weights(holder, SHAPE)
                for values in (layer[:2] if kind == "BatchNormalization" else layer)]
    optimizers = [getattr(optimizer, "inner_optimizer", optimizer) for optimizer in step.optimizers.values()]

    def momentum(variable):
        for optimizer in optimizers:
            try:
                return optimizer._momentums[optimizer._get_variable_index(variable)].numpy()
            except KeyError:  # another network's optimizer
                continue
        raise AssertionError(f"no optimizer holds {variable.path}")

    return [momentum(variable) for layer in network.layers for variable in layer.weights if variable.trainable]


def assert_same_but_for_sign_flips(torch_values, keras_values, lr, what):
    """Equal to float32 rounding after one training step, but for a few entries whose
    gradient is within rounding of 0.

    Adam's first step is lr * g / (|g| + eps), about lr * sign(g): where the frameworks'
    summation orders give such a gradient opposite signs (it happens in convolutions; which
    entries depends on the kernels the CPU and the thread count pick), that weight ends up
    2 lr from its twin. A real difference between the twins (a loss, an update rule, an
    average) moves nearly every entry instead."""
    apart = np.abs(torch_values - keras_values)
    rounding = 1e-6 + 1e-4 * np.abs(keras_values)
    flipped = apart > rounding
    # 1% (none in a bias or a batch norm's vector, whose gradients sum over the batch)
    assert flipped.sum() <= flipped.size // 100, f"{what}: {flipped.sum()} of {flipped.size} entries differ"
    assert np.all(apart <= 2 * lr + rounding), f"{what}: {apart.max():.2g} apart"


def train_both(pair: dict, model: str, step_index: int, rng, dataset: str) -> dict:
    """One training step of each twin on the same rows of data and the same noise: their losses."""
    draws = noise_for_one_step(model, models.get(model).hparams, rng, dataset)
    rows = np.arange(step_index * BATCH, (step_index + 1) * BATCH)
    losses = {}
    for framework, (step, data) in pair.items():
        step.replicas = SharedNoise(step.replicas, [d.copy() for d in draws])
        batch = data.batch(torch.from_numpy(rows) if framework == "pytorch" else tf.constant(rows, tf.int32))
        losses[framework] = {k: float(v) for k, v in step.train_step(batch).items()}
        assert not step.replicas._draws, "a twin left noise unused"
        step.replicas = step.replicas._replicas
    return losses


@pytest.mark.parametrize(("model", "dataset"), CASES, ids=[f"{model}-{dataset}" for model, dataset in CASES])
def test_the_twins_take_the_same_training_steps(model, dataset):
    pair = twins(model, dataset)
    torch_step, keras_step = pair["pytorch"][0], pair["tensorflow"][0]
    start = {name: weights("pytorch", network) for name, network in torch_step.modules.items()}
    start_statistics = {name: running_statistics("pytorch", network) for name, network in torch_step.modules.items()}
    rng = np.random.default_rng(0)

    losses = train_both(pair, model, 0, rng, dataset)
    for key, value in losses["pytorch"].items():
        assert value == pytest.approx(losses["tensorflow"][key], rel=1e-5), key

    # the gradients themselves: Adam's step barely changes when a gradient is 3x what it
    # should be, its first moment is 3x (measured: 3e-6 of the norm apart, DCGAN's G; WGAN-GP's
    # critic's output bias has none, in both)
    for name, network in torch_step.modules.items():
        torch_moments = first_moments("pytorch", torch_step, network)
        keras_moments = first_moments("tensorflow", keras_step, keras_step.modules[name])
        assert [m.shape for m in torch_moments] == [m.shape for m in keras_moments], f"{model} {name}"
        for index, (a, b) in enumerate(zip(torch_moments, keras_moments)):
            apart, norm = np.linalg.norm(a.astype(np.float64) - b), np.linalg.norm(a.astype(np.float64))
            assert apart <= 1e-4 * norm, f"{model} {name} gradient {index}: {apart / norm:.3g} of its norm apart"

    lr = torch_step.cfg.lr
    for name, network in torch_step.modules.items():
        moved = 0
        for index, (a, b, a0) in enumerate(zip(weights("pytorch", network),
                                               weights("tensorflow", keras_step.modules[name]), start[name])):
            assert_same_but_for_sign_flips(a, b, lr, f"{model} {name} weight {index}")
            moved += int(np.any(a != a0))
        # the one exception: WGAN-GP's critic's output bias, which E[C(fake)] - E[C(real)] cancels
        still = int(model == "wgan_gp" and name == "discriminator")
        assert moved == len(start[name]) - still, f"{model} {name}: some weights did not train"
    # closer: 1e-5 of their moves and 4 float32 roundings (the running variance moves by the
    # unbiased batch variance in both; Keras' own layer, by the biased one, is 5e-5 of the move
    # apart in DCGAN)
    for name, network in torch_step.modules.items():
        for index, (a, b, a0) in enumerate(zip(running_statistics("pytorch", network),
                                               running_statistics("tensorflow", keras_step.modules[name]),
                                               start_statistics[name])):
            allowed = 1e-5 * np.abs(a - a0) + 4 * np.spacing(np.abs(a))
            assert np.all(np.abs(b - a) <= allowed), (
                f"{model} {name} batch-norm statistic {index}: {np.max(np.abs(b - a) / allowed):.3g}x the allowed")
    for name, average in torch_step.averages.items():
        for index, (a, b) in enumerate(zip(weights("pytorch", average.module),
                                           weights("tensorflow", keras_step.averages[name].module))):
            assert_same_but_for_sign_flips(a, b, lr, f"{model} average of {name}, weight {index}")

    # and the updated networks compute the next losses alike (a few flipped weights move them ~1e-4)
    losses = train_both(pair, model, 1, rng, dataset)
    for key, value in losses["pytorch"].items():
        assert value == pytest.approx(losses["tensorflow"][key], rel=1e-3), key


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_keras_adam_adds_epsilon_where_pytorch_does(name):
    """The optimizers alone, on weights whose gradients span 1e-9 to 1: Keras' own Adam/AdamW,
    with the same epsilon, moves the tiny-gradient weights differently (its epsilon in effect
    32x PyTorch's at the first step); the repository's takes PyTorch's steps."""
    import keras

    rng = np.random.default_rng(0)
    start = rng.standard_normal((4, 50)).astype(np.float32)
    scales = np.array([1e-9, 1e-7, 1e-4, 1.0], np.float32)[:, None]
    gradients = [(rng.standard_normal((4, 50)) * scales).astype(np.float32) for _ in range(50)]
    decay = dict(weight_decay=0.01) if name == "adamw" else {}

    def keras_steps(optimizer_class):
        variable = keras.Variable(start)
        optimizer = optimizer_class(1e-3, beta_1=0.5, beta_2=0.999, epsilon=1e-8, **decay)
        for gradient in gradients:
            optimizer.apply_gradients([(tf.constant(gradient), variable)])
        return variable.numpy()

    parameter = torch.nn.Parameter(torch.from_numpy(start.copy()))
    torch_class = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    optimizer = torch_class([parameter], lr=1e-3, betas=(0.5, 0.999), eps=1e-8, **decay)
    for gradient in gradients:
        parameter.grad = torch.from_numpy(gradient)
        optimizer.step()
    expected = parameter.detach().numpy()

    ours, theirs = ((AdamW, keras.optimizers.AdamW) if name == "adamw" else (Adam, keras.optimizers.Adam))
    # AdamW: PyTorch multiplies by (1 - lr * wd) rounded to float32, 6e-8 off 0.99999
    np.testing.assert_allclose(keras_steps(ours), expected, rtol=0, atol=1e-5 if decay else 2e-6)
    assert np.abs(keras_steps(theirs) - expected).max() > 1e-4


@pytest.mark.parametrize("norm, clip", [(0.016, 0.01), (2e-5, 1e-5), (2e-6, 1e-6), (0.005, 0.01)])
def test_clip_grad_norm_clips_as_pytorch(norm, clip):
    """--clip-grad-norm in both frameworks: clip_grad_norm_ scales the gradients by
    max_norm / (norm + 1e-6), Keras' global_clipnorm by max_norm / norm, which left the Keras
    twin's gradient 5% longer at a norm of 2e-5 and a clip of 1e-5, 50% at 2e-6 and 1e-6.
    Seen in Adam's first moment after one step: (1 - beta1) times the clipped gradient."""
    from common.tensorflow.optimizers import make_optimizer
    from common.tensorflow.runtime import setup

    rng = np.random.default_rng(0)
    gradients = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 5), (5,))]
    total = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in gradients))
    gradients = [g * np.float32(norm / total) for g in gradients]

    parameters = [torch.nn.Parameter(torch.zeros(g.shape)) for g in gradients]
    for parameter, gradient in zip(parameters, gradients):
        parameter.grad = torch.from_numpy(gradient.copy())
    torch.nn.utils.clip_grad_norm_(parameters, clip)
    expected = [parameter.grad.numpy() for parameter in parameters]

    cfg = parse_args("vanilla_gan", "tensorflow", ["--clip-grad-norm", str(clip), "--beta1", "0.5"])
    optimizer = make_optimizer(cfg, setup(cfg, log=lambda *_: None))
    variables = [tf.Variable(tf.zeros(g.shape)) for g in gradients]
    optimizer.apply_gradients(zip([tf.constant(g) for g in gradients], variables))
    clipped = [optimizer._momentums[optimizer._get_variable_index(v)].numpy() / 0.5 for v in variables]
    for ours, theirs in zip(clipped, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
