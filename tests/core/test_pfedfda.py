"""pFedFDA's mathematics against closed forms, brute force and the spec's thresholds (T1-T8).

T1 LDA head = Gaussian posterior; T2 estimators; T3 PD repair; T4 Theorem-1 bias/variance by
Monte Carlo; T5 beta selection; T6 server aggregation; T7 a tiny federated run written with
plain torch (no Flower); T8 Table 8's parameter counts. Plus options, bad input and fallbacks.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flwr_pfl.core import pfedfda as P
from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.data.synthetic.pfedfda import (
    affine_shift_federation,
    bias_variance_problem,
    sample_client_means,
    shifted_gaussian_client,
)

NO_REG = P.CovRegularization(ridge=0.0, const_add=0.0, pd_repair=False)


def _spd(rng: np.random.Generator, d: int, jitter: float = 0.5) -> np.ndarray:
    a = rng.standard_normal((d, d))
    return a @ a.T + jitter * np.eye(d)


def _gaussian_posterior(z: np.ndarray, means: np.ndarray, cov: np.ndarray, priors: np.ndarray) -> np.ndarray:
    """Eq. 3 from full Gaussian densities (normalizers included), float64."""
    d = z.shape[1]
    inv = np.linalg.inv(cov)
    _, logdet = np.linalg.slogdet(cov)
    diff = z[:, None, :] - means[None, :, :]
    maha = np.einsum("ncd,de,nce->nc", diff, inv, diff)
    log_joint = -0.5 * maha - 0.5 * logdet - 0.5 * d * math.log(2 * math.pi) + np.log(priors)
    log_joint -= log_joint.max(axis=1, keepdims=True)
    post = np.exp(log_joint)
    return post / post.sum(axis=1, keepdims=True)


# ------------------------------------------------------------------------------------------
# T1: the LDA head is the exact Gaussian posterior (Eq. 3-4)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("solve", ["lstsq", "inverse"])
def test_t1_lda_head_equals_gaussian_posterior(solve: str) -> None:
    rng = np.random.default_rng(0)
    d, c = 8, 5
    means = rng.standard_normal((c, d))
    cov = _spd(rng, d)
    priors = rng.dirichlet(np.ones(c))
    z = rng.standard_normal((200, d)) * 2.0
    w, b = P.lda_head(torch.tensor(means), torch.tensor(cov), torch.tensor(priors), shrinkage=0.0, solve=solve)
    posterior = torch.softmax(P.lda_logits(torch.tensor(z), w, b), dim=1).numpy()
    assert np.abs(posterior - _gaussian_posterior(z, means, cov, priors)).max() < 1e-6


def test_t1_identity_cov_uniform_prior_is_nearest_mean() -> None:
    rng = np.random.default_rng(1)
    d, c = 8, 5
    means = rng.standard_normal((c, d))
    z = rng.standard_normal((500, d))
    w, b = P.lda_head(means, np.eye(d), np.full(c, 1.0 / c), shrinkage=0.0)
    predicted = P.lda_logits(z, w, b).argmax(1).numpy()
    nearest = np.linalg.norm(z[:, None, :] - means[None], axis=2).argmin(1)
    assert np.array_equal(predicted, nearest)


@pytest.mark.parametrize("seed", range(8))
def test_t1_shrinkage_changes_posterior_little(seed: int) -> None:
    """eps = 1e-4 shrinkage vs the exact posterior, on features drawn from the model itself.

    The effect scales with eps tr(Sigma)/d / lambda_min(Sigma): with A ~ N(0, 1/d) entries
    (condition number 5-8) the largest posterior change is below the spec's 1e-3; with
    A ~ N(0, 1) (condition number 30-55) it reaches 1.9e-3 at worst, so there the largest is
    held to 3e-3. Measured over seeds 0-39 (0-7 in brackets): largest change 1.2e-4..3.0e-4
    [1.3e-4..3.0e-4] and 6.6e-4..1.86e-3 [8.6e-4..1.86e-3]; mean change up to 9.9e-6 [7.0e-6] and
    1.04e-4 [8.7e-5]. The mean bounds were 1e-5 and 1e-4: 1.15x above seeds 0-7, and seed 22
    exceeds the second (1.04e-4); they are 2e-5 and 2e-4, about 2x above the 40-seed maximum.
    """
    d, c = 8, 5
    for scale, max_tol, mean_tol in [(d**-0.5, 1e-3, 2e-5), (1.0, 3e-3, 2e-4)]:
        rng = np.random.default_rng(seed)
        means, a = rng.standard_normal((c, d)), rng.standard_normal((d, d)) * scale
        cov, priors = a @ a.T + 0.5 * np.eye(d), rng.dirichlet(np.ones(c))
        labels = rng.choice(c, size=2000, p=priors)
        z = means[labels] + rng.standard_normal((2000, d)) @ np.linalg.cholesky(cov).T
        w, b = P.lda_head(torch.tensor(means), torch.tensor(cov), torch.tensor(priors), shrinkage=1e-4)
        posterior = torch.softmax(P.lda_logits(torch.tensor(z), w, b), dim=1).numpy()
        change = np.abs(posterior - _gaussian_posterior(z, means, cov, priors))
        assert change.max() < max_tol and change.mean() < mean_tol, (scale, change.max(), change.mean())
        # Exactly the code's head: Sigma~ = (1 - eps) Sigma + eps tr(Sigma)/d I, b with unshrunk means.
        shrunk = (1 - 1e-4) * cov + 1e-4 * np.trace(cov) / d * np.eye(d)
        w_ref = np.linalg.solve(shrunk, means.T).T
        assert np.allclose(w.numpy(), w_ref, atol=1e-10)
        assert np.allclose(b.numpy(), -0.5 * (means * w_ref).sum(1) + np.log(priors), atol=1e-10)


def test_t1_lda_head_is_differentiable() -> None:
    rng = np.random.default_rng(3)
    means = torch.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    a = torch.tensor(_spd(rng, 4), requires_grad=True)
    priors = torch.tensor(rng.dirichlet(np.ones(3)))
    z = torch.tensor(rng.standard_normal((6, 4)))

    def f(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        w, b = P.lda_head(m, 0.5 * (s + s.T), priors)
        return P.lda_logits(z, w, b)

    assert torch.autograd.gradcheck(f, (means, a))


def test_label_priors_smoothing_and_absent_class() -> None:
    labels = np.array([0, 0, 0, 1])
    pi = P.label_priors(labels, 3, eps=1e-4).double().numpy()
    raw = np.array([0.75, 0.25, 0.0]) + 1e-4
    assert np.allclose(pi, raw / raw.sum(), atol=1e-7)
    assert abs(math.log(pi[2]) - math.log(1e-4)) < 1e-3  # log-prior ~ -9.2 for an absent class
    assert np.allclose(P.label_priors(labels, 3, eps=0.0).numpy(), [0.75, 0.25, 0.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"means": np.zeros((3, 4)), "cov": np.eye(5), "priors": np.full(3, 1 / 3)}, "cov must have shape"),
        ({"means": np.zeros((3, 4)), "cov": np.eye(4), "priors": np.full(2, 0.5)}, "priors must have shape"),
        ({"means": np.zeros((3, 4)), "cov": np.eye(4), "priors": np.array([0.5, 0.5, 0.5])}, "sum to 1"),
        ({"means": np.full((3, 4), np.nan), "cov": np.eye(4), "priors": np.full(3, 1 / 3)}, "NaN"),
        ({"means": np.zeros((3, 4)), "cov": np.eye(4), "priors": np.full(3, 1 / 3), "shrinkage": 1.0}, "lda_shrinkage"),
        ({"means": np.zeros((3, 4)), "cov": np.eye(4), "priors": np.full(3, 1 / 3), "solve": "chol"}, "solve"),
    ],
)
def test_lda_head_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        P.lda_head(**kwargs)


def test_labels_are_validated() -> None:
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        P.label_priors(np.array([0, 3]), 3)
    with pytest.raises(ValueError, match="integer"):
        P.label_priors(np.array([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match="2 feature rows but 3 labels"):
        P.class_moments(np.zeros((2, 4)), np.array([0, 1, 1]), 3)


# ------------------------------------------------------------------------------------------
# T2: estimators (Eq. 6-8)
# ------------------------------------------------------------------------------------------


def test_t2_estimators_on_hand_made_data() -> None:
    z = np.array([[1.0, 2.0], [3.0, 2.0], [2.0, 5.0], [0.0, 0.0], [2.0, 2.0], [4.0, 0.0], [2.0, -2.0]])
    y = np.array([0, 0, 0, 1, 1, 1, 1])
    mu_g = np.array([[9.0, 9.0], [8.0, 8.0], [-1.0, 7.0]])
    means, cov = P.estimate_statistics(z, y, mu_g, min_class_count=2, regularization=NO_REG)
    # Class 0: mean (2, 3); class 1: mean (2, 0); class 2 absent -> mu_g.
    assert np.allclose(means.numpy(), [[2.0, 3.0], [2.0, 0.0], [-1.0, 7.0]])
    centered = np.array([[-1, -1], [1, -1], [0, 2], [-2, 0], [0, 2], [2, 0], [0, -2]], dtype=float)
    assert np.allclose(cov.numpy(), centered.T @ centered / 6)  # / (N - 1), Eq. 7
    assert np.allclose(cov.numpy(), [[10 / 6, 0.0], [0.0, 14 / 6]])


def test_t2_class_below_threshold_takes_global_mean_and_is_centered_on_it() -> None:
    z = np.array([[1.0, 0.0], [3.0, 0.0], [5.0, 1.0], [0.0, 4.0], [2.0, 6.0]])
    y = np.array([0, 0, 0, 1, 1])  # class 1 has 2 rows: not more than 2
    mu_g = np.array([[0.0, 0.0], [1.0, 1.0]])
    means, cov = P.estimate_statistics(z, y, mu_g, min_class_count=2, regularization=NO_REG)
    assert np.allclose(means.numpy(), [[3.0, 1 / 3], [1.0, 1.0]])
    centered = z - means.numpy()[y]  # class 1 rows centered on mu_g^1 (spec §9.11)
    assert np.allclose(cov.numpy(), centered.T @ centered / 4)
    # min_class_count = 0 (the code's training path): any present class gets its own mean.
    means0, cov0 = P.estimate_statistics(z, y, mu_g, min_class_count=0, regularization=NO_REG)
    assert np.allclose(means0.numpy()[1], [1.0, 5.0])
    centered0 = z - means0.numpy()[y]
    assert np.allclose(cov0.numpy(), centered0.T @ centered0 / 4)


def test_t2_regularization_variants() -> None:
    rng = np.random.default_rng(4)
    z = rng.standard_normal((30, 5))
    y = rng.integers(0, 3, 30)
    mu_g = np.zeros((3, 5))
    _, raw = P.estimate_statistics(z, y, mu_g, regularization=NO_REG)
    _, official = P.estimate_statistics(z, y, mu_g, regularization=P.CovRegularization.official())
    _, paper = P.estimate_statistics(z, y, mu_g, regularization=P.CovRegularization.paper())
    assert np.allclose(official.numpy(), raw.numpy() + 1e-4 + np.eye(5), atol=1e-12)
    assert np.allclose(paper.numpy(), raw.numpy() + 1e-4 * np.eye(5), atol=1e-12)


def test_t2_merged_batches_equal_one_pass() -> None:
    rng = np.random.default_rng(5)
    z = torch.tensor(rng.standard_normal((97, 6)) * 3 + 1)
    y = torch.tensor(rng.integers(0, 4, 97))
    y[:20] = 0  # the first batch holds class 0 only
    whole = P.class_moments(z, y, 5)  # class 4 absent everywhere
    merged = P.class_moments(z[:20], y[:20], 5)
    for start, stop in [(20, 21), (21, 60), (60, 97)]:
        merged = P.merge_class_moments(merged, P.class_moments(z[start:stop], y[start:stop], 5))
    assert torch.equal(merged.counts, whole.counts)
    assert torch.allclose(merged.means, whole.means, atol=1e-12)
    assert torch.allclose(merged.scatter, whole.scatter, atol=1e-10)


def test_t2_float32_covariance_is_accurate_for_offset_features() -> None:
    """Two-pass centering: a large common offset does not cancel away float32 precision."""
    rng = np.random.default_rng(6)
    z = rng.standard_normal((2000, 8)) + 1e4
    y = rng.integers(0, 4, 2000)
    mu_g = np.zeros((4, 8))
    _, cov32 = P.estimate_statistics(z.astype(np.float32), y, mu_g.astype(np.float32), regularization=NO_REG)
    _, cov64 = P.estimate_statistics(z, y, mu_g, regularization=NO_REG)
    assert np.abs(cov32.double().numpy() - cov64.numpy()).max() < 1e-2


def test_t2_estimator_rejects_fewer_than_two_rows() -> None:
    with pytest.raises(ValueError, match="at least 2 feature rows"):
        P.estimate_statistics(np.ones((1, 3)), np.array([0]), np.zeros((2, 3)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_t2_statistics_and_head_on_cuda() -> None:
    rng = np.random.default_rng(7)
    z = torch.tensor(rng.standard_normal((64, 8)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, 64))
    mu_g, cov_g = torch.zeros(3, 8), torch.eye(8)
    cpu = P.personalize(z, y, mu_g, cov_g)
    gpu = P.personalize(z.cuda(), y.cuda(), mu_g, cov_g)
    assert gpu.weight.device.type == "cuda"
    assert torch.allclose(gpu.means.cpu(), cpu.means, atol=1e-4)
    assert torch.allclose(gpu.weight.cpu(), cpu.weight, atol=1e-3)


# ------------------------------------------------------------------------------------------
# T3: PD repair (nearest PD matrix with identical variances)
# ------------------------------------------------------------------------------------------


def _reference_clipped_repair(cov: np.ndarray, threshold: float = 1e-15) -> np.ndarray:
    std = np.sqrt(np.diag(cov))
    corr = cov / np.outer(std, std)
    evals, evecs = np.linalg.eigh(corr)
    if not (evals < threshold).any():
        return cov
    x = (evecs * np.maximum(evals, threshold)) @ evecs.T
    x = x / np.sqrt(np.outer(np.diag(x), np.diag(x)))
    return x * np.outer(std, std)


def test_t3_repair_makes_psd_and_keeps_the_diagonal() -> None:
    rng = np.random.default_rng(8)
    v = rng.standard_normal((6, 6))
    cov = v @ np.diag([3.0, 2.0, 1.0, 0.5, -0.4, -1.0]) @ v.T
    cov += np.diag(np.abs(np.diag(cov)) + 0.1)  # positive variances, still indefinite
    assert np.linalg.eigvalsh(cov)[0] < 0
    for dtype in (torch.float64, torch.float32):
        repaired = P.nearest_pd_same_variance(torch.tensor(cov, dtype=dtype)).double().numpy()
        assert np.linalg.eigvalsh(repaired)[0] >= -1e-10 * (1 if dtype == torch.float64 else 1e4)
        assert np.allclose(np.diag(repaired), np.diag(cov), rtol=1e-12 if dtype == torch.float64 else 1e-6)
        assert np.allclose(repaired, repaired.T)
    repaired = P.nearest_pd_same_variance(torch.tensor(cov)).numpy()
    assert np.allclose(repaired, _reference_clipped_repair(cov), atol=1e-10)


def test_t3_pd_input_comes_back_unchanged() -> None:
    cov = torch.tensor(_spd(np.random.default_rng(9), 6))
    assert torch.equal(P.nearest_pd_same_variance(cov), cov)
    # With the official +I ridge the repair is always a no-op.
    z = torch.tensor(np.random.default_rng(10).standard_normal((4, 6)))  # N < d: singular scatter
    _, on = P.estimate_statistics(z, torch.tensor([0, 0, 1, 1]), torch.zeros(2, 6), min_class_count=0)
    _, off = P.estimate_statistics(
        z, torch.tensor([0, 0, 1, 1]), torch.zeros(2, 6), min_class_count=0,
        regularization=P.CovRegularization(pd_repair=False),
    )
    assert torch.equal(on, off)


def test_t3_paper_regularization_repairs_low_sample_covariance() -> None:
    """N << d: the scatter is singular; eps I plus the repair gives a PD matrix."""
    rng = np.random.default_rng(11)
    z = rng.standard_normal((5, 20)).astype(np.float32)
    _, cov = P.estimate_statistics(
        z, np.array([0, 0, 0, 1, 1]), np.zeros((2, 20), np.float32), min_class_count=0,
        regularization=P.CovRegularization.paper(),
    )
    assert np.linalg.eigvalsh(cov.double().numpy())[0] > 0


@pytest.mark.parametrize(
    ("cov", "match"),
    [
        (np.array([[1.0, 0.5], [0.4, 1.0]]), "symmetric"),
        (np.array([[1.0, 0.0], [0.0, 0.0]]), "non-positive variance at index 1"),
        (np.array([[1.0, np.nan], [np.nan, 1.0]]), "NaN"),
        (np.ones((2, 3)), "square"),
    ],
)
def test_t3_repair_rejects_bad_input(cov: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        P.nearest_pd_same_variance(cov)


# ------------------------------------------------------------------------------------------
# Interpolation (Alg. 1 lines 10-11)
# ------------------------------------------------------------------------------------------


def test_nearest_psd_clips_negative_eigenvalues_of_the_symmetric_part() -> None:
    """Closed form: in the eigenbasis R of a rotation, diag(-1, 2) becomes diag(0, 2); an
    asymmetric input is first replaced by its symmetric part; a PSD input comes back as it is
    (bit for bit once symmetric); dtype is kept; the result is the nearest PSD matrix (every
    other PSD candidate tried is farther in the Frobenius norm)."""
    c, s = math.cos(0.3), math.sin(0.3)
    rot = np.array([[c, -s], [s, c]])
    indefinite = rot @ np.diag([-1.0, 2.0]) @ rot.T
    out = P.nearest_psd(indefinite.astype(np.float32))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, rot @ np.diag([0.0, 2.0]) @ rot.T, atol=1e-6)
    pd = np.array([[2.0, 0.5], [0.5, 1.0]])
    assert np.array_equal(P.nearest_psd(pd), pd)
    skew = np.array([[2.0, 0.9], [0.1, 1.0]])
    np.testing.assert_allclose(P.nearest_psd(skew), [[2.0, 0.5], [0.5, 1.0]])
    rng = np.random.default_rng(0)
    best = np.linalg.norm(out - indefinite)
    for _ in range(200):
        a = rng.normal(size=(2, 2))
        assert np.linalg.norm(a @ a.T - indefinite) >= best - 1e-9
    for bad, match in ((np.ones((2, 3)), "square"), (np.array([[np.nan, 0.0], [0.0, 1.0]]), "NaN")):
        with pytest.raises(ValueError, match=match):
            P.nearest_psd(bad)


def test_interpolation_is_convex_and_keeps_absent_classes_global() -> None:
    rng = np.random.default_rng(12)
    mu_g = torch.tensor(rng.standard_normal((3, 4)))
    cov_g = torch.tensor(_spd(rng, 4))
    z = torch.tensor(rng.standard_normal((20, 4)))
    y = torch.tensor([0] * 10 + [1] * 10)  # class 2 absent
    mu_hat, cov_hat = P.estimate_statistics(z, y, mu_g)
    for beta_mu, beta_sigma in [(0.0, 0.0), (0.3, 0.8), (1.0, 1.0)]:
        mu, cov = P.interpolate_statistics(mu_hat, cov_hat, mu_g, cov_g, beta_mu, beta_sigma)
        assert torch.allclose(mu, beta_mu * mu_hat + (1 - beta_mu) * mu_g)
        assert torch.allclose(cov, beta_sigma * cov_hat + (1 - beta_sigma) * cov_g)
        assert torch.equal(mu[2], mu_g[2])
        assert torch.linalg.eigvalsh(cov)[0] > 0
    with pytest.raises(ValueError, match="beta_mu must be <= 1"):
        P.interpolate_statistics(mu_hat, cov_hat, mu_g, cov_g, 1.5)
    with pytest.raises(ValueError, match="shapes do not agree"):
        P.interpolate_statistics(mu_hat, cov_hat, mu_g[:2], cov_g, 0.5)


# ------------------------------------------------------------------------------------------
# Cross-validation and the beta objective (Eq. 9)
# ------------------------------------------------------------------------------------------


def test_stratified_kfold_balances_each_class() -> None:
    rng = np.random.default_rng(13)
    y = rng.integers(0, 5, 101)
    y[y == 4] = 3
    y[:3] = 4  # a class of 3 rows
    folds = P.stratified_kfold(y, k=3, seed=0)
    for c in np.unique(y):
        per_fold = np.bincount(folds[y == c], minlength=3)
        assert per_fold.max() - per_fold.min() <= 1
    assert np.array_equal(folds, P.stratified_kfold(y, k=3, seed=0))
    assert not np.array_equal(folds, P.stratified_kfold(y, k=3, seed=1))
    with pytest.raises(P.CVInfeasible, match="greater than the number of samples"):
        P.stratified_kfold(np.array([0]), k=2)
    with pytest.raises(P.CVInfeasible, match="every class"):
        P.stratified_kfold(np.array([0, 1, 2]), k=2)
    with pytest.raises(ValueError, match="k_folds must be >= 2"):
        P.stratified_kfold(y, k=1)


def test_cv_folds_drop_small_classes_and_match_the_estimator() -> None:
    rng = np.random.default_rng(14)
    z = torch.tensor(rng.standard_normal((41, 3)))
    y = torch.tensor([0] * 20 + [1] * 20 + [2])  # class 2 has one row: dropped from the folds
    mu_g = torch.tensor(rng.standard_normal((3, 3)))
    folds = P.build_cv_folds(z, y, mu_g, k_folds=2, seed=0)
    assert sum(len(f.val_labels) for f in folds) == 40
    assert all(2 not in f.val_labels.tolist() for f in folds)
    fold_of = torch.as_tensor(P.stratified_kfold(y[:40], 2, 0))
    for j, fold in enumerate(folds):
        means, cov = P.estimate_statistics(z[:40][fold_of != j], y[:40][fold_of != j], mu_g)
        assert torch.allclose(fold.means, means) and torch.allclose(fold.cov, cov)
        assert torch.equal(fold.means[2], mu_g[2])


def test_cv_objective_matches_composition_and_its_gradient() -> None:
    cl = shifted_gaussian_client(10, 1.0, seed=3)
    z, y = torch.tensor(cl.train_features, dtype=torch.float64), torch.tensor(cl.train_labels)
    mu_g, cov_g = torch.tensor(cl.global_means, dtype=torch.float64), torch.eye(16, dtype=torch.float64)
    pi = P.label_priors(y, 4).double()
    folds = P.build_cv_folds(z, y, mu_g)
    expected = 0.0
    for fold in folds:
        mu, cov = P.interpolate_statistics(fold.means, fold.cov, mu_g, cov_g, 0.3, 0.6)
        w, b = P.lda_head(mu, cov, pi)
        expected += float(F.cross_entropy(P.lda_logits(fold.val_features, w, b), fold.val_labels))
    assert abs(float(P.cv_objective(0.3, 0.6, folds, mu_g, cov_g, pi)) - expected) < 1e-10
    beta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    P.cv_objective(beta, beta, folds, mu_g, cov_g, pi).backward()
    h = 1e-5
    numeric = (
        float(P.cv_objective(0.4 + h, 0.4 + h, folds, mu_g, cov_g, pi))
        - float(P.cv_objective(0.4 - h, 0.4 - h, folds, mu_g, cov_g, pi))
    ) / (2 * h)
    assert abs(float(beta.grad) - numeric) < 1e-6


def _client_tensors(cl) -> tuple[torch.Tensor, ...]:
    z, y = torch.tensor(cl.train_features), torch.tensor(cl.train_labels)
    return z, y, torch.tensor(cl.global_means), torch.tensor(cl.global_cov), P.label_priors(y, 4)


def test_bounded_single_beta_matches_brute_force_grid() -> None:
    for seed, (n, delta) in enumerate([(25, 1.5), (25, 0.0), (250, 1.5)]):
        z, y, mu_g, cov_g, pi = _client_tensors(shifted_gaussian_client(n, delta, seed=seed))
        config = P.PFedFDAConfig(beta=P.BetaSearch(solver=P.BetaSolver.GOLDEN))
        result = P.solve_beta(z, y, mu_g, cov_g, pi, config=config)
        assert result.status is P.BetaStatus.OPTIMIZED and result.beta_mu == result.beta_sigma
        folds = P.build_cv_folds(z, y, mu_g)
        grid = np.linspace(0, 1, 501)
        values = [float(P.cv_objective(b, b, folds, mu_g, cov_g, pi)) for b in grid]
        assert result.objective <= min(values) + 1e-5
        assert abs(result.beta_mu - grid[int(np.argmin(values))]) <= 0.01


def test_multi_beta_bounded_search_reaches_the_grid_minimum_and_lbfgs_descends() -> None:
    z, y, mu_g, cov_g, pi = _client_tensors(shifted_gaussian_client(25, 1.5, seed=21))
    folds = P.build_cv_folds(z, y, mu_g)
    grid = np.linspace(0, 1, 21)
    best = min(float(P.cv_objective(a, b, folds, mu_g, cov_g, pi)) for a in grid for b in grid)
    start = float(P.cv_objective(0.5, 0.5, folds, mu_g, cov_g, pi))
    results = {}
    for solver in P.BetaSolver:
        config = P.PFedFDAConfig(beta=P.BetaSearch(mode=P.BetaMode.MULTI, solver=solver))
        result = P.solve_beta(z, y, mu_g, cov_g, pi, config=config)
        assert result.status is P.BetaStatus.OPTIMIZED
        assert 0 <= result.beta_mu <= 1 and 0 <= result.beta_sigma <= 1
        assert result.objective < start
        results[solver] = result
    assert results[P.BetaSolver.GOLDEN].objective <= best + 1e-4
    # The code's unconstrained L-BFGS on the clipped objective can stop on a bound, where the
    # gradient vanishes (spec §9.9): here beta_mu = 1 with an objective above the grid minimum.
    lbfgs = results[P.BetaSolver.LBFGS]
    assert lbfgs.beta_mu == 1.0 and lbfgs.objective > best + 1e-2


def test_lbfgs_agrees_with_bounded_search_on_interior_optimum() -> None:
    z, y, mu_g, cov_g, pi = _client_tensors(shifted_gaussian_client(25, 1.5, seed=2))
    golden = P.solve_beta(z, y, mu_g, cov_g, pi, config=P.PFedFDAConfig(beta=P.BetaSearch(solver="golden")))
    lbfgs = P.solve_beta(z, y, mu_g, cov_g, pi)
    as64 = P.solve_beta(z, y, mu_g, cov_g, pi, config=P.PFedFDAConfig(beta=P.BetaSearch(float64=True)))
    assert 0.05 < golden.beta_mu < 0.95
    assert abs(lbfgs.beta_mu - golden.beta_mu) < 0.02
    assert abs(as64.beta_mu - lbfgs.beta_mu) < 0.02


def test_local_and_fixed_modes_skip_cross_validation() -> None:
    z, y, mu_g, cov_g, pi = _client_tensors(shifted_gaussian_client(5, 1.0, seed=0))
    local = P.solve_beta(z, y, mu_g, cov_g, pi, config=P.PFedFDAConfig(beta=P.BetaSearch(mode="local")))
    assert (local.beta_mu, local.beta_sigma, local.status) == (1.0, 1.0, P.BetaStatus.LOCAL)
    fixed = P.PFedFDAConfig(beta=P.BetaSearch(mode="fixed", fixed_beta=0.0))
    p = P.personalize(z, y, mu_g, cov_g, config=fixed)
    assert p.beta.status is P.BetaStatus.FIXED
    assert torch.equal(p.means, mu_g) and torch.equal(p.cov, cov_g)


# ------------------------------------------------------------------------------------------
# Bad input and fallbacks (spec §3.2-b-5, §9.8)
# ------------------------------------------------------------------------------------------


def test_fewer_samples_than_folds_falls_back_to_global_statistics() -> None:
    mu_g, cov_g = torch.zeros(3, 4), torch.eye(4)
    z = torch.tensor([[1.0, 2.0, 0.0, 0.0], [0.0, 1.0, 3.0, 0.0]])
    y = torch.tensor([0, 1])  # every class has fewer than k = 2 rows
    p = P.personalize(z, y, mu_g, cov_g, previous_beta=0.7)
    assert p.beta.status is P.BetaStatus.CV_INFEASIBLE and p.beta.fallback
    assert (p.beta.beta_mu, p.beta.beta_sigma) == (0.0, 0.0)
    assert "rows remain" in p.beta.reason
    assert torch.equal(p.means, mu_g) and torch.equal(p.cov, cov_g)
    assert p.beta.as_metrics() == {"beta_mu": 0.0, "beta_sigma": 0.0, "beta_fallback": 1.0}


def test_fold_too_small_for_a_covariance_falls_back() -> None:
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    y = torch.tensor([0, 0, 1])  # class 1 dropped; each fold trains on one row
    result = P.solve_beta(z, y, torch.zeros(2, 2), torch.eye(2), torch.tensor([0.5, 0.5]))
    assert result.status is P.BetaStatus.CV_INFEASIBLE and result.beta_mu == 0.0
    assert "training part has 1 rows" in result.reason


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_solver_failure_keeps_the_previous_beta(monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    def broken(objective, size, search, dtype, device):
        if failure == "raises":
            raise torch.linalg.LinAlgError("singular")
        return torch.full((size,), float("nan"), dtype=dtype)

    monkeypatch.setattr("flwr_pfl.core.pfedfda.beta._minimize_lbfgs", broken)
    z, y, mu_g, cov_g, pi = _client_tensors(shifted_gaussian_client(10, 1.0, seed=0))
    config = P.PFedFDAConfig(beta=P.BetaSearch(mode="multi"))
    result = P.solve_beta(z, y, mu_g, cov_g, pi, config=config, previous_beta=(0.3, 0.6))
    assert result.status is P.BetaStatus.SOLVER_FAILED and result.fallback
    assert (result.beta_mu, result.beta_sigma) == (0.3, 0.6)
    p = P.personalize(z, y, mu_g, cov_g, config=config, previous_beta=(0.3, 0.6))
    mu_hat, cov_hat = P.estimate_statistics(z, y, mu_g)
    assert torch.allclose(p.means, 0.3 * mu_hat + 0.7 * mu_g, atol=1e-6)
    assert torch.allclose(p.cov, 0.6 * cov_hat + 0.4 * cov_g, atol=1e-6)


def test_class_absent_on_client() -> None:
    cl = shifted_gaussian_client(30, 1.0, seed=4)
    keep = cl.train_labels != 3
    z, y = torch.tensor(cl.train_features[keep]), torch.tensor(cl.train_labels[keep])
    mu_g = torch.tensor(cl.global_means)
    p = P.personalize(z, y, mu_g, torch.eye(16))
    assert torch.equal(p.means[3], mu_g[3])
    assert math.isclose(float(p.priors[3]), 1e-4 / (1 + 4e-4), rel_tol=1e-5)  # (0/n + eps) normalized
    test = torch.tensor(cl.test_features[cl.test_labels != 3])
    predicted = P.lda_logits(test, p.weight, p.bias).argmax(1)
    assert (predicted == 3).float().mean() < 0.01


def test_personalize_equals_manual_composition() -> None:
    z, y, mu_g, cov_g, pi = _client_tensors(shifted_gaussian_client(25, 1.0, seed=5))
    p = P.personalize(z, y, mu_g, cov_g)
    beta = P.solve_beta(z, y, mu_g, cov_g, pi)
    mu_hat, cov_hat = P.estimate_statistics(z, y, mu_g)
    mu, cov = P.interpolate_statistics(mu_hat, cov_hat, mu_g, cov_g, beta.beta_mu, beta.beta_sigma)
    w, b = P.lda_head(mu, cov, pi)
    assert p.beta == beta
    assert torch.allclose(p.means, mu) and torch.allclose(p.cov, cov)
    assert torch.allclose(p.weight, w, atol=1e-5) and torch.allclose(p.bias, b, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"features": np.full((8, 16), np.inf, np.float32)}, "features contains NaN or Inf"),
        ({"features": np.zeros((8, 5), np.float32)}, "width 5"),
        ({"labels": np.array([0, 1, 2, 3, 4, 0, 1, 2])}, r"labels must lie in \[0, 4\)"),
        ({"global_cov": np.eye(5, dtype=np.float32)}, "global_cov must have shape"),
        ({"previous_beta": 2.0}, "previous beta_mu must be <= 1"),
    ],
)
def test_personalize_rejects_bad_input(change: dict, match: str) -> None:
    cl = shifted_gaussian_client(2, 1.0, seed=0)
    args = {
        "features": cl.train_features,
        "labels": cl.train_labels,
        "global_means": cl.global_means,
        "global_cov": cl.global_cov,
        "previous_beta": 0.5,
    } | change
    with pytest.raises(ValueError, match=match):
        P.personalize(
            args["features"], args["labels"], args["global_means"], args["global_cov"],
            previous_beta=args["previous_beta"],
        )


# ------------------------------------------------------------------------------------------
# T4: Theorem 1, exact bias-variance formula by Monte Carlo
# ------------------------------------------------------------------------------------------


def test_t4_bias_variance_formula_monte_carlo() -> None:
    problem = bias_variance_problem(counts=(5, 20, 50, 100), dim=5, seed=1)
    sample_means = sample_client_means(problem, 20_000, seed=1)  # (M, R, d)
    counts = problem.counts
    pooled = weighted_average([[m] for m in sample_means], counts)[0]  # the server's n-weighted mean
    worst = 0.0
    for i in range(len(counts)):
        betas = [0.0, 0.3, 0.7, 1.0, P.optimal_interpolation_beta(i, problem.means, problem.cov_traces, counts)]
        for beta in betas:
            mixed = beta * sample_means[i] + (1 - beta) * pooled
            monte_carlo = float(((mixed - problem.means[i]) ** 2).sum(1).mean())
            exact = P.interpolated_mean_error(beta, i, problem.means, problem.cov_traces, counts)
            worst = max(worst, abs(monte_carlo - exact) / exact)
    # problem and sampling seeds 0-7 (seed=s for both): worst relative error 0.0036..0.0107
    assert worst < 0.03, f"largest relative error {worst:.4f}"


def test_t4_optimal_beta_is_the_minimum_of_the_quadratic() -> None:
    problem = bias_variance_problem(seed=1)
    grid = np.linspace(0, 1, 2_001)
    for i in range(4):
        errors = [P.interpolated_mean_error(b, i, problem.means, problem.cov_traces, problem.counts) for b in grid]
        best = P.optimal_interpolation_beta(i, problem.means, problem.cov_traces, problem.counts)
        at_best = P.interpolated_mean_error(best, i, problem.means, problem.cov_traces, problem.counts)
        assert abs(best - grid[int(np.argmin(errors))]) <= 5e-4
        assert at_best <= min(errors[0], errors[-1]) + 1e-12
    # No heterogeneity: equal means and covariances -> the pooled estimate is best (beta* = 0).
    same = np.zeros((3, 2))
    assert P.optimal_interpolation_beta(0, same, [1.0, 1.0, 1.0], [10, 10, 10]) == 0.0


# ------------------------------------------------------------------------------------------
# T5: beta selection behaves as the spec's table
# ------------------------------------------------------------------------------------------


def test_t5_beta_selection_tracks_shift_and_sample_size() -> None:
    """Spec T5: d = 16, C = 4, 40 trials per cell, bounded scalar minimizer, code's +I ridge.

    Class means are estimated from any present class (min_class_count = 0, the code's training
    path), which matches the spec's reference figures.

    Trial seeds 1000 t + o for offsets o = 0-8 (the test uses 7), 9 tables: every bound held.
    Median beta at delta 0 / 0.5 / 1.5: n=5 0.00..0.03 / 0.00..0.07 / 0.19..0.26, n=25
    0.00..0.02 / 0.06..0.13 / 0.63..0.71, n=250 0.00..0.02 / 0.18..0.22 / 1.00. Interpolated
    accuracy minus the better of local and global: worst -0.011 (bound -0.015, the thinnest
    margin here).
    """
    config = P.PFedFDAConfig(beta=P.BetaSearch(solver=P.BetaSolver.GOLDEN, golden_tol=1e-3), min_class_count=0)
    trials, shifts = 40, (0.0, 0.5, 1.5)
    median: dict[tuple[int, float], float] = {}
    mean: dict[tuple[int, float], float] = {}
    report = []
    for n in (5, 25, 250):
        for delta in shifts:
            betas, accuracy = [], np.zeros(3)
            for trial in range(trials):
                cl = shifted_gaussian_client(n, delta, n_test_per_class=500, seed=1000 * trial + 7)
                z, y, mu_g, cov_g, pi = _client_tensors(cl)
                beta = P.solve_beta(z, y, mu_g, cov_g, pi, config=config)
                assert beta.status is P.BetaStatus.OPTIMIZED
                betas.append(beta.beta_mu)
                mu_hat, cov_hat = P.estimate_statistics(z, y, mu_g, min_class_count=0, regularization=config.cov)
                test_z, test_y = torch.tensor(cl.test_features), torch.tensor(cl.test_labels)
                for k, b in enumerate((1.0, 0.0, beta.beta_mu)):  # local-only, global-only, interpolated
                    mu, cov = P.interpolate_statistics(mu_hat, cov_hat, mu_g, cov_g, b)
                    w, bias = P.lda_head(mu, cov, pi)
                    accuracy[k] += float((P.lda_logits(test_z, w, bias).argmax(1) == test_y).float().mean())
            accuracy /= trials
            median[n, delta], mean[n, delta] = float(np.median(betas)), float(np.mean(betas))
            report.append(f"n={n} delta={delta}: median beta {median[n, delta]:.2f}, acc {accuracy.round(3)}")
            assert accuracy[2] >= accuracy[:2].max() - 0.015, report[-1]
    summary = "\n".join(report)
    for n in (5, 25, 250):
        assert median[n, 0.0] <= 0.15, summary
        # Medians pinned near the bound 0 differ only by the search tolerance: allow 0.02.
        assert median[n, 0.0] - 0.02 <= median[n, 0.5] <= median[n, 1.5], summary
        assert median[n, 1.5] >= median[n, 0.0] + 0.1, summary
        assert mean[n, 0.0] < mean[n, 0.5] < mean[n, 1.5], summary
    assert median[250, 1.5] >= 0.8, summary


# ------------------------------------------------------------------------------------------
# T6: server aggregation
# ------------------------------------------------------------------------------------------


def test_t6_server_aggregation_identities() -> None:
    rng = np.random.default_rng(15)
    c, d = 4, 6
    mu_g = rng.standard_normal((c, d)).astype(np.float32)
    cov_g = _spd(rng, d).astype(np.float32)
    counts = [10, 30, 60]
    betas = [0.2, 0.5, 0.9]
    messages, local_means = [], []
    for n, beta in zip(counts, betas):
        z = rng.standard_normal((n, d)).astype(np.float32)
        y = rng.integers(0, 3, n)  # class 3 absent on every client
        mu_hat, cov_hat = P.estimate_statistics(z, y, mu_g, min_class_count=0)
        mu_i, cov_i = P.interpolate_statistics(mu_hat, cov_hat, mu_g, cov_g, beta)
        backbone = [rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
        messages.append(P.join_wire(backbone, mu_i, cov_i))
        local_means.append(mu_hat.double().numpy())
    # The whole server step is FedAvg over [backbone..., mu, Sigma] with n_i weights.
    averaged = weighted_average(messages, counts)
    w = np.asarray(counts, float) / sum(counts)
    for k in range(len(messages[0])):
        brute = sum(wi * m[k].astype(np.float64) for wi, m in zip(w, messages))
        assert np.allclose(averaged[k], brute, atol=1e-6)
        assert averaged[k].dtype == np.float32
    backbone, mu_new, cov_new = P.split_wire(averaged)
    mu_agg, cov_agg = P.aggregate_statistics([m[-2] for m in messages], [m[-1] for m in messages], counts)
    assert np.allclose(mu_agg, mu_new, atol=1e-7) and np.allclose(cov_agg, cov_new, atol=1e-6)
    # Moving-average reading: mu_g' = sum w_i beta_i mu_hat_i + (1 - sum w_i beta_i) mu_g.
    step = float(np.dot(w, betas))
    moving = sum(wi * bi * m for wi, bi, m in zip(w, betas, local_means)) + (1 - step) * mu_g.astype(np.float64)
    assert np.allclose(mu_agg, moving, atol=1e-5)
    assert np.array_equal(mu_agg[3], mu_g[3])  # absent everywhere: kept exactly
    assert np.array_equal(cov_agg, cov_agg.T)
    assert np.linalg.eigvalsh(cov_agg.astype(np.float64))[0] > 0
    P.check_client_statistics(mu_agg, cov_agg, c, d)


@pytest.mark.parametrize(
    ("counts", "match"),
    [([1, -1], "non-negative integer"), ([0, 0], "all example counts are zero"), ([1.5, 2], "non-negative integer"),
     ([1], "one example count per client"), ([1, float("nan")], "non-negative integer")],
)
def test_aggregation_rejects_bad_counts(counts: list, match: str) -> None:
    means = [np.zeros((2, 2), np.float32)] * 2
    covs = [np.eye(2, dtype=np.float32)] * 2
    with pytest.raises(ValueError, match=match):
        P.aggregate_statistics(means, covs, counts)


def test_zero_count_clients_do_not_move_the_average() -> None:
    mu, cov = P.aggregate_statistics(
        [np.ones((2, 2)), np.full((2, 2), 7.0)], [np.eye(2), 3 * np.eye(2)], [5, 0]
    )
    assert np.array_equal(mu, np.ones((2, 2))) and np.array_equal(cov, np.eye(2))


@pytest.mark.parametrize(
    ("means", "cov", "match"),
    [
        (np.zeros((3, 2)), np.eye(2), r"means must have shape \(2, 2\)"),
        (np.zeros((2, 2)), np.eye(3), r"cov must have shape \(2, 2\)"),
        (np.full((2, 2), np.nan), np.eye(2), "means contain NaN"),
        (np.zeros((2, 2)), np.array([[1.0, np.inf], [np.inf, 1.0]]), "cov contains NaN or Inf"),
        (np.zeros((2, 2)), np.array([[1.0, 0.5], [0.0, 1.0]]), "not symmetric"),
        (np.zeros((2, 2)), np.array([[1.0, 2.0], [2.0, 1.0]]), "not positive semi-definite"),
    ],
)
def test_check_client_statistics_rejects_bad_replies(means: np.ndarray, cov: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        P.check_client_statistics(means, cov, 2, 2)


def test_wire_layout_round_trip_and_packed_covariance() -> None:
    rng = np.random.default_rng(16)
    cov = _spd(rng, 5).astype(np.float32)
    mu = rng.standard_normal((3, 5)).astype(np.float32)
    backbone = [np.ones((2, 2), np.float32)]
    for packed in (False, True):
        arrays = P.join_wire(backbone, torch.tensor(mu), torch.tensor(cov), packed_cov=packed)
        assert arrays[-1].shape == ((15,) if packed else (5, 5))
        got_backbone, got_mu, got_cov = P.split_wire(arrays, packed_cov=packed)
        assert np.array_equal(got_backbone[0], backbone[0])
        assert np.array_equal(got_mu, mu) and np.array_equal(got_cov, cov)
    with pytest.raises(ValueError, match="ends with"):
        P.split_wire([mu])
    with pytest.raises(ValueError, match=r"cov must have shape \(5, 5\)"):
        P.split_wire([mu, np.eye(4)])


def test_initial_statistics_and_participation() -> None:
    mu, cov = P.init_global_statistics(10, 8, seed=3)
    assert mu.shape == (10, 8) and mu.dtype == np.float32 and mu.min() >= 0 and mu.max() < 1
    assert np.array_equal(cov, np.eye(8, dtype=np.float32))
    assert np.array_equal(mu, P.init_global_statistics(10, 8, seed=3)[0])
    assert P.init_global_statistics(10, 8, init="gaussian", seed=3)[0].min() < 0
    with pytest.raises(ValueError, match="init must be"):
        P.init_global_statistics(10, 8, init="zeros")  # type: ignore[arg-type]

    rng = np.random.default_rng(0)
    sizes = [len(P.bernoulli_participation(100, 0.3, rng)) for _ in range(300)]
    assert abs(np.mean(sizes) - 30) < 1.0  # binomial mean 30, s.e. of the average 0.26
    assert np.array_equal(P.bernoulli_participation(7, 0.1, rng, full=True), np.arange(7))
    assert len(P.bernoulli_participation(7, 0.0, rng)) == 1  # never an empty round
    assert len(P.bernoulli_participation(7, 0.0, rng, ensure_nonempty=False)) == 0
    a = P.bernoulli_participation(50, 0.3, np.random.default_rng(5))
    assert np.array_equal(a, P.bernoulli_participation(50, 0.3, np.random.default_rng(5)))


def test_summaries() -> None:
    s = P.global_statistics_summary(np.array([[3.0, 4.0]]), np.diag([1.0, 4.0]))
    assert {k: s[k] for k in ("mu_g_norm", "sigma_g_trace", "sigma_g_cond")} == {
        "mu_g_norm": 5.0, "sigma_g_trace": 5.0, "sigma_g_cond": 4.0}
    assert math.isnan(s["mu_g_separation"])  # one class: nothing to separate
    two = P.global_statistics_summary(np.array([[1.0, 0.0], [-1.0, 0.0]]), 4.0 * np.eye(2))
    assert two["mu_g_separation"] == pytest.approx(0.5)
    acc = P.client_accuracy_summary([0.5, 0.7, 0.9], [10, 10, 20])
    assert math.isclose(acc["wmean"], 0.75) and math.isclose(acc["mean"], 0.7)
    assert math.isclose(acc["std_bessel"], 0.2)


# ------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------


def test_defaults_and_presets_follow_the_spec() -> None:
    default = P.PFedFDAConfig()
    assert default.beta.mode is P.BetaMode.SINGLE and default.beta.solver is P.BetaSolver.LBFGS
    assert (default.beta.k_folds, default.beta.cv_seed, default.beta.x0) == (2, 0, 0.5)
    assert (default.beta.max_iter, default.beta.gtol, default.beta.xtol) == (10, 1e-3, 1e-9)
    assert (default.cov.ridge, default.cov.const_add, default.cov.pd_repair) == (1.0, 1e-4, True)
    assert (default.lda_shrinkage, default.lda_solve, default.prior_eps, default.min_class_count) == (
        1e-4, "lstsq", 1e-4, 2
    )
    paper, official = P.PFedFDAConfig.paper(), P.PFedFDAConfig.official_code()
    assert paper.beta.mode is P.BetaMode.SINGLE and paper.beta.solver is P.BetaSolver.GOLDEN
    assert (paper.cov.ridge, paper.cov.const_add) == (1e-4, 0.0)
    assert official.beta.mode is P.BetaMode.MULTI and official.cov == P.CovRegularization.official()


def test_flat_config_round_trip_and_validation() -> None:
    config = P.PFedFDAConfig.official_code()
    flat = config.to_flat()
    assert set(flat) == set(P.FLAT_KEYS)
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())
    assert P.PFedFDAConfig.from_flat(flat) == config
    changed = P.PFedFDAConfig.from_flat({"beta-mode": "local", "cov_ridge": 0.01, "pd_repair": 0})
    assert changed.beta.mode is P.BetaMode.LOCAL and changed.cov.ridge == 0.01 and changed.cov.pd_repair is False
    with pytest.raises(ValueError, match="unknown pFedFDA option 'ridge'; allowed"):
        P.PFedFDAConfig.from_flat({"ridge": 1.0})
    with pytest.raises(ValueError, match=r"beta_mode must be one of \['single', 'multi', 'local', 'fixed'\]"):
        P.PFedFDAConfig.from_flat({"beta_mode": "per_class"})
    for bad, match in [
        ({"k_folds": 1}, "k_folds must be >= 2"),
        ({"cov_ridge": -1.0}, "ridge must be >= 0"),
        ({"beta_fixed": 1.5}, "fixed_beta must be <= 1"),
        ({"lda_solve": "chol"}, "lda_solve must be"),
        ({"lda_shrinkage": 1.0}, "lda_shrinkage must be < 1"),
        ({"pd_threshold": 0.0}, "pd_threshold must be > 0"),
        ({"min_class_count": -1}, "min_class_count must be >= 0"),
        ({"beta_float64": "yes"}, "beta_float64 must be a bool"),
    ]:
        with pytest.raises(ValueError, match=match):
            P.PFedFDAConfig.from_flat(bad)


# ------------------------------------------------------------------------------------------
# T7: a tiny federated run of the whole algorithm, written with plain torch
# ------------------------------------------------------------------------------------------

T7 = {"clients": 10, "q": 0.5, "rounds": 20, "epochs": 2, "batch": 20, "lr": 0.05, "feature_dim": 16}


def _t7_backbone(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.LeakyReLU(), nn.Linear(32, T7["feature_dim"]), nn.LeakyReLU())


def _t7_local_train(model: nn.Module, head: nn.Module | None, weight, bias, x, y, seed: int):
    """E epochs of SGD with shuffled, drop_last batches; returns the feature bank."""
    params = list(model.parameters()) + ([] if head is None else list(head.parameters()))
    optimizer = torch.optim.SGD(params, lr=T7["lr"], momentum=0.5, weight_decay=5e-4)
    generator = torch.Generator().manual_seed(seed)
    bank_z, bank_y = [], []
    batch = min(T7["batch"], len(y))
    for _ in range(T7["epochs"]):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y) - batch + 1, batch):
            idx = order[start : start + batch]
            z = model(x[idx])
            logits = head(z) if head is not None else P.lda_logits(z, weight, bias)
            loss = F.cross_entropy(logits, y[idx])
            bank_z.append(z.detach())
            bank_y.append(y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return torch.cat(bank_z), torch.cat(bank_y)


def _t7_run(algorithm: str, seed: int) -> dict[str, np.ndarray]:
    data = affine_shift_federation(num_clients=T7["clients"], seed=seed)
    xs = [torch.tensor(a) for a in data.train_x]
    ys = [torch.tensor(a) for a in data.train_y]
    global_model = _t7_backbone(seed)
    global_head = nn.Linear(T7["feature_dim"], data.num_classes)
    mu_g_np, cov_g_np = P.init_global_statistics(data.num_classes, T7["feature_dim"], seed=seed)
    mu_g, cov_g = torch.tensor(mu_g_np), torch.tensor(cov_g_np)
    priors = [P.label_priors(y, data.num_classes) for y in ys]
    previous_beta = [0.5] * T7["clients"]
    fit_config = P.PFedFDAConfig(min_class_count=0)  # the code's training path
    rng = np.random.default_rng(seed)
    for rnd in range(1, T7["rounds"] + 1):
        chosen = P.bernoulli_participation(T7["clients"], T7["q"], rng, full=rnd == T7["rounds"])
        messages, counts = [], []
        for i in chosen:
            model = copy.deepcopy(global_model)
            if algorithm == "fedavg":
                head = copy.deepcopy(global_head)
                _t7_local_train(model, head, None, None, xs[i], ys[i], seed=1000 * rnd + int(i))
                messages.append([p.detach().numpy() for p in [*model.parameters(), *head.parameters()]])
            else:
                weight, bias = P.lda_head(mu_g, cov_g, priors[i])  # frozen head
                z, y = _t7_local_train(model, None, weight, bias, xs[i], ys[i], seed=1000 * rnd + int(i))
                p = P.personalize(z, y, mu_g, cov_g, priors=priors[i], config=fit_config,
                                  previous_beta=previous_beta[i])
                previous_beta[i] = p.beta.beta_mu
                messages.append(P.join_wire([q.detach().numpy() for q in model.parameters()], p.means, p.cov))
            counts.append(len(ys[i]))
        averaged = weighted_average(messages, counts)
        if algorithm == "fedavg":
            params = [*global_model.parameters(), *global_head.parameters()]
        else:
            backbone, mu_np, cov_np = P.split_wire(averaged)
            P.check_client_statistics(mu_np, cov_np, data.num_classes, T7["feature_dim"])
            mu_g, cov_g = torch.tensor(mu_np), torch.tensor(cov_np)
            averaged = backbone
            params = list(global_model.parameters())
        with torch.no_grad():
            for param, value in zip(params, averaged):
                param.copy_(torch.tensor(value))
    accuracy, betas = [], []
    with torch.no_grad():
        for i in range(T7["clients"]):
            test_x, test_y = torch.tensor(data.test_x[i]), torch.tensor(data.test_y[i])
            if algorithm == "fedavg":
                logits = global_head(global_model(test_x))
            else:
                p = P.personalize(global_model(xs[i]), ys[i], mu_g, cov_g, priors=priors[i])
                logits = P.lda_logits(global_model(test_x), p.weight, p.bias)
                betas.append(p.beta.beta_mu)
            accuracy.append(float((logits.argmax(1) == test_y).float().mean()))
    return {"accuracy": np.array(accuracy), "beta": np.array(betas), "shifted": data.shifted}


def test_t7_tiny_federated_run() -> None:
    """Spec T7 over eight seeds: pFedFDA above FedAvg, shifted (odd) clients with larger beta.

    One seed is too noisy for either claim (12 test samples per client, Dir(0.5) label skew):
    over seeds 0-39 the accuracy gain pFedFDA - FedAvg was -0.042..+0.283 (negative on seed 4)
    and the beta gap (shifted - clean mean beta_mu) -0.37..+0.65 (not positive on 10 of 40,
    seeds 4 and 6 among them). The means over eight seeds are steady: in the five blocks 0-7,
    8-15, ..., 32-39 the mean gain was 0.096..0.140 and the mean gap 0.083..0.229, with 5..7
    positive gaps out of 8. Thresholds: mean gain >= 0.05, mean gap >= 0.04, >= 4 positive gaps.
    """
    gains, gaps = [], []
    for seed in range(8):
        fda = _t7_run("pfedfda", seed=seed)
        fedavg = _t7_run("fedavg", seed=seed)
        gains.append(fda["accuracy"].mean() - fedavg["accuracy"].mean())
        gaps.append(fda["beta"][fda["shifted"]].mean() - fda["beta"][~fda["shifted"]].mean())
    summary = f"gains {np.round(gains, 3)}, beta gaps {np.round(gaps, 3)}"
    assert np.mean(gains) >= 0.05, summary
    assert np.mean(gaps) >= 0.04, summary
    assert sum(g > 0 for g in gaps) >= 4, summary
    again = _t7_run("pfedfda", seed=0)
    fda = _t7_run("pfedfda", seed=0)
    assert np.array_equal(fda["accuracy"], again["accuracy"]) and np.array_equal(fda["beta"], again["beta"])


# ------------------------------------------------------------------------------------------
# T8: Table 8, parameters communicated per round
# ------------------------------------------------------------------------------------------


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class _GroupAffineGroupNorm(nn.Module):
    """GroupNorm over groups of 32 channels with one scale/shift per group (spec §5.1)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.groups = channels // 32
        self.weight = nn.Parameter(torch.ones(self.groups))
        self.bias = nn.Parameter(torch.zeros(self.groups))


def test_t8_table8_parameter_counts() -> None:
    torchvision = pytest.importorskip("torchvision")
    cifar_cnn = nn.Sequential(
        nn.Conv2d(3, 16, 5), nn.LeakyReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=1), nn.LeakyReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.LeakyReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(576, 128), nn.LeakyReLU(),
    )
    assert cifar_cnn(torch.zeros(1, 3, 32, 32)).shape == (1, 128)
    emnist_cnn = nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.LeakyReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=1), nn.LeakyReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(800, 128), nn.LeakyReLU(),
    )
    assert emnist_cnn(torch.zeros(1, 1, 28, 28)).shape == (1, 128)
    resnet = torchvision.models.resnet18(norm_layer=_GroupAffineGroupNorm)
    resnet_backbone = _count(resnet) - _count(resnet.fc)
    mobilenet = torchvision.models.mobilenet_v3_small()
    rows = [
        # (backbone, C, d, hidden head params) -> (backbone, linear, gaussian, overhead %) of Table 8
        ((_count(emnist_cnn), 62, 128, 0), (115_776, 7_998, 16_192, 6.620)),
        ((_count(cifar_cnn), 100, 128, 0), (106_400, 12_900, 21_056, 6.837)),
        ((resnet_backbone, 200, 512, 0), (11_167_212, 102_600, 233_728, 1.164)),
        (
            (_count(mobilenet.features), 1000, 1024, _count(mobilenet.classifier[0])),
            (927_008, 1_615_848, 1_548_800, -2.637),
        ),
    ]
    for (backbone, c, d, hidden), (want_backbone, want_linear, want_gaussian, want_overhead) in rows:
        cost = P.communication_cost(backbone, c, d, head_hidden_params=hidden)
        assert (cost.backbone, cost.linear_head, cost.gaussian) == (want_backbone, want_linear, want_gaussian)
        assert round(100 * cost.overhead, 3) == want_overhead
    # The packed covariance on the wire has exactly Table 8's (d^2 + d)/2 entries.
    assert P.cov_to_triu(np.eye(128)).size + 100 * 128 == 21_056


def test_class_separation_is_the_means_spread_in_feature_standard_deviations() -> None:
    # means +-1 around the centroid (distance 1 each); tr(Sigma) / d = 8 / 2 = 4, so sd 2: 1 / 2
    means, cov = np.array([[1.0, 0.0], [-1.0, 0.0]]), np.diag([3.0, 5.0])
    assert P.class_separation(means, cov) == pytest.approx(0.5)
    # scale-free: features x 3 -> means x 3, Sigma x 9
    assert P.class_separation(3.0 * means, 9.0 * cov) == pytest.approx(0.5)
    assert P.class_separation(means + 10.0, cov) == pytest.approx(0.5)  # a shared offset is no separation
    # three classes, distances 2, 1, 1 from the centroid (0, 0): mean 4/3, sd 1
    three = np.array([[2.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]])
    assert P.class_separation(three, np.eye(2)) == pytest.approx(4.0 / 3.0)
    assert P.class_separation(np.ones((4, 2)), np.eye(2)) == 0.0  # every mean equal: collapsed
    assert P.class_separation(means, np.zeros((2, 2))) == math.inf  # no variance, distinct means
    assert P.class_separation(np.ones((3, 2)), np.zeros((2, 2))) == 0.0
    assert math.isnan(P.class_separation(np.ones((1, 2)), np.eye(2)))


def test_a_collapsed_lda_head_passes_no_gradient_to_the_features() -> None:
    """Why a collapse (class_separation ~ 0) is absorbing: with equal class means the LDA head's
    logits differ only by the priors, so the cross-entropy's gradient w.r.t. the features is 0."""
    d, c = 5, 3
    cov = torch.eye(d, dtype=torch.float64) * 2.0
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    z = torch.randn(7, d, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    for means, vanishes in ((torch.ones(c, d, dtype=torch.float64) * 0.7, True),
                            (torch.eye(c, d, dtype=torch.float64), False)):
        w, b = P.lda_head(means, cov, pi)  # W = Sigma^-1 mu (rows w_c), b from mu and the priors
        (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(z @ w.T + b, y), z)
        assert (grad.abs().max().item() < 1e-12) is vanishes
        assert (P.class_separation(means.numpy(), cov.numpy()) < P.COLLAPSED_SEPARATION) is vanishes
