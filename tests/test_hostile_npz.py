"""Every .npz this repository reads (datasets, TensorFlow checkpoints, --init-from weights files,
the feature net's weights, amp_gradients.py --weights) checks each array's header against the
bytes its zip member holds before numpy allocates what the header claims. A header that claims
petabytes ends in one line naming the array, not in a MemoryError."""
import io
import zipfile

import numpy as np
import pytest

from common.data import npy_header
from common.errors import CheckpointError

PETABYTES = 10**13  # rows the lying header claims: far past any machine's memory


def claim_petabytes(path, key):
    """Rewrite `key`'s member of the .npz at `path` so its header claims PETABYTES rows of its
    rows' shape, its data unchanged."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    name = f"{key}.npy"
    member = io.BytesIO(members[name])
    shape, fortran, dtype = npy_header(member)
    data = members[name][member.tell():]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": fortran, "shape": (PETABYTES, *shape)})
    members[name] = header.getvalue() + data
    with zipfile.ZipFile(path, "w") as archive:
        for member_name, content in members.items():
            archive.writestr(member_name, content)


def checkpoint_error_line(read, path) -> str:
    """The CheckpointError `read(path)` raises, checked to be one line."""
    with pytest.raises(CheckpointError) as error:
        read(path)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_weights_file_whose_header_lies_is_one_line(tmp_path):
    from common import porting

    path = tmp_path / "weights.npz"
    porting.save_weights(path, {"generator": [("dense", [np.ones((3, 2), np.float32), np.zeros(2, np.float32)])]},
                         {"model": "gan"})
    assert porting.load_weights(path)[0]["generator"][0][0] == "dense"  # the file as written reads
    claim_petabytes(path, "layers/generator/000/0")
    message = checkpoint_error_line(porting.load_weights, path)
    assert "layers/generator/000/0 claims float32(10000000000000, 3, 2)" in message and "but holds 24" in message


def test_feature_net_weights_whose_header_lies_are_one_line(tmp_path):
    from common import feature_net

    path = tmp_path / "feature_net.npz"
    path.write_bytes(feature_net.DEFAULT_WEIGHTS.read_bytes())
    claim_petabytes(path, "fc2.bias")
    message = checkpoint_error_line(feature_net.load_feature_net, path)
    assert "fc2.bias claims float32(10000000000000," in message and "scripts/train_feature_net.py" in message


def test_a_tensorflow_checkpoint_whose_header_lies_is_one_line(tmp_path, capsys):
    """Resuming from it, and amp_gradients.py --weights reading its networks."""
    from GAN.vanilla_gan import gan_pytorch, gan_tensorflow
    from scripts import amp_gradients

    run = tmp_path / "run"
    flags = ["--out", str(run), "--batch-size", "8", "--width", "8", "--data-limit", "64",
             "--no-tensorboard", "--sample-every", "0"]
    gan_tensorflow.main([*flags, "--iters", "2"])
    checkpoint = run / "checkpoints" / "step_000002.npz"
    with np.load(checkpoint) as stored:
        key = next(k for k in stored.files if k.startswith("module/generator/"))
    claim_petabytes(checkpoint, key)

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        gan_tensorflow.main([*flags, "--iters", "4", "--resume"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1 and f"{key} claims float32(10000000000000," in err and "\n" not in err, err

    networks = gan_pytorch.build_networks((1, 28, 28), 8)
    with pytest.raises(CheckpointError, match=f"{key} claims float32"):
        amp_gradients.load_checkpoint_weights(checkpoint, "tensorflow", gan_tensorflow, networks, (28, 28, 1), 8)


def test_a_file_that_is_not_an_archive_gets_no_advice_to_allow_pickles(tmp_path):
    """numpy takes a file that is neither .npy nor zip for a pickle and suggests allow_pickle:
    not advice to pass on about a file that should hold weights."""
    from common import porting

    path = tmp_path / "config.json"
    path.write_text('{"model": "vanilla_gan"}')
    message = checkpoint_error_line(porting.load_weights, path)
    assert "it is not a zip archive" in message and "pickle" not in message
    np.savez(tmp_path / "prefixed.npz", a=np.zeros(3))  # zipfile reads past bytes in front; numpy does not
    (tmp_path / "prefixed.npz").write_bytes(b"junk1234" + (tmp_path / "prefixed.npz").read_bytes())
    message = checkpoint_error_line(porting.load_weights, tmp_path / "prefixed.npz")
    assert "it is not a zip archive" in message and "pickle" not in message
    np.save(tmp_path / "one.npy", np.zeros(3))
    assert "it is a single .npy array" in checkpoint_error_line(porting.load_weights, tmp_path / "one.npy")
