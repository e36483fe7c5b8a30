"""A node's own settings: read once from its node config, checked, and typed.

A SuperNode is started with ``flower-supernode --node-config 'key=value ...'`` (strings in double
quotes); Flower's simulation gives every node ``partition-id`` and ``num-partitions``. Every
per-node setting the app reads comes from here (:data:`NODE_KEYS` documents each key), and a
wrong or missing one is a :class:`NodeSettingsError` that names the node, the key, the value and
what is allowed. The server asks every node for its settings when the run starts
(:mod:`flwr_pfl.app.nodes`), so such an error stops the run there instead of dropping the node
from every round.

Keys the app does not know are left alone (other software may read the node config), except
ones close to a known key, which are refused as likely typos.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr_pfl.data.node_files import NodeDataSpec, data_format
from flwr_pfl.errors import ConfigError
from flwr_pfl.training.device import resolve_device

PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
ROLE = "fedgp-role"
DEVICE = "device"
DATA_PATH = "data-path"
ROLES = ("target", "source")

#: every node-config key the app reads -> what it means and what is allowed
NODE_KEYS: dict[str, str] = {
    PARTITION_ID: "this node's partition: an integer in [0, num-partitions), unique in the federation (required)",
    NUM_PARTITIONS: "the federation's number of partitions, the same on every node: an integer >= 1 (required)",
    ROLE: "FedGP / FedDA: 'target' or 'source' (absent: the target is partition fedgp.target-partition)",
    DEVICE: "where this node trains: 'auto', 'cpu', 'cuda' or 'cuda:<index>' (absent: the run's device)",
    DATA_PATH: "this node's own data, an absolute path: an image folder <root>/<class>/<image>, a .npz or a .pt "
               "file with x, y[, domain] (absent: the node's slice of the run's dataset)",
    "data-test-path": "its test data, of the same kind as data-path (absent: a fraction of data-path)",
    "data-test-fraction": "share of data-path held out for testing when there is no data-test-path, in [0, 1) "
                          "(absent: the run's test-fraction)",
    "data-split-seed": "seed of that split, an integer (absent: the run's seed)",
    "num-classes": "the federation's number of classes when this node's data lacks some (0 or absent: as the "
                   "data shows)",
    "num-domains": "the federation's number of domains when this node's data lacks some (0 or absent: as the "
                   "data shows)",
    "image-size": "'<height>x<width>' images are resized to (absent: their own size, equal for all images)",
    "image-channels": "1 (grey) or 3 (RGB) channels of images (default 3)",
    "state-dir": "a directory on this node where its personal state is kept across restarts "
                 "(flwr_pfl.app.node_state; absent: in memory only)",
    "state-key-file": "a file holding this node's secret key (16 bytes or more): its state files are signed "
                      "with it and a file without its valid signature is refused (absent: unsigned)",
}
#: the data keys that need ``data-path``
_DATA_KEYS = ("data-test-path", "data-test-fraction", "data-split-seed", "num-classes", "num-domains",
              "image-size", "image-channels")


class NodeSettingsError(ConfigError):
    """A node's node config lacks a setting or has a wrong one (the message names the node)."""


def node_label(node_id: int | None, node_config: Mapping[str, Any]) -> str:
    """``node <id> (partition <p>)`` as errors name a node."""
    partition = node_config.get(PARTITION_ID, "?")
    return f"node {node_id if node_id is not None else '?'} (partition {partition})"


@dataclass(frozen=True)
class NodeSettings:
    """What one node's node config says (see :data:`NODE_KEYS`).

    Attributes:
        partition_id / num_partitions: the node's partition and the federation's size.
        role: FedGP / FedDA role, ``target`` / ``source``, or None (by partition id).
        device: where the node trains, or None (the run's ``device``).
        data: the node's own data, or None (its slice of the run's dataset).
    """

    partition_id: int
    num_partitions: int
    role: str | None = None
    device: str | None = None
    data: NodeDataSpec | None = None

    @classmethod
    def parse(cls, node_config: Mapping[str, Any], node_id: int | None = None) -> NodeSettings:
        """The settings of ``node_config``, checked.

        Raises:
            NodeSettingsError: a missing or wrong setting, naming the node, the key and what is allowed.
        """
        who = node_label(node_id, node_config)
        _refuse_typos(node_config, who)
        missing = [k for k in (PARTITION_ID, NUM_PARTITIONS) if k not in node_config]
        if missing:
            raise NodeSettingsError(
                f"{who}: the node config lacks {', '.join(missing)}; start the SuperNode with "
                f"--node-config 'partition-id=<i> num-partitions=<n>' ({PARTITION_ID}: {NODE_KEYS[PARTITION_ID]})"
            )
        num = _integer(node_config, NUM_PARTITIONS, who, low=1)
        partition = _integer(node_config, PARTITION_ID, who, low=0)
        if partition >= num:
            raise NodeSettingsError(f"{who}: {PARTITION_ID}={partition} must be in [0, {NUM_PARTITIONS}={num})")
        device = node_config.get(DEVICE)
        if device is not None:
            _string(node_config, DEVICE, who)
            try:
                resolve_device(device)
            except ConfigError as err:
                raise NodeSettingsError(f"{who}: node config {err}") from None
        return cls(partition, num, role_setting(node_config, who), device, _data(node_config, who))


def role_setting(node_config: Mapping[str, Any], who: str = "this node") -> str | None:
    """The node config's ``fedgp-role`` (None when absent).

    Raises:
        NodeSettingsError: a value other than ``target`` or ``source``.
    """
    role = node_config.get(ROLE)
    if role is not None and role not in ROLES:
        raise NodeSettingsError(f"{who}: node config {ROLE}={role!r} is not allowed; use 'target' or 'source'")
    return role


def _refuse_typos(node_config: Mapping[str, Any], who: str) -> None:
    for key in node_config:
        if key not in NODE_KEYS:
            close = difflib.get_close_matches(key, list(NODE_KEYS), n=1, cutoff=0.8)
            if close:
                raise NodeSettingsError(f"{who}: node config key {key!r} is unknown; did you mean {close[0]!r}?")


def _integer(config: Mapping[str, Any], key: str, who: str, low: int) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise NodeSettingsError(f"{who}: node config {key}={value!r} must be an integer >= {low}")
    return value


def _string(config: Mapping[str, Any], key: str, who: str) -> str:
    value = config[key]
    if not isinstance(value, str) or not value:
        raise NodeSettingsError(f"{who}: node config {key}={value!r} must be a non-empty string (in double quotes)")
    return value


def _path(config: Mapping[str, Any], key: str, who: str) -> str:
    path = os.path.expanduser(_string(config, key, who))
    if not os.path.isabs(path):
        raise NodeSettingsError(f"{who}: node config {key}={path!r} must be an absolute path (the ClientApp does "
                                "not run in the directory the SuperNode was started from)")
    try:
        data_format(path)
    except ConfigError as err:
        raise NodeSettingsError(f"{who}: node config {key}: {err}") from None
    return path


def _data(config: Mapping[str, Any], who: str) -> NodeDataSpec | None:
    if DATA_PATH not in config:
        stray = [k for k in _DATA_KEYS if k in config]
        if stray:
            raise NodeSettingsError(f"{who}: node config {', '.join(stray)} without {DATA_PATH} ({NODE_KEYS[DATA_PATH]})")
        return None
    path = _path(config, DATA_PATH, who)
    test_path = _path(config, "data-test-path", who) if "data-test-path" in config else ""
    if test_path and data_format(test_path) != data_format(path):
        raise NodeSettingsError(f"{who}: node config data-test-path is a {data_format(test_path)} but {DATA_PATH} "
                                f"is a {data_format(path)}; give both of one kind")
    fraction = config.get("data-test-fraction")
    if fraction is not None:
        if test_path:
            raise NodeSettingsError(f"{who}: node config data-test-fraction and data-test-path exclude each other")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise NodeSettingsError(f"{who}: node config data-test-fraction={fraction!r} must be a number in [0, 1)")
    seed = _integer(config, "data-split-seed", who, low=0) if "data-split-seed" in config else None
    size = None
    if "image-size" in config:
        text = _string(config, "image-size", who)
        height, _, width = text.lower().partition("x")
        if not (height.isdigit() and width.isdigit() and int(height) > 0 and int(width) > 0):
            raise NodeSettingsError(f"{who}: node config image-size={text!r} must be '<height>x<width>', e.g. '28x28'")
        size = (int(height), int(width))
    channels = config.get("image-channels", 3)
    if channels not in (1, 3) or isinstance(channels, bool):
        raise NodeSettingsError(f"{who}: node config image-channels={channels!r} must be 1 or 3")
    return NodeDataSpec(
        path=path,
        test_path=test_path,
        test_fraction=None if fraction is None else float(fraction),
        split_seed=seed,
        num_classes=_integer(config, "num-classes", who, low=0) if "num-classes" in config else 0,
        num_domains=_integer(config, "num-domains", who, low=0) if "num-domains" in config else 0,
        image_size=size,
        image_channels=channels,
    )
