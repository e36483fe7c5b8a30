"""Questions the ServerApp asks a connected node outside the strategy's rounds.

Two facts the server cannot know by itself come from the clients, through the same
``get_properties`` exchange the strategies use (:meth:`flwr_pfl.clients.base.PFLClient.get_properties`):
the federation's size (each node knows ``num-partitions`` from its node config), which
``num-clients = 0`` stands for and a set ``num-clients`` must equal, and the names of the arrays on the wire, for the model export
(:mod:`flwr_pfl.app.export`). A node is asked only after it has registered: in Flower's simulation
the ServerApp starts while the engine is still registering the simulated nodes, and in a deployment
nodes connect when they are started.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import WARNING
from typing import Any

from flwr.common import GetPropertiesIns, log
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid

from flwr_pfl.clients.base import Config
from flwr_pfl.errors import ConfigError

#: seconds between two looks for registered nodes
POLL_SECONDS = 0.2
#: ``get_properties`` query for the federation's size, and the answer's key
FEDERATION_QUERY = {"query": "federation-size"}
NUM_PARTITIONS = "num_partitions"


def federation_answer(node_config: Mapping[str, Any]) -> Config:
    """A node's answer to :data:`FEDERATION_QUERY`: its ``num-partitions`` (0 when unset)."""
    return {NUM_PARTITIONS: int(node_config.get("num-partitions", 0))}


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


def federation_size(grid: Grid, timeout: float) -> int:
    """The number of partitions the federation's nodes were configured with (their
    ``num-partitions``), asked of one node.

    Raises:
        RuntimeError: no node answered, or the answer holds no positive ``num_partitions``.
    """
    answer = ask_a_node(grid, FEDERATION_QUERY, timeout)
    try:
        size = int(answer[NUM_PARTITIONS])
    except (KeyError, TypeError, ValueError):
        size = 0
    if size < 1:
        raise RuntimeError(
            f"the federation's size is unknown: a node answered {answer}, without num-partitions; start "
            "SuperNodes with --node-config \"partition-id=<i> num-partitions=<n>\""
        )
    return size


def resolve_num_clients(grid: Grid, num_clients: int, timeout: float) -> int:
    """``num-clients`` checked against the federation's size, or that size when it is 0.

    Raises:
        ConfigError: ``num_clients`` > 0 differs from the nodes' ``num-partitions``.
        RuntimeError: no node answered (see :func:`federation_size`).
    """
    size = federation_size(grid, timeout)
    if num_clients and num_clients != size:
        raise ConfigError(
            f"num-clients={num_clients} but the federation has num-partitions={size} (in simulation: "
            f"num-supernodes); make them equal, or set num-clients=0 to use the federation's size"
        )
    return size
