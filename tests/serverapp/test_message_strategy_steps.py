"""PFLMessageStrategy's own steps, one at a time: what it refuses and how it says so, how it
builds its round logic (the federation's size, the run's rounds), what each message carries
(round, time to live), which replies count, what its hooks for subclasses are told, and what
it logs. The translation as a whole is in test_translation.py and test_user_model.py."""

from __future__ import annotations

import inspect
import logging
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import ndarrays_to_parameters
from flwr.serverapp.strategy import Strategy

from flwr_pfl import messages
from flwr_pfl.app.inprocess import InProcessGrid
from flwr_pfl.clients.base import WIRE_LAYOUT_QUERY
from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp import FedAvg, FedRep, PFLMessageStrategy
from flwr_pfl.serverapp.strategy import numeric_record
from flwr_pfl.strategies import FedAvg as LegacyFedAvg
from serverapp.test_translation import (  # noqa: F401 - server_identity: a fixture
    BODY, Recorder, ScriptedGrid, scaled_reply, server_identity, state_dict_record)

NODES = (1000, 1001, 1002)


def flwr_messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


class ScriptedReplies(InProcessGrid):
    """The in-process grid with 3 nodes, whose replies a test arranges: ``stray`` puts a reply
    from node 4242 (never asked) first, ``twice`` answers node 1000's messages twice in a row
    (the second with arrays 100 times the first's), ``drop`` loses one node's reply of one
    message type. Records each ``send_and_receive``'s timeout."""

    def __init__(self, app: Recorder, *, stray: bool = False, twice: bool = False,
                 drop: tuple[int, str] | None = None) -> None:
        super().__init__(app, 3, {})  # type: ignore[arg-type]
        self.stray, self.twice, self.drop = stray, twice, drop
        self.timeouts: list[tuple[str, float | None]] = []  # (message type, timeout)

    def send_and_receive(self, *args, timeout=None, **kwargs):  # Flower passes messages=... by name
        sent = list(kwargs.pop("messages", args[0] if args else []))
        kinds = {m.metadata.message_type for m in sent}
        self.timeouts += [(kind, timeout) for kind in sorted(kinds)]
        replies = super().send_and_receive(sent, timeout=timeout)
        out: list[Message] = []
        if self.stray and kinds & {"train", "evaluate"}:
            request = Message(RecordDict(), dst_node_id=4242, message_type=sent[0].metadata.message_type)
            out.append(Message(RecordDict(), reply_to=request))
        for reply in replies:
            if self.drop == (reply.metadata.src_node_id, reply.metadata.message_type):
                continue
            out.append(reply)
            if self.twice and reply.metadata.src_node_id == 1000 and reply.metadata.message_type == "train":
                request = next(m for m in sent if m.metadata.dst_node_id == 1000)
                out.append(scaled_reply(reply, request, 100.0))
        return out


class Hooked(FedRep):
    """FedRep whose hooks for subclasses record what they are told."""

    def phase_done(self, server_round, phase, results, failures):
        self.phases = [*getattr(self, "phases", []), (server_round, phase, sorted(int(p.cid) for p, _ in results),
                                                      [str(f) for f in failures])]

    def round_done(self, server_round):
        self.rounds = [*getattr(self, "rounds", []), server_round]


def logic_builder(calls: list[tuple[int, int]]):
    def build(num_clients: int, num_rounds: int) -> LegacyFedAvg:
        calls.append((num_clients, num_rounds))
        return LegacyFedAvg(num_clients=num_clients, num_rounds=num_rounds)

    return build


class NoGrid:
    """A grid that must not be asked anything."""

    def get_node_ids(self):
        raise AssertionError("the grid was asked for its nodes")

    def send_and_receive(self, *args, **kwargs):
        raise AssertionError("the grid was sent a message")


# ------------------------------------------------------------------------------ construction
def test_the_constructor_says_what_it_needs():
    needs = ("give the round logic, or build ((num_clients, num_rounds) -> round logic) to make it when the first "
             "round starts")
    with pytest.raises(TypeError, match=f"^{re.escape(needs)}$"):
        PFLMessageStrategy()
    with pytest.raises(TypeError, match=f"^{re.escape(needs)}$"):
        PFLMessageStrategy(LegacyFedAvg(num_clients=2), build=logic_builder([]))
    with pytest.raises(TypeError, match=r"^logic must be a flwr_pfl PFLStrategy, got object$"):
        PFLMessageStrategy(object())  # type: ignore[arg-type]
    strategy = FedRep(num_clients=3)
    assert repr(strategy) == f"FedRep({strategy.logic!r})"
    assert isinstance(strategy.extra_arrays, ArrayRecord) and len(strategy.extra_arrays) == 0


def test_build_takes_the_constructors_num_clients_without_asking_the_grid():
    calls: list[tuple[int, int]] = []
    strategy = PFLMessageStrategy(build=logic_builder(calls), num_clients=5)
    logic = strategy.ensure_logic(NoGrid(), 1.0, 4)  # type: ignore[arg-type]
    assert calls == [(5, 4)] and logic.num_clients == 5
    assert strategy.ensure_logic(NoGrid(), 1.0, 9) is logic and calls == [(5, 4)]  # built once  # type: ignore[arg-type]
    unknown: list[tuple[int, int]] = []
    PFLMessageStrategy(build=logic_builder(unknown), num_clients=5).ensure_logic(NoGrid(), 1.0)  # type: ignore[arg-type]
    assert unknown == [(5, 0)]  # the rounds unknown (0): no round is taken for the last one


def test_start_keeps_flowers_defaults_and_timeout():
    ours, flowers = inspect.signature(PFLMessageStrategy.start).parameters, inspect.signature(Strategy.start).parameters
    for name in ("num_rounds", "timeout", "train_config", "evaluate_config", "evaluate_fn"):
        assert ours[name].default == flowers[name].default, name
    grid = ScriptedReplies(Recorder())
    FedRep(num_clients=3).start(grid=grid, initial_arrays=state_dict_record(), num_rounds=1, timeout=77)
    assert [t for kind, t in grid.timeouts if kind in ("train", "evaluate")] == [77, 77]  # Flower's rounds


def test_start_called_without_rounds_and_timeout_runs_flowers_defaults():
    grid = ScriptedReplies(Recorder())
    FedRep(num_clients=3).start(grid=grid, initial_arrays=state_dict_record())
    assert [t for kind, t in grid.timeouts if kind == "train"] == [3600] * 3  # 3 rounds, 3600 s each


def test_the_config_keys_no_client_reads_are_named_once_per_phase(caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        FedRep(num_clients=3).start(grid=InProcessGrid(Recorder(), 3, {}), initial_arrays=state_dict_record(), num_rounds=2,  # type: ignore[arg-type]
                                    timeout=60, train_config=ConfigRecord({"batch_size": 32}),
                                    evaluate_config=ConfigRecord({"val_steps": 5}))
    logged = [m for m in flwr_messages(caplog) if "to the clients; flwr_pfl's clients read only" in m]
    assert len(logged) == 2  # each key once, not every round
    assert logged[0].startswith("FedRep: train_config sends ['batch_size'] to the clients;")
    assert logged[1].startswith("FedRep: evaluate_config sends ['val_steps'] to the clients;")


def test_a_strategy_made_without_num_clients_learns_the_size_and_rounds_at_start():
    strategy = FedRep()
    strategy.start(grid=InProcessGrid(Recorder(), 3, {}), initial_arrays=state_dict_record(), num_rounds=2, timeout=60)  # type: ignore[arg-type]
    assert strategy.logic.num_clients == 3 and strategy.logic.num_rounds == 2


# ------------------------------------------------------------------------------ the run's rounds
def test_start_tells_the_logic_its_rounds_and_refuses_a_constructor_that_disagrees():
    strategy = FedRep(num_clients=3)
    strategy.adopt_num_rounds(4)
    assert strategy.logic.num_rounds == 4
    fixed = FedRep(num_clients=3, num_rounds=5)
    fixed.adopt_num_rounds(5)
    want = ("FedRep(num_rounds=5) but start(num_rounds=4): the run would end at round 4; pass the same number to both, "
            "or leave num_rounds out of the constructor (start() tells it)")
    with pytest.raises(ConfigError, match=f"^{re.escape(want)}$"):
        fixed.adopt_num_rounds(4)
    resumed = FedRep(num_clients=3, num_rounds=5)
    resumed.logic.round_offset = 2
    resumed.adopt_num_rounds(3)  # 2 resumed + 3 = 5: accepted
    want = ("FedRep(num_rounds=5) but start(num_rounds=4) after the 2 rounds resumed: the run would end at round 6; "
            "pass the same number to both, or leave num_rounds out of the constructor (start() tells it)")
    with pytest.raises(ConfigError, match=f"^{re.escape(want)}$"):
        resumed.adopt_num_rounds(4)


# ------------------------------------------------------------------------------ the federation's size
def test_the_federation_size_is_the_nodes_num_partitions(caplog):
    grid = InProcessGrid(Recorder(), 3, {})  # type: ignore[arg-type]
    for context in grid.contexts.values():
        context.node_config["num-partitions"] = 7  # three of seven partitions are connected
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert FedRep().federation_size(grid, 5.0) == 7  # type: ignore[arg-type]
    assert "the federation has 7 partitions (the nodes' num-partitions)" in flwr_messages(caplog)


def test_nodes_that_do_not_say_the_size_are_counted(caplog):
    grid = ScriptedGrid(lambda message: None, nodes=[4, 5, 6])  # they never answer
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert FedRep().federation_size(grid, 5.0) == 3  # type: ignore[arg-type]
    assert "the nodes do not say the federation's size: 3 connected nodes are the clients" in flwr_messages(caplog)


# ------------------------------------------------------------------------------ what it logs
def test_the_summary_names_the_logic_and_its_settings(caplog):
    with caplog.at_level(logging.INFO, logger="flwr"):
        FedAvg().summary()
        FedRep(num_clients=4, fraction_fit=0.5, fraction_evaluate=0.25, min_available_clients=3, seed=11,
               round_timeout=90.0).summary()
    assert flwr_messages(caplog)[-4:] == [
        "\t└── flwr_pfl round logic: FedAvg, built when the first round starts (the federation's size is learned then)",
        "\t├── flwr_pfl round logic: FedRep (fedrep)",
        "\t├── clients: 4, fraction fit 0.5, fraction evaluate 0.25, min available 3",
        "\t└── seed 11, round timeout 90.0",
    ]


# ------------------------------------------------------------------------------ what each message carries
def test_messages_carry_their_round_and_the_round_timeout_and_queries_the_exchange_timeout():
    app = Recorder()
    strategy = FedRep(num_clients=3, round_timeout=123.0)
    strategy.start(grid=InProcessGrid(app, 3, {}), initial_arrays=ArrayRecord(), num_rounds=2, timeout=60)  # type: ignore[arg-type]
    for message in app.of_type("train") + app.of_type("evaluate"):
        server_round = message.content.config_records[messages.CONFIG]["server-round"]
        assert message.metadata.group_id == str(server_round) and message.metadata.ttl == 123.0
    asked = app.of_type("query.parameters")
    assert len(asked) == 1 and asked[0].metadata.ttl == 123.0  # one node, once; the logic keeps the arrays after
    unbounded = Recorder()
    FedRep(num_clients=3, wait_timeout=45.0).start(grid=InProcessGrid(unbounded, 3, {}), initial_arrays=ArrayRecord(),
                                                   num_rounds=1, timeout=60)  # type: ignore[arg-type]
    assert [m.metadata.ttl for m in unbounded.of_type("query.parameters")] == [45.0]  # no round timeout: wait-timeout


def layout_queries(app: Recorder) -> list[Message]:
    return [m for m in app.of_type("query") if dict(m.content.config_records[messages.CONFIG]).keys() >= WIRE_LAYOUT_QUERY.keys()]


def test_the_wire_layout_is_asked_of_one_node_once():
    app = Recorder()
    strategy = FedRep(num_clients=3, round_timeout=50.0)
    result = strategy.start(grid=InProcessGrid(app, 3, {}), initial_arrays=state_dict_record(), num_rounds=3, timeout=60)  # type: ignore[arg-type]
    assert [m.metadata.ttl for m in layout_queries(app)] == [50.0]
    assert list(result.arrays.keys()) == list(state_dict_record().keys())


def test_arrays_a_node_gave_come_back_under_their_names():
    """Started without arrays, the logic asks a node (named wire arrays): Flower's Result holds
    the trained arrays under those names."""
    result = FedRep(num_clients=3).start(grid=InProcessGrid(Recorder(), 3, {}), initial_arrays=ArrayRecord(),  # type: ignore[arg-type]
                                         num_rounds=1, timeout=60)
    assert list(result.arrays.keys()) == BODY


def test_a_query_no_node_answers_is_named(caplog):
    from flwr.app import Error

    grid = ScriptedGrid(lambda m: Message(Error(code=0, reason="no data"), reply_to=m), nodes=[7])
    strategy = FedRep(num_clients=1, wait_timeout=5.0)
    manager = strategy.manager(grid)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"^no node answered the wire-layout query: node 7: .*no data"):
        strategy.wire_layout(manager)
    with pytest.raises(RuntimeError, match=r"^no node answered the parameters query: node 7: .*no data"):
        strategy.node_initial_arrays(manager)


def test_the_client_manager_follows_the_grid_it_is_given():
    first, second = ScriptedGrid(lambda m: None, nodes=[1, 2]), ScriptedGrid(lambda m: None, nodes=[3])
    strategy = FedRep(num_clients=2)
    manager = strategy.manager(first)  # type: ignore[arg-type]
    assert strategy.manager(first) is manager  # type: ignore[arg-type]
    assert strategy.manager(second).grid is second and sorted(strategy.manager(second).all()) == ["3"]  # type: ignore[arg-type]


def test_a_logic_with_its_own_initial_arrays_asks_no_node(caplog):
    initial = [state_dict_record()[name].numpy() for name in BODY]
    app = Recorder()
    with caplog.at_level(logging.INFO, logger="flwr"):
        FedRep(num_clients=3, initial_arrays=initial).start(grid=InProcessGrid(app, 3, {}), initial_arrays=ArrayRecord(),  # type: ignore[arg-type]
                                                            num_rounds=1, timeout=60)
    assert not app.of_type("query.parameters") and "asking one node for the initial global arrays" not in flwr_messages(caplog)
    sent = app.of_type("train")[0].content.array_records[messages.ARRAYS]
    for array, given in zip(sent.values(), initial, strict=True):
        np.testing.assert_array_equal(array.numpy(), given)
    asked = Recorder()
    with caplog.at_level(logging.INFO, logger="flwr"):
        FedRep(num_clients=3).start(grid=InProcessGrid(asked, 3, {}), initial_arrays=ArrayRecord(), num_rounds=1, timeout=60)  # type: ignore[arg-type]
    assert len(asked.of_type("query.parameters")) == 1 and "asking one node for the initial global arrays" in flwr_messages(caplog)


# ------------------------------------------------------------------------------ which replies count
def test_a_stray_reply_and_a_second_reply_are_ignored_and_the_others_all_count(caplog):
    """A reply from a node never asked comes first, and node 1000 answers twice in a row: both
    are logged and ignored, every other reply after them still counts."""
    strategy = Hooked(num_clients=3)
    grid = ScriptedReplies(Recorder(), stray=True, twice=True)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid=grid, initial_arrays=state_dict_record(), num_rounds=1, timeout=60)
    assert strategy.phases == [(1, "fit", list(NODES), []), (1, "evaluate", list(NODES), [])]
    logged = flwr_messages(caplog)
    for phase in ("train", "evaluate"):
        assert f"a {phase} reply from node 4242, which was not asked (or answered twice): ignored" in logged
    assert "a train reply from node 1000, which was not asked (or answered twice): ignored" in logged


def test_the_hooks_hear_each_phase_its_results_and_failures_then_the_rounds_end():
    strategy = Hooked(num_clients=3)
    strategy.start(grid=ScriptedReplies(Recorder(), drop=(1001, "train")), initial_arrays=state_dict_record(),
                   num_rounds=2, timeout=60)
    lost = "node 1001: no 'train' reply in time (timed out, or the node left)"
    assert strategy.phases == [(1, "fit", [1000, 1002], [lost]), (1, "evaluate", list(NODES), []),
                               (2, "fit", [1000, 1002], [lost]), (2, "evaluate", list(NODES), [])]
    assert strategy.rounds == [1, 2]


def test_aggregating_a_phase_that_sent_nothing_returns_nothing():
    strategy = Hooked(num_clients=3)
    assert strategy.aggregate_train(1, []) == (None, None)
    assert strategy.aggregate_evaluate(1, []) is None
    assert not hasattr(strategy, "phases") and strategy.rounds == [1]  # the round is over all the same


def test_an_evaluation_before_any_training_builds_the_logic_and_asks_a_node_for_arrays():
    """A loop of the user's own may evaluate the initial model first: configure_evaluate then
    builds the logic (the federation's size from the grid) and gets the arrays from a node."""
    app = Recorder()
    strategy = FedRep()
    sent = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), InProcessGrid(app, 3, {})))  # type: ignore[arg-type]
    assert strategy.logic.num_clients == 3 and len(app.of_type("query.parameters")) == 1
    assert sorted(m.metadata.dst_node_id for m in sent) == list(NODES) and {m.metadata.group_id for m in sent} == {"1"}
    assert list(sent[0].content.array_records[messages.ARRAYS].keys()) == BODY


# ------------------------------------------------------------------------------ arrays and records
def test_an_algorithm_without_a_global_model_asks_a_node_for_arrays_once():
    """Local hands no arrays back, so Flower passes the empty initial record every round: the
    arrays the strategy holds are used, not asked again."""
    from flwr_pfl.serverapp import Local

    app = Recorder()
    Local(num_clients=3).start(grid=InProcessGrid(app, 3, {}), initial_arrays=ArrayRecord(), num_rounds=3, timeout=60)  # type: ignore[arg-type]
    assert len(app.of_type("query.parameters")) == 1 and len(app.of_type("train")) == 9


def test_the_record_is_the_wire_arrays_when_the_users_model_cannot_hold_them():
    strategy = FedRep(num_clients=3)
    arrays = [np.full(2, 1.0, np.float32), np.full(3, 2.0, np.float32)]
    strategy._template = {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}
    strategy.wire_names = None  # names unknown: positional
    assert list(strategy.record(ndarrays_to_parameters(arrays)).keys()) == ["0", "1"]
    strategy.wire_names = ["a", "c"]  # "c" is neither the user's nor an algorithm's own array
    record = strategy.record(ndarrays_to_parameters(arrays))
    assert list(record.keys()) == ["a", "c"]
    for array, want in zip(record.values(), arrays, strict=True):
        np.testing.assert_array_equal(array.numpy(), want)
    strategy.wire_names = ["a", "b"]
    filled = strategy.record(ndarrays_to_parameters(arrays))
    assert list(filled.keys()) == ["a", "b"] and filled["b"].numpy().tolist() == [2.0, 2.0, 2.0]


def test_only_numeric_metrics_reach_a_metric_record():
    record = numeric_record({"a": 1, "b": 2.5, "flag": True, "ids": "0 1 2", "none": None, "c": 0})
    assert dict(record) == {"a": 1, "b": 2.5, "c": 0}


class CopyingFedRep(FedRep):
    """A round loop of the user's own that hands each round a copy of the record it got back,
    after ``edit(copy)``, instead of that record."""

    edit = staticmethod(lambda record: None)

    def start(self, grid, initial_arrays, num_rounds=3, timeout=3600, train_config=None, evaluate_config=None, evaluate_fn=None):
        arrays = initial_arrays
        for server_round in range(1, num_rounds + 1):
            sent = list(self.configure_train(server_round, arrays, train_config or ConfigRecord(), grid))
            returned, _ = self.aggregate_train(server_round, grid.send_and_receive(sent, timeout=timeout))
            arrays = ArrayRecord({k: Array(v.numpy().copy()) for k, v in returned.items()})
            self.edit(arrays)
        return arrays


def test_a_copy_in_the_wire_order_is_taken_as_it_is_without_asking_the_layout():
    """Started without arrays, the strategy knows the wire's names from the node that gave them:
    a copy of the record it handed back, named in that order, needs no layout query."""
    app = Recorder()
    final = CopyingFedRep(num_clients=3).start(InProcessGrid(app, 3, {}), ArrayRecord(), num_rounds=3, timeout=60)  # type: ignore[arg-type]
    assert list(final.keys()) == BODY and len(app.of_type("query.parameters")) == 1
    assert not layout_queries(app)


def test_the_parts_an_algorithm_does_not_share_come_back_as_start_was_given_them():
    """The user's loop zeroes the head (which FedRep keeps on the nodes) in each copy it hands
    back: the head in every record the strategy returns is still the one start() was given."""

    class ZeroingHead(CopyingFedRep):
        edit = staticmethod(lambda record: [record.__setitem__(k, Array(np.zeros_like(record[k].numpy())))
                                            for k in list(record.keys()) if k.startswith("fc3")])

    initial = state_dict_record()
    strategy = ZeroingHead(num_clients=3)
    returned = []
    own = strategy.record
    strategy.record = lambda parameters: returned.append(own(parameters)) or returned[-1]  # type: ignore[method-assign]
    strategy.start(InProcessGrid(Recorder(), 3, {}), initial, num_rounds=2, timeout=60)  # type: ignore[arg-type]
    assert len(returned) == 2
    for record in returned:
        for name in ("fc3.weight", "fc3.bias"):
            np.testing.assert_array_equal(record[name].numpy(), initial[name].numpy())


def test_a_copy_of_the_users_state_dict_each_round_asks_the_layout_once():
    """Each round's copy is the user's whole state_dict, cut to the wire by the layout: asked of
    one node once, within wait-timeout when no round timeout is set."""
    app = Recorder()
    CopyingFedRep(num_clients=3, wait_timeout=45.0).start(InProcessGrid(app, 3, {}), state_dict_record(), num_rounds=3,  # type: ignore[arg-type]
                                                          timeout=60)
    assert [m.metadata.ttl for m in layout_queries(app)] == [45.0]
    assert len(app.of_type("train")) == 9


def test_a_loop_that_turns_from_positional_arrays_to_the_users_state_dict_is_followed():
    """Round 1 gets the wire arrays by position (no names known), round 2 the user's whole
    state_dict: the strategy then asks the layout and sends the state_dict's body by name."""
    app = Recorder()
    grid = InProcessGrid(app, 3, {})  # type: ignore[arg-type]
    strategy = FedRep(num_clients=3)
    whole = state_dict_record()
    positional = ArrayRecord([whole[name].numpy() for name in BODY])
    returned, _ = strategy.aggregate_train(1, grid.send_and_receive(list(strategy.configure_train(1, positional, ConfigRecord(), grid))))
    assert strategy.wire_names is None and list(returned.keys()) == [str(i) for i in range(len(BODY))]
    edited = ArrayRecord({k: Array(v.numpy() + 1) for k, v in whole.items()})
    sent = list(strategy.configure_train(2, edited, ConfigRecord(), grid))
    arrays = sent[0].content.array_records[messages.ARRAYS]
    assert list(arrays.keys()) == BODY and len(layout_queries(app)) == 1
    for name in BODY:
        np.testing.assert_array_equal(arrays[name].numpy(), edited[name].numpy())
