"""Run a ServerApp and a ClientApp in one Python process, without Ray (tests, notebooks, benchmarks).

:class:`InProcessGrid` is a minimal Flower ``Grid`` that hands each message straight to the
ClientApp with the node's own :class:`~flwr.app.Context` (so ``context.state`` persists across
rounds exactly as in the simulation engine) and turns a ClientApp exception into an error reply,
as the engine does. Messages are not serialized, so it is fast: a few seconds for a small
federation. It relies on two details of flwr 1.41 that are not public API (``TaskIdentity`` and
the ``grid.run`` attribute read by the legacy server loop); the real-engine tests guard them.
"""

from __future__ import annotations

import copy
import threading
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity

from flwr_pfl.app.traffic import array_bytes


class InProcessGrid(Grid):
    """A Grid whose nodes are ``num_nodes`` in-process ClientApp calls.

    Node ``1000 + i`` has ``node_config = {"partition-id": i, "num-partitions": num_nodes}``.
    ``bytes_sent`` / ``bytes_received`` count the array payload (server -> clients and back), and
    ``client_seconds`` the time spent inside the ClientApp.
    """

    #: clients run one at a time here (see ``_lock``): the server needs no more threads than one
    max_concurrent_clients = 1

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: Mapping[str, Any], run_id: int = 1) -> None:
        self._app = client_app
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 1
        self.contexts = {
            1000 + i: Context(
                run_id=run_id,
                node_id=1000 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}
        self._run = types.SimpleNamespace(run_id=run_id)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.client_seconds = 0.0
        # Flower's server loop contacts clients from a thread pool; clients share this process's
        # random generators, so they run one at a time to keep runs reproducible.
        self._lock = threading.Lock()

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        with self._lock:
            return self._push(messages)

    def _push(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message_id = str(uuid4())
            message.metadata.__dict__["_message_id"] = message_id
            delivered = copy.deepcopy(message)  # the node's own copy, as over the wire
            self.bytes_sent += array_bytes(message.content)
            start = time.perf_counter()
            try:
                reply = self._app(delivered, self.contexts[message.metadata.dst_node_id])
            except Exception as err:  # the engine turns ClientApp exceptions into error replies
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=delivered)
            self.client_seconds += time.perf_counter() - start
            if not reply.has_error():
                self.bytes_received += array_bytes(reply.content)
            self._replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))


def run_inprocess(
    server_app: ServerApp,
    client_app: ClientApp,
    num_nodes: int,
    run_config: Mapping[str, Any],
) -> InProcessGrid:
    """Run ``server_app`` against ``num_nodes`` in-process clients; returns the grid (its node
    contexts hold each client's final state)."""
    grid = InProcessGrid(client_app, num_nodes, run_config)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config)))
    return grid
