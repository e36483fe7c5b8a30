"""APFL's mixture and its gradients (Deng et al., 2020, Sec. 3 and Alg. 1) against closed forms on a
quadratic, f(theta) = 1/2 (theta - c)^T A (theta - c), whose gradient A (theta - c) is written out
in numpy, and against autograd through alpha on a softmax regression."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flwr_pfl.core.apfl import alpha_gradient, alpha_step, check_alpha, mix, mixed_state, personal_gradient

ALPHA = 0.3


def quadratic(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    m = g.normal(size=(5, 5))
    return m @ m.T + np.eye(5), g.normal(size=5)  # A symmetric positive definite, c


def split(theta: np.ndarray) -> dict[str, torch.Tensor]:
    """A 5-vector as two named float64 tensors, as a model's parameters are."""
    return {"a": torch.as_tensor(theta[:3].reshape(3, 1)), "b": torch.as_tensor(theta[3:].copy())}


def flat(named: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([named["a"].numpy().reshape(-1), named["b"].numpy().reshape(-1)])


def test_the_mixture_is_alpha_v_plus_one_minus_alpha_w_and_takes_buffers_from_v():
    g = np.random.default_rng(1)
    v, w = g.normal(size=5), g.normal(size=5)
    np.testing.assert_allclose(flat(mix(split(v), split(w), ALPHA)), ALPHA * v + (1 - ALPHA) * w, rtol=1e-14)
    np.testing.assert_allclose(flat(mix(split(v), split(w), 1.0)), v)  # alpha = 1: the personal model
    np.testing.assert_allclose(flat(mix(split(v), split(w), 0.0)), w)  # alpha = 0: the global model
    personal = {**split(v), "running_mean": torch.tensor([7.0]), "steps": torch.tensor(4)}
    global_ = {**split(w), "running_mean": torch.tensor([-1.0]), "steps": torch.tensor(9)}
    state = mixed_state(personal, global_, ALPHA, ["a", "b"])
    assert list(state) == list(personal)  # state_dict order kept
    np.testing.assert_allclose(flat(state), ALPHA * v + (1 - ALPHA) * w, rtol=1e-14)
    assert float(state["running_mean"]) == 7.0 and int(state["steps"]) == 4 and state["steps"].dtype == torch.int64


def test_the_gradients_in_v_and_alpha_are_the_closed_forms_of_the_quadratic():
    A, c = quadratic()
    g = np.random.default_rng(2)
    v, w = g.normal(size=5), g.normal(size=5)
    v_bar = ALPHA * v + (1 - ALPHA) * w
    grad_at_mix = A @ (v_bar - c)  # grad f(v_bar), closed form
    # d/dv f(alpha v + (1-alpha) w) = alpha A (v_bar - c); d/dalpha = (v - w)^T A (v_bar - c)
    np.testing.assert_allclose(flat(personal_gradient(split(grad_at_mix), ALPHA)), ALPHA * A @ (v_bar - c), rtol=1e-13)
    expected = float((v - w) @ A @ (v_bar - c))
    assert alpha_gradient(split(v), split(w), split(grad_at_mix)) == pytest.approx(expected, rel=1e-12)
    # and a central finite difference of alpha -> f(alpha v + (1 - alpha) w)
    f = lambda a: 0.5 * (a * v + (1 - a) * w - c) @ A @ (a * v + (1 - a) * w - c)  # noqa: E731
    h = 1e-6
    assert (f(ALPHA + h) - f(ALPHA - h)) / (2 * h) == pytest.approx(expected, rel=1e-6)


def test_the_gradients_match_autograd_through_the_mixture_on_a_softmax_regression():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(11, 4, generator=g, dtype=torch.float64), torch.arange(11) % 3
    v = {"W": torch.randn(3, 4, generator=g, dtype=torch.float64), "b": torch.randn(3, generator=g, dtype=torch.float64)}
    w = {"W": torch.randn(3, 4, generator=g, dtype=torch.float64), "b": torch.randn(3, generator=g, dtype=torch.float64)}
    loss = lambda p: F.cross_entropy(x @ p["W"].T + p["b"], y)  # noqa: E731
    # autograd on alpha and v directly, the mixture spelled out here
    alpha = torch.tensor(ALPHA, dtype=torch.float64, requires_grad=True)
    v_leaf = {k: t.clone().requires_grad_(True) for k, t in v.items()}
    value = loss({k: alpha * v_leaf[k] + (1 - alpha) * w[k] for k in v})
    d_alpha, d_w, d_b = torch.autograd.grad(value, [alpha, v_leaf["W"], v_leaf["b"]])
    # the core's formulas from grad f at the mixture
    mixed = {k: t.clone().requires_grad_(True) for k, t in mix(v, w, ALPHA).items()}
    grad_at_mix = dict(zip(mixed, torch.autograd.grad(loss(mixed), list(mixed.values()))))
    assert alpha_gradient(v, w, grad_at_mix) == pytest.approx(float(d_alpha), rel=1e-12)
    direction = personal_gradient(grad_at_mix, ALPHA)
    torch.testing.assert_close(direction["W"], d_w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(direction["b"], d_b, rtol=1e-12, atol=1e-14)


def test_the_alpha_step_descends_and_is_projected_onto_zero_one():
    assert alpha_step(0.4, 2.0, 0.05) == pytest.approx(0.3)
    assert alpha_step(0.4, -2.0, 0.05) == pytest.approx(0.5)
    assert alpha_step(0.1, 5.0, 0.1) == 0.0
    assert alpha_step(0.9, -5.0, 0.1) == 1.0
    with pytest.raises(FloatingPointError, match="alpha"):
        alpha_step(0.5, float("nan"), 0.1)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_alpha_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_alpha(bad)
    assert check_alpha(1) == 1.0 and check_alpha(0.0) == 0.0
