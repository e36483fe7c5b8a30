"""The Message-API client handlers (flwr_pfl.clientapp) reply exactly what the NumPyClient
flavour's client returns for the same node state, pack it as flwr_pfl.messages says, and keep
the personal part in the node's context.state."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fakes import QuickNet, image_tensors
from flwr_pfl import messages
from flwr_pfl.clientapp import message_client_app, register_handlers
from flwr_pfl.clients import FedRepClient, LocalData, TrainConfig
from flwr_pfl.training import OptimizerConfig

BODY = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def local_data(pid: int) -> LocalData:
    n = 20 + 7 * pid  # unequal clients
    x, y, _ = image_tensors(n + 10, seed=50 + pid)
    return LocalData(
        train=DataLoader(TensorDataset(x[:n], y[:n]), batch_size=8, shuffle=True),
        test=DataLoader(TensorDataset(x[n:], y[n:]), batch_size=16),
    )


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=100 + pid, node_config={"partition-id": pid, "num-partitions": 3},
                   state=RecordDict(), run_config={})


def build(ctx: Context) -> FedRepClient:
    torch.manual_seed(0)
    pid = int(ctx.node_config["partition-id"])
    return FedRepClient(ctx, QuickNet(), local_data(pid), TrainConfig(optimizer=OptimizerConfig(learning_rate=0.05)), head="fc3", head_epochs=2)


@pytest.fixture(autouse=True)
def server_identity() -> None:
    """Messages are created as the server creates them (Flower reads the task identity)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


def request(kind: str, arrays: list[np.ndarray], config: dict) -> Message:
    content = messages.request_content(arrays, config) if kind != "query" else messages.query_content(config)
    return Message(content, dst_node_id=101, message_type=kind)


def global_body() -> list[np.ndarray]:
    torch.manual_seed(1)
    state = QuickNet().state_dict()
    return [state[k].numpy() + 0.01 for k in BODY]


CONFIG = {"server-round": 3, "seed": 7}


def test_train_reply_equals_the_numpyclient_flavour_and_names_the_arrays() -> None:
    app = message_client_app(build)
    ctx, twin = context(1), context(1)
    reply = app(request("train", global_body(), CONFIG), ctx)
    arrays, num_examples, metrics = messages.read_train_reply(reply.content)
    expected, expected_n, expected_metrics = build(twin).fit(global_body(), dict(CONFIG))
    assert num_examples == expected_n == 27  # partition 1's training set, not a default
    assert list(reply.content.array_records[messages.ARRAYS].keys()) == BODY
    for got, want in zip(arrays, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert metrics.keys() == expected_metrics.keys()
    assert metrics["train_loss"] == expected_metrics["train_loss"]


def test_train_keeps_the_personal_head_in_context_state_for_the_next_message() -> None:
    app = message_client_app(build)
    ctx = context(2)
    app(request("train", global_body(), CONFIG), ctx)
    assert ctx.state.array_records, "the trained head was not kept in context.state"
    head_after_first = copy.deepcopy(build(ctx).personal_state())
    fresh_head = build(context(2)).personal_state()
    assert any(not torch.equal(head_after_first[k], fresh_head[k]) for k in fresh_head)
    # the next message starts from the kept head: its evaluation equals the twin client's
    reply = app(request("evaluate", global_body(), CONFIG), ctx)
    loss, num_examples, _ = messages.read_evaluate_reply(reply.content)
    twin = context(2)
    twin.state = copy.deepcopy(ctx.state)
    want_loss, want_n, _ = build(twin).evaluate(global_body(), dict(CONFIG))
    assert (num_examples, loss) == (want_n, pytest.approx(want_loss, abs=0.0))


class PlainClient:
    """A user's own client: its evaluate returns a loss that its metrics do not repeat, and
    names no arrays."""

    def fit(self, parameters, config):
        return [a * 2 for a in parameters], 6, {"steps": 3}

    def evaluate(self, parameters, config):
        return 0.625, 11, {"accuracy": 0.25}

    def get_properties(self, config):
        return {"partition_id": 0}

    def get_parameters(self, config):
        return [np.ones(2, np.float32)]


def test_an_evaluate_reply_carries_the_loss_the_client_returned() -> None:
    app = message_client_app(lambda ctx: PlainClient())
    reply = app(request("evaluate", [np.zeros(2, np.float32)], CONFIG), context(0))
    assert messages.read_evaluate_reply(reply.content) == (0.625, 11, {"accuracy": 0.25, "loss": 0.625})
    train = app(request("train", [np.full(2, 1.5, np.float32)], CONFIG), context(0))
    arrays, n, metrics = messages.read_train_reply(train.content)
    assert n == 6 and metrics == {"steps": 3} and list(train.content.array_records[messages.ARRAYS].keys()) == ["0"]
    np.testing.assert_array_equal(arrays[0], np.full(2, 3.0, np.float32))


def test_query_reply_carries_the_partition_id() -> None:
    app = message_client_app(build)
    reply = app(request("query", [], {}), context(2))
    assert messages.read_properties(reply.content)["partition_id"] == 2


def test_a_client_error_propagates_for_flower_to_turn_into_an_error_reply() -> None:
    def broken(ctx: Context) -> FedRepClient:
        raise RuntimeError("no data on this node")

    app = message_client_app(broken)
    with pytest.raises(RuntimeError, match="no data on this node"):
        app(request("train", global_body(), CONFIG), context(0))


def test_handlers_cannot_be_registered_beside_a_client_fn() -> None:
    app = ClientApp(client_fn=lambda context: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"either `@app.train\(\)` or `client_fn`"):
        register_handlers(app, build)


def test_a_users_clientapp_keeps_the_personal_part_across_a_restart_with_persisted(tmp_path) -> None:
    """The lifespan the clientapp docs show: with ``state-dir``, a node restarted (a new, empty
    context) continues from the head it had trained, not from a fresh one."""
    from collections.abc import Iterator

    from flwr_pfl.app.node_state import persisted

    app = message_client_app(build)

    @app.lifespan()
    def keep_state(context: Context) -> Iterator[None]:
        with persisted(context):
            yield

    def node() -> Context:
        ctx = context(1)
        ctx.node_config["state-dir"] = str(tmp_path)
        return ctx

    first = node()
    app(request("train", global_body(), CONFIG), first)
    trained = build(first).personal_state()
    restarted = node()
    app(request("evaluate", global_body(), CONFIG), restarted)
    assert any(tmp_path.rglob("partition-1.state"))
    kept = build(restarted).personal_state()
    assert kept.keys() == trained.keys() and all(torch.equal(kept[k], trained[k]) for k in kept)


def test_a_mod_attached_to_train_runs_for_train_messages_only() -> None:
    """``register_handlers(mods={"train": [...]})``: a mod that expects a training reply (as
    Flower's clipping mods do) never sees the suite's query messages."""
    seen: list[str] = []

    def scaling_mod(message: Message, ctx: Context, call_next) -> Message:
        seen.append(message.metadata.message_type)
        reply = call_next(message, ctx)
        for record in reply.content.array_records.values():
            for name in record.keys():
                record[name] = type(record[name]).from_numpy_ndarray(record[name].numpy() * 0.0)
        return reply

    app = register_handlers(ClientApp(), build, mods={"train": [scaling_mod]})
    query = app(request("query", [], {"what": "nothing"}), context(0))
    assert not query.has_error() and seen == []
    reply = app(request("train", global_body(), CONFIG), context(0))
    arrays, _, _ = messages.read_train_reply(reply.content)
    assert seen == ["train"]
    assert all(not a.any() for a in arrays)  # the mod's change reached the reply
    evaluated = app(request("evaluate", global_body(), CONFIG), context(0))
    assert not evaluated.has_error() and seen == ["train"]


def test_mods_for_an_unknown_handler_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'fit'.*not handlers.*'train'"):
        register_handlers(ClientApp(), build, mods={"fit": []})
