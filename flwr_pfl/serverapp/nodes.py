"""The round logic's handle on the nodes of a Message-API ``Grid``.

A legacy strategy (:class:`~flwr_pfl.strategies.base.PFLStrategy`) talks to clients through
Flower's ``ClientProxy`` (``fit``, ``evaluate``, ``get_properties``, ``get_parameters``) and
samples them from a ``ClientManager``. :class:`MessageNode` is such a proxy for one node of a
``Grid``: each call sends ONE native Message-API message (``train``, ``evaluate``, ``query``,
``query.parameters``) whose records :mod:`flwr_pfl.messages` packs and reads, and turns the
reply into Flower's result type. An error reply, no reply, or a reply of the wrong shape raises,
so that the round logic counts the node as failed, exactly as it counts a failed legacy client.
:class:`GridClientManager` offers the grid's current nodes as such proxies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from flwr.app import DEFAULT_TTL, ArrayRecord, Message, RecordDict
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    Properties,
    ReconnectIns,
    Scalar,
    Status,
    DisconnectRes,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid

from flwr_pfl import messages

#: message types of the Message-API flavour (Flower's categories; ``query.parameters`` asks a
#: node for its initial shared arrays, what a legacy client's ``get_parameters`` returns)
TRAIN, EVALUATE, QUERY, PARAMETERS = "train", "evaluate", "query", "query.parameters"
#: seconds between two looks for registered nodes
POLL_SECONDS = 0.2
#: names of the wire arrays when known (None: arrays are named by position)
WireNames = Callable[[], Sequence[str] | None]


class NodeFailure(RuntimeError):
    """A node did not answer a message usably: an error reply, no reply, malformed content.

    An error reply reads as the legacy flavour's does (``Message contains an Error (reason:
    ...)``), so that failure summaries (:func:`~flwr_pfl.strategies.validation.describe_failures`)
    read the same in both flavours.
    """


def error_reply_failure(reply: Message) -> NodeFailure:
    """The failure for an error reply, worded as Flower's legacy proxy words it."""
    return NodeFailure(
        f"Message contains an Error (reason: {reply.error.reason}). It originated during client-side "
        "execution of a message."
    )


def reply_content(reply: Message | None, node_id: int, message_type: str) -> RecordDict:
    """The content of ``reply``, or :class:`NodeFailure` (no reply, or an error reply)."""
    if reply is None:
        raise NodeFailure(f"node {node_id}: no {message_type!r} reply in time (timed out, or the node left)")
    if reply.has_error():
        raise error_reply_failure(reply)
    return reply.content


class MessageNode(ClientProxy):
    """A node of ``grid`` as the ``ClientProxy`` the round logic addresses (``cid``: the node
    id as a string, as Flower's legacy proxy has it).

    Args:
        grid: the run's Grid.
        node_id: the node's id.
        wire_names: the names of the global arrays on the wire when known (arrays of another
            count are named by position), so that messages carry the model's names.
    """

    def __init__(self, grid: Grid, node_id: int, wire_names: WireNames | None = None) -> None:
        super().__init__(str(node_id))
        self.grid = grid
        self.node_id = node_id
        self.wire_names = wire_names or (lambda: None)

    # ------------------------------------------------------------------ messages
    def message(self, message_type: str, content: RecordDict, timeout: float | None, group_id: int | None) -> Message:
        """A message of ``message_type`` to this node (TTL ``timeout``, as the legacy proxy sets)."""
        return Message(
            content,
            dst_node_id=self.node_id,
            message_type=message_type,
            group_id=str(group_id) if group_id else "",
            ttl=timeout if timeout else DEFAULT_TTL,
        )

    def train_message(self, ins: FitIns, timeout: float | None, group_id: int | None, user: Mapping[str, Scalar] | None = None) -> Message:
        """The ``train`` message of ``ins``; ``user`` config keys go under the instruction's."""
        content = messages.request_content(parameters_to_ndarrays(ins.parameters), {**(user or {}), **ins.config}, self.wire_names())
        return self.message(TRAIN, content, timeout, group_id)

    def evaluate_message(self, ins: EvaluateIns, timeout: float | None, group_id: int | None, user: Mapping[str, Scalar] | None = None) -> Message:
        """The ``evaluate`` message of ``ins``; ``user`` config keys go under the instruction's."""
        content = messages.request_content(parameters_to_ndarrays(ins.parameters), {**(user or {}), **ins.config}, self.wire_names())
        return self.message(EVALUATE, content, timeout, group_id)

    def exchange(self, message: Message, timeout: float | None) -> RecordDict:
        """Send ``message``, wait for its reply (up to ``timeout`` seconds) and return its content."""
        replies = list(self.grid.send_and_receive([message], timeout=timeout))
        return reply_content(replies[0] if replies else None, self.node_id, message.metadata.message_type)

    # ------------------------------------------------------------------ replies
    def fit_res(self, content: RecordDict) -> FitRes:
        """A ``train`` reply's content as FitRes, its arrays read by the wire's names when known
        (raises :class:`~flwr_pfl.messages.MessageContentError` when it is malformed, or named
        with other names than the wire's)."""
        arrays, num_examples, metrics = messages.read_train_reply(content, self.wire_names())
        return FitRes(_OK, ndarrays_to_parameters(arrays), num_examples, metrics)

    def evaluate_res(self, content: RecordDict) -> EvaluateRes:
        """An ``evaluate`` reply's content as EvaluateRes (one without ``loss`` is malformed)."""
        loss, num_examples, metrics = messages.read_evaluate_reply(content)
        return EvaluateRes(_OK, loss, num_examples, metrics)

    # ------------------------------------------------------------------ ClientProxy
    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        return self.fit_res(self.exchange(self.train_message(ins, timeout, group_id), timeout))

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        return self.evaluate_res(self.exchange(self.evaluate_message(ins, timeout, group_id), timeout))

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        content = self.exchange(self.message(QUERY, messages.query_content(ins.config), timeout, group_id), timeout)
        properties: Properties = messages.read_properties(content)
        return GetPropertiesRes(_OK, properties)

    def initial_arrays(self, config: Mapping[str, Scalar], timeout: float | None, group_id: int | None = None) -> ArrayRecord:
        """The node's initial shared arrays, as named by its client: a ``query.parameters``
        message, whose reply holds an ArrayRecord ``"arrays"``."""
        content = self.exchange(self.message(PARAMETERS, messages.query_content(config), timeout, group_id), timeout)
        if messages.ARRAYS not in content.array_records:
            raise messages.MessageContentError(f"node {self.node_id}: the parameters reply has no ArrayRecord {messages.ARRAYS!r}")
        return content.array_records[messages.ARRAYS]

    def get_parameters(self, ins: GetParametersIns, timeout: float | None, group_id: int | None) -> GetParametersRes:
        arrays = messages.unpack_arrays(self.initial_arrays(ins.config, timeout, group_id))
        return GetParametersRes(_OK, ndarrays_to_parameters(arrays))

    def reconnect(self, ins: ReconnectIns, timeout: float | None, group_id: int | None) -> DisconnectRes:
        return DisconnectRes(reason="")  # nothing to do: the grid owns the connection


_OK = Status(code=Code.OK, message="Success")


class GridClientManager(SimpleClientManager):
    """Flower's client manager over the grid's nodes, as :class:`MessageNode` proxies.

    :meth:`refresh` registers the nodes the grid has now and unregisters those it no longer
    has (nodes come and go); the strategy calls it before each round's sampling, and
    :meth:`wait_for` polls the grid until enough nodes are there.
    """

    def __init__(self, grid: Grid, wire_names: WireNames | None = None) -> None:
        super().__init__()
        self.grid = grid
        self.wire_names = wire_names
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Match the registered proxies to the grid's current node ids."""
        with self._lock:
            current = {str(node_id): node_id for node_id in self.grid.get_node_ids()}
            for cid, proxy in list(self.clients.items()):
                if cid not in current:
                    self.unregister(proxy)
            for cid, node_id in current.items():
                if cid not in self.clients:
                    self.register(MessageNode(self.grid, node_id, self.wire_names))

    def node(self, node_id: int) -> MessageNode:
        """The proxy of ``node_id`` (a new one when it is not registered)."""
        proxy = self.clients.get(str(node_id))
        return proxy if isinstance(proxy, MessageNode) else MessageNode(self.grid, node_id, self.wire_names)

    def wait_for(self, num_clients: int, timeout: int = 86400) -> bool:
        """Poll the grid until ``num_clients`` nodes are registered, up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if len(self.clients) >= num_clients:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)
