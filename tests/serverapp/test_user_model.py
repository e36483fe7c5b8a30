"""What a Message-API strategy hands back to Flower's loop (``evaluate_fn``'s arrays and
``Result.arrays``) loads into the user's own model: started from the whole ``state_dict``, it is
that ``state_dict`` again, the shared part trained and the rest as given; the global arrays
without a place in the user's model (pFedFDA's statistics) are kept apart in ``extra_arrays``.
An algorithm without a global model refuses ``evaluate_fn`` at ``start()`` and hands back no
arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fakes import BatchNormDropoutNet, MiddleHeadNet, QuickNet, image_tensors
from flwr_pfl.app.inprocess import InProcessGrid
from flwr_pfl.clientapp import register_handlers
from flwr_pfl.clients import FEDORAClient, FedBNClient, FedRepClient, LocalClient, LocalData, PFedFDAClient, TrainConfig
from flwr_pfl.core.pfedfda import lda_head
from flwr_pfl.errors import ConfigError
from flwr_pfl.serverapp import FEDORA, FedBN, FedRep, Local, PFedFDA
from flwr_pfl.training import OptimizerConfig

HEAD = ["fc3.weight", "fc3.bias"]


def data(pid: int, model=QuickNet) -> LocalData:
    n = 24 + 6 * pid  # unequal clients
    if model in (BatchNormDropoutNet, MiddleHeadNet):  # 6 features, 3 classes
        g = torch.Generator().manual_seed(90 + pid)
        x = torch.randn(n + 12, 6, generator=g)
        y = (x[:, :3].argmax(1) + pid) % 3
    else:
        x, y, _ = image_tensors(n + 12, seed=90 + pid)
    return LocalData(train=DataLoader(TensorDataset(x[:n], y[:n]), batch_size=8, shuffle=True),
                     test=DataLoader(TensorDataset(x[n:], y[n:]), batch_size=12))


def app_for(client_class, model=QuickNet, head: str | None = "fc3") -> ClientApp:
    def build(ctx: Context):
        torch.manual_seed(0)
        kwargs = {"head": head} if head is not None else {}
        return client_class(ctx, model(), data(int(ctx.node_config["partition-id"]), model),
                            TrainConfig(optimizer=OptimizerConfig(learning_rate=0.05)), **kwargs)

    return register_handlers(ClientApp(), build)


def whole(model=QuickNet, seed: int = 3) -> ArrayRecord:
    torch.manual_seed(seed)
    return ArrayRecord({k: Array(v.numpy()) for k, v in model().state_dict().items()})


def start(strategy, app: ClientApp, initial: ArrayRecord, rounds: int = 2, **kwargs):
    return strategy.start(grid=InProcessGrid(app, 3, {}), initial_arrays=initial, num_rounds=rounds, timeout=60, **kwargs)  # type: ignore[arg-type]


def loads_strictly(arrays: ArrayRecord, model=QuickNet) -> None:
    model().load_state_dict(arrays.to_torch_state_dict(), strict=True)


def test_fedrep_hands_back_the_users_net_with_its_trained_body_and_the_given_head():
    seen: list[tuple[int, ArrayRecord]] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loads_strictly(arrays)  # what Flower's examples do with it
        seen.append((server_round, arrays))
        return MetricRecord({"accuracy": 0.0})

    initial = whole()
    strategy = FedRep(num_clients=3)
    result = start(strategy, app_for(FedRepClient), initial, evaluate_fn=evaluate_fn)
    assert [r for r, _ in seen] == [0, 1, 2]
    assert list(result.arrays.keys()) == list(initial.keys())
    loads_strictly(result.arrays)
    body = [k for k in initial.keys() if k not in HEAD]
    for name, array in zip(body, strategy.logic.global_arrays, strict=True):  # the trained body, by name
        np.testing.assert_array_equal(result.arrays[name].numpy(), array)
    assert any(not np.array_equal(result.arrays[k].numpy(), initial[k].numpy()) for k in body)
    for name in HEAD:  # each client's trained head stays on its node: the head is the one given
        np.testing.assert_array_equal(result.arrays[name].numpy(), initial[name].numpy())
    assert len(strategy.extra_arrays) == 0
    assert not np.array_equal(seen[1][1]["fc1.weight"].numpy(), initial["fc1.weight"].numpy())  # round 1's body


def test_pfedfda_keeps_its_statistics_apart_and_hands_back_its_global_classifier_as_the_head():
    """pFedFDA's global model is the backbone and the Gaussian classifier of the global
    statistics: the head handed back is that classifier's LDA head (Eq. 4, uniform priors)."""
    initial = whole()
    strategy = PFedFDA(num_clients=3)
    result = start(strategy, app_for(PFedFDAClient), initial, rounds=1)
    loads_strictly(result.arrays)
    _, mu, sigma = strategy.logic.split(strategy.logic.global_arrays)
    weight, bias = lda_head(mu.astype(np.float64), sigma.astype(np.float64), np.full(3, 1 / 3))
    np.testing.assert_allclose(result.arrays["fc3.weight"].numpy(), weight.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.arrays["fc3.bias"].numpy(), bias.numpy(), rtol=1e-5, atol=1e-6)
    assert result.arrays["fc3.weight"].numpy().dtype == initial["fc3.weight"].numpy().dtype == np.float32
    assert not np.allclose(result.arrays["fc3.weight"].numpy(), initial["fc3.weight"].numpy())
    # the closed form: W = Sigma~^-1 mu, the shrunk covariance's solve
    shrunk = (1 - 1e-4) * sigma.astype(np.float64) + 1e-4 * np.trace(sigma) / sigma.shape[0] * np.eye(sigma.shape[0])
    np.testing.assert_allclose(result.arrays["fc3.weight"].numpy(), np.linalg.solve(shrunk, mu.T).T, rtol=1e-4, atol=1e-5)
    assert not any(":" in name for name in result.arrays.keys())
    extras = dict(strategy.extra_arrays.items())
    assert sorted(extras) and all(name.startswith("pfedfda:") for name in extras)
    means = next(a.numpy() for n, a in extras.items() if "means" in n)
    assert means.shape[0] == 3 and np.isfinite(means).all() and np.abs(means).sum() > 0  # three classes, estimated


def test_fedbn_hands_back_the_layers_outside_batchnorm_trained_and_batchnorm_as_given():
    initial = whole(BatchNormDropoutNet)
    strategy = FedBN(num_clients=3)
    result = start(strategy, app_for(FedBNClient, BatchNormDropoutNet, head=None), initial)
    loads_strictly(result.arrays, BatchNormDropoutNet)
    norm = [k for k in initial.keys() if k.startswith("bn")]
    assert norm
    for name in norm:
        np.testing.assert_array_equal(result.arrays[name].numpy(), initial[name].numpy())


@pytest.mark.parametrize(("strategy_class", "client_class", "reason"), [
    (FEDORA, FEDORAClient, "FEDORA has no global model"),
    (Local, LocalClient, "local training has no global model"),
])
def test_an_algorithm_without_a_global_model_refuses_evaluate_fn_before_any_message(strategy_class, client_class, reason):
    requests: list = []
    app = app_for(client_class)

    def recording(message, context):
        requests.append(message)
        return app(message, context)

    with pytest.raises(ConfigError, match=f"^{strategy_class.__name__} cannot take evaluate_fn: {reason}"):
        start(strategy_class(num_clients=3), recording, whole(), evaluate_fn=lambda r, a: MetricRecord({}))
    assert requests == []


def test_fedora_hands_back_no_arrays_rather_than_the_untouched_initial_model():
    result = start(FEDORA(num_clients=3), app_for(FEDORAClient), whole(), rounds=1)
    assert len(result.arrays) == 0
    assert result.evaluate_metrics_clientapp  # the clients' own models were evaluated


def test_the_clients_metrics_reach_flowers_result_under_flowers_and_the_users_names():
    """Flower's FedAvg reports each client metric's example-weighted mean under its own name;
    metric_names adds the user's names (advanced-pytorch's client called them eval_acc and
    eval_loss). The suite's summaries stay beside them."""
    strategy = FedRep(num_clients=3, metric_names={"accuracy": "eval_acc", "loss": "eval_loss"})
    result = start(strategy, app_for(FedRepClient), whole())
    for server_round in (1, 2):
        evaluated = result.evaluate_metrics_clientapp[server_round]
        assert evaluated["eval_acc"] == evaluated["accuracy"] == evaluated["accuracy_wmean"]
        assert evaluated["eval_loss"] == evaluated["loss"] == evaluated["loss_wmean"]
        assert evaluated["accuracy_min"] <= evaluated["eval_acc"] <= evaluated["accuracy_max"]
        trained = result.train_metrics_clientapp[server_round]
        assert trained["train_loss"] == trained["train_loss_wmean"] and "eval_acc" not in trained


@pytest.mark.parametrize("names", [{"accuracy": 3}, ["accuracy"], {"accuracy": ""}])
def test_metric_names_must_map_names_to_names(names):
    with pytest.raises(ConfigError, match=r"metric_names must map the clients' metric names to yours"):
        FedRep(num_clients=3, metric_names=names)


def feddar_app() -> ClientApp:
    """FedDAR's ClientApp on 3 unequal clients of 2 domains, the QuickNet with head ``fc3``."""
    from flwr_pfl.clients import FedDARClient

    def domain_data(pid: int) -> LocalData:
        n = 24 + 6 * pid
        x, y, d = image_tensors(n + 12, seed=95 + pid)
        return LocalData(train=DataLoader(TensorDataset(x[:n], y[:n], d[:n]), batch_size=8, shuffle=True),
                         test=DataLoader(TensorDataset(x[n:], y[n:], d[n:]), batch_size=12), num_domains=2)

    def build(ctx: Context):
        torch.manual_seed(0)
        return FedDARClient(ctx, QuickNet(), domain_data(int(ctx.node_config["partition-id"])),
                            TrainConfig(optimizer=OptimizerConfig(learning_rate=0.05)), head="fc3")

    return register_handlers(ClientApp(), build)


def test_feddar_takes_the_users_whole_state_dict_and_starts_each_domains_head_as_the_users():
    """The user's Net has one head; FedDAR's clients carry one per domain. The heads of domains
    1..M-1 start as copies of the user's head (as each client starts them), travel apart in
    extra_arrays, and what comes back loads into the user's Net."""
    from flwr_pfl.serverapp import FedDAR

    sent: list = []
    handlers = feddar_app()

    def app(message, ctx):
        if message.metadata.message_type == "train" and not sent:
            sent.append(message.content.array_records["arrays"])
        return handlers(message, ctx)

    initial = whole()
    strategy = FedDAR(num_clients=3)
    result = start(strategy, app, initial, rounds=1)
    loads_strictly(result.arrays)
    assert sorted(strategy.extra_arrays.keys()) == ["extra_heads.0.bias", "extra_heads.0.weight"]
    first = sent[0]
    for name in HEAD:  # round 1 sent domain 1's head as a copy of the user's
        np.testing.assert_array_equal(first[f"extra_heads.0.{name.split('.')[1]}"].numpy(), initial[name].numpy())


def test_a_record_named_as_the_client_names_its_tensors_comes_back_as_the_wire_arrays():
    """initial_arrays under the client's own names (``module.fc1.weight``, a split model's
    state_dict): the arrays are found by name, and what comes back is the wire's arrays under the
    user's names (there is no user's state_dict to fill)."""
    whole_record = whole()
    initial = ArrayRecord({f"module.{k}": v for k, v in whole_record.items()})
    result = start(FedRep(num_clients=3), app_for(FedRepClient), initial, rounds=1)
    assert list(result.arrays.keys()) == [k for k in whole_record.keys() if k not in HEAD]


class CopyingLoop(PFedFDA):
    """A subclass whose own round loop hands each round a copy of the last arrays (a new record,
    as a user's loop that edits them does), not the record the strategy returned."""

    def start(self, grid, initial_arrays, num_rounds=3, timeout=3600, train_config=None, evaluate_config=None, evaluate_fn=None):
        self.sent_statistics, self.aggregated_statistics = [], []
        arrays = initial_arrays
        for server_round in range(1, num_rounds + 1):
            messages_ = list(self.configure_train(server_round, arrays, train_config or ConfigRecord(), grid))
            self.sent_statistics.append({k: v.numpy() for k, v in messages_[0].content.array_records["arrays"].items()
                                         if k.startswith("pfedfda:")})
            returned, _ = self.aggregate_train(server_round, grid.send_and_receive(messages_, timeout=timeout))
            self.aggregated_statistics.append({k: v.numpy() for k, v in self.extra_arrays.items()})
            arrays = ArrayRecord({k: Array(v.numpy().copy()) for k, v in returned.items()})
        return arrays


def test_a_loop_that_hands_back_a_copy_keeps_the_aggregated_statistics():
    """pFedFDA's statistics have no place in the user's record: a copy handed back takes them
    from the round before (the aggregate), not from a node's initial arrays."""
    strategy = CopyingLoop(num_clients=3, num_rounds=2)
    strategy.start(InProcessGrid(app_for(PFedFDAClient), 3, {}), whole(), num_rounds=2, timeout=60)  # type: ignore[arg-type]
    first, second = strategy.sent_statistics
    assert first.keys() == second.keys() == strategy.aggregated_statistics[0].keys() and first
    for name, aggregate in strategy.aggregated_statistics[0].items():  # round 2 sent round 1's aggregate
        np.testing.assert_array_equal(second[name], aggregate)
    assert any(not np.array_equal(first[k], second[k]) for k in first)


def test_an_evaluation_of_a_copy_sends_the_aggregated_domain_heads():
    """A loop of the user's own evaluates a copy of the record FedDAR handed back (the user's
    model: one head): the heads of domains 1..M-1, which the copy cannot hold, are the round's
    aggregate (``extra_arrays``), not copies of the user's head."""
    from flwr_pfl.serverapp import FedDAR

    initial = whole()
    strategy = FedDAR(num_clients=3)
    grid = InProcessGrid(feddar_app(), 3, {})  # type: ignore[arg-type]
    sent = list(strategy.configure_train(1, initial, ConfigRecord(), grid))
    returned, _ = strategy.aggregate_train(1, grid.send_and_receive(sent, timeout=60))
    copy = ArrayRecord({k: Array(v.numpy().copy()) for k, v in returned.items()})
    evaluate = list(strategy.configure_evaluate(1, copy, ConfigRecord(), grid))
    arrays = evaluate[0].content.array_records["arrays"]
    heads = dict(strategy.extra_arrays.items())
    assert sorted(heads) == ["extra_heads.0.bias", "extra_heads.0.weight"]
    for name, head in heads.items():
        np.testing.assert_array_equal(arrays[name].numpy(), head.numpy())
    assert not np.array_equal(heads["extra_heads.0.weight"].numpy(), initial["fc3.weight"].numpy())
