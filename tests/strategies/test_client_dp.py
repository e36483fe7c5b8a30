"""Client-level DP in the strategies: the aggregate is the global arrays plus the clipped,
uniformly averaged, noised updates of the round's sampled clients; epsilon is accounted every
round and survives a resume; algorithms it cannot cover, and bad settings, are refused before
training."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.common import parameters_to_ndarrays

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.results import read_status
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.app.server_app import build_strategy
from flwr_pfl.core.dp import private_mean
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies import FedAvg, FedRep, PFedMe
from flwr_pfl.strategies.privacy import ClientLevelDP, PrivateAggregator

from fakes import FakeProxy, fit_res

GLOBAL = [np.full((3, 4), 0.5, np.float32), np.zeros(4, np.float32), np.array(7, np.int64)]  # a BatchNorm counter last
SIZES = [10, 300, 20, 40, 25]  # very unequal: an example-weighted mean would be dominated by partition 1


def update(pid: int, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(pid)
    return [(scale * rng.normal(size=a.shape)).astype(np.float32) for a in GLOBAL[:2]]


def reply_arrays(pid: int, scale: float = 1.0) -> list[np.ndarray]:
    return [g + u for g, u in zip(GLOBAL[:2], update(pid, scale))] + [np.array(7 + 10 * SIZES[pid], np.int64)]


def run_round(strategy, server_round: int, pids, sampled: int | None = None, scale: float = 1.0):
    strategy.global_arrays = [a.copy() for a in GLOBAL]
    proxies = [FakeProxy(str(100 + pid), pid) for pid in range(sampled or len(pids))]
    strategy.record_sample("fit", proxies)
    results = [(proxies[pid], fit_res(reply_arrays(pid, scale), SIZES[pid], pid)) for pid in pids]
    params, metrics = strategy.aggregate_fit(server_round, results, [])
    return parameters_to_ndarrays(params), metrics


def dp(**kwargs) -> ClientLevelDP:
    return ClientLevelDP(**({"noise_multiplier": 1.0, "clip_norm": 0.5, "noise_seed": 3} | kwargs))


def test_the_aggregate_is_the_private_mean_over_the_sampled_clients_whatever_their_sizes():
    """Three replies of five sampled clients, sizes 10 to 300: global + (sum of clipped updates +
    noise) / 5, with the noise of the seeded round; the integer counter keeps its global value."""
    strategy = FedAvg(num_clients=5, client_dp=dp())
    out, metrics = run_round(strategy, 1, [0, 1, 3], sampled=5)
    expected, _ = private_mean([[u.astype(np.float64) for u in update(p)] for p in (0, 1, 3)], 0.5, 1.0, 5,
                               np.random.default_rng([3, 1]))
    for got, g, e in zip(out, GLOBAL, expected):
        np.testing.assert_allclose(got, (g.astype(np.float64) + e).astype(np.float32), rtol=1e-6)
    assert out[2] == GLOBAL[2] and out[2].dtype == np.int64
    assert metrics["dp_noise_std"] == pytest.approx(1.0 * 0.5 / 5)
    assert metrics["dp_clip_norm"] == 0.5 and metrics["dp_delta"] == 1e-5


def test_without_its_noise_or_its_clipping_the_test_above_would_fail():
    """The deviation from the noiseless clipped mean, on 60,000 coordinates, has the stated
    spread; a client 10^6 times larger moves the noiseless mean by at most C / m."""
    big = [np.zeros(60_000, np.float32)]
    strategy = FedAvg(num_clients=4, client_dp=dp(noise_multiplier=2.0, clip_norm=0.3, noise_seed=None))
    strategy.global_arrays = [a.copy() for a in big]
    results = [(FakeProxy(str(p), p), fit_res([a.copy() for a in big], 10, p)) for p in range(4)]
    out, _ = strategy.aggregate_fit(1, results, [])
    noise = parameters_to_ndarrays(out)[0]
    assert np.std(noise) == pytest.approx(2.0 * 0.3 / 4, rel=0.02)
    quiet = FedAvg(num_clients=5, client_dp=dp(noise_multiplier=1e-12))
    base, _ = run_round(quiet, 1, [0, 2, 3, 4], sampled=5)
    attacked, _ = run_round(quiet, 1, [0, 1, 2, 3, 4], sampled=5, scale=1.0)
    moved = math.sqrt(sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(attacked[:2], base[:2])))
    assert moved <= 0.5 / 5 + 1e-6


def test_secret_noise_differs_between_runs_and_seeded_noise_repeats():
    a, _ = run_round(FedAvg(num_clients=5, client_dp=dp(noise_seed=None)), 1, [0, 1, 2])
    b, _ = run_round(FedAvg(num_clients=5, client_dp=dp(noise_seed=None)), 1, [0, 1, 2])
    assert not np.array_equal(a[0], b[0])
    c, _ = run_round(FedAvg(num_clients=5, client_dp=dp()), 1, [0, 1, 2])
    d, _ = run_round(FedAvg(num_clients=5, client_dp=dp()), 1, [0, 1, 2])
    assert all(np.array_equal(x, y) for x, y in zip(c, d))


def test_epsilon_is_accounted_every_round_as_flowers_accountant_does():
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

    strategy = FedAvg(num_clients=5, client_dp=dp(delta=1e-3))
    reference = RdpAccountant(PrivacyConfig(1e-3, 5, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION))
    spent = []
    for r in range(1, 4):
        _, metrics = run_round(strategy, r, [0, 1, 2, 3, 4])
        reference.compose(GaussianPrivacyEvent(1.0, 5, 5))
        assert metrics["dp_epsilon"] == pytest.approx(reference.get_epsilon(1e-3))
        spent.append(metrics["dp_epsilon"])
    assert 0 < spent[0] < spent[1] < spent[2]
    # the classical RDP bound (Mironov 2017, Prop. 3) over alpha: accounting may only be tighter
    classic = min(3 * a / 2 + math.log(1 / 1e-3) / (a - 1) for a in np.linspace(1.01, 200, 20_000))
    assert 0.7 * classic < spent[2] <= classic


def test_adaptive_clipping_raises_the_norm_when_every_update_is_clipped():
    """Every update's norm is far above C: C must grow each round (Andrew et al.: b = 0 <
    gamma). Flower 1.42's server-side adaptive wrapper shrinks it in this case."""
    strategy = FedAvg(num_clients=5, client_dp=dp(adaptive=True, clip_norm=0.01, count_stddev=1e-9,
                                                  noise_multiplier=1e-9))
    norms = []
    for r in range(1, 4):
        _, metrics = run_round(strategy, r, [0, 1, 2, 3, 4], scale=10.0)
        norms.append(metrics["dp_clip_norm"])
        assert metrics["dp_unclipped_fraction"] == pytest.approx(0.0, abs=1e-6)
    assert norms[0] == 0.01 and norms[0] < norms[1] < norms[2]
    assert strategy.private.clip_norm == pytest.approx(0.01 * math.exp(0.2 * 0.5) ** 3)


def test_a_resumed_run_continues_the_accounting_and_the_noise():
    whole = FedAvg(num_clients=5, client_dp=dp(adaptive=True, count_stddev=1.0))
    for r in (1, 2):
        run_round(whole, r, [0, 1, 2, 3, 4])
    first = FedAvg(num_clients=5, client_dp=dp(adaptive=True, count_stddev=1.0))
    run_round(first, 1, [0, 1, 2, 3, 4])
    resumed = FedAvg(num_clients=5, client_dp=dp(adaptive=True, count_stddev=1.0))
    resumed.load_state_dict(first.state_dict(), 1)
    out, metrics = run_round(resumed, 1, [0, 1, 2, 3, 4])  # Flower numbers a resumed run's rounds from 1 again
    assert resumed.private.releases == whole.private.releases
    assert resumed.private.clip_norm == whole.private.clip_norm
    assert metrics["dp_epsilon"] == pytest.approx(whole.private.epsilon())
    assert all(np.array_equal(a, b) for a, b in zip(out, whole.global_arrays))
    with pytest.raises(ConfigError, match="holds no privacy state"):
        FedAvg(num_clients=5, client_dp=dp()).load_state_dict(FedAvg(num_clients=5).state_dict() | {"global_arrays": GLOBAL}, 1)


def test_fedrep_releases_its_body_only_and_pfedme_its_uniform_private_mean():
    """FedRep's replies are the body: that is all DP releases (the heads never leave). pFedMe's
    beta step moves the global model towards the private mean."""
    body = [np.zeros((2, 2), np.float32)]
    strategy = FedRep(num_clients=2, client_dp=dp(noise_multiplier=1e-9, clip_norm=1.0))
    strategy.global_arrays = [a.copy() for a in body]
    results = [(FakeProxy(str(p), p), fit_res([np.full((2, 2), 10.0, np.float32)], 5 + p, p)) for p in range(2)]
    out = parameters_to_ndarrays(strategy.aggregate_fit(1, results, [])[0])
    assert len(out) == 1 and np.linalg.norm(out[0]) == pytest.approx(1.0, rel=1e-5)  # both clipped to 1, same direction
    pfedme = PFedMe(num_clients=2, beta=0.5, client_dp=dp(noise_multiplier=1e-9, clip_norm=1.0))
    pfedme.global_arrays = [a.copy() for a in body]
    out = parameters_to_ndarrays(pfedme.aggregate_fit(1, results, [])[0])
    assert np.linalg.norm(out[0]) == pytest.approx(0.5, rel=1e-5)


def test_pfedfda_releases_backbone_and_statistics_as_one_clipped_noised_mean():
    """pFedFDA's upload [phi, mu, Sigma] is one update per client: clipped together (a client's
    statistics cannot escape the bound), averaged uniformly over the sampled clients (sizes 5
    to 400), noised; Sigma_g is then the nearest PSD matrix. Compared with the private mean of
    the whole list computed here; with large noise Sigma_g stays symmetric PSD."""
    from fakes import pfedfda_wire, ready_pfedfda_strategy
    from flwr_pfl.core.pfedfda import nearest_psd, split_wire

    sizes = {0: 5, 4: 400, 7: 30}
    base = pfedfda_wire(0.1, mu=np.arange(12, dtype=np.float32).reshape(3, 4) / 10, cov=2 * np.eye(4, dtype=np.float32))

    def reply(pid):
        rng = np.random.default_rng(pid)
        backbone, mu, cov = split_wire(base)
        a = rng.normal(size=(4, 4)).astype(np.float32)
        return [*(b + rng.normal(size=b.shape).astype(np.float32) for b in backbone),
                mu + rng.normal(size=mu.shape).astype(np.float32), cov + a @ a.T]

    def release(noise):
        strategy = ready_pfedfda_strategy(fraction_fit=1.0, client_dp=dp(noise_multiplier=noise, clip_norm=2.0))
        strategy.global_arrays = [a.copy() for a in base]
        proxies = [FakeProxy(str(100 + p), p) for p in range(10)]
        strategy.record_sample("fit", proxies)
        results = [(proxies[p], fit_res(reply(p), n, p)) for p, n in sizes.items()]
        params, metrics = strategy.aggregate_fit(1, results, [])
        return parameters_to_ndarrays(params), metrics

    out, metrics = release(1e-3)
    updates = [[r.astype(np.float64) - g.astype(np.float64) for r, g in zip(reply(p), base)] for p in sizes]
    expected, _ = private_mean(updates, 2.0, 1e-3, 10, np.random.default_rng([3, 1]))
    want = [(g.astype(np.float64) + e).astype(np.float32) for g, e in zip(base, expected)]
    backbone, mu, sigma = split_wire(out)
    w_backbone, w_mu, w_sigma = split_wire(want)
    for got, exp in zip([*backbone, mu], [*w_backbone, w_mu]):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sigma, nearest_psd(w_sigma), rtol=1e-5, atol=1e-6)
    assert sum(np.linalg.norm(u) ** 2 for u in updates[1]) > 2.0 ** 2  # the large client's update was clipped
    assert metrics["dp_noise_std"] == pytest.approx(1e-3 * 2.0 / 10) and metrics["dp_epsilon"] > 0
    _, _, noisy = split_wire(release(50.0)[0])
    assert np.array_equal(noisy, noisy.T) and np.linalg.eigvalsh(noisy.astype(np.float64)).min() >= -1e-5


# ------------------------------------------------------------------------------ refusals and bad settings
@pytest.mark.parametrize("algorithm", ["fedora", "fedfomo", "fedamp", "pfedhn", "fmtl", "feddar-sa", "fedgp",
                                       "ifca", "fedpac", "local"])
def test_algorithms_it_cannot_cover_refuse_it_with_the_reason(algorithm):
    experiment = parse_experiment({"algorithm": algorithm, "num-clients": 4, "num-server-rounds": 2,
                                   "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match=r"client-level DP \(dp-noise-multiplier\) cannot be used: .+"):
        build_strategy(experiment)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep", "fedper", "fedprox", "ditto", "apfl", "fedbn", "fedbabu", "pfedfda"])
def test_the_mean_family_accepts_it(algorithm):
    experiment = parse_experiment({"algorithm": algorithm, "num-clients": 4, "num-server-rounds": 2,
                                   "dp-noise-multiplier": 1.0})
    assert build_strategy(experiment).private is not None


@pytest.mark.parametrize(("keys", "message"), [
    ({"dp-clip-norm": 2.0}, "dp-clip-norm=2.0 set with dp-noise-multiplier=0: without noise there is no differential privacy"),
    ({"dp-noise-multiplier": 1.0, "dp-delta": 0.0}, r"ClientLevelDP\(delta=0.0\) \(run config dp-delta\): delta must be in"),
    ({"dp-noise-multiplier": 1.0, "dp-delta": 0.25}, r"\(run config dp-delta\): delta must be in \(0, 1/num_clients"),
    ({"dp-noise-multiplier": 1.0, "dp-clip-norm": 0.0}, "needs a clipping norm > 0"),
    ({"dp-noise-multiplier": 1.0, "dp-adaptive-clipping": True, "dp-count-stddev": 0.4}, "must exceed dp-noise-multiplier / 2"),
    ({"dp-noise-multiplier": 1.0, "dp-adaptive-clipping": True}, r"4 clients per round: .* default clients / 20 = 0.2\) must "
                                                                  r"exceed .* or sample at least 11 clients"),
    ({"dp-noise-multiplier": 1.0, "dp-adaptive-clipping": True, "dp-target-quantile": 1.0}, r"must be in \(0, 1\)"),
    ({"dp-noise-multiplier": 1.0, "dp-max-epsilon": 1.0}, r"2 rounds of 4 clients .* spend epsilon=.* more than dp-max-epsilon=1.0"),
    ({"dp-noise-multiplier": 1.0, "clip-update-norm": 1.0}, "cannot be combined with clip-update-norm"),
    ({"dp-noise-multiplier": 1.0, "aggregate": "trimmed-mean"}, "cannot be combined with aggregate='trimmed-mean'"),
    ({"dp-noise-multiplier": 1.0, "dp-noise-seed": -2}, "dp-noise-seed=-2"),
])
def test_bad_settings_are_refused_before_training(keys, message):
    with pytest.raises(ConfigError, match=message):
        build_strategy(parse_experiment({"num-clients": 4, "num-server-rounds": 2} | keys))


def test_a_budget_that_holds_is_accepted():
    experiment = parse_experiment({"num-clients": 4, "num-server-rounds": 2, "dp-noise-multiplier": 5.0,
                                   "dp-max-epsilon": 10.0, "dp-delta": 1e-3})
    assert build_strategy(experiment).private.planned_epsilon(2, 4) < 10.0


def test_a_run_records_the_privacy_spent_each_round(tmp_path, blobs_dataset):
    config = {"dataset": blobs_dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": 2, "learning-rate": 0.1,
              "partitioner": "iid", "test-fraction": 0.25, "output-dir": str(tmp_path), "run-name": "run",
              "dp-noise-multiplier": 0.3, "dp-clip-norm": 0.1, "dp-delta": 1e-3}
    run_inprocess(server_app, client_app, 3, config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fit = [r for r in rows if r.get("phase") == "fit"]
    assert [r["round"] for r in fit] == [1, 2]
    assert 0 < fit[0]["dp_epsilon"] < fit[1]["dp_epsilon"]
    assert fit[1]["dp_noise_std"] == pytest.approx(0.3 * 0.1 / 3)
    assert read_status(tmp_path / "run")["status"] == "completed"


# ------------------------------------------------------------------------------ details the tool asked about
@pytest.mark.parametrize(("settings", "message"), [
    ({"noise_multiplier": 0.0}, r"^ClientLevelDP\(noise_multiplier=0.0\) \(run config dp-noise-multiplier\): a noise multiplier of 0 adds no noise and gives no privacy; "
                                r"use a value > 0 \(about 1 for a useful guarantee\), or leave client-level DP off "
                                r"\(clip-update-norm bounds a client's pull without claiming privacy\)$"),
    ({"clip_norm": 0.0}, r"^ClientLevelDP\(clip_norm=0.0\) \(run config dp-clip-norm\): client-level DP needs a clipping norm > 0 \(the sensitivity that the noise "
                         r"is scaled to\)$"),
    ({"delta": 0.25}, r"^ClientLevelDP\(delta=0.25\) \(run config dp-delta\): delta must be in \(0, 1/num_clients = 0.2\); a delta of 0 has no finite epsilon "
                      r"for the Gaussian mechanism, and one of 1/N or more allows releasing a client's data outright$"),
    ({"max_epsilon": 0.0}, r"^ClientLevelDP\(max_epsilon=0.0\) \(run config dp-max-epsilon\): must be > 0, or 0 for no limit$"),
    ({"adaptive": True, "target_quantile": 0.0}, r"^ClientLevelDP\(target_quantile=0.0\) \(run config dp-target-quantile\): must be in \(0, 1\)$"),
    ({"adaptive": True, "clip_learning_rate": 0.0}, r"^ClientLevelDP\(clip_learning_rate=0.0\) \(run config dp-clip-learning-rate\): must be > 0$"),
    ({"adaptive": True, "count_stddev": 0.5}, r"^ClientLevelDP\(count_stddev=0.5\) \(run config dp-count-stddev\): must exceed dp-noise-multiplier / 2 = 0.5 "
                                              r"\(Andrew et al., Thm. 1\), or 0 for m / 20$"),
    ({"adaptive": True, "count_stddev": 0.4}, r"^ClientLevelDP\(count_stddev=0.4\) \(run config dp-count-stddev\): must exceed"),
])
def test_each_bad_setting_gets_its_own_message(settings, message):
    with pytest.raises(ConfigError, match=message):
        ClientLevelDP(**({"noise_multiplier": 1.0, "clip_norm": 1.0} | settings)).check(5)


def test_the_adaptive_count_refusal_names_the_numbers():
    with pytest.raises(ConfigError, match=r"^adaptive clipping with 4 clients per round: the noise on the count of "
                       r"unclipped updates \(dp-count-stddev, default clients / 20 = 0.2\) must exceed dp-noise-multiplier "
                       r"/ 2 = 0.75 \(Andrew et al., Thm. 1\); set dp-count-stddev above it, or sample at least 16 clients "
                       r"per round$"):
        PrivateAggregator(ClientLevelDP(1.5, 1.0, adaptive=True), 10, 4)


def test_nothing_released_is_nothing_spent_and_a_budget_may_be_spent_exactly():
    aggregator = PrivateAggregator(ClientLevelDP(1.0, 1.0, delta=1e-3), 10, 10)
    assert aggregator.epsilon() == 0.0 and aggregator.planned_epsilon(0, 10) == 0.0
    planned = aggregator.planned_epsilon(3, 10)
    PrivateAggregator(ClientLevelDP(1.0, 1.0, delta=1e-3, max_epsilon=planned), 10, 10).check_budget(3, 10)
    with pytest.raises(ConfigError, match="more than dp-max-epsilon"):
        PrivateAggregator(ClientLevelDP(1.0, 1.0, delta=1e-3, max_epsilon=planned * 0.999), 10, 10).check_budget(3, 10)


def test_a_damaged_privacy_state_and_a_missing_accountant_are_named(monkeypatch):
    import sys

    aggregator = PrivateAggregator(ClientLevelDP(1.0, 1.0), 10, 10)
    with pytest.raises(ConfigError, match=r"^the checkpoint's client-level DP state is unreadable \(KeyError\('releases'\)"
                       r"\); it was not written by a run with client-level DP$"):
        aggregator.load_state_dict({"clip_norm": 1.0})
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ConfigError, match=r"^client-level DP accounts privacy with Flower's RDP accountant, which is not "
                       r"installed \(.+\); pip install \"flwr_pfl\[privacy\]\""):
        PrivateAggregator(ClientLevelDP(1.0, 1.0), 10, 10)
