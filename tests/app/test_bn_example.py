"""examples/torchvision_bn: torchvision's ResNet-18 (20 BatchNorm layers) in Flower's Message API,
switched to FedRep, pFedFDA and FedBN, run in-process for each: it trains, FedBN's nodes keep
their own BatchNorm layers (statistics included) in ``context.state``, the others share them with
the body, and the final model loads into the user's ResNet-18 strictly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from app.test_examples import load_example
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.clients.fedbn import normalization_keys
from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.training import load_arrays

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchvision_bn"
#: the first BatchNorm layer (after conv1) and the shared convolution before it
BN, CONV = "bn1", "conv1.weight"


@pytest.fixture
def example(monkeypatch, data_dir):
    return load_example(monkeypatch, EXAMPLE, "bnexample", data_dir)


# ResNet-18 on CPU: FedRep's five head epochs and pFedFDA's 512-dimensional statistics (the beta
# search of every fit and evaluation) make their rounds several times as costly as FedBN's
@pytest.mark.parametrize(("algorithm", "rounds"), [
    ("fedbn", 3), ("fedrep", 2), ("pfedfda", 1), pytest.param("pfedfda", 2, marks=pytest.mark.slow),
])
def test_the_bn_example_trains_and_keeps_batchnorm_where_the_algorithm_says(example, monkeypatch, tmp_path, algorithm, rounds):
    client_app, server_app, config = example
    from bnexample.task import make_model

    rows: list[tuple[str, dict]] = []
    monkeypatch.setattr(PFLStrategy, "_notify", lambda self, r, phase, metrics, clients: rows.append((phase, metrics)))
    final = tmp_path / "final_model.pt"
    grid = run_inprocess(server_app, client_app, 4, {**config, "algorithm": algorithm, "num-server-rounds": rounds,
                                                     "max-samples": 400, "final-model": str(final)})
    fits = [m for phase, m in rows if phase == "fit"]
    evaluations = [m for phase, m in rows if phase == "evaluate"]
    assert len(fits) == len(evaluations) == rounds
    assert all(m["num_failures"] == 0 for _, m in rows if "num_failures" in m)
    # it trains: the local loss falls, and the personalized models beat chance (0.1) by far
    if rounds > 1:
        assert fits[-1]["train_loss_wmean"] < fits[0]["train_loss_wmean"], [m["train_loss_wmean"] for m in fits]
    accuracy = [m["accuracy_wmean"] for m in evaluations]
    assert accuracy[-1] > 0.3, accuracy

    # the final model is the user's whole ResNet-18, loadable strictly
    initial = make_model().state_dict()
    saved = torch.load(final, weights_only=True)
    assert list(saved) == list(initial)
    make_model().load_state_dict(saved, strict=True)
    assert not torch.equal(saved[CONV], initial[CONV])  # every algorithm shares (and trains) the convolutions
    norms = normalization_keys(make_model())
    assert len(norms) == 20 * 5  # weight, bias, running mean, running variance, step counter

    contexts = list(grid.contexts.values())
    if algorithm == "fedbn":
        # the BatchNorm layers never leave the nodes: the global model has them as start() was given them
        assert all(torch.equal(saved[k], initial[k]) for k in norms)
        assert not torch.equal(saved["fc.weight"], initial["fc.weight"])  # FedBN shares the head
        personal = []
        for context in contexts:
            arrays = load_arrays(context.state, "fedbn-norms")
            assert arrays is not None and len(arrays) == len(norms)
            layers = dict(zip(norms, arrays))
            assert layers[f"{BN}.num_batches_tracked"] > 0 and np.abs(layers[f"{BN}.running_mean"]).max() > 0
            assert all(np.isfinite(a).all() for a in arrays)
            personal.append(layers[f"{BN}.running_mean"])
        assert not np.allclose(personal[0], personal[1])  # each node's own statistics
    else:
        # the BatchNorm layers are part of the shared body: trained, averaged, statistics included
        assert saved[f"{BN}.num_batches_tracked"] > 0 and saved[f"{BN}.running_mean"].abs().max() > 0
        if algorithm == "fedrep":  # each node keeps its own head, and nothing else
            assert torch.equal(saved["fc.weight"], initial["fc.weight"]) and torch.equal(saved["fc.bias"], initial["fc.bias"])
            for context in contexts:
                head = load_arrays(context.state, "personal")
                assert [a.shape for a in head] == [(10, 512), (10,)] and all(np.isfinite(a).all() for a in head)
                assert load_arrays(context.state, "fedbn-norms") is None
        else:  # pFedFDA: the head of the global statistics
            assert not torch.equal(saved["fc.weight"], initial["fc.weight"]) and torch.isfinite(saved["fc.weight"]).all()
            assert all(len(context.state.keys()) > 0 for context in contexts)


@pytest.mark.parametrize("frozen_norm", ["eval", "train"])
def test_the_bn_example_passes_frozen_norm_to_its_clients(example, frozen_norm):
    _, _, config = example
    from bnexample.client_app import client

    run_config = {**config, "algorithm": "fedrep", "frozen-norm": frozen_norm, "max-samples": 400}
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                      state=RecordDict(), run_config=run_config)
    built = client(context)
    assert built.train_config.frozen_norm == frozen_norm
    assert built.train_config.optimizer.learning_rate == config["lr"]


def test_the_bn_example_refuses_an_unknown_frozen_norm(example):
    _, _, config = example
    from bnexample.client_app import client

    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4},
                      state=RecordDict(), run_config={**config, "frozen-norm": "frozen", "max-samples": 400})
    with pytest.raises(ValueError, match="frozen-norm"):
        client(context)
