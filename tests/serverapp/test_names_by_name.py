"""Arrays in a Message are read by name where the reader knows the wire's names
(flwr_pfl.messages.arrays_in_wire_order): a train reply read by ``MessageNode.fit_res`` and a
request read by the client handlers (flwr_pfl.clientapp) come back in wire order whatever order
the sender put them in, and a record named with other names than the wire's is refused with a
message naming what it lacks and what it has beyond the wire."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common import parameters_to_ndarrays

from flwr_pfl import messages
from flwr_pfl.clientapp import evaluate_reply, train_reply
from flwr_pfl.serverapp.nodes import MessageNode

NAMES = ["body.weight", "body.bias", "head.weight"]
#: distinct shapes and dtypes, so that a swap shows in every check
ARRAYS = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0, 8.0], np.float64), np.array([[1, 2]], np.int64)]


@pytest.fixture(autouse=True)
def server_identity() -> None:
    """Messages are created as the server creates them (Flower reads the task identity)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


def record(order: list[int], names: list[str] | None = None) -> ArrayRecord:
    """ARRAYS in ``order``, each under its name in ``names`` (default NAMES)."""
    names = names or NAMES
    return ArrayRecord({names[i]: Array(ARRAYS[i]) for i in order})


def reply_content(arrays: ArrayRecord) -> RecordDict:
    content = messages.metrics_content(5, {"partition_id": 0})
    content[messages.ARRAYS] = arrays
    return content


def assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and g.tobytes() == e.tobytes()


def node() -> MessageNode:
    return MessageNode(None, 3, lambda: list(NAMES))  # type: ignore[arg-type]


def test_a_train_reply_in_another_order_reaches_the_round_logic_in_wire_order() -> None:
    res = node().fit_res(reply_content(record([2, 0, 1])))
    assert_same(parameters_to_ndarrays(res.parameters), ARRAYS)
    assert res.num_examples == 5 and res.metrics == {"partition_id": 0}


def test_a_train_reply_in_wire_order_or_by_position_is_read_as_it_is() -> None:
    in_order = reply_content(record([0, 1, 2]))
    assert_same(parameters_to_ndarrays(node().fit_res(in_order).parameters), ARRAYS)
    positional = reply_content(messages.pack_arrays(ARRAYS))
    assert_same(parameters_to_ndarrays(node().fit_res(positional).parameters), ARRAYS)
    # a server that does not know the names reads the record's own order
    unnamed = MessageNode(None, 3)  # type: ignore[arg-type]
    assert_same(parameters_to_ndarrays(unnamed.fit_res(reply_content(record([2, 0, 1]))).parameters),
                [ARRAYS[2], ARRAYS[0], ARRAYS[1]])


def test_a_train_reply_named_otherwise_than_the_wire_is_refused_naming_what_is_missing_and_extra() -> None:
    other = ["body.weight", "body.bias", "classifier.weight"]
    with pytest.raises(messages.MessageContentError, match=r"lacks 1 \(\['head.weight'\]\) and has 1 the wire does "
                                                           r"not carry \(\['classifier.weight'\]\)"):
        node().fit_res(reply_content(record([0, 1, 2], other)))
    with pytest.raises(messages.MessageContentError, match=r"lacks 1 \(\['head.weight'\]\) and has 0"):
        node().fit_res(reply_content(record([1, 0])))


class Recording:
    """A client with the wire's names that keeps what ``fit`` / ``evaluate`` are handed."""

    def __init__(self) -> None:
        self.received: list[list[np.ndarray]] = []

    def user_wire_names(self) -> list[str]:
        return list(NAMES)

    def fit(self, parameters, config):
        self.received.append(parameters)
        return parameters, 1, {}

    def evaluate(self, parameters, config):
        self.received.append(parameters)
        return 0.5, 1, {}


def request(arrays: ArrayRecord, kind: str) -> Message:
    return Message(RecordDict({messages.ARRAYS: arrays}), dst_node_id=1, message_type=kind)


@pytest.mark.parametrize("kind", ["train", "evaluate"])
def test_a_request_in_another_order_reaches_the_client_in_wire_order(kind: str) -> None:
    client = Recording()
    handler = train_reply if kind == "train" else evaluate_reply
    handler(client, request(record([1, 2, 0]), kind))  # type: ignore[arg-type]
    assert_same(client.received[0], ARRAYS)


def test_a_request_with_names_the_client_does_not_have_is_refused_before_the_client_trains() -> None:
    client = Recording()
    extra = ArrayRecord({**{n: Array(a) for n, a in zip(NAMES, ARRAYS)}, "stray": Array(np.zeros(1))})
    with pytest.raises(messages.MessageContentError, match=r"lacks 0 \(none\) and has 1 the wire does not carry \(\['stray'\]\)"):
        train_reply(client, request(extra, "train"))  # type: ignore[arg-type]
    assert client.received == []
