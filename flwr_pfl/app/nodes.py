"""Questions the ServerApp asks a connected node outside the strategy's rounds.

Two facts the server cannot know by itself come from the nodes, through the ``get_properties``
exchange the strategies use: the federation's size, which ``num-clients = 0`` stands for and a
set ``num-clients`` must equal (each node knows ``num-partitions`` from its node config; every
suite client answers :data:`~flwr_pfl.clients.base.FEDERATION_QUERY`, the app's
:class:`~flwr_pfl.app.node_client.NodeClient` without even building one); and the names of the
arrays on the wire, for the model export (:mod:`flwr_pfl.app.export`). A node is asked only after
it has registered: in Flower's simulation the ServerApp starts while the engine is still
registering the simulated nodes, and in a deployment nodes connect when they are started.
"""

from __future__ import annotations

import time
from logging import WARNING

from flwr.common import GetPropertiesIns, log
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid

from flwr_pfl.clients.base import FEDERATION_QUERY, NUM_PARTITIONS, Config
from flwr_pfl.errors import ConfigError

#: seconds between two looks for registered nodes
POLL_SECONDS = 0.2


def wait_for_nodes(grid: Grid, timeout: float) -> list[int]:
    """The ids of the registered nodes (sorted), once there is at least one.

    Raises:
        RuntimeError: no node registered within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if nodes:
            return nodes
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"no node connected within {timeout:.0f} s (wait-timeout); start the SuperNodes, or in "
                "simulation check the federation's num-supernodes"
            )
        time.sleep(POLL_SECONDS)


def ask_a_node(grid: Grid, config: Config, timeout: float) -> Config:
    """One node's ``get_properties(config)`` answer; the registered nodes are asked in turn
    until one answers (a node may fail on its own, e.g. on its data).

    Raises:
        RuntimeError: no node answered (naming each node's error).
    """
    errors = []
    for node_id in wait_for_nodes(grid, timeout):
        proxy = GridClientProxy(node_id=node_id, grid=grid, run_id=grid.run.run_id)
        try:
            return dict(proxy.get_properties(GetPropertiesIns(dict(config)), timeout=timeout, group_id=None).properties)
        except Exception as err:  # an error reply, or no reply
            log(WARNING, "node %d did not answer %s: %s", node_id, config, err)
            errors.append(f"node {node_id}: {err}")
    raise RuntimeError(f"no node answered the server's query {config}: " + "; ".join(errors))


def federation_size(grid: Grid, timeout: float) -> int | None:
    """The number of partitions the federation's nodes were configured with (their
    ``num-partitions``), asked of one node; None when it does not say (a client from outside
    the suite, or a node config without ``num-partitions``).

    Raises:
        RuntimeError: no node answered.
    """
    answer = ask_a_node(grid, FEDERATION_QUERY, timeout)
    try:
        size = int(answer[NUM_PARTITIONS])
    except (KeyError, TypeError, ValueError):
        return None
    return size if size > 0 else None


def resolve_num_clients(grid: Grid, num_clients: int, timeout: float) -> int:
    """``num-clients`` checked against the federation's size, or that size when it is 0. A set
    ``num-clients`` is taken as it is when the nodes do not say their size.

    Raises:
        ConfigError: ``num_clients`` > 0 differs from the nodes' ``num-partitions``.
        RuntimeError: no node answered, or ``num_clients`` is 0 and the nodes do not say their size.
    """
    size = federation_size(grid, timeout)
    if size is None:
        if num_clients:
            return num_clients
        raise RuntimeError(
            "num-clients=0 (the federation's size) but a node does not say its num-partitions; start "
            "SuperNodes with --node-config \"partition-id=<i> num-partitions=<n>\", or set num-clients"
        )
    if num_clients and num_clients != size:
        raise ConfigError(
            f"num-clients={num_clients} but the federation has num-partitions={size} (in simulation: "
            f"num-supernodes); make them equal, or set num-clients=0 to use the federation's size"
        )
    return size
