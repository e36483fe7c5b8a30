"""Who took part in a round, when the replies carry no ``partition_id`` (a Flower user's own
NumPyClient): each accepted reply counts once, is known by its node id (``node-<id>``), and a
node that replied is never reported dropped; a sampled node that did not reply is."""

from __future__ import annotations

import numpy as np
from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters

from fakes import FakeProxy, client_manager
from flwr_pfl.strategies import FedAvg

ARRAYS = [np.zeros((2, 3), np.float32), np.zeros(3, np.float32)]
OK = Status(Code.OK, "")


class Rows:
    """An ``on_round`` callback that keeps (phase, metrics, per-client dict) of each call."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict, dict]] = []

    def __call__(self, server_round: int, phase: str, metrics: dict, clients: dict) -> None:
        self.rows.append((phase, metrics, clients))


def fit_reply(value: float, n: int) -> FitRes:
    """A reply without any metric, as a plain NumPyClient sends."""
    return FitRes(OK, ndarrays_to_parameters([np.full_like(a, value) for a in ARRAYS]), n, {})


def setup() -> tuple[FedAvg, Rows, list[FakeProxy]]:
    rows = Rows()
    strategy = FedAvg(num_clients=2, initial_arrays=ARRAYS, on_round=rows, seed=0, wait_timeout=0)
    proxies = [FakeProxy("node-b-17"), FakeProxy("node-a-4")]  # no partition id to answer with
    return strategy, rows, proxies


def test_two_fit_replies_without_partition_ids_count_as_two_participants_and_none_dropped() -> None:
    strategy, rows, proxies = setup()
    sampled = strategy.configure_fit(1, ndarrays_to_parameters(ARRAYS), client_manager(proxies))
    assert len(sampled) == 2
    parameters, _ = strategy.aggregate_fit(1, [(proxies[0], fit_reply(1.0, 10)), (proxies[1], fit_reply(4.0, 30))], [])
    assert parameters is not None
    phase, metrics, _ = rows.rows[-1]
    assert phase == "fit"
    assert metrics["participants"] == 2.0
    assert metrics["num_dropped"] == 0.0 and metrics["dropped_ids"] == ""
    assert metrics["participant_ids"] == "node-node-a-4 node-node-b-17"
    np.testing.assert_allclose(strategy.global_arrays[0], np.full((2, 3), 3.25))  # both weighted in: (10 + 120) / 40


def test_a_sampled_node_without_partition_id_that_did_not_reply_is_the_one_dropped() -> None:
    strategy, rows, proxies = setup()
    strategy.configure_fit(1, ndarrays_to_parameters(ARRAYS), client_manager(proxies))
    strategy.aggregate_fit(1, [(proxies[1], fit_reply(1.0, 10))], [RuntimeError("timed out")])
    _, metrics, _ = rows.rows[-1]
    assert metrics["participants"] == 1.0 and metrics["participant_ids"] == "node-node-a-4"
    assert metrics["num_dropped"] == 1.0 and metrics["dropped_ids"] == "node-node-b-17"


def test_two_evaluations_without_partition_ids_count_as_two_participants_and_none_dropped() -> None:
    strategy, rows, proxies = setup()
    assert len(strategy.configure_evaluate(1, ndarrays_to_parameters(ARRAYS), client_manager(proxies))) == 2
    results = [(proxies[0], EvaluateRes(OK, 0.5, 10, {"accuracy": 0.5})), (proxies[1], EvaluateRes(OK, 0.25, 30, {"accuracy": 0.75}))]
    loss, _ = strategy.aggregate_evaluate(1, results, [])
    assert loss == (0.5 * 10 + 0.25 * 30) / 40
    phase, metrics, _ = rows.rows[-1]
    assert phase == "evaluate"
    assert metrics["participants"] == 2.0 and metrics["num_dropped"] == 0.0
    assert metrics["participant_ids"] == "node-node-a-4 node-node-b-17"


def test_replies_with_partition_ids_are_recorded_by_partition_as_before() -> None:
    rows = Rows()
    strategy = FedAvg(num_clients=3, initial_arrays=ARRAYS, on_round=rows, seed=0, wait_timeout=0)
    proxies = [FakeProxy("5000", 0), FakeProxy("5007", 1), FakeProxy("5014", 2)]
    strategy.configure_fit(1, ndarrays_to_parameters(ARRAYS), client_manager(proxies))
    replies = [(p, FitRes(OK, ndarrays_to_parameters(ARRAYS), 5, {"partition_id": p.pid})) for p in proxies[:2]]
    strategy.aggregate_fit(1, replies, [RuntimeError("gone")])
    _, metrics, clients = rows.rows[-1]
    assert sorted(clients) == [0, 1] and metrics["participant_ids"] == "0 1" and metrics["participants"] == 2.0
    assert metrics["num_dropped"] == 1.0 and metrics["dropped_ids"] == "node-5014"  # its partition was never learned


def test_each_exchange_records_its_duration_and_warns_once_when_it_nears_round_timeout(monkeypatch, caplog) -> None:
    """``exchange_seconds`` runs from the sample (just before the instructions go out) to the
    aggregation; over half of ``round_timeout`` it warns once per phase, naming 3x the exchange."""
    import logging

    from flwr_pfl.strategies import base

    now = [0.0]
    monkeypatch.setattr(base.time, "perf_counter", lambda: now[0])
    rows = Rows()
    strategy = FedAvg(num_clients=2, initial_arrays=ARRAYS, on_round=rows, seed=0, wait_timeout=0, round_timeout=50.0)
    proxies = [FakeProxy("a", 0), FakeProxy("b", 1)]
    strategy.partition_of = {"a": 0, "b": 1}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        for server_round, (start, took) in enumerate([(100.0, 30.0), (200.0, 10.0), (300.0, 31.0)], 1):
            now[0] = start
            strategy.record_sample("fit", proxies)
            now[0] = start + took
            strategy._notify(server_round, "fit", {}, {0: {}, 1: {}})
    seconds = [m["exchange_seconds"] for _, m, _ in rows.rows]
    assert seconds == [30.0, 10.0, 31.0]
    warnings = [r.getMessage() for r in caplog.records if "round-timeout" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("round 1: fit took 30.0 s, 60% of round-timeout=50 s")
    assert "at least 90 s" in warnings[0]


def test_without_round_timeout_nothing_warns_and_the_duration_is_still_recorded(caplog) -> None:
    import logging

    rows = Rows()
    strategy = FedAvg(num_clients=2, initial_arrays=ARRAYS, on_round=rows, seed=0, wait_timeout=0)
    strategy.record_sample("evaluate", [FakeProxy("a", 0)])
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy._notify(1, "evaluate", {}, {0: {}})
    assert rows.rows[-1][1]["exchange_seconds"] >= 0.0
    assert not [r for r in caplog.records if "round-timeout" in r.getMessage()]


def test_replies_sort_by_partition_id_then_node_id_and_outside_clients_come_first():
    from flwr_pfl.strategies.sampling import in_partition_order, reply_order

    def reply(cid: str, metrics: dict) -> tuple[FakeProxy, FitRes]:
        return FakeProxy(cid, 0), FitRes(Status(Code.OK, ""), ndarrays_to_parameters([]), 1, metrics)

    assert reply_order(reply("17", {"partition_id": 3})) == (3, "17")
    assert reply_order(reply("17", {})) == (-1, "17")  # a client from outside the suite
    assert reply_order(reply("18", {"partition_id": "x"})) == (-1, "18")  # not a number
    pairs = [reply("9", {"partition_id": 1}), reply("30", {}), reply("12", {"partition_id": 0}),
             reply("8", {"partition_id": 1}), reply("31", {"partition_id": "x"}), reply("2", {"partition_id": -5})]
    assert [p.cid for p, _ in in_partition_order(pairs)] == ["2", "30", "31", "12", "8", "9"]
