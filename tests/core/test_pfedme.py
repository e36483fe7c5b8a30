"""pFedMe's mathematics (T. Dinh et al., NeurIPS 2020, Eq. 7 and Alg. 1) against closed forms:
the inner Moreau-envelope solve on a quadratic f, whose minimiser is
theta* = (A + lambda I)^{-1} (b + lambda w), and whose K-step gradient descent has the closed
form theta_K - theta* = (I - lr (A + lambda I))^K (theta_0 - theta*); the local update and the
server's beta step against their formulas written out in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_pfl.core.pfedme import check_lam, inner_objective, inner_solve, inner_step, outer_step, server_step

LAM, LR = 2.5, 0.05


def quadratic(seed: int = 0, d: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """A symmetric positive definite A and a vector b: f(theta) = 1/2 theta^T A theta - b^T theta."""
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(d, d))
    return m @ m.T / d + 0.5 * np.eye(d), rng.normal(size=d)


def loss_of(a: np.ndarray, b: np.ndarray):
    at, bt = torch.tensor(a), torch.tensor(b)

    def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
        theta = params["theta"]
        return 0.5 * theta @ at @ theta - bt @ theta

    return f


def closed_form(a: np.ndarray, b: np.ndarray, w: np.ndarray, lam: float) -> np.ndarray:
    return np.linalg.solve(a + lam * np.eye(len(b)), b + lam * w)


def test_the_inner_solve_converges_to_the_closed_form_prox_of_a_quadratic():
    a, b = quadratic()
    w = np.array([0.3, -1.2, 2.0, 0.7])
    theta0 = {"theta": torch.zeros(4, dtype=torch.float64)}
    out = inner_solve(theta0, {"theta": torch.tensor(w)}, loss_of(a, b), LAM, LR, k=600)
    np.testing.assert_allclose(out["theta"].numpy(), closed_form(a, b, w, LAM), rtol=1e-9, atol=1e-10)
    # the theta* of another lambda is another point: lambda is really used
    assert not np.allclose(closed_form(a, b, w, LAM), closed_form(a, b, w, 2 * LAM), atol=1e-3)


def test_k_steps_follow_the_closed_form_contraction():
    """theta_K - theta* = (I - lr (A + lambda I))^K (theta_0 - theta*), for a small K."""
    a, b = quadratic(seed=3)
    w, theta0, k = np.array([1.0, 0.0, -2.0, 0.5]), np.array([0.2, 0.4, -0.1, 3.0]), 3
    star = closed_form(a, b, w, LAM)
    contraction = np.linalg.matrix_power(np.eye(4) - LR * (a + LAM * np.eye(4)), k)
    expected = star + contraction @ (theta0 - star)
    out = inner_solve({"theta": torch.tensor(theta0)}, {"theta": torch.tensor(w)}, loss_of(a, b), LAM, LR, k)
    np.testing.assert_allclose(out["theta"].numpy(), expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(expected, star, atol=1e-3)  # 3 steps are not the solution: K matters


def test_one_inner_step_is_the_gradient_step_on_eq7_and_the_objective_matches_autograd():
    a, b = quadratic(seed=1)
    w, theta = np.array([0.5, 0.5, -1.0, 2.0]), np.array([1.0, -1.0, 0.0, 0.3])
    grad_f = a @ theta - b
    step = inner_step({"theta": torch.tensor(theta)}, {"theta": torch.tensor(grad_f)}, {"theta": torch.tensor(w)}, LAM, LR)
    np.testing.assert_allclose(step["theta"].numpy(), theta - LR * (grad_f + LAM * (theta - w)), rtol=1e-13)
    leaf = torch.tensor(theta, requires_grad=True)
    h = inner_objective(loss_of(a, b)({"theta": leaf}), {"theta": leaf}, {"theta": torch.tensor(w)}, LAM)
    expected = 0.5 * theta @ a @ theta - b @ theta + 0.5 * LAM * np.sum((theta - w) ** 2)
    assert float(h.detach()) == pytest.approx(expected, rel=1e-13)
    (grad,) = torch.autograd.grad(h, leaf)
    np.testing.assert_allclose(grad.numpy(), grad_f + LAM * (theta - w), rtol=1e-12)


def test_the_local_update_moves_w_towards_theta_by_eta_lambda():
    w = {"x": torch.tensor([1.0, -2.0], dtype=torch.float64), "y": torch.tensor([[0.5]], dtype=torch.float64)}
    theta = {"x": torch.tensor([3.0, 0.0], dtype=torch.float64), "y": torch.tensor([[-1.5]], dtype=torch.float64)}
    eta, lam = 0.03, 7.0
    out = outer_step(w, theta, lam, eta)
    for name in w:
        expected = w[name].numpy() - eta * lam * (w[name].numpy() - theta[name].numpy())
        np.testing.assert_allclose(out[name].numpy(), expected, rtol=1e-13)
    # with eta * lambda = 1 the local model jumps onto theta
    np.testing.assert_allclose(outer_step(w, theta, 4.0, 0.25)["x"].numpy(), theta["x"].numpy())


def test_the_server_step_mixes_the_average_with_the_previous_model_by_beta():
    previous = [np.array([1.0, 2.0], np.float32), np.array([[4.0]], np.float32), np.array(10, np.int64)]
    average = [np.array([3.0, -1.0], np.float32), np.array([[5.0]], np.float32), np.array(14, np.int64)]
    beta = 1.7
    out = server_step(previous, average, beta)
    np.testing.assert_allclose(out[0], (1 - beta) * previous[0] + beta * average[0], rtol=1e-6)
    np.testing.assert_allclose(out[0], [4.4, -3.1], rtol=1e-6)  # 2 w_avg - w^t style extrapolation
    np.testing.assert_allclose(out[1], [[5.7]], rtol=1e-6)
    assert out[2] == 14 and out[2].dtype == np.int64  # an integer counter takes the average
    assert out[0].dtype == np.float32
    # beta = 1 is the average itself, bit for bit
    for got, avg in zip(server_step(previous, average, 1.0), average):
        assert got.dtype == avg.dtype and got.tobytes() == avg.tobytes()
    # an array flagged as not moving (a buffer) takes the average as it is
    kept = server_step(previous, average, beta, moves=[True, False, False])
    np.testing.assert_array_equal(kept[1], average[1])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="lambda"):
        check_lam(0.0)
    with pytest.raises(ValueError, match="lambda"):
        check_lam(float("nan"))
    with pytest.raises(ValueError, match="beta"):
        server_step([np.zeros(1)], [np.zeros(1)], 0.0)
    with pytest.raises(ValueError, match="one flag per array"):
        server_step([np.zeros(1)], [np.zeros(1)], 1.5, moves=[True, True])
    with pytest.raises(ValueError, match="layout"):
        server_step([np.zeros(2)], [np.zeros(1)], 1.5)
    theta = {"theta": torch.zeros(2, dtype=torch.float64)}
    with pytest.raises(ValueError, match="K"):
        inner_solve(theta, theta, lambda p: p["theta"].sum(), LAM, LR, k=0)
    with pytest.raises(ValueError, match="learning rate"):
        inner_solve(theta, theta, lambda p: p["theta"].sum(), LAM, 0.0, k=1)
