"""The committed MNIST feature net: it classifies, its features are stable, its numpy forward
pass is the PyTorch net it was trained as, it imports no framework, and a bad weights file is a
one-line CheckpointError."""

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


def test_uint8_and_unit_range_floats_give_the_same_features(test_images):
    images = test_images.x[:50]
    from_uint8, _ = feature_net.features_and_logits(images)
    from_float, _ = feature_net.features_and_logits(datasets.to_unit_range(images))
    np.testing.assert_array_equal(from_uint8, from_float)


def test_tanh_range_and_wrong_shapes_are_refused(test_images):
    with pytest.raises(ValueError, match=r"\(x \+ 1\) / 2"):
        feature_net.features_and_logits(datasets.to_tanh_range(test_images.x[:10]))
    with pytest.raises(ValueError, match="28, 28, 1"):
        feature_net.features_and_logits(np.zeros((4, 32, 32, 1), dtype=np.uint8))


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
