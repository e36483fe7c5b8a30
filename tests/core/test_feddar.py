"""Tests of FedDAR's mathematics (flwr_pfl.core.feddar) against closed forms, brute force and the
paper's synthetic claims (spec section 7)."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from flwr_pfl.core import feddar as F
from flwr_pfl.data.synthetic import feddar as S

SQ, LOGI, SOFT = F.HeadLoss.SQUARED, F.HeadLoss.LOGISTIC, F.HeadLoss.SOFTMAX
EXACT = F.SAOptions(solver=F.SASolver.EXACT)
PINV = F.SAOptions(solver=F.SASolver.PINV)
UNDAMPED = F.SAOptions(damping=0.0)
LONG = os.environ.get("FLWR_PFL_LONG_TESTS") == "1"


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def _targets(loss: F.HeadLoss, shape: tuple[int, ...], layout: F.HeadLayout, gen: torch.Generator) -> torch.Tensor:
    if loss is SOFT:
        return torch.randint(0, layout.num_outputs, shape, generator=gen)
    if loss is LOGI:
        return torch.randint(0, 2, shape, generator=gen).double()
    if layout.num_outputs == 1:
        return torch.randn(shape, generator=gen, dtype=torch.float64)
    return torch.randn(*shape, layout.num_outputs, generator=gen, dtype=torch.float64)


def _client_problem(counts: np.ndarray, layout: F.HeadLayout, loss: F.HeadLoss, seed: int = 0):
    """Per-client (features, targets, domains) lists for a count table (n, M)."""
    gen = torch.Generator().manual_seed(seed)
    clients = []
    for row in counts:
        z = torch.as_tensor(np.repeat(np.arange(len(row)), row))
        z = z[torch.randperm(len(z), generator=gen)]
        phi = torch.randn(len(z), layout.feature_dim, generator=gen, dtype=torch.float64)
        clients.append((phi, _targets(loss, (len(z),), layout, gen), z))
    return clients


def _pooled(clients, m: int):
    phi = torch.cat([c[0][c[2] == m] for c in clients])
    y = torch.cat([c[1][c[2] == m] for c in clients])
    return phi, y


def _augment(phi: torch.Tensor, layout: F.HeadLayout) -> np.ndarray:
    a = phi.numpy()
    return np.hstack([a, np.ones((len(a), 1))]) if layout.bias else a


def _client_stats(clients, heads, layout, loss):
    stats = [
        F.head_statistics(phi, y, z, heads[i] if heads.dim() == 3 else heads, layout, loss)
        for i, (phi, y, z) in enumerate(clients)
    ]
    return (
        np.stack([s.counts.numpy() for s in stats]),
        np.stack([s.hessians.numpy() for s in stats]),
        np.stack([s.gradients.numpy() for s in stats]),
    )


def _null_space_projector(layout: F.HeadLayout) -> np.ndarray:
    """Projector onto the softmax invariance directions 1_N kron e_a (class-major layout)."""
    basis = np.kron(np.ones((layout.num_outputs, 1)), np.eye(layout.in_dim)) / np.sqrt(layout.num_outputs)
    return basis @ basis.T


# ------------------------------------------------------------------------------------------
# layout, counts, losses
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_head_layout_roundtrip_torch_and_numpy(bias):
    layout = F.HeadLayout(3, 4, bias)
    w = torch.randn(5, 3, 4, dtype=torch.float64)
    b = torch.randn(5, 3, dtype=torch.float64) if bias else None
    flat = layout.pack(w, b)
    assert flat.shape == (5, layout.num_params) and layout.num_params == 3 * (4 + bias)
    w2, b2 = layout.unpack(flat)
    assert torch.equal(w2, w) and (b2 is None if not bias else torch.equal(b2, b))
    # class-major: row c of [W | b] is contiguous
    full = torch.cat([w, b[..., None]], -1) if bias else w
    assert torch.equal(flat[:, : layout.in_dim], full[:, 0])
    flat_np = layout.pack(w.numpy(), None if b is None else b.numpy())
    np.testing.assert_array_equal(flat_np, flat.numpy())


def test_head_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="num_outputs"):
        F.HeadLayout(0, 2)
    layout = F.HeadLayout(2, 3, bias=True)
    with pytest.raises(ValueError, match="bias"):
        layout.pack(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        layout.pack(torch.zeros(3, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="parameters"):
        layout.unpack(torch.zeros(7))
    with pytest.raises(ValueError, match="no bias"):
        F.HeadLayout(2, 3).pack(torch.zeros(2, 3), torch.zeros(2))


def test_domain_counts_and_out_of_range_labels():
    z = torch.tensor([[0, 2, 2, 1], [1, 1, 1, 1]])
    assert F.domain_counts(z, 3).tolist() == [[1, 1, 2], [0, 4, 0]]
    layout = F.HeadLayout(1, 2)
    phi, y, heads = torch.zeros(4, 2), torch.zeros(4), torch.zeros(3, 2)
    for bad in (torch.tensor([0, 1, 3, 0]), torch.tensor([0, -1, 1, 0])):
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            F.domain_counts(bad, 3)
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            F.head_statistics(phi, y, bad, heads, layout, SQ)
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            F.head_outputs(phi, bad, heads, layout)
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            F.reweighted_loss(torch.ones(4), bad, np.ones(3))
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            F.linear_head_statistics(torch.zeros(4, 5), y, bad, torch.zeros(5, 2), 3)
    with pytest.raises(ValueError, match="integers"):
        F.domain_counts(torch.tensor([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match="num_domains"):
        F.domain_counts(z, 0)


def test_domain_weights_formula_and_zero_domain():
    table = np.array([[3, 0, 1, 0], [5, 2, 0, 0]])
    u = F.domain_weights(table)
    totals, total = np.array([8, 2, 1, 0]), 11
    np.testing.assert_allclose(u[:3], total / (totals[:3] * 4))
    assert u[3] == 0.0
    np.testing.assert_array_equal(F.domain_weights(totals), u)
    with pytest.raises(ValueError, match="at least one sample"):
        F.domain_weights(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="non-negative"):
        F.domain_weights(np.array([1, -1]))


def test_reweighted_objective_equals_domain_average():
    """Eq. 6: sum_i (L_i/L) R_i with u_m re-weighting = (1/M) sum_m R_m (pooled domain means)."""
    gen = torch.Generator().manual_seed(3)
    num_domains, sizes = 4, [7, 12, 3, 9]
    losses = [torch.rand(s, generator=gen, dtype=torch.float64) for s in sizes]
    domains = [torch.randint(0, num_domains, (s,), generator=gen) for s in sizes]
    table = np.stack([F.domain_counts(z, num_domains).numpy() for z in domains])
    u = F.domain_weights(table)
    total = sum(sizes)
    fed = sum(s / total * F.reweighted_loss(l, z, u) for s, l, z in zip(sizes, losses, domains))
    all_l, all_z = torch.cat(losses), torch.cat(domains)
    domain_avg = np.mean([all_l[all_z == m].mean().item() for m in range(num_domains)])
    assert fed.item() == pytest.approx(domain_avg, rel=1e-12)


def test_head_phase_loss_is_sum_of_domain_means_and_gives_domain_gradients():
    gen = torch.Generator().manual_seed(4)
    layout = F.HeadLayout(1, 3)
    phi = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(10, generator=gen, dtype=torch.float64)
    z = torch.tensor([0, 0, 1, 0, 1, 1, 1, 0, 0, 0])
    heads = torch.randn(3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    losses = F.per_sample_loss(F.head_outputs(phi, z, heads, layout), y, SQ)
    obj = F.head_phase_loss(losses, z, 3)
    assert obj.item() == pytest.approx(losses[z == 0].mean().item() + losses[z == 1].mean().item())
    (grad,) = torch.autograd.grad(obj, heads)
    stats = F.head_statistics(phi, y, z, heads.detach(), layout, SQ)
    torch.testing.assert_close(grad, stats.gradients)  # absent domain 2: zero gradient
    assert torch.all(grad[2] == 0)


# ------------------------------------------------------------------------------------------
# client statistics: exact Hessians
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss,num_outputs,bias",
    [(SQ, 1, False), (SQ, 3, True), (LOGI, 1, False), (LOGI, 1, True), (SOFT, 4, True), (SOFT, 3, False)],
)
def test_head_statistics_match_autograd(loss, num_outputs, bias):
    layout = F.HeadLayout(num_outputs, 3, bias)
    gen = torch.Generator().manual_seed(1)
    z = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1, 0])
    phi = torch.randn(len(z), 3, generator=gen, dtype=torch.float64)
    y = _targets(loss, (len(z),), layout, gen)
    heads = torch.randn(3, layout.num_params, generator=gen, dtype=torch.float64)  # domain 2 absent
    stats = F.head_statistics(phi, y, z, heads, layout, loss)
    for m in range(2):
        def risk(w, m=m):
            h = torch.cat([heads[:m], w[None], heads[m + 1 :]])
            return F.per_sample_loss(F.head_outputs(phi, z, h, layout), y, loss)[z == m].mean()

        hessian = torch.autograd.functional.hessian(risk, heads[m])
        gradient = torch.autograd.functional.jacobian(risk, heads[m])
        torch.testing.assert_close(stats.hessians[m], hessian, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(stats.gradients[m], gradient, atol=1e-12, rtol=1e-10)
        assert stats.losses[m].item() == pytest.approx(risk(heads[m]).item(), rel=1e-12)
    assert stats.counts.tolist() == [5, 4, 0]
    assert torch.all(stats.hessians[2] == 0) and torch.all(stats.gradients[2] == 0) and stats.losses[2] == 0


def test_paper_closed_forms_for_squared_and_logistic_heads():
    gen = torch.Generator().manual_seed(2)
    layout = F.HeadLayout(1, 4)
    phi = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    z = torch.zeros(6, dtype=torch.long)
    w = torch.randn(1, 4, generator=gen, dtype=torch.float64)
    x = phi.numpy()
    sq = F.head_statistics(phi, torch.randn(6, generator=gen, dtype=torch.float64), z, w, layout, SQ)
    np.testing.assert_allclose(sq.hessians[0].numpy(), 2 / 6 * x.T @ x, rtol=1e-13)
    mu = 1 / (1 + np.exp(-x @ w[0].numpy()))
    logi = F.head_statistics(phi, torch.ones(6, dtype=torch.float64), z, w, layout, LOGI)
    np.testing.assert_allclose(logi.hessians[0].numpy(), x.T @ np.diag(mu * (1 - mu)) @ x / 6, rtol=1e-12)


def test_softmax_hessian_is_singular_along_class_shifts():
    layout = F.HeadLayout(3, 2, bias=True)
    gen = torch.Generator().manual_seed(5)
    phi = torch.randn(20, 2, generator=gen, dtype=torch.float64)
    stats = F.head_statistics(phi, torch.randint(0, 3, (20,), generator=gen), torch.zeros(20, dtype=torch.long),
                              torch.randn(1, 9, generator=gen, dtype=torch.float64), layout, SOFT)
    h = stats.hessians[0].numpy()
    shift = np.kron(np.ones(3), np.array([0.3, -1.0, 2.0]))  # the same vector added to every class row
    np.testing.assert_allclose(h @ shift, 0, atol=1e-14)
    assert np.linalg.matrix_rank(h) == layout.num_params - layout.in_dim


def test_batched_statistics_equal_per_client_calls():
    layout, gen = F.HeadLayout(2, 3, bias=True), torch.Generator().manual_seed(6)
    phi = torch.randn(4, 8, 3, generator=gen, dtype=torch.float64)
    z = torch.randint(0, 3, (4, 8), generator=gen)
    y = torch.randint(0, 2, (4, 8), generator=gen)
    heads = torch.randn(4, 3, layout.num_params, generator=gen, dtype=torch.float64)
    batched = F.head_statistics(phi, y, z, heads, layout, SOFT)
    for i in range(4):
        single = F.head_statistics(phi[i], y[i], z[i], heads[i], layout, SOFT)
        for name in ("counts", "losses", "gradients", "hessians"):
            torch.testing.assert_close(getattr(batched, name)[i], getattr(single, name))


def test_hessian_point_and_squared_hessian_independent_of_point():
    gen = torch.Generator().manual_seed(7)
    local, glob = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    assert F.hessian_point(F.HessianAt.LOCAL, local, glob) is local
    assert F.hessian_point("global", local, glob) is glob
    layout, phi = F.HeadLayout(1, 3), torch.randn(5, 3, generator=gen, dtype=torch.float64)
    z, y = torch.tensor([0, 1, 1, 0, 0]), torch.randn(5, generator=gen, dtype=torch.float64)
    h_local = F.head_statistics(phi, y, z, local, layout, SQ).hessians
    torch.testing.assert_close(h_local, F.head_statistics(phi, y, z, glob, layout, SQ).hessians)
    h_logi = F.head_statistics(phi, (y > 0).double(), z, local, layout, LOGI).hessians
    assert not torch.allclose(h_logi, F.head_statistics(phi, (y > 0).double(), z, glob, layout, LOGI).hessians)


def test_statistics_reject_bad_targets_shapes_and_huge_heads():
    layout = F.HeadLayout(3, 2)
    phi, z, heads = torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), torch.zeros(1, 6)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        F.head_statistics(phi, torch.tensor([0, 1, 3, 0]), z, heads, layout, SOFT)
    with pytest.raises(ValueError, match="class indices"):
        F.head_statistics(phi, torch.zeros(4), z, heads, layout, SOFT)
    with pytest.raises(ValueError, match="N = 1"):
        F.head_statistics(phi, torch.zeros(4), z, heads, layout, LOGI)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        F.head_statistics(torch.zeros(4, 2), torch.full((4,), 2.0), z, torch.zeros(1, 2), F.HeadLayout(1, 2), LOGI)
    with pytest.raises(ValueError, match="features"):
        F.head_statistics(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), z, heads, layout, SOFT)
    with pytest.raises(ValueError, match="heads"):
        F.head_statistics(phi, torch.zeros(4, dtype=torch.long), z, torch.zeros(1, 5), layout, SOFT)
    with pytest.raises(ValueError, match="max_hessian_params"):
        F.head_statistics(torch.zeros(4, 512), torch.zeros(4, dtype=torch.long), z, torch.zeros(1, 9 * 512),
                          F.HeadLayout(9, 512), SOFT)


def test_local_least_squares_heads_are_nearest_local_minimisers():
    layout, gen = F.HeadLayout(2, 4, bias=True), torch.Generator().manual_seed(8)
    z = torch.tensor([0] * 3 + [1] * 9)  # domain 0: 3 rows < 5 columns; domain 1: overdetermined; 2 absent
    phi = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(12, 2, generator=gen, dtype=torch.float64)
    init = torch.randn(3, layout.num_params, generator=gen, dtype=torch.float64)
    heads = F.local_least_squares_heads(phi, y, z, init, layout)
    stats = F.head_statistics(phi, y, z, heads, layout, SQ)
    assert stats.gradients[:2].abs().max() < 1e-12  # local normal equations hold
    torch.testing.assert_close(heads[2], init[2])
    for m in range(2):
        a = _augment(phi[z == m], layout)
        w0 = init[m].reshape(2, 5).numpy()
        for c in range(2):  # brute force: w0 + argmin-norm ||a d - (y - a w0)||
            d = np.linalg.lstsq(a, y[z == m, c].numpy() - a @ w0[c], rcond=None)[0]
            np.testing.assert_allclose(heads[m].reshape(2, 5)[c].numpy(), w0[c] + d, atol=1e-10)


# ------------------------------------------------------------------------------------------
# server: WA and SA
# ------------------------------------------------------------------------------------------

# clients 0-3 hold fewer samples of a domain than the head has parameters; some hold none.
COUNTS = np.array([[2, 3, 0], [1, 0, 4], [3, 2, 1], [0, 1, 2], [9, 7, 0], [6, 0, 8]])


@pytest.mark.parametrize("layout", [F.HeadLayout(1, 4), F.HeadLayout(2, 3, bias=True)])
@pytest.mark.parametrize("options", [EXACT, PINV, UNDAMPED], ids=["exact", "pinv", "damped0"])
def test_sa_on_squared_loss_equals_pooled_least_squares(layout, options):
    clients = _client_problem(COUNTS, layout, SQ, seed=11)
    gen = torch.Generator().manual_seed(12)
    prev = torch.randn(3, layout.num_params, generator=gen, dtype=torch.float64)
    local = torch.stack([F.local_least_squares_heads(phi, y, z, prev, layout) for phi, y, z in clients])
    # any exact local minimiser works, not only the nearest one: add local null-space moves
    for i, (phi, _, z) in enumerate(clients):
        for m in range(3):
            a = _augment(phi[z == m], layout)
            if 0 < len(a) < layout.in_dim:
                null = np.linalg.svd(a)[2][len(a):].T  # (in_dim, in_dim - rows)
                move = null @ np.random.default_rng(i * 3 + m).standard_normal((null.shape[1], layout.num_outputs))
                local[i, m] += torch.as_tensor(move.T.reshape(-1))
    counts, hess, _ = _client_stats(clients, local, layout, SQ)
    res = F.aggregate_heads(F.HeadAggregation.SA, local.numpy(), counts, prev.numpy(), hess, options)
    for m in range(3):
        phi, y = _pooled(clients, m)
        ls = np.linalg.lstsq(_augment(phi, layout), y.numpy().reshape(len(y), -1), rcond=None)[0]
        np.testing.assert_allclose(res.heads[m], ls.T.reshape(-1), atol=1e-8, rtol=0)
    assert res.updated.all() and not res.fell_back_to_wa.any()
    assert np.all(res.condition_numbers < 1e6) and np.all(res.min_eigenvalues > 0)


def test_default_damped_sa_is_the_proximal_closed_form():
    layout = F.HeadLayout(1, 4)
    clients = _client_problem(COUNTS, layout, SQ, seed=13)
    prev = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    local = torch.stack([F.local_least_squares_heads(phi, y, z, prev, layout) for phi, y, z in clients])
    counts, hess, _ = _client_stats(clients, local, layout, SQ)
    res = F.aggregate_heads_sa(local.numpy(), hess, counts, prev.numpy(), loss=SQ)  # no trust region
    assert not res.trust_bound.any()
    for m in range(3):
        phi, y = _pooled(clients, m)
        x = phi.numpy()
        a, b = 2 * x.T @ x / len(x), 2 * x.T @ y.numpy() / len(x)  # pooled mean Hessian and H w_LS
        lam = 1e-6 * np.trace(a) / 4
        assert res.damping[m] == pytest.approx(lam, rel=1e-12)
        closed_form = np.linalg.solve(a + lam * np.eye(4), b + lam * prev[m].numpy())
        np.testing.assert_allclose(res.heads[m], closed_form, atol=1e-10)
        w_ls = np.linalg.solve(a, b)
        bound = lam / (np.linalg.eigvalsh(a)[0] + lam) * np.linalg.norm(prev[m].numpy() - w_ls)
        assert np.linalg.norm(res.heads[m] - w_ls) <= bound + 1e-12


def test_wa_formula_identical_heads_and_absent_domains():
    rng = np.random.default_rng(0)
    heads = rng.standard_normal((6, 3, 5))
    prev = rng.standard_normal((3, 5))
    counts = COUNTS.copy()
    counts[:, 2] = 0  # domain 2: no samples anywhere
    wa = F.aggregate_heads_wa(heads, counts, prev)
    for m in range(2):
        np.testing.assert_allclose(wa[m], (counts[:, m, None] * heads[:, m]).sum(0) / counts[:, m].sum(), rtol=1e-13)
    np.testing.assert_array_equal(wa[2], prev[2])
    same = np.broadcast_to(heads[0], heads.shape)
    np.testing.assert_allclose(F.aggregate_heads_wa(same, COUNTS, prev), heads[0], rtol=1e-13)
    res = F.aggregate_heads("wa", heads, counts, prev)
    assert res.updated.tolist() == [True, True, False] and np.isnan(res.condition_numbers).all()


@pytest.mark.parametrize("weighting", list(F.SAWeighting))
def test_sa_with_equal_hessians_is_a_weighted_average(weighting):
    rng = np.random.default_rng(1)
    heads, prev = rng.standard_normal((6, 3, 4)), rng.standard_normal((3, 4))
    g = rng.standard_normal((3, 4, 4))
    hess = np.broadcast_to(g @ g.transpose(0, 2, 1) + 0.1 * np.eye(4), (6, 3, 4, 4))
    sa = F.aggregate_heads_sa(heads, hess, COUNTS, prev, F.SAOptions(weighting=weighting, solver="exact")).heads
    if weighting is F.SAWeighting.DOMAIN_COUNT:
        np.testing.assert_allclose(sa, F.aggregate_heads_wa(heads, COUNTS, prev), atol=1e-12)
    else:  # Eq. 7 literal: alpha_i = L_i / L over clients that hold the domain
        client_sizes = np.where(COUNTS > 0, COUNTS.sum(1, keepdims=True), 0)
        np.testing.assert_allclose(sa, F.aggregate_heads_wa(heads, client_sizes, prev), atol=1e-12)


def test_sa_ignores_clients_without_domain_samples_and_keeps_unseen_heads():
    layout = F.HeadLayout(1, 3)
    counts = COUNTS.copy()
    counts[:, 2] = 0
    clients = _client_problem(counts, layout, SQ, seed=14)
    prev = np.random.default_rng(2).standard_normal((3, 3))
    local = torch.stack([F.local_least_squares_heads(p, y, z, torch.as_tensor(prev), layout) for p, y, z in clients])
    local = local.numpy()
    cnt, hess, _ = _client_stats(clients, torch.as_tensor(local), layout, SQ)
    base = F.aggregate_heads_sa(local, hess, cnt, prev)
    garbage_heads, garbage_hess = local.copy(), hess.copy()
    garbage_heads[counts == 0] = 1e3  # absent domains: arbitrary finite uploads
    garbage_hess[counts == 0] = np.eye(3)
    other = F.aggregate_heads_sa(garbage_heads, garbage_hess, cnt, prev)
    np.testing.assert_array_equal(other.heads, base.heads)
    np.testing.assert_array_equal(base.heads[2], prev[2])
    assert base.updated.tolist() == [True, True, False] and np.isnan(base.condition_numbers[2])
    wa = F.aggregate_heads_wa(local, cnt, prev)
    np.testing.assert_array_equal(F.aggregate_heads_wa(garbage_heads, cnt, prev), wa)


def test_sa_of_local_newton_steps_is_the_pooled_newton_step_logistic():
    """Eq. 8 derivation: with Hessians at the global head, SA of local Newton steps = global Newton step."""
    layout = F.HeadLayout(1, 3, bias=True)
    counts = np.array([[6, 9], [12, 5], [7, 8]])
    clients = _client_problem(counts, layout, LOGI, seed=15)
    w0 = 0.5 * torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cnt, hess, grads = _client_stats(clients, w0, layout, LOGI)  # HessianAt.GLOBAL
    local = w0.numpy() - np.einsum("impq,imq->imp", np.linalg.inv(hess), grads)
    res = F.aggregate_heads_sa(local, hess, cnt, w0.numpy(), EXACT)
    for m in range(2):
        phi, y = _pooled(clients, m)
        pooled = F.head_statistics(phi, y, torch.zeros(len(y), dtype=torch.long), w0[m : m + 1], layout, LOGI)
        newton = w0[m].numpy() - np.linalg.solve(pooled.hessians[0].numpy(), pooled.gradients[0].numpy())
        np.testing.assert_allclose(res.heads[m], newton, atol=1e-10)


def test_softmax_singular_sum_pinv_newton_identity_and_null_space():
    layout = F.HeadLayout(3, 2, bias=True)
    counts = np.array([[4, 2], [1, 6], [5, 3]])
    clients = _client_problem(counts, layout, SOFT, seed=16)
    w0 = torch.randn(2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cnt, hess, grads = _client_stats(clients, w0, layout, SOFT)
    local = w0.numpy() - np.einsum("impq,imq->imp", np.linalg.pinv(hess, rcond=1e-12, hermitian=True), grads)
    null = _null_space_projector(layout)
    prev = w0.numpy() + np.outer([1.0, -2.0], null @ np.arange(9.0))  # prev differs in the null space
    pinv = F.aggregate_heads_sa(local, hess, cnt, prev, PINV)
    damped = F.aggregate_heads_sa(local, hess, cnt, prev)  # default: damping 1e-6
    for m in range(2):
        phi, y = _pooled(clients, m)
        pooled = F.head_statistics(phi, y, torch.zeros(len(y), dtype=torch.long), w0[m : m + 1], layout, SOFT)
        step = np.linalg.pinv(pooled.hessians[0].numpy(), rcond=1e-12, hermitian=True) @ pooled.gradients[0].numpy()
        # range part = pooled pseudo-Newton step; null-space part = that of the previous head
        range_part = np.eye(9) - null
        np.testing.assert_allclose(range_part @ pinv.heads[m], range_part @ (w0[m].numpy() - step), atol=1e-9)
        np.testing.assert_allclose(null @ pinv.heads[m], null @ prev[m], atol=1e-10)
        np.testing.assert_allclose(null @ damped.heads[m], null @ prev[m], atol=1e-10)
        np.testing.assert_allclose(damped.heads[m], pinv.heads[m], atol=1e-4)
    assert np.all(np.isfinite(damped.heads)) and np.all(damped.damping > 0)
    assert np.all(np.abs(pinv.min_eigenvalues) < 1e-12) and np.all(pinv.condition_numbers > 1e12)
    with pytest.raises(ValueError, match="singular or ill-conditioned"):
        F.aggregate_heads_sa(local, hess, cnt, prev, EXACT)
    with pytest.raises(ValueError, match="singular or ill-conditioned"):
        F.aggregate_heads_sa(local, hess, cnt, prev, UNDAMPED)
    fb = F.aggregate_heads_sa(local, hess, cnt, prev, F.SAOptions(solver="exact", fallback_to_wa=True))
    assert fb.fell_back_to_wa.all()
    np.testing.assert_allclose(fb.heads, F.aggregate_heads_wa(local, cnt, prev))


def _label_skewed_softmax_round(seed: int = 0, noise: float = 0.01):
    """One SA round on softmax heads shaped like a CNN's features under label skew: 4 clients
    with 30 samples of 2 of the 5 classes each, features = class centre (k = 16) + small noise,
    so the feature Gram has 5 strong and 11 weak directions. Each client takes 10 gradient steps
    (lr 0.5) on its head from the global head; Hessians at the local heads (Algorithm 1).
    Returns (layout, held-out data, local heads, counts, Hessians, previous head)."""
    layout = F.HeadLayout(5, 16, bias=True)
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(5, 16, generator=g, dtype=torch.float64)
    prev = 0.1 * torch.randn(1, layout.num_params, generator=g, dtype=torch.float64)
    clients, local = [], []
    for _ in range(4):
        own = torch.randperm(5, generator=g)[:2]
        y = own[torch.randint(0, 2, (30,), generator=g)]
        x = centers[y] + noise * torch.randn(30, 16, generator=g, dtype=torch.float64)
        z = torch.zeros(30, dtype=torch.long)
        w = prev.clone()
        for _ in range(10):
            w = w - 0.5 * F.head_statistics(x, y, z, w, layout, SOFT).gradients
        clients.append((x, y, z))
        local.append(w)
    y_test = torch.arange(500) % 5
    test = (centers[y_test] + noise * torch.randn(500, 16, generator=g, dtype=torch.float64), y_test)
    local = torch.stack(local)
    counts, hess, _ = _client_stats(clients, local, layout, SOFT)
    return layout, test, local.numpy(), counts, hess, prev.numpy()


def test_damped_sa_on_softmax_heads_stays_within_the_clients_steps_and_does_not_diverge():
    """Eq. 8 on softmax heads is a Newton step on a sum of local quadratic models; along the
    weak feature directions the summed Hessian is tiny and the undamped step moves the head
    18x farther than any client did, to a held-out loss 4x that of the round's starting head (on
    the default Fashion-MNIST experiment, 90x farther, and the run diverged). The default trust
    region keeps the step within the longest local step, and the head improves on the start."""
    layout, (x, y), local, counts, hess, prev = _label_skewed_softmax_round()
    z = torch.zeros(len(y), dtype=torch.long)

    def held_out_loss(heads: np.ndarray) -> float:
        return float(F.per_sample_loss(F.head_outputs(x, z, torch.as_tensor(heads), layout), y, SOFT).mean())

    longest = np.linalg.norm(local[:, 0] - prev[0], axis=-1).max()
    res = F.aggregate_heads_sa(local, hess, counts, prev)  # defaults: damped, trust radius 1
    assert np.linalg.norm(res.heads[0] - prev[0]) <= longest * (1 + 1e-6)
    assert held_out_loss(res.heads) < held_out_loss(prev) / 2
    assert res.trust_bound[0] and res.damping[0] > 1e-6 * np.trace(hess.mean(0)[0]) / layout.num_params
    # the failure it prevents: the unbounded solve (trust radius 0, the paper's Eq. 8 with the
    # 1e-6 damping floor) steps far beyond every client and raises the held-out loss
    unbounded = F.aggregate_heads_sa(local, hess, counts, prev, F.SAOptions(trust_radius=0.0))
    assert np.linalg.norm(unbounded.heads[0] - prev[0]) > 10 * longest
    assert held_out_loss(unbounded.heads) > 2 * held_out_loss(prev)
    assert not unbounded.trust_bound.any()
    # a wider trust region allows a proportionally longer step; the loss decides nothing here
    wide = F.aggregate_heads_sa(local, hess, counts, prev, F.SAOptions(trust_radius=3.0))
    assert longest < np.linalg.norm(wide.heads[0] - prev[0]) <= 3 * longest * (1 + 1e-6)
    # squared-loss Hessians get no trust region (their quadratic model is exact), nor do pinv
    # and exact solves, nor damping 0 (Eq. 8 as written)
    for kwargs in ({"loss": SQ}, {"options": PINV}):
        assert not F.aggregate_heads_sa(local, hess, counts, prev, **kwargs).trust_bound.any()


def test_pinv_on_underdetermined_domain_solves_normal_equations_nearest_prev():
    layout = F.HeadLayout(1, 5)
    counts = np.array([[1, 6], [2, 4]])  # domain 0: 3 samples in total < 5 parameters
    clients = _client_problem(counts, layout, SQ, seed=17)
    prev = np.random.default_rng(5).standard_normal((2, 5))
    local = torch.stack([F.local_least_squares_heads(p, y, z, torch.as_tensor(prev), layout) for p, y, z in clients])
    cnt, hess, _ = _client_stats(clients, local, layout, SQ)
    with pytest.raises(ValueError, match="domain 0"):
        F.aggregate_heads_sa(local.numpy(), hess, cnt, prev, EXACT)
    res = F.aggregate_heads_sa(local.numpy(), hess, cnt, prev, PINV)
    phi, y = _pooled(clients, 0)
    x = phi.numpy()
    np.testing.assert_allclose(x @ res.heads[0], y.numpy(), atol=1e-10)  # interpolates the pooled data
    delta = res.heads[0] - prev[0]
    np.testing.assert_allclose(np.linalg.pinv(x) @ x @ delta, delta, atol=1e-10)  # move within the row space
    assert np.isinf(res.condition_numbers[0])


def test_aggregation_rejects_bad_input():
    heads, prev, hess = np.zeros((2, 3, 4)), np.zeros((3, 4)), np.zeros((2, 3, 4, 4))
    counts = np.ones((2, 3))
    with pytest.raises(ValueError, match="NaN"):
        F.aggregate_heads_wa(np.full((2, 3, 4), np.nan), counts, prev)
    with pytest.raises(ValueError, match="NaN"):
        F.aggregate_heads_sa(heads, np.full_like(hess, np.inf), counts, prev)
    with pytest.raises(ValueError, match=r"\(n, M\)"):
        F.aggregate_heads_wa(heads, np.ones((3, 3)), prev)
    with pytest.raises(ValueError, match="non-negative integers"):
        F.aggregate_heads_wa(heads, -counts, prev)
    with pytest.raises(ValueError, match="non-negative integers"):
        F.aggregate_heads_wa(heads, 0.5 * counts, prev)
    with pytest.raises(ValueError, match="prev_heads"):
        F.aggregate_heads_wa(heads, counts, np.zeros((3, 5)))
    with pytest.raises(ValueError, match="hessians"):
        F.aggregate_heads_sa(heads, np.zeros((2, 3, 4, 5)), counts, prev)
    with pytest.raises(ValueError, match="Hessians"):
        F.aggregate_heads("sa", heads, counts, prev)
    with pytest.raises(ValueError, match="'xa'"):
        F.aggregate_heads("xa", heads, counts, prev)
    with pytest.raises(ValueError, match="damping"):
        F.SAOptions(damping=-1.0)
    with pytest.raises(ValueError, match="cond_threshold"):
        F.SAOptions(cond_threshold=0.5)
    with pytest.raises(ValueError, match="trust_radius"):
        F.SAOptions(trust_radius=-1.0)


def test_aggregate_encoder_weighted_average_and_layout_check():
    rng = np.random.default_rng(6)
    clients = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(3)]
    sizes = np.array([5, 0, 15])
    out = F.aggregate_encoder(clients, sizes)
    for k in range(2):
        np.testing.assert_allclose(out[k], (5 * clients[0][k] + 15 * clients[2][k]) / 20, rtol=1e-13)
    with pytest.raises(ValueError, match="layout"):
        F.aggregate_encoder([clients[0], [clients[1][0]]], [1, 1])
    with pytest.raises(ValueError, match="one weight per client"):
        F.aggregate_encoder(clients, [1, 1])
    with pytest.raises(ValueError, match="not all zero"):
        F.aggregate_encoder(clients, [0, 0, 0])
    with pytest.raises(ValueError, match="client 1: encoder array 0"):
        F.aggregate_encoder([clients[0], [np.full((3, 2), np.nan), clients[1][1]]], [1, 1])


# ------------------------------------------------------------------------------------------
# Algorithm 2 (linear variant)
# ------------------------------------------------------------------------------------------


def test_algorithm2_client_statistics_and_server_solve():
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(3, 15, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 15, generator=gen, dtype=torch.float64)
    z = torch.randint(0, 2, (3, 15), generator=gen)
    rep = np.linalg.qr(np.random.default_rng(7).standard_normal((6, 2)))[0]
    stats = F.linear_head_statistics(x, y, z, torch.as_tensor(rep), 2)
    for i in range(3):
        for m in range(2):
            p = x[i][z[i] == m].numpy() @ rep
            np.testing.assert_allclose(stats.gram[i, m].numpy(), p.T @ p, atol=1e-12)
            np.testing.assert_allclose(stats.moment[i, m].numpy(), p.T @ y[i][z[i] == m].numpy(), atol=1e-12)
    heads = F.solve_linear_heads(stats.gram.numpy(), stats.moment.numpy(), stats.counts.numpy(), np.zeros((2, 2)))
    for m in range(2):
        p = x[z == m].numpy() @ rep
        np.testing.assert_allclose(heads[m], np.linalg.lstsq(p, y[z == m].numpy(), rcond=None)[0], atol=1e-10)

    heads_t = torch.as_tensor(heads)
    grads, counts = F.linear_representation_gradient(x, y, z, rep, heads)
    for i in range(3):
        for m in range(2):
            b = torch.as_tensor(rep).clone().requires_grad_(True)
            f = 0.5 * ((y[i][z[i] == m] - x[i][z[i] == m] @ b @ heads_t[m]) ** 2).sum()
            (g,) = torch.autograd.grad(f, b)
            torch.testing.assert_close(grads[i, m], g)
    assert counts.tolist() == F.domain_counts(z, 2).tolist()

    new = F.representation_step(rep, grads.numpy(), counts.numpy(), lr=0.7)
    totals = counts.numpy().sum(0)
    expected = rep - 0.7 * sum(grads[:, m].numpy().sum(0) / totals[m] for m in range(2)) / 2
    np.testing.assert_allclose(new @ new.T, np.linalg.qr(expected)[0] @ np.linalg.qr(expected)[0].T, atol=1e-12)
    np.testing.assert_allclose(new.T @ new, np.eye(2), atol=1e-12)
    with pytest.raises(ValueError, match="lr"):
        F.representation_step(rep, grads.numpy(), counts.numpy(), lr=0.0)


def test_principal_angle_distance():
    rng = np.random.default_rng(8)
    b = rng.standard_normal((7, 3))
    assert F.principal_angle_distance(b @ rng.standard_normal((3, 3)), b) == pytest.approx(0.0, abs=1e-12)
    e = np.eye(7)
    assert F.principal_angle_distance(e[:, :2], e[:, 2:4]) == pytest.approx(1.0)
    theta = 0.3
    line = np.array([[np.cos(theta)], [np.sin(theta)]])
    assert F.principal_angle_distance(line, np.array([[1.0], [0.0]])) == pytest.approx(np.sin(theta))


def test_spectral_init_recovers_the_representation():
    """Theorem A.13: dist(B0, B*)^2 = O(1 / (n L0)); 16x more samples shrink dist by > 2x."""
    problem = S.make_domain_mixed_linear_problem(num_clients=20, num_domains=4, dim=8, rep_dim=2, rng=9)
    dists = []
    for samples in (100, 1600):
        data = problem.sample(samples, 1e-3, np.random.default_rng(1), torch.float64)
        rep0 = F.spectral_init(F.spectral_statistic(data.x, data.y).numpy(), 20 * samples, 2)
        np.testing.assert_allclose(rep0.T @ rep0, np.eye(2), atol=1e-12)
        dists.append(F.principal_angle_distance(rep0, problem.rep_star))
    # problem and sample seeds 0-7 (rng=s for both): dist 0.183..0.317 at 100 samples, 0.057..0.086
    # at 1600, ratio 2.40..5.01
    assert dists[1] < 0.1 and dists[1] < dists[0] / 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_algorithm2_converges_linearly(seed):
    """Spec 7.2: n=100, M=5, d=20, k=2, L=L0=20, eta=1, sigma=1e-3 (reference: 0.18 @5, 6e-3 @20)."""
    problem = S.make_domain_mixed_linear_problem(rng=seed)
    dist = S.run_algorithm2(problem, rounds=100, lr=1.0, seed=seed)
    # seeds 0-7: dist[30] / dist[5] 0.0035..0.0046, dist[100] 6.6e-5..9.8e-5, observed rate
    # (dist[20] / dist[0])^(1/20) 0.803..0.811 against the bound 0.955..0.961
    assert dist[30] <= dist[5] / 10
    assert dist[100] < 1e-3
    # Theorem A.4's rate sqrt(1 - eta E0 sigma_min^2 / 2) bounds the observed geometric decay
    sigma_min2 = np.linalg.svd(problem.heads_star / np.sqrt(5), compute_uv=False)[-1] ** 2
    rate = np.sqrt(1 - (1 - dist[0] ** 2) * sigma_min2 / 2)
    assert (dist[20] / dist[0]) ** (1 / 20) < rate


# ------------------------------------------------------------------------------------------
# Fig. 1: synthetic domain-mixed linear regression
# ------------------------------------------------------------------------------------------

FIG1 = dict(num_clients=100, num_domains=5, rep_dim=2, dim=20, dtype=torch.float64)
PER_DOMAIN = S.MixtureConcentration.ALPHA_PER_DOMAIN


# T = 400 rounds, not the paper's 300: at T = 300 SA ended at 1.2e-4 on seed 6 (Dir(0.4) per
# domain) and 9.2e-4 with the Dir(alpha p) reading, above the 1e-4 bound; that seed sits on a
# plateau until round ~150 and then converges linearly like the others (2.4e-6 / 2.8e-5 at 400).
FIG1_ROUNDS = 400


@functools.lru_cache(maxsize=None)
def _fig1(method: str, seed: int, samples: int = 10, concentration: S.MixtureConcentration = PER_DOMAIN) -> float:
    """Final test MSE of a Fig. 1 method at T = FIG1_ROUNDS (cached: several tests share runs)."""
    data = S.make_feddar_synthetic(seed=seed, samples_per_client=samples, concentration=concentration, **FIG1)
    return S.run_fig1(method, data, S.Fig1Config(rounds=FIG1_ROUNDS, seed=seed)).test_mse


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fig1_sa_converges_and_wa_fails(seed):
    """L=10, T=400, Dir(0.4) per domain: SA < 1e-4, WA > 1e-2 (reference: SA ~5e-8, WA 0.4-3).

    Seeds 0-7 at T=400: SA 4.6e-8..2.4e-6 (seed 6), WA 0.30..6.6.
    """
    sa = _fig1("feddar_sa", seed)
    wa = _fig1("feddar_wa", seed)
    assert sa < 1e-4
    assert wa > 1e-2


def test_fig1_sa_beats_baselines_by_two_orders():
    """L=10, T=400, seed 0: FedAvg > 0.1 and SA at least 100x below FedAvg, FedRep, Local-Only and
    FedDAR-WA (seeds 0-7: FedAvg 0.29..0.41, best baseline / SA 1.4e5..7.9e6). Separate FedAvg is checked against its pooled least-squares limit below."""
    results = {m: _fig1(m, 0) for m in ("feddar_sa", "feddar_wa", "fedavg", "fedrep", "local")}
    assert results["fedavg"] > 0.1
    best_baseline = min(v for k, v in results.items() if k != "feddar_sa")
    assert results["feddar_sa"] * 100 <= best_baseline, results


def test_fig1_sa_converges_with_paper_mixture_reading():
    """Dir(alpha p) read literally (0.08 per domain): SA still reaches < 1e-4 (seeds 0-7 at
    T=400: 3.8e-8..2.8e-5, seed 6 the largest)."""
    assert _fig1("feddar_sa", 0, concentration=S.MixtureConcentration.ALPHA_TIMES_PRIOR) < 1e-4


def test_fig1_separate_fedavg_reaches_pooled_least_squares():
    """Separate FedAvg (one d-dim linear model per domain) converges to per-domain pooled least
    squares; with ~200 samples per domain (d=20) that is ~1e-7, so its gap to SA is small.
    Seeds 0-7: pooled least squares 8.9e-8..1.4e-7, Separate FedAvg / it 0.97..1.26."""
    data = S.make_feddar_synthetic(seed=0, samples_per_client=10, concentration=PER_DOMAIN, **FIG1)
    mse = S.run_fig1("separate_fedavg", data, S.Fig1Config(rounds=150)).test_mse
    x, y, z = data.train.x.reshape(-1, 20), data.train.y.reshape(-1), data.train.z.reshape(-1)
    coef = torch.stack([torch.linalg.lstsq(x[z == m], y[z == m][:, None]).solution[:, 0] for m in range(5)])
    xt, yt, zt = data.test.x.reshape(-1, 20), data.test.y.reshape(-1), data.test.z.reshape(-1)
    ls_mse = ((xt * coef[zt]).sum(-1) - yt).pow(2).mean().item()
    assert ls_mse < 1e-6
    assert mse < 1.5 * ls_mse


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="full Fig. 1 grid (3 seeds x L in {5, 10, 20}, ~3 min); set FLWR_PFL_LONG_TESTS=1")
@pytest.mark.parametrize("samples", [5, 10, 20])
def test_fig1_full_grid(samples):
    for seed in range(3):
        res = {m: _fig1(m, seed, samples) for m in ("feddar_sa", "feddar_wa", "fedavg", "fedrep", "local")}
        assert res["feddar_sa"] < 1e-4, (samples, seed, res)
        assert res["fedavg"] > 0.1, (samples, seed, res)
        best_baseline = min(v for k, v in res.items() if k != "feddar_sa")
        assert res["feddar_sa"] * 100 <= best_baseline, (samples, seed, res)
