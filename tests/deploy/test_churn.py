"""Real fleets, in-process: nodes that leave and join between rounds, and a node that never answers.

The grids below are the in-process engine's Grid with the two behaviours of a SuperLink that
matter here (read in flwr 1.41's link state): ``get_node_ids`` lists only the nodes that are
connected now, and a message that nobody answered within its TTL comes back as an error reply
("Message TTL has expired"). Flower's legacy server loop sets each message's TTL to
``ServerConfig.round_timeout``, so these tests check that ``round-timeout`` reaches it, that
the round then goes on with the replies in hand, and what the results record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from flwr.app import DEFAULT_TTL, Context, Error, Message, RecordDict

from app.test_inprocess import config as inprocess_config
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import InProcessGrid
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.errors import ConfigError


def config(tmp_path, dataset, **overrides):
    """The in-process tests' small run, waiting at most 5 s for nodes unless told otherwise."""
    return inprocess_config(tmp_path, dataset, **{"wait_timeout": 5.0, **overrides})


def run(grid: InProcessGrid, run_config: dict) -> list[dict]:
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config)))
    return json.loads((Path(run_config["output-dir"]) / "run" / "metrics.json").read_text())


class ChurnGrid(InProcessGrid):
    """Partition 1's node leaves after round 1; partition 3's node joins before round 2."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.next_round = 1  # the round whose fit comes next

    def get_node_ids(self) -> list[int]:
        gone = {1001} if self.next_round >= 2 else {1003}
        return [n for n in self.contexts if n not in gone]

    def _push(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        ids = super()._push(messages)
        for m in messages:
            if m.metadata.message_type == "evaluate":
                self.next_round = max(self.next_round, int(m.metadata.group_id) + 1)
        return ids


class HungNodeGrid(InProcessGrid):
    """Node ``hung`` takes every message and never answers; like the SuperLink, the grid turns a
    message whose TTL has passed into an error reply, and ``send_and_receive`` without a timeout
    waits for the replies (as Flower's deployment grid does)."""

    def __init__(self, *args, hung: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hung = hung
        self.waiting: dict[str, Message] = {}
        self.ttls: list[tuple[str, float]] = []  # (message type, TTL) of each message to the hung node

    def _push(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            if message.metadata.dst_node_id == self.hung:
                message_id = f"hung-{len(self.waiting)}"
                message.metadata.__dict__["_message_id"] = message_id
                self.waiting[message_id] = message
                self.ttls.append((message.metadata.message_type, message.metadata.ttl))
                ids.append(message_id)
            else:
                ids += super()._push([message])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        message_ids = list(message_ids)
        out = super().pull_messages(message_ids)
        for m in message_ids:
            msg = self.waiting.get(m)
            if msg is not None and time.time() > msg.metadata.created_at + msg.metadata.ttl:
                del self.waiting[m]
                out.append(Message(Error(code=0, reason="Message TTL has expired"), reply_to=msg))
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        pending = set(self.push_messages(messages))
        replies: list[Message] = []
        while pending:
            got = self.pull_messages(pending)
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            time.sleep(0.05)
        return replies


def test_rounds_go_on_with_the_nodes_that_are_connected(tmp_path, blobs_dataset, caplog):
    """min-clients=3 of 4: round 1 runs with partitions 0-2, partition 1 leaves, partition 3
    joins late and is sampled from round 2 on; every row says who took part."""
    cfg = config(tmp_path, blobs_dataset, min_clients=3)
    rows = run(ChurnGrid(client_app, 4, cfg), cfg)
    taken = {(r["round"], r["phase"]): (r["participants"], r["participant_ids"]) for r in rows if "participants" in r}
    assert taken[(1, "fit")] == (3.0, "0 1 2")
    assert taken[(1, "evaluate")] == (3.0, "0 1 2")
    for rnd in (2, 3):
        assert taken[(rnd, "fit")] == (3.0, "0 2 3")
        assert taken[(rnd, "evaluate")] == (3.0, "0 2 3")
    assert all(r.get("num_dropped", 0.0) == 0.0 for r in rows)
    clients = json.loads((tmp_path / "run" / "clients.json").read_text())
    assert {c["partition_id"]: c["round"] for c in clients} == {0: 3, 1: 1, 2: 3, 3: 3}


def test_by_default_a_missing_node_stops_the_run_with_the_numbers(tmp_path, blobs_dataset):
    """min-clients=0 (= num-clients) waits for the whole federation, then names the shortfall."""
    cfg = config(tmp_path, blobs_dataset, wait_timeout=1.0)
    with pytest.raises(RuntimeError, match=r"only 3 of num-clients=4 clients.*lower min-clients"):
        run(ChurnGrid(client_app, 4, cfg), cfg)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_a_hung_client_is_dropped_after_round_timeout(tmp_path, blobs_dataset, caplog, algorithm):
    """Partition 2 never answers: each exchange waits round-timeout seconds, then the round is
    aggregated from the other three and the dropped one is logged and recorded."""
    cfg = config(tmp_path, blobs_dataset, algorithm=algorithm, num_server_rounds=2, round_timeout=1.5)
    grid = HungNodeGrid(client_app, 4, cfg, hung=1002)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        rows = run(grid, cfg)
    assert time.perf_counter() - start >= 4 * 1.5  # 2 rounds x (fit + evaluate), each waited out
    # the start-up survey's query waits wait-timeout (5 s); every round's exchange round-timeout
    assert grid.ttls[0] == ("get_properties", 5.0)
    assert grid.ttls[1:] and {ttl for _, ttl in grid.ttls[1:]} == {1.5}
    for rnd in (1, 2):
        for phase in ("fit", "evaluate"):
            row = next(r for r in rows if r["round"] == rnd and r["phase"] == phase)
            assert (row["participants"], row["participant_ids"]) == (3.0, "0 1 3"), row
            # it never answered, so not even its partition id is known: it is named by node id
            assert (row["num_dropped"], row["dropped_ids"]) == (1.0, "node-1002")
    assert "1 of 4 sampled clients dropped" in caplog.text


def test_without_round_timeout_messages_keep_flowers_default_ttl(tmp_path, blobs_dataset):
    """round-timeout=0 leaves Flower's default TTL (hours): the app sets no limit of its own."""
    cfg = config(tmp_path, blobs_dataset, num_server_rounds=1)
    grid = HungNodeGrid(client_app, 4, cfg, hung=1003)
    grid.contexts.pop(1003)  # the "hung" node is not connected: every message is answered
    sent: list[float] = []
    push = grid._push

    def spy(messages):
        messages = list(messages)
        # the rounds' messages (the federation-size question before the run has its own limit)
        sent.extend(m.metadata.ttl for m in messages if m.metadata.message_type in ("train", "evaluate"))
        return push(messages)

    grid._push = spy
    run(grid, config(tmp_path, blobs_dataset, num_server_rounds=1, min_clients=3))
    assert sent and set(sent) == {DEFAULT_TTL}


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [("min-clients", 5, r"min-clients=5 is out of range; must be in \[0, num-clients=4\]"),
     ("min-clients", -1, r"min-clients=-1 is out of range"),
     ("round-timeout", -1.0, r"round-timeout=-1.0 must be >= 0 seconds \(0 = no limit\)")],
)
def test_bad_churn_keys_are_refused(tmp_path, blobs_dataset, key, value, match):
    from flwr_pfl.app.config import parse_experiment

    with pytest.raises(ConfigError, match=match):
        parse_experiment(config(tmp_path, blobs_dataset) | {key: value})
