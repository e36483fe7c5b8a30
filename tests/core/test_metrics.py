"""Summaries of client metrics: weighted/unweighted means, spread, and exact per-domain pooling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_pfl.core.metrics import aggregate_client_metrics, domain_metrics, summarize

# ---------------------------------------------------------------- summarize


def test_summarize_matches_numpy():
    values = [0.5, 0.9, 0.2, 0.7]
    weights = [10, 30, 5, 55]
    out = summarize(values, weights)
    assert out["wmean"] == pytest.approx(np.average(values, weights=weights))
    assert out["wmean"] == pytest.approx((0.5 * 10 + 0.9 * 30 + 0.2 * 5 + 0.7 * 55) / 100)
    assert out["mean"] == pytest.approx(np.mean(values))
    assert out["min"] == 0.2 and out["max"] == 0.9
    assert out["std"] == pytest.approx(np.std(values))  # population std
    assert out["n_nonfinite"] == 0.0
    assert set(out) == {"wmean", "mean", "min", "max", "std", "n_nonfinite"}


def test_summarize_weighted_differs_from_unweighted():
    out = summarize([0.0, 1.0], [1, 3])
    assert out["wmean"] == pytest.approx(0.75)
    assert out["mean"] == pytest.approx(0.5)


def test_summarize_without_weights_is_unweighted():
    out = summarize([1.0, 2.0, 6.0])
    assert out["wmean"] == pytest.approx(3.0) and out["mean"] == pytest.approx(3.0)
    assert out["std"] == pytest.approx(np.std([1.0, 2.0, 6.0]))


def test_summarize_all_zero_weights_falls_back_to_mean():
    out = summarize([1.0, 3.0], [0, 0])
    assert out["wmean"] == pytest.approx(2.0)


def test_summarize_excludes_and_counts_non_finite():
    values = [0.5, float("nan"), 0.9, float("inf"), 0.1]
    weights = [1, 100, 2, 100, 3]
    out = summarize(values, weights)
    assert out["n_nonfinite"] == 2.0
    finite_v, finite_w = [0.5, 0.9, 0.1], [1, 2, 3]
    assert out["wmean"] == pytest.approx(np.average(finite_v, weights=finite_w))
    assert out["mean"] == pytest.approx(np.mean(finite_v))
    assert out["min"] == 0.1 and out["max"] == 0.9
    assert out["std"] == pytest.approx(np.std(finite_v))


def test_summarize_all_non_finite_or_empty():
    out = summarize([float("nan"), float("-inf")])
    assert out["n_nonfinite"] == 2.0
    for key in ("wmean", "mean", "min", "max", "std"):
        assert math.isnan(out[key])
    empty = summarize([])
    assert empty["n_nonfinite"] == 0.0 and math.isnan(empty["mean"])


def test_summarize_length_mismatch_raises():
    with pytest.raises(ValueError, match="weights"):
        summarize([1.0, 2.0], [1.0])


# ---------------------------------------------------------------- domain_metrics


CLIENTS = [
    # client 0: 10 samples of domain 0 (7 right), 30 of domain 1 (15 right)
    {"n_d0": 10.0, "acc_d0": 0.7, "loss_d0": 0.4, "n_d1": 30.0, "acc_d1": 0.5, "loss_d1": 1.0},
    # client 1: 40 samples of domain 0 (36 right), none of domain 1, 20 of domain 2 (5 right)
    {"n_d0": 40.0, "acc_d0": 0.9, "loss_d0": 0.2, "n_d2": 20.0, "acc_d2": 0.25, "loss_d2": 2.0},
    # client 2: 10 samples of domain 1 (9 right)
    {"n_d1": 10.0, "acc_d1": 0.9, "loss_d1": 0.3},
]


def test_domain_pooling_equals_pooled_accuracy_by_hand():
    out = domain_metrics(CLIENTS)
    acc = {0: (7 + 36) / 50, 1: (15 + 9) / 40, 2: 5 / 20}
    loss = {0: (10 * 0.4 + 40 * 0.2) / 50, 1: (30 * 1.0 + 10 * 0.3) / 40, 2: 2.0}
    for m in range(3):
        assert out[f"acc_d{m}"] == pytest.approx(acc[m])
        assert out[f"loss_d{m}"] == pytest.approx(loss[m])
    assert out["acc_domain_min"] == pytest.approx(min(acc.values()))
    assert out["acc_domain_mean"] == pytest.approx(np.mean(list(acc.values())))
    assert out["loss_domain_max"] == pytest.approx(max(loss.values()))
    assert out["loss_domain_mean"] == pytest.approx(np.mean(list(loss.values())))
    assert set(out) == {
        "acc_d0", "acc_d1", "acc_d2", "loss_d0", "loss_d1", "loss_d2",
        "acc_domain_min", "acc_domain_mean", "loss_domain_max", "loss_domain_mean",
    }


def test_domain_pooling_is_not_the_plain_mean_of_clients():
    out = domain_metrics(CLIENTS)
    assert out["acc_d0"] != pytest.approx((0.7 + 0.9) / 2)


def test_domain_metrics_with_prefixes_kept_apart():
    clients = [
        {"global_n_d0": 10.0, "global_acc_d0": 0.5, "n_d0": 10.0, "acc_d0": 0.8},
        {"global_n_d0": 30.0, "global_acc_d0": 0.1, "n_d0": 30.0, "acc_d0": 0.4},
    ]
    out = domain_metrics(clients)
    assert out["global_acc_d0"] == pytest.approx((5 + 3) / 40)
    assert out["acc_d0"] == pytest.approx((8 + 12) / 40)
    assert out["global_acc_domain_min"] == pytest.approx(0.2)
    assert out["acc_domain_mean"] == pytest.approx(0.5)


def test_domain_metrics_skip_missing_counts_and_non_finite_values():
    clients = [
        {"n_d0": 10.0, "acc_d0": 0.5},
        {"acc_d0": 0.0},  # no count: ignored
        {"n_d0": 0.0, "acc_d0": 0.0},  # zero count: ignored
        {"n_d0": 5.0, "acc_d0": float("nan"), "loss_d0": 1.0},  # NaN accuracy left out
    ]
    out = domain_metrics(clients)
    assert out["acc_d0"] == pytest.approx(0.5)
    assert out["loss_d0"] == pytest.approx(1.0)


def test_domain_metrics_empty():
    assert domain_metrics([]) == {}
    assert domain_metrics([{"accuracy": 0.5, "loss": 1.0}]) == {}


# ---------------------------------------------------------------- aggregate_client_metrics


def test_aggregate_client_metrics_summaries_and_domains():
    results = [(n, m | {"accuracy": a, "loss": l, "partition_id": pid})
               for (n, m, a, l, pid) in zip([40, 60, 10], CLIENTS, [0.55, 0.75, 0.9], [0.8, 0.6, 0.3], [0, 1, 2])]
    out = aggregate_client_metrics(results)
    assert out["num_clients"] == 3.0
    acc, w = [0.55, 0.75, 0.9], [40, 60, 10]
    assert out["accuracy_wmean"] == pytest.approx(np.average(acc, weights=w))
    assert out["accuracy_mean"] == pytest.approx(np.mean(acc))
    assert out["accuracy_min"] == 0.55 and out["accuracy_max"] == 0.9
    assert out["accuracy_std"] == pytest.approx(np.std(acc))
    assert out["loss_wmean"] == pytest.approx(np.average([0.8, 0.6, 0.3], weights=w))
    # bookkeeping and per-domain figures are not summarised across clients
    assert not any(k.startswith(("partition_id", "n_d", "acc_d0_", "loss_d1_")) for k in out)
    assert "accuracy_n_nonfinite" not in out
    assert out["acc_d0"] == pytest.approx(43 / 50)
    assert out["acc_domain_min"] == pytest.approx(0.25)


def test_aggregate_client_metrics_nan_is_excluded_and_counted():
    results = [(10, {"accuracy": 0.5}), (10, {"accuracy": float("nan")}), (30, {"accuracy": 0.9})]
    out = aggregate_client_metrics(results)
    assert out["accuracy_n_nonfinite"] == 1.0
    assert out["accuracy_wmean"] == pytest.approx((5 + 27) / 40)
    assert out["accuracy_mean"] == pytest.approx(0.7)


def test_aggregate_client_metrics_keys_present_in_some_clients_only():
    results = [(10, {"accuracy": 0.5, "extra": 2.0}), (30, {"accuracy": 0.9})]
    out = aggregate_client_metrics(results)
    assert out["extra_mean"] == 2.0 and out["extra_wmean"] == 2.0 and out["extra_std"] == 0.0
    assert out["accuracy_wmean"] == pytest.approx(0.8)


def test_aggregate_client_metrics_explicit_keys_and_non_numeric_skipped():
    results = [(10, {"accuracy": 0.5, "loss": 1.0, "name": "a", "ok": True}), (30, {"accuracy": 0.9, "loss": 2.0})]
    out = aggregate_client_metrics(results, keys=["loss"])
    assert "loss_mean" in out and not any(k.startswith("accuracy") for k in out)
    default = aggregate_client_metrics(results)
    assert not any(k.startswith(("name", "ok")) for k in default)
    assert "accuracy_mean" in default


def test_aggregate_client_metrics_no_results():
    assert aggregate_client_metrics([]) == {"num_clients": 0.0}
