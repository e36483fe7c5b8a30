"""FedAMP's mathematics (Huang et al., AAAI 2021, Eq. 3-6) against closed forms and recomputations
written another way: the attention weights of Eq. 5 from known distances, the cloud model as the
weighted sum of Eq. 5 (Python loops) and as the gradient step of Eq. 3 (autograd), the distances
over the parameters only, and the proximal term of Eq. 6 as FedProx's with mu = lambda / alpha_k."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import flwr_pfl.core.fedamp as core
from flwr_pfl.core.fedamp import (
    attention,
    attention_derivative,
    check_hyperparameters,
    client_regularizer,
    cloud_model,
    message_weights,
    proximal_coefficient,
    self_weight_lower_bound,
    squared_distances,
)
from flwr_pfl.errors import ConfigError


def stacks_of(models: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Client models (lists of arrays) as the server stacks them: one (m, *shape) array per slot."""
    return [np.stack([m[a] for m in models]) for a in range(len(models[0]))]


def three_models() -> tuple[list[list[np.ndarray]], list[bool]]:
    """Three clients: a (2, 2) weight, a (2,) bias (parameters), a running mean (buffer, far apart
    between clients) and an integer counter."""
    g = np.random.default_rng(3)
    models = []
    for i in range(3):
        models.append([
            (g.normal(size=(2, 2)) * (0.3 + 0.4 * i)).astype(np.float32),
            (g.normal(size=2) * 0.5).astype(np.float32),
            np.full(2, 100.0 * i, np.float32),
            np.array(7 * i + 1, np.int64),
        ])
    return models, [True, True, False, False]


# ------------------------------------------------------------------------------ A and A'
def test_the_attention_function_is_the_papers_and_its_derivative_is_exp_over_sigma():
    x = torch.tensor([0.0, 0.3, 2.0, 11.0], dtype=torch.float64, requires_grad=True)
    sigma = 2.5
    a = 1 - torch.exp(-x / sigma)
    (grad,) = torch.autograd.grad(a.sum(), x)
    np.testing.assert_allclose(attention(x.detach().numpy(), sigma), a.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(attention_derivative(x.detach().numpy(), sigma), grad.numpy(), rtol=1e-12)
    assert attention(0.0, sigma) == 0.0 and attention_derivative(0.0, sigma) == pytest.approx(1 / sigma)


# ------------------------------------------------------------------------------ Eq. 5's weights
def test_three_clients_with_known_distances_get_the_weights_written_out():
    alpha, sigma = 0.5, 2.0
    xi = message_weights(np.array([9.0, 1.0, 4.0]), 0, alpha, sigma)  # its own entry is ignored
    x01 = alpha * math.exp(-1.0 / 2.0) / 2.0
    x02 = alpha * math.exp(-4.0 / 2.0) / 2.0
    np.testing.assert_allclose(xi, [1 - x01 - x02, x01, x02], rtol=1e-14)
    assert xi.sum() == pytest.approx(1.0, abs=1e-15)
    assert xi[1] > xi[2]  # the closer client weighs more


def test_sigma_scales_the_weights_at_zero_distance_and_widens_the_attention():
    alpha = 0.1
    near = [message_weights(np.array([0.0, 0.0]), 0, alpha, s)[1] for s in (1.0, 2.0)]
    assert near == [pytest.approx(0.1), pytest.approx(0.05)]  # alpha / sigma
    far = [message_weights(np.array([0.0, 6.0]), 0, alpha, s)[1] for s in (1.0, 2.0)]
    assert far[0] == pytest.approx(0.1 * math.exp(-6.0)) and far[1] == pytest.approx(0.05 * math.exp(-3.0))
    assert far[1] > far[0]  # a larger sigma gives distant models more weight


def test_the_own_weight_goes_negative_exactly_past_the_bound():
    # m = 5 identical models: every other weight is alpha / sigma, xi_ii = 1 - 4 alpha / sigma
    assert self_weight_lower_bound(5, 0.25, 1.0) == pytest.approx(0.0)
    for alpha, expected in ((0.2, 0.2), (0.25, 0.0), (0.5, -1.0)):
        xi = message_weights(np.zeros(5), 2, alpha, 1.0)
        assert xi[2] == pytest.approx(expected, abs=1e-15) and xi.sum() == pytest.approx(1.0)
        assert xi[2] == pytest.approx(self_weight_lower_bound(5, alpha, 1.0), abs=1e-15)


def test_a_client_alone_gets_weight_one_and_its_own_model():
    models, mask = three_models()
    stacks = stacks_of(models[:1])
    xi = message_weights(squared_distances(stacks, 0, mask), 0, 3.0, 0.01)
    assert xi.tolist() == [1.0]
    for got, own in zip(cloud_model(stacks, 0, xi, mask), models[0]):
        assert got.dtype == own.dtype and np.array_equal(got, own)


# ------------------------------------------------------------------------------ distances and u_i
def test_distances_are_over_the_parameters_only():
    models, mask = three_models()
    stacks = stacks_of(models)
    for i in range(3):
        d = squared_distances(stacks, i, mask)
        for j in range(3):
            flat = [np.concatenate([models[k][a].ravel().astype(np.float64) for a in (0, 1)]) for k in (i, j)]
            assert d[j] == pytest.approx(float(((flat[0] - flat[1]) ** 2).sum()), rel=1e-12)
        everything = squared_distances(stacks, i, [True, True, True, False])
        assert everything[(i + 1) % 3] > d[(i + 1) % 3] + 1000  # the buffers would dominate


def test_the_cloud_model_is_eq5s_weighted_sum_with_the_clients_own_buffers():
    models, mask = three_models()
    stacks = stacks_of(models)
    alpha, sigma = 0.3, 1.5
    for i in range(3):
        xi = message_weights(squared_distances(stacks, i, mask), i, alpha, sigma)
        u = cloud_model(stacks, i, xi, mask)
        for a in (0, 1):  # sum_j xi_ij w_j, by loops in float64
            expected = np.zeros(models[0][a].shape)
            for j in range(3):
                expected = expected + xi[j] * models[j][a].astype(np.float64)
            np.testing.assert_allclose(u[a], expected, rtol=1e-6, atol=1e-7)
            assert u[a].dtype == np.float32
        assert np.array_equal(u[2], models[i][2]) and u[3] == models[i][3] and u[3].dtype == np.int64
        assert not np.allclose(u[0], models[i][0])  # the others pull


def test_the_cloud_model_is_a_gradient_step_of_size_alpha_on_the_attention_term():
    """u_i = w_i - alpha_k grad_{w_i} (1/2) sum_{j != i} A(||w_i - w_j||^2) (Eq. 3 row i, the
    factor 2 of the squared norm absorbed as the paper's Eq. 5 prints it), by autograd."""
    models, mask = three_models()
    stacks = stacks_of(models)
    alpha, sigma = 0.7, 0.9
    vectors = [torch.tensor(np.concatenate([m[0].ravel(), m[1].ravel()]), dtype=torch.float64) for m in models]
    for i in range(3):
        w = vectors[i].clone().requires_grad_(True)
        term = sum(0.5 * (1 - torch.exp(-((w - vectors[j]) ** 2).sum() / sigma)) for j in range(3) if j != i)
        (grad,) = torch.autograd.grad(term, w)
        expected = (vectors[i] - alpha * grad).numpy()
        xi = message_weights(squared_distances(stacks, i, mask), i, alpha, sigma)
        u = cloud_model(stacks, i, xi, mask)
        np.testing.assert_allclose(np.concatenate([u[0].ravel(), u[1].ravel()]), expected, rtol=1e-6, atol=1e-7)


def test_identical_or_distant_models_leave_the_own_model_unchanged_bit_for_bit():
    models, mask = three_models()
    same = stacks_of([models[1]] * 4)
    xi = message_weights(squared_distances(same, 2, mask), 2, 0.4, 1.0)  # xi_ii = -0.2: still exact
    assert all(np.array_equal(u, w) for u, w in zip(cloud_model(same, 2, xi, mask), models[1]))
    far = [[a * 1000 if a.dtype.kind == "f" else a for a in m] for m in models]
    stacks = stacks_of(far)
    xi = message_weights(squared_distances(stacks, 0, mask), 0, 0.4, 1.0)
    assert xi.tolist() == [1.0, 0.0, 0.0]
    assert all(np.array_equal(u, w) for u, w in zip(cloud_model(stacks, 0, xi, mask), far[0]))


def test_blocks_of_rows_give_the_same_numbers(monkeypatch):
    g = np.random.default_rng(0)
    stacks = [g.normal(size=(7, 3, 5)).astype(np.float32), g.normal(size=(7, 4)).astype(np.float32)]
    mask = [True, True]
    d = squared_distances(stacks, 4, mask)
    xi = message_weights(d, 4, 0.05, 3.0)
    u = cloud_model(stacks, 4, xi, mask)
    monkeypatch.setattr(core, "BLOCK_VALUES", 8)  # one or two rows per block
    np.testing.assert_allclose(squared_distances(stacks, 4, mask), d, rtol=1e-13)
    for a, b in zip(cloud_model(stacks, 4, xi, mask), u):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_weights_that_do_not_sum_to_one_or_a_short_mask_are_refused():
    models, mask = three_models()
    stacks = stacks_of(models)
    with pytest.raises(ValueError, match="sum to 1"):
        cloud_model(stacks, 0, np.array([0.5, 0.2, 0.2]), mask)
    with pytest.raises(ValueError, match="mask"):
        squared_distances(stacks, 0, mask[:2])


# ------------------------------------------------------------------------------ Eq. 6
def test_the_clients_proximal_term_is_lambda_over_two_alpha_times_the_squared_distance():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    lam, alpha = 0.6, 0.25
    regularizer = client_regularizer(model, lam, alpha)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape))
    value = regularizer(model)
    by_hand = lam / (2 * alpha) * sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
    assert float(value.detach()) == pytest.approx(float(by_hand.detach()), rel=1e-6)
    grads = torch.autograd.grad(value, list(model.parameters()))
    for (n, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(g, (lam / alpha) * (p.detach() - anchor[n]))  # the proximal gradient
    assert proximal_coefficient(lam, alpha) == pytest.approx(2.4)
    assert client_regularizer(model, 0.0, alpha) is None  # lambda = 0: F_i alone


@pytest.mark.parametrize(("alpha", "lam", "sigma", "key"), [
    (0.0, 1.0, 1.0, "alpha-k"), (float("inf"), 1.0, 1.0, "alpha-k"), (1.0, -0.1, 1.0, "lam"),
    (1.0, float("nan"), 1.0, "lam"), (1.0, 1.0, 0.0, "sigma"), (1.0, 1.0, True, "sigma"),
])
def test_bad_hyperparameters_name_their_key(alpha, lam, sigma, key):
    with pytest.raises(ConfigError, match=f"^x.{key} must be"):
        check_hyperparameters(alpha, lam, sigma, lambda name: f"x.{name}")
    check_hyperparameters(1.0, 0.0, 1.0)  # lambda = 0 is allowed
