"""MessageNode, one node of a Grid as the ClientProxy the round logic addresses, and
GridClientManager, the grid's nodes as such proxies: what each message carries (type, node,
round, time to live, the config with the instruction's keys last, the arrays by the wire's
names), what each reply becomes, and the failures that name the node and the message."""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import DEFAULT_TTL, Error, Message, RecordDict
from flwr.common import Code, EvaluateIns, FitIns, GetParametersIns, GetPropertiesIns, ReconnectIns, ndarrays_to_parameters, parameters_to_ndarrays

from flwr_pfl import messages
from flwr_pfl.serverapp import GridClientManager, MessageNode, NodeFailure
from flwr_pfl.serverapp.nodes import error_reply_failure, reply_content
from serverapp.test_translation import ScriptedGrid, server_identity  # noqa: F401 - a fixture

ARRAYS = [np.arange(3, dtype=np.float32), np.ones((2, 2), dtype=np.float64)]


class Answering(ScriptedGrid):
    """A ScriptedGrid that keeps every message it was sent and the timeout of each exchange."""

    def __init__(self, reply, nodes=None) -> None:
        super().__init__(reply, nodes)
        self.sent: list[Message] = []
        self.timeouts: list[float | None] = []

    def send_and_receive(self, messages_, *, timeout=None):
        messages_ = list(messages_)
        self.sent += messages_
        self.timeouts.append(timeout)
        return super().send_and_receive(messages_, timeout=timeout)


def fit_ins(server_round: int = 3) -> FitIns:
    return FitIns(ndarrays_to_parameters(ARRAYS), {"server-round": server_round, "lr": 0.1})


def test_a_message_names_its_node_type_round_and_time_to_live():
    node = MessageNode(Answering(lambda m: None), 7)  # type: ignore[arg-type]
    message = node.message("query", messages.query_content({}), 12.5, 4)
    assert (message.metadata.dst_node_id, message.metadata.message_type) == (7, "query")
    assert (message.metadata.group_id, message.metadata.ttl) == ("4", 12.5)
    unbounded = node.message("query", messages.query_content({}), None, None)
    assert (unbounded.metadata.group_id, unbounded.metadata.ttl) == ("", DEFAULT_TTL)
    no_time = node.message("query", messages.query_content({}), 0.0, 0)  # as Flower's legacy proxy: no limit
    assert (no_time.metadata.group_id, no_time.metadata.ttl) == ("", DEFAULT_TTL)


def test_a_train_message_carries_the_arrays_by_the_wire_names_and_the_instructions_keys_last():
    node = MessageNode(Answering(lambda m: None), 7, lambda: ["body.w", "body.b"])  # type: ignore[arg-type]
    message = node.train_message(fit_ins(), 30.0, 3, {"lr": 5.0, "batch_size": 8})
    assert (message.metadata.message_type, message.metadata.group_id, message.metadata.ttl) == ("train", "3", 30.0)
    arrays = message.content.array_records[messages.ARRAYS]
    assert list(arrays.keys()) == ["body.w", "body.b"]
    for got, want in zip(arrays.values(), ARRAYS, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
        assert got.numpy().dtype == want.dtype
    assert dict(message.content.config_records[messages.CONFIG]) == {"lr": 0.1, "batch_size": 8, "server-round": 3}
    evaluate = node.evaluate_message(EvaluateIns(ndarrays_to_parameters(ARRAYS), {"server-round": 3}), 30.0, 3, {"k": 1})
    assert evaluate.metadata.message_type == "evaluate"
    assert dict(evaluate.content.config_records[messages.CONFIG]) == {"k": 1, "server-round": 3}
    positional = MessageNode(Answering(lambda m: None), 7).train_message(fit_ins(), None, None)  # type: ignore[arg-type]
    assert list(positional.content.array_records[messages.ARRAYS].keys()) == ["0", "1"]


def test_fit_sends_one_train_message_and_reads_the_reply_by_the_wire_names():
    def reply(message: Message) -> Message:
        arrays, config = messages.read_request(message.content, ["b", "a"])
        return Message(messages.train_reply_content([a * 2 for a in arrays], 11, {"partition_id": 2}, ["b", "a"]),
                       reply_to=message)

    grid = Answering(reply)
    res = MessageNode(grid, 7, lambda: ["b", "a"]).fit(fit_ins(), 9.0, 3)  # type: ignore[arg-type]
    assert len(grid.sent) == 1 and grid.timeouts == [9.0]
    assert (grid.sent[0].metadata.ttl, grid.sent[0].metadata.group_id) == (9.0, "3")
    assert (res.status.code, res.num_examples, res.metrics) == (Code.OK, 11, {"partition_id": 2})
    for got, want in zip(parameters_to_ndarrays(res.parameters), ARRAYS, strict=True):
        np.testing.assert_array_equal(got, want * 2)


def test_a_train_reply_is_read_in_the_wire_order_and_refused_under_other_names():
    def reply_named(names):
        def reply(message: Message) -> Message:
            return Message(messages.train_reply_content(ARRAYS, 4, {}, names), reply_to=message)
        return reply

    node = MessageNode(Answering(reply_named(["a", "b"])), 7, lambda: ["b", "a"])  # type: ignore[arg-type]
    swapped = parameters_to_ndarrays(node.fit(fit_ins(), 1.0, 1).parameters)
    np.testing.assert_array_equal(swapped[0], ARRAYS[1])  # "b" first, as the wire has it
    np.testing.assert_array_equal(swapped[1], ARRAYS[0])
    stranger = MessageNode(Answering(reply_named(["x", "y"])), 7, lambda: ["b", "a"])  # type: ignore[arg-type]
    with pytest.raises(messages.MessageContentError):
        stranger.fit(fit_ins(), 1.0, 1)


def test_evaluate_reads_the_loss_the_count_and_the_metrics():
    def reply(message: Message) -> Message:
        return Message(messages.metrics_content(6, {"accuracy": 0.5}, loss=1.25), reply_to=message)

    grid = Answering(reply)
    res = MessageNode(grid, 7).evaluate(EvaluateIns(ndarrays_to_parameters(ARRAYS), {}), 4.0, 2)  # type: ignore[arg-type]
    assert (res.status.code, res.loss, res.num_examples) == (Code.OK, 1.25, 6) and res.metrics["accuracy"] == 0.5
    assert grid.sent[0].metadata.message_type == "evaluate" and grid.timeouts == [4.0]
    assert (grid.sent[0].metadata.ttl, grid.sent[0].metadata.group_id) == (4.0, "2")


def test_a_query_and_the_initial_arrays():
    def reply(message: Message) -> Message:
        config = dict(message.content.config_records[messages.CONFIG])
        if message.metadata.message_type == "query":
            return Message(messages.properties_content({"asked": ",".join(sorted(config))}), reply_to=message)
        return Message(RecordDict({messages.ARRAYS: messages.pack_arrays(ARRAYS, ["w", "b"])}), reply_to=message)

    grid = Answering(reply)
    node = MessageNode(grid, 7)  # type: ignore[arg-type]
    properties = node.get_properties(GetPropertiesIns({"x": 1, "y": 2}), 3.0, 5)
    assert (properties.status.code, properties.properties) == (Code.OK, {"asked": "x,y"})
    assert (grid.sent[-1].metadata.message_type, grid.sent[-1].metadata.group_id, grid.sent[-1].metadata.ttl) == ("query", "5", 3.0)
    assert grid.timeouts[-1] == 3.0
    record = node.initial_arrays({"z": 0}, 2.0, 6)
    assert list(record.keys()) == ["w", "b"] and grid.sent[-1].metadata.message_type == "query.parameters"
    assert dict(grid.sent[-1].content.config_records[messages.CONFIG]) == {"z": 0} and grid.timeouts[-1] == 2.0
    assert (grid.sent[-1].metadata.group_id, grid.sent[-1].metadata.ttl) == ("6", 2.0)
    parameters = node.get_parameters(GetParametersIns({}), 2.5, 8)
    assert parameters.status.code == Code.OK
    assert (grid.sent[-1].metadata.group_id, grid.sent[-1].metadata.ttl, grid.timeouts[-1]) == ("8", 2.5, 2.5)
    for got, want in zip(parameters_to_ndarrays(parameters.parameters), ARRAYS, strict=True):
        np.testing.assert_array_equal(got, want)
    assert node.reconnect(ReconnectIns(seconds=None), 1.0, None).reason == ""


def test_failures_name_the_node_and_the_message():
    silent = MessageNode(Answering(lambda m: None), 7)  # type: ignore[arg-type]
    with pytest.raises(NodeFailure, match=r"^node 7: no 'train' reply in time \(timed out, or the node left\)$"):
        silent.fit(fit_ins(), 1.0, 1)
    with pytest.raises(NodeFailure, match=r"^node 7: no 'query' reply in time"):
        silent.get_properties(GetPropertiesIns({}), 1.0, None)
    empty = MessageNode(Answering(lambda m: Message(RecordDict(), reply_to=m)), 7)  # type: ignore[arg-type]
    with pytest.raises(messages.MessageContentError, match=r"^node 7: the parameters reply has no ArrayRecord 'arrays'$"):
        empty.initial_arrays({}, 1.0)
    failing = Answering(lambda m: Message(Error(code=0, reason="out of memory"), reply_to=m))
    want = ("Message contains an Error (reason: out of memory). It originated during client-side execution of a "
            "message.")
    with pytest.raises(NodeFailure, match=f"^{re.escape(want)}$"):
        MessageNode(failing, 7).fit(fit_ins(), 1.0, 1)  # type: ignore[arg-type]
    reply = failing.reply(Message(RecordDict(), dst_node_id=7, message_type="train"))
    assert str(error_reply_failure(reply)) == want
    with pytest.raises(NodeFailure, match=f"^{re.escape(want)}$"):
        reply_content(reply, 7, "train")
    ok = Message(RecordDict({"x": messages.query_content({})[messages.CONFIG]}), reply_to=Message(RecordDict(), dst_node_id=7,
                                                                                                message_type="train"))
    assert reply_content(ok, 7, "train") is ok.content


def test_the_manager_registers_the_grids_nodes_and_forgets_those_that_left():
    grid = ScriptedGrid(lambda m: None, nodes=[1, 2, 3])
    manager = GridClientManager(grid, lambda: ["w"])  # type: ignore[arg-type]
    manager.refresh()
    first = dict(manager.all())
    assert sorted(first) == ["1", "2", "3"] and all(p.node_id == int(cid) for cid, p in first.items())
    assert all(p.wire_names() == ["w"] and p.grid is grid for p in first.values())
    grid.nodes = [2, 3, 4]
    manager.refresh()
    assert sorted(manager.all()) == ["2", "3", "4"]
    assert manager.all()["2"] is first["2"]  # a node still there keeps its proxy
    assert manager.node(2) is first["2"]
    stranger = manager.node(9)  # not registered: a proxy made for it
    assert isinstance(stranger, MessageNode) and stranger.node_id == 9 and stranger.wire_names() == ["w"]
    assert stranger.grid is grid
    assert "9" not in manager.all()


def test_waiting_for_nodes_polls_the_grid_until_enough_are_there():
    class Arriving(ScriptedGrid):
        def get_node_ids(self):
            self.nodes.append(len(self.nodes) + 1)  # one more node each look
            return list(self.nodes)

    grid = Arriving(lambda m: None, nodes=[1])
    manager = GridClientManager(grid)  # type: ignore[arg-type]
    assert manager.wait_for(3, timeout=5)
    assert len(manager.all()) == 3  # returned as soon as three were registered
    assert not GridClientManager(ScriptedGrid(lambda m: None, nodes=[1])).wait_for(2, timeout=0)  # type: ignore[arg-type]


def test_waiting_without_a_timeout_gives_up_after_a_day_as_flowers_manager_does(monkeypatch):
    from flwr_pfl.serverapp import nodes

    clock = [1000.0]
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        clock[0] += 3600.0  # an hour a look, so that a day is 24 looks

    monkeypatch.setattr(nodes.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(nodes.time, "sleep", nap)
    assert not GridClientManager(ScriptedGrid(lambda m: None, nodes=[1])).wait_for(2)  # type: ignore[arg-type]
    assert len(naps) == 24 and set(naps) == {nodes.POLL_SECONDS}
