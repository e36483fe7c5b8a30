"""The ClientApp that ``flwr run .`` starts: build the configured algorithm's client for a node.

Flower calls the app once per message. What does not change between messages (the parsed run
config, the node's data, an initialised model) is built once per process and reused
(:mod:`flwr_pfl.app.client_cache`); a reused model is reset to its freshly built state, so every
message computes exactly what it would with everything built anew.
"""

from __future__ import annotations

from collections.abc import Iterator

from flwr.app import Context
from flwr.client import Client, ClientApp

from flwr_pfl.app.client_cache import ClientCache
from flwr_pfl.app.config import Experiment
from flwr_pfl.app.node_client import NodeClient
from flwr_pfl.clients.base import LocalData, PFLClient
from flwr_pfl.data.types import ClientData
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import EncoderHeadModel, build_model
from flwr_pfl.training import seeded, set_num_threads

#: this process's parsed configs, clients' data and model pools (one run at a time)
CACHE = ClientCache()


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


def new_model(experiment: Experiment, data: ClientData) -> EncoderHeadModel:
    """The run's initial model for ``data``.

    Built under the run's seed: every client starts from identical weights, whichever client the
    server asks for the initial global parameters. Scoped, so that building a model leaves no
    random state behind for the server or the next client in this process.
    """
    with seeded(experiment.run.seed):
        return build_model(
            experiment.run.model,
            data.input_shape,
            data.num_outputs,
            num_heads=experiment.algorithm.num_heads(experiment.options, data.num_domains),
            feature_dim=experiment.run.feature_dim,
        )


def build_client(context: Context) -> PFLClient:
    """The configured algorithm's NumPyClient for this node, with its data and an initial model.

    Inside a message of :data:`app` the model is leased from this process's pool (and returned
    when the message ends); called directly, the client gets a model of its own.
    """
    from flwr_pfl.data.federated import load_client_data  # the data pipeline, on first use

    run = CACHE.run(context.run_id, context.run_config)
    experiment = run.experiment
    set_num_threads(experiment.run.num_threads)
    partition_id, num_partitions = node_partition(context, experiment)
    data = run.client_data(partition_id, num_partitions,
                           lambda: load_client_data(experiment.data, partition_id, num_partitions))
    spec = experiment.algorithm
    key = (data.input_shape, data.num_outputs, spec.num_heads(experiment.options, data.num_domains))
    model = CACHE.model(run, key, lambda: new_model(experiment, data))
    # The client's constructor runs under the run's seed too, as it always has.
    with seeded(experiment.run.seed):
        local = LocalData.from_client_data(data, experiment.run.batch_size)
        return spec.client(context, model, local, experiment.train_config, **spec.client_kwargs(experiment.options))


def client_fn(context: Context) -> Client:
    return NodeClient(context, build_client).to_client()


app = ClientApp(client_fn=client_fn)


@app.lifespan()
def _one_message(context: Context) -> Iterator[None]:
    """Every message leases its model from the pool and gives it back when done."""
    with CACHE.message():
        yield
