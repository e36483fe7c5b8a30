"""Secure aggregation (``secure-aggregation = "secagg+"``): Flower's SecAgg+ protocol gives the
strategy the example-weighted mean of the fit replies, equal to the plain run's aggregate up to
the protocol's quantization (a bound computed from its settings), also when a node drops out in
the middle of the protocol; a round the protocol cannot finish is a round without training;
settings and algorithms it cannot serve are refused before training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flwr_pfl.app import secagg as secagg_module
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.results import RunFailed
from flwr_pfl.app.secagg import SecureAggregation, check_maskable
from flwr_pfl.app.server_app import app as server_app, build_strategy
from flwr_pfl.clients import FedAvgClient
from flwr_pfl.errors import ConfigError

CLIENTS = 4


def config(tmp_path: Path, name: str, **overrides) -> dict:
    """Four clients of unequal sizes (Dirichlet labels), an MLP, one round."""
    base = {
        "dataset": "test-blobs", "model": "mlp", "num-clients": CLIENTS, "num-server-rounds": 1, "learning-rate": 0.1,
        "partitioner": "dirichlet", "test-fraction": 0.25, "output-dir": str(tmp_path), "run-name": name,
    }
    return base | overrides


def global_arrays(tmp_path: Path, name: str) -> list[np.ndarray]:
    with np.load(tmp_path / name / "checkpoint.npz", allow_pickle=True) as saved:
        keys = sorted((k for k in saved.files if k.startswith("global_")), key=lambda k: int(k.split("_")[1]))
        return [saved[k] for k in keys]


@pytest.fixture
def masked(monkeypatch) -> list[int]:
    """The num_examples of every reply the clients checked and masked (proof that each went
    through the protocol)."""
    seen: list[int] = []
    real = secagg_module.check_maskable

    def spy(arrays, num_examples, max_weight, clipping_range):
        seen.append(num_examples)
        return real(arrays, num_examples, max_weight, clipping_range)

    monkeypatch.setattr(secagg_module, "check_maskable", spy)
    return seen


def quantization_bound(sizes: list[int], settings: SecureAggregation = SecureAggregation()) -> float:
    """The largest error SecAgg+ can add to a coordinate of the weighted mean: each client's
    weighted value is rounded (stochastically) to a grid of step 2c/Q, so the sum is off by
    less than K * 2c/Q, and the mean divides that by the sum of the weights n_i / max_weight;
    plus the float32 rounding of both aggregates."""
    step = 2 * settings.clipping_range / settings.quantization_range
    return len(sizes) * step / (sum(sizes) / settings.max_weight) + 1e-6


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_the_secure_aggregate_is_the_plain_one_up_to_quantization(tmp_path, blobs_dataset, masked, algorithm):
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "plain", algorithm=algorithm))
    assert masked == []  # the plain run does not touch the protocol
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", algorithm=algorithm,
                                                          **{"secure-aggregation": "secagg+"}))
    assert len(masked) == CLIENTS and len(set(masked)) > 1  # every client masked; unequal sizes
    plain, secure = global_arrays(tmp_path, "plain"), global_arrays(tmp_path, "secure")
    bound = quantization_bound(masked)
    assert bound < 1e-4
    differences = [float(np.abs(p - s).max()) for p, s in zip(plain, secure, strict=True)]
    assert max(differences) <= bound
    assert max(differences) > 0  # the secure run's aggregate really went through the quantizer
    assert all(p.dtype == s.dtype for p, s in zip(plain, secure))


def test_a_secure_run_repeats_exactly(tmp_path, blobs_dataset):
    """The protocol's stochastic rounding is seeded per run seed, node and round; each round has
    one fit row, with every client, and ends with its evaluation and checkpoint."""
    for name in ("a", "b"):
        run_inprocess(server_app, client_app, CLIENTS,
                      config(tmp_path, name, **{"secure-aggregation": "secagg+", "num-server-rounds": 2}))
    for first, second in zip(global_arrays(tmp_path, "a"), global_arrays(tmp_path, "b"), strict=True):
        np.testing.assert_array_equal(first, second)
    rows = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert [(r["round"], r["phase"], r["participants"]) for r in rows if r["phase"] in ("fit", "evaluate")] == [
        (1, "fit", CLIENTS), (1, "evaluate", CLIENTS), (2, "fit", CLIENTS), (2, "evaluate", CLIENTS)]
    with np.load(tmp_path / "a" / "checkpoint.npz", allow_pickle=True) as saved:
        assert int(saved["rounds_done"]) == 2


def drop_at(monkeypatch, partition: int, stage: str) -> None:
    """``partition``'s node loses its connection when the protocol's ``stage`` reaches it."""
    real = secagg_module.secaggplus_mod

    def dropping(message, context, call_next):
        configs = message.content.config_records.get("secaggplus_configs")
        if context.node_config["partition-id"] == partition and configs is not None and configs.get("stage") == stage:
            raise ConnectionError(f"node {partition} lost its connection")
        return real(message, context, call_next)

    monkeypatch.setattr(secagg_module, "secaggplus_mod", dropping)


@pytest.fixture
def partition_2_fails_to_train(monkeypatch) -> None:
    real_fit = FedAvgClient.fit

    def fit(self, parameters, cfg):
        if self.partition_id == 2:
            raise RuntimeError("partition 2 went offline")
        return real_fit(self, parameters, cfg)

    monkeypatch.setattr(FedAvgClient, "fit", fit)


def test_a_node_dropping_out_before_its_masked_reply_leaves_the_others_mean(tmp_path, blobs_dataset, masked,
                                                                             partition_2_fails_to_train):
    """Partition 2 took part in the key exchange, then failed while training: its pairwise masks
    are removed from the others' shares, and the aggregate is the plain mean of the three
    others (the plain run with the same failure)."""
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "plain"))
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", **{"secure-aggregation": "secagg+"}))
    assert len(masked) == CLIENTS - 1
    for plain, secure in zip(global_arrays(tmp_path, "plain"), global_arrays(tmp_path, "secure"), strict=True):
        np.testing.assert_allclose(secure, plain, rtol=0, atol=quantization_bound(masked))
    fit_row = next(r for r in json.loads((tmp_path / "secure" / "metrics.json").read_text()) if r["phase"] == "fit")
    assert fit_row["num_failures"] == 1 and fit_row["participants"] == CLIENTS - 1


def test_a_node_dropping_out_while_unmasking_still_counts(tmp_path, blobs_dataset, monkeypatch, masked):
    """Partition 1 sent its masked reply, then vanished before the unmask stage: its private
    mask is rebuilt from its neighbours' shares and its reply stays in the mean of all four."""
    drop_at(monkeypatch, 1, "unmask")
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "plain"))
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", **{"secure-aggregation": "secagg+"}))
    assert len(masked) == CLIENTS
    for plain, secure in zip(global_arrays(tmp_path, "plain"), global_arrays(tmp_path, "secure"), strict=True):
        np.testing.assert_allclose(secure, plain, rtol=0, atol=quantization_bound(masked))


@pytest.mark.parametrize("stage", ["setup", "share_keys"])
def test_a_node_dropping_out_before_sharing_its_keys_leaves_the_others_mean(tmp_path, blobs_dataset, monkeypatch, masked,
                                                                             partition_2_fails_to_train, stage):
    """Partition 2 vanishes during the key exchange: it never trains, its neighbours hold no share
    of its secrets, and the round aggregates the three others (as the plain run whose partition
    2 fails). Flower 1.42 alone asks the others for shares of it in the unmask stage, and every
    client fails there: the round would halt."""
    drop_at(monkeypatch, 2, stage)
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "plain"))
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", **{"secure-aggregation": "secagg+"}))
    assert len(masked) == CLIENTS - 1
    for plain, secure in zip(global_arrays(tmp_path, "plain"), global_arrays(tmp_path, "secure"), strict=True):
        np.testing.assert_allclose(secure, plain, rtol=0, atol=quantization_bound(masked))


def test_a_round_the_protocol_cannot_finish_is_a_round_without_training(tmp_path, blobs_dataset, monkeypatch, caplog):
    """Three of four nodes fail after the key exchange: too few shares remain, Flower's workflow
    halts without an aggregate, and the run ends failed instead of "completing"."""
    real_fit = FedAvgClient.fit

    def fit(self, parameters, cfg):
        if self.partition_id != 0:
            raise RuntimeError("offline")
        return real_fit(self, parameters, cfg)

    monkeypatch.setattr(FedAvgClient, "fit", fit)
    with caplog.at_level("WARNING", logger="flwr"), pytest.raises(RunFailed):
        run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", **{"secure-aggregation": "secagg+"}))
    summary = json.loads((tmp_path / "secure" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "secure aggregation halted" in json.dumps(summary)
    assert "the clients' errors (round 1, fit): 4 of 4 failed" in json.dumps(summary)
    assert "offline" in json.dumps(summary)  # the clients' own errors are quoted too
    assert ("round 1: secure aggregation halted: too few of the 4 clients asked completed the protocol to reconstruct "
            "the sum; the global model is unchanged") in caplog.text
    fits = [r for r in json.loads((tmp_path / "secure" / "metrics.json").read_text()) if r["phase"] == "fit"]
    assert [(r["round"], r["num_failures"], r["participants"]) for r in fits] == [(1, CLIENTS, 0)]


def test_a_client_with_more_examples_than_max_weight_refuses_to_be_masked(tmp_path, blobs_dataset):
    with pytest.raises(RunFailed):
        run_inprocess(server_app, client_app, CLIENTS,
                      config(tmp_path, "secure", **{"secure-aggregation": "secagg+", "secagg-max-weight": 10.0}))
    assert "secagg-max-weight" in (tmp_path / "secure" / "summary.json").read_text()


def test_a_node_dropping_out_before_sharing_keeps_its_neighbourhoods_narrow(tmp_path, blobs_dataset, monkeypatch,
                                                                            masked):
    """Five clients, three shares each (a client's neighbourhood is itself and two others):
    partition 2 vanishes at setup, and the four others' mean is still exact, each client's masks
    removed with its own neighbours only."""
    drop_at(monkeypatch, 2, "setup")
    real_fit = FedAvgClient.fit

    def fit(self, parameters, cfg):
        if self.partition_id == 2:
            raise RuntimeError("partition 2 went offline")
        return real_fit(self, parameters, cfg)

    monkeypatch.setattr(FedAvgClient, "fit", fit)
    five = {"num-clients": 5}
    run_inprocess(server_app, client_app, 5, config(tmp_path, "plain", **five))
    run_inprocess(server_app, client_app, 5, config(tmp_path, "secure", **five, **{
        "secure-aggregation": "secagg+", "secagg-num-shares": 3, "secagg-threshold": 2}))
    assert len(masked) == 4
    for plain, secure in zip(global_arrays(tmp_path, "plain"), global_arrays(tmp_path, "secure"), strict=True):
        np.testing.assert_allclose(secure, plain, rtol=0, atol=quantization_bound(masked))


def test_the_rounds_and_the_round_timeout_reach_flowers_workflow(tmp_path, blobs_dataset, monkeypatch):
    seen = {}
    real_workflow, real_context = SecureAggregation.workflow, secagg_module.LegacyContext

    def workflow(self, timeout):
        seen["protocol_timeout"] = timeout
        return real_workflow(self, timeout)

    def legacy_context(context, config, strategy):
        seen["rounds"], seen["round_timeout"] = config.num_rounds, config.round_timeout
        return real_context(context, config=config, strategy=strategy)

    monkeypatch.setattr(SecureAggregation, "workflow", workflow)
    monkeypatch.setattr(secagg_module, "LegacyContext", legacy_context)
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", **{
        "secure-aggregation": "secagg+", "round-timeout": 30.0, "num-server-rounds": 2}))
    assert seen == {"protocol_timeout": 30.0, "rounds": 2, "round_timeout": 30.0}


def test_evaluation_failures_of_a_secure_run_are_recorded(tmp_path, blobs_dataset, monkeypatch):
    def evaluate(self, parameters, cfg):
        raise RuntimeError("the test split is unreadable")

    monkeypatch.setattr(FedAvgClient, "evaluate", evaluate)
    run_inprocess(server_app, client_app, CLIENTS, config(tmp_path, "secure", **{"secure-aggregation": "secagg+"}))
    assert "evaluate failures (round 1): 4 of 4 failed" in (tmp_path / "secure" / "summary.txt").read_text()


# ------------------------------------------------------------------------------ client checks
def test_check_maskable_refuses_what_the_protocol_would_corrupt():
    fine = [np.array([7.9, -7.9]), np.zeros((2, 2), dtype=np.int64)]
    check_maskable(fine, num_examples=1000, max_weight=1000.0, clipping_range=8.0)
    check_maskable([np.array([15.0])], num_examples=500, max_weight=1000.0, clipping_range=8.0)  # weighted: 7.5
    with pytest.raises(ValueError, match=r"1001 examples.*secagg-max-weight=1000"):
        check_maskable(fine, num_examples=1001, max_weight=1000.0, clipping_range=8.0)
    with pytest.raises(ValueError, match=r"array 1 .*17.*secagg-clipping-range=8"):
        check_maskable([np.array([1.0]), np.array([[0.0, -17.0]])], num_examples=500, max_weight=1000.0, clipping_range=8.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_maskable([np.array([np.nan])], num_examples=5, max_weight=1000.0, clipping_range=8.0)


def test_a_secure_runs_client_refuses_a_train_message_without_the_protocol():
    from flwr.app import Context, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    message = Message(RecordDict(), dst_node_id=5, message_type="train")
    secure = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={"secure-aggregation": "secagg+"})
    with pytest.raises(ValueError, match="in the clear"):
        secagg_module.secagg_client_mod(message, secure, lambda m, c: m)
    plain = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    assert secagg_module.secagg_client_mod(message, plain, lambda m, c: "answered") == "answered"


# ------------------------------------------------------------------------------ refusals
def secure_experiment(**overrides):
    return parse_experiment({"num-clients": CLIENTS, "num-server-rounds": 2, "secure-aggregation": "secagg+"} | overrides)


def test_the_algorithms_that_need_single_replies_refuse_it_naming_why():
    for algorithm, reason in (("fedamp", "attention weights"), ("pfedfda", "feature statistics"), ("fedora", "own rule"),
                              ("local", "sends no model"), ("pfedhn", "hypernetwork")):
        with pytest.raises(ConfigError, match=rf"secure-aggregation cannot be used: .*{reason}"):
            build_strategy(secure_experiment(algorithm=algorithm))
    for algorithm in ("fedavg", "fedrep", "fedper", "finetune", "ditto", "fedbn"):
        assert build_strategy(secure_experiment(algorithm=algorithm)).secure_aggregation


@pytest.mark.parametrize(("overrides", "match"), [
    ({"clip-update-norm": 1.0}, "clip-update-norm"),
    ({"aggregate": "trimmed-mean"}, "trimmed-mean"),
    ({"dp-noise-multiplier": 1.0}, "client-level DP"),
    ({"algorithm": "pfedme", "pfedme.weighting": "uniform"}, "weights every reply by its number of examples"),
])
def test_what_needs_each_update_is_refused_with_it(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_strategy(secure_experiment(**overrides))


@pytest.mark.parametrize(("overrides", "match"), [
    ({"api": "message"}, "needs api='numpyclient'"),
    ({"secure-aggregation": "secagg"}, "secure-aggregation"),
    ({"secure-aggregation": "off", "secagg-threshold": 3}, "in the clear"),
    ({"secagg-num-shares": 2}, "integer > 2"),
    ({"secagg-threshold": 1.5}, "integer >= 2"),
    ({"secagg-num-shares": 5, "secagg-threshold": 5}, "less than secagg-num-shares"),
    ({"secagg-quantization-range": 1000}, "power of 2"),
    ({"secagg-clipping-range": 0.0}, "must be > 0"),
    ({"secagg-max-weight": 0.5}, ">= 1"),
])
def test_bad_settings_are_refused_before_training(overrides, match):
    with pytest.raises(ConfigError, match=match):
        secure_experiment(**overrides)


def test_a_protocol_that_could_never_finish_is_refused_for_the_rounds_sample():
    settings = SecureAggregation(num_shares=3, threshold=2)
    settings.check_sampled(10)
    with pytest.raises(ConfigError, match="at least 3 clients per round"):
        settings.check_sampled(2)
    with pytest.raises(ConfigError, match=r"7 shares .* only 4 neighbours"):
        SecureAggregation(num_shares=1.0, threshold=7).check_sampled(4)
    assert SecureAggregation().shares_and_threshold(4) == (4, 2)
    assert SecureAggregation(num_shares=0.5, threshold=0.6).shares_and_threshold(10) == (5, 3)


def test_a_server_checks_the_sample_before_training(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match="at least 3 clients per round"):
        run_inprocess(server_app, client_app, CLIENTS,
                      config(tmp_path, "secure", **{"secure-aggregation": "secagg+", "fraction-fit": 0.5}))
    assert not (tmp_path / "secure").exists()


@pytest.mark.slow
def test_a_secure_run_on_ray_gives_the_inprocess_numbers(tmp_path, data_dir):
    """Flower's simulation engine (clients in Ray actors, the protocol's state carried in each
    node's context between its four messages a round): byte-identical to the in-process run."""
    from flwr_pfl.app.simulation import run_ray_simulation

    cfg = {"dataset": "fashion-mnist", "data-dir": str(data_dir), "max-samples": 900, "model": "mlp",
           "num-clients": CLIENTS, "num-server-rounds": 2, "output-dir": str(tmp_path), "algorithm": "fedrep",
           "secure-aggregation": "secagg+"}
    run_ray_simulation(cfg | {"run-name": "ray"}, num_clients=CLIENTS, total_cpus=2)
    run_inprocess(server_app, client_app, CLIENTS, cfg | {"run-name": "inprocess"})
    ray, inprocess = ((tmp_path / name / "metrics.json").read_bytes() for name in ("ray", "inprocess"))
    assert ray == inprocess
    assert [r["participants"] for r in json.loads(ray) if r["phase"] == "fit"] == [CLIENTS, CLIENTS]


# ------------------------------------------------------------------------------ settings, unit by unit
@pytest.mark.parametrize(("num_shares", "threshold", "sampled", "expected"), [
    (1.0, 0.5, 4, (4, 2)),     # every sampled client shares with every other
    (1.0, 0.5, 10, (10, 5)),
    (1.0, 0.5, 3, (3, 2)),     # round(1.5) = 2
    (0.5, 0.6, 10, (5, 3)),
    (0.4, 0.5, 10, (5, 2)),    # 4 shares, even and below the sample: made odd; round(2.5) = 2
    (0.2, 0.5, 10, (3, 2)),    # 2 -> 3 (odd)
    (0.1, 0.5, 10, (10, 5)),   # 1 share is too few: every client
    (4.0, 3.0, 10, (5, 3)),    # an even count below the sample is made odd
    (4.0, 3.0, 4, (4, 3)),     # ... but not when it is the whole sample
    (3.0, 2.0, 3, (3, 2)),
    (1.0, 0.9, 5, (5, 4)),     # round(4.5) = 4
    (1.0, 0.1, 5, (5, 2)),     # at least 2
])
def test_shares_and_threshold_follow_flowers_rules(num_shares, threshold, sampled, expected):
    assert SecureAggregation(num_shares=num_shares, threshold=threshold).shares_and_threshold(sampled) == expected


def test_a_threshold_equal_to_the_neighbourhood_is_allowed_one_more_is_not():
    SecureAggregation(num_shares=1.0, threshold=4).check_sampled(4)
    SecureAggregation().check_sampled(3)
    with pytest.raises(ConfigError, match=r"gives 5 shares .* only 4 neighbours \(itself included\) in a round of 4"):
        SecureAggregation(num_shares=1.0, threshold=5).check_sampled(4)
    with pytest.raises(ConfigError, match=r"but a round samples 2"):
        SecureAggregation().check_sampled(2)


@pytest.mark.parametrize(("field", "value", "ok"), [
    ("num_shares", 1.0, True), ("num_shares", 0.01, True), ("num_shares", 3.0, True), ("num_shares", 0.0, False),
    ("num_shares", 2.0, False), ("num_shares", 3.5, False), ("num_shares", -1.0, False),
    ("threshold", 0.99, True), ("threshold", 2.0, True), ("threshold", 1.0, False), ("threshold", 0.0, False),
    ("threshold", 2.5, False),
    ("clipping_range", 1e-3, True), ("clipping_range", 0.0, False), ("clipping_range", -8.0, False),
    ("quantization_range", 1 << 31, True), ("quantization_range", 1 << 32, False), ("quantization_range", 3 << 20, False),
    ("quantization_range", 0, False), ("quantization_range", 1, True), ("quantization_range", 2, True),
    ("max_weight", 1.0, True), ("max_weight", 0.99, False),
])
def test_each_setting_has_its_range(field, value, ok):
    if ok:
        SecureAggregation(**{field: value})
    else:
        with pytest.raises(ConfigError, match=f"secagg-{field.replace('_', '-')}"):
            SecureAggregation(**{field: value})


def test_the_workflow_gets_counts_as_integers_and_fractions_as_floats():
    counts = SecureAggregation(num_shares=5, threshold=3, clipping_range=4.0, quantization_range=1 << 20,
                               max_weight=500.0).workflow(timeout=12.0)
    assert (counts.num_shares, counts.reconstruction_threshold) == (5, 3)
    assert isinstance(counts.num_shares, int) and isinstance(counts.reconstruction_threshold, int)
    assert (counts.clipping_range, counts.quantization_range, counts.max_weight, counts.timeout) == (4.0, 1 << 20, 500.0, 12.0)
    fractions = SecureAggregation(num_shares=0.6, threshold=0.5).workflow(timeout=None)
    assert (fractions.num_shares, fractions.reconstruction_threshold) == (0.6, 0.5)
    assert isinstance(fractions.num_shares, float) and fractions.timeout is None


def test_check_maskable_boundaries_are_inclusive():
    check_maskable([np.array([8.0, -8.0])], num_examples=1000, max_weight=1000.0, clipping_range=8.0)  # exactly +-c
    check_maskable([np.array([16.0])], num_examples=500, max_weight=1000.0, clipping_range=8.0)  # weighted: exactly c
    check_maskable([np.zeros(0), np.array([1.0])], num_examples=1000, max_weight=1000.0, clipping_range=8.0)
    with pytest.raises(ValueError, match="array 0"):
        check_maskable([np.array([16.001])], num_examples=500, max_weight=1000.0, clipping_range=8.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_maskable([np.array([np.inf])], num_examples=5, max_weight=1000.0, clipping_range=8.0)
    # an integer array's most negative value counts by its magnitude (int8's abs(-128) is -128)
    with pytest.raises(ValueError, match=r"array 0 of the reply holds 128,"):
        check_maskable([np.array([-128, 5], dtype=np.int8)], num_examples=10, max_weight=10.0, clipping_range=100.0)


def test_the_client_mod_passes_other_messages_by_and_refuses_a_stage_in_a_plain_run():
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    secure = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={"secure-aggregation": "secagg+"})
    query = Message(RecordDict(), dst_node_id=5, message_type="query")
    assert secagg_module.secagg_client_mod(query, secure, lambda m, c: "answered") == "answered"
    staged = Message(RecordDict({"secaggplus_configs": ConfigRecord({"stage": "setup"})}), dst_node_id=5,
                     message_type="train")
    plain = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={"secure-aggregation": "off"})
    with pytest.raises(ValueError, match="arrived in a run without secure-aggregation"):
        secagg_module.secagg_client_mod(staged, plain, lambda m, c: "answered")


def test_the_rounding_is_seeded_per_run_node_and_round_and_leaves_numpys_state_alone():
    from flwr.app import Context, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1

    def draw(seed: int, partition: int, group: str) -> float:
        context = Context(run_id=1, node_id=9, node_config={"partition-id": partition}, state=RecordDict(),
                          run_config={"seed": seed})
        message = Message(RecordDict(), dst_node_id=9, message_type="train", group_id=group)
        with secagg_module.rounding_seeded(context, message):
            return float(np.random.rand())

    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    first = draw(0, 1, "2")
    assert np.array_equal(np.random.get_state()[1], before)  # restored
    assert draw(0, 1, "2") == first
    assert len({first, draw(1, 1, "2"), draw(0, 2, "2"), draw(0, 1, "3"), draw(0, 1, "x")}) == 5


def test_a_failure_flower_lists_twice_counts_once():
    from flwr.app import Error

    error = Error(code=0, reason="offline")
    twice = [Exception(error), Exception(error)]
    assert len(secagg_module.distinct_failures(twice)) == 1
    halted = [secagg_module.SecAggHalted("same words"), secagg_module.SecAggHalted("same words")]
    assert len(secagg_module.distinct_failures(halted)) == 2  # one per client, though worded alike
    assert len(secagg_module.distinct_failures([RuntimeError(), RuntimeError()])) == 2


def test_the_refusals_say_what_is_allowed_in_full():
    with pytest.raises(ConfigError) as shares:
        SecureAggregation(num_shares=2)
    assert str(shares.value) == ("secagg-num-shares=2: an integer > 2 (shares per client) or a fraction in (0, 1] of "
                                 "the clients a round samples")
    with pytest.raises(ConfigError) as threshold:
        SecureAggregation(threshold=1.0)
    assert str(threshold.value) == ("secagg-threshold=1.0: an integer >= 2 (shares that reconstruct a secret) or a "
                                    "fraction in (0, 1) of the shares")
    with pytest.raises(ConfigError, match="must be less than secagg-num-shares=3"):
        SecureAggregation(num_shares=3, threshold=3)
    with pytest.raises(ConfigError) as quantization:
        SecureAggregation(quantization_range=1000)
    assert str(quantization.value).endswith("(the protocol's masks are drawn modulo 2**32)")
    with pytest.raises(ConfigError) as neighbourhood:
        SecureAggregation(num_shares=1.0, threshold=5).check_sampled(4)
    assert str(neighbourhood.value).endswith("clients; every round would halt. Lower secagg-threshold or raise "
                                             "secagg-num-shares")
    with pytest.raises(ValueError) as weight:
        check_maskable([np.zeros(1)], num_examples=11, max_weight=10.0, clipping_range=8.0)
    assert str(weight.value).endswith("Set secagg-max-weight to at least the largest client's number of training examples")
    with pytest.raises(ValueError) as clipped:
        check_maskable([np.zeros(0), np.array([100.0])], num_examples=10, max_weight=10.0, clipping_range=8.0)
    assert str(clipped.value).endswith("would be clipped; raise secagg-clipping-range (or secagg-max-weight)")
    assert isinstance(SecureAggregation(num_shares=3, threshold=2).workflow(None).num_shares, int)


def test_the_client_mods_refusals_in_full():
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    secure = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={"secure-aggregation": "secagg+"})
    with pytest.raises(ValueError) as clear:
        secagg_module.secagg_client_mod(Message(RecordDict(), dst_node_id=5, message_type="train"), secure, lambda m, c: m)
    assert str(clear.value) == ("this run aggregates securely (secure-aggregation), but the train message carries no "
                                "SecAgg+ stage: the reply would reach the server in the clear; refused")
    staged = Message(RecordDict({"secaggplus_configs": ConfigRecord({"stage": "setup"})}), dst_node_id=5, message_type="train")
    plain = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError) as stray:
        secagg_module.secagg_client_mod(staged, plain, lambda m, c: m)
    assert str(stray.value) == "a secure-aggregation stage arrived in a run without secure-aggregation; refused"
