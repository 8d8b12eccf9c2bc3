"""--ema-decay: GANs sample and are evaluated with an exponential moving average of G's
weights (common/ema.py). The twins average alike, batch-norm statistics included; the
average is what samples and evaluation see, is checkpointed (tests/test_training.py resumes
it bit for bit) and follows one process under data parallelism (test_tf_distribute.py,
test_distributed.py)."""
import importlib

import numpy as np
import pytest
import torch

from common import ema
from common.pytorch.ema import ExponentialMovingAverage as TorchAverage
from common.tensorflow.ema import ExponentialMovingAverage as KerasAverage
from scripts import parity

SHAPE = (28, 28, 1)


def test_the_decay_warms_up_then_holds():
    assert ema.decay_at(1, 0.999) == pytest.approx(2 / 11)
    assert ema.decay_at(100, 0.999) == pytest.approx(101 / 110)
    assert ema.decay_at(10_000, 0.999) == 0.999
    assert ema.decay_at(5, 0.5) == 0.4 and ema.decay_at(20, 0.5) == 0.5  # a low decay holds sooner


def test_the_twins_average_alike_batch_norm_statistics_included():
    """DCGAN's G ported into both frameworks; after each of 6 updates of G (new weights and
    batch-norm statistics, the same in both) the averages compute the same function, equal to
    the average computed here by hand."""
    (_, make_torch, make_keras, _), = [n for n in parity.networks("dcgan", SHAPE, width=8) if n[0] == "generator"]
    torch.manual_seed(0)
    torch_net, keras_net = make_torch(), make_keras()
    parity.torch_to_keras(torch_net, keras_net, SHAPE)
    torch_average, keras_average = TorchAverage(torch_net, 0.9), KerasAverage(keras_net, 0.9)
    torch_average.start_from(torch_net)
    keras_average.start_from(keras_net)

    rng = np.random.default_rng(0)
    probe = next(name for name, value in torch_net.state_dict().items() if "running_mean" in name)
    expected = torch_net.state_dict()[probe].clone().double()
    for update in range(1, 7):
        parity.randomize_batch_norm(torch_net, rng)
        with torch.no_grad():
            for weight in torch_net.parameters():
                weight.add_(torch.from_numpy(rng.normal(0, 0.05, weight.shape).astype(np.float32)))
        parity.torch_to_keras(torch_net, keras_net, SHAPE)
        torch_average.update(torch_net)
        keras_average.update(keras_net)
        decay = ema.decay_at(update, 0.9)
        expected = decay * expected + (1 - decay) * torch_net.state_dict()[probe].double()

    torch.testing.assert_close(torch_average.module.state_dict()[probe].double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(torch_average.module.state_dict()[probe], torch_net.state_dict()[probe])
    z = rng.standard_normal((16, keras_net.inputs[0].shape[1])).astype(np.float32)
    worst_abs, _ = parity.compare(parity.run_torch(torch_average.module, z, amp=False),
                                  parity.run_keras(keras_average.module, z))
    assert worst_abs <= parity.FLOAT32_TARGET
    assert int(keras_average.updates.numpy()) == torch_average.updates == 6


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_samples_and_evaluation_come_from_the_average(framework):
    """After a few steps the average differs from G, and what the trainer samples (grids and
    evaluation both call `sample`) is the average's output, not G's."""
    import keras

    from common.config import parse_args
    from GAN.vanilla_gan import hparams

    script = importlib.import_module(f"GAN.vanilla_gan.gan_{framework}")
    gan_step = importlib.import_module(f"GAN.gan_step_{framework}")
    runtime_module, data_module, session_module = (importlib.import_module(f"common.{framework}.{name}")
                                                   for name in ("runtime", "data", "session"))
    cfg = parse_args("vanilla_gan", framework, ["--ema-decay", "0.5", "--dataset", "ring8", "--width", "8",
                                                "--batch-size", "32", "--data-limit", "64"])
    runtime = runtime_module.setup(cfg, log=lambda *_: None)
    data = data_module.load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    networks = script.build_networks(data.sample_shape, cfg.width)
    gan = gan_step.GAN(networks["generator"], networks["discriminator"], script.discriminator_loss,
                       script.generator_loss, hparams.Z_DIM, cfg, runtime, data)
    assert set(gan.averages) == {"generator"}
    gan.average.start_from(gan.generator)
    session = session_module.Session(gan, data, runtime)
    for _ in range(3):
        session.train_step(session.upload_batches(np.arange(32)[None])[0])

    z = np.random.default_rng(0).standard_normal((8, hparams.Z_DIM)).astype(np.float32)
    if framework == "pytorch":
        with torch.no_grad():
            averaged = gan.average.module(torch.from_numpy(z)).numpy()
            plain = gan.generator(torch.from_numpy(z)).numpy()
    else:
        averaged = keras.ops.convert_to_numpy(gan.average.module(z, training=False))
        plain = keras.ops.convert_to_numpy(gan.generator(z, training=False))
    sampled = gan.sample(z)
    np.testing.assert_allclose(sampled, averaged, rtol=1e-6, atol=1e-7)
    assert np.abs(sampled - plain).max() > 1e-4


def test_tensorflow_training_starts_the_average_from_the_networks_weights(tmp_path, monkeypatch):
    """Keras' clone_model gives the average freshly initialised weights: fit starts it from
    G's (after --init-from) before the loop's first step, or G's first average held 2/11 of
    random weights. The test above starts the average itself, so fit without it went unseen."""
    from common import loop
    from common.config import parse_args
    from common.tensorflow import session as session_module
    from common.tensorflow.data import load_data
    from common.tensorflow.runtime import setup
    from GAN import gan_step_tensorflow
    from GAN.vanilla_gan import gan_tensorflow as script
    from GAN.vanilla_gan import hparams

    cfg = parse_args("vanilla_gan", "tensorflow", ["--out", str(tmp_path / "run"), "--ema-decay", "0.5",
                                                   "--dataset", "ring8", "--width", "8", "--batch-size", "32",
                                                   "--data-limit", "64", "--no-tensorboard"])
    runtime = setup(cfg, log=lambda *_: None)
    data = load_data(cfg, runtime, value_range=hparams.PIXEL_RANGE)
    networks = script.build_networks(data.sample_shape, cfg.width)
    gan = gan_step_tensorflow.GAN(networks["generator"], networks["discriminator"], script.discriminator_loss,
                                  script.generator_loss, hparams.Z_DIM, cfg, runtime, data)
    assert any(not np.array_equal(a.numpy(), g.numpy())
               for a, g in zip(gan.average.module.weights, gan.generator.weights))
    started = {}
    monkeypatch.setattr(loop, "train", lambda *args, **kwargs: started.update(
        {"averaged": [w.numpy() for w in gan.average.module.weights],
         "generator": [w.numpy() for w in gan.generator.weights]}))
    session_module.fit(cfg, runtime, gan, data)
    assert len(started["averaged"]) == len(started["generator"]) > 0
    for averaged, weights in zip(started["averaged"], started["generator"]):
        np.testing.assert_array_equal(averaged, weights)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_gan_samples_are_mapped_from_the_models_pixel_range(framework, tmp_path, monkeypatch):
    """The GANs' samples (for evaluation) and grids took G's images to be in (-1, 1) whatever
    the model's hparams.PIXEL_RANGE: a model of another range would be scored and drawn wrong."""
    from common import sampling
    from common.config import parse_args
    from common.runs import RunFolder
    from GAN.vanilla_gan import hparams

    script = importlib.import_module(f"GAN.vanilla_gan.gan_{framework}")
    gan_step = importlib.import_module(f"GAN.gan_step_{framework}")
    runtime_module = importlib.import_module(f"common.{framework}.runtime")
    data_module = importlib.import_module(f"common.{framework}.data")
    cfg = parse_args("vanilla_gan", framework, ["--width", "8", "--batch-size", "16", "--data-limit", "16"])
    runtime = runtime_module.setup(cfg, log=lambda *_: None)
    z = np.random.default_rng(0).standard_normal((4, hparams.Z_DIM)).astype(np.float32)
    samples = {}
    for value_range in ((-1.0, 1.0), (0.0, 1.0)):
        data = data_module.load_data(cfg, runtime, value_range=value_range)
        networks = script.build_networks(data.sample_shape, cfg.width)
        gan = gan_step.GAN(networks["generator"], networks["discriminator"], script.discriminator_loss,
                           script.generator_loss, hparams.Z_DIM, cfg, runtime, data)
        generated = np.asarray(gan.generate(torch.from_numpy(z) if framework == "pytorch" else z))
        generated = generated.transpose(0, 2, 3, 1) if framework == "pytorch" else generated  # NCHW there
        samples[value_range] = gan.sample(z), generated, gan
    sampled, generated, _ = samples[(-1.0, 1.0)]
    np.testing.assert_allclose(sampled, (generated + 1.0) / 2.0, rtol=1e-6)
    sampled, generated, gan = samples[(0.0, 1.0)]
    np.testing.assert_allclose(sampled, generated, rtol=1e-6)  # already in [0, 1]: as it is

    grids = []
    monkeypatch.setattr(sampling, "save_image_grid", lambda images, path, value_range: grids.append(value_range))
    (tmp_path / "run").mkdir()
    gan.write_samples(RunFolder(tmp_path / "run"), 0)
    assert grids == [(0.0, 1.0)]


@pytest.mark.parametrize("script,flags,words", [
    ("VAE/vanilla_vae/vae_pytorch.py", ["--ema-decay", "0.99"], "averages a GAN's generator"),
    ("VAE/vanilla_vae/vae_tensorflow.py", ["--ema-decay", "0.99"], "averages a GAN's generator"),
    ("GAN/dcgan/dcgan_pytorch.py", ["--ema-decay", "1"], "must be in [0, 1)"),
])
def test_ema_flag_errors_are_one_line(script, flags, words, tmp_path):
    from tests.conftest import run_script

    result = run_script(script, "--out", str(tmp_path / "run"), *flags, timeout=120)
    assert result.returncode == 2 and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
