"""pFedHN's mathematics (flwr_pfl/core/pfedhn.py) against closed forms and finite differences:
the chain rule of Eq. 4 on a hypernetwork linear in each of its tensors (gradients written out
by hand), central differences on a nonlinear one, the SGD step with momentum, weight decay and
clipping written out, per-client models that differ by their embedding only, a zero change that
moves phi by weight decay alone, and the optimizer's momentum restored exactly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flwr_pfl.core import pfedhn as core

SHAPES = [(2, 3), (2,), ()]


def linear_hnet(seed: int = 0) -> core.HyperNetwork:
    """N = 3 clients, e = 2, h = 4, no hidden block: theta_k = H_k (W1 v_i + b1) + c_k (float64)."""
    return core.build_hypernetwork(3, SHAPES, seed=seed, embed_dim=2, hidden_dim=4, n_hidden=0).double()


def deltas(seed: int, shapes=SHAPES, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


def hand_gradients(hnet: core.HyperNetwork, i: int, delta: list[torch.Tensor]) -> list[np.ndarray]:
    """The chain rule written out for the linear hypernetwork, in NumPy, in parameters() order
    (embeddings, W1, b1, then H_k, c_k per target)."""
    E = hnet.embeddings.weight.detach().numpy()
    W1, b1 = hnet.mlp[0].weight.detach().numpy(), hnet.mlp[0].bias.detach().numpy()
    heads = [(h.weight.detach().numpy(), h.bias.detach().numpy()) for h in hnet.heads]
    v = E[i]
    f = W1 @ v + b1
    d = [x.numpy().reshape(-1) for x in delta]
    g_f = sum(H.T @ dk for (H, _), dk in zip(heads, d))
    g_E = np.zeros_like(E)
    g_E[i] = W1.T @ g_f
    out = [g_E, np.outer(g_f, v), g_f]
    for dk in d:
        out += [np.outer(dk, f), dk]
    return out


def flat(hnet) -> list[torch.Tensor]:
    return [p.detach().clone() for p in hnet.parameters()]


# ------------------------------------------------------------------------------------ gradients
def test_the_chain_rule_of_a_linear_hypernetwork_matches_the_gradients_written_out():
    hnet = linear_hnet()
    for i, seed in ((0, 1), (2, 2)):
        delta = deltas(seed)
        got = core.chain_rule_gradients(hnet, i, delta)
        expected = hand_gradients(hnet, i, delta)
        assert len(got) == len(expected) == 3 + 2 * len(SHAPES)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.numpy(), e, rtol=1e-12, atol=1e-12)
        rows = [r for r in range(3) if r != i]
        assert not got[0][rows].any() and got[0][i].abs().sum() > 0  # only v_i moves by its own gradient


def test_the_chain_rule_equals_central_differences_of_the_surrogate_on_a_nonlinear_hypernetwork():
    """(d theta / d phi)^T delta is the gradient of <h(v_i; phi), delta> with delta held fixed."""
    hnet = core.build_hypernetwork(4, [(3, 2), (3,), (2, 1, 2)], seed=3, embed_dim=3, hidden_dim=5, n_hidden=2).double()
    delta = deltas(7, [(3, 2), (3,), (2, 1, 2)])
    client = 1
    grads = core.chain_rule_gradients(hnet, client, delta)

    def surrogate() -> float:
        with torch.no_grad():
            return float(sum((t * d).sum() for t, d in zip(hnet(client), delta)))

    eps, checked = 1e-6, 0
    g = torch.Generator().manual_seed(0)
    for p, grad in zip(hnet.parameters(), grads):
        picks = torch.randint(0, p.numel(), (3,), generator=g).tolist()
        if p is hnet.embeddings.weight:
            picks = [client * 3, client * 3 + 2, 0]  # own row, and another client's (gradient 0)
        for k in picks:
            flat_p = p.data.view(-1)
            old = flat_p[k].item()
            flat_p[k] = old + eps
            up = surrogate()
            flat_p[k] = old - eps
            down = surrogate()
            flat_p[k] = old
            assert grad.view(-1)[k].item() == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-8)
            checked += 1
    assert checked == 3 * len(grads)
    assert float(grads[0][client].abs().sum()) > 0 and not grads[0][0].any()


# ------------------------------------------------------------------------------------ the step
def test_two_clients_make_two_sgd_steps_with_gradients_at_the_rounds_phi():
    """server_round: each client's gradient at phi_0, then one SGD step per client (momentum,
    weight decay), written out: p1 = p0 - lr (g_a + wd p0); p2 = p1 - lr (m (g_a + wd p0) + g_b + wd p1)."""
    lr, m, wd = 0.07, 0.6, 0.01
    hnet = linear_hnet()
    p0 = [p.detach().numpy().copy() for p in hnet.parameters()]
    da, db = deltas(1), deltas(2)
    ga, gb = hand_gradients(hnet, 0, da), hand_gradients(hnet, 2, db)
    opt = core.server_optimizer(hnet, lr, m, wd)
    norms = core.server_round(hnet, opt, [(0, da), (2, db)], clip_norm=0)
    b1 = [g + wd * p for g, p in zip(ga, p0)]
    p1 = [p - lr * b for p, b in zip(p0, b1)]
    p2 = [p - lr * (m * b + g + wd * p) for p, b, g in zip(p1, b1, gb)]
    for got, e in zip(hnet.parameters(), p2):
        np.testing.assert_allclose(got.detach().numpy(), e, rtol=1e-12, atol=1e-13)
    assert norms == pytest.approx([np.sqrt(sum((g ** 2).sum() for g in ga)), np.sqrt(sum((g ** 2).sum() for g in gb))])
    # the second gradient at phi_1 instead would be another step: the hypernetwork is not linear in phi
    hnet1 = linear_hnet()
    with torch.no_grad():
        for p, v in zip(hnet1.parameters(), p1):
            p.copy_(torch.as_tensor(v))
    gb_at_p1 = hand_gradients(hnet1, 2, db)
    assert not np.allclose(gb_at_p1[1], gb[1])


def test_the_mean_step_moves_phi_along_the_mean_gradient_and_each_embedding_row_along_its_own():
    """server_round_mean: one SGD step (momentum and weight decay as a single step: the buffer is
    g + wd p0), with g = (g_a + g_b) / 2 off the embedding table and g_a + g_b on it (rows 0 and 2
    each get their own client's gradient; row 1 none)."""
    lr, m, wd = 0.07, 0.6, 0.01
    hnet = linear_hnet()
    p0 = [p.detach().numpy().copy() for p in hnet.parameters()]
    da, db = deltas(1), deltas(2)
    ga, gb = hand_gradients(hnet, 0, da), hand_gradients(hnet, 2, db)
    embedding = [i for i, p in enumerate(hnet.parameters()) if p is hnet.embeddings.weight]
    assert len(embedding) == 1
    norms = core.server_round_mean(hnet, core.server_optimizer(hnet, lr, m, wd), [(0, da), (2, db)], clip_norm=0)
    for i, (got, p, a, b) in enumerate(zip(hnet.parameters(), p0, ga, gb)):
        g = a + b if i in embedding else (a + b) / 2
        np.testing.assert_allclose(got.detach().numpy(), p - lr * (g + wd * p), rtol=1e-12, atol=1e-13)
    e = embedding[0]
    np.testing.assert_allclose(ga[e][2], 0.0) and np.testing.assert_allclose(gb[e][0], 0.0)  # rows apart
    assert norms == pytest.approx([np.sqrt(sum((g ** 2).sum() for g in ga)), np.sqrt(sum((g ** 2).sum() for g in gb))])


def test_with_one_client_the_mean_step_is_the_per_client_step():
    one, other = linear_hnet(), linear_hnet()
    core.server_round_mean(one, core.server_optimizer(one, 0.05, 0.9, 1e-3), [(1, deltas(4))])
    core.server_round(other, core.server_optimizer(other, 0.05, 0.9, 1e-3), [(1, deltas(4))])
    for a, b in zip(one.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_the_mean_steps_size_does_not_grow_with_the_clients_of_a_round():
    """The same change from every client: K per-client momentum steps move phi's shared tensors
    about K times as far; the mean step as far as one client's step."""
    moves = {}
    for step in (core.server_round, core.server_round_mean):
        for k in (1, 3):
            hnet = linear_hnet()
            before = [p.detach().clone() for p in hnet.parameters()]
            step(hnet, core.server_optimizer(hnet, 0.05, 0.9, 0.0), [(c, deltas(5)) for c in range(k)], clip_norm=0)
            shared = [i for i, p in enumerate(hnet.parameters()) if p is not hnet.embeddings.weight]
            moves[step.__name__, k] = float(sum((list(hnet.parameters())[i] - before[i]).norm() ** 2 for i in shared) ** 0.5)
    assert moves["server_round_mean", 3] / moves["server_round_mean", 1] < 1.5
    assert moves["server_round", 3] / moves["server_round", 1] > 2.5


def test_the_sum_step_moves_phi_once_along_the_sum_of_the_gradients_each_clipped_first():
    """server_round_sum: each client's gradient scaled to the clip norm when longer (client a's is,
    client b's is not), summed, one SGD step with momentum and weight decay as a single step."""
    lr, m, wd = 0.07, 0.6, 0.01
    hnet = linear_hnet()
    p0 = [p.detach().numpy().copy() for p in hnet.parameters()]
    da, db = deltas(1, scale=3.0), deltas(2, scale=0.2)
    ga, gb = hand_gradients(hnet, 0, da), hand_gradients(hnet, 2, db)
    na, nb = (float(np.sqrt(sum((g ** 2).sum() for g in grads))) for grads in (ga, gb))
    clip = (na + nb) / 2
    assert nb < clip < na
    norms = core.server_round_sum(hnet, core.server_optimizer(hnet, lr, m, wd), [(0, da), (2, db)], clip_norm=clip)
    for got, p, a, b in zip(hnet.parameters(), p0, ga, gb):
        g = a * clip / (na + 1e-6) + b
        np.testing.assert_allclose(got.detach().numpy(), p - lr * (g + wd * p), rtol=1e-10, atol=1e-12)
    assert norms == pytest.approx([na, nb])
    with pytest.raises(ValueError, match="one update per client and round; got clients \\[1, 1\\]"):
        core.server_round_sum(hnet, core.server_optimizer(hnet), [(1, deltas(1)), (1, deltas(2))])
    assert core.server_round_sum(hnet, core.server_optimizer(hnet), []) == []


def test_with_one_client_the_sum_step_is_the_per_client_step_clip_included():
    for clip in (0.0, 0.3):
        one, other = linear_hnet(), linear_hnet()
        core.server_round_sum(one, core.server_optimizer(one, 0.05, 0.9, 1e-3), [(1, deltas(4))], clip_norm=clip)
        core.server_round(other, core.server_optimizer(other, 0.05, 0.9, 1e-3), [(1, deltas(4))], clip_norm=clip)
        for a, b in zip(one.parameters(), other.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_per_client_momentum_steps_compound_over_a_rounds_stale_gradients_the_sum_step_does_not():
    """The same change from K = 10 clients with one embedding at momentum 0.9: the sum step moves
    phi's shared tensors K times one client's step; the K per-client steps sum_j (1 - 0.9^j) / 0.1,
    about 4.1 K times (the overshoot that made the default experiment diverge)."""
    moves = {}
    for step in (core.server_round, core.server_round_sum):
        for k in (1, 10):
            hnet = core.build_hypernetwork(10, SHAPES, seed=0, embed_dim=2, hidden_dim=4, n_hidden=0).double()
            with torch.no_grad():
                hnet.embeddings.weight[:] = hnet.embeddings.weight[0]  # every client's gradient alike
            before = [p.detach().clone() for p in hnet.parameters()]
            step(hnet, core.server_optimizer(hnet, 0.05, 0.9, 0.0), [(c, deltas(5)) for c in range(k)], clip_norm=0)
            shared = [i for i, p in enumerate(hnet.parameters()) if p is not hnet.embeddings.weight]
            moves[step.__name__, k] = float(sum((list(hnet.parameters())[i] - before[i]).norm() ** 2 for i in shared) ** 0.5)
    compounding = sum((1 - 0.9 ** j) / 0.1 for j in range(1, 11))
    assert moves["server_round_sum", 10] / moves["server_round_sum", 1] == pytest.approx(10, rel=1e-4)
    assert moves["server_round", 10] / moves["server_round", 1] == pytest.approx(compounding, rel=1e-4)
    assert compounding / 10 == pytest.approx(4.14, abs=0.01)


def test_the_mean_step_refuses_two_updates_of_one_client():
    hnet = linear_hnet()
    with pytest.raises(ValueError, match="one update per client and round; got clients \\[1, 1\\]"):
        core.server_round_mean(hnet, core.server_optimizer(hnet), [(1, deltas(1)), (1, deltas(2))])
    assert core.server_round_mean(hnet, core.server_optimizer(hnet), []) == []


def test_the_total_gradient_norm_is_clipped_before_the_step():
    lr, clip = 0.1, 0.5
    hnet = linear_hnet()
    delta = deltas(4, scale=10.0)
    g = hand_gradients(hnet, 1, delta)
    norm = np.sqrt(sum((x ** 2).sum() for x in g))
    assert norm > clip
    p0 = [p.detach().numpy().copy() for p in hnet.parameters()]
    got = core.server_round(hnet, core.server_optimizer(hnet, lr, 0.0, 0.0), [(1, delta)], clip_norm=clip)
    assert got == [pytest.approx(norm)]
    for p, before, gk in zip(hnet.parameters(), p0, g):
        np.testing.assert_allclose(p.detach().numpy(), before - lr * clip * gk / norm, rtol=1e-6, atol=1e-12)
    # below the threshold nothing is scaled
    hnet2 = linear_hnet()
    small = deltas(4, scale=1e-4)
    g2 = hand_gradients(hnet2, 1, small)
    core.server_round(hnet2, core.server_optimizer(hnet2, lr, 0.0, 0.0), [(1, small)], clip_norm=clip)
    for p, before, gk in zip(hnet2.parameters(), p0, g2):
        np.testing.assert_allclose(p.detach().numpy(), before - lr * gk, rtol=1e-9, atol=1e-15)


def test_a_zero_change_moves_phi_by_weight_decay_only():
    hnet = linear_hnet()
    p0 = flat(hnet)
    zero = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    core.server_round(hnet, core.server_optimizer(hnet, 0.05, 0.9, 0.0), [(0, zero), (1, zero)])
    assert all(torch.equal(a, b) for a, b in zip(flat(hnet), p0))
    hnet = linear_hnet()
    core.server_round(hnet, core.server_optimizer(hnet, 0.05, 0.9, 0.02), [(2, zero)])
    for a, b in zip(flat(hnet), p0):  # every tensor, every embedding row, shrinks by (1 - lr wd)
        torch.testing.assert_close(a, b * (1 - 0.05 * 0.02), rtol=1e-14, atol=0)


def test_a_step_moves_the_generated_model_towards_the_trained_one():
    """The direction is the gradient of 1/2 ||h(v_i; phi) - theta~||^2: a small step reduces it."""
    hnet = core.build_hypernetwork(3, [(4, 3), (4,)], seed=1, embed_dim=2, hidden_dim=6, n_hidden=2).double()
    with torch.no_grad():
        theta = hnet(1)
    trained = [t + 0.3 * d for t, d in zip(theta, deltas(9, [(4, 3), (4,)]))]

    def gap() -> float:
        with torch.no_grad():
            return float(sum(((t - s) ** 2).sum() for t, s in zip(hnet(1), trained)))

    before = gap()
    core.server_round(hnet, core.server_optimizer(hnet, 1e-3, 0.0, 0.0), [(1, [t - s for t, s in zip(theta, trained)])])
    assert gap() < before


# ------------------------------------------------------------------------------------ the network
def test_each_client_gets_the_model_of_its_own_embedding():
    hnet = core.build_hypernetwork(4, SHAPES, seed=2, embed_dim=3, hidden_dim=5, n_hidden=1)
    models = [hnet(i) for i in range(4)]
    assert [tuple(t.shape) for t in models[0]] == SHAPES
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.allclose(models[a][0], models[b][0])
    with torch.no_grad():
        hnet.embeddings.weight[3] = hnet.embeddings.weight[1]
        hnet.embeddings.weight[0] += 1.0
    same, other = hnet(3), hnet(2)
    assert all(torch.equal(x, y) for x, y in zip(same, hnet(1)))  # the embedding is all that differs
    assert all(torch.equal(x, y) for x, y in zip(other, models[2]))  # v_0 does not reach client 2


def test_the_architecture_follows_the_authors_and_the_target_shapes():
    hnet = core.build_hypernetwork(50, [(6, 3, 5, 5), (6,), (10, 84), ()], seed=0)
    assert hnet.embeddings.weight.shape == (50, 13)  # int(1 + 50 / 4)
    linears = [m for m in hnet.mlp if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(100, 13), (100, 100), (100, 100), (100, 100)]
    assert [type(m).__name__ for m in hnet.mlp] == ["Linear", "ReLU", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [tuple(h.weight.shape) for h in hnet.heads] == [(450, 100), (6, 100), (840, 100), (1, 100)]
    assert [tuple(t.shape) for t in hnet(49)] == [(6, 3, 5, 5), (6,), (10, 84), ()]
    total = sum(p.numel() for p in hnet.parameters())
    assert total == core.num_hypernetwork_values(50, [450, 6, 840, 1], 13, 100, 3)
    assert [core.auto_embed_dim(n) for n in (1, 3, 4, 10, 50, 100)] == [1, 1, 2, 3, 13, 26]


def test_the_initialisation_is_seeded_and_leaves_torchs_generator_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = core.build_hypernetwork(5, SHAPES, seed=8, hidden_dim=4, n_hidden=1)
    assert torch.equal(torch.rand(3), expected_next)
    b = core.build_hypernetwork(5, SHAPES, seed=8, hidden_dim=4, n_hidden=1)
    c = core.build_hypernetwork(5, SHAPES, seed=9, hidden_dim=4, n_hidden=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embeddings.weight, c.embeddings.weight)
    arrays = core.generate(a, 4, [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)])
    assert [x.dtype for x in arrays] == [np.float64, np.float32, np.float16] and arrays[2].shape == ()
    np.testing.assert_array_equal(arrays[1], a(4)[1].detach().numpy())


def test_restored_momentum_continues_the_optimizer_bit_for_bit():
    hnet = linear_hnet()
    opt = core.server_optimizer(hnet, 0.05, 0.9, 1e-3)
    assert core.momentum_buffers(opt, hnet) is None
    core.server_round(hnet, opt, [(0, deltas(1)), (1, deltas(2))])
    saved, buffers = copy.deepcopy(hnet), core.momentum_buffers(opt, hnet)
    assert buffers is not None and len(buffers) == len(list(hnet.parameters()))
    opt2 = core.server_optimizer(saved, 0.05, 0.9, 1e-3)
    core.load_momentum_buffers(opt2, saved, buffers)
    fresh = copy.deepcopy(saved)
    core.server_round(hnet, opt, [(2, deltas(3))])
    core.server_round(saved, opt2, [(2, deltas(3))])
    core.server_round(fresh, core.server_optimizer(fresh, 0.05, 0.9, 1e-3), [(2, deltas(3))])
    assert all(torch.equal(x, y) for x, y in zip(hnet.parameters(), saved.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(hnet.parameters(), fresh.parameters()))  # momentum mattered
    with pytest.raises(ValueError, match="momentum buffers"):
        core.load_momentum_buffers(opt2, saved, buffers[:-1])
    with pytest.raises(ValueError, match="shape"):
        core.load_momentum_buffers(opt2, saved, [np.zeros((1,))] * len(buffers))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n_hidden"):
        core.HyperNetwork(3, SHAPES, 2, 4, -1)
    with pytest.raises(ValueError, match="embed_dim"):
        core.HyperNetwork(3, SHAPES, 0, 4, 1)
    with pytest.raises(ValueError, match="at least one"):
        core.HyperNetwork(3, [], 2, 4, 1)
    with pytest.raises(ValueError, match="num_clients"):
        core.auto_embed_dim(0)
    hnet = linear_hnet()
    with pytest.raises(IndexError, match="not in"):
        hnet(3)
    with pytest.raises(ValueError, match="delta has 2 tensors"):
        core.chain_rule_gradients(hnet, 0, deltas(0)[:2])
    with pytest.raises(ValueError, match="shape"):
        core.chain_rule_gradients(hnet, 0, [torch.zeros(3, 2), torch.zeros(2), torch.zeros(())])
    with pytest.raises(ValueError, match="gradients for"):
        core.apply_step(hnet, core.server_optimizer(hnet), [torch.zeros(1)])
