"""examples/advanced_pytorch: Flower's advanced-pytorch example (a subclassed strategy running its
own round loop, server-side evaluation that loads the arrays into the user's ``Net``, an ``lr``
schedule, best-model saving, results.json, W&B behind ``use-wandb``) switched to FedRep, pFedFDA
and FedPer, run in-process for each; slow: one run under ``flwr run``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from app.test_examples import flwr_run_example, load_example
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.training import load_arrays, loops

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "advanced_pytorch"
ROUNDS = 3
LR = 0.05  # Flower's 0.1 with momentum 0.9 is too much for pFedFDA on a few hundred images


@pytest.fixture
def example(monkeypatch, data_dir):
    return load_example(monkeypatch, EXAMPLE, "advancedexample", data_dir)


def small(config: dict, tmp_path: Path, algorithm: str) -> dict:
    """The example's run config for a short run: every client each round, 1200 images."""
    return {**config, "algorithm": algorithm, "num-server-rounds": ROUNDS, "lr": LR, "fraction-train": 1.0,
            "fraction-evaluate": 1.0, "max-samples": 1200, "central-samples": 200,
            "outputs-dir": str(tmp_path / "outputs"), "final-model": str(tmp_path / "final_model.pt")}


def initial_net() -> torch.nn.Module:
    """The example's initial ``Net``, as its server and clients build it (seed 0)."""
    from advancedexample.task import Net

    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("algorithm", ["fedrep", "pfedfda", "fedper"])
def test_the_advanced_example_runs_its_own_loop_schedule_and_server_side_evaluation(example, monkeypatch, tmp_path, algorithm):
    client_app, server_app, config = example
    from advancedexample import server_app as server_module
    from advancedexample.strategy import CustomStrategy
    from advancedexample.task import Net

    monkeypatch.setattr(CustomStrategy, "lr_halving_round", 2)  # Flower's schedule, reached in a short run
    # the learning rate of every optimizer the clients build
    rates: list[float] = []
    make = loops.make_optimizer
    monkeypatch.setattr(loops, "make_optimizer", lambda params, cfg: rates.append(cfg.learning_rate) or make(params, cfg))
    # the example's own evaluate_fn (a strict load_state_dict into Net), with the rounds and names it got
    calls: list[tuple[int, list[str]]] = []
    original = server_module.get_global_evaluate_fn

    def recording(**kwargs):
        evaluate = original(**kwargs)

        def run(server_round, arrays):
            metrics = evaluate(server_round, arrays)
            calls.append((server_round, list(arrays.keys())))
            return metrics

        return run

    monkeypatch.setattr(server_module, "get_global_evaluate_fn", recording)
    grid = run_inprocess(server_app, client_app, 4, small(config, tmp_path, algorithm))

    keys = list(Net().state_dict())
    assert [r for r, _ in calls] == list(range(ROUNDS + 1))
    assert all(names == keys for _, names in calls)

    (run,) = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert json.loads((run / "run_config.json").read_text())["algorithm"] == algorithm
    results = json.loads((run / "results.json").read_text())
    assert [r["round"] for r in results] == list(range(1, ROUNDS + 1))
    for r in results:
        server, clients = r["evaluate_metrics_serverapp"], r["evaluate_metrics_clientapp"]
        assert 0.0 <= server["accuracy"] <= 1.0 and server["loss"] > 0
        assert clients["eval_acc"] == clients["accuracy"] and clients["eval_loss"] == clients["loss"]  # Flower's names
        assert clients["num_failures"] == 0 and r["train_metrics"]["train_loss"] > 0
    # the personalized models learn: ten classes (chance 0.1); measured about 0.55-0.67 in round 3
    accuracy = [r["evaluate_metrics_clientapp"]["eval_acc"] for r in results]
    assert accuracy[-1] > accuracy[0] and accuracy[-1] > 0.35, accuracy

    # Flower's schedule reached the clients' optimizers: lr in round 1, halved from round 2 on
    assert rates and rates[0] == LR and set(rates) == {LR, LR / 2}
    assert rates == sorted(rates, reverse=True)

    # the best models and the final model load into the user's Net, strictly
    best = sorted(run.glob("model_state_acc_*_round_*.pth"))
    assert best
    for path in best:
        Net().load_state_dict(torch.load(path, weights_only=True), strict=True)
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    assert list(final) == keys
    Net().load_state_dict(final, strict=True)
    initial = initial_net().state_dict()
    assert not torch.equal(final["conv1.weight"], initial["conv1.weight"])  # the shared body trained
    if algorithm == "pfedfda":  # the head of the global statistics
        assert not torch.equal(final["fc2.weight"], initial["fc2.weight"]) and torch.isfinite(final["fc2.weight"]).all()
    else:  # each client's head stays on its node: the global Net keeps the head it was given
        assert torch.equal(final["fc2.weight"], initial["fc2.weight"]) and torch.equal(final["fc2.bias"], initial["fc2.bias"])

    # each node kept its own part in context.state (FedRep's and FedPer's head: Net's fc2)
    for context in grid.contexts.values():
        assert len(context.state.keys()) > 0
        if algorithm != "pfedfda":
            head = load_arrays(context.state, "personal")
            assert [a.shape for a in head] == [(10, 128), (10,)] and all(np.isfinite(a).all() for a in head)


def test_the_advanced_example_logs_to_wandb_only_when_asked(example, monkeypatch, tmp_path):
    """``use-wandb = true``: Flower's ``wandb.init`` once and ``wandb.log`` of each round's train,
    client-evaluation and server-evaluation metrics (a stand-in module: the test is offline)."""
    client_app, server_app, config = example
    calls: list[tuple[str, object]] = []
    wandb = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)),
                                  log=lambda metrics, step: calls.append(("log", (step, sorted(metrics)))))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_inprocess(server_app, client_app, 4, {**small(config, tmp_path, "fedper"), "num-server-rounds": 2, "use-wandb": True})
    assert calls[0][0] == "init" and calls[0][1]["project"] == "FLOWER-advanced-pytorch"
    steps = [step for kind, (step, _) in calls[1:]]
    assert [kind for kind, _ in calls[1:]] == ["log"] * 6 and steps == [1, 1, 1, 2, 2, 2]
    assert all("accuracy" in names for kind, (step, names) in calls[1:][2::3])  # the server-side evaluation's

    calls.clear()  # off (the default): wandb is not even imported
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would raise
    run_inprocess(server_app, client_app, 4, {**small(config, tmp_path / "off", "fedper"), "num-server-rounds": 1})
    assert calls == []


@pytest.mark.slow
def test_the_advanced_example_runs_under_flwr_run(monkeypatch, tmp_path, data_dir):
    """``flwr run`` on the example's directory (Flower's default federation), FedRep."""
    final = tmp_path / "final_model.pt"
    pairs = (f"algorithm='fedrep' num-server-rounds=2 max-samples=600 central-samples=200 data-dir='{data_dir}' "
             f"outputs-dir='{tmp_path / 'outputs'}' final-model='{final}'")
    flwr_run_example(EXAMPLE, pairs, tmp_path, 39611)
    load_example(monkeypatch, EXAMPLE, "advancedexample", data_dir)
    saved = torch.load(final, weights_only=True)
    net = initial_net()
    assert list(saved) == list(net.state_dict())
    net.load_state_dict(saved, strict=True)
    (run,) = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert [r["round"] for r in json.loads((run / "results.json").read_text())] == [1, 2]
