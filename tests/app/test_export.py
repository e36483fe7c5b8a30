"""Every run exports its final models: ``model.pt`` (the global model, by state_dict name) and each
personalizing client's own part in ``clients/<partition-id>.pt``. Loaded into a freshly built
model, they give back exactly the loss and accuracy each client reported for the last round, so
a stale, partial or misnamed export fails here. docs/export.md's code runs as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torch import nn

import flwr_pfl.app.server_app as server_app_module
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.client_app import build_client
from flwr_pfl.app.export import EXPORT_KEY, client_export_dir, name_arrays
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import PFLClient
from flwr_pfl.training import group_keys, load_arrays

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"
ROUNDS = 3
#: what each algorithm's clients keep for themselves (the rest export nothing personal)
PERSONAL = {"local": "all", "fedora": "all", "finetune": "all", "fedprox-ft": "all", "fedbabu": "all",
            "fedrep": "heads", "fedper": "heads", "pfedfda": "heads", "lg-fedavg": "body",
            "ditto": "all", "apfl": "all", "per-fedavg": "all", "pfedme": "all",
            "fedrod": "personal head", "fedpac": "heads", "ifca": "all", "fedamp": "all", "pfedhn": "all", "fedfomo": "all", "knn-per": "datastore"}  # fedrod: its own keys, fedrod:personal_head.<name>
#: what model.pt holds: the whole model unless listed (None: no global model, no model.pt)
GLOBAL = {"local": None, "fedora": None, "fedamp": None, "pfedhn": None, "fedfomo": None, "fedrep": "body", "fedper": "body", "pfedfda": "body", "lg-fedavg": "heads"}
DOMAIN_FAMILY = ("feddar", "feddar-sa", "feddar-wa", "separate-fedavg", "fedavg-rw", "fedavg-mh")
TARGET_FAMILY = ("fedgp", "fedda", "target-only", "source-only")


@pytest.fixture(scope="module")
def dataset() -> str:
    """'test-export-domains': 4 classes x 3 domains (a shift per domain), 1,440 vectors."""
    from flwr_pfl.data.registry import DatasetPool, register_dataset

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(7)
        centers, offsets = 1.2 * torch.randn(4, 10, generator=g), torch.randn(3, 10, generator=g)
        y, d = torch.arange(1440) % 4, (torch.arange(1440) // 4) % 3
        x = centers[y] + offsets[d] + torch.randn(1440, 10, generator=g)
        return DatasetPool(x=x, y=y, domain=d, num_classes=4, num_domains=3)

    register_dataset("test-export-domains", build, replace=True)
    return "test-export-domains"


def run_config(tmp_path: Path, dataset: str, algorithm: str) -> dict:
    """Six clients, half of them training per round (so some clients' personal parts are older
    than the last round), all evaluated in the last round; unequal client sizes (Dirichlet)."""
    cfg = {
        "algorithm": algorithm, "dataset": dataset, "model": "mlp", "num-clients": 6, "num-server-rounds": ROUNDS,
        "fraction-fit": 0.5, "fraction-evaluate": 1.0, "learning-rate": 0.05, "batch-size": 16,
        "partitioner": "dirichlet", "dirichlet-alpha": 1.0, "test-fraction": 0.25, "seed": 5,
        "output-dir": str(tmp_path), "run-name": algorithm, "finetune.epochs": 2, "fedrep.head-epochs": 2,
    }
    if algorithm == "fmtl":
        cfg |= {"partitioner": "pathological", "classes-per-client": 2, "fmtl.t1-rounds": 2}
    if algorithm in DOMAIN_FAMILY:
        cfg |= {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 80, "feddar.head-epochs": 1}
    if algorithm in TARGET_FAMILY:  # the paper's protocol: every client trains
        cfg |= {"partitioner": "one-domain-per-client", "num-clients": 3, "fraction-fit": 1.0,
                f"{algorithm}.target-train-samples": 16, f"{algorithm}.target-batch-size": 4}
    return cfg


def fresh_client(context: Context) -> PFLClient:
    """The node's client as the app builds it, with a freshly initialised model and no state."""
    return build_client(Context(run_id=1, node_id=context.node_id, node_config=context.node_config,
                                state=RecordDict(), run_config=context.run_config))


def evaluate_exported(client: PFLClient, algorithm: str, state: dict[str, torch.Tensor]):
    """Load ``state`` (global + personal) strictly into the client's fresh model and evaluate it
    on the client's test split as the run's last evaluation did."""
    if algorithm == "separate-fedavg":  # one whole model per domain, names models.<m>.<key>
        holder = nn.Module()
        holder.models = nn.ModuleList(client.models)  # type: ignore[attr-defined]
        holder.load_state_dict(state, strict=True)
        return client.local_evaluate({})
    if algorithm == "fedrod":  # the personal head sits beside the model: fedrod:personal_head.<name>
        client.model.load_state_dict({k: v for k, v in state.items() if ":" not in k}, strict=True)
        client.load_personal_state(state)
        return client.local_evaluate({})
    if algorithm == "knn-per":  # the datastore and lambda sit beside the model: knn-per:<what>
        client.model.load_state_dict({k: v for k, v in state.items() if ":" not in k}, strict=True)
        return client.evaluate_personal(state)
    client.model.load_state_dict(state, strict=True)
    return client.evaluate_on(client.data.test)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_exported_models_are_the_final_ones(tmp_path, dataset, algorithm, monkeypatch):
    built = []
    original = server_app_module.build_strategy
    monkeypatch.setattr(server_app_module, "build_strategy", lambda e, w=None, k=None: built.append(original(e, w, k)) or built[-1])
    cfg = run_config(tmp_path, dataset, algorithm)
    grid = run_inprocess(server_app_module.app, client_app, cfg["num-clients"], cfg)
    out, strategy = tmp_path / algorithm, built[0]
    reported = {row["partition_id"]: row for row in json.loads((out / "clients.json").read_text())}
    assert {row["round"] for row in reported.values()} == {ROUNDS}

    # the global model: the strategy's final arrays, by name, with the right dtypes
    probe = fresh_client(next(iter(grid.contexts.values())))
    global_state: dict[str, torch.Tensor] = {}
    if GLOBAL.get(algorithm, "all") is None:
        assert not (out / "model.pt").exists()
    else:
        global_state = torch.load(out / "model.pt", weights_only=True)
        extras = torch.load(out / "extras.pt", weights_only=True) if (out / "extras.pt").exists() else {}
        names = probe.wire_names()
        assert list(global_state) + list(extras) == names
        assert len(names) == len(strategy.global_arrays)
        for name, array in zip(names, strategy.global_arrays):
            tensor = global_state.get(name, extras.get(name))
            assert tensor.dtype == torch.from_numpy(np.asarray(array)).dtype and np.array_equal(tensor.numpy(), array), name
        if algorithm != "separate-fedavg":
            assert list(global_state) == group_keys(probe.model, GLOBAL.get(algorithm, "all"))
        assert (algorithm in ("pfedfda", "fedpac", "ifca")) == bool(extras)  # ifca: clusters 1 .. k-1

    # each client's personal part, and the evaluation it reproduces
    for context in grid.contexts.values():
        pid = int(context.node_config["partition-id"])
        path = out / "clients" / f"{pid}.pt"
        if algorithm not in PERSONAL:
            assert not path.exists()
            personal: dict[str, torch.Tensor] = {}
        else:
            personal = torch.load(path, weights_only=True)
            client = fresh_client(context)
            if algorithm == "fedrod":
                assert list(personal) == list(client.personal_state())
            elif algorithm == "knn-per":  # the last evaluation's datastore and lambda
                assert list(personal) == ["knn-per:features", "knn-per:labels", "knn-per:lambda"]
            else:
                assert list(personal) == group_keys(client.model, PERSONAL[algorithm])
            record = json.loads((out / "clients" / f"{pid}.json").read_text())
            assert record["round"] == ROUNDS and record["keys"] == list(personal)
            assert record["metrics"]["loss"] == reported[pid]["loss"]
            if algorithm in ("local", "fedora", "fedrep", "fedper", "lg-fedavg", "fedrod"):  # the part kept across rounds
                stored = load_arrays(context.state, "fedrod-personal-head" if algorithm == "fedrod" else PFLClient.PERSONAL_KEY)
                if stored is None and algorithm == "fedrod":  # never trained: the last received generic head
                    stored = [global_state[k].numpy() for k in group_keys(client.model, "heads")]
                if stored is None:  # never sampled to train: its part is still the initial one
                    stored = [t.numpy() for t in client.personal_state().values()]
                assert all(np.array_equal(t.numpy(), a) for t, a in zip(personal.values(), stored, strict=True))
        client = fresh_client(context)
        result = evaluate_exported(client, algorithm, {**global_state, **personal})
        assert result.loss == reported[pid]["loss"], (pid, result.loss, reported[pid]["loss"])
        assert result.accuracy == reported[pid]["accuracy"]
    if algorithm in ("finetune", "fedprox-ft", "fedbabu"):  # the fine-tuned copy, not the global model, was exported
        tuned = torch.load(out / "clients" / "0.pt", weights_only=True)
        assert any(not torch.equal(tuned[k], global_state[k]) for k in tuned)


def test_names_must_fit_the_arrays():
    arrays = [np.zeros((2, 3)), np.zeros(2)]
    assert list(name_arrays(arrays, [["a.weight", [2, 3]], ["a.bias", [2]]])) == ["a.weight", "a.bias"]
    with pytest.raises(ValueError, match="2 global arrays but the clients' wire layout names 1"):
        name_arrays(arrays, [["a.weight", [2, 3]]])
    with pytest.raises(ValueError, match="'a.bias' has shape \\(2,\\), the wire layout says \\(3,\\)"):
        name_arrays(arrays, [["a.weight", [2, 3]], ["a.bias", [3]]])


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/abs/x"])
def test_a_client_writes_only_under_its_own_output_dir(tmp_path, name):
    with pytest.raises(ValueError, match=EXPORT_KEY):
        client_export_dir({"output-dir": str(tmp_path)}, name)
    assert client_export_dir({"output-dir": str(tmp_path)}, "run-1") == tmp_path.resolve() / "run-1" / "clients"


def docs_example() -> str:
    match = re.search(r"<!-- export-example -->\s*```python\n(.*?)```", DOCS.read_text(), re.S)
    assert match, "docs/export.md has no marked example"
    return match.group(1)


def test_the_docs_example_loads_the_models_and_reproduces_the_run(tmp_path, blobs_dataset):
    """docs/export.md's functions, on a FedAvg run and a FedRep run: the loaded models give every
    client's reported accuracy, and the FedAvg model the run's final weighted-mean accuracy."""
    namespace: dict = {}
    exec(compile(docs_example(), str(DOCS), "exec"), namespace)
    for algorithm in ("fedavg", "fedrep"):
        cfg = {"algorithm": algorithm, "dataset": blobs_dataset, "model": "mlp", "num-clients": 4, "num-server-rounds": 2,
               "partitioner": "dirichlet", "dirichlet-alpha": 0.5, "output-dir": str(tmp_path), "run-name": algorithm}
        run_inprocess(server_app_module.app, client_app, 4, cfg)
        run_dir = tmp_path / algorithm
        reported = json.loads((run_dir / "clients.json").read_text())
        correct = total = 0
        for row in reported:
            model, test_loader = namespace["load_client_model"](run_dir, row["partition_id"])
            accuracy, n = namespace["accuracy"](model, test_loader)
            assert accuracy == pytest.approx(row["accuracy"], abs=1e-12) and n == row["num_examples"]
            correct, total = correct + accuracy * n, total + n
        final = [r for r in json.loads((run_dir / "metrics.json").read_text()) if r["phase"] == "evaluate"][-1]
        assert correct / total == pytest.approx(final["accuracy_wmean"], abs=1e-12)
