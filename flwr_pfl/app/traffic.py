"""What a run sends and receives, per round, per node and per message kind (``traffic.json``).

Every message between the ServerApp and the nodes passes through the Grid Flower hands the
ServerApp, whichever engine runs it and whichever flavour of the app drives the rounds: Flower's
legacy loop, the Message-API strategy, SecAgg+'s stages and the algorithms' own exchanges (queries,
FedDAR's head phase, FEDORA's setup). :class:`MeteredGrid` wraps that Grid and counts the payload
of each message: the bytes of its arrays, and of the byte strings in its config records (SecAgg+'s
masked vectors travel there). Flower's envelope (message metadata, protobuf framing, TLS) adds a
little on top; metrics and scalars are not counted.

A message is counted in the round its ``group_id`` names (Flower's loops and the suite's own
exchanges set it to the round; it is Flower's round, which a resumed run offsets), and in round 0
when it names none (the federation survey, the initial arrays asked of one node).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

def array_bytes(content: RecordDict) -> int:
    """The serialized bytes of every array in ``content``."""
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())


def payload_bytes(content: RecordDict) -> int:
    """The bytes of ``content``'s arrays and of the byte strings in its config records."""
    arrays = array_bytes(content)
    strings = 0
    for record in content.config_records.values():
        for value in record.values():
            if isinstance(value, bytes):
                strings += len(value)
            elif isinstance(value, list):
                strings += sum(len(v) for v in value if isinstance(v, bytes))
    return arrays + strings


@dataclass
class Tally:
    """Bytes and messages of one (round, kind, node)."""

    sent: int = 0
    received: int = 0
    messages: int = 0


def round_of(message: Message) -> int:
    """The round a message belongs to (its ``group_id``; 0 when it names none)."""
    group = message.metadata.group_id
    return int(group) if group.isdigit() else 0


def kind_of(message: Message) -> str:
    """Flower's message type without its action: ``train``, ``evaluate``, ``query`` (the Message
    API's ``query.parameters`` folded in), or the legacy flavour's ``get_properties`` and
    ``get_parameters``."""
    return message.metadata.message_type.split(".")[0]


class Traffic:
    """The tally of a run's messages by (Flower round, kind, node id)."""

    def __init__(self) -> None:
        self.tallies: dict[tuple[int, str, int], Tally] = defaultdict(Tally)

    def sent(self, message: Message) -> None:
        tally = self.tallies[(round_of(message), kind_of(message), message.metadata.dst_node_id)]
        tally.sent += payload_bytes(message.content)
        tally.messages += 1

    def received(self, reply: Message) -> None:
        if reply.has_error():
            return
        key = (round_of(reply), kind_of(reply), reply.metadata.src_node_id)
        self.tallies[key].received += payload_bytes(reply.content)

    def rows(self, partition_of: dict[str, int], round_offset: int = 0) -> list[dict[str, Any]]:
        """One row per (round, kind, node), sorted: the round counted over the whole run (Flower's
        round plus ``round_offset``, 0 for the run's start), the node's partition where known
        (``partition_of``: node id as a string -> partition id), bytes each way, messages."""
        rows = []
        for (server_round, kind, node), tally in sorted(self.tallies.items()):
            rows.append({
                "round": server_round + round_offset if server_round else 0, "kind": kind, "node_id": node,
                "partition_id": partition_of.get(str(node)), "bytes_sent": tally.sent,
                "bytes_received": tally.received, "messages": tally.messages,
            })
        return rows


def merge(*parts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of several processes of one run (a resumed run) as one table: the rows of one
    (round, kind, node) added up, sorted."""
    merged: dict[tuple[int, str, int], dict[str, Any]] = {}
    for row in (r for part in parts for r in part):
        key = (row["round"], row["kind"], row["node_id"])
        if key in merged:
            for field in ("bytes_sent", "bytes_received", "messages"):
                merged[key][field] += row[field]
        else:
            merged[key] = dict(row)
    return [merged[key] for key in sorted(merged)]


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The run's bytes each way, and per training round and client (the rows of rounds >= 1)."""
    sent = sum(r["bytes_sent"] for r in rows)
    received = sum(r["bytes_received"] for r in rows)
    training = [r for r in rows if r["round"] >= 1]
    pairs = {(r["round"], r["node_id"]) for r in training}
    per = max(len(pairs), 1)
    return {
        "bytes_sent": float(sent), "bytes_received": float(received),
        "bytes_sent_per_client_round": sum(r["bytes_sent"] for r in training) / per,
        "bytes_received_per_client_round": sum(r["bytes_received"] for r in training) / per,
    }


class MeteredGrid(Grid):
    """``grid`` with every message it carries counted in :attr:`traffic` (the rest delegated)."""

    def __init__(self, grid: Grid) -> None:
        self.inner = grid
        self.traffic = Traffic()

    def __getattr__(self, name: str) -> Any:  # the inner grid's own attributes (max_concurrent_clients, ...)
        return getattr(self.inner, name)

    @property
    def run(self) -> Any:
        return self.inner.run

    def set_run(self, run_id: int) -> None:
        self.inner.set_run(run_id)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(self._counted(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            self.traffic.received(reply)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = list(self.inner.send_and_receive(list(self._counted(messages)), timeout=timeout))
        for reply in replies:
            self.traffic.received(reply)
        return replies

    def _counted(self, messages: Iterable[Message]) -> Iterator[Message]:
        for message in messages:
            self.traffic.sent(message)
            yield message
