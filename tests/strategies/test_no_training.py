"""A run in which every client fails from the start stops with NoTrainingError instead of
ending as completed with the initial model (``stop_if_nothing_trains``, on by default): in the
strategy's own aggregation, in Flower's legacy loop and in the Message API's ``start()``. A
round that loses only some clients, or every client after a round that trained, goes on; the
suite's own app judges the whole run at its end instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context
from flwr.clientapp import ClientApp
from flwr.client import ClientApp as LegacyClientApp
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fakes import FakeProxy, QuickNet, fit_res, image_tensors
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FedRepClient, LocalData, TrainConfig
from flwr_pfl.errors import NoTrainingError
from flwr_pfl.serverapp import FedRep as MessageFedRep
from flwr_pfl.strategies import FedAvg, FedRep
from flwr_pfl.strategies.validation import describe_failures
from flwr_pfl.training import OptimizerConfig

ERROR = "a batch is a dict with keys ['pixels', 'target']"


class RenamedKeys(Dataset):
    """Dict samples under keys the clients do not look for (Flower's datasets name them otherwise)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"pixels": self.x[i], "target": self.y[i]}


def loaders(pid: int, renamed: bool) -> LocalData:
    x, y, _ = image_tensors(30 + 5 * pid, seed=70 + pid)
    make = RenamedKeys if renamed else TensorDataset
    return LocalData(train=DataLoader(make(x[:24], y[:24]), batch_size=8), test=DataLoader(make(x[24:], y[24:]), batch_size=8))


def client(ctx: Context, renamed_from: int = 0) -> FedRepClient:
    """Partition ``pid``'s FedRep client; partitions >= ``renamed_from`` have unreadable batches."""
    torch.manual_seed(0)
    pid = int(ctx.node_config["partition-id"])
    return FedRepClient(ctx, QuickNet(), loaders(pid, pid >= renamed_from), TrainConfig(optimizer=OptimizerConfig(learning_rate=0.05)),
                        head="fc3")


def whole_state_dict() -> ArrayRecord:
    torch.manual_seed(3)
    return ArrayRecord({k: Array(v.numpy()) for k, v in QuickNet().state_dict().items()})


def test_a_first_round_in_which_every_client_fails_stops_the_message_api_run_quoting_the_error_once():
    app = register_handlers(ClientApp(), client)
    grid = InProcessGrid(app, 3, {})  # type: ignore[arg-type]
    with pytest.raises(NoTrainingError, match=r"MessageFedRep|FedRep, round 1 \(fit\)") as caught:
        MessageFedRep(num_clients=3).start(grid=grid, initial_arrays=whole_state_dict(), num_rounds=3, timeout=60)
    text = str(caught.value)
    assert "round 1 (fit)" in text and "the clients' errors (3): ConfigError: " + ERROR in text
    assert text.count(ERROR) == 1 and "stop_if_nothing_trains=False" in text


def test_the_legacy_loop_stops_too_and_no_second_round_is_asked():
    asked: list[int] = []

    def client_fn(ctx: Context):
        return client(ctx).to_client()

    def server_fn(ctx: Context):
        strategy = FedRep(num_clients=3, on_round=lambda r, phase, m, c: asked.append(r))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=3))

    with pytest.raises(NoTrainingError, match=r"FedRep, round 1 \(fit\).*" + r"errors \(3\): ConfigError: a batch is a dict"):
        run_inprocess(ServerApp(server_fn=server_fn), LegacyClientApp(client_fn=client_fn), 3, {})
    assert set(asked) == {1}


def test_with_stop_if_nothing_trains_false_the_run_goes_on_through_every_round():
    app = register_handlers(ClientApp(), client)
    rows: list[tuple[int, str, dict]] = []
    strategy = MessageFedRep(num_clients=3, stop_if_nothing_trains=False, on_round=lambda r, phase, m, c: rows.append((r, phase, m)))
    strategy.start(grid=InProcessGrid(app, 3, {}), initial_arrays=whole_state_dict(), num_rounds=2, timeout=60)  # type: ignore[arg-type]
    fits = [m for r, phase, m in rows if phase == "fit"]
    assert [f["num_failures"] for f in fits] == [3.0, 3.0]


def test_a_round_that_keeps_one_client_trains_and_the_run_goes_on():
    app = register_handlers(ClientApp(), lambda ctx: client(ctx, renamed_from=1))
    rows: list[tuple[int, str, dict]] = []
    strategy = MessageFedRep(num_clients=3, on_round=lambda r, phase, m, c: rows.append((r, phase, m)))
    result = strategy.start(grid=InProcessGrid(app, 3, {}), initial_arrays=whole_state_dict(), num_rounds=2, timeout=60)  # type: ignore[arg-type]
    fits = [m for r, phase, m in rows if phase == "fit"]
    assert [(f["num_failures"], f["participants"]) for f in fits] == [(2.0, 1.0), (2.0, 1.0)]
    assert len(result.arrays) > 0


def proxies(n: int) -> list[FakeProxy]:
    return [FakeProxy(str(100 + i), i) for i in range(n)]


def test_every_client_failing_after_a_round_that_trained_is_no_reason_to_stop():
    """A fleet that loses every client in a later round (a network outage) keeps the model it
    has; only a run that never trained is stopped."""
    strategy = FedAvg(num_clients=2, initial_arrays=[np.zeros(3)])
    arrays = [np.ones(3)]
    trained, _ = strategy.aggregate_fit(1, [(p, fit_res(arrays, pid=p.pid)) for p in proxies(2)], [])
    assert trained is not None
    assert strategy.aggregate_fit(2, [], [RuntimeError("gone"), RuntimeError("gone")]) == (None, {"num_failures": 2.0, "num_rejected": 0.0})


def test_rejected_replies_count_as_lost_and_a_round_without_replies_is_not_judged():
    """Replies the strategy rejects (here NaN arrays) lose the round as errors do; a round in
    which nobody was asked and nothing was lost says nothing about the run."""
    strategy = FedAvg(num_clients=2, initial_arrays=[np.zeros(3)])
    assert strategy.aggregate_fit(1, [], []) == (None, {"num_failures": 0.0, "num_rejected": 0.0})
    bad = [(p, fit_res([np.full(3, np.nan)], pid=p.pid)) for p in proxies(2)]
    with pytest.raises(NoTrainingError, match=r"round 2 \(fit\).*client 100: its reply was rejected"):
        strategy.aggregate_fit(2, bad, [])


def test_the_round_is_counted_in_the_whole_run_after_a_resume():
    """The round in the message is the run's (resumed rounds included), as every log line's."""
    strategy = FedAvg(num_clients=1, initial_arrays=[np.zeros(3)])
    strategy.round_offset = 4
    with pytest.raises(NoTrainingError, match=r"FedAvg, round 5 \(fit\).*RuntimeError: disk full"):
        strategy.aggregate_fit(1, [], [RuntimeError("disk full")])


def test_describe_failures_quotes_an_error_shared_by_several_clients_once_with_its_count():
    failures = [RuntimeError("x"), RuntimeError("x"), ValueError("y"), RuntimeError("x")]
    assert describe_failures(failures) == "3 clients: RuntimeError: x; ValueError: y"
    assert describe_failures([RuntimeError("x")] * 3) == "RuntimeError: x"  # the caller says how many
    many = [RuntimeError(str(i)) for i in range(5)]
    assert describe_failures(many, limit=2) == "RuntimeError: 0; RuntimeError: 1 (and 3 more)"


def test_accept_failures_false_leaves_rounds_unaggregated_on_purpose_and_is_not_stopped():
    """accept_failures=False leaves a round with one failure unaggregated although others
    trained (Flower's meaning): the strict user decides, and the run goes on."""
    strategy = FedAvg(num_clients=2, initial_arrays=[np.zeros(3)], accept_failures=False)
    good = [(proxies(1)[0], fit_res([np.ones(3)], pid=0))]
    assert strategy.aggregate_fit(1, good, [RuntimeError("client lost")])[0] is None
    assert strategy.aggregate_fit(2, [], [RuntimeError("client lost"), RuntimeError("client lost")])[0] is None


def test_a_reply_whose_training_loss_overflowed_is_rejected_even_with_finite_arrays():
    """A local training that diverged (its loss inf or NaN) sends arrays that are no model,
    finite or not; the others are aggregated without it."""
    strategy = FedAvg(num_clients=3, initial_arrays=[np.zeros(3)])
    replies = [(p, fit_res([np.full(3, float(p.pid + 1))], pid=p.pid, metrics={"train_loss": loss}))
               for p, loss in zip(proxies(3), [1.0, float("inf"), float("nan")])]
    parameters, metrics = strategy.aggregate_fit(1, replies, [])
    assert metrics["num_rejected"] == 2.0
    np.testing.assert_array_equal(strategy.global_arrays[0], np.ones(3))


class ConstantNet(torch.nn.Module):
    """A classifier that answers ``answer`` for every input (a collapsed model)."""

    def __init__(self, answer: int | None) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 3)
        self.answer = answer

    def forward(self, x: torch.Tensor, domain: torch.Tensor | None = None) -> torch.Tensor:
        if self.answer is None:
            return x[:, :1] * torch.tensor([[1.0, -1.0, 0.0]])  # class 0 or 1 by the sign of x[0]
        return torch.nn.functional.one_hot(torch.full((len(x),), self.answer), 3).float()


def test_evaluation_reports_a_model_that_predicts_one_class_for_samples_of_several():
    from flwr_pfl.core.metrics import ONE_CLASS
    from flwr_pfl.training.loops import evaluate

    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0], [-3.0, 0.0]])
    several = DataLoader(TensorDataset(x, torch.tensor([0, 1, 0, 1])), batch_size=1)  # one class per batch
    one = DataLoader(TensorDataset(x, torch.tensor([2, 2, 2, 2])), batch_size=2)
    device = torch.device("cpu")
    assert evaluate(ConstantNet(2), several, device=device).metrics()[ONE_CLASS] == 1.0
    assert ONE_CLASS not in evaluate(ConstantNet(None), several, device=device).metrics()
    assert ONE_CLASS not in evaluate(ConstantNet(2), one, device=device).metrics()  # right to answer one class


def test_the_strategy_warns_when_half_the_evaluated_clients_collapsed(caplog):
    from flwr.common import Code, EvaluateRes, Status
    from flwr.common.logger import FLOWER_LOGGER

    def replies(collapsed: int, n: int = 4):
        return [(p, EvaluateRes(Status(Code.OK, ""), 1.0, 10, {"partition_id": p.pid, "accuracy": 0.3,
                                                                  **({"one_class_predicted": 1.0} if p.pid < collapsed else {})}))
                for p in proxies(n)]

    FLOWER_LOGGER.propagate = True
    try:
        for collapsed, warned in ((1, False), (2, True), (4, True), (0, False)):
            caplog.clear()
            FedAvg(num_clients=4, initial_arrays=[np.zeros(3)]).aggregate_evaluate(3, replies(collapsed), [])
            text = [r.getMessage() for r in caplog.records if "predict one class" in r.getMessage()]
            assert bool(text) == warned, collapsed
            assert not warned or text[0].startswith(f"round 3: {collapsed} of 4 evaluated clients' models")
    finally:
        FLOWER_LOGGER.propagate = False
