"""LSGAN and DCGAN on the shared GAN step: they train in both frameworks, the twins have the
same architecture at every image size, and the GANs share one step implementation."""
import json
import math
import pickle

import numpy as np
import pytest
import torch

from common import models
from GAN.dcgan import dcgan_pytorch, dcgan_tensorflow
from GAN.dcgan import hparams as dcgan_hparams
from GAN.least_squares_gan import lsgan_pytorch, lsgan_tensorflow
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

SCRIPTS = {("lsgan", "pytorch"): lsgan_pytorch, ("lsgan", "tensorflow"): lsgan_tensorflow,
           ("dcgan", "pytorch"): dcgan_pytorch, ("dcgan", "tensorflow"): dcgan_tensorflow}
TINY = ["--batch-size", "16", "--data-limit", "64", "--log-every", "2", "--iters", "4"]


def history(out):
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model, framework", list(SCRIPTS))
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_trains_a_few_steps_with_finite_losses(model, framework, amp, tmp_path):
    out = tmp_path / "run"
    SCRIPTS[model, framework].main(["--out", str(out), *TINY, *(["--amp"] if amp else [])])
    rows = history(out)
    assert [row["step"] for row in rows] == [2, 4]
    assert all(math.isfinite(row["d_loss"]) and math.isfinite(row["g_loss"]) for row in rows)
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == model and config["precision"] == ("amp-bf16" if amp else "fp32")
    assert (out / "samples" / "step_000004.png").exists()


def write_cifar(root, count=40):
    """A tiny CIFAR-10 python folder: the real layout, random pixels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"batch_label": name, "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                 "labels": [int(v) for v in rng.integers(0, 10, count)],
                 "filenames": [f"{i}.png" for i in range(count)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    return root


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_dcgan_trains_on_32x32_rgb_cifar(framework, tmp_path):
    data_dir = write_cifar(tmp_path / "data")
    out = tmp_path / "run"
    SCRIPTS["dcgan", framework].main(["--out", str(out), "--dataset", "cifar10", "--data-dir",
                                      str(data_dir), *TINY])
    assert all(math.isfinite(row["d_loss"]) for row in history(out))
    from PIL import Image

    grid = Image.open(out / "samples" / "step_000004.png")
    assert grid.size == (8 * 32 + 9 * 2,) * 2 and grid.mode in ("RGB", "RGBA")


def count_torch(module):
    return sum(p.numel() for p in module.parameters()), sum(b.numel() for b in module.buffers()
                                                           if b.dtype.is_floating_point)


def count_keras(model):
    return (sum(int(np.prod(w.shape)) for w in model.trainable_weights),
            sum(int(np.prod(w.shape)) for w in model.non_trainable_weights))


@pytest.mark.parametrize("side", sorted(dcgan_hparams.GEOMETRY))
@pytest.mark.parametrize("channels", [1, 3])
def test_dcgan_shapes_and_twin_architectures_at_every_size(side, channels):
    width = dcgan_hparams.WIDTH
    z = np.random.default_rng(0).standard_normal((2, dcgan_hparams.Z_DIM)).astype(np.float32)

    generator = dcgan_pytorch.Generator((channels, side, side), width)
    discriminator = dcgan_pytorch.Discriminator((channels, side, side), width)
    images = generator(torch.from_numpy(z))
    assert images.shape == (2, channels, side, side)
    assert images.abs().max() <= 1.0
    assert discriminator(images).shape == (2, 1)

    keras_generator = dcgan_tensorflow.make_generator((side, side, channels), width)
    keras_discriminator = dcgan_tensorflow.make_discriminator((side, side, channels), width)
    keras_images = keras_generator(z, training=False)
    assert tuple(keras_images.shape) == (2, side, side, channels)
    assert tuple(keras_discriminator(keras_images).shape) == (2, 1)

    # Same layers, widths and kernels: the same number of weights and batch-norm statistics.
    assert count_torch(generator) == count_keras(keras_generator)
    assert count_torch(discriminator) == count_keras(keras_discriminator)


def test_mlp_gans_hidden_layers_follow_the_width_in_both_frameworks():
    """G's hidden layers are 1, 2 and 4 times --width, D's 2 and 1 times it (hparams.py), each
    followed by LeakyReLU 0.2, in both frameworks (LSGAN trains these networks too)."""
    from GAN.vanilla_gan import hparams

    width = 8
    torch_networks = gan_pytorch.build_networks((1, 28, 28), width)
    keras_networks = gan_tensorflow.build_networks((28, 28, 1), width)
    expected = {"generator": [width * k for k in hparams.G_HIDDEN] + [784],
                "discriminator": [width * k for k in hparams.D_HIDDEN] + [1]}
    assert expected["generator"][:3] == [8, 16, 32] and expected["discriminator"][:2] == [16, 8]
    for name, units in expected.items():
        torch_layers = list(torch_networks[name].modules())
        assert [m.out_features for m in torch_layers if isinstance(m, torch.nn.Linear)] == units
        slopes = [m.negative_slope for m in torch_layers if isinstance(m, torch.nn.LeakyReLU)]
        assert slopes == [0.2] * (len(units) - 1)
        keras_layers = keras_networks[name].layers
        assert [layer.units for layer in keras_layers if type(layer).__name__ == "Dense"] == units
        assert [float(layer.negative_slope) for layer in keras_layers
                if type(layer).__name__ == "LeakyReLU"] == pytest.approx([0.2] * (len(units) - 1))


def test_dcgan_has_a_3x3_convolution_at_every_hidden_resolution_in_both_frameworks():
    """hparams.REFINE_CONVS 3x3, stride-1 convolutions (channels in = out) follow each of G's
    hidden layers and each of D's, at 7x7x64 and 14x14x32 for 28x28 MNIST at width 32."""
    image = (1, 28, 28)
    expected = [(64, 7), (32, 14)] * dcgan_hparams.REFINE_CONVS
    for network in ("generator", "discriminator"):
        torch_model = dcgan_pytorch.build_networks(image, 32)[network]
        found, hooks = [], []
        for layer in torch_model.modules():
            if isinstance(layer, torch.nn.Conv2d) and layer.kernel_size == (3, 3):
                assert layer.stride == (1, 1) and layer.in_channels == layer.out_channels
                hooks.append(layer.register_forward_hook(
                    lambda _, __, out: found.append((out.shape[1], out.shape[2]))))
        if network == "generator":
            torch_model(torch.zeros(2, dcgan_hparams.Z_DIM))
        else:
            torch_model(torch.zeros(2, *image))
        assert sorted(found) == sorted(expected), network
        keras_model = dcgan_tensorflow.build_networks((28, 28, 1), 32)[network]
        keras_found = [(layer.output.shape[3], layer.output.shape[1]) for layer in keras_model.layers
                       if type(layer).__name__ == "Conv2D" and tuple(layer.kernel_size) == (3, 3)
                       and tuple(layer.strides) == (1, 1)]
        assert sorted(keras_found) == sorted(expected), network


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("argv, message", [
    (["--dataset", "ring8"], "DCGAN is convolutional"),
    (["--image-size", "40"], "DCGAN takes 28x28, 32x32, 64x64 images, not 40x40"),
])
def test_dcgan_refuses_data_it_cannot_model(framework, argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS["dcgan", framework].main(["--out", str(tmp_path / "run"), *TINY, *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_vanilla_gan_and_lsgan_share_one_training_step(framework, monkeypatch, tmp_path):
    from GAN import gan_step_pytorch, gan_step_tensorflow

    shared = gan_step_pytorch.GAN if framework == "pytorch" else gan_step_tensorflow.GAN
    seen = []
    original = shared.train_step

    def spy(self, real):
        seen.append(self.discriminator_loss.__module__)
        return original(self, real)

    monkeypatch.setattr(shared, "train_step", spy)
    scripts = ((gan_pytorch, lsgan_pytorch) if framework == "pytorch"
               else (gan_tensorflow, lsgan_tensorflow))
    for index, script in enumerate(scripts):
        script.main(["--out", str(tmp_path / str(index)), *TINY])
    assert {script.__name__ for script in scripts} == set(seen)


def test_vanilla_gan_losses_are_the_non_saturating_ones():
    """D: -log sigmoid(real) - log(1 - sigmoid(fake)), G: -log sigmoid(fake) (the
    non-saturating loss DCGAN shares), means over the batch, in both frameworks: the twins'
    test compares them with each other, so a target flipped in both went unseen. With
    softplus(x) = log(1 + e^x): D = mean softplus(-real) + mean softplus(fake), G = mean
    softplus(-fake); G pulling fake scores down instead would be mean softplus(fake)."""
    import tensorflow as tf

    def softplus(x):
        return np.logaddexp(0.0, x.astype(np.float64))

    real, fake = np.array([[2.0], [0.5]], np.float32), np.array([[-1.0], [1.5]], np.float32)
    expected_d = softplus(-real).mean() + softplus(fake).mean()  # 0.5735 + 1.0073
    expected_g = softplus(-fake).mean()  # 0.7573 (fake scores pulled down: 1.0073)
    for module, to_tensor in ((gan_pytorch, torch.from_numpy), (gan_tensorflow, tf.constant)):
        d_loss = module.discriminator_loss(to_tensor(real), to_tensor(fake))
        assert float(d_loss) == pytest.approx(expected_d, rel=1e-6)
        assert float(module.generator_loss(to_tensor(fake))) == pytest.approx(expected_g, rel=1e-6)
    # DCGAN trains with these very functions
    assert dcgan_pytorch.generator_loss is gan_pytorch.generator_loss
    assert dcgan_tensorflow.generator_loss is gan_tensorflow.generator_loss
    assert dcgan_pytorch.discriminator_loss is gan_pytorch.discriminator_loss
    assert dcgan_tensorflow.discriminator_loss is gan_tensorflow.discriminator_loss


def test_lsgan_losses_are_the_least_squares_ones():
    """D pulls real scores to 1 and fake ones to 0, G pulls fake scores to 1. No set of scores
    mirrors itself or the other about 0.5 (with real = [1, 0] and fake = [0, 1], D's loss with
    the targets swapped was the same 0.5; real = [0.75, 0.25] scored real pulled to 0 the same),
    and they are dyadic, so every loss is exact in float32."""
    import tensorflow as tf

    real, fake = np.array([[0.75], [0.5]], np.float32), np.array([[0.125], [0.5]], np.float32)
    # D: 0.5 mean((real-1)^2) + 0.5 mean(fake^2) = 0.5 * 0.15625 + 0.5 * 0.1328125
    #    (real pulled to 0: 0.26953125; fake to 1: 0.33203125; both swapped: 0.45703125)
    # G: 0.5 mean((fake-1)^2) = 0.5 * 0.5078125 (fake pulled to 0 instead: 0.06640625)
    expected_d, expected_g = 0.14453125, 0.25390625
    for module, to_tensor in ((lsgan_pytorch, torch.from_numpy), (lsgan_tensorflow, tf.constant)):
        assert float(module.discriminator_loss(to_tensor(real), to_tensor(fake))) == expected_d
        assert float(module.generator_loss(to_tensor(fake))) == expected_g
        perfect = to_tensor(np.ones((2, 1), np.float32))
        assert float(module.generator_loss(perfect)) == 0.0


def test_tensorflow_dcgan_initialisation_is_reproducible_across_processes(tmp_path):
    """A fresh process and this one, one seed: the same initial weights (an initializer made
    at import time once drew its seed before --seed was set and changed every run)."""
    from tests.conftest import run_script

    flags = ["--iters", "1", "--batch-size", "16", "--data-limit", "64", "--sample-every", "0"]
    result = run_script("GAN/dcgan/dcgan_tensorflow.py", "--out", str(tmp_path / "a"), *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    SCRIPTS["dcgan", "tensorflow"].main(["--out", str(tmp_path / "b"), *flags])
    with np.load(tmp_path / "a" / "initial_weights.npz") as a, np.load(tmp_path / "b" / "initial_weights.npz") as b:
        assert a.files == b.files
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_width_flag_sets_dcgan_channels_in_both_frameworks_and_is_part_of_the_run(tmp_path, capsys):
    """--width is ngf = ndf: at 64x64 and width 8, D's first convolution has 8 filters and G's
    first has 8 * 2**3; both frameworks build the same weights, and a run resumes only at its width."""
    shapes = {}
    for framework in ("pytorch", "tensorflow"):
        out = tmp_path / framework
        SCRIPTS["dcgan", framework].main(["--out", str(out), *TINY, "--image-size", "64", "--width", "8"])
        assert json.loads((out / "config.json").read_text())["width"] == 8
        with np.load(out / "initial_weights.npz") as weights:
            shapes[framework] = sorted(weights[key].shape for key in weights.files)
    assert shapes["pytorch"] == shapes["tensorflow"]
    kernels = [shape for shape in shapes["pytorch"] if len(shape) == 4]
    channel_counts = {size for shape in kernels for size in shape[2:]}
    assert {8, 64} <= channel_counts and 128 not in channel_counts  # the default width 32 would have 256

    with pytest.raises(SystemExit):
        SCRIPTS["dcgan", "pytorch"].main(["--out", str(tmp_path / "pytorch"), *TINY, "--image-size", "64",
                                          "--width", "16", "--iters", "6", "--resume"])
    assert "width: 8 -> 16" in capsys.readouterr().err


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_mlp_gan_discriminator_judges_points_in_packs_and_images_one_by_one(framework):
    """PacGAN (hparams.POINT_PACK): on 2-D points D gives one logit for each pack of
    consecutive samples, which depends on every sample of that pack and on no other; on
    images it judges each sample alone."""
    from GAN.vanilla_gan import hparams

    pack = hparams.POINT_PACK
    assert pack == 2 and hparams.pack((2,)) == pack and hparams.pack((1, 28, 28)) == 1
    if framework == "pytorch":
        torch.manual_seed(0)
        build = lambda shape: gan_pytorch.build_networks(shape, 8)["discriminator"]
        judge = lambda d, x: d(torch.from_numpy(x)).detach().numpy()[:, 0]
        image_shape = (1, 28, 28)
    else:
        build = lambda shape: gan_tensorflow.build_networks(shape, 8)["discriminator"]
        judge = lambda d, x: np.asarray(d(x, training=False))[:, 0]
        image_shape = (28, 28, 1)
    points = np.random.default_rng(0).normal(size=(3 * pack, 2)).astype(np.float32)
    d = build((2,))
    logits = judge(d, points)
    assert logits.shape == (3,)
    for moved in range(3 * pack):  # move one sample: only its own pack's logit changes
        other = points.copy()
        other[moved] += 1.0
        changed = np.abs(judge(d, other) - logits) > 1e-6
        assert changed.tolist() == [i == moved // pack for i in range(3)], moved
    images = np.random.default_rng(1).uniform(-1, 1, (3, *image_shape)).astype(np.float32)
    assert judge(build(image_shape), images).shape == (3,)


def test_mlp_gan_discriminators_on_points_compute_the_same_function_in_both_frameworks():
    """The packed D ported from PyTorch to Keras gives the same logits (the twins reshape the
    pack alike: sample 0's x, y, then sample 1's)."""
    from common.pytorch import porting as torch_porting
    from common.tensorflow import porting as keras_porting

    torch.manual_seed(0)
    torch_d = gan_pytorch.build_networks((2,), 16)["discriminator"]
    keras_d = gan_tensorflow.build_networks((2,), 16)["discriminator"]
    keras_porting.import_weights(keras_d, torch_porting.export_weights(torch_d))
    points = np.random.default_rng(2).normal(size=(8, 2)).astype(np.float32)
    expected = torch_d(torch.from_numpy(points)).detach().numpy()
    np.testing.assert_allclose(np.asarray(keras_d(points, training=False)), expected, atol=1e-6)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_dcgan_initialises_kernels_at_the_paper_std_and_batch_norm_scale_near_one(framework):
    """Convolution and transposed-convolution kernels ~ N(0, hparams.INIT_STD), batch-norm scale
    ~ N(1, INIT_STD) and shift 0. A kernel std off by a factor (0.01 instead of 0.02) trains, but
    not the DCGAN the FIDs in hparams.py were measured on; nothing else would notice."""
    std = dcgan_hparams.INIT_STD
    if framework == "pytorch":
        torch.manual_seed(0)
        networks = dcgan_pytorch.build_networks((1, 28, 28), 32)
        kernels, gammas, betas = [], [], []
        for network in networks.values():
            for layer in network.modules():
                if isinstance(layer, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                    kernels.append(layer.weight.detach().numpy())
                elif isinstance(layer, torch.nn.BatchNorm2d):
                    gammas.append(layer.weight.detach().numpy())
                    betas.append(layer.bias.detach().numpy())
    else:
        import keras

        keras.utils.set_random_seed(0)
        networks = dcgan_tensorflow.build_networks((28, 28, 1), 32)
        kernels = [np.asarray(w) for n in networks.values() for w in n.weights if "kernel" in w.path]
        gammas = [np.asarray(w) for n in networks.values() for w in n.weights if "gamma" in w.path]
        betas = [np.asarray(w) for n in networks.values() for w in n.weights if "beta" in w.path]
    # G: 2 transposed, 2 refining 3x3, 1 output (4 batch norms); D: 2 strided, 2 refining 3x3,
    # 1 output (3 batch norms: none on the input).
    assert len(kernels) == 10 and len(gammas) == len(betas) == 7
    for kernel in kernels:  # each layer's own draw, not only their pool
        assert abs(kernel.mean()) < 0.1 * std and abs(kernel.std() / std - 1) < 0.1, kernel.shape
    pooled = np.concatenate([k.ravel() for k in kernels])
    assert abs(pooled.mean()) < 0.01 * std and abs(pooled.std() / std - 1) < 0.05
    gamma = np.concatenate(gammas)
    assert abs(gamma.mean() - 1) < 0.2 * std and abs(gamma.std() / std - 1) < 0.2
    assert all((beta == 0).all() for beta in betas)


@pytest.mark.parametrize("model", ["dcgan", "wgan_gp"])
def test_the_convolutional_discriminators_score_in_float32_under_amp(model):
    """D's (the critic's) last layer computes its logit in float32 in both twins, as the MLPs'
    and the VAE's heads do: the losses take it in float32, and a bfloat16 logit keeps 8 bits."""
    import keras
    import tensorflow as tf

    from GAN.wgan_gp import wgan_gp_pytorch, wgan_gp_tensorflow

    torch_script, keras_script = {"dcgan": (dcgan_pytorch, dcgan_tensorflow),
                                  "wgan_gp": (wgan_gp_pytorch, wgan_gp_tensorflow)}[model]
    discriminator = torch_script.build_networks((1, 28, 28), 8)["discriminator"]
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        assert discriminator(torch.rand(2, 1, 28, 28)).dtype == torch.float32
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        discriminator = keras_script.build_networks((28, 28, 1), 8)["discriminator"]
        assert discriminator(tf.random.uniform((2, 28, 28, 1)), training=False).dtype == tf.float32
        assert discriminator.layers[-2].compute_dtype == "float32"  # the logit's layer, not a cast after it
        assert discriminator.layers[1].compute_dtype == "bfloat16"  # the policy is really on
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("model, data_shape", [("vanilla_gan", (28, 28, 1)), ("vanilla_gan", (2,)),
                                               ("dcgan", (28, 28, 1))], ids=["mlp-images", "mlp-points", "dcgan"])
def test_every_output_layer_computes_in_float32_under_amp(model, data_shape):
    """G's last layer (before tanh) and the MLP D's logit layer compute in float32 in both
    twins, as the convolutional discriminators' above: a bfloat16 sample or logit keeps 8 bits.
    (Mutation round 12: G's output layers and the Keras MLP D's logit without float32 went
    unseen; Keras' float32 activation and reshape after them cast the rounded values back.)"""
    import keras
    import tensorflow as tf

    torch_script, keras_script = (gan_pytorch, gan_tensorflow) if model == "vanilla_gan" else (
        dcgan_pytorch, dcgan_tensorflow)
    torch_shape = (data_shape[2], *data_shape[:2]) if len(data_shape) == 3 else data_shape
    networks = torch_script.build_networks(torch_shape, 8)
    z = torch.randn(4, dcgan_hparams.Z_DIM)
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        fake = networks["generator"](z)
        logits = networks["discriminator"](fake)
    assert fake.dtype == logits.dtype == torch.float32
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        networks = keras_script.build_networks(data_shape, 8)
        for name, network in networks.items():
            weighted = [layer for layer in network.layers if layer.weights]
            assert weighted[0].compute_dtype == "bfloat16", name  # the policy is really on
            assert weighted[-1].compute_dtype == "float32", name  # the output layer, not a cast after it
        fake = networks["generator"](tf.random.normal((4, dcgan_hparams.Z_DIM)), training=False)
        assert fake.dtype == networks["discriminator"](fake, training=False).dtype == tf.float32
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_dcgan_batch_norm_momentum_and_epsilon_are_pytorchs_in_both_twins():
    """PyTorch's conventions (momentum 0.1 of the batch, epsilon 1e-5), Keras' momentum written
    as 1 - 0.1: Keras' own defaults (0.99, 1e-3) would make the twins normalise differently."""
    import keras

    torch_norms = [layer for network in dcgan_pytorch.build_networks((1, 28, 28), 8).values()
                   for layer in network.modules() if isinstance(layer, torch.nn.BatchNorm2d)]
    keras_norms = [layer for network in dcgan_tensorflow.build_networks((28, 28, 1), 8).values()
                   for layer in network.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(torch_norms) == len(keras_norms) == 7  # G's 4, D's 3
    assert {(layer.momentum, layer.eps) for layer in torch_norms} == {(0.1, 1e-5)}
    assert {(round(layer.momentum, 6), layer.epsilon) for layer in keras_norms} == {(0.9, 1e-5)}


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_the_gan_step_feeds_g_standard_normal_noise_one_row_per_real_example(framework):
    """G's training input is z ~ N(0, I) with as many rows as the real batch: the twins tests
    feed both the same draws, so a uniform z (randn -> rand) in both went unseen."""
    from common.config import parse_args
    from GAN import gan_step_pytorch, gan_step_tensorflow
    from GAN.vanilla_gan import hparams
    from tests.conftest import runtime_and_data

    script = gan_pytorch if framework == "pytorch" else gan_tensorflow
    step = gan_step_pytorch if framework == "pytorch" else gan_step_tensorflow
    cfg = parse_args("vanilla_gan", framework, ["--batch-size", "64", "--data-limit", "64", "--width", "8"])
    runtime, data = runtime_and_data(cfg, hparams.PIXEL_RANGE)
    networks = script.build_networks(data.sample_shape, cfg.width)
    gan = step.GAN(networks["generator"], networks["discriminator"], script.discriminator_loss,
                   script.generator_loss, hparams.Z_DIM, cfg, runtime, data)
    drawn = []
    if framework == "pytorch":
        gan.generator.register_forward_pre_hook(lambda module, inputs: drawn.append(inputs[0].numpy().copy()))
        gan.train_step(data.batch(torch.arange(64)))
    else:
        generator = gan.generator

        class Spy:  # the step calls G and reads its variables; record what it is called on
            def __call__(self, z, **kwargs):
                drawn.append(np.asarray(z))
                return generator(z, **kwargs)

            def __getattr__(self, name):
                return getattr(generator, name)

        gan.generator = Spy()
        gan.train_step(data.dataset.x[:64])
    (z,) = drawn
    assert z.shape == (64, hparams.Z_DIM) and z.dtype == np.float32
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05 and z.min() < -2.5  # 6,400 draws


def d_packs_points(model: str) -> bool:
    """Whether the model's D judges 2-D points in packs (PacGAN): it scores 4 points, not 3."""
    networks = models.get(model).module("pytorch").build_networks((2,), 8)
    networks["discriminator"](torch.zeros(4, 2))
    try:
        networks["discriminator"](torch.zeros(3, 2))
    except RuntimeError:
        return True
    return False


def test_every_model_whose_d_packs_points_refuses_a_batch_its_packs_do_not_divide():
    """A new model that takes the vanilla GAN's networks takes their packs, and must say so in
    its hparams.py (batch_division, validate): without them an odd batch on the mixtures ended
    in a reshape's traceback (a contributor following "Adding a model" met it)."""
    from common.config import parse_args
    from common.errors import UsageError

    packing = [key for key, model in models.MODELS.items() if model.family == "GAN" and not model.images_only
               and d_packs_points(key)]
    assert {"vanilla_gan", "lsgan"} <= set(packing)
    for model in packing:
        with pytest.raises(UsageError, match="packs of 2"):
            parse_args(model, "pytorch", ["--dataset", "ring8", "--batch-size", "63"])
        assert parse_args(model, "pytorch", ["--dataset", "ring8", "--batch-size", "62"]).batch_size == 62
