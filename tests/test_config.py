"""The shared flags: validation, precision choice, and one-line errors with exit status 2."""
import pytest

from common import models
from common.config import RunConfig, parse_args, resolve_precision, unused_flags
from common.errors import UsageError
from GAN.vanilla_gan import hparams
from tests.conftest import run_script


def parse(*argv):
    return parse_args("vanilla_gan", "pytorch", list(argv))


def test_model_defaults_come_from_hparams_and_flags_override_them():
    cfg = parse()
    assert (cfg.batch_size, cfg.lr, cfg.iters) == (hparams.DEFAULTS["batch_size"],
                                                   hparams.DEFAULTS["lr"],
                                                   hparams.DEFAULTS["iters"])
    cfg = parse("--batch-size", "16", "--lr", "5e-4", "--amp", "--dataset", "ring8")
    assert (cfg.batch_size, cfg.lr, cfg.amp, cfg.dataset) == (16, 5e-4, True, "ring8")


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--iters", "-5"], "--iters: must be a positive integer"),
    # past a checkpoint's int64: the run's own summary.json was then read as damaged
    (["--iters", str(2**63)], "--iters: must be at most 2**63 - 1, got 9223372036854775808"),
    (["--checkpoint-every", "1" + "0" * 23], "--checkpoint-every: must be at most 2**63 - 1"),
    (["--lr", "nan"], "--lr: must be a positive finite number"),
    (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    (["--amp-dtype", "float32"], "invalid choice: 'float32'"),
    (["--beta1", "1.5"], "must be in [0, 1)"),
    (["--beta1", "nan"], "--beta1: must be in [0, 1)"),
    (["--ema-decay", "-0.1"], "--ema-decay: must be in [0, 1)"),
    (["--weight-decay", "-1"], "--weight-decay: must be 0 (off) or a positive finite number"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm: must be 0 (off) or a positive finite number"),
    # values a framework cannot hold in float32 (PyTorch's Adam and GradScaler raised deep in the
    # first step) are refused with the flag's bound
    (["--lr", "3e38"], "--lr: must be a positive number up to 10**6, got 3e38"),
    (["--init-scale", "1e300"], "--init-scale: must be from 2**-64 to 2**64, got 1e300"),
    (["--init-scale", "1e-50"], "--init-scale: must be from 2**-64 to 2**64, got 1e-50"),  # float32's 0
    (["--init-scale", "nan"], "--init-scale: must be from 2**-64 to 2**64, got nan"),
    (["--min-loss-scale", "1e39"], "--min-loss-scale: must be from 2**-64 to"),
    (["--min-loss-scale", "0"], "--min-loss-scale: must be from 2**-64 to"),
    (["--growth-interval", str(2**63)], "--growth-interval: must be from 1 to 2,147,483,647"),  # raised mid-run
    # Keras holds these in float32: a beta rounded to 1 divided its update by 0, a clip of 1e39
    # overflowed to inf (NaN losses), where PyTorch trained on
    (["--beta2", "0.99999999"], "--beta2: must stay below 1 in float32 (below 1 - 2**-25), got 0.99999999"),
    (["--ema-decay", "0.99999999"], "--ema-decay: must stay below 1 in float32"),
    (["--clip-grad-norm", "1e39"], "--clip-grad-norm: must be 0 (off) or a positive number up to 10**6, got 1e39"),
    (["--weight-decay", "2e6"], "--weight-decay: must be 0 (off) or a positive number up to 10**6"),
    # 3 nearest neighbours need more than 3 samples: this failed after the training
    (["--evaluate", "3"], "--evaluate: must be 0 (off) or from 10 to 50,000, got 3"),
    (["--evaluate", "-1"], "--evaluate: must be 0 (off) or from 10 to 50,000"),
    # an unset shell variable: "" would mean the default run folder (which --overwrite replaces)
    (["--out", ""], "--out: must name a path, got an empty or blank string"),
    (["--init-from", " "], "--init-from: must name a path"),
    (["--data-dir", ""], "--data-dir: must name a path"),
    (["--replicas", "1000"], "--replicas: must be from 1 to 64, got 1000"),  # ran for minutes building them
    (["--workers", "1000"], "--workers: must be from 0 to 64, got 1000"),  # PyTorch forked 1,000 loader processes
    (["--workers", "-1"], "--workers: must be from 0 to 64, got -1"),
    # one past the bound (mutation round 10: a bound of 5,120 went unseen; only 100,000 was tried)
    (["--image-size", "513"], "--image-size: must be from 1 to 512, got 513"),
])
def test_invalid_flag_values_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_float_flags_take_their_bounds_and_zero_where_zero_means_off():
    cfg = parse("--lr", "1e6", "--ema-decay", "-0", "--clip-grad-norm", "0e0", "--amp", "--init-scale", str(2.0**64),
                "--min-loss-scale", str(2.0**-64))
    assert (cfg.lr, cfg.ema_decay, cfg.clip_grad_norm, cfg.init_scale, cfg.min_loss_scale) == (
        1e6, 0.0, 0.0, 2.0**64, 2.0**-64)
    assert str(cfg.ema_decay) == "0.0"  # not -0.0
    cfg = parse("--beta2", "0.99999994", "--clip-grad-norm", "1e6", "--optimizer", "adamw", "--weight-decay", "1e6",
                "--evaluate", "10")
    assert (cfg.beta2, cfg.clip_grad_norm, cfg.weight_decay, cfg.evaluate) == (0.99999994, 1e6, 1e6, 10)
    assert parse("--evaluate", "0").evaluate == 0  # off


@pytest.mark.parametrize("argv, message", [
    (["--amp-dtype", "float16"], "needs --amp"),
    (["--eval-draws", "3"], "--eval-draws 3 needs --evaluate N"),
    (["--eval-draws", "2"], "--eval-draws 2 needs --evaluate N"),  # mutation round 10: `> 2` went unseen
    (["--save-samples"], "--save-samples needs --evaluate N"),
    (["--resume", "--overwrite"], "contradict"),
    (["--weight-decay", "0.01"], "needs --optimizer adamw"),
    (["--dataset", "cifar10"], "needs --data-dir"),
    (["--dataset", "fashion-mnist"], "--dataset fashion-mnist needs --data-dir"),  # mutation round 10: unseen
    (["--dataset", "ring8", "--image-size", "32"], "--image-size resizes images; --dataset ring8 is 2-D points"),
    # the mixtures read no files: the run went on and recorded a folder that was never read
    (["--dataset", "ring8", "--data-dir", "/nonexistent/dir"], "--data-dir names the files of an image dataset; "
                                                               "--dataset ring8 is 2-D points"),
    (["--dataset", "grid25", "--data-dir", "."], "--dataset grid25 is 2-D points sampled in memory: leave it out"),
    (["--batch-size", "64", "--data-limit", "10"], "smaller than --batch-size"),
    # a factor of 1 leaves the float16 loss scale where it is: it never grows back, or never backs off
    (["--growth-factor", "1"], "--growth-factor 1.0 must be above 1"),
    (["--backoff-factor", "1"], "--backoff-factor 1.0 must be between 0 and 1"),
    # its sample grids became images of the folder: the run's --resume, and evaluate.py, then
    # said the data held "both class folders and loose images"
    (["--dataset", "folder", "--data-dir", "/data/faces", "--out", "/data/faces/run"],
     "--out /data/faces/run lies inside --data-dir /data/faces, whose every visible folder --dataset folder reads"),
    (["--dataset", "folder", "--data-dir", "."], r"the default run folder \(runs/vanilla_gan/...\) lies inside "),
    (["--dataset", "folder", "--data-dir", "runs/vanilla_gan"], r"the default run folder \(runs/vanilla_gan/...\)"),
])
def test_inconsistent_flags_raise_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


def test_a_run_folder_beside_its_image_folder_or_in_a_hidden_folder_of_it_is_taken():
    """Beside it, or below a hidden entry (.runs/), which the folder dataset skips."""
    for out in ("/data/faces-run", "/data/faces/.runs/gan"):
        assert parse("--dataset", "folder", "--data-dir", "/data/faces", "--out", out).out == out


def test_amp_picks_bfloat16_on_cpu_and_float16_on_cuda():
    amp = RunConfig(model="m", framework="pytorch", amp=True)
    assert resolve_precision(amp, "cpu") == "amp-bf16"
    assert resolve_precision(amp, "cuda") == "amp-fp16"
    assert resolve_precision(RunConfig(model="m", framework="pytorch"), "cuda") == "fp32"
    forced = RunConfig(model="m", framework="pytorch", amp=True, amp_dtype="float16")
    assert resolve_precision(forced, "cpu") == "amp-fp16"


def test_tf32_flag_sets_both_frameworks_and_auto_leaves_their_defaults():
    """--tf32 reaches the settings CUDA's float32 kernels read (set even on a CPU, which
    ignores them), and is recorded in the run's config; auto touches nothing."""
    import tensorflow as tf
    import torch

    from common.pytorch import runtime as torch_runtime
    from common.tensorflow import runtime as tf_runtime

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision, tf.config.experimental.tensor_float_32_execution_enabled())
    try:
        torch_runtime.setup(parse("--tf32", "off", "--device", "cpu"), log=lambda *_: None)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")
        assert torch_runtime.set_tf32("auto") == "float32 matmuls ieee, convolutions ieee"
        torch_runtime.setup(parse("--tf32", "on", "--device", "cpu"), log=lambda *_: None)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
        torch_runtime.setup(parse("--device", "cpu"), log=lambda *_: None)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")  # auto: as it was

        tf_parse = lambda *argv: parse_args("vanilla_gan", "tensorflow", ["--device", "cpu", *argv])
        tf_runtime.setup(tf_parse("--tf32", "off"), log=lambda *_: None)
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
        tf_runtime.setup(tf_parse(), log=lambda *_: None)
        assert tf_runtime.tf32_state() == "off"
        tf_runtime.setup(tf_parse("--tf32", "on"), log=lambda *_: None)
        assert tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved[:2]
        tf.config.experimental.enable_tensor_float_32_execution(saved[2])
    assert parse().tf32 == "auto" and '"tf32": "off"' in parse("--tf32", "off").to_json()


def test_tf32_auto_reports_pytorchs_own_defaults_where_no_level_sets_them():
    """"none" defers to the level above; where no level sets it, PyTorch runs CUDA's float32
    matmuls in IEEE float32 and cuDNN's convolutions in TF32: what a CUDA run's first line says."""
    import torch

    from common.pytorch import runtime as torch_runtime

    backends = torch.backends
    levels = (backends.cuda.matmul, backends.cudnn.conv, backends.cudnn, backends)
    saved = [level.fp32_precision for level in levels]
    try:
        for level in levels:
            level.fp32_precision = "none"
        assert torch_runtime.set_tf32("auto") == "float32 matmuls ieee, convolutions tf32"
        backends.cudnn.fp32_precision = "ieee"  # a level above the convolutions' own
        assert torch_runtime.set_tf32("auto") == "float32 matmuls ieee, convolutions ieee"
    finally:
        for level, precision in reversed(list(zip(levels, saved))):
            level.fp32_precision = precision


def test_only_float16_on_a_onednn_cpu_turns_tensorflows_remapper_off(monkeypatch):
    """Grappler's fused MatMul+BiasAdd went to oneDNN's reference kernel for float16 on a CPU
    (1,587 ms a step, 21 ms unfused); a GPU's float16, bfloat16 and float32 keep the fusion, and
    so does a CPU whose build runs no oneDNN, or does not say."""
    from common.tensorflow import runtime as tf_runtime

    monkeypatch.setattr(tf_runtime, "onednn_enabled", lambda: True)
    assert tf_runtime.fuses_float16_slowly("amp-fp16", "cpu")
    assert not any(tf_runtime.fuses_float16_slowly(precision, device) for precision, device in
                   (("amp-fp16", "cuda"), ("amp-bf16", "cpu"), ("fp32", "cpu"), ("amp-bf16", "cuda")))
    for off_or_unknown in (False, None):
        monkeypatch.setattr(tf_runtime, "onednn_enabled", lambda: off_or_unknown)
        assert not tf_runtime.fuses_float16_slowly("amp-fp16", "cpu")


def test_bfloat16_where_it_cannot_run_is_refused():
    cfg = RunConfig(model="m", framework="pytorch", amp=True, amp_dtype="bfloat16")
    with pytest.raises(UsageError, match="not supported"):
        resolve_precision(cfg, "cuda", bf16_supported=False)


def test_cli_errors_are_one_line_without_traceback():
    bad_flag = run_script("GAN/vanilla_gan/gan_pytorch.py", "--batch-size", "0")
    assert bad_flag.returncode == 2
    assert bad_flag.stderr.strip().count("\n") == 0 and "Traceback" not in bad_flag.stderr

    no_gpu = run_script("GAN/vanilla_gan/gan_pytorch.py", "--device", "cuda", "--iters", "1")
    assert no_gpu.returncode == 2, no_gpu.stderr
    assert no_gpu.stderr.strip().splitlines()[-1].startswith("error: --device cuda")
    assert "Traceback" not in no_gpu.stderr


def test_help_lists_the_shared_flags():
    result = run_script("GAN/vanilla_gan/gan_pytorch.py", "--help")
    assert result.returncode == 0
    for flag in ("--amp", "--amp-dtype", "--iters", "--batch-size", "--resume",
                 "--checkpoint-every", "--optimizer", "--profile", "--data-dir"):
        assert flag in result.stdout


def test_a_misspelt_hparams_default_is_refused():
    from common.config import build_parser

    with pytest.raises(ValueError, match=r"unknown run settings: \['iterz'\]"):
        build_parser("vanilla_gan", "pytorch", {"iterz": 5, "lr": 1e-3})
    assert build_parser("vanilla_gan", "pytorch", {"lr": 0.5}).parse_args([]).lr == 0.5


@pytest.mark.parametrize("model", ["vanilla_gan", "lsgan"])
def test_a_datasets_own_defaults_sit_between_the_models_and_the_command_line(model):
    """hparams.DATASET_DEFAULTS: the 2-D mixtures train longer, at their own rate and batch;
    MNIST keeps the model's defaults (the average of G included); a flag on the command line
    overrides both."""
    hparams = models.get(model).hparams
    ring = hparams.DATASET_DEFAULTS["ring8"]
    assert ring["iters"] != hparams.DEFAULTS["iters"] and ring["lr"] != hparams.DEFAULTS["lr"]
    assert ring["batch_size"] != hparams.DEFAULTS["batch_size"]
    assert hparams.DEFAULTS["ema_decay"] > 0
    mnist = parse_args(model, "tensorflow", [])
    model_defaults = hparams.DEFAULTS
    assert (mnist.iters, mnist.batch_size, mnist.lr, mnist.ema_decay) == (
        model_defaults["iters"], model_defaults["batch_size"], model_defaults["lr"], model_defaults["ema_decay"])
    on_ring = parse_args(model, "tensorflow", ["--dataset", "ring8"])
    assert (on_ring.iters, on_ring.batch_size, on_ring.lr, on_ring.ema_decay, on_ring.sample_every) == (
        ring["iters"], ring["batch_size"], ring["lr"], hparams.DEFAULTS["ema_decay"], ring["sample_every"])
    overridden = parse_args(model, "pytorch", ["--iters", "7", "--dataset", "grid25", "--ema-decay", "0"])
    assert (overridden.iters, overridden.lr, overridden.ema_decay) == (7, hparams.DEFAULTS["lr"], 0.0)


def test_a_dataset_default_that_names_no_setting_is_a_programming_error(monkeypatch):
    monkeypatch.setattr(hparams, "DATASET_DEFAULTS", {"ring8": {"iterations": 5}})
    with pytest.raises(ValueError, match="iterations"):
        parse("--dataset", "ring8")


@pytest.mark.parametrize("model", ["vanilla_gan", "lsgan"])
def test_a_batch_that_does_not_divide_into_packs_is_refused_on_points_only(model):
    with pytest.raises(UsageError, match=f"packs of {hparams.POINT_PACK}"):
        parse_args(model, "pytorch", ["--dataset", "ring8", "--batch-size", "63"])
    assert parse_args(model, "pytorch", ["--batch-size", "63"]).batch_size == 63  # MNIST: one by one
    # among replicas, each one's share must divide into packs too: 6 does into 2s, its halves do not
    with pytest.raises(UsageError, match=r"does not divide among 2 replicas x packs of 2 samples: use a multiple of 4"):
        parse_args(model, "tensorflow", ["--dataset", "ring8", "--distribute", "mirrored", "--replicas", "2",
                                         "--batch-size", str(3 * hparams.POINT_PACK)])


def test_one_replica_is_said_in_the_singular():
    """--distribute mirrored --replicas 1 said "among 1 replicas"."""
    with pytest.raises(UsageError, match=r"does not divide among 1 replica x 5 parts of each step's batch"):
        parse_args("wgan_gp", "tensorflow", ["--distribute", "mirrored", "--replicas", "1", "--batch-size", "42"])


@pytest.mark.parametrize("model, argv, precision, device, notes", [
    ("vanilla_gan", [], "fp32", "cpu", []),
    # loss scaling is float16's alone
    ("vanilla_gan", ["--init-scale", "1024", "--growth-interval", "50"], "fp32", "cpu",
     ["--init-scale, --growth-interval: only float16 scales its loss, and this run is float32"]),
    ("vanilla_gan", ["--amp", "--min-loss-scale", "1"], "amp-bf16", "cpu",
     ["--min-loss-scale: only float16 scales its loss, and this run is bfloat16"]),
    ("vanilla_gan", ["--amp", "--amp-dtype", "float16", "--init-scale", "1024", "--growth-interval", "10"],
     "amp-fp16", "cpu", []),
    # the IWAE bound is the VAE's, measured under --evaluate
    ("dcgan", ["--iwae-k", "50", "--evaluate", "100"], "fp32", "cpu",
     ["--iwae-k: the VAE's likelihood bound; a GAN has none"]),
    ("vae", ["--iwae-k", "50"], "fp32", "cpu", ["--iwae-k: the IWAE bound is measured under --evaluate N only"]),
    ("vae", ["--iwae-k", "50", "--evaluate", "100"], "fp32", "cpu", []),
    # TensorFloat-32 is a GPU's
    ("vanilla_gan", ["--tf32", "off"], "fp32", "cpu",
     ["--tf32 off: TensorFloat-32 is an NVIDIA GPU's; a CPU computes float32 in full"]),
    ("vanilla_gan", ["--tf32", "off", "--init-scale", "1024"], "amp-fp16", "cuda", []),
])
def test_flags_a_run_never_reads_are_named(model, argv, precision, device, notes):
    for framework in ("pytorch", "tensorflow"):
        assert unused_flags(parse_args(model, framework, argv), precision, device) == notes


@pytest.mark.parametrize("model", list(models.MODELS))
def test_sync_bn_on_a_model_without_batch_norm_is_named(model):
    """The VAE under --distribute mirrored --sync-bn trained with no word that the flag did
    nothing. The registry's batch_norm is checked against the networks themselves."""
    import torch

    entry = models.MODELS[model]
    networks = entry.module("pytorch").build_networks((1, 28, 28), 8)
    has_batch_norm = any(isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)
                         for network in networks.values() for layer in network.modules())
    assert entry.batch_norm == has_batch_norm
    cfg = parse_args(model, "tensorflow", ["--distribute", "mirrored", "--replicas", "2", "--sync-bn"])
    notes = unused_flags(cfg, "fp32", "cpu")
    assert notes == ([] if has_batch_norm else [f"--sync-bn: {model} has no batch norm to synchronise"])


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_run_notes_the_flags_it_ignores(framework, tmp_path, capsys):
    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

    script = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}[framework]
    script.main(["--out", str(tmp_path / "run"), "--dataset", "ring8", "--iters", "2", "--batch-size", "16",
                 "--sample-every", "0", "--no-tensorboard", "--init-scale", "1024", "--iwae-k", "5"])
    out = capsys.readouterr().out
    assert ("note: --init-scale: only float16 scales its loss, and this run is float32: ignored\n"
            "note: --iwae-k: the VAE's likelihood bound; a GAN has none: ignored\n") in out


def test_a_default_from_hparams_is_no_flag_given(monkeypatch):
    """The model's and the dataset's own defaults are what the run was not told: no note."""
    monkeypatch.setitem(hparams.DEFAULTS, "init_scale", 1024.0)
    monkeypatch.setitem(hparams.DATASET_DEFAULTS["ring8"], "tf32", "off")
    cfg = parse("--dataset", "ring8")
    assert (cfg.init_scale, cfg.tf32) == (1024.0, "off") and unused_flags(cfg, "fp32", "cpu") == []
    assert unused_flags(parse("--init-scale", "512"), "fp32", "cpu") == [
        "--init-scale: only float16 scales its loss, and this run is float32"]


def test_minus_zero_for_a_switch_that_is_off_is_recorded_as_zero():
    """-0 turns the clip or weight decay off as 0 does, and config.json records 0.0, not -0.0
    (mutation round 10: returning the -0.0 as typed went unseen)."""
    cfg = parse("--clip-grad-norm", "-0", "--weight-decay", "-0.0")
    assert (str(cfg.clip_grad_norm), str(cfg.weight_decay)) == ("0.0", "0.0")


def test_a_data_dir_with_a_tilde_no_shell_expanded_is_under_the_home_folder(monkeypatch, tmp_path):
    """Quoted, or after "=", a "~" reaches the script as typed: it is the home folder, not a
    folder named "~" in the working one (mutation round 10: dropping the expansion went unseen)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse("--data-dir", "~/mnist").data_dir == str(tmp_path / "mnist")


def test_a_data_limit_of_exactly_one_batch_is_taken():
    """One full batch is enough; only a smaller limit is refused (mutation round 10: refusing
    --data-limit equal to --batch-size went unseen)."""
    assert parse("--batch-size", "64", "--data-limit", "64").data_limit == 64


def test_the_precision_line_warns_of_slow_float16_on_a_cpu_only():
    """float16 is emulated on a CPU; on CUDA, and for bfloat16, the line says nothing of it
    (mutation round 10: dropping the warning went unseen)."""
    from common.config import describe_precision

    assert describe_precision("amp-fp16", "cpu") == ("AMP float16 with dynamic loss scaling -- float16 is "
                                                     "emulated on CPU and runs slowly")
    assert describe_precision("amp-fp16", "cuda") == "AMP float16 with dynamic loss scaling"
    assert "emulated" not in describe_precision("amp-bf16", "cpu") + describe_precision("fp32", "cpu")


def test_bfloat16_on_a_cpu_without_native_support_is_noted_once_as_slower(monkeypatch):
    """Only a bfloat16 run on a CPU that surely lacks AVX512-BF16/AMX is told it runs slower than
    float32 (mutation round 10: dropping the note went unseen)."""
    from common import cpu
    from common.config import warn_if_bf16_emulated

    for native in (False, True):
        monkeypatch.setattr(cpu, "has_native_bf16", lambda: native)
        logged = []
        for precision, device in (("amp-bf16", "cpu"), ("amp-bf16", "cuda"), ("amp-fp16", "cpu"), ("fp32", "cpu")):
            warn_if_bf16_emulated(precision, device, log=logged.append)
        assert len(logged) == (0 if native else 1) and all("no native bfloat16" in line for line in logged)
