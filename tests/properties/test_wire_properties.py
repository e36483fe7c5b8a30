"""The wire as properties: every registered algorithm's arrays survive both flavours' packing
unchanged (values bitwise, dtype, shape, and the order of the names), and a record whose names
come in another order is read by name, not by position.

Covered: ``ALGORITHMS`` (flwr_pfl.app.registry) through the app's own ``build_client``, plus a
user's model given with ``head=`` (its wire names differ from its user names); the clients'
``wire_names`` / ``user_wire_names`` / ``get_parameters``; flwr_pfl.messages (what both sides
pack and read); flwr_pfl.serverapp.layout and ``PFLMessageStrategy.parameters_of`` / ``record``
(the server's translation); Flower's protobuf encoding of a RecordDict (what crosses the
network); and the legacy ``Parameters`` conversion.

The clients are built once per module; hypothesis draws the algorithm, the values, a dtype per
array and the order of the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from fakes import QuickNet, image_tensors, register_domain_blobs
from flwr_pfl import messages
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.serverapp import FedAvg as MessageFedAvg
from flwr_pfl.serverapp.layout import record_arrays, select_wire_arrays
from flwr_pfl.serverapp.nodes import MessageNode

#: the user's-model case: FedRep over Flower's quickstart Net given with ``head="fc3"``
USER_MODEL = "fedrep (user's QuickNet, head='fc3')"
CASES = (*sorted(ALGORITHMS), USER_MODEL)
#: dtypes an array may be cast to (the wire must keep whichever it is)
DTYPES = ("keep", "float16", "float32", "float64", "int64", "int32", "uint8", "bool")


@dataclass(frozen=True)
class Wire:
    """One client's wire: its names (model keys, user names) and its initial arrays."""

    names: tuple[str, ...]
    user_names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, tuple(a.shape)) for name, a in zip(self.names, self.arrays)]


@cache
def wire_of(case: str) -> Wire:
    """The wire of ``case``'s client, built once (as the app builds it, or around a user's model)."""
    from flwr_pfl.app.client_app import build_client
    from flwr_pfl.clients import FedRepClient, LocalData, TrainConfig

    if case == USER_MODEL:
        x, y, _ = image_tensors(24, seed=5)
        data = LocalData(train=DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8),
                         test=DataLoader(TensorDataset(x[16:], y[16:]), batch_size=8))
        context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                          state=RecordDict(), run_config={})
        torch.manual_seed(0)
        client = FedRepClient(context, QuickNet(), data, TrainConfig(), head="fc3")
    else:
        dataset = register_domain_blobs("wire-properties-domains", seed=99, center_scale=1.5)
        config = {"algorithm": case, "dataset": dataset, "model": "mlp", "num-clients": 3, "partitioner": "iid",
                  "seed": 3, "run-name": "wire"}
        context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                          state=RecordDict(), run_config=config)
        client = build_client(context)
    return Wire(tuple(client.wire_names()), tuple(client.user_wire_names()), tuple(client.get_parameters({})))


@st.composite
def wires(draw, case: str | None = None, min_arrays: int = 0) -> tuple[Wire, list[np.ndarray]]:
    """``case``'s wire (drawn when None) and arrays of its layout: drawn values, each array in a
    drawn dtype."""
    wire = wire_of(draw(st.sampled_from(CASES), label="algorithm") if case is None else case)
    assume(len(wire.arrays) >= min_arrays)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="values"))
    arrays = []
    for a in wire.arrays:
        dtype = draw(st.sampled_from(DTYPES))
        values = rng.normal(scale=100.0, size=a.shape)
        arrays.append(np.asarray(values, dtype=a.dtype if dtype == "keep" else dtype))
    return wire, arrays


def over_the_network(content: RecordDict) -> RecordDict:
    """``content`` encoded as Flower sends it (protobuf bytes) and decoded again."""
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    return recorddict_from_proto(ProtoRecordDict.FromString(recorddict_to_proto(content).SerializeToString()))


def assert_identical(got, expected) -> None:
    """Same number of arrays, each of the same dtype, shape and bytes."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape and g.tobytes() == e.tobytes()


def test_every_algorithms_wire_names_are_distinct_and_one_per_array() -> None:
    """Each case names every wire array once (a repeated name would make the record fall back to
    positions and lose the names)."""
    for case in CASES:
        wire = wire_of(case)
        assert len(wire.names) == len(wire.user_names) == len(wire.arrays), case
        assert len(set(wire.user_names)) == len(wire.user_names), case


@pytest.mark.parametrize("algorithm", CASES)
@settings(max_examples=3)
@given(data=st.data())
def test_arrays_to_named_record_to_arrays_is_the_identity_over_the_network_in_both_directions(algorithm: str, data) -> None:
    """Arrays packed as a train/evaluate request and as a train reply, encoded and decoded as
    Flower sends them, read back bitwise with their dtypes and shapes; the record carries the
    user names in wire order."""
    wire, arrays = data.draw(wires(algorithm), label="wire")
    names = list(wire.user_names)
    request = over_the_network(messages.request_content(arrays, {"server-round": 3}, names))
    assert list(request.array_records[messages.ARRAYS].keys()) == names
    got, config = messages.read_request(request)
    assert_identical(got, arrays)
    assert config == {"server-round": 3}
    reply = over_the_network(messages.train_reply_content(arrays, 17, {"partition_id": 0}, names))
    assert list(reply.array_records[messages.ARRAYS].keys()) == names
    got, num_examples, metrics = messages.read_train_reply(reply)
    assert_identical(got, arrays)
    assert num_examples == 17 and metrics == {"partition_id": 0}
    assert_identical(record_arrays(reply.array_records[messages.ARRAYS], names), arrays)


@settings(max_examples=40)
@given(wires())
def test_arrays_to_legacy_parameters_to_arrays_is_the_identity(case) -> None:
    """The NumPyClient flavour's Parameters keep every array's bytes, dtype and shape, in order."""
    _, arrays = case
    assert_identical(parameters_to_ndarrays(ndarrays_to_parameters(arrays)), arrays)


@pytest.mark.parametrize("algorithm", [case for case in CASES if case != "local"])  # local sends no arrays
@settings(max_examples=3)
@given(data=st.data())
def test_a_record_named_in_another_order_is_mapped_back_to_wire_order_by_name(algorithm: str, data) -> None:
    """A record whose names come in any order (a user's ``state_dict``, another tool) gives the
    wire's arrays in wire order, each the one its name says: through the layout and through the
    Message-API strategy, which hands back the record as the user named and ordered it."""
    wire, arrays = data.draw(wires(algorithm, min_arrays=1), label="wire")
    order = data.draw(st.permutations(range(len(arrays))), label="order")
    shuffled = over_the_network(RecordDict({"a": ArrayRecord(
        {wire.user_names[i]: Array(arrays[i]) for i in order})})).array_records["a"]
    assert_identical(select_wire_arrays(shuffled, wire.layout()), arrays)
    strategy = MessageFedAvg(num_clients=3)
    strategy.wire_names = list(wire.user_names)
    strategy.wire_layout = lambda manager: wire.layout()  # what one node answers to the wire-layout query
    parameters = strategy.parameters_of(shuffled, None)
    assert_identical(parameters_to_ndarrays(parameters), arrays)
    returned = strategy.record(parameters)  # the user's record again: their names, their order
    assert list(returned.keys()) == list(shuffled.keys())
    assert_identical([returned[name].numpy() for name in wire.user_names], arrays)


@settings(max_examples=10)
@given(wires(min_arrays=2), st.data())
def test_a_train_reply_named_in_another_order_is_read_back_in_wire_order_by_name(case, data) -> None:
    """A train reply whose arrays carry the wire's names in another order reaches the round logic
    in wire order, each array where its name says."""
    wire, arrays = case
    order = data.draw(st.permutations(range(len(arrays))).filter(lambda p: list(p) != sorted(p)), label="order")
    content = over_the_network(messages.train_reply_content(
        [arrays[i] for i in order], 5, {"partition_id": 0}, [wire.user_names[i] for i in order]))
    node = MessageNode(None, 1, lambda: list(wire.user_names))  # type: ignore[arg-type]
    assert_identical(parameters_to_ndarrays(node.fit_res(content).parameters), arrays)


@settings(max_examples=10)
@given(wires(min_arrays=2), st.data())
def test_a_request_named_in_another_order_reaches_the_client_in_wire_order_by_name(case, data) -> None:
    """A train request whose arrays carry the wire's names in another order reaches the client's
    ``fit`` in wire order (the handler reads it with the client's wire names)."""
    from flwr.app import Message
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from flwr_pfl.clientapp import train_reply

    wire, arrays = case
    order = data.draw(st.permutations(range(len(arrays))).filter(lambda p: list(p) != sorted(p)), label="order")
    content = over_the_network(messages.request_content(
        [arrays[i] for i in order], {}, [wire.user_names[i] for i in order]))
    received: list[list[np.ndarray]] = []

    class Recording:
        """A client with the wire's names that keeps what its ``fit`` is handed."""

        def user_wire_names(self) -> list[str]:
            return list(wire.user_names)

        def fit(self, parameters, config):
            received.append(parameters)
            return parameters, 1, {}

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    train_reply(Recording(), Message(content, dst_node_id=1, message_type="train"))  # type: ignore[arg-type]
    assert_identical(received[0], arrays)
