"""The proximal term of FedProx (Li et al., MLSys 2020, Eq. 2) against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_pfl.core.proximal import proximal_gradient, proximal_regularizer, proximal_value
from flwr_pfl.training import OptimizerConfig, train


def named(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 2, generator=g, dtype=torch.float64), "b": torch.randn(2, generator=g, dtype=torch.float64)}


def test_value_is_half_mu_times_the_squared_distance():
    w, w0, mu = named(0), named(1), 0.37
    expected = 0.5 * mu * sum(float(((w[k] - w0[k]) ** 2).sum()) for k in w)
    assert float(proximal_value(w, w0, mu)) == pytest.approx(expected, rel=1e-12)
    assert float(proximal_value(w, w, mu)) == 0.0
    assert float(proximal_value({}, w0, mu)) == 0.0


def test_gradient_is_mu_times_the_difference_and_matches_autograd():
    w0, mu = named(1), 0.37
    w = {k: v.clone().requires_grad_(True) for k, v in named(0).items()}
    grads = dict(zip(w, torch.autograd.grad(proximal_value(w, w0, mu), list(w.values()))))
    closed = proximal_gradient(w, w0, mu)
    for k in w:
        np.testing.assert_allclose(closed[k].numpy(), mu * (w[k].detach() - w0[k]).numpy(), rtol=1e-12)
        np.testing.assert_allclose(grads[k].numpy(), closed[k].numpy(), rtol=1e-12)


def test_negative_mu_and_missing_anchor_are_refused():
    with pytest.raises(ValueError, match="mu"):
        proximal_value(named(0), named(1), -0.1)
    with pytest.raises(ValueError, match="anchor"):
        proximal_value({"other": torch.zeros(1)}, named(1), 0.1)
    assert proximal_regularizer(nn.Linear(2, 1), 0.0) is None  # mu = 0 is FedAvg: no term at all


def test_one_sgd_step_with_the_proximal_term_is_the_hand_computed_step():
    """Least squares F(w) = (1/2n)||X w + b - y||^2 from w_s, anchored at w0 != w_s: one full-batch
    SGD step is w_s - lr (X^T r / n + mu (w_s - w0)), r the residual (Eq. 2's gradient)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
    regularizer = proximal_regularizer(model, mu=0.8)  # anchored now, at w0
    with torch.no_grad():
        model.weight.add_(0.5)
        model.bias.sub_(0.25)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = torch.randn(7, generator=g, dtype=torch.float64)

    def half_squared_error(m, xb, yb, db):
        return 0.5 * (m(xb).reshape(-1) - yb) ** 2

    lr, mu = 0.1, 0.8
    train(model, DataLoader(TensorDataset(x, y), batch_size=7), optimizer=OptimizerConfig("sgd", lr),
          device=torch.device("cpu"), loss_fn=half_squared_error, regularizer=regularizer)
    X, Y = x.numpy(), y.numpy()
    w, b = start["weight"].numpy().reshape(-1), float(start["bias"])
    r = X @ w + b - Y
    w_expected = w - lr * (X.T @ r / 7 + mu * (w - anchor["weight"].numpy().reshape(-1)))
    b_expected = b - lr * (r.mean() + mu * (b - float(anchor["bias"])))
    np.testing.assert_allclose(model.weight.detach().numpy().reshape(-1), w_expected, rtol=1e-10)
    assert float(model.bias.detach()) == pytest.approx(b_expected, rel=1e-10)


def test_the_regularizer_covers_only_parameters_that_train():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    regularizer = proximal_regularizer(model, 2.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model[0].requires_grad_(False)
    expected = 0.5 * 2.0 * sum(p.numel() for p in model[1].parameters())  # each entry moved by 1
    assert float(regularizer(model)) == pytest.approx(expected)
