"""The vanilla VAE pair: short real runs with and without --amp, the loss against the closed
form, float32 where AMP would overflow, bit-exact resume, the reconstruction grid's layout,
and refusing 2-D point datasets."""
import json
import math
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from common import sampling
from common.data import embedded_mnist
from VAE.vanilla_vae import hparams, vae_pytorch, vae_tensorflow

SCRIPTS = {"pytorch": vae_pytorch, "tensorflow": vae_tensorflow}
TINY = ["--batch-size", "32", "--data-limit", "256", "--log-every", "2"]
GRID_PIXELS = 8 * (28 + 2) + 2  # 8 columns of 28-pixel images, 2-pixel gaps, 8 rows


def train(framework, out, *extra):
    return SCRIPTS[framework].main(["--out", str(out), *TINY, *extra])


def read_history(out):
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def gray_png(path):
    """A saved grid as float gray levels in [0, 1] (the PNGs are RGBA with equal RGB)."""
    return np.asarray(Image.open(path).convert("L"), dtype=np.float32) / 255.0


# --- short runs ---------------------------------------------------------------------------

@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_short_run_logs_recon_and_kl_and_writes_both_grids(framework, amp, tmp_path):
    out = tmp_path / "run"
    train(framework, out, "--iters", "6", "--checkpoint-every", "0",
          *(["--amp"] if amp else []))

    assert json.loads((out / "config.json").read_text())["precision"] == (
        "amp-bf16" if amp else "fp32")
    history = read_history(out)
    assert [row["step"] for row in history] == [2, 4, 6]
    for row in history:
        assert all(math.isfinite(row[k]) for k in ("loss", "recon", "kl")), row
        assert row["recon"] > 0 and row["kl"] > 0
        assert row["loss"] == pytest.approx(row["recon"] + row["kl"], rel=1e-5)
    assert history[-1]["loss"] < history[0]["loss"] - 20  # it learns from step one

    # Both frameworks decode the same z: the fixed noise depends on the seed alone.
    expected = np.random.default_rng([0, sampling.NOISE_STREAM]).standard_normal((64, 20))
    np.testing.assert_array_equal(np.load(out / "fixed_noise.npy"), expected.astype(np.float32))

    samples, recon = out / "samples" / "step_000006.png", out / "samples" / "step_000006_recon.png"
    assert sorted(p.name for p in (out / "samples").iterdir()) == [
        "step_000000.png", "step_000000_recon.png", samples.name, recon.name]
    assert gray_png(samples).shape == gray_png(recon).shape == (GRID_PIXELS, GRID_PIXELS)
    # Row one of the reconstruction grid holds the first test images themselves.
    first_test_image = embedded_mnist("test")[0][0, :, :, 0] / 255.0
    np.testing.assert_allclose(gray_png(recon)[2:30, 2:30], first_test_image, atol=2 / 255)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("dataset", ["ring8", "grid25"])
def test_point_datasets_are_refused_in_one_line(framework, dataset, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train(framework, tmp_path / "run", "--dataset", dataset)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert err.startswith("error: the VAE models images") and "\n" not in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def write_idx_mnist(folder, sides, counts=None):
    """Tiny IDX MNIST files: 64 random images per split (or as `counts` names), of the side each
    split names."""
    rng = np.random.default_rng(0)
    for prefix, side in sides.items():
        count = (counts or {}).get(prefix, 64)
        for kind, array in (("images-idx3", rng.integers(0, 256, (count, side, side), dtype=np.uint8)),
                            ("labels-idx1", rng.integers(0, 10, count, dtype=np.uint8))):
            header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
            (folder / f"{prefix}-{kind}-ubyte").write_bytes(header + array.tobytes())
    return folder


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_test_split_of_another_image_size_is_refused_in_one_line(framework, tmp_path, capsys):
    data_dir = write_idx_mnist(tmp_path, {"train": 28, "t10k": 20})
    with pytest.raises(SystemExit) as exit_info:
        train(framework, tmp_path / "run", "--data-dir", str(data_dir), "--iters", "2", "--width", "8",
              "--batch-size", "8", "--data-limit", "64", "--no-tensorboard")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1
    assert err.startswith("error: ") and "\n" not in err, err
    assert "test split" in err and "20x20" in err and "training images are 28x28" in err, err
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_evaluate_on_an_empty_test_split_is_refused_in_one_line_before_training(framework, tmp_path, capsys):
    """The bounds are measured on the test images: with none, the run trained and then ended in
    a traceback (numpy's reshape of 0 images in vae_bounds)."""
    data_dir = write_idx_mnist(tmp_path, {"train": 28, "t10k": 28}, counts={"t10k": 0})
    with pytest.raises(SystemExit) as exit_info:
        train(framework, tmp_path / "run", "--data-dir", str(data_dir), "--iters", "2", "--width", "8",
              "--batch-size", "16", "--data-limit", "64", "--no-tensorboard", "--evaluate", "10")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1
    assert err == (f"error: the mnist test split in {data_dir} has no images, and --evaluate measures the test "
                   "ELBO and IWAE bound on them: add test images there, or leave out --evaluate"), err
    assert not (tmp_path / "run").exists()  # refused before the run folder was made, nothing trained


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_bounds_on_fewer_test_images_than_asked_say_how_many(framework, tmp_path, capsys):
    """--evaluate 100 on a --data-dir with 64 test images: the samples are 100, the bounds were
    measured on the 64 there are, and the summary used to say only "samples": 100."""
    data_dir = write_idx_mnist(tmp_path, {"train": 28, "t10k": 28})
    summary = train(framework, tmp_path / "run", "--data-dir", str(data_dir), "--iters", "2", "--width", "8",
                    "--batch-size", "8", "--data-limit", "64", "--no-tensorboard", "--evaluate", "100",
                    "--iwae-k", "2")
    metrics = summary["metrics"]
    assert metrics["samples"] == 100 and metrics["bound_images"] == 64, metrics
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["metrics"] == metrics
    assert "bound_images 64" in capsys.readouterr().out


def checkpoint_tensors(path):
    """Every array in a checkpoint, flattened to {name: numpy}, whichever the framework."""
    if path.suffix == ".npz":
        with np.load(path) as stored:
            return {k: stored[k] for k in stored.files}
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif torch.is_tensor(value):
            flat[prefix] = value.numpy()

    walk("", torch.load(path, weights_only=True))
    return flat


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_resume_is_bit_exact(framework, amp, tmp_path):
    flags = ["--checkpoint-every", "4", "--sample-every", "0", "--seed", "5",
             *(["--amp"] if amp else [])]
    # 10 steps of 32 out of 256 examples: the resumed half crosses an epoch boundary.
    train(framework, tmp_path / "straight", "--iters", "10", *flags)
    train(framework, tmp_path / "resumed", "--iters", "6", *flags)
    train(framework, tmp_path / "resumed", "--iters", "10", "--resume", *flags)

    suffix = "pt" if framework == "pytorch" else "npz"
    name = f"step_000010.{suffix}"
    straight = checkpoint_tensors(tmp_path / "straight" / "checkpoints" / name)
    resumed = checkpoint_tensors(tmp_path / "resumed" / "checkpoints" / name)
    assert straight.keys() == resumed.keys() and len(straight) > 12
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key], err_msg=key)
    timeless = lambda out: [{k: v for k, v in row.items() if k != "step_ms"}
                            for row in read_history(out)]
    assert timeless(tmp_path / "straight") == timeless(tmp_path / "resumed")


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_resuming_a_finished_run_with_workers_has_nothing_to_do(framework, tmp_path, capsys):
    """--workers N: the host loader of a run resumed at its last step has no batch to load."""
    flags = ["--iters", "2", "--width", "8", "--batch-size", "8", "--data-limit", "64",
             "--workers", "1", "--no-tensorboard", "--sample-every", "0"]
    train(framework, tmp_path / "run", *flags)
    capsys.readouterr()
    train(framework, tmp_path / "run", *flags, "--resume")
    assert "nothing to do: the run is at step 2 and --iters is 2" in capsys.readouterr().out


def test_tensorflow_host_loader_starts_on_an_empty_range():
    from common.data import Dataset
    from common.runs import BatchOrder
    from common.tensorflow.data import HostLoader

    dataset = Dataset("mnist", np.zeros((16, 4, 4, 1), np.uint8), np.zeros(16, np.int64))
    loader = HostLoader(dataset, (0.0, 1.0), workers=1)
    loader.start(BatchOrder(16, 8, seed=0), 5, 5)
    assert list(loader.iterator) == []
    loader.start(BatchOrder(16, 8, seed=0), 3, 5)
    assert len(list(loader.iterator)) == 2


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_reconstruction_grid_that_fails_is_drawn_by_resume(framework, tmp_path, monkeypatch):
    """The reconstruction grid is written before the samples' grid, whose file --resume takes
    as the sign that the step's grids were written: when the reconstructions fail (a full
    disk), --resume draws both."""
    save_recon = sampling.save_reconstruction_grid

    def disk_full_at_step_2(originals, reconstructions, path, *args, **kwargs):
        if path.name == "step_000002_recon.png":
            raise OSError(28, "No space left on device", str(path))
        save_recon(originals, reconstructions, path, *args, **kwargs)

    out, flags = tmp_path / "run", ["--iters", "4", "--sample-every", "2", "--checkpoint-every", "4"]
    monkeypatch.setattr(sampling, "save_reconstruction_grid", disk_full_at_step_2)
    with pytest.raises(SystemExit):
        train(framework, out, *flags)
    assert not (out / "samples" / "step_000002.png").exists()
    monkeypatch.setattr(sampling, "save_reconstruction_grid", save_recon)
    train(framework, out, *flags, "--resume")
    assert {path.name for path in (out / "samples").iterdir()} == {
        f"step_00000{step}{kind}.png" for step in (0, 2, 4) for kind in ("", "_recon")}


# --- the loss and float32 where it matters --------------------------------------------------

# Two examples of three "pixels", latent 2.
X = [[0.0, 1.0, 0.5], [1.0, 0.0, 0.25]]
LOGITS = [[0.3, -1.2, 2.0], [-0.5, 0.7, 0.0]]
MEAN = [[0.1, -0.2], [0.5, 0.0]]
LOGVAR = [[0.0, -1.0], [0.4, 0.2]]


def closed_form_loss():
    """-ELBO per example, averaged: the textbook formulas, term by term, in float64."""
    def bce(target, logit):
        p = 1.0 / (1.0 + math.exp(-logit))
        return -(target * math.log(p) + (1.0 - target) * math.log(1.0 - p))

    recon = sum(bce(t, logit) for xs, logits in zip(X, LOGITS) for t, logit in zip(xs, logits))
    recon /= len(X)
    kl = sum(-0.5 * sum(1.0 + v - m * m - math.exp(v) for m, v in zip(ms, vs))
             for ms, vs in zip(MEAN, LOGVAR)) / len(X)
    return recon + kl, recon, kl


def run_loss(framework, *arrays, dtype="float32"):
    if framework == "pytorch":
        tensors = [torch.tensor(a, dtype=getattr(torch, dtype)) for a in arrays]
        return [t.item() for t in vae_pytorch.vae_loss(*tensors)]
    import tensorflow as tf

    tensors = [tf.constant(a, dtype=getattr(tf, dtype)) for a in arrays]
    return [float(t) for t in vae_tensorflow.vae_loss(*tensors)]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_loss_is_summed_bce_plus_kl_averaged_over_the_batch(framework):
    loss, recon, kl = closed_form_loss()
    # By hand: recon = (3.44447 + 2.77041) / 2, kl = (0.20894 + 0.18161) / 2.
    assert recon == pytest.approx(3.10749, abs=1e-5) and kl == pytest.approx(0.19528, abs=1e-5)
    got = run_loss(framework, X, LOGITS, MEAN, LOGVAR)
    assert got == pytest.approx([loss, recon, kl], rel=1e-6)


# exp(30) = 1.07e13 and exp(15) = 3.3e6 overflow float16 (max 65,504); bfloat16 holds them with
# only 8 bits of mantissa (relative error up to 2**-9). float32 gets them right to ~1e-7.
BIG_LOGVAR = 30.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pytorch_reparameterisation_and_kl_do_not_overflow_under_autocast(dtype):
    low = getattr(torch, dtype)
    mean = torch.tensor([[0.5, -1.0]], dtype=low)
    logvar = torch.full((1, 2), BIG_LOGVAR, dtype=low)  # as if a head had run in 16 bits
    eps = torch.tensor([[1.0, -0.5]])
    with torch.amp.autocast("cpu", dtype=low):
        z = vae_pytorch.reparameterize(mean, logvar, eps)
        _, _, kl = vae_pytorch.vae_loss(torch.zeros(1, 3), torch.zeros(1, 3), mean, logvar)
    sigma = math.exp(BIG_LOGVAR / 2)
    assert z.dtype == torch.float32 and kl.dtype == torch.float32
    np.testing.assert_allclose(z.numpy(), [[0.5 + sigma, -1.0 - 0.5 * sigma]], rtol=1e-6)
    expected_kl = -0.5 * sum(1 + BIG_LOGVAR - m * m - math.exp(BIG_LOGVAR) for m in (0.5, -1.0))
    assert kl.item() == pytest.approx(expected_kl, rel=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensorflow_reparameterisation_and_kl_do_not_overflow_in_16_bits(dtype):
    import tensorflow as tf

    low = getattr(tf, dtype)
    mean = tf.constant([[0.5, -1.0]], dtype=low)
    logvar = tf.fill((1, 2), tf.constant(BIG_LOGVAR, dtype=low))
    z = vae_tensorflow.reparameterize(mean, logvar, tf.constant([[1.0, -0.5]]))
    _, _, kl = vae_tensorflow.vae_loss(tf.zeros((1, 3)), tf.zeros((1, 3)), mean, logvar)
    sigma = math.exp(BIG_LOGVAR / 2)
    assert z.dtype == tf.float32 and kl.dtype == tf.float32
    np.testing.assert_allclose(z.numpy(), [[0.5 + sigma, -1.0 - 0.5 * sigma]], rtol=1e-6)
    expected_kl = -0.5 * sum(1 + BIG_LOGVAR - m * m - math.exp(BIG_LOGVAR) for m in (0.5, -1.0))
    assert float(kl) == pytest.approx(expected_kl, rel=1e-6)


def test_pytorch_heads_run_in_float32_under_autocast():
    encoder = vae_pytorch.Encoder((1, 28, 28), hparams.WIDTH)
    decoder = vae_pytorch.Decoder((1, 28, 28), hparams.WIDTH)
    x = torch.rand(4, 1, 28, 28)
    with torch.amp.autocast("cpu", dtype=torch.bfloat16):
        assert encoder.hidden(x).dtype == torch.bfloat16  # autocast is really on
        mean, logvar = encoder(x)
        logits = decoder(mean)
    assert mean.dtype == logvar.dtype == logits.dtype == torch.float32
    assert logits.shape == (4, 1, 28, 28) and mean.shape == (4, hparams.LATENT)


def test_tensorflow_heads_run_in_float32_under_mixed_policy():
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        encoder = vae_tensorflow.make_encoder((28, 28, 1), hparams.WIDTH)
        decoder = vae_tensorflow.make_decoder((28, 28, 1), hparams.WIDTH)
        hidden = keras.Model(encoder.input, encoder.layers[2].output)
        x = tf.random.uniform((4, 28, 28, 1))
        assert hidden(x).dtype == tf.bfloat16  # the policy is really on
        mean, logvar = encoder(x)
        logits = decoder(mean)
        assert mean.dtype == logvar.dtype == logits.dtype == tf.float32
        assert logits.shape == (4, 28, 28, 1) and mean.shape == (4, hparams.LATENT)
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --- the reconstruction grid ----------------------------------------------------------------

def test_reconstruction_rows_alternate_originals_and_reconstructions():
    originals = np.arange(10, dtype=np.float32).reshape(10, 1, 1, 1)
    tiles = sampling.reconstruction_rows(originals, -originals, columns=4, blank=9.5)
    assert tiles.ravel().tolist() == [0, 1, 2, 3, -0, -1, -2, -3,
                                      4, 5, 6, 7, -4, -5, -6, -7,
                                      8, 9, 9.5, 9.5, -8, -9, 9.5, 9.5]
    with pytest.raises(ValueError):
        sampling.reconstruction_rows(originals, originals[:9])


def test_save_reconstruction_grid_puts_originals_above_reconstructions(tmp_path):
    originals = np.full((3, 4, 4, 1), 1.0, dtype=np.float32)  # white
    reconstructions = np.full((3, 4, 4, 1), -1.0, dtype=np.float32)  # black in (-1, 1)
    path = tmp_path / "grid.png"
    sampling.save_reconstruction_grid(originals, reconstructions, path, columns=2)
    grid = gray_png(path)
    assert grid.shape == (4 * 6 + 2, 2 * 6 + 2)  # rows: originals, recon, originals, recon
    tile = lambda row, col: grid[2 + 6 * row:6 + 6 * row, 2 + 6 * col:6 + 6 * col]
    assert tile(0, 0).min() == 1.0 and tile(1, 0).max() == 0.0 and tile(1, 1).max() == 0.0
    assert tile(2, 0).min() == 1.0 and tile(3, 0).max() == 0.0
    assert tile(2, 1).min() == 1.0 and tile(3, 1).min() == 1.0  # padding is blank (white)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_the_bounds_score_a_random_draw_of_the_test_images(framework, tmp_path, monkeypatch):
    """As FID's reference: MNIST's test set is ordered by writer, its first images the cleaner
    ones (their bound was about 5 nats better than all 10,000's); the same draw in both twins."""
    from common import evaluation

    scored, bounds = [], evaluation.vae_bounds

    def recorded(encode, decode_logits, images, k, seed):
        scored.append(images)
        return bounds(encode, decode_logits, images, k, seed)

    monkeypatch.setattr(evaluation, "vae_bounds", recorded)
    train(framework, tmp_path / "run", "--iters", "2", "--evaluate", "50", "--iwae-k", "2", "--no-tensorboard")
    test = embedded_mnist("test")[0].astype(np.float32) / 255.0
    (images,) = scored
    np.testing.assert_array_equal(images, evaluation.random_subset(test, 50))
    assert not np.array_equal(images, test[:50])


def test_pytorch_encode_reads_nhwc_images_as_nchw_without_transposing_them():
    """Evaluation hands encode NHWC numpy images; it must permute them to (N, C, H, W), not
    (N, C, W, H): on a square image the latter runs, and encodes every digit mirrored about
    its diagonal."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    encoder = vae_pytorch.build_networks((1, 28, 28), 16)["encoder"].eval()
    x = np.zeros((2, 28, 28, 1), np.float32)
    x[:, :, :14] = 1.0  # the left half white: its transpose is the top half
    x[1, :3] = 0.5
    vae = SimpleNamespace(encoder=encoder, device=torch.device("cpu"))
    with torch.no_grad():  # as the session runs it
        mean, logvar = vae_pytorch.VAE.encode(vae, x)
        expected_mean, expected_logvar = encoder(torch.from_numpy(x).permute(0, 3, 1, 2))
    np.testing.assert_allclose(mean, expected_mean.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logvar, expected_logvar.numpy(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # and the transpose would have encoded something else
        transposed, _ = encoder(torch.from_numpy(x).permute(0, 3, 2, 1))
    assert np.abs(transposed.numpy() - mean).max() > 1e-3


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_reconstruction_grid_decodes_the_posterior_means_of_its_test_images(framework, tmp_path, monkeypatch):
    """The grid's reconstructions are sigmoid(decoder(encoder's mean)) of the originals shown
    above them, at the weights of that step: decoding the fixed prior noise instead draws
    samples there, which look like digits too and no test would otherwise tell apart."""
    script = SCRIPTS[framework]
    saved, checked = [], []
    save_recon, write_samples = sampling.save_reconstruction_grid, script.VAE.write_samples

    def recorded(originals, reconstructions, path, *args, **kwargs):
        saved.append((originals, reconstructions))
        save_recon(originals, reconstructions, path, *args, **kwargs)

    def write_and_check(self, run, step):
        write_samples(self, run, step)
        originals, reconstructions = saved[-1]
        with torch.no_grad():
            mean, _ = self.encode(originals)
            logits = self.decode_logits(mean).reshape(reconstructions.shape)
        np.testing.assert_allclose(reconstructions, 1 / (1 + np.exp(-logits)), atol=1e-5)
        checked.append(step)

    monkeypatch.setattr(sampling, "save_reconstruction_grid", recorded)
    monkeypatch.setattr(script.VAE, "write_samples", write_and_check)
    train(framework, tmp_path / "run", "--iters", "2", "--sample-every", "2", "--checkpoint-every", "0")
    assert checked == [0, 2]
    originals = saved[0][0]
    assert originals.shape == (hparams.RECONSTRUCTION_COUNT, 28, 28, 1)
    np.testing.assert_allclose(originals[0, :, :, 0], embedded_mnist("test")[0][0, :, :, 0] / 255.0, atol=1e-6)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_decode_logits_are_flattened_in_the_pixel_order_of_the_images_they_score(framework):
    """The bounds score flattened NHWC images against decode_logits(z), pixel by pixel; on RGB
    data PyTorch's NCHW logits flattened as they are would put every red logit against
    R, G, B, R, ... pixels: MNIST's single channel cannot tell the two orders apart."""
    from types import SimpleNamespace

    z = np.random.default_rng(0).standard_normal((4, hparams.LATENT)).astype(np.float32)
    if framework == "pytorch":
        torch.manual_seed(0)
        decoder = vae_pytorch.build_networks((3, 5, 7), 16)["decoder"].eval()
        vae = SimpleNamespace(decoder=decoder, device=torch.device("cpu"))
    else:
        vae = SimpleNamespace(decoder=vae_tensorflow.build_networks((5, 7, 3), 16)["decoder"])
    with torch.no_grad():
        logits = SCRIPTS[framework].VAE.decode_logits(vae, z)
        images = SCRIPTS[framework].VAE.sample(vae, z)
    assert images.shape == (4, 5, 7, 3) and logits.shape == (4, 5 * 7 * 3)
    np.testing.assert_allclose(1 / (1 + np.exp(-logits)), images.reshape(4, -1), rtol=1e-5, atol=1e-6)
    assert np.abs(images[..., 0] - images[..., 1]).max() > 1e-3  # the channels differ: the order shows


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_float16_loss_scale_grows_after_each_growth_interval_of_clean_steps(framework, tmp_path):
    """The VAE's step updates its scaler after every step, as the GANs' do: without it the scale
    stayed where it began, never growing, nor halving after an overflow (every later step skipped)."""
    out = tmp_path / "run"
    train(framework, out, "--iters", "5", "--log-every", "1", "--amp", "--amp-dtype", "float16", "--init-scale", "8",
          "--growth-interval", "2", "--checkpoint-every", "0", "--sample-every", "0")
    rows = read_history(out)
    assert [row["skipped"] for row in rows] == [0] * 5
    assert [row["loss_scale"] for row in rows] == [8.0, 16.0, 16.0, 32.0, 32.0]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_the_reparameterisation_draws_standard_normal_noise(framework, monkeypatch):
    """z = mean + sigma * eps with eps ~ N(0, I), one row per image: the twins are fed the same
    draws in the tests that compare them, so a uniform eps in both went unseen."""
    from common.config import parse_args
    from tests.conftest import runtime_and_data

    script, drawn = SCRIPTS[framework], []
    reparameterize = script.reparameterize

    def spy(mean, logvar, eps):
        drawn.append(np.asarray(eps))
        return reparameterize(mean, logvar, eps)

    monkeypatch.setattr(script, "reparameterize", spy)
    cfg = parse_args("vanilla_vae", framework, ["--batch-size", "256", "--data-limit", "256"])
    runtime, data = runtime_and_data(cfg, hparams.PIXEL_RANGE)
    networks = script.build_networks(data.sample_shape, cfg.width)
    vae = script.VAE(networks["encoder"], networks["decoder"], cfg, runtime)
    vae.train_step(data.batch(torch.arange(256)) if framework == "pytorch" else data.dataset.x[:256])
    (eps,) = drawn
    assert eps.shape == (256, hparams.LATENT)
    assert abs(eps.mean()) < 0.05 and abs(eps.std() - 1) < 0.05 and eps.min() < -2  # 5,120 draws


def test_a_ctrl_c_while_evaluating_names_the_iwae_k_the_run_was_measured_with(tmp_path, monkeypatch, capsys):
    """The command that measures the saved run carries the VAE's --iwae-k: without it,
    evaluate.py measures a bound of another K (another key in the summary)."""
    from common.pytorch import session

    def interrupted(self, cfg, keep=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(session.Session, "evaluate", interrupted)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train("pytorch", out, "--iters", "2", "--evaluate", "100", "--iwae-k", "5")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 130
    assert err.endswith(f"step 2: python scripts/evaluate.py {out} --samples 100 --iwae-k 5 measures it"), err
