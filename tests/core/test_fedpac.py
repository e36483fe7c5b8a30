"""FedPAC's mathematics (flwr_pfl.core.fedpac) against closed forms, loops written by hand and
brute-force grids over the simplex."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flwr_pfl.core.fedpac import (
    aggregate_prototypes,
    alignment_loss,
    alignment_targets,
    class_means,
    combination_weights,
    combine_heads,
    feature_variance,
    prior_weighted_means,
    project_simplex,
    qp_matrix,
    repair_psd,
    solve_simplex_qp,
)


def features(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor([0, 0, 0, 2, 2, 0, 2, 2, 2])  # class 1 absent
    return torch.randn(len(y), 4, generator=g, dtype=torch.float64) + y[:, None] * 0.5, y


def test_class_means_and_counts_by_hand():
    z, y = features()
    means, counts = class_means(z, y, 3)
    assert counts.tolist() == [4.0, 0.0, 5.0]
    for k in (0, 2):
        np.testing.assert_allclose(means[k].numpy(), z[y == k].numpy().mean(0), rtol=1e-12)
    assert means[1].abs().sum() == 0


def test_feature_variance_as_the_authors_loop():
    """V = (sum_k p_k tr(Z_k^T Z_k / n_k) - p_k^2 ||mu_k||^2) / n, their statistics_extraction."""
    z, y = features(1)
    n = len(y)
    expected = 0.0
    for k in (0, 2):
        zk = z[y == k].numpy()
        p = len(zk) / n
        expected += p * np.trace(zk.T @ zk / len(zk)) - p * p * (zk.mean(0) ** 2).sum()
    assert feature_variance(z, y, 3) == pytest.approx(expected / n, rel=1e-12)


def test_feature_variance_is_zero_for_a_single_sample_per_client_class():
    """One class, all features equal: E||z||^2 = ||mu||^2 and p = 1, so V = 0."""
    z = torch.ones(3, 2, dtype=torch.float64)
    assert feature_variance(z, torch.zeros(3, dtype=torch.long), 2) == pytest.approx(0.0, abs=1e-15)


def test_aggregate_prototypes_is_count_weighted_per_class():
    m1 = np.array([[1.0, 0.0], [5.0, 5.0], [0.0, 0.0]])
    m2 = np.array([[3.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    c1, c2 = np.array([1.0, 2.0, 0.0]), np.array([3.0, 0.0, 0.0])
    protos, totals = aggregate_prototypes([m1, m2], [c1, c2])
    np.testing.assert_allclose(protos[0], (1 * m1[0] + 3 * m2[0]) / 4)  # not the plain mean (2, 1)
    np.testing.assert_allclose(protos[1], m1[1])  # only client 1 holds class 1
    np.testing.assert_allclose(protos[2], 0.0)
    np.testing.assert_allclose(totals, [4.0, 2.0, 0.0])


def test_alignment_targets_fall_back_to_the_local_prototype():
    protos = torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 3.0]])
    counts = torch.tensor([2.0, 0.0, 1.0])
    local = torch.tensor([[9.0, 9.0], [7.0, 8.0], [9.0, 9.0]])
    targets = alignment_targets(torch.tensor([2, 1, 0]), protos, counts, local)
    assert targets.tolist() == [[3.0, 3.0], [7.0, 8.0], [1.0, 1.0]]


def test_alignment_loss_is_torch_mse_per_sample():
    z = torch.randn(5, 3, requires_grad=True)
    c = torch.randn(5, 3)
    loss = alignment_loss(z, c)
    assert loss.shape == (5,)
    torch.testing.assert_close(loss.mean(), torch.nn.functional.mse_loss(z, c))  # the authors' nn.MSELoss
    loss.sum().backward()
    torch.testing.assert_close(z.grad, 2 * (z - c).detach() / 3)


def test_prior_weighted_means():
    h = prior_weighted_means(np.array([[2.0, 4.0], [1.0, 1.0]]), np.array([1.0, 3.0]))
    np.testing.assert_allclose(h, [[0.5, 1.0], [0.75, 0.75]])


def test_qp_matrix_by_the_authors_double_loop():
    rng = np.random.default_rng(3)
    h = [rng.normal(size=(3, 2)) for _ in range(4)]
    v = [0.1, 0.2, 0.3, 0.4]
    i = 2
    p = qp_matrix(i, v, h)
    for j1, j2 in itertools.product(range(4), repeat=2):
        dist = sum(float(np.dot(h[i][k] - h[j1][k], h[i][k] - h[j2][k])) for k in range(3))
        assert p[j1, j2] == pytest.approx(dist + (v[j1] if j1 == j2 else 0.0), rel=1e-12)
    alpha = rng.dirichlet(np.ones(4))  # its quadratic form is variance + bias
    bias = sum(a * (h[i] - hj) for a, hj in zip(alpha, h))
    assert alpha @ p @ alpha == pytest.approx(sum(a * a * vj for a, vj in zip(alpha, v)) + (bias ** 2).sum())


def test_project_simplex_against_brute_force():
    rng = np.random.default_rng(0)
    grid = simplex_grid(3, 200)
    for _ in range(20):
        v = rng.normal(size=3) * 2
        x = project_simplex(v)
        assert x.min() >= 0 and x.sum() == pytest.approx(1.0)
        best = grid[np.argmin(((grid - v) ** 2).sum(1))]
        assert ((x - v) ** 2).sum() <= ((best - v) ** 2).sum() + 1e-12


def simplex_grid(m: int, steps: int) -> np.ndarray:
    points = [c for c in itertools.product(range(steps + 1), repeat=m - 1) if sum(c) <= steps]
    return np.array([[*c, steps - sum(c)] for c in points], dtype=np.float64) / steps


def test_two_clients_closed_form():
    """m = 2: a = clip((P22 - P12) / (P11 + P22 - 2 P12), 0, 1)."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        a = rng.normal(size=(2, 2))
        p = a @ a.T + np.diag(rng.uniform(0, 0.5, 2))
        first = np.clip((p[1, 1] - p[0, 1]) / (p[0, 0] + p[1, 1] - 2 * p[0, 1]), 0, 1)
        np.testing.assert_allclose(solve_simplex_qp(p), [first, 1 - first], atol=1e-9)


def test_diagonal_closed_form():
    """P = diag(v): a_j proportional to 1 / v_j (no bias: every head counts by its precision)."""
    v = np.array([0.5, 1.0, 2.0, 4.0])
    expected = (1 / v) / (1 / v).sum()
    np.testing.assert_allclose(solve_simplex_qp(np.diag(v)), expected, atol=1e-10)


def kkt_gap(p: np.ndarray, a: np.ndarray) -> float:
    """How far ``a`` is from the simplex QP's KKT conditions: with g = 2 P a and lambda = a.g,
    g_j = lambda where a_j > 0 and g_j >= lambda elsewhere."""
    g = 2 * p @ a
    lam = a @ g
    on = a > 1e-9
    return max(float(np.abs(g[on] - lam).max()), float(max(0.0, (lam - g[~on]).max() if (~on).any() else 0.0)))


@pytest.mark.parametrize("seed", range(8))
def test_solver_meets_kkt_and_beats_a_grid(seed):
    rng = np.random.default_rng(seed)
    m = 3
    h = [rng.normal(size=(2, 3)) for _ in range(m)]
    p = qp_matrix(0, rng.uniform(0.0, 0.3, m), h)
    a = solve_simplex_qp(p)
    assert a.min() >= 0 and a.sum() == pytest.approx(1.0)
    assert kkt_gap(p, a) < 1e-8
    grid = simplex_grid(m, 120)
    assert a @ p @ a <= np.einsum("ni,ij,nj->n", grid, p, grid).min() + 1e-12


@pytest.mark.parametrize("seed", range(5))
def test_solver_on_larger_singular_problems(seed):
    """m = 7 with rank-2 bias and some zero variances (a singular P): KKT holds, and no random
    simplex point does better."""
    rng = np.random.default_rng(100 + seed)
    m = 7
    h = [rng.normal(size=(1, 2)) for _ in range(m)]
    v = rng.uniform(0, 1, m) * (rng.uniform(size=m) < 0.5)
    p = qp_matrix(seed % m, v, h)
    a = solve_simplex_qp(p)
    assert kkt_gap(p, a) < 1e-7
    samples = rng.dirichlet(np.ones(m) * 0.3, size=5000)
    assert a @ p @ a <= np.einsum("ni,ij,nj->n", samples, p, samples).min() + 1e-12


def test_repair_psd_keeps_a_psd_matrix_and_fixes_an_indefinite_one():
    p = np.array([[2.0, 1.0], [1.0, 2.0]])
    np.testing.assert_array_equal(repair_psd(p), p)
    bad = np.diag([3.0, -1e-6])
    np.testing.assert_allclose(repair_psd(bad), np.diag([3.0, 0.0]))


def test_combination_weights_prune_small_weights_and_renormalise():
    """P = diag(1, 1, 1e6): the exact a_3 = 1e-6 / (2 + 1e-6) < 1e-3 is pruned, the rest renormalised."""
    a = combination_weights(np.diag([1.0, 1.0, 1e6]))
    np.testing.assert_allclose(a, [0.5, 0.5, 0.0], atol=1e-12)
    unpruned = combination_weights(np.diag([1.0, 1.0, 1e6]), prune_below=0.0)
    assert unpruned[2] > 0


def test_combine_heads_weights_each_array():
    heads = [[np.ones((2, 2), np.float32), np.zeros(2, np.float32)], [np.full((2, 2), 3.0, np.float32), np.ones(2, np.float32)]]
    out = combine_heads(np.array([0.25, 0.75]), heads)
    np.testing.assert_allclose(out[0], np.full((2, 2), 2.5))
    np.testing.assert_allclose(out[1], np.full(2, 0.75))
    assert out[0].dtype == np.float32
