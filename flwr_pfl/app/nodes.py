"""Questions the ServerApp asks connected nodes outside the strategy's rounds.

When the run starts, every connected node is asked :data:`~flwr_pfl.clients.base.FEDERATION_QUERY`
(:func:`survey_nodes`): the app's nodes answer with their partition and the federation's size, a
wrong node setting as ``node_error`` (:mod:`flwr_pfl.app.node_settings`), and, for a node that
trains on its own files, what its data looks like. The run stops there, naming the node, on a
node error, on two nodes with one partition id, on nodes that disagree on ``num-partitions``,
and on data that does not fit one model (input shape, classes, domains): otherwise such a node
would only fail, logged, in every round while the run completed without it.

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

import concurrent.futures
import json
import time
from collections.abc import Callable, Iterable
from logging import WARNING
from typing import Any, TypeVar

from flwr.common import GetPropertiesIns, log
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.serverapp import Grid

from flwr_pfl.clients.base import FEDERATION_QUERY, NUM_PARTITIONS, Config
from flwr_pfl.data.types import ClientData
from flwr_pfl.errors import ConfigError

#: answer key: why a node cannot take part (a wrong node setting, unreadable data)
NODE_ERROR = "node_error"
#: answer key: the node's data as JSON (:func:`data_answer`)
DATA_SHAPE = "data_shape"
#: query key: asks a node that uses the run's dataset to describe its slice too
DESCRIBE_DATA = "describe-data"

T = TypeVar("T")

#: seconds between two looks for registered nodes
POLL_SECONDS = 0.2

#: how the server addresses one node: ``(grid, node_id) -> ClientProxy``; the NumPyClient
#: flavour's legacy messages by default, :class:`flwr_pfl.serverapp.nodes.MessageNode` in the
#: Message-API flavour
NodeProxy = Callable[[Grid, int], ClientProxy]


def legacy_proxy(grid: Grid, node_id: int) -> ClientProxy:
    """Flower's proxy of the legacy messages (what a ``client_fn`` ClientApp answers)."""
    return GridClientProxy(node_id=node_id, grid=grid, run_id=grid.run.run_id)


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


def first_answer(node_ids: Iterable[int], ask: Callable[[int], T], what: str) -> T:
    """``ask(node_id)`` of ``node_ids`` in turn until one answers (a node may fail on its own,
    e.g. on its data); ``what`` names the question in the log and the error.

    Raises:
        RuntimeError: no node answered (naming each node's error).
    """
    errors = []
    for node_id in node_ids:
        try:
            return ask(node_id)
        except Exception as err:  # an error reply, no reply, a malformed one
            log(WARNING, "node %d did not answer %s: %s", node_id, what, err)
            errors.append(f"node {node_id}: {err}")
    raise RuntimeError(f"no node answered {what}: " + "; ".join(errors))


def ask_a_node(grid: Grid, config: Config, timeout: float, proxy: NodeProxy = legacy_proxy) -> Config:
    """One node's ``get_properties(config)`` answer, the registered nodes asked in turn
    (:func:`first_answer`). ``proxy`` addresses a node.

    Raises:
        RuntimeError: no node answered (naming each node's error).
    """
    def ask(node_id: int) -> Config:
        return dict(proxy(grid, node_id).get_properties(GetPropertiesIns(dict(config)), timeout=timeout, group_id=None).properties)

    return first_answer(wait_for_nodes(grid, timeout), ask, f"the server's query {config}")


def data_answer(data: ClientData, classes: tuple[str, ...] = (), own: bool = True) -> Config:
    """What a node says of its data in the federation query: input shape, classes, domains (and
    an image folder's class names), as JSON under :data:`DATA_SHAPE`."""
    shape = {"input_shape": list(data.input_shape), "num_outputs": data.num_outputs, "task": data.task,
             "num_domains": data.num_domains, "classes": list(classes), "own": own}
    return {DATA_SHAPE: json.dumps(shape)}


def ask_nodes(
    grid: Grid, node_ids: list[int], config: Config, timeout: float, workers: int, proxy: NodeProxy = legacy_proxy
) -> dict[int, Config | Exception]:
    """Every node's ``get_properties(config)`` answer, or the error of one that could not answer;
    ``proxy`` addresses a node."""
    def ask(node_id: int) -> Config | Exception:
        try:
            return dict(proxy(grid, node_id).get_properties(GetPropertiesIns(dict(config)), timeout=timeout, group_id=None).properties)
        except Exception as err:  # an error reply, or no reply
            return err

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(node_ids)))) as pool:
        return dict(zip(node_ids, pool.map(ask, node_ids)))


def survey_nodes(grid: Grid, timeout: float, wanted: int = 0, workers: int = 32, proxy: NodeProxy = legacy_proxy) -> dict[int, Config]:
    """Every connected node's answer to the federation query, checked; node id -> answer.

    Waits (up to ``timeout`` s) for ``wanted`` nodes (0: as many as the first answer's
    ``num-partitions``); nodes that register later are not asked. A node that cannot answer
    is logged and left out (the rounds decide what to do with it).

    Raises:
        ConfigError: a node's setting is wrong (naming the node), two nodes have one partition
            id, nodes disagree on ``num-partitions``, or their data does not fit one model.
        RuntimeError: no node connected, or none answered.
    """
    deadline = time.monotonic() + timeout
    answers: dict[int, Config] = {}
    errors: list[str] = []
    asked: set[int] = set()
    while True:
        new = [n for n in wait_for_nodes(grid, max(0.0, deadline - time.monotonic())) if n not in asked]
        asked.update(new)
        for node_id, answer in ask_nodes(grid, new, FEDERATION_QUERY, timeout, workers, proxy).items():
            if isinstance(answer, Exception):
                log(WARNING, "node %d did not answer %s: %s", node_id, FEDERATION_QUERY, answer)
                errors.append(f"node {node_id}: {answer}")
            else:
                answers[node_id] = answer
        target = wanted or max((partition_count(a) or 0 for a in answers.values()), default=0)
        if len(asked) >= target or time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
    if not answers:
        raise RuntimeError(f"no node answered the server's query {FEDERATION_QUERY}: " + "; ".join(errors))
    check_survey(answers)
    if any(_shape(a) for a in answers.values()):  # some nodes use their own data: every node describes its data
        silent = [n for n, a in answers.items() if not _shape(a)]
        for node_id, answer in ask_nodes(grid, silent, {**FEDERATION_QUERY, DESCRIBE_DATA: True}, timeout, workers, proxy).items():
            if not isinstance(answer, Exception):
                answers[node_id] = answer
        check_survey(answers)
    return answers


def check_survey(answers: dict[int, Config]) -> None:
    """ConfigError on a node error, duplicate partition ids, disagreeing ``num-partitions`` or
    data that does not fit one model (see :func:`survey_nodes`)."""
    for node_id, answer in sorted(answers.items()):
        if NODE_ERROR in answer:
            error = str(answer[NODE_ERROR])
            raise ConfigError(error if error.startswith(f"node {node_id} ") else f"node {node_id}: {error}")
    holders: dict[int, int] = {}
    for node_id, answer in sorted(answers.items()):
        partition = _int(answer.get("partition_id"))
        if partition is None:
            continue
        if partition in holders:
            raise ConfigError(
                f"nodes {holders[partition]} and {node_id} both have partition-id={partition}; every node needs "
                "its own partition-id (--node-config 'partition-id=<i> ...')"
            )
        holders[partition] = node_id
    sizes = {node_id: partition_count(a) for node_id, a in answers.items() if partition_count(a) is not None}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"node {n}: {s}" for n, s in sorted(sizes.items()))
        raise ConfigError(f"the nodes disagree on num-partitions ({shown}); give every node the same num-partitions")
    shapes = {node_id: _shape(a) for node_id, a in answers.items() if _shape(a)}
    if len({_model_fit(s) for s in shapes.values()}) > 1:
        shown = "; ".join(f"node {n} (partition {answers[n].get('partition_id')}): {_describe(s)}" for n, s in sorted(shapes.items()))
        raise ConfigError(
            f"the nodes' data does not fit one model: {shown}. Every node needs inputs of one shape and the same "
            "classes and domains; a node whose data lacks some classes or domains sets num-classes / num-domains "
            "in its node config, and image folders need the same class folders (an empty folder keeps a class)"
        )


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def partition_count(answer: Config) -> int | None:
    """The federation's size a node's answer to the federation query says (its
    ``num-partitions``), or None when it says none."""
    size = _int(answer.get(NUM_PARTITIONS))
    return size if size is not None and size > 0 else None


def _shape(answer: Config) -> dict[str, Any]:
    text = answer.get(DATA_SHAPE)
    return json.loads(text) if isinstance(text, str) else {}


def _model_fit(shape: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree between nodes for one model to serve them (image-folder class names only
    where the node has them: a dataset slice or array file has numbered classes)."""
    names = tuple(shape["classes"])
    return (tuple(shape["input_shape"]), shape["num_outputs"], shape["task"], shape["num_domains"]) + ((names,) if names else ())


def _describe(shape: dict[str, Any]) -> str:
    source = "own data" if shape["own"] else "the run's dataset"
    names = f" {shape['classes']}" if shape["classes"] else ""
    return (f"{source}, inputs {tuple(shape['input_shape'])}, {shape['num_outputs']} "
            f"{'classes' if shape['task'] == 'classification' else 'outputs'}{names}, {shape['num_domains']} domain(s)")


def resolve_num_clients(
    grid: Grid, num_clients: int, timeout: float, wanted: int = 0, workers: int = 32, proxy: NodeProxy = legacy_proxy
) -> int:
    """``num-clients`` checked against the federation's size, or that size when it is 0, after
    :func:`survey_nodes` (``wanted``: the nodes to wait for, 0 = ``num_clients`` or the
    federation's size). A set ``num-clients`` is taken as it is when the nodes do not say their size.

    Raises:
        ConfigError: ``num_clients`` > 0 differs from the nodes' ``num-partitions``, or
            :func:`survey_nodes` refused a node.
        RuntimeError: no node answered, or ``num_clients`` is 0 and the nodes do not say their size.
    """
    answers = survey_nodes(grid, timeout, wanted or num_clients, workers, proxy)
    size = next((s for a in answers.values() if (s := partition_count(a)) is not None), None)
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
