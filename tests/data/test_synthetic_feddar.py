"""Tests of the FedDAR synthetic domain-mixed linear regression generator (Fig. 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_pfl.core import feddar as F
from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.federated import load_client_data
from flwr_pfl.data.synthetic import feddar as S
from flwr_pfl.errors import ConfigError


def test_shapes_ground_truth_and_noise_free_test_set():
    data = S.make_feddar_synthetic(num_clients=7, num_domains=4, dim=9, rep_dim=2, samples_per_client=6,
                                   test_samples_per_client=11, seed=3, dtype=torch.float64)
    p = data.problem
    assert data.train.x.shape == (7, 6, 9) and data.train.y.shape == (7, 6) and data.train.z.shape == (7, 6)
    assert data.test.x.shape == (7, 11, 9) and data.train.z.dtype == torch.int64
    np.testing.assert_allclose(p.rep_star.T @ p.rep_star, np.eye(2), atol=1e-12)
    np.testing.assert_allclose(p.heads_star.T @ p.heads_star, np.eye(2), atol=1e-12)  # QR-normalised W*
    np.testing.assert_allclose(p.mixtures.sum(1), 1.0)
    coef = torch.as_tensor(p.rep_star @ p.heads_star.T)  # column m = B* w*_m
    clean = (data.test.x * coef.T[data.test.z]).sum(-1)
    torch.testing.assert_close(data.test.y, clean, atol=1e-12, rtol=0)
    noise = data.train.y - (data.train.x * coef.T[data.train.z]).sum(-1)
    # sigma = 1e-3 as a standard deviation; 42 draws, seeds 0-7: 0.78e-3..1.11e-3
    assert 0.5e-3 < noise.std().item() < 1.5e-3


def test_seeded_and_domain_frequencies_follow_mixtures():
    a = S.make_feddar_synthetic(num_clients=5, samples_per_client=4, seed=1)
    b = S.make_feddar_synthetic(num_clients=5, samples_per_client=4, seed=1)
    c = S.make_feddar_synthetic(num_clients=5, samples_per_client=4, seed=2)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.train.z, b.train.z)
    assert not torch.equal(a.train.x, c.train.x)
    problem = S.make_domain_mixed_linear_problem(num_clients=3, rng=0)
    big = problem.sample(20000, 0.0, np.random.default_rng(0))
    freq = F.domain_counts(big.z, 5).numpy() / 20000
    np.testing.assert_allclose(freq, problem.mixtures, atol=0.015)


def test_mixture_concentration_readings():
    """Dir(alpha p) (0.08 per domain) concentrates clients on one domain more than Dir(0.4 each)."""
    literal = S.make_domain_mixed_linear_problem(num_clients=2000, rng=0).mixtures
    per_domain = S.make_domain_mixed_linear_problem(
        num_clients=2000, concentration=S.MixtureConcentration.ALPHA_PER_DOMAIN, rng=0
    ).mixtures
    # E[max_m pi_m] for symmetric Dirichlet: larger for smaller concentration
    assert literal.max(1).mean() > per_domain.max(1).mean() + 0.1
    # the mean mixture is the uniform prior in both readings
    np.testing.assert_allclose(literal.mean(0), 0.2, atol=0.03)
    np.testing.assert_allclose(per_domain.mean(0), 0.2, atol=0.03)


def test_client_datasets():
    data = S.make_feddar_synthetic(num_clients=3, samples_per_client=5, seed=0)
    sets = data.train.client_datasets()
    assert len(sets) == 3 and len(sets[1]) == 5
    x, y, z = sets[2][4]
    assert torch.equal(x, data.train.x[2, 4]) and y == data.train.y[2, 4] and z == data.train.z[2, 4]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="rep_dim"):
        S.make_domain_mixed_linear_problem(num_domains=3, rep_dim=4)
    with pytest.raises(ValueError, match="prior"):
        S.make_domain_mixed_linear_problem(prior=np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="samples_per_client"):
        S.make_domain_mixed_linear_problem().sample(0, 0.0, np.random.default_rng(0))


def test_closed_form_representation_step_matches_reweighted_loss_autograd():
    """The simulation's closed-form encoder GD step is GD on core.reweighted_loss."""
    data = S.make_feddar_synthetic(num_clients=4, samples_per_client=6, seed=5, dtype=torch.float64)
    x, y, z = data.train.x, data.train.y, data.train.z
    gen = torch.Generator().manual_seed(0)
    rep = torch.randn(20, 2, generator=gen, dtype=torch.float64)
    heads = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    u = F.domain_weights(F.domain_counts(z, 5).numpy())
    stepped = S._local_rep_gd(rep, x, y, heads[z], torch.as_tensor(u)[z], steps=1, lr=0.1)
    reps = rep.expand(4, 20, 2).clone().requires_grad_(True)
    out = F.head_outputs(x @ reps, z, heads, F.HeadLayout(1, 2))
    loss = F.reweighted_loss(F.per_sample_loss(out, y, F.HeadLoss.SQUARED), z, u).sum()
    (grad,) = torch.autograd.grad(loss, reps)
    torch.testing.assert_close(stepped, rep - 0.1 * grad)


def test_run_fig1_local_only_is_min_norm_least_squares():
    data = S.make_feddar_synthetic(num_clients=3, samples_per_client=5, test_samples_per_client=7, seed=2,
                                   dtype=torch.float64)
    res = S.run_fig1("local", data, S.Fig1Config(rounds=2))
    errs = []
    for i in range(3):
        coef = torch.linalg.pinv(data.train.x[i]) @ data.train.y[i]
        errs.append(((data.test.x[i] @ coef - data.test.y[i]) ** 2).mean())
    assert res.test_mse == pytest.approx(torch.stack(errs).mean().item(), rel=1e-10)
    assert res.history.shape == (2,)


# ------------------------------------------------------------- the registered "feddar-synthetic"
def synthetic_config(**changes) -> DataConfig:
    """The preset's layout (Dir(0.4 p) mixtures, 40 samples a client, half for test) plus a
    validation split, seed 2."""
    S.register_feddar_synthetic()
    layout = {
        "dataset": "feddar-synthetic", "partitioner": "domain-mixture", "domain_alpha": 0.4,
        "samples_per_client": 40, "val_fraction": 0.1, "test_fraction": 0.5, "seed": 2,
    }
    return DataConfig(**{**layout, **changes})


def test_pool_targets_are_the_generating_process_with_and_without_noise():
    """y = x^T B* w*_z + 1e-3 * N(0, 1), drawn in this order from the seed; noise_free_y without
    the noise term (the noisy targets are the same draws as before the noise-free ones existed)."""
    pool = S.feddar_synthetic_pool(synthetic_config())
    rng = np.random.default_rng(2)
    problem = S.make_domain_mixed_linear_problem(num_clients=1, rng=rng)
    z = rng.integers(0, 5, S.SYNTHETIC_POOL_SIZE)
    x = rng.standard_normal((S.SYNTHETIC_POOL_SIZE, 20))
    clean = (x * (problem.rep_star @ problem.heads_star.T).T[z]).sum(-1)
    noisy = clean + 1e-3 * rng.standard_normal(S.SYNTHETIC_POOL_SIZE)
    assert torch.equal(pool.domain, torch.as_tensor(z))
    torch.testing.assert_close(pool.noise_free_y, torch.as_tensor(clean, dtype=torch.float32), atol=1e-6, rtol=0)
    torch.testing.assert_close(pool.y, torch.as_tensor(noisy, dtype=torch.float32), atol=1e-6, rtol=0)
    assert 0.99e-3 < (pool.y - pool.noise_free_y).std().item() < 1.01e-3


def test_noise_free_test_key_gives_clean_test_targets_and_keeps_training_ones():
    on, off = synthetic_config(noise_free_test=True), synthetic_config()
    problem = S.make_domain_mixed_linear_problem(num_clients=1, rng=np.random.default_rng(2))
    coef = torch.as_tensor(problem.rep_star @ problem.heads_star.T)  # (d, M): column m is B* w*_m

    def residual(part):  # y - x^T B* w*_z, in float64
        return part.y.double() - (part.x.double() * coef.T[part.domain]).sum(-1)

    for k in (0, 3):
        a, b = load_client_data(on, k, 5), load_client_data(off, k, 5)
        assert (len(a.train), len(a.val), len(a.test)) == (16, 4, 20)
        assert torch.equal(a.test.x, b.test.x) and torch.equal(a.test.domain, b.test.domain)
        for part_on, part_off in ((a.train, b.train), (a.val, b.val)):
            assert torch.equal(part_on.x, part_off.x) and torch.equal(part_on.y, part_off.y)
        # noise-free test targets: exact up to float32 rounding (1e-7) against sigma = 1e-3
        assert residual(a.test).abs().max().item() < 2e-6
        # without the key the test targets carry the noise; the training targets always do
        for noisy in (b.test, a.train):
            assert 0.4e-3 < residual(noisy).std().item() < 1.6e-3


def test_noise_free_test_is_refused_for_a_dataset_without_noise_free_targets():
    S.register_feddar_synthetic()
    with pytest.raises(ConfigError) as err:
        DataConfig(dataset="mnist", noise_free_test=True)
    for fragment in ("'noise-free-test'", "dataset 'mnist'", "no noise-free targets", "'feddar-synthetic'"):
        assert fragment in str(err.value)
