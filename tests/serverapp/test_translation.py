"""PFLMessageStrategy and MessageNode only translate: a failed, malformed or NaN reply is a
failure or a rejection of the round logic and the round goes on; the user's configs reach the
clients under the logic's own keys; initial arrays given as a whole ``state_dict`` are cut down
to the wire's by name, and a wrong name is refused naming it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fakes import QuickNet, image_tensors
from flwr_pfl import messages
from flwr_pfl.app.inprocess import InProcessGrid
from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FedRepClient, LocalData, TrainConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp import FedAvg, FedRep, GridClientManager, MessageNode, NodeFailure, PFLMessageStrategy
from flwr_pfl.strategies import FedRep as LegacyFedRep
from flwr_pfl.training import OptimizerConfig

BODY = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
Handler = Callable[[Message, Context], Message]


def local_data(pid: int) -> LocalData:
    n = 20 + 7 * pid  # unequal clients
    x, y, _ = image_tensors(n + 10, seed=50 + pid)
    return LocalData(train=DataLoader(TensorDataset(x[:n], y[:n]), batch_size=8, shuffle=True),
                     test=DataLoader(TensorDataset(x[n:], y[n:]), batch_size=16))


def build(ctx: Context) -> FedRepClient:
    torch.manual_seed(0)
    pid = int(ctx.node_config["partition-id"])
    return FedRepClient(ctx, QuickNet(), local_data(pid), TrainConfig(optimizer=OptimizerConfig(learning_rate=0.05)),
                        head="fc3", head_epochs=1)


CLIENTS = register_handlers(ClientApp(), build)


class Recorder:
    """A ClientApp in front of :data:`CLIENTS`: records requests, and lets a test tamper."""

    def __init__(self, tamper: Callable[[Message, Context, Handler], Message] | None = None) -> None:
        self.requests: list[Message] = []
        self.tamper = tamper

    def __call__(self, message: Message, context: Context) -> Message:
        self.requests.append(message)
        if self.tamper is not None:
            return self.tamper(message, context, CLIENTS)
        return CLIENTS(message, context)

    def of_type(self, message_type: str) -> list[Message]:
        return [m for m in self.requests if m.metadata.message_type == message_type]


def rows_of(strategy_kwargs: dict | None = None) -> tuple[list[tuple[int, str, dict]], dict]:
    rows: list[tuple[int, str, dict]] = []
    kwargs = {"num_clients": 3, "on_round": lambda r, phase, m, c: rows.append((r, phase, m)), **(strategy_kwargs or {})}
    return rows, kwargs


def run(app: Recorder, strategy: PFLMessageStrategy, initial: ArrayRecord, rounds: int = 2, **start) -> object:
    grid = InProcessGrid(app, 3, {})  # type: ignore[arg-type]
    return strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=60, **start)


def state_dict_record(**renamed: str) -> ArrayRecord:
    torch.manual_seed(3)
    state = QuickNet().state_dict()
    return ArrayRecord({renamed.get(k, k): Array(v.numpy()) for k, v in state.items()})


def fit_row(rows, server_round: int) -> dict:
    return next(m for r, phase, m in rows if r == server_round and phase == "fit")


def when_node(node_id: int, message_type: str, answer: Callable[[Message, Context, Handler], Message]):
    """A tamper that lets ``answer`` reply to ``message_type`` messages of ``node_id`` only."""

    def tamper(message: Message, context: Context, clients: Handler) -> Message:
        if message.metadata.dst_node_id == node_id and message.metadata.message_type == message_type:
            return answer(message, context, clients)
        return clients(message, context)

    return tamper


def test_a_whole_state_dict_is_cut_to_the_shared_body_by_name():
    app = Recorder()
    rows, kwargs = rows_of()
    initial = state_dict_record()
    result = run(app, FedRep(**kwargs), initial)
    first = app.of_type("train")[0]
    sent = first.content.array_records[messages.ARRAYS]
    assert list(sent.keys()) == BODY  # named as the user's model names them, the head left out
    for name in BODY:
        np.testing.assert_array_equal(sent[name].numpy(), initial[name].numpy())
    # handed back whole: the trained body, the head as it was given (tests/serverapp/test_user_model.py)
    assert list(result.arrays.keys()) == list(initial.keys())
    assert len(app.of_type("query")) >= 1  # the wire layout was asked of one node
    assert fit_row(rows, 1)["num_failures"] == 0.0 and fit_row(rows, 2)["participants"] == 3.0


def test_a_wrong_name_is_refused_naming_what_is_missing_and_extra():
    rows, kwargs = rows_of()
    with pytest.raises(ConfigError, match=r"lacks 1 array.*'fc1\.weight'.*'fc1\.w'"):
        run(Recorder(), FedRep(**kwargs), state_dict_record(**{"fc1.weight": "fc1.w"}))


def test_an_error_reply_is_a_failure_and_the_round_goes_on():
    def fail(message, context, clients):
        raise RuntimeError("disk full")

    app = Recorder(when_node(1001, "train", fail))
    rows, kwargs = rows_of()
    strategy = FedRep(**kwargs)
    result = run(app, strategy, state_dict_record())
    # round 1: the node never answered yet (known by node id); round 2: its evaluation told its partition
    for server_round, dropped in ((1, "node-1001"), (2, "1")):
        row = fit_row(rows, server_round)
        assert row["num_failures"] == 1.0 and row["participants"] == 2.0 and row["dropped_ids"] == dropped
    assert result.train_metrics_clientapp[2]["num_failures"] == 1.0
    assert all(isinstance(v, (int, float)) for v in result.train_metrics_clientapp[2].values())  # no strings


def test_a_reply_without_metrics_is_a_failure():
    def no_metrics(message, context, clients):
        reply = clients(message, context)
        return Message(RecordDict({messages.ARRAYS: reply.content.array_records[messages.ARRAYS]}), reply_to=message)

    app = Recorder(when_node(1002, "train", no_metrics))
    rows, kwargs = rows_of()
    run(app, FedRep(**kwargs), state_dict_record(), rounds=1)
    row = fit_row(rows, 1)
    assert row["num_failures"] == 1.0 and row["num_rejected"] == 0.0 and row["participant_ids"] == "0 1"


def test_a_nan_reply_is_rejected_by_the_round_logic():
    def nan(message, context, clients):
        reply = clients(message, context)
        arrays = reply.content.array_records[messages.ARRAYS]
        names = list(arrays.keys())
        values = [a.numpy() for a in arrays.values()]
        values[0] = np.full_like(values[0], np.nan)
        content = reply.content
        content[messages.ARRAYS] = messages.pack_arrays(values, names)
        return Message(content, reply_to=message)

    app = Recorder(when_node(1000, "train", nan))
    rows, kwargs = rows_of()
    result = run(app, FedRep(**kwargs), state_dict_record(), rounds=1)
    row = fit_row(rows, 1)
    assert row["num_rejected"] == 1.0 and row["participant_ids"] == "1 2"
    assert all(np.isfinite(a.numpy()).all() for a in result.arrays.values())


def test_an_evaluate_reply_without_loss_is_a_failure():
    def no_loss(message, context, clients):
        return Message(RecordDict({messages.METRICS: MetricRecord({messages.NUM_EXAMPLES: 5})}), reply_to=message)

    app = Recorder(when_node(1000, "evaluate", no_loss))
    rows, kwargs = rows_of()
    run(app, FedRep(**kwargs), state_dict_record(), rounds=1)
    evaluate = next(m for r, phase, m in rows if phase == "evaluate")
    assert evaluate["num_failures"] == 1.0 and evaluate["participant_ids"] == "1 2"


def test_user_configs_reach_the_clients_under_the_logic_keys():
    app = Recorder()
    rows, kwargs = rows_of({"fit_config": {"from-logic": 1}})
    run(app, FedRep(**kwargs), state_dict_record(),
        train_config=ConfigRecord({"mine": 7, "server-round": 99, "from-logic": 5}),
        evaluate_config=ConfigRecord({"eval-mine": "x"}))
    for message in app.of_type("train"):
        config = message.content.config_records[messages.CONFIG]
        assert config["mine"] == 7 and config["from-logic"] == 1 and config["server-round"] in (1, 2)
    assert {m.content.config_records[messages.CONFIG]["server-round"] for m in app.of_type("train")} == {1, 2}
    assert all(m.content.config_records[messages.CONFIG]["eval-mine"] == "x" for m in app.of_type("evaluate"))


def test_flowers_lr_in_the_train_config_sets_the_clients_rate():
    """advanced-pytorch's habit: ``train_config=ConfigRecord({"lr": ...})``. A rate float32 cannot
    step with leaves the model where it was; the same run at 0.1 moves it."""
    def final(lr: float) -> list[np.ndarray]:
        result = run(Recorder(), FedAvg(**rows_of()[1]), state_dict_record(), rounds=1,
                     train_config=ConfigRecord({"lr": lr}))
        return [a.numpy() for a in result.arrays.values()]

    start = [a.numpy() for a in state_dict_record().values()]
    assert all(np.array_equal(a, b) for a, b in zip(final(1e-30), start))
    assert any(not np.allclose(a, b) for a, b in zip(final(0.1), start))


class OwnLoopFedAvg(FedAvg):
    """Flower's advanced-pytorch habits: a strategy made without num_clients whose start() is its
    own round loop (it never calls super().start()), logging summary() first, and whose
    configure_train halves the train config's "lr" from round 2."""

    def configure_train(self, server_round, arrays, config, grid):
        if server_round == 2:
            config["lr"] = config["lr"] * 0.5
        self.sent_lr = config["lr"]
        return super().configure_train(server_round, arrays, config, grid)

    def start(self, grid, initial_arrays, num_rounds=3, timeout=3600, train_config=None, evaluate_config=None,
              evaluate_fn=None):
        self.summary()
        arrays, history = initial_arrays, []
        for current_round in range(1, num_rounds + 1):
            replies = grid.send_and_receive(self.configure_train(current_round, arrays, train_config, grid), timeout=timeout)
            new_arrays, _ = self.aggregate_train(current_round, replies)
            arrays = new_arrays if new_arrays is not None else arrays
            replies = grid.send_and_receive(self.configure_evaluate(current_round, arrays, evaluate_config or ConfigRecord(), grid),
                                            timeout=timeout)
            history.append((self.sent_lr, self.aggregate_evaluate(current_round, replies)))
        return arrays, history


def test_a_subclass_with_its_own_round_loop_runs_as_in_flowers_advanced_example():
    app = Recorder()
    arrays, history = OwnLoopFedAvg(fraction_evaluate=1.0).start(
        InProcessGrid(app, 3, {}), state_dict_record(), num_rounds=2, train_config=ConfigRecord({"lr": 0.1}))  # type: ignore[arg-type]
    assert [lr for lr, _ in history] == [0.1, 0.05]  # the schedule reached the clients
    assert [m.content.config_records[messages.CONFIG]["lr"] for m in app.of_type("train")] == [0.1] * 3 + [0.05] * 3
    assert all(metrics is not None and metrics["num_clients"] == 3 for _, metrics in history)
    start = [a.numpy() for a in state_dict_record().values()]
    assert any(not np.allclose(a.numpy(), b) for a, b in zip(arrays.values(), start))


def test_positional_initial_arrays_are_taken_as_they_are():
    app = Recorder()
    rows, kwargs = rows_of()
    whole = state_dict_record()
    initial = [whole[name].numpy() for name in BODY]  # FedRep's wire: the body, by position
    run(app, FedRep(**kwargs), ArrayRecord(initial), rounds=1)
    sent = app.of_type("train")[0].content.array_records[messages.ARRAYS]
    assert len(sent) == len(initial) and not app.of_type("query")  # no layout asked, all arrays sent


def test_the_logic_object_is_the_legacy_strategy():
    strategy = FedRep(num_clients=3)
    assert isinstance(strategy, PFLMessageStrategy) and type(strategy.logic) is LegacyFedRep
    assert FedRep.__name__ == "FedRep" and FedRep.logic_class is LegacyFedRep
    with pytest.raises(TypeError, match="PFLStrategy"):
        PFLMessageStrategy(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ MessageNode
class ScriptedGrid:
    """A Grid that answers every message with ``reply(message)`` (None: no reply)."""

    def __init__(self, reply: Callable[[Message], Message | None], nodes: list[int] | None = None) -> None:
        self.reply = reply
        self.nodes = nodes or [7]

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages_, *, timeout=None):
        out = [self.reply(m) for m in messages_]
        return [m for m in out if m is not None]


@pytest.fixture(autouse=True)
def server_identity() -> None:
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


def test_message_node_raises_on_no_reply_an_error_reply_and_bad_content():
    from flwr.app import Error
    from flwr.common import FitIns, GetPropertiesIns, ndarrays_to_parameters

    ins = FitIns(ndarrays_to_parameters([np.zeros(2, np.float32)]), {"server-round": 1})
    with pytest.raises(NodeFailure, match="no 'train' reply"):
        MessageNode(ScriptedGrid(lambda m: None), 7).fit(ins, 1.0, 1)  # type: ignore[arg-type]
    with pytest.raises(NodeFailure, match="boom"):
        MessageNode(ScriptedGrid(lambda m: Message(Error(code=0, reason="boom"), reply_to=m)), 7).fit(ins, 1.0, 1)  # type: ignore[arg-type]
    with pytest.raises(messages.MessageContentError, match="no ConfigRecord 'properties'"):
        MessageNode(ScriptedGrid(lambda m: Message(RecordDict(), reply_to=m)), 7).get_properties(GetPropertiesIns({}), 1.0, None)  # type: ignore[arg-type]

    def echo(message: Message) -> Message:
        arrays, config = messages.read_request(message.content)
        assert message.metadata.message_type == "train" and config == {"server-round": 1}
        return Message(messages.train_reply_content([a + 1 for a in arrays], 4, {"partition_id": 0}), reply_to=message)

    res = MessageNode(ScriptedGrid(echo), 7).fit(ins, 1.0, 1)  # type: ignore[arg-type]
    assert res.num_examples == 4 and res.metrics == {"partition_id": 0}


def test_the_client_manager_follows_the_grid_nodes():
    grid = ScriptedGrid(lambda m: None, nodes=[1, 2, 3])
    manager = GridClientManager(grid)  # type: ignore[arg-type]
    manager.refresh()
    assert sorted(manager.all()) == ["1", "2", "3"]
    grid.nodes = [2, 3, 4]
    manager.refresh()
    assert sorted(manager.all()) == ["2", "3", "4"] and all(isinstance(p, MessageNode) for p in manager.all().values())
    assert manager.wait_for(3, timeout=0) and not manager.wait_for(4, timeout=0)


# ------------------------------------------------------------------------------ what each reply counts for
def scaled_reply(reply: Message, request: Message, scale: float) -> Message:
    """A second reply to ``request``, as ``reply`` but with its arrays ``scale`` times theirs."""
    arrays = reply.content.array_records[messages.ARRAYS]
    content = RecordDict(dict(reply.content))
    content[messages.ARRAYS] = messages.pack_arrays([a.numpy() * scale for a in arrays.values()], list(arrays.keys()))
    return Message(content, reply_to=request)


class DuplicatingGrid(InProcessGrid):
    """An in-process grid on which ``node_id`` answers every ``train`` message twice: its real
    reply, then a second one whose arrays are ``scale`` times the first's."""

    def __init__(self, app: Recorder, node_id: int, scale: float) -> None:
        super().__init__(app, 3, {})  # type: ignore[arg-type]
        self.node_id, self.scale = node_id, scale

    def send_and_receive(self, *args, timeout=None, **kwargs):  # Flower passes messages=... by name
        sent = list(kwargs.pop("messages", args[0] if args else []))
        replies = super().send_and_receive(sent, timeout=timeout)
        for message in sent:
            if message.metadata.message_type != "train" or message.metadata.dst_node_id != self.node_id:
                continue
            first = next(r for r in replies if r.metadata.src_node_id == self.node_id)
            replies.append(scaled_reply(first, message, self.scale))
        return replies


def test_a_nodes_second_reply_is_ignored_and_its_first_counts_once():
    """A node that answers twice (a retried delivery) counts once, with its first reply: the run
    ends exactly where the run without the duplicate ends (a second reply counted would pull
    the mean towards arrays 100 times the first's)."""
    results = []
    for grid_of in (lambda app: InProcessGrid(app, 3, {}), lambda app: DuplicatingGrid(app, 1001, 100.0)):  # type: ignore[arg-type]
        rows, kwargs = rows_of()
        result = FedRep(**kwargs).start(grid=grid_of(Recorder()), initial_arrays=state_dict_record(), num_rounds=2, timeout=60)
        results.append((rows, result))
    (clean_rows, clean), (dup_rows, dup) = results
    assert list(dup.arrays.keys()) == list(clean.arrays.keys()) == list(state_dict_record().keys())
    for name in dup.arrays.keys():
        np.testing.assert_array_equal(dup.arrays[name].numpy(), clean.arrays[name].numpy())
    for server_round in (1, 2):
        row = fit_row(dup_rows, server_round)
        assert (row["num_failures"], row["num_rejected"], row["participant_ids"]) == (0.0, 0.0, "0 1 2")
        assert row["train_loss_wmean"] == fit_row(clean_rows, server_round)["train_loss_wmean"]


def test_the_initial_arrays_are_evaluated_as_round_zero_then_each_round_after_training():
    """The logic's evaluate_fn sees the initial arrays as round 0 (before any node trains), then
    each round's aggregate as that round, as in the legacy server loop."""
    seen: list[tuple[int, list[np.ndarray]]] = []

    def evaluate_fn(server_round, arrays, config):
        seen.append((server_round, arrays))
        return 0.5 + server_round, {"rounds_seen": float(len(seen))}

    app = Recorder()
    rows, kwargs = rows_of({"evaluate_fn": evaluate_fn})
    initial = state_dict_record()
    result = run(app, FedRep(**kwargs), initial)
    assert [r for r, _ in seen] == [0, 1, 2]
    assert [(r, m["loss"]) for r, phase, m in rows if phase == "server-evaluate"] == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert rows[0][1] == "server-evaluate"  # recorded before round 1's fit row
    for array, name in zip(seen[0][1], BODY, strict=True):
        np.testing.assert_array_equal(array, initial[name].numpy())
    for array, name in zip(seen[2][1], BODY, strict=True):
        np.testing.assert_array_equal(array, result.arrays[name].numpy())
    assert any(not np.array_equal(a, b) for a, b in zip(seen[0][1], seen[1][1]))  # round 1 saw the trained arrays


def test_initial_arrays_named_in_another_order_are_sent_by_name_in_every_round():
    """The wire arrays given in reverse order: every message carries each array under its own
    name, also when round 1's training fails everywhere and Flower hands the same record back
    for round 1's evaluation and round 2 (the names are known by then, the order is not theirs)."""

    def fail_round_one(message, context, clients):
        config = message.content.config_records[messages.CONFIG]
        if message.metadata.message_type == "train" and config["server-round"] == 1:
            raise RuntimeError("round 1 lost")
        return clients(message, context)

    app = Recorder(fail_round_one)
    rows, kwargs = rows_of({"stop_if_nothing_trains": False})  # round 1 fails on purpose (tests/strategies/test_no_training.py)
    whole = state_dict_record()
    reverse = ArrayRecord({name: whole[name] for name in reversed(BODY)})
    run(app, FedRep(**kwargs), reverse)
    assert fit_row(rows, 1)["num_failures"] == 3.0 and fit_row(rows, 2)["num_failures"] == 0.0
    sent = [m for m in app.requests if m.metadata.message_type in ("train", "evaluate")]
    rounds = [(m.metadata.message_type, m.content.config_records[messages.CONFIG]["server-round"]) for m in sent]
    assert {("train", 1), ("evaluate", 1), ("train", 2)} <= set(rounds)
    for message, (kind, server_round) in zip(sent, rounds):
        if (kind, server_round) == ("evaluate", 2):
            continue  # round 2's aggregate
        arrays = message.content.array_records[messages.ARRAYS]
        assert list(arrays.keys()) == BODY, (kind, server_round)
        for name in BODY:
            np.testing.assert_array_equal(arrays[name].numpy(), whole[name].numpy(), err_msg=f"{kind} {server_round} {name}")


def test_the_evaluation_loss_is_each_nodes_reported_loss_weighted_by_its_examples():
    """Each node's evaluate reply says its own loss and count (unequal); the round's loss is their
    example-weighted mean, in the results row and in Flower's Result."""
    reported = {1000: (0.5, 4), 1001: (2.0, 12), 1002: (1.25, 8)}

    def scripted(message, context, clients):
        if message.metadata.message_type != "evaluate":
            return clients(message, context)
        loss, n = reported[message.metadata.dst_node_id]
        pid = int(context.node_config["partition-id"])
        return Message(messages.metrics_content(n, {"partition_id": pid, "accuracy": 0.1 * pid}, loss=loss), reply_to=message)

    rows, kwargs = rows_of()
    result = run(Recorder(scripted), FedRep(**kwargs), state_dict_record(), rounds=1)
    want = (0.5 * 4 + 2.0 * 12 + 1.25 * 8) / 24
    evaluate = next(m for r, phase, m in rows if phase == "evaluate")
    assert evaluate["loss_wmean"] == pytest.approx(want, rel=1e-12) and evaluate["num_failures"] == 0.0
    assert evaluate["loss_min"] == 0.5 and evaluate["loss_max"] == 2.0
    assert result.evaluate_metrics_clientapp[1]["loss_wmean"] == pytest.approx(want, rel=1e-12)
