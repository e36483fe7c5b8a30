"""The ClientApp that ``flwr run .`` starts: build the configured algorithm's client for a node.

It answers both flavours of the app (run-config key ``api``): the legacy messages of the
NumPyClient flavour through ``client_fn``, and the Message-API messages of the ``message``
flavour through the handlers of :func:`flwr_pfl.clientapp.register_handlers` (on
:data:`message_app`). Flower refuses a ClientApp with both a ``client_fn`` and ``@app.train()``
handlers, so :data:`app` is the ``client_fn`` app with a mod that hands Message-API messages
(a ``query``, or a request with a ``"config"`` record, which legacy messages never have) to
:data:`message_app`. Both build the same client (:class:`~flwr_pfl.app.node_client.NodeClient`).

Flower calls the app once per message. What does not change between messages (the parsed run
config, the node's data, an initialised model) is built once per process and reused
(:mod:`flwr_pfl.app.client_cache`); a reused model is reset to its freshly built state, so every
message computes exactly what it would with everything built anew. A node given ``state-dir`` in
its node config keeps its ``context.state`` on disk too (:mod:`flwr_pfl.app.node_state`). In a
run with ``secure-aggregation``, Flower's ``secaggplus_mod`` masks the train replies
(:func:`~flwr_pfl.app.secagg.secagg_client_mod`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from flwr.app import Context, Message
from flwr.client import Client, ClientApp
from flwr.clientapp.typing import ClientAppCallable

from flwr_pfl import messages
from flwr_pfl.clientapp import register_handlers

from flwr_pfl.app.client_cache import ClientCache
from flwr_pfl.app.config import Experiment
from flwr_pfl.app.node_client import NodeClient
from flwr_pfl.app.node_settings import NodeSettings, node_label
from flwr_pfl.app.nodes import DESCRIBE_DATA, NODE_ERROR, data_answer
from flwr_pfl.clients.base import NUM_PARTITIONS, Config, LocalData, PFLClient
from flwr_pfl.data.node_files import class_names, load_node_data
from flwr_pfl.app.node_state import persisted, rounds_mod
from flwr_pfl.app.secagg import secagg_client_mod
from flwr_pfl.data.types import ClientData
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import EncoderHeadModel, build_model
from flwr_pfl.training import seeded, set_num_threads

#: this process's parsed configs, clients' data and model pools (one run at a time)
CACHE = ClientCache()


def node_partition(context: Context, experiment: Experiment) -> tuple[int, int]:
    """(partition id, number of partitions) from the node's config, checked against num-clients
    (0: the federation's size, whatever the node config says)."""
    settings = NodeSettings.parse(context.node_config, context.node_id)
    check_federation_size(settings, experiment)
    return settings.partition_id, settings.num_partitions


def check_federation_size(settings: NodeSettings, experiment: Experiment) -> None:
    """ConfigError unless the node's num-partitions equals a set num-clients."""
    if experiment.run.num_clients and settings.num_partitions != experiment.run.num_clients:
        raise ConfigError(
            f"the federation has num-partitions={settings.num_partitions} but num-clients="
            f"{experiment.run.num_clients}; make them equal (simulation: num-supernodes), or set "
            "num-clients=0 to use the federation's size"
        )


def node_data(context: Context, settings: NodeSettings) -> ClientData:
    """The node's data (cached per run): its own files when its node config names them
    (:mod:`flwr_pfl.data.node_files`), else its slice of the run's dataset."""
    run = CACHE.run(context.run_id, context.run_config)
    config = run.experiment.data
    pid, num = settings.partition_id, settings.num_partitions
    if settings.data is None:
        # the simulation's data pipeline (partitioners: extra [datasets]), imported on first use
        # and only here: a node on its own files never needs it
        from flwr_pfl.data.federated import load_client_data

        return run.client_data(pid, num, lambda: load_client_data(config, pid, num))
    spec, who = settings.data, node_label(context.node_id, context.node_config)
    return run.client_data(pid, num, lambda: load_node_data(
        spec, val_fraction=config.val_fraction, test_fraction=config.test_fraction, seed=config.seed, who=who), spec)


def node_answer(context: Context, config: Config) -> Config:
    """This node's answer to the server's federation query (:func:`flwr_pfl.app.nodes.survey_nodes`):
    its partition, the federation's size and, when it trains on its own data or the server asks
    (``describe-data``), what its data looks like. A wrong node setting or unreadable data is
    answered as ``node_error``, so that the server stops the run naming this node."""
    try:
        settings = NodeSettings.parse(context.node_config, context.node_id)
        answer: Config = {"partition_id": settings.partition_id, NUM_PARTITIONS: settings.num_partitions}
        if settings.data is not None or config.get(DESCRIBE_DATA):
            classes = class_names(settings.data) if settings.data is not None else ()
            answer |= data_answer(node_data(context, settings), classes, own=settings.data is not None)
        return answer
    except ConfigError as err:
        return {NODE_ERROR: str(err)}


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
    """The configured algorithm's NumPyClient for this node, with its data and an initial model;
    it trains on the node's ``device`` when its node config sets one.

    Inside a message of :data:`app` the model is leased from this process's pool (and returned
    when the message ends); called directly, the client gets a model of its own.
    """
    run = CACHE.run(context.run_id, context.run_config)
    experiment = run.experiment
    set_num_threads(experiment.run.num_threads)
    settings = NodeSettings.parse(context.node_config, context.node_id)
    check_federation_size(settings, experiment)
    data = node_data(context, settings)
    train_config = experiment.train_config
    if settings.device is not None:
        train_config = replace(train_config, device=settings.device)
    spec = experiment.algorithm
    key = (data.input_shape, data.num_outputs, spec.num_heads(experiment.options, data.num_domains))
    model = CACHE.model(run, key, lambda: new_model(experiment, data))
    # The client's constructor runs under the run's seed too, as it always has.
    with seeded(experiment.run.seed):
        local = LocalData.from_client_data(data, experiment.run.batch_size)
        return spec.client(context, model, local, train_config, **spec.client_kwargs(experiment.options))


def node_client(context: Context) -> NodeClient:
    """The node's client for one message (the algorithm's client is built when needed)."""
    return NodeClient(context, build_client, node_answer)


def client_fn(context: Context) -> Client:
    return node_client(context).to_client()


#: the Message-API handlers (``train``, ``evaluate``, ``query``, ``query.parameters``)
message_app = register_handlers(ClientApp(), node_client)


def is_message_api(message: Message) -> bool:
    """Whether ``message`` is of the Message-API flavour (not a legacy one)."""
    return message.metadata.message_type.split(".")[0] == "query" or messages.CONFIG in message.content


def dispatch(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Mod: Message-API messages to :data:`message_app`, the legacy ones to ``client_fn``."""
    return message_app(message, context) if is_message_api(message) else call_next(message, context)


app = ClientApp(client_fn=client_fn, mods=[rounds_mod, secagg_client_mod, dispatch])


@app.lifespan()
def _one_message(context: Context) -> Iterator[None]:
    """Every message leases its model from the pool and gives it back when done; with the node's
    ``state-dir`` set, a restarted node's state is read back before the message and a changed
    state written after it (:mod:`flwr_pfl.app.node_state`)."""
    with CACHE.message(), persisted(context):
        yield
