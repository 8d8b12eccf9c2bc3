"""Every metric against a case whose answer is known in closed form or by construction."""

import math

import numpy as np
import pytest

from common import data as datasets
from common import metrics


def random_rotation(dims: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((dims, dims)))
    return q * np.sign(np.diag(r))


# ---------------------------------------------------------------------------------------------
# Frechet distance


def test_feature_statistics_are_the_float64_mean_and_sample_covariance():
    features = np.array([[1.0, 2.0], [3.0, 0.0], [5.0, 4.0]], dtype=np.float32)
    mean, covariance = metrics.feature_statistics(features)
    assert mean.dtype == covariance.dtype == np.float64
    np.testing.assert_allclose(mean, [3.0, 2.0])
    # by hand: deviations (-2, 0), (0, -2), (2, 2); sum of outer products / (N - 1)
    np.testing.assert_allclose(covariance, [[4.0, 2.0], [2.0, 4.0]])


def test_identical_feature_sets_have_zero_fid():
    features = np.random.default_rng(0).standard_normal((500, 16)) @ np.random.default_rng(1).standard_normal((16, 16))
    _, covariance = metrics.feature_statistics(features)
    assert metrics.fid(features, features) < 1e-6 * np.trace(covariance)


def test_diagonal_gaussians_match_the_closed_form():
    mu1, mu2 = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.5])
    a, b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()  # 1 + 6.25 + 4 + 1 = 12.25
    assert expected == pytest.approx(12.25)
    assert metrics.frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(12.25, rel=1e-12)


def test_commuting_non_diagonal_covariances_match_the_closed_form():
    # S1 and S2 share eigenvectors Q, so Tr (S1 S2)^(1/2) = sum sqrt(a_i b_i).
    rng = np.random.default_rng(2)
    rotation = random_rotation(6, rng)
    a, b = rng.uniform(0.1, 3.0, 6), rng.uniform(0.1, 3.0, 6)
    sigma1, sigma2 = rotation @ np.diag(a) @ rotation.T, rotation @ np.diag(b) @ rotation.T
    mu1, mu2 = rng.standard_normal(6), rng.standard_normal(6)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    assert metrics.frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(expected, rel=1e-10)


def test_non_commuting_2x2_matches_the_trace_of_a_2x2_square_root():
    # For a 2x2 matrix M with non-negative eigenvalues, Tr M^(1/2) = sqrt(Tr M + 2 sqrt(det M)):
    # (sqrt(l1) + sqrt(l2))^2 = l1 + l2 + 2 sqrt(l1 l2). No eigendecomposition involved.
    sigma1 = np.array([[2.0, 0.8], [0.8, 1.0]])
    sigma2 = np.array([[1.0, -0.3], [-0.3, 0.5]])
    product = sigma1 @ sigma2
    trace_sqrt = math.sqrt(np.trace(product) + 2.0 * math.sqrt(np.linalg.det(product)))
    expected = np.trace(sigma1) + np.trace(sigma2) - 2.0 * trace_sqrt
    zero = np.zeros(2)
    assert metrics.frechet_distance(zero, sigma1, zero, sigma2) == pytest.approx(expected, rel=1e-10)


def test_non_commuting_covariances_match_the_eigenvalues_of_the_product():
    # Tr (S1 S2)^(1/2) is the sum of the square roots of the (real, positive) eigenvalues of the
    # non-symmetric product S1 S2, computed here with the general eigenvalue solver instead.
    rng = np.random.default_rng(3)
    x1, x2 = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
    sigma1, sigma2 = x1 @ x1.T + 0.1 * np.eye(8), x2 @ x2.T + 0.1 * np.eye(8)
    mu1, mu2 = rng.standard_normal(8), rng.standard_normal(8)
    eigenvalues = np.linalg.eigvals(sigma1 @ sigma2)
    assert np.abs(eigenvalues.imag).max() < 1e-8 and eigenvalues.real.min() > 0
    expected = ((mu1 - mu2) ** 2).sum() + np.trace(sigma1) + np.trace(sigma2) - 2 * np.sqrt(eigenvalues.real).sum()
    assert metrics.frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_is_symmetric():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((200, 5)), 2.0 * rng.standard_normal((300, 5)) + 1.0
    assert metrics.fid(a, b) == pytest.approx(metrics.fid(b, a), rel=1e-10)
    assert metrics.fid(a, b) > 1.0


def test_rank_deficient_features_give_a_finite_distance():
    # 20 samples in 64 dimensions, plus a constant column: both covariances are singular.
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((20, 64)), rng.standard_normal((20, 64)) + 0.5
    a[:, 0] = b[:, 0] = 3.0
    distance = metrics.fid(a, b)
    assert np.isfinite(distance) and distance > 0
    assert metrics.fid(a, a) < 1e-6 * np.trace(metrics.feature_statistics(a)[1])


def test_frechet_distance_of_equal_distributions_is_never_negative():
    # The distance of a set to itself is 0 up to rounding, which lands below 0 (about -1e-8 for
    # these badly scaled features) for about half of these seeds unless the result is clipped.
    for seed in range(20):
        rng = np.random.default_rng(seed)
        features = rng.standard_normal((300, 64)) * rng.uniform(0.1, 100.0, 64)
        assert metrics.fid(features, features) >= 0.0


# ---------------------------------------------------------------------------------------------
# Precision and recall


def four_clusters(points_per_cluster: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Points around 4 centres 100 apart, with cluster spread 1: no k-NN ball reaches another cluster."""
    centres = 100.0 * np.eye(4, 3)
    labels = np.repeat(np.arange(4), points_per_cluster)
    return centres[labels] + rng.standard_normal((len(labels), 3)), labels


def test_identical_sets_have_precision_and_recall_one():
    real, _ = four_clusters(50, np.random.default_rng(6))
    assert metrics.precision_recall(real, real.copy()) == {"precision": 1.0, "recall": 1.0}


def test_far_away_fakes_have_precision_and_recall_zero():
    real, _ = four_clusters(50, np.random.default_rng(7))
    assert metrics.precision_recall(real, real + 1000.0) == {"precision": 0.0, "recall": 0.0}


def test_fakes_covering_half_the_modes_have_recall_one_half_and_precision_one():
    # The fakes are exactly the real points of clusters 0 and 1: each lies at distance 0 from a
    # real point (precision 1); real points of clusters 0 and 1 are at distance 0 from a fake,
    # those of clusters 2 and 3 are 100 away from every fake (recall exactly 1/2).
    real, labels = four_clusters(50, np.random.default_rng(8))
    fake = real[labels < 2]
    assert metrics.precision_recall(real, fake) == {"precision": 1.0, "recall": 0.5}


def test_the_k_th_neighbour_excludes_the_point_itself():
    # Real points 0, 1, ..., 9 on a line: every k=1 radius is 1; the k=3 radii are 3 at the ends
    # (0 and 9) and 2 inside. Fakes: 4.5 (0.5 from a real point: inside every ball), -1.5 and
    # 11.5 (1.5 and 2.5 from an end: inside its k=3 ball only), 20 (outside every ball).
    # Counting the point itself as its first neighbour would give 0 for k=1 and 0.5 for k=3.
    real = np.arange(10.0)[:, None]
    fake = np.array([[4.5], [-1.5], [11.5], [20.0]])
    assert metrics.precision_recall(real, fake, k=3)["precision"] == 0.75
    assert metrics.precision_recall(real, fake, k=1)["precision"] == 0.25


def test_a_point_on_a_ball_boundary_is_inside():
    # Real 0..9, k=3: the ball of 0 has radius exactly 3, so the fake at -3 is inside (the
    # paper's <=) and the fake at -3.5 is not; 20, 30, 40 are outside every ball.
    real = np.arange(10.0)[:, None]
    fake = np.array([[-3.0], [-3.5], [20.0], [30.0], [40.0]])
    assert metrics.precision_recall(real, fake, k=3)["precision"] == 0.2


def test_recall_uses_the_balls_of_the_fake_points():
    # Fakes 0, 10.5, 20, 30 have k=1 radii 10.5, 9.5, 9.5, 10: the ball of 0 holds every real
    # point 0..9 (recall 1) although the real radii are all 1. Only the fake at 0 is within a real
    # ball (10.5 is 1.5 from 9): precision 1/4.
    real = np.arange(10.0)[:, None]
    fake = np.array([[0.0], [10.5], [20.0], [30.0]])
    assert metrics.precision_recall(real, fake, k=1) == {"precision": 0.25, "recall": 1.0}


def test_duplicated_points_far_from_the_origin_stay_inside_their_balls():
    # With every point present twice, the 1st neighbour is a duplicate: radius 0. The expansion
    # |a|^2 + |b|^2 - 2 a.b of a zero distance rounds to about +-1e-6 at norms of 1e4 (+-1e-14 after
    # centring), differently in differently shaped chunks, so unless such values are taken as 0
    # a few percent of the points fall outside the zero-radius ball of their own copy.
    rng = np.random.default_rng(15)
    points = np.repeat(1e4 + rng.standard_normal((40, 16)), 2, axis=0)
    shuffled = points[rng.permutation(len(points))]
    assert metrics.precision_recall(points, shuffled, k=1, chunk_rows=7) == {"precision": 1.0, "recall": 1.0}


def test_a_far_offset_does_not_change_the_answer():
    # 1e6 from the origin |a|^2 = 4e12 and the expansion's rounding is about 1e-3, close to the
    # squared distances themselves (about 8) unless the points are centred first.
    rng = np.random.default_rng(16)
    real, fake = rng.standard_normal((60, 4)), 1.5 * rng.standard_normal((50, 4)) + 1.0
    near = metrics.precision_recall(real, fake)
    assert 0.0 < near["precision"] < 1.0 and 0.0 < near["recall"] < 1.0
    assert metrics.precision_recall(real + 1e6, fake + 1e6) == near


def test_chunked_distances_give_the_same_result_as_one_block():
    rng = np.random.default_rng(9)
    real, fake = rng.standard_normal((157, 8)), rng.standard_normal((133, 8)) * 1.3 + 0.2
    whole = metrics.precision_recall(real, fake, k=3, chunk_rows=10_000)
    assert 0.0 < whole["precision"] < 1.0 and 0.0 < whole["recall"] < 1.0
    assert metrics.precision_recall(real, fake, k=3, chunk_rows=7) == whole
    assert metrics.precision_recall(real, fake, k=3, chunk_rows=1) == whole


def test_a_distance_chunk_holds_a_bounded_number_of_values_whatever_the_sample_count(monkeypatch):
    """Chunks were DISTANCE_CHUNK_ROWS rows of every sample's distance: memory grew with the
    count (200 MiB at 8,000 samples against 1,000 real ones, 26 GB per chunk at --evaluate's
    former limit of 1,000,000)."""
    shapes = []
    original = metrics._squared_distances

    def recorded(rows, columns, norms):
        shapes.append((len(rows), len(columns)))
        return original(rows, columns, norms)

    monkeypatch.setattr(metrics, "_squared_distances", recorded)
    monkeypatch.setattr(metrics, "DISTANCE_CHUNK_VALUES", 5_000)
    rng = np.random.default_rng(3)
    real, fake = rng.standard_normal((300, 4)), rng.standard_normal((2_000, 4))
    bounded = metrics.precision_recall(real, fake, k=3)
    assert max(rows * columns for rows, columns in shapes) <= 5_000
    assert {columns for _, columns in shapes} == {300, 2_000}  # every pass, each set as the columns
    monkeypatch.setattr(metrics, "DISTANCE_CHUNK_VALUES", 10**9)
    assert metrics.precision_recall(real, fake, k=3) == bounded


def test_precision_recall_rejects_k_not_below_the_set_size():
    with pytest.raises(ValueError, match="k must be"):
        metrics.precision_recall(np.zeros((3, 2)), np.zeros((10, 2)), k=3)


# ---------------------------------------------------------------------------------------------
# Class coverage


def test_a_single_predicted_class_covers_one_class():
    coverage = metrics.class_coverage(np.full(100, 7))
    assert coverage["classes_covered"] == 1
    assert coverage["label_entropy"] == 0.0
    assert coverage["kl_to_uniform"] == pytest.approx(math.log(10))


def test_uniform_predictions_cover_every_class():
    coverage = metrics.class_coverage(np.tile(np.arange(10), 30))
    assert coverage["classes_covered"] == 10
    assert coverage["label_entropy"] == pytest.approx(math.log(10))
    assert coverage["kl_to_uniform"] == pytest.approx(0.0, abs=1e-12)


def test_scores_are_reduced_to_their_argmax():
    # Two classes, half the samples each: entropy log 2; the rows are logits, not labels.
    logits = np.zeros((4, 10))
    logits[[0, 1], 3] = 5.0
    logits[[2, 3], 8] = 2.0
    coverage = metrics.class_coverage(logits)
    assert coverage["classes_covered"] == 2
    assert coverage["counts"] == [0, 0, 0, 2, 0, 0, 0, 0, 2, 0]
    assert coverage["label_entropy"] == pytest.approx(math.log(2))
    assert coverage["kl_to_uniform"] == pytest.approx(math.log(10) - math.log(2))


def test_min_count_ignores_classes_predicted_only_rarely():
    labels = np.concatenate([np.zeros(98, dtype=int), [1, 2]])
    assert metrics.class_coverage(labels)["classes_covered"] == 3
    assert metrics.class_coverage(labels, min_count=5)["classes_covered"] == 1


def test_class_coverage_rejects_labels_out_of_range():
    with pytest.raises(ValueError, match="0..9"):
        metrics.class_coverage(np.array([0, 10]))


# ---------------------------------------------------------------------------------------------
# 2-D mixtures


def test_samples_at_the_ring_means_cover_all_modes_with_full_quality():
    means, sd = datasets.mixture_spec("ring8")
    result = metrics.mixture_quality(np.repeat(means, 3, axis=0), means, sd)
    assert result == {"high_quality_fraction": 1.0, "modes_covered": 8, "num_modes": 8}


def test_a_generator_emitting_one_mode_covers_one_mode():
    means, sd = datasets.mixture_spec("grid25")
    samples = means[12] + sd * np.random.default_rng(10).standard_normal((2500, 2))
    result = metrics.mixture_quality(samples, means, sd)
    assert result["modes_covered"] == 1 and result["num_modes"] == 25


def test_points_far_from_every_mean_have_zero_quality():
    means, sd = datasets.mixture_spec("ring8")
    samples = np.zeros((100, 2))  # the ring's centre is 1 = 100 sd away from every mean
    assert metrics.mixture_quality(samples, means, sd) == {
        "high_quality_fraction": 0.0, "modes_covered": 0, "num_modes": 8}


def test_the_threshold_is_three_sd_of_euclidean_distance():
    means, sd = datasets.mixture_spec("ring8")
    inside = means[0] + np.array([[0.0, 2.99 * sd]])
    outside = means[1] + np.array([[3.01 * sd, 0.0]])
    result = metrics.mixture_quality(np.vstack([inside, outside]), means, sd)
    assert result == {"high_quality_fraction": 0.5, "modes_covered": 1, "num_modes": 8}


@pytest.mark.parametrize("name, modes", [("ring8", 8), ("grid25", 25)])
def test_real_mixture_data_is_high_quality_and_covers_every_mode(name, modes):
    # The distance of a 2-D Gaussian sample from its mean is Rayleigh(sd): a share exp(-9/2) = 1.1%
    # lies beyond 3 sd, so real data scores 0.989, not 1. The binomial sd over 10,000 points is 0.001.
    real = datasets.load_dataset(name, split="test")
    result = metrics.mixture_quality_for(name, real.x)
    assert result["modes_covered"] == result["num_modes"] == modes
    assert result["high_quality_fraction"] == pytest.approx(1 - math.exp(-4.5), abs=0.004)


# ---------------------------------------------------------------------------------------------
# VAE log densities and bounds


def test_log_normal_diag_matches_the_univariate_density():
    x, mean, logvar = np.array([0.3, -1.0]), np.array([0.0, 1.0]), np.array([0.0, math.log(4.0)])
    by_hand = sum(math.log(math.exp(-0.5 * (xi - m) ** 2 / v) / math.sqrt(2 * math.pi * v))
                  for xi, m, v in zip(x, mean, [1.0, 4.0]))
    assert metrics.log_normal_diag(x, mean, logvar) == pytest.approx(by_hand, rel=1e-12)


def test_log_standard_normal_sums_over_the_last_axis():
    z = np.random.default_rng(11).standard_normal((5, 3, 4))
    log_pz = metrics.log_standard_normal(z)
    assert log_pz.shape == (5, 3)
    np.testing.assert_allclose(log_pz, metrics.log_normal_diag(z, np.zeros(4), np.zeros(4)), rtol=1e-12)
    assert metrics.log_standard_normal(np.zeros(2)) == pytest.approx(-math.log(2 * math.pi))


def test_log_bernoulli_logits_matches_the_direct_formula():
    rng = np.random.default_rng(12)
    x, logits = rng.uniform(0, 1, (6, 20)), rng.uniform(-5, 5, (6, 20))
    probs = 1 / (1 + np.exp(-logits))
    direct = (x * np.log(probs) + (1 - x) * np.log(1 - probs)).sum(axis=1)
    np.testing.assert_allclose(metrics.log_bernoulli_logits(x, logits), direct, rtol=1e-12)


def test_log_bernoulli_logits_is_stable_at_extreme_logits():
    x, logits = np.array([1.0, 0.0, 1.0, 0.0]), np.array([100.0, -100.0, -100.0, 100.0])
    terms = [metrics.log_bernoulli_logits(x[i:i + 1], logits[i:i + 1]) for i in range(4)]
    # confident and right: log sigmoid(100) = -log1p(e^-100) ~ -3.7e-44; confident and wrong: -100
    assert terms[0] == pytest.approx(-math.exp(-100), rel=1e-12, abs=0) and terms[1] == terms[0]
    assert terms[2] == pytest.approx(-100.0, rel=1e-12) and terms[3] == terms[2]
    assert np.isfinite(metrics.log_bernoulli_logits(np.full(5, 0.5), np.array([-1e4, -100, 0, 100, 1e4])))


def test_iwae_with_one_sample_equals_the_elbo():
    rng = np.random.default_rng(13)
    log_px, log_pz, log_qz = rng.normal(-100, 5, (1, 7)), rng.normal(-3, 1, (1, 7)), rng.normal(-2, 1, (1, 7))
    expected = (log_px + log_pz - log_qz)[0]
    np.testing.assert_allclose(metrics.elbo(log_px, log_pz, log_qz), expected, rtol=1e-14)
    np.testing.assert_allclose(metrics.iwae_bound(log_px, log_pz, log_qz), expected, rtol=1e-14)
    np.testing.assert_allclose(metrics.iwae_bound(log_px[0], log_pz[0], log_qz[0]), expected, rtol=1e-14)


def test_iwae_of_identical_weights_equals_them():
    log_weights = np.tile(np.array([-1000.0, -95.5, 3.0]), (50, 1))  # exp(-1000) underflows to 0 without the shift
    zeros = np.zeros_like(log_weights)
    np.testing.assert_allclose(metrics.iwae_bound(log_weights, zeros, zeros), [-1000.0, -95.5, 3.0], rtol=1e-14)


def test_iwae_is_at_least_the_elbo():
    rng = np.random.default_rng(14)
    log_px, log_pz, log_qz = rng.normal(-100, 5, (16, 40)), rng.normal(-3, 1, (16, 40)), rng.normal(-2, 1, (16, 40))
    iwae, elbo = metrics.iwae_bound(log_px, log_pz, log_qz), metrics.elbo(log_px, log_pz, log_qz)
    assert np.all(iwae >= elbo) and np.all(iwae - elbo > 0.01)  # weights differ, so Jensen's gap is strict


def test_iwae_matches_a_hand_logsumexp():
    # k = 2, one example: log((e^-1 + e^-3) / 2) with log p(x|z) = [-1, -3], log p(z) = log q = 0.
    log_px = np.array([[-1.0], [-3.0]])
    zeros = np.zeros_like(log_px)
    expected = math.log((math.exp(-1) + math.exp(-3)) / 2)
    assert metrics.iwae_bound(log_px, zeros, zeros)[0] == pytest.approx(expected, rel=1e-14)
    assert metrics.elbo(log_px, zeros, zeros)[0] == pytest.approx(-2.0)


def test_feature_statistics_refuse_a_single_row():
    """One sample has no sample covariance: np.cov gives NaN, and the FID would be NaN."""
    with pytest.raises(ValueError, match="N >= 2"):
        metrics.feature_statistics(np.ones((1, 3)))
