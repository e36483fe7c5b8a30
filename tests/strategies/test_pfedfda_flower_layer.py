"""pFedFDA's Flower layer against independent computations (Alg. 1 lines 5-15, §4.3).

Client fit: the head is the LDA head of the *global* statistics with the client's *local* label
priors, frozen while the backbone trains; the upload is beta * local + (1 - beta) * global
statistics computed with the fit-time options, and num_examples is the training-split size.
Client evaluate: the test split is scored by the LDA head of the personalized statistics with
the local priors and the evaluation options. Server: the initial means follow ``mean_init``; the
last round (counted across a resume) takes every client.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn

import flwr_pfl.core.pfedfda as core
from flwr_pfl.clients import PFedFDAClient
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.core.pfedfda import BetaSearch, PFedFDAConfig
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import collect_features, get_arrays
from flwr_pfl.training.optim import OptimizerConfig

from fakes import manager
from fakes import PFEDFDA_CLASSES as C
from fakes import PFEDFDA_FEATURES as D
from fakes import pfedfda_strategy as strategy
from fakes import pfedfda_wire as wire
from fakes import ready_pfedfda_strategy as ready_strategy

CPU = torch.device("cpu")
# skewed labels: the local priors (14, 4, 2) / 20 differ clearly from uniform
LABELS = [0] * 14 + [1] * 4 + [2] * 2
_g = torch.Generator().manual_seed(11)
TRAIN_Y = torch.as_tensor(LABELS)
TRAIN_X = torch.randn(len(LABELS), 6, generator=_g) + 1.5 * F.one_hot(TRAIN_Y, 6).float()
TEST_Y = torch.as_tensor([0] * 6 + [1, 2])
TEST_X = torch.randn(len(TEST_Y), 6, generator=_g) + 1.5 * F.one_hot(TEST_Y, 6).float()


def fixed(beta: float, **kwargs) -> PFedFDAConfig:
    return PFedFDAConfig(beta=BetaSearch(mode="fixed", fixed_beta=beta), **kwargs)


def make_client(*, config=None, fit_config=None, stats_source="fresh_pass", epochs=2, ctx=None) -> PFedFDAClient:
    train_split = ArraySplit(TRAIN_X, TRAIN_Y, torch.zeros(len(TRAIN_Y), dtype=torch.long))
    test_split = ArraySplit(TEST_X, TEST_Y, torch.zeros(len(TEST_Y), dtype=torch.long))
    torch.manual_seed(0)
    model = EncoderHeadModel(nn.Sequential(nn.Linear(6, D), nn.LeakyReLU()), D, C)
    ctx = ctx or Context(run_id=1, node_id=1, node_config={"partition-id": 2}, state=RecordDict(), run_config={})
    tc = TrainConfig(local_epochs=epochs, batch_size=8, optimizer=OptimizerConfig("sgd", 0.05), device="cpu")
    return PFedFDAClient(ctx, model, LocalData(train_split.loader(8, True), test_split.loader(8, False)), tc,
                         config=config, fit_config=fit_config, stats_source=stats_source)


def message(client: PFedFDAClient) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    mu = rng.standard_normal((C, D)).astype(np.float32)
    a = rng.standard_normal((D, D))
    sigma = (a @ a.T / D + 0.5 * np.eye(D)).astype(np.float32)
    return core.join_wire(get_arrays(client.model, "body"), mu, sigma)


def tensors(msg):
    _, mu, sigma = core.split_wire(msg)
    return torch.as_tensor(mu), torch.as_tensor(sigma)


def test_fit_trains_the_backbone_under_the_frozen_global_lda_head_with_local_priors():
    fit_config = fixed(0.5, prior_eps=0.02, min_class_count=0)
    client = make_client(config=fixed(0.5), fit_config=fit_config)
    msg = message(client)
    mu_g, sigma_g = tensors(msg)
    arrays, _, _ = client.fit(msg, {"server-round": 1})
    priors = core.label_priors(torch.as_tensor(LABELS), C, 0.02)
    weight, bias = core.lda_head(mu_g, sigma_g, priors, shrinkage=fit_config.lda_shrinkage, solve=fit_config.lda_solve)
    head = client.model.heads[0]
    np.testing.assert_allclose(head.weight.detach().numpy(), weight.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(head.bias.detach().numpy(), bias.numpy(), rtol=1e-5, atol=1e-5)
    uniform = core.lda_head(mu_g, sigma_g, torch.full((C,), 1.0 / C), shrinkage=fit_config.lda_shrinkage)[1]
    assert not np.allclose(bias.numpy(), uniform.numpy(), atol=0.1)  # the priors matter here
    received = core.split_wire(msg)[0]
    assert any(not np.allclose(a, b) for a, b in zip(arrays[:len(received)], received))  # the backbone trained


def test_fit_uploads_the_beta_interpolation_with_the_fit_time_options():
    """mu_i = beta mu_hat + (1 - beta) mu_g, Sigma_i likewise (Alg. 1 lines 10-11), with the
    fit options (beta 0.7, min_class_count 0), not the evaluation ones (beta 0.2, 2)."""
    fit_config = fixed(0.7, min_class_count=0)
    client = make_client(config=fixed(0.2), fit_config=fit_config)
    msg = message(client)
    mu_g, sigma_g = tensors(msg)
    arrays, n, metrics = client.fit(msg, {"server-round": 1})
    assert n == len(LABELS)
    assert metrics["beta_mu"] == pytest.approx(0.7) and metrics["beta_sigma"] == pytest.approx(0.7)
    z, y, _ = collect_features(client.model, client.data.train, device=CPU)  # fresh pass of the trained backbone
    mu_hat, sigma_hat = core.estimate_statistics(z, y, mu_g, min_class_count=0, regularization=fit_config.cov)
    np.testing.assert_allclose(arrays[-2], (0.7 * mu_hat + 0.3 * mu_g).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(arrays[-1], (0.7 * sigma_hat + 0.3 * sigma_g).numpy(), rtol=1e-4, atol=1e-5)
    assert dict(client.context.state["pfedfda"]) == {"beta_mu": pytest.approx(0.7), "beta_sigma": pytest.approx(0.7)}


def test_fit_counts_training_samples_not_feature_rows():
    client = make_client(stats_source="all_epochs", epochs=3)
    _, n, metrics = client.fit(message(client), {"server-round": 1})
    assert n == len(LABELS) and metrics["n_feats"] == 3 * len(LABELS)


def test_evaluate_scores_the_test_split_with_the_personalized_head_and_local_priors():
    config = fixed(0.6, prior_eps=0.01)
    client = make_client(config=config, fit_config=fixed(0.1))
    msg = message(client)
    mu_g, sigma_g = tensors(msg)
    loss, n, metrics = client.evaluate(msg, {"server-round": 1})
    # reference: features of the training split under the received backbone, eval mode
    z, y, _ = collect_features(client.model, client.data.train, device=CPU)
    priors = core.label_priors(torch.as_tensor(LABELS), C, 0.01)
    p = core.personalize(z, y, mu_g, sigma_g, priors=priors, config=config)
    with torch.no_grad():
        logits = client.model.features(TEST_X) @ p.weight.T + p.bias
    assert n == len(TEST_Y) and metrics["beta_mu"] == pytest.approx(0.6)
    assert loss == pytest.approx(float(F.cross_entropy(logits, TEST_Y)), rel=1e-4)
    assert metrics["accuracy"] == pytest.approx(float((logits.argmax(1) == TEST_Y).float().mean()))


# ------------------------------------------------------------------------------------ server
def test_gaussian_mean_init_sends_standard_normal_initial_means():
    s = strategy(mean_init="gaussian", seed=3)
    ins = s.configure_fit(1, ndarrays_to_parameters(wire(1.0)), manager(10))
    mu = parameters_to_ndarrays(ins[0][1].parameters)[-2]
    np.testing.assert_array_equal(mu, core.init_global_statistics(C, D, init="gaussian", seed=3)[0])
    assert (mu < 0).any()  # not U[0, 1)


def test_the_last_round_counts_rounds_done_before_a_resume():
    first = ready_strategy(num_rounds=10, fraction_fit=0.2)
    resumed = strategy(num_rounds=10, fraction_fit=0.2)
    resumed.load_state_dict(first.state_dict(), rounds_done=8)
    cm = manager(10)
    params = ndarrays_to_parameters(wire())
    assert len(resumed.configure_fit(1, params, cm)) < 10  # round 9: Bernoulli(0.2)
    assert len(resumed.configure_fit(2, params, cm)) == 10  # round 10, the last: everyone
    assert len(resumed.configure_evaluate(2, params, cm)) == 10


def test_a_failing_solver_falls_back_to_both_betas_of_the_previous_round(monkeypatch):
    """Separate (beta_mu, beta_Sigma) (the official code's mode): both are kept in
    context.state and both come back when the next round's solver fails."""
    official = PFedFDAConfig.official_code()
    client = make_client(config=official, fit_config=official, stats_source="all_epochs")
    _, _, first = client.fit(message(client), {"server-round": 1})
    assert first["beta_fallback"] == 0.0
    assert abs(first["beta_mu"] - first["beta_sigma"]) > 1e-3  # two different numbers to keep

    def broken(*args, **kwargs):
        raise RuntimeError("line search failed")

    monkeypatch.setattr("flwr_pfl.core.pfedfda.beta._minimize_lbfgs", broken)
    again = make_client(config=official, fit_config=official, stats_source="all_epochs", ctx=client.context)
    _, _, second = again.fit(message(again), {"server-round": 2})
    assert second["beta_fallback"] == 1.0
    assert second["beta_mu"] == pytest.approx(first["beta_mu"]) and second["beta_sigma"] == pytest.approx(first["beta_sigma"])
