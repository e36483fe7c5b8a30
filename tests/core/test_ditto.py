"""Ditto's personal objective (Li et al., ICML 2021, Eq. 2) and its personal update (Alg. 1)
against closed forms on least squares, F(v) = (1/2n) ||X a + b - y||^2, whose gradient is
(X^T r / n, mean(r)) with r the residual, written out in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.core.ditto import check_lam, personal_gradient, personal_objective, personal_regularizer, personal_step
from flwr_pfl.training import OptimizerConfig, train

LAM, LR = 0.85, 0.3


def problem(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.normal(size=(9, 3)), g.normal(size=9)


def params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(1, 3, generator=g, dtype=torch.float64),
            "bias": torch.randn(1, generator=g, dtype=torch.float64)}


def least_squares(v: dict[str, torch.Tensor], X: np.ndarray, y: np.ndarray) -> torch.Tensor:
    out = torch.as_tensor(X) @ v["weight"].reshape(-1) + v["bias"]
    return 0.5 * ((out - torch.as_tensor(y)) ** 2).mean()


def closed_form_grad_f(v: dict[str, torch.Tensor], X: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    a, b = v["weight"].detach().numpy().reshape(-1), float(v["bias"].detach())
    r = X @ a + b - y
    return {"weight": (X.T @ r / len(y)).reshape(1, 3), "bias": np.array([r.mean()])}


def test_the_objective_is_f_plus_half_lambda_times_the_squared_distance_and_its_gradient_the_closed_form():
    X, y = problem()
    w = params(1)  # the received global model w^t
    v = {k: t.clone().requires_grad_(True) for k, t in params(2).items()}  # the personal model, != w^t
    value = personal_objective(least_squares(v, X, y), v, w, LAM)
    distance = sum(float(((v[k].detach() - w[k]) ** 2).sum()) for k in v)
    assert float(value.detach()) == pytest.approx(float(least_squares(v, X, y).detach()) + 0.5 * LAM * distance, rel=1e-12)
    autograd = dict(zip(v, torch.autograd.grad(value, list(v.values()))))
    grad_f = closed_form_grad_f(v, X, y)
    closed = personal_gradient({k: torch.as_tensor(g) for k, g in grad_f.items()}, v, w, LAM)
    for k in v:
        expected = grad_f[k] + LAM * (v[k].detach().numpy() - w[k].numpy())  # grad F(v) + lambda (v - w^t)
        np.testing.assert_allclose(autograd[k].numpy(), expected, rtol=1e-12)
        np.testing.assert_allclose(closed[k].numpy(), expected, rtol=1e-12)


def test_one_personal_step_is_v_minus_lr_times_the_closed_form_gradient():
    X, y = problem()
    w, v = params(1), params(2)
    grad_f = closed_form_grad_f(v, X, y)
    stepped = personal_step(v, {k: torch.as_tensor(g) for k, g in grad_f.items()}, w, LAM, LR)
    for k in v:
        expected = v[k].numpy() - LR * (grad_f[k] + LAM * (v[k].numpy() - w[k].numpy()))
        np.testing.assert_allclose(stepped[k].numpy(), expected, rtol=1e-12)


def test_the_regularizer_anchors_at_the_model_as_it_was_when_built_and_one_train_step_is_the_personal_step():
    """The client builds the regularizer while the module holds w^t, then trains the global model
    and swaps v_k into the same module: the anchor must stay w^t through both."""
    X, y = problem()
    model = nn.Linear(3, 1).double()
    w = params(1)
    model.load_state_dict(w)
    regularizer = personal_regularizer(model, LAM)  # anchored now, at w^t
    with torch.no_grad():  # what the global update does to the module before the personal one
        model.weight.add_(10.0)
    v = params(2)
    model.load_state_dict(v)  # the personal model swapped in
    data = DataLoader(TensorDataset(torch.as_tensor(X), torch.as_tensor(y)), batch_size=len(y))

    def half_squared_error(m, xb, yb, db):
        return 0.5 * (m(xb).reshape(-1) - yb) ** 2

    train(model, data, optimizer=OptimizerConfig("sgd", LR), device=torch.device("cpu"),
          loss_fn=half_squared_error, regularizer=regularizer)
    grad_f = closed_form_grad_f(v, X, y)
    for k, got in model.state_dict().items():
        expected = v[k].numpy() - LR * (grad_f[k] + LAM * (v[k].numpy() - w[k].numpy()))
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10)


def test_lambda_zero_adds_nothing_and_bad_lambdas_are_refused():
    assert personal_regularizer(nn.Linear(2, 1), 0.0) is None  # v_k trains on F_k alone
    v = {k: t.clone().requires_grad_(True) for k, t in params(2).items()}
    loss = torch.tensor(1.25, dtype=torch.float64)
    assert float(personal_objective(loss, v, params(1), 0).detach()) == 1.25
    assert check_lam(2) == 2.0 and isinstance(check_lam(2), float)
    for bad in (-0.1, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="lambda"):
            check_lam(bad)
