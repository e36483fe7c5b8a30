"""The ClientApp that ``flwr run .`` starts: build the configured algorithm's client for a node."""

from __future__ import annotations

from flwr.app import Context
from flwr.client import Client, ClientApp

from flwr_pfl.app.config import Experiment, parse_experiment
from flwr_pfl.app.node_client import NodeClient
from flwr_pfl.clients.base import LocalData, PFLClient
from flwr_pfl.data.federated import load_client_data
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import build_model
from flwr_pfl.training import seeded, set_num_threads


def node_partition(context: Context, experiment: Experiment) -> tuple[int, int]:
    """(partition id, number of partitions) from the node's config, checked against num-clients
    (0: the federation's size, whatever the node config says)."""
    try:
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
    except KeyError as err:
        raise ConfigError(
            f"node config lacks {err.args[0]!r}; start SuperNodes with "
            "--node-config \"partition-id=<i> num-partitions=<n>\""
        ) from None
    if experiment.run.num_clients and num_partitions != experiment.run.num_clients:
        raise ConfigError(
            f"the federation has num-partitions={num_partitions} but num-clients="
            f"{experiment.run.num_clients}; make them equal (simulation: num-supernodes), or set "
            "num-clients=0 to use the federation's size"
        )
    return partition_id, num_partitions


def build_client(context: Context) -> PFLClient:
    """The configured algorithm's NumPyClient for this node, with its data and a fresh model."""
    experiment = parse_experiment(context.run_config)
    set_num_threads(experiment.run.num_threads)
    partition_id, num_partitions = node_partition(context, experiment)
    data = load_client_data(experiment.data, partition_id, num_partitions)
    # The same seed on every client: identical initial models, whichever client the server
    # asks for the initial global parameters. Scoped, so that building a client leaves no
    # random state behind for the server or the next client in this process.
    spec = experiment.algorithm
    with seeded(experiment.run.seed):
        model = build_model(
            experiment.run.model,
            data.input_shape,
            data.num_outputs,
            num_heads=spec.num_heads(experiment.options, data.num_domains),
            feature_dim=experiment.run.feature_dim,
        )
        local = LocalData.from_client_data(data, experiment.run.batch_size)
        return spec.client(context, model, local, experiment.train_config, **spec.client_kwargs(experiment.options))


def client_fn(context: Context) -> Client:
    return NodeClient(context, build_client).to_client()


app = ClientApp(client_fn=client_fn)
