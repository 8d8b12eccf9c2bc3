"""The committed MNIST feature net: it classifies, its features are stable, its numpy forward
pass is the PyTorch net it was trained as, it imports no framework, and a bad weights file is a
one-line CheckpointError. The training script: --amp trains and tests under autocast, float32
training is reproducible, only the reproducible run writes the committed weights, --precisions
prints the side-by-side table, and bad flags are one-line errors."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from common import data as datasets
from common import feature_net
from common.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def test_images():
    return datasets.load_dataset("mnist", split="test", limit=2000)


def test_committed_weights_classify_mnist(test_images):
    features, logits = feature_net.features_and_logits(test_images.x)
    assert features.shape == (2000, feature_net.FEATURE_DIM) and logits.shape == (2000, 10)
    assert features.dtype == logits.dtype == np.float64
    assert (logits.argmax(axis=1) == test_images.y).mean() >= 0.985


def test_features_are_deterministic_and_independent_of_batching(test_images):
    images = test_images.x[:300]
    first, _ = feature_net.features_and_logits(images, batch_size=300)
    again, _ = feature_net.features_and_logits(images, batch_size=300)
    np.testing.assert_array_equal(first, again)
    chunked, _ = feature_net.features_and_logits(images, batch_size=64)
    np.testing.assert_allclose(chunked, first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_a_batch_size_below_one_is_refused(test_images, batch_size):
    """(mutation round 9: the check as batch_size < 0, which measured nothing at -1 and
    returned empty features, went unseen)"""
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        feature_net.features_and_logits(test_images.x[:10], batch_size=batch_size)


def test_no_images_give_empty_features_and_logits_of_the_right_widths():
    """(mutation round 9: the empty arrays' widths swapped, features 10 wide and logits 128,
    went unseen)"""
    features, logits = feature_net.features_and_logits(np.zeros((0, 28, 28, 1), np.uint8))
    assert features.shape == (0, feature_net.FEATURE_DIM) and logits.shape == (0, feature_net.NUM_CLASSES)


def test_uint8_and_unit_range_floats_give_the_same_features(test_images):
    images = test_images.x[:50]
    from_uint8, _ = feature_net.features_and_logits(images)
    from_float, _ = feature_net.features_and_logits(datasets.to_unit_range(images))
    np.testing.assert_array_equal(from_uint8, from_float)


def test_tanh_range_and_wrong_shapes_are_refused(test_images):
    with pytest.raises(ValueError, match=r"\(x \+ 1\) / 2"):
        feature_net.features_and_logits(test_images.x[:10] / np.float32(127.5) - 1)
    with pytest.raises(ValueError, match="28, 28, 1"):
        feature_net.features_and_logits(np.zeros((4, 32, 32, 1), dtype=np.uint8))


def test_float_images_must_lie_in_the_unit_range_give_or_take_its_slack():
    """Float images of 0..255 (uint8 pixels cast, never divided) would score as near-white
    digits, clipped to 1, with no error; a sigmoid's or a resize's rounding just past [0, 1] is
    not such a mistake."""
    images = np.zeros((2, 28, 28, 1), dtype=np.float32)
    images[0, 14, 14] = 255.0
    with pytest.raises(ValueError, match=r"float images must lie in \[0, 1\], got values in \[0, 255\]"):
        feature_net.to_network_input(images)
    for stray in (1.002, -0.002):  # past the slack of 1e-3
        images[0, 14, 14] = stray
        with pytest.raises(ValueError, match=r"float images must lie in \[0, 1\]"):
            feature_net.to_network_input(images)
    for stray, clipped in ((1.0005, 1.0), (-0.0005, 0.0)):  # within it: taken, and clipped
        images[0, 14, 14] = stray
        pixels = feature_net.to_network_input(images)
        assert pixels.dtype == np.float32 and pixels[0, 14, 14, 0] == clipped


def test_missing_weights_name_the_training_script(tmp_path):
    with pytest.raises(CheckpointError, match="do not exist; create them with python scripts/train_feature_net.py"):
        feature_net.load_feature_net(tmp_path / "absent.npz")


@pytest.mark.parametrize("content", [b"", b"not a zip archive", b"PK\x03\x04truncated"])
def test_corrupt_weights_name_the_training_script(tmp_path, content):
    path = tmp_path / "corrupt.npz"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="unreadable .*python scripts/train_feature_net.py") as error:
        feature_net.load_feature_net(path)
    assert "\n" not in str(error.value)


def test_a_fifo_as_weights_file_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO blocks until a writer comes, so the load runs in a child: a regression
    fails at the timeout instead of hanging the suite."""
    fifo = tmp_path / "weights.npz"
    os.mkfifo(fifo)
    script = textwrap.dedent("""
        import sys
        from common import feature_net
        try:
            feature_net.load_feature_net(sys.argv[1])
        except feature_net.CheckpointError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script, str(fifo)], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"feature net weights file {fifo} is not a regular file; "
                             "remove it and recreate it with python scripts/train_feature_net.py\n")


def test_truncated_weights_file_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "truncated.npz"
    path.write_bytes(feature_net.DEFAULT_WEIGHTS.read_bytes()[:100_000])
    with pytest.raises(CheckpointError, match="python scripts/train_feature_net.py"):
        feature_net.load_feature_net(path)


def test_weights_of_another_architecture_are_a_checkpoint_error(tmp_path):
    from scripts.train_feature_net import MnistFeatureNet, state_to_arrays

    arrays = state_to_arrays(MnistFeatureNet())
    arrays["fc1.weight"] = arrays["fc1.weight"][:64]
    del arrays["fc2.bias"]
    path = tmp_path / "other.npz"
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match="do not fit the network.*fc2.bias missing.*fc1.weight has shape"):
        feature_net.load_feature_net(path)


def test_weights_with_one_nan_entry_are_a_checkpoint_error(tmp_path):
    """(mutation round 9: the finiteness check as any() for all(), which loaded weights with
    one NaN entry, went unseen)"""
    with np.load(feature_net.DEFAULT_WEIGHTS) as committed:
        arrays = dict(committed)
    arrays["conv2.weight"][3, 5, 2, 2] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match="do not fit the network.*conv2.weight is not finite"):
        feature_net.load_feature_net(path)


def test_pickled_arrays_are_refused(tmp_path):
    path = tmp_path / "pickled.npz"
    np.savez(path, **{"conv1.weight": np.array([object()], dtype=object)})
    with pytest.raises(CheckpointError, match="unreadable"):
        feature_net.load_feature_net(path)


def test_weights_file_format_is_the_pytorch_state_dict():
    from scripts.train_feature_net import MnistFeatureNet, state_to_arrays

    arrays = state_to_arrays(MnistFeatureNet())
    assert {name: array.shape for name, array in arrays.items()} == feature_net.WEIGHT_SHAPES
    assert list(arrays) == list(feature_net.WEIGHT_SHAPES)


def test_numpy_forward_pass_equals_the_pytorch_net(test_images):
    """Also the layout check: flattening (H, W, C) instead of PyTorch's (C, H, W), flipping a
    kernel (convolution instead of PyTorch's cross-correlation) or swapping its kh and kw all
    move the features far beyond this tolerance (each was tried on purpose)."""
    import torch

    from scripts.train_feature_net import MnistFeatureNet, network_input_tensor

    images = test_images.x[:500]
    torch_net = MnistFeatureNet()
    with np.load(feature_net.DEFAULT_WEIGHTS) as archive:
        torch_net.load_state_dict({name: torch.from_numpy(archive[name]) for name in feature_net.WEIGHT_SHAPES})
    with torch.no_grad():
        torch_features = torch_net.eval().features(network_input_tensor(images))
        torch_logits = torch_net.fc2(torch_features)
    features, logits = feature_net.features_and_logits(images)
    np.testing.assert_allclose(features, torch_features.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(logits, torch_logits.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(logits.argmax(axis=1), torch_logits.numpy().argmax(axis=1))
    assert features.std() > 0.5  # real activations, not a degenerate all-zero agreement


def test_scoring_imports_no_deep_learning_framework():
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import common.feature_net
        images = np.random.default_rng(0).integers(0, 256, (8, 28, 28, 1), dtype=np.uint8)
        features, logits = common.feature_net.features_and_logits(images)
        assert features.shape == (8, 128) and logits.shape == (8, 10)
        print(sorted(name for name in ("torch", "tensorflow", "keras") if name in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


TINY = ["--data-limit", "256", "--epochs", "1"]


@pytest.fixture
def training_script(monkeypatch, tmp_path):
    """The script's module, with its committed-weights path pointing into tmp_path; restores the
    thread count that main() sets to one."""
    import torch

    from scripts import train_feature_net

    threads = torch.get_num_threads()
    monkeypatch.setattr(train_feature_net, "DEFAULT_WEIGHTS", tmp_path / "committed.npz")
    yield train_feature_net
    torch.set_num_threads(threads)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_amp_trains_and_tests_in_bfloat16_on_cpu(training_script, amp):
    """The feature layer's output dtype, seen by a hook, in the training steps (grad enabled)
    and in the test pass (no grad): removing either autocast fails this."""
    import torch

    seen = {True: set(), False: set()}

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear) and module.out_features == feature_net.FEATURE_DIM:
            seen[torch.is_grad_enabled()].add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        _, result = training_script.train(training_script.parse_args(TINY + (["--amp"] if amp else [])))
    finally:
        handle.remove()
    expected = torch.bfloat16 if amp else torch.float32
    assert seen == {True: {expected}, False: {expected}}
    assert result["precision"] == ("amp-bf16" if amp else "fp32")


def test_float32_training_is_reproducible(training_script):
    args = training_script.parse_args(["--data-limit", "256", "--epochs", "2"])  # 2: the low-rate epoch too
    first, first_result = training_script.train(args)
    again, again_result = training_script.train(args)
    for (name, array), other in zip(training_script.state_to_arrays(first).items(),
                                    training_script.state_to_arrays(again).values()):
        np.testing.assert_array_equal(array, other, err_msg=name)
    assert first_result["test_accuracy"] == again_result["test_accuracy"]
    assert len(first_result["epoch_seconds"]) == 2 and first_result["peak_memory_mb"] > 0
    assert first_result["gate_accuracy"] is None  # no weights to write: no gate ran


def test_only_the_reproducible_run_writes_the_committed_weights(training_script, tmp_path, monkeypatch):
    committed = training_script.DEFAULT_WEIGHTS
    real_asset = feature_net.DEFAULT_WEIGHTS.read_bytes()
    destination = lambda flags: training_script.weights_destination(training_script.parse_args(flags))
    assert destination([]) == committed
    # each condition alone keeps the committed weights (the runs below all carry --data-limit)
    for flags in (["--amp"], ["--device", "cuda"], ["--test-limit", "10"],
                  ["--result-json", str(tmp_path / "result.json")], ["--data-limit", "10"], ["--seed", "1"],
                  ["--epochs", "5"], ["--batch-size", "64"], ["--lr", "2e-3"], ["--tf32", "off"]):
        assert destination(flags) is None, flags
    assert destination(["--amp", "--out", str(tmp_path / "mine.npz")]) == tmp_path / "mine.npz"
    monkeypatch.setattr(training_script, "MIN_TEST_ACCURACY", 0.0)  # so that only the destination rule stops a write
    for flags in (["--amp"], [], ["--amp", "--amp-dtype", "bfloat16"]):
        training_script.main(TINY + flags)
    assert not committed.exists()
    explicit = tmp_path / "explicit.npz"
    training_script.main(TINY + ["--amp", "--out", str(explicit)])
    feature_net.load_feature_net(explicit)  # a weights file that fits the network
    assert not committed.exists() and feature_net.DEFAULT_WEIGHTS.read_bytes() == real_asset


def test_the_accuracy_gate_still_guards_an_explicit_out(training_script, tmp_path, capsys):
    explicit = tmp_path / "explicit.npz"
    with pytest.raises(SystemExit) as exit_info:
        training_script.main(TINY + ["--out", str(explicit)])
    assert exit_info.value.code == 1 and not explicit.exists()
    assert "on all 10,000 test images is below 0.99; weights not saved" in capsys.readouterr().err
    # ...on every test image, whatever --test-limit: one image right of a net 22% accurate passed it
    one_right = TINY + ["--test-limit", "1", "--out", str(explicit)]
    with pytest.raises(SystemExit) as exit_info:
        training_script.main(one_right)
    assert exit_info.value.code == 1 and not explicit.exists()
    assert "on all 10,000 test images is below 0.99" in capsys.readouterr().err


def test_precisions_print_the_side_by_side_table(training_script, tmp_path, capfd):
    table_path = tmp_path / "table.md"
    training_script.main(TINY + ["--precisions", "fp32", "amp", "--table-out", str(table_path)])
    # each row's run gave advice --precisions refuses (--out), and noted a --tf32 the user never gave
    printed = capfd.readouterr()
    assert "--out" not in printed.out + printed.err and "tf32" not in printed.out + printed.err, printed
    rows = [line.strip("|").split("|") for line in table_path.read_text().splitlines()
            if line.startswith("| ") and "precision" not in line]
    assert [row[0].strip() for row in rows] == ["fp32", "amp-bf16"]
    for _, seconds, memory, accuracy in rows:
        assert float(seconds) > 0 and float(memory) > 0 and 0 <= float(accuracy) <= 1
    assert "avx512_bf16" in table_path.read_text() and not training_script.DEFAULT_WEIGHTS.exists()


def test_a_ctrl_c_to_the_precisions_parent_and_its_child_is_one_line(tmp_path):
    """A terminal's Ctrl-C reaches both: the child's line and then the parent's. The child now
    stops quietly and leaves the one line to the parent."""
    import signal
    import time

    log = tmp_path / "stdout.txt"
    with open(log, "w") as stdout:
        parent = subprocess.Popen([sys.executable, "scripts/train_feature_net.py", "--precisions", "fp32", "amp",
                                   "--data-limit", "256", "--epochs", "100000"],
                                  cwd=REPO, stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "epoch 1/" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(parent.pid, signal.SIGINT)
        _, err = parent.communicate(timeout=60)  # its child's 100,000 epochs would take an hour
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)  # the child too, in the parent's group
            parent.communicate()
    assert parent.returncode == 130, err
    assert err.strip() == "error: interrupted: the table stopped at fp32"
    assert "== amp" not in log.read_text()


def test_gpu_rows_of_the_table_say_whether_float32_used_tf32(training_script):
    """--precisions fp32 fp32-tf32 on a GPU: the two float32 rows differ by TensorFloat-32."""
    measured = dict(device="cuda", machine="GPU", torch="2", epochs=1, train_images=10, batch_size=2,
                    test_images=5, median_epoch_s=1.0, peak_memory_mb=1.0, test_accuracy=0.5)
    table = training_script.markdown([{**measured, "precision": "fp32", "tf32": "off"},
                                      {**measured, "precision": "fp32", "tf32": "on"}])
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:4]] == ["fp32, TF32 off", "fp32, TF32 on"]
    assert "--tf32" in training_script.TABLE_PRECISIONS["fp32-tf32"]
    assert training_script.table_flags("fp32-tf32", "cuda") == ["--tf32", "on"]
    assert training_script.table_flags("amp-bf16", "cpu") == ["--amp", "--amp-dtype", "bfloat16"]


@pytest.mark.parametrize("flags", [["--amp-dtype", "float16"], ["--precisions", "fp32", "--amp"],
                                   ["--table-out", "table.md"], ["--data-limit", "0"], ["--precisions", "fp64"],
                                   ["--device", "tpu"]])
def test_bad_flags_are_one_line_errors(training_script, capsys, flags):
    with pytest.raises(SystemExit) as exit_info:
        training_script.main(flags)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "error:" in error


def test_precisions_refuse_a_tf32_of_their_own_as_they_set_each_rows(training_script, capsys):
    """Each row sets --tf32 (fp32 off, fp32-tf32 on, amp the device's default): a --tf32 given
    was dropped without a word."""
    for tf32 in ("on", "auto"):  # auto too: fp32's row sets it off
        with pytest.raises(SystemExit) as exit_info:
            training_script.main(["--precisions", "fp32", "amp", "--tf32", tf32])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == ("error: --precisions sets the precision of each run and keeps no weights: "
                                           "drop --tf32\n")


def test_a_precision_named_twice_is_refused_before_any_run(training_script, capsys):
    """Each precision is one run and one row: `--precisions fp32 fp32` trained twice and printed
    two rows of one precision (a fresh-user review)."""
    with pytest.raises(SystemExit) as exit_info:
        training_script.main(["--precisions", "fp32", "amp", "fp32"])
    assert exit_info.value.code == 2
    said = "error: --precisions names fp32 more than once: it would be measured and tabled twice\n"
    assert capsys.readouterr().err == said
    # two names of one precision on a CPU: two identical rows; two such pairs are named apart
    for given, names, runs_as in ((["amp", "amp-bf16"], ["amp", "amp-bf16"], "amp-bf16"),
                                  (["fp32-tf32", "fp32"], ["fp32-tf32", "fp32"], "fp32"),
                                  (["amp", "fp32", "amp-bf16", "fp32-tf32"], ["amp", "amp-bf16"], "amp-bf16")):
        with pytest.raises(SystemExit) as exit_info:
            training_script.main(["--precisions", *given, "--device", "cpu"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (f"error: --precisions {names[0]} and {names[1]} are one precision here "
                                           f"({runs_as}): it would be measured and tabled twice\n")


def test_precisions_that_differ_on_a_gpu_are_all_taken_there(training_script):
    """On a GPU amp is float16 (not amp-bf16's bfloat16) and fp32-tf32 computes in TensorFloat-32
    (not fp32's full float32): four runs, four rows, none refused as one precision named twice."""
    given = ["amp", "amp-bf16", "fp32", "fp32-tf32"]
    assert training_script.parse_args(["--precisions", *given, "--device", "cuda"]).precisions == given


def test_the_weights_file_records_the_accuracy_of_the_gate_on_every_test_image(training_script, tmp_path,
                                                                                monkeypatch):
    """Under --test-limit the weights file's recorded accuracy is the gate's, on all 10,000 test
    images, not that of the few images the epochs were tested on."""
    monkeypatch.setattr(training_script, "MIN_TEST_ACCURACY", 0.0)  # so that these weights are written
    weights, result = tmp_path / "weights.npz", tmp_path / "result.json"
    training_script.main(TINY + ["--test-limit", "3", "--out", str(weights), "--result-json", str(result)])
    measured = json.loads(result.read_text())
    assert measured["test_images"] == 3 and measured["gate_accuracy"] not in (0, 1 / 3, 2 / 3, 1)
    with np.load(weights) as arrays:
        assert float(arrays["meta_test_accuracy"]) == measured["gate_accuracy"]


@pytest.mark.parametrize("flags", [["--result-json", "{weights}", "--out", "{weights}"],
                                   ["--result-json", "{committed}"],
                                   ["--result-json", "{committed}", "--out", "{weights}"],
                                   ["--precisions", "fp32", "--table-out", "{committed}"]])
def test_a_measurements_file_that_names_a_weights_file_is_refused(training_script, capsys, tmp_path, monkeypatch,
                                                                  flags):
    """The JSON or table is written whatever the accuracy gate decides: named as the weights
    (--out's, or the committed file, given relative to the working folder), it would replace them."""
    committed = training_script.DEFAULT_WEIGHTS
    committed.write_bytes(b"the committed weights")
    monkeypatch.chdir(tmp_path)
    flags = [flag.format(weights="net.npz", committed=committed.name) for flag in flags]
    with pytest.raises(SystemExit) as exit_info:
        training_script.main(TINY + flags)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is a weights file" in error
    assert committed.read_bytes() == b"the committed weights" and not (tmp_path / "net.npz").exists()
