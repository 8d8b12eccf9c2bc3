"""The PyTorch scripts on a CUDA GPU: float16 with the GradScaler, bfloat16, float32 with
TensorFloat-32 off, channels_last, torch.compile, the pinned host loader, the profiler's
kernel times, --resume, and checkpoints and weights crossing between CUDA and the CPU.

The tests marked `cuda` are skipped where PyTorch sees no CUDA GPU; `pytest -m cuda
tests/test_cuda.py tests/test_loss_scaling.py` runs them alone, with the GradScaler's skipped
step on CUDA (test_loss_scaling.py). Neither file imports TensorFlow, which the GPU machines
this repository was measured on do not have: its GPU path is untested.
"""
import copy
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common import models
from common.pytorch import porting
from tests.conftest import checkpoint_arrays, cuda_param

PRECISIONS = {"fp32": ["--tf32", "off"], "amp-fp16": ["--amp"], "amp-bf16": ["--amp", "--amp-dtype", "bfloat16"]}
# batches of 20: WGAN-GP splits each into 5 critic batches
TINY = ["--device", "cuda", "--batch-size", "20", "--data-limit", "100", "--log-every", "2"]
FLOAT32_TARGET = 1e-5  # scripts/parity.py's, for the twins on a CPU


def train(model, out, *flags):
    return models.MODELS[model].module("pytorch").main(["--out", str(out), *TINY, *flags])


def history(out):
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def cuda_defaults():
    """Each test starts from PyTorch's CUDA defaults: a CPU run earlier in the process turned
    deterministic algorithms on (cuBLAS refuses them without CUBLAS_WORKSPACE_CONFIG) and a CUDA
    run turned cudnn.benchmark on (timing-picked kernels); the scripts' runs set both again."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark = saved[1]


@pytest.fixture
def ieee_float32():
    """Float32 matmuls and convolutions without TensorFloat-32 for the test, restored after."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = matmul.fp32_precision, conv.fp32_precision
    matmul.fp32_precision = conv.fp32_precision = "ieee"
    yield
    matmul.fp32_precision, conv.fp32_precision = saved


@pytest.mark.parametrize("device", ["cpu", cuda_param("cuda")])
def test_pytorch_dcgan_weights_and_batches_are_channels_last_on_every_device(device):
    """oneDNN's CPU convolutions, like tensor cores, run fastest on NHWC: the networks' conv
    weights and the image batches are stored channels_last, on CPU too."""
    from common.config import parse_args
    from common.pytorch.data import load_data
    from common.pytorch.runtime import setup

    cfg = parse_args("dcgan", "pytorch", ["--data-limit", "64", "--device", device])
    runtime = setup(cfg, log=lambda *_: None)
    data = load_data(cfg, runtime, models.MODELS["dcgan"].hparams.PIXEL_RANGE)
    batch = data.batch(torch.arange(4))
    assert batch.device.type == device
    assert batch.shape == (4, 1, 28, 28) and batch.is_contiguous(memory_format=torch.channels_last)
    assert batch.stride()[1] == 1  # channels innermost (with one channel NCHW would also be "contiguous")
    discriminator = runtime.place(models.MODELS["dcgan"].module("pytorch").Discriminator(data.sample_shape, cfg.width))
    kernels = [p for p in discriminator.parameters() if p.dim() == 4]
    assert kernels and all(p.is_contiguous(memory_format=torch.channels_last) and p.stride()[1] == 1
                           and p.device.type == device for p in kernels)


def test_pytorch_rgb_batches_are_channels_last_in_the_models_range():
    """With one channel, NCHW is channels_last too, so the DCGAN test above could not tell
    (mutation round 9: to_model's .contiguous(memory_format=torch.channels_last) dropped went
    unseen). 3 channels on a 2x3 map: the same pixels, NCHW, scaled to the model's range."""
    from common.data import Dataset
    from common.pytorch.data import DeviceData

    images = np.arange(4 * 2 * 3 * 3, dtype=np.uint8).reshape(4, 2, 3, 3)
    data = DeviceData(Dataset("cifar10", images, np.zeros(4, np.int64)), torch.device("cpu"), (-1.0, 1.0))
    batch = data.batch(torch.tensor([2, 0]))
    assert batch.dtype == torch.float32 and batch.is_contiguous(memory_format=torch.channels_last)
    expected = images[[2, 0]].transpose(0, 3, 1, 2).astype(np.float32) * (2 / 255) - 1
    np.testing.assert_allclose(batch.numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("model", list(models.MODELS))
def test_every_pytorch_script_trains_on_cuda_and_writes_its_run_folder(model, precision, tmp_path):
    out = tmp_path / "run"
    summary = train(model, out, "--iters", "4", "--sample-every", "2", "--checkpoint-every", "2",
                    "--evaluate", "200", "--iwae-k", "2", *PRECISIONS[precision])
    allocator_peak = torch.cuda.max_memory_allocated() / 2**20

    config = json.loads((out / "config.json").read_text())
    assert config["device"] == "cuda:0" and config["precision"] == precision
    rows = history(out)
    assert [row["step"] for row in rows] == [2, 4]
    for row in rows:
        assert all(math.isfinite(value) for key, value in row.items() if key != "skipped_at"), row
        # float16 scales the loss (65536, halved at each skipped step); the others do not
        assert (row["loss_scale"] > 1) == (precision == "amp-fp16"), row
    names = {path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file()}
    assert {"config.json", "history.jsonl", "summary.json", "fixed_noise.npy", "initial_weights.npz",
            "samples/step_000000.png", "samples/step_000004.png",
            "checkpoints/step_000002.pt", "checkpoints/step_000004.pt"} <= names
    assert any(name.startswith("events.out.tfevents") for name in names)
    # the CUDA allocator's peak of this run (the process's resident set would be gigabytes)
    assert 0 < summary["peak_memory_mb"] <= allocator_peak
    assert summary["gpu"] == torch.cuda.get_device_name(0) and summary["gpu"]  # whose timings these are
    assert summary["metrics"]["samples"] == 200 and all(math.isfinite(v) for v in summary["metrics"].values())


@pytest.mark.cuda
def test_binary_cross_entropy_raises_under_cuda_autocast_and_bce_with_logits_does_not():
    """F.binary_cross_entropy on probabilities is refused under CUDA autocast (float16 would
    round 1 - p to 0); BCE-with-logits, fused and stable, runs and returns float32: which is
    why the models' losses take logits (the next test) and the float16 runs above train."""
    probabilities = torch.rand(8, 1, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(probabilities, torch.ones_like(probabilities))
        logits = F.linear(torch.randn(8, 4, device="cuda"), torch.randn(1, 4, device="cuda"))
        fused = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
    assert logits.dtype == torch.float16 and fused.dtype == torch.float32 and torch.isfinite(fused)


def test_the_models_losses_take_logits():
    """No PyTorch model script (nor the GAN step they share) calls F.binary_cross_entropy or
    BCELoss on probabilities, which CUDA autocast refuses: a source scan, so it runs on a CPU."""
    sources = [source for model in models.MODELS.values()
               for source in (model.script("pytorch"), models.REPO / model.family / "gan_step_pytorch.py")
               if source.exists()]
    assert sources
    texts = {source: source.read_text() for source in sources}
    assert any("binary_cross_entropy_with_logits(" in text for text in texts.values())  # the scan reads the losses
    for source, text in texts.items():
        assert not re.search(r"binary_cross_entropy\(|BCELoss\(", text), source


@pytest.mark.cuda
@pytest.mark.parametrize("model, precision, rel", [
    ("vanilla_gan", ["--tf32", "off"], 1e-4),
    # a scale the first steps do not overflow (2^16 does, on the H100): the steps train, not skip
    ("dcgan", ["--amp", "--amp-dtype", "float16", "--init-scale", "1024"], 1e-2)])
def test_compile_trains_like_eager_on_cuda_and_its_checkpoint_resumes_eagerly(model, precision, rel, tmp_path,
                                                                              ieee_float32):
    """DCGAN compiles under float16 (in float32, see the next test)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    flags = ["--iters", "4", "--sample-every", "0", "--checkpoint-every", "4", *precision]
    compiled = train(model, tmp_path / "compiled", *flags, "--compile")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # G and D ran compiled
    eager = train(model, tmp_path / "eager", *flags)
    for key in ("d_loss", "g_loss"):  # inductor fuses and reorders float sums: close, not equal
        assert compiled["final"][key] == pytest.approx(eager["final"][key], rel=rel)
    assert compiled["skipped_steps"] == eager["skipped_steps"] < 4
    resumed = train(model, tmp_path / "compiled", "--iters", "6", "--sample-every", "0", "--resume", *precision)
    assert resumed["step"] == 6 and math.isfinite(resumed["final"]["d_loss"])


@pytest.mark.cuda
def test_dcgan_compiled_in_float32_trains_or_says_in_one_line_that_the_compiler_failed(tmp_path):
    """PyTorch 2.11's inductor mispredicts the strides of a transposed convolution's weight
    gradient in float32 on CUDA (pytorch/pytorch#171622) and fails DCGAN's first step: the
    script says so in one line. A PyTorch that compiles it trains instead."""
    import subprocess
    import sys

    script = models.MODELS["dcgan"].script("pytorch")
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "run"), *TINY, "--iters", "4",
                             "--sample-every", "0", "--tf32", "off", "--compile"],
                            capture_output=True, text=True, timeout=600)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    if result.returncode == 0:
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 4
    else:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
        assert errors[0].startswith("error: torch.compile failed in PyTorch ") and "without --compile" in errors[0]


@pytest.mark.cuda
def test_tf32_on_reaches_the_log_and_runs_eager_and_compiled(tmp_path, capsys):
    """--tf32 on, the fp32-tf32 rows of the CUDA table: DCGAN's convolutions eagerly, the MLP
    GAN's matmuls under torch.compile (whose kernel choice reads the float32 precision settings)."""
    for model, compiled in (("dcgan", False), ("vanilla_gan", True)):
        summary = train(model, tmp_path / f"compiled{compiled}", "--iters", "4", "--sample-every", "0",
                        "--tf32", "on", *(["--compile"] if compiled else []))
        assert summary["step"] == 4 and math.isfinite(summary["final"]["d_loss"])
        assert "float32 matmuls tf32, convolutions tf32" in capsys.readouterr().out
    train("dcgan", tmp_path / "off", "--iters", "2", "--sample-every", "0", "--tf32", "off")
    assert "float32 matmuls ieee, convolutions ieee" in capsys.readouterr().out


@pytest.mark.cuda
def test_host_loader_pins_its_batches_on_cuda_and_trains_on_the_same_ones(tmp_path, monkeypatch, ieee_float32):
    pinned = []
    original_iter = torch.utils.data.DataLoader.__iter__

    def spy(loader):
        for batch in original_iter(loader):
            pinned.append(batch.is_pinned())
            yield batch

    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", spy)
    flags = ["--iters", "6", "--sample-every", "0", "--log-every", "1", "--tf32", "off"]
    loaded = train("vanilla_gan", tmp_path / "loaded", *flags, "--workers", "2")
    resident = train("vanilla_gan", tmp_path / "resident", *flags)
    assert len(pinned) >= 6 and all(pinned)
    losses = lambda name: [row[key] for row in history(tmp_path / name) for key in ("d_loss", "g_loss")]
    assert losses("loaded") == pytest.approx(losses("resident"), rel=1e-6)
    assert loaded["step"] == resident["step"] == 6


@pytest.mark.cuda
def test_profile_table_is_cuda_kernel_time(tmp_path, capsys):
    out = tmp_path / "run"
    train("dcgan", out, "--iters", "16", "--profile", "--amp")
    table = (out / "profile" / "top_ops.txt").read_text()
    assert table.startswith("top operations by self CUDA kernel time over 10 profiled steps")
    assert table in capsys.readouterr().out + "\n"
    trace = json.loads((out / "profile" / "trace.json").read_text())
    kernels = {event["name"] for event in trace["traceEvents"]
               if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")}  # what ran on the GPU
    shown = [line[2:].rsplit(None, 3)[0] for line in table.splitlines()[2:]]
    # the table's rows are the trace's GPU work, not the ops that launched it (names over 60
    # characters end in "...")
    assert len(shown) >= 5
    matched = [name for name in shown
               if any(kernel == name or (name.endswith("...") and kernel.startswith(name[:-3])) for kernel in kernels)]
    assert matched == shown, (shown, sorted(kernels)[:20])


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["vanilla_gan", "dcgan"])
def test_resume_continues_a_cuda_run_where_the_straight_run_went(model, tmp_path, ieee_float32, monkeypatch):
    """CUDA's RNG state is checkpointed with the rest (and must end where the straight run's
    did). A run's cuDNN kernels may sum in any order (atomics), and Adam turns a last-bit
    difference in a near-zero gradient into an lr-sized step: on a GPU only deterministic
    kernels make two runs comparable. With them (timed once, the same for the three runs in
    this process) the resumed run ends on the straight run's weights exactly."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    flags = ["--checkpoint-every", "4", "--sample-every", "0", "--seed", "3", "--ema-decay", "0.9", "--tf32", "off"]
    train(model, tmp_path / "straight", "--iters", "8", *flags)
    train(model, tmp_path / "resumed", "--iters", "4", *flags)
    train(model, tmp_path / "resumed", "--iters", "8", "--resume", *flags)
    assert [row["step"] for row in history(tmp_path / "resumed")] == [2, 4, 6, 8]
    straight = checkpoint_arrays(tmp_path / "straight" / "checkpoints" / "step_000008.pt")
    resumed = checkpoint_arrays(tmp_path / "resumed" / "checkpoints" / "step_000008.pt")
    assert straight.keys() == resumed.keys() and "rng_cuda" in straight
    np.testing.assert_array_equal(resumed["rng_cuda"], straight["rng_cuda"])
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


@pytest.mark.cuda
@pytest.mark.parametrize("first, then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_crosses_between_cuda_and_the_cpu(first, then, tmp_path):
    out = tmp_path / "run"
    flags = ["--batch-size", "20", "--data-limit", "100", "--log-every", "2", "--sample-every", "0",
             "--checkpoint-every", "4"]
    script = models.MODELS["dcgan"].module("pytorch")
    script.main(["--out", str(out), *flags, "--iters", "4", "--device", first])
    resumed = script.main(["--out", str(out), *flags, "--iters", "6", "--resume", "--device", then])
    assert resumed["step"] == 6 and math.isfinite(resumed["final"]["d_loss"])
    assert json.loads((out / "config.json").read_text())["device"] == ("cuda:0" if then == "cuda" else "cpu")


def network_input(model, name, network, batch=16):
    """Noise for G and the VAE's decoder, MNIST-shaped images in the model's range otherwise."""
    hparams = models.MODELS[model].hparams
    if name in ("generator", "decoder"):
        return torch.randn(batch, getattr(hparams, "Z_DIM", getattr(hparams, "LATENT", None)))
    low, high = hparams.PIXEL_RANGE
    return torch.rand(batch, 1, 28, 28) * (high - low) + low


@pytest.mark.cuda
@pytest.mark.parametrize("model", list(models.MODELS))
def test_float32_on_cuda_computes_what_the_cpu_computes_and_weights_port_both_ways(model, ieee_float32):
    """The twins agree on a CPU (test_porting.py, within 1e-5): here CUDA float32 without
    TensorFloat-32 agrees with the CPU within the same 1e-5, and the neutral weight format
    (what --init-from and scripts/parity.py carry between the frameworks) reads and writes
    CUDA networks exactly."""
    torch.manual_seed(0)
    script = models.MODELS[model].module("pytorch")
    width = models.MODELS[model].hparams.DEFAULTS["width"]
    for name, on_cpu in script.build_networks((1, 28, 28), width).items():
        on_cuda = copy.deepcopy(on_cpu).to("cuda", memory_format=torch.channels_last).eval()
        on_cpu.eval()
        x = network_input(model, name, on_cpu)
        with torch.no_grad():
            expected, got = on_cpu(x), on_cuda(x.cuda())
        for a, b in zip(expected if isinstance(expected, tuple) else (expected,),
                        got if isinstance(got, tuple) else (got,)):
            assert (b.cpu() - a).abs().max().item() <= FLOAT32_TARGET, f"{model} {name}"

        exported = porting.export_weights(on_cuda)
        back_on_cpu = script.build_networks((1, 28, 28), width)[name]
        porting.import_weights(back_on_cpu, exported)
        onto_cuda = script.build_networks((1, 28, 28), width)[name].cuda()
        porting.import_weights(onto_cuda, porting.export_weights(on_cpu))
        for original, read_back, written in zip(on_cpu.state_dict().values(), back_on_cpu.state_dict().values(),
                                                onto_cuda.state_dict().values()):
            if original.dtype.is_floating_point:
                assert torch.equal(original, read_back) and torch.equal(original, written.cpu())
