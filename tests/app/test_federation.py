"""``num-clients`` follows the federation unless set: 0 means the federation's size (each client's
``num-partitions``, which the server asks a node for), and a set value that disagrees stops the
run before training with a message naming both numbers. Slow: a bare ``flwr run .``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fakes import tiny_model
from flwr_pfl.app import launch
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.client_app import node_partition
from flwr_pfl.app.config import RunConfig, parse_experiment
from flwr_pfl.app.inprocess import InProcessGrid, run_inprocess
from flwr_pfl.app.node_client import NodeClient
from flwr_pfl.app.nodes import ask_a_node, resolve_num_clients, wait_for_nodes
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients import FedAvgClient, LocalData
from flwr_pfl.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, dataset: str, **extra) -> dict:
    return {"dataset": dataset, "model": "mlp", "num-server-rounds": 2, "output-dir": str(tmp_path),
            "run-name": "run", "wait-timeout": 5.0, **extra}


def test_num_clients_defaults_to_the_federations_size():
    assert RunConfig().num_clients == 0
    assert parse_experiment({"num-clients": 0, "fraction-fit": 0.01}).run.num_clients == 0  # checked once resolved
    with pytest.raises(ConfigError, match="num-clients=-1"):
        parse_experiment({"num-clients": -1})
    with pytest.raises(ConfigError, match="fraction-fit=0.1 samples no client out of num-clients=5"):
        parse_experiment({"fraction-fit": 0.1}).with_num_clients(5)


def test_a_client_takes_its_partitions_from_the_node_unless_num_clients_is_set():
    def context(num_partitions: int) -> Context:
        return Context(run_id=1, node_id=1, node_config={"partition-id": 2, "num-partitions": num_partitions},
                       state=RecordDict(), run_config={})

    assert node_partition(context(7), parse_experiment({})) == (2, 7)
    assert node_partition(context(7), parse_experiment({"num-clients": 7})) == (2, 7)
    with pytest.raises(ConfigError, match="num-partitions=7 but num-clients=3"):
        node_partition(context(7), parse_experiment({"num-clients": 3}))


def test_the_run_takes_the_federations_size(tmp_path, blobs_dataset):
    """num-clients = 0 on 5 nodes: a 5-client experiment (config, partitions, every round)."""
    run_inprocess(server_app, client_app, 5, config(tmp_path, blobs_dataset))
    out = tmp_path / "run"
    assert json.loads((out / "config.json").read_text())["num-clients"] == 5
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["num_clients"] for r in rows if r["phase"] == "evaluate"] == [5.0, 5.0]
    assert sorted(c["partition_id"] for c in json.loads((out / "clients.json").read_text())) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("num_clients", "nodes"), [(4, 3), (2, 3)])
def test_a_set_num_clients_that_disagrees_stops_the_run_before_training(tmp_path, blobs_dataset, num_clients, nodes):
    with pytest.raises(ConfigError, match=f"num-clients={num_clients} but the federation has num-partitions={nodes}"):
        run_inprocess(server_app, client_app, nodes, config(tmp_path, blobs_dataset, **{"num-clients": num_clients}))
    assert not (tmp_path / "run").exists()  # nothing was written, nothing trained


def _node_client_app(built: list[int]) -> ClientApp:
    """The app's node client around a plain FedAvg client; ``built`` counts the clients built."""
    x, y = torch.randn(12, 5), torch.arange(12) % 3
    data = LocalData(train=DataLoader(TensorDataset(x, y), batch_size=4), test=DataLoader(TensorDataset(x, y), batch_size=4))

    def build(context: Context) -> FedAvgClient:
        built.append(int(context.node_config["partition-id"]))
        return FedAvgClient(context, tiny_model(), data)

    return ClientApp(client_fn=lambda context: NodeClient(context, build).to_client())


def test_the_server_asks_a_node_for_the_federations_size_without_building_a_client():
    built: list[int] = []
    grid = InProcessGrid(_node_client_app(built), 5, {})
    assert resolve_num_clients(grid, 0, 1.0) == 5
    assert resolve_num_clients(grid, 5, 1.0) == 5
    with pytest.raises(ConfigError, match="num-clients=4 but the federation has num-partitions=5"):
        resolve_num_clients(grid, 4, 1.0)
    assert built == []  # answered from the node config alone
    assert ask_a_node(grid, {}, 1.0) == {"partition_id": 0} and built == [0]  # other queries: the client's


def test_a_suite_client_outside_the_app_answers_the_federations_size_too():
    x, y = torch.randn(12, 5), torch.arange(12) % 3
    data = LocalData(train=DataLoader(TensorDataset(x, y), batch_size=4), test=DataLoader(TensorDataset(x, y), batch_size=4))
    app = ClientApp(client_fn=lambda context: FedAvgClient(context, tiny_model(), data).to_client())
    grid = InProcessGrid(app, 3, {})
    assert resolve_num_clients(grid, 0, 1.0) == 3
    with pytest.raises(ConfigError, match="num-clients=2 but the federation has num-partitions=3"):
        resolve_num_clients(grid, 2, 1.0)


def test_a_node_without_num_partitions_is_reported():
    grid = InProcessGrid(_node_client_app([]), 2, {})
    for context in grid.contexts.values():
        context.node_config = {"partition-id": context.node_config["partition-id"]}
    with pytest.raises(RuntimeError, match="num-clients=0 .* does not say its num-partitions; start SuperNodes"):
        resolve_num_clients(grid, 0, 1.0)
    assert resolve_num_clients(grid, 2, 1.0) == 2  # a set num-clients has nothing to be checked against


def test_the_server_waits_for_a_node_then_gives_up_with_a_message():
    with pytest.raises(RuntimeError, match="no node connected within 0 s"):
        wait_for_nodes(InProcessGrid(_node_client_app([]), 0, {}), 0.3)


@pytest.mark.slow
def test_a_bare_flwr_run_completes_on_flowers_default_federation(tmp_path, data_dir):
    """``flwr run .`` as the README types it (runtime dependency installation off, overrides in
    --run-config, no --federation-config): Flower's default federation of 2 SuperNodes, so
    2 clients. A private Flower home and port; the SuperLink is stopped afterwards."""
    flwr = launch.flwr_executable()
    env = launch.flwr_env(tmp_path / "flwr-home", 39591, flwr)
    overrides = {"data-dir": str(data_dir), "output-dir": str(tmp_path), "run-name": "bare",
                 "model": "mlp", "max-samples": 600, "num-server-rounds": 2}
    pairs = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items())
    try:
        result = subprocess.run([str(flwr), "run", ".", "--stream", "--run-config", pairs],
                                cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        status = launch.last_run_status(env, flwr)
    finally:
        launch.stop_superlink(tmp_path / "flwr-home")
    assert result.returncode == 0 and status == "finished:completed", (status, result.stdout[-3000:] + result.stderr[-3000:])
    out = tmp_path / "bare"
    assert json.loads((out / "config.json").read_text())["num-clients"] == 2
    evaluations = [r for r in json.loads((out / "metrics.json").read_text()) if r["phase"] == "evaluate"]
    assert [r["num_clients"] for r in evaluations] == [2.0, 2.0]
    assert (out / "model.pt").exists()
