"""Per-FedAvg's meta step (Fallah et al., NeurIPS 2020, Alg. 1 and Section 5) against closed
forms on quadratic losses, whose Hessians are known, and against independent recomputations on a
tiny network: the Hessian-vector product against torch.autograd.functional.hessian, HF against
autograd through the inner step (the exact MAML gradient when D'' = D) and against the paper's
finite difference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flwr_pfl.core.perfedavg import (
    batch_loss,
    batches_per_step,
    check_variant,
    hessian_vector_product,
    inner_step,
    meta_step,
    outer_step,
)

ALPHA, BETA = 0.3, 0.7


def spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m @ m.T + n * torch.eye(n, dtype=torch.float64)


def vec(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def quadratic(a: torch.Tensor, b: torch.Tensor):
    """f(w) = 0.5 w'Aw - b'w over w = concat of the parameter tensors: grad Aw - b, Hessian A."""

    def loss_at(params):
        w = torch.cat([p.reshape(-1) for p in params])
        return 0.5 * w @ a @ w - b @ w

    return loss_at


def split(w: torch.Tensor) -> list[torch.Tensor]:
    """Two parameter tensors (a 2x2 matrix and a 1-vector) from a 5-vector."""
    return [w[:4].reshape(2, 2).clone(), w[4:].clone()]


def flat(params) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params])


@pytest.fixture
def problem():
    w = vec(5, 1)
    data = [(spd(5, 10 + i), vec(5, 20 + i)) for i in range(3)]  # D, D', D''
    return w, data


def test_fo_on_quadratics_is_the_closed_form(problem):
    w, ((a0, b0), (a1, b1), _) = problem
    step = meta_step("fo", [quadratic(a0, b0), quadratic(a1, b1)], split(w), ALPHA)
    temp = w - ALPHA * (a0 @ w - b0)
    expected = a1 @ temp - b1
    torch.testing.assert_close(flat(step.direction), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(step.loss, 0.5 * w @ a0 @ w - b0 @ w)
    torch.testing.assert_close(step.adapted_loss, 0.5 * temp @ a1 @ temp - b1 @ temp)
    torch.testing.assert_close(flat(outer_step(split(w), step.direction, BETA)), w - BETA * expected)


def test_hf_on_quadratics_is_the_closed_form_with_the_hessian_of_d2(problem):
    w, ((a0, b0), (a1, b1), (a2, b2)) = problem
    step = meta_step("hf", [quadratic(a0, b0), quadratic(a1, b1), quadratic(a2, b2)], split(w), ALPHA)
    temp = w - ALPHA * (a0 @ w - b0)
    expected = (torch.eye(5, dtype=torch.float64) - ALPHA * a2) @ (a1 @ temp - b1)
    torch.testing.assert_close(flat(step.direction), expected, rtol=1e-12, atol=1e-12)
    # the Hessian of D'' (not of D or D'): with A_D in its place the answer differs
    wrong = (torch.eye(5, dtype=torch.float64) - ALPHA * a0) @ (a1 @ temp - b1)
    assert (flat(step.direction) - wrong).abs().max() > 1e-3
    new = w - BETA * expected
    torch.testing.assert_close(flat(outer_step(split(w), step.direction, BETA)), new)


def test_inner_and_outer_steps_do_not_touch_their_inputs(problem):
    w, _ = problem
    params = split(w)
    before = [p.clone() for p in params]
    inner_step(params, [torch.ones_like(p) for p in params], ALPHA)
    outer_step(params, [torch.ones_like(p) for p in params], BETA)
    meta_step("hf", [quadratic(spd(5, 1), vec(5, 2))] * 3, params, ALPHA)
    for p, q in zip(params, before):
        assert torch.equal(p, q) and not p.requires_grad


# ------------------------------------------------------------------------------ a tiny network
def tiny_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


class Net(nn.Module):
    """The batch_loss signature: forward(x, d)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = tiny_net()

    def forward(self, x, d=None):
        return self.body(x)


def batch(seed: int, n: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,), generator=g), torch.zeros(n, dtype=torch.long)


def network():
    net = Net().double()
    names = [name for name, _ in net.named_parameters()]
    params = [p.detach().clone() for p in net.parameters()]
    losses = [batch_loss(net, names, *batch(s)) for s in (5, 6, 7)]
    return net, names, params, losses


def unflatten(w: torch.Tensor, like) -> list[torch.Tensor]:
    out, i = [], 0
    for p in like:
        out.append(w[i:i + p.numel()].reshape(p.shape))
        i += p.numel()
    return out


def test_hessian_vector_product_equals_the_explicit_hessian_times_the_vector():
    _, _, params, losses = network()
    v = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i, p in enumerate(params)]
    hessian = torch.autograd.functional.hessian(lambda w: losses[2](unflatten(w, params)), flat(params))
    assert hessian.shape == (flat(params).numel(),) * 2 and hessian.abs().max() > 1e-3
    product = hessian_vector_product(losses[2], params, v)
    torch.testing.assert_close(flat(product), hessian @ flat(v), rtol=1e-9, atol=1e-12)


def test_hf_with_d2_equal_to_d_is_the_exact_maml_gradient_by_autograd_through_the_inner_step():
    _, _, params, (loss_d, loss_d1, _) = network()
    step = meta_step("hf", [loss_d, loss_d1, loss_d], params, ALPHA)
    w = [p.clone().requires_grad_() for p in params]
    inner = torch.autograd.grad(loss_d(w), w, create_graph=True)
    maml = torch.autograd.grad(loss_d1([p - ALPHA * g for p, g in zip(w, inner)]), w)
    torch.testing.assert_close(flat(step.direction), flat(maml), rtol=1e-9, atol=1e-12)
    fo = meta_step("fo", [loss_d, loss_d1], params, ALPHA)
    assert (flat(fo.direction) - flat(maml)).abs().max() > 1e-4  # FO drops the Hessian term


def test_hf_is_the_limit_of_the_papers_finite_difference():
    """Section 5's d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta)."""
    _, _, params, losses = network()
    fo = meta_step("fo", losses[:2], params, ALPHA).direction
    hf = meta_step("hf", losses, params, ALPHA).direction
    delta = 1e-5

    def grad_at(shift):
        w = [(p + shift * g).requires_grad_() for p, g in zip(params, fo)]
        return torch.autograd.grad(losses[2](w), w)

    difference = [(a - b) / (2 * delta) for a, b in zip(grad_at(delta), grad_at(-delta))]
    expected = [g - ALPHA * h for g, h in zip(fo, difference)]
    torch.testing.assert_close(flat(hf), flat(expected), rtol=1e-6, atol=1e-9)


def test_fo_equals_a_plain_sgd_step_then_the_gradient_at_the_adapted_model():
    """FO as PFLlib writes it: an SGD step of size alpha on D, the gradient on D' there."""
    net, _, params, losses = network()
    step = meta_step("fo", losses[:2], params, ALPHA)
    x, y, _ = batch(5)
    opt = torch.optim.SGD(net.parameters(), lr=ALPHA)
    F.cross_entropy(net(x), y).backward()
    opt.step()
    opt.zero_grad()
    x1, y1, _ = batch(6)
    F.cross_entropy(net(x1), y1).backward()
    torch.testing.assert_close(flat(step.direction), flat([p.grad for p in net.parameters()]), rtol=1e-9, atol=1e-12)


def test_batch_loss_runs_the_model_with_the_given_values_and_moves_batchnorm_statistics():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, d=None):
            return self.net(x)

    model = Wrapped().train()
    names = [n for n, _ in model.named_parameters()]
    zeros = [torch.zeros_like(p) for p in model.parameters()]
    x, y, d = batch(1)
    loss = batch_loss(model, names, x, y, d)(zeros)
    torch.testing.assert_close(loss, torch.tensor(2.0, dtype=torch.float64).log())  # all-zero weights: uniform outputs
    assert model.net[1].num_batches_tracked.item() == 1
    assert model.net[0].weight.abs().sum() > 0  # the model's own parameters are untouched


class NoDoubleBackward(torch.autograd.Function):
    """x^2 whose backward refuses to build a graph, as torch's ops without a second derivative
    do (torch's message: "the derivative for '...' is not implemented")."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError("the derivative for 'NoDoubleBackward' is not implemented")
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_a_model_without_second_derivatives_fails_hf_loudly_and_fo_works():
    loss = lambda p: (NoDoubleBackward.apply(p[0]) * p[0]).sum()  # noqa: E731
    w = [torch.tensor([1.0, 2.0])]
    with pytest.raises(RuntimeError, match="derivative"):
        hessian_vector_product(loss, w, [torch.ones(2)])
    with pytest.raises(RuntimeError, match="derivative"):
        meta_step("hf", [loss] * 3, w, ALPHA)
    assert meta_step("fo", [loss] * 2, w, ALPHA).direction[0].shape == (2,)


def test_variants_and_batch_counts():
    assert batches_per_step("fo") == 2 and batches_per_step("hf") == 3
    with pytest.raises(ValueError, match="fo, hf"):
        check_variant("so")
    with pytest.raises(ValueError, match="takes 3 batch losses"):
        meta_step("hf", [quadratic(spd(2, 0), vec(2, 0))] * 2, [vec(2, 1)], ALPHA)
