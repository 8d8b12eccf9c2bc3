"""Fixed noise, image grids and 2-D scatter plots (numpy + matplotlib, no framework).

The fixed noise is drawn from a seeded numpy generator and saved in the run folder, so every
sample grid of a run, and the grids of the PyTorch and TensorFlow twins, come from the same z.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common.data import npy_claims  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.runs import atomic_write  # noqa: E402

NOISE_STREAM = 7  # keeps the fixed noise independent of other numpy streams drawn from --seed
GRID_IMAGES = 64  # an 8x8 grid of images


def noise_file_shape(path: Path) -> tuple:
    """The shape of a fixed_noise.npy, from its header, after checking that the file is a
    regular one holding float32 rows and exactly the bytes its header claims (a damaged header
    may claim terabytes). One UserError line otherwise."""
    if not path.is_file():  # a FIFO would block the read forever
        raise UserError(f"{path} is not a regular file; remove it to draw the noise again")
    try:
        with open(path, "rb") as file:
            shape, dtype, declared, held = npy_claims(file, path.stat().st_size)
    except (OSError, ValueError) as error:
        raise UserError(f"{path} is unreadable ({error}); delete it to draw it again") from None
    if dtype != np.float32 or len(shape) != 2:
        raise UserError(f"{path} holds {dtype}{shape}, not the float32 rows a run writes; delete it to draw "
                        "it again")
    if declared != held:
        raise UserError(f"{path} holds {held:,} bytes but its header claims {dtype}{shape}: not the "
                        "float32 rows a run writes; delete it to draw it again")
    return shape


def check_fixed_noise(run_dir: Path, count: int, dim: int) -> None:
    """Before a resumed run trains: its noise file is sound and holds (count, dim) rows (its
    grids come after steps)."""
    path = Path(run_dir) / "fixed_noise.npy"
    if path.exists() or path.is_symlink():
        shape = noise_file_shape(path)
        if shape != (count, dim):
            raise UserError(f"{path} holds float32{shape}, expected float32({count}, {dim}); "
                            "delete it or use another --out")


def fixed_noise(run_dir: Path, count: int, dim: int, seed: int) -> np.ndarray:
    """The run's fixed N(0, I) noise: read from fixed_noise.npy, or drawn and saved there."""
    path = Path(run_dir) / "fixed_noise.npy"
    if path.exists():
        check_fixed_noise(run_dir, count, dim)
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise UserError(f"{path} is unreadable ({error}); delete it to draw it again") from None
    noise = np.random.default_rng([seed, NOISE_STREAM]).standard_normal((count, dim))
    noise = noise.astype(np.float32)
    atomic_write(path, lambda file: np.save(file, noise))
    return noise


def image_grid(images: np.ndarray, columns: int = 8, pad: int = 2) -> np.ndarray:
    """Tile NHWC images with values in [0, 1] into one (H', W', C) array on a white ground."""
    count, height, width, channels = images.shape
    rows = -(-count // columns)
    grid = np.ones((rows * (height + pad) + pad, columns * (width + pad) + pad, channels),
                   dtype=np.float32)
    for index, image in enumerate(images):
        top = pad + (index // columns) * (height + pad)
        left = pad + (index % columns) * (width + pad)
        grid[top:top + height, left:left + width] = image
    return grid


def to_unit_range(images: np.ndarray, value_range) -> np.ndarray:
    """Images with values in `value_range` (the model's hparams.PIXEL_RANGE) mapped to [0, 1]."""
    low, high = value_range
    return (np.asarray(images, dtype=np.float32) - low) / (high - low)


def save_image_grid(images: np.ndarray, path: Path, value_range=(-1.0, 1.0),
                    columns: int = 8) -> None:
    """Save NHWC images (values in `value_range`) as one PNG grid."""
    unit = np.clip(to_unit_range(images, value_range), 0.0, 1.0)
    grid = image_grid(unit, columns=columns)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if grid.shape[-1] == 1:
        atomic_write(path, lambda file: plt.imsave(file, grid[..., 0], cmap="gray", vmin=0.0, vmax=1.0, format="png"),
                     durable=False)
    else:
        atomic_write(path, lambda file: plt.imsave(file, grid, format="png"), durable=False)


def save_scatter(samples: np.ndarray, path: Path, real: np.ndarray | None = None,
                 title: str = "") -> None:
    """Generated 2-D points over (a sample of) the real ones."""
    figure, axes = plt.subplots(figsize=(4, 4), dpi=100)
    if real is not None:
        axes.scatter(real[:, 0], real[:, 1], s=2, c="tab:gray", alpha=0.3, label="real")
    axes.scatter(samples[:, 0], samples[:, 1], s=2, c="tab:red", alpha=0.6, label="generated")
    axes.set_aspect("equal")
    axes.set_title(title, fontsize=9)
    axes.legend(loc="upper right", fontsize=7, markerscale=4)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    atomic_write(path, lambda file: figure.savefig(file, format="png"), durable=False)
    plt.close(figure)


def reconstruction_rows(originals: np.ndarray, reconstructions: np.ndarray, columns: int = 8,
                        blank: float = 1.0) -> np.ndarray:
    """Interleave two NHWC batches row by row for a grid of `columns`: a row of originals,
    then a row of their reconstructions underneath, and so on. A short last row is padded
    with `blank` images (white once the grid is scaled to [0, 1])."""
    originals = np.asarray(originals, dtype=np.float32)
    reconstructions = np.asarray(reconstructions, dtype=np.float32)
    if originals.shape != reconstructions.shape or originals.ndim != 4:
        raise ValueError(f"originals {originals.shape} and reconstructions "
                         f"{reconstructions.shape} must be NHWC batches of one shape")
    count = originals.shape[0]
    rows = -(-count // columns)
    padding = rows * columns - count
    pairs = []
    for batch in (originals, reconstructions):
        batch = np.concatenate([batch, np.full((padding, *batch.shape[1:]), blank, np.float32)])
        pairs.append(batch.reshape(rows, columns, *batch.shape[1:]))
    return np.stack(pairs, axis=1).reshape(2 * rows * columns, *originals.shape[1:])


def save_reconstruction_grid(originals: np.ndarray, reconstructions: np.ndarray, path: Path,
                             value_range=(-1.0, 1.0), columns: int = 8) -> None:
    """Save originals and their reconstructions (NHWC, values in `value_range`) as one PNG
    grid whose rows alternate: originals, their reconstructions, the next originals, ..."""
    images = reconstruction_rows(originals, reconstructions, columns, blank=value_range[1])
    save_image_grid(images, path, value_range=value_range, columns=columns)
