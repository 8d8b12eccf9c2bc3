"""Quality metrics for the generative models, in numpy alone so that PyTorch and TensorFlow
samples are judged by the same code (no SciPy, no framework).

    Frechet distance / FID      feature_statistics, frechet_distance, fid
    precision and recall        precision_recall (Kynkaanniemi et al. 2019, k-NN balls)
    class coverage              class_coverage (predicted labels of a classifier)
    2-D mixtures                mixture_quality, mixture_quality_for (VEEGAN / PacGAN protocol)
    VAE bounds                  log_normal_diag, log_standard_normal, log_bernoulli_logits, elbo, iwae_bound

The features fed to FID and precision/recall come from the MNIST classifier in
common/feature_net.py, not Inception (which cannot be downloaded here), so the numbers are
comparable within this repository only.
"""

from __future__ import annotations

import math

import numpy as np

LOG_2PI = math.log(2.0 * math.pi)
DISTANCE_CHUNK_ROWS = 1_000  # at most; fewer against more than 10,000 columns:
DISTANCE_CHUNK_VALUES = 10_000_000  # 80 MB of float64 distances at a time, whatever the sample count
ZERO_DISTANCE_TOLERANCE = 1e-12  # squared distances below this share of |a|^2 + |b|^2 are rounding, not distance
MIXTURE_QUALITY_SDS = 3.0  # VEEGAN / PacGAN: high quality = within 3 standard deviations of a mean


# ---------------------------------------------------------------------------------------------
# Frechet distance


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and covariance (D, D) of features (N, D) in float64: the Gaussian that the
    Frechet distance compares."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"features must be (N, D) with N >= 2, got shape {features.shape}")
    return features.mean(axis=0), np.atleast_2d(np.cov(features, rowvar=False))


def _symmetric_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix; rounding can leave tiny
    negative eigenvalues, which are taken as 0 rather than turned into NaN."""
    eigenvalues, eigenvectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))) @ eigenvectors.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """Frechet (2-Wasserstein) distance between N(mu1, sigma1) and N(mu2, sigma2):
    |mu1 - mu2|^2 + Tr S1 + Tr S2 - 2 Tr (S1 S2)^(1/2). Never negative; finite for singular
    covariances (fewer samples than feature dimensions)."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    dims = len(mu1)
    if mu1.shape != (dims,) or mu2.shape != (dims,) or sigma1.shape != (dims, dims) or sigma2.shape != (dims, dims):
        raise ValueError(f"shapes do not match: mu {mu1.shape} {mu2.shape}, sigma {sigma1.shape} {sigma2.shape}")
    # S1 S2 = A (A S2 A) A^-1 with A = S1^(1/2), so Tr (S1 S2)^(1/2) = Tr (A S2 A)^(1/2); A S2 A is
    # symmetric PSD, so eigvalsh is accurate where a general matrix square root of S1 S2 (as
    # scipy.linalg.sqrtm) can return complex parts or fail on near-singular covariances.
    sqrt_sigma1 = _symmetric_sqrt(sigma1)
    product = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    trace_sqrt_product = np.sqrt(np.clip(np.linalg.eigvalsh((product + product.T) / 2), 0.0, None)).sum()
    mean_difference = mu1 - mu2
    distance = mean_difference @ mean_difference + np.trace(sigma1) + np.trace(sigma2) - 2.0 * trace_sqrt_product
    return float(max(distance, 0.0))  # equal distributions can round to -1e-12


def fid(features_a: np.ndarray, features_b: np.ndarray) -> float:
    """Frechet distance between the Gaussians fitted to two feature sets (N, D) and (M, D)."""
    return frechet_distance(*feature_statistics(features_a), *feature_statistics(features_b))


# ---------------------------------------------------------------------------------------------
# Precision and recall (Kynkaanniemi et al. 2019, "Improved precision and recall metric")


def _squared_distances(rows: np.ndarray, columns: np.ndarray, columns_squared_norms: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances (len(rows), len(columns)) by |a|^2 + |b|^2 - 2 a.b (a matrix
    product, so 10,000 x 10,000 takes seconds)."""
    norms_sum = (rows * rows).sum(axis=1)[:, None] + columns_squared_norms[None, :]
    squared = rows @ columns.T
    squared *= -2.0  # in place: a chunk holds two (rows, columns) arrays at a time, not four
    squared += norms_sum
    # The expansion rounds a zero distance to about +-1e-16 |a|^2, and differently in differently
    # shaped chunks; values that small are duplicates and become exactly 0, so a point always lies
    # inside the zero-radius ball of its copy (and no distance is negative).
    norms_sum *= ZERO_DISTANCE_TOLERANCE
    squared[squared <= norms_sum] = 0.0
    return squared


def rows_per_chunk(most: int, columns: int) -> int:
    """Rows of distances to `columns` points computed at a time: at most `most`, and few
    enough for DISTANCE_CHUNK_VALUES (a chunk and its temporaries hold about three times that)."""
    return max(1, min(most, DISTANCE_CHUNK_VALUES // max(columns, 1)))


def _squared_knn_radii(points: np.ndarray, k: int, chunk_rows: int) -> np.ndarray:
    """Squared distance from each point to its k-th nearest neighbour in its own set; the
    point itself (distance 0) is the 0-th neighbour and does not count."""
    squared_norms = (points * points).sum(axis=1)
    radii = np.empty(len(points))
    chunk_rows = rows_per_chunk(chunk_rows, len(points))
    for start in range(0, len(points), chunk_rows):
        distances = _squared_distances(points[start:start + chunk_rows], points, squared_norms)
        radii[start:start + chunk_rows] = np.partition(distances, k, axis=1)[:, k]
    return radii


def _fraction_inside_balls(queries: np.ndarray, centres: np.ndarray, squared_radii: np.ndarray,
                           chunk_rows: int) -> float:
    """Share of queries that lie in at least one ball (centre, radius), boundary included."""
    squared_norms = (centres * centres).sum(axis=1)
    inside = 0
    chunk_rows = rows_per_chunk(chunk_rows, len(centres))
    for start in range(0, len(queries), chunk_rows):
        distances = _squared_distances(queries[start:start + chunk_rows], centres, squared_norms)
        inside += int((distances <= squared_radii[None, :]).any(axis=1).sum())
    return inside / len(queries)


def precision_recall(real_features: np.ndarray, fake_features: np.ndarray, k: int = 3,
                     chunk_rows: int = DISTANCE_CHUNK_ROWS) -> dict[str, float]:
    """Precision (share of fake samples that look real: inside the k-NN ball of some real
    sample) and recall (share of real samples the generator covers: inside the k-NN ball of
    some fake sample). Low precision = bad samples; low recall = missing modes, which FID
    alone mixes together. Distances are computed chunk_rows rows at a time to bound memory."""
    real = np.asarray(real_features, dtype=np.float64)
    fake = np.asarray(fake_features, dtype=np.float64)
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise ValueError(f"features must be (N, D) and (M, D), got {real.shape} and {fake.shape}")
    if k < 1 or min(len(real), len(fake)) <= k:
        raise ValueError(f"k must be at least 1 and below both set sizes, got k={k} with {len(real)} and {len(fake)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    # Distances do not change under a shift, but their rounding does: centring on the real mean
    # keeps the norms at the scale of the spread, not of the offset (ReLU features are all >= 0).
    centre = real.mean(axis=0)
    real, fake = real - centre, fake - centre
    real_radii = _squared_knn_radii(real, k, chunk_rows)
    fake_radii = _squared_knn_radii(fake, k, chunk_rows)
    return {
        "precision": _fraction_inside_balls(fake, real, real_radii, chunk_rows),
        "recall": _fraction_inside_balls(real, fake, fake_radii, chunk_rows),
    }


# ---------------------------------------------------------------------------------------------
# Class coverage (mode collapse on labelled data, as judged by a classifier)


def class_coverage(predictions: np.ndarray, num_classes: int = 10, min_count: int = 1) -> dict:
    """How evenly generated samples spread over the classes, judged by a classifier's
    predictions: labels (N,) or per-class probabilities/logits (N, num_classes), reduced to
    their argmax.

    classes_covered counts classes predicted for at least min_count samples; the default 1
    is the rule of the stacked-MNIST mode counts in VEEGAN and PacGAN. label_entropy (nats)
    is the entropy of the predicted-label histogram, log(num_classes) when uniform;
    kl_to_uniform = log(num_classes) - label_entropy, 0 when uniform.
    """
    predictions = np.asarray(predictions)
    if predictions.ndim == 2:
        if predictions.shape[1] != num_classes:
            raise ValueError(f"expected {num_classes} columns of class scores, got shape {predictions.shape}")
        labels = predictions.argmax(axis=1)
    elif predictions.ndim == 1:
        if not np.issubdtype(predictions.dtype, np.integer):
            raise ValueError(f"1-D predictions must be integer labels, got {predictions.dtype}")
        labels = predictions
    else:
        raise ValueError(f"predictions must be labels (N,) or scores (N, {num_classes}), got shape {predictions.shape}")
    if len(labels) == 0:
        raise ValueError("no predictions")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels must lie in 0..{num_classes - 1}, got {labels.min()}..{labels.max()}")
    counts = np.bincount(labels, minlength=num_classes)
    shares = counts / counts.sum()
    nonzero = shares[shares > 0]
    entropy = float(-(nonzero * np.log(nonzero)).sum())
    return {
        "classes_covered": int((counts >= min_count).sum()),
        "label_entropy": entropy,
        "kl_to_uniform": float(max(math.log(num_classes) - entropy, 0.0)),
        "counts": counts.tolist(),
    }


# ---------------------------------------------------------------------------------------------
# 2-D Gaussian mixtures (VEEGAN, Srivastava et al. 2017; PacGAN, Lin et al. 2018)


def mixture_quality(samples: np.ndarray, means: np.ndarray, sd: float,
                    threshold_sds: float = MIXTURE_QUALITY_SDS) -> dict:
    """Sample quality and mode coverage on a Gaussian mixture: a sample is high quality if it
    lies within threshold_sds * sd (Euclidean) of its nearest mean; a mode is covered if it is
    the nearest mean of at least one high-quality sample. Note that even real data is not
    100% high quality: in 2-D, a share exp(-threshold_sds^2 / 2) (1.1% for 3 sd) lies further out.
    """
    samples = np.asarray(samples, dtype=np.float64)
    means = np.asarray(means, dtype=np.float64)
    if samples.ndim != 2 or means.ndim != 2 or samples.shape[1] != means.shape[1] or len(samples) == 0:
        raise ValueError(f"samples must be (N, D) and means (K, D), got {samples.shape} and {means.shape}")
    distances = np.sqrt(((samples[:, None, :] - means[None, :, :]) ** 2).sum(axis=2))
    nearest = distances.argmin(axis=1)
    high_quality = distances[np.arange(len(samples)), nearest] <= threshold_sds * sd
    return {
        "high_quality_fraction": float(high_quality.mean()),
        "modes_covered": int(np.unique(nearest[high_quality]).size),
        "num_modes": len(means),
    }


def mixture_quality_for(dataset_name: str, samples: np.ndarray) -> dict:
    """mixture_quality with the means and sd of a mixture dataset of common/data.py ("ring8" or
    "grid25"), so the metric always judges against the distribution the model trained on."""
    from common.data import mixture_spec  # imported here: the rest of this module needs numpy only

    means, sd = mixture_spec(dataset_name)
    return mixture_quality(samples, means, sd)


# ---------------------------------------------------------------------------------------------
# VAE: log densities and bounds on log p(x). Densities sum over `axis` (the features) and
# keep every other axis, so they work on (batch, D) and on (k, batch, D) alike.


def log_normal_diag(x: np.ndarray, mean: np.ndarray, logvar: np.ndarray, axis=-1) -> np.ndarray:
    """log N(x; mean, diag(exp(logvar))), e.g. log q(z|x) of a Gaussian encoder."""
    x, mean, logvar = (np.asarray(a, dtype=np.float64) for a in (x, mean, logvar))
    return -0.5 * (LOG_2PI + logvar + (x - mean) ** 2 * np.exp(-logvar)).sum(axis=axis)


def log_standard_normal(z: np.ndarray, axis=-1) -> np.ndarray:
    """log N(z; 0, I), the VAE prior log p(z)."""
    z = np.asarray(z, dtype=np.float64)
    return -0.5 * (LOG_2PI + z**2).sum(axis=axis)


def log_bernoulli_logits(x: np.ndarray, logits: np.ndarray, axis=-1) -> np.ndarray:
    """log Bernoulli(x; sigmoid(logits)), the decoder term log p(x|z) for pixels in [0, 1];
    finite and accurate for any logits, where log(sigmoid(logits)) gives log(0) = -inf."""
    x, logits = np.asarray(x, dtype=np.float64), np.asarray(logits, dtype=np.float64)
    # x log sigmoid(l) + (1 - x) log sigmoid(-l), with log sigmoid(l) = -softplus(-l). The usual
    # x * l - softplus(l) is the same number but rounds a confident right answer, -1e-44, to 0.
    return -(x * _softplus(-logits) + (1.0 - x) * _softplus(logits)).sum(axis=axis)


def _softplus(values: np.ndarray) -> np.ndarray:
    """log(1 + exp(values)) without overflow for large values or loss of digits for very negative ones."""
    return np.maximum(values, 0.0) + np.log1p(np.exp(-np.abs(values)))


def _log_weights(log_px_given_z, log_pz, log_qz_given_x) -> np.ndarray:
    """log p(x, z) - log q(z|x) as (k, batch); 1-D inputs are one sample per example (k = 1)."""
    log_weights = (np.asarray(log_px_given_z, dtype=np.float64) + np.asarray(log_pz, dtype=np.float64)
                   - np.asarray(log_qz_given_x, dtype=np.float64))
    if log_weights.ndim == 1:
        log_weights = log_weights[None, :]
    if log_weights.ndim != 2:
        raise ValueError(f"log densities must be (batch,) or (k, batch), got shape {log_weights.shape}")
    return log_weights


def elbo(log_px_given_z, log_pz, log_qz_given_x) -> np.ndarray:
    """Evidence lower bound per example, E_q[log p(x|z) + log p(z) - log q(z|x)], estimated by
    the mean over the k samples of z (axis 0 of (k, batch) arrays; 1-D arrays mean k = 1)."""
    return _log_weights(log_px_given_z, log_pz, log_qz_given_x).mean(axis=0)


def iwae_bound(log_px_given_z, log_pz, log_qz_given_x) -> np.ndarray:
    """Importance-weighted bound per example (Burda et al. 2016), log (1/k) sum_k p(x, z_k) /
    q(z_k|x) for (k, batch) arrays: tighter than the ELBO as k grows, equal to it for k = 1."""
    log_weights = _log_weights(log_px_given_z, log_pz, log_qz_given_x)
    # Subtract the largest weight before exponentiating: the weights are log densities of
    # hundreds of pixels (around -100 nats), whose exp underflows to 0.
    largest = log_weights.max(axis=0)
    return largest + np.log(np.exp(log_weights - largest).mean(axis=0))
