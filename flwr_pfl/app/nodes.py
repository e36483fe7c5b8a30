"""Questions the ServerApp asks a connected node outside the strategy's rounds.

Two facts the server cannot know by itself come from the clients, through the same
``get_properties`` exchange the strategies use (:meth:`flwr_pfl.clients.base.PFLClient.get_properties`):
the federation's size, when ``num-clients = 0`` (each node knows ``num-partitions`` from its node
config), and the names of the arrays on the wire, for the model export
(:mod:`flwr_pfl.app.export`). A node is asked only after it has registered: in Flower's simulation
the ServerApp starts while the engine is still registering the simulated nodes, and in a deployment
nodes connect when they are started.
"""

from __future__ import annotations

import time
from logging import WARNING

from flwr.common import GetPropertiesIns, log
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid

from flwr_pfl.clients.base import NUM_PARTITIONS, Config

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
    """One node's ``get_properties(config)`` answer: the registered nodes are asked in turn
    until one answers.

    Raises:
        RuntimeError: no node answered (naming each node's error).
    """
    errors = []
    for node_id in wait_for_nodes(grid, timeout):
        proxy = GridClientProxy(node_id=node_id, grid=grid, run_id=grid.run.run_id)
        try:
            return dict(proxy.get_properties(GetPropertiesIns(dict(config)), timeout=timeout, group_id=None).properties)
        except Exception as err:  # an error reply or no reply: try the next node
            log(WARNING, "node %d did not answer %s: %s", node_id, config, err)
            errors.append(f"node {node_id}: {err}")
    raise RuntimeError(f"no node answered the query {config}: " + "; ".join(errors))


def federation_size(grid: Grid, timeout: float) -> int:
    """The number of partitions the federation's nodes were configured with (their
    ``num-partitions``), asked of one node.

    Raises:
        RuntimeError: no node answered, or the answer holds no positive ``num_partitions``.
    """
    answer = ask_a_node(grid, {}, timeout)
    try:
        size = int(answer[NUM_PARTITIONS])
    except (KeyError, TypeError, ValueError):
        size = 0
    if size < 1:
        raise RuntimeError(
            f"num-clients=0 (the federation's size) but the node's answer {answer} holds no num-partitions; "
            "start SuperNodes with --node-config \"partition-id=<i> num-partitions=<n>\" or set num-clients"
        )
    return size
