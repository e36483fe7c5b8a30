"""flwr_pfl.messages: what the Message-API flavour puts in a message comes back exactly, and a
malformed reply is refused with a message that says what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from flwr_pfl import messages
from flwr_pfl.messages import MessageContentError


def test_train_reply_round_trip_keeps_order_dtype_and_every_metric() -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([3, 1], dtype=np.int64), np.float64(2.5) * np.ones(1)]
    metrics = {"train_loss": 0.25, "partition_id": 4, "note": "no subspace", "flag": True}
    content = messages.train_reply_content(arrays, 17, metrics, names=["w", "steps", "scale"])
    got, n, got_metrics = messages.read_train_reply(content)
    assert n == 17 and got_metrics == metrics
    assert [a.dtype for a in got] == [a.dtype for a in arrays]
    for a, b in zip(got, arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    assert list(content.array_records["arrays"].keys()) == ["w", "steps", "scale"]
    # numbers go to the MetricRecord, the rest (Flower's MetricRecord holds numbers only) to "info"
    assert set(content.metric_records["metrics"]) == {"train_loss", "partition_id", "num-examples"}
    assert dict(content.config_records["info"]) == {"note": "no subspace", "flag": True}


@pytest.mark.parametrize("names", [None, ["a"], ["a", "a"]])
def test_arrays_are_named_by_position_without_usable_names(names) -> None:
    record = messages.pack_arrays([np.zeros(1), np.ones(2)], names)
    assert list(record.keys()) == ["0", "1"]


def test_evaluate_reply_carries_loss_and_examples() -> None:
    content = messages.metrics_content(9, {"accuracy": 0.5, "loss": 0.75}, loss=0.75)
    assert messages.read_evaluate_reply(content) == (0.75, 9, {"accuracy": 0.5, "loss": 0.75})
    # the loss travels even when the client's metrics do not repeat it (a user's own client)
    content = messages.metrics_content(9, {"accuracy": 0.5}, loss=0.375)
    assert dict(content.metric_records["metrics"]) == {"accuracy": 0.5, "loss": 0.375, "num-examples": 9}
    assert messages.read_evaluate_reply(content) == (0.375, 9, {"accuracy": 0.5, "loss": 0.375})


def test_a_metric_that_contradicts_the_reply_is_refused() -> None:
    with pytest.raises(MessageContentError, match="num-examples"):
        messages.metrics_content(3, {"num-examples": 4})
    with pytest.raises(MessageContentError, match="differs from the loss"):
        messages.metrics_content(3, {"loss": 0.5}, loss=0.25)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (RecordDict(), "no MetricRecord"),
        (RecordDict({"metrics": MetricRecord({"acc": 1.0})}), "num-examples"),
        (RecordDict({"metrics": MetricRecord({"num-examples": -2})}), "not a non-negative integer"),
        (RecordDict({"metrics": MetricRecord({"num-examples": 2.0})}), "not a non-negative integer"),
    ],
)
def test_malformed_replies_are_refused(content: RecordDict, match: str) -> None:
    with pytest.raises(MessageContentError, match=match):
        messages.read_train_reply(content)


def test_an_evaluate_reply_without_loss_is_refused() -> None:
    with pytest.raises(MessageContentError, match="'loss'"):
        messages.read_evaluate_reply(messages.metrics_content(3, {"accuracy": 1.0}))


def test_requests_and_queries_round_trip() -> None:
    arrays, config = messages.read_request(messages.request_content([np.ones(2)], {"server-round": 2, "phase": "head"}))
    assert config == {"server-round": 2, "phase": "head"} and len(arrays) == 1
    assert messages.read_request(messages.query_content({"query": "federation"})) == ([], {"query": "federation"})
    assert messages.read_properties(messages.properties_content({"partition_id": 3})) == {"partition_id": 3}
    with pytest.raises(MessageContentError, match="properties"):
        messages.read_properties(RecordDict({"x": ConfigRecord({})}))
