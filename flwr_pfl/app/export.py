"""Every run's models as named torch ``state_dict`` files, loadable for inference.

Written into the run's output directory (``<output-dir>/<run-name>``):

* ``model.pt``: the final global model, by the model's ``state_dict`` names; the whole model, or
  the shared part where only a part is shared (FedRep's and FedPer's body, pFedFDA's backbone).
  The server writes it after the last round. It has the arrays it ended with, and their names
  from the clients' wire layout, which one connected node tells it
  (:meth:`~flwr_pfl.clients.base.PFLClient.wire_layout`): the server needs no model, no data.
  Global arrays that are not model tensors (pFedFDA's class means and covariance) go to
  ``extras.pt``. Algorithms without a global model (``local``; ``fedora``, whose server keeps one
  model per client) write no ``model.pt``.
* ``clients/<partition-id>.pt``: each client's personalized part
  (:meth:`~flwr_pfl.clients.base.PFLClient.personal_state`): FedRep's and FedPer's head, Local's
  and FEDORA's whole model, the fine-tuned model of ``finetune``, pFedFDA's personalized head.
  Together with ``model.pt`` (``{**global, **personal}``) it is the model the client evaluated
  in the last round. Beside it ``clients/<partition-id>.json``: the round, the keys and that
  evaluation's metrics. The client writes these itself (:class:`~flwr_pfl.app.node_client.NodeClient`),
  on the evaluate message of the run's last round, which carries the run directory's name
  (:data:`EXPORT_KEY`): in simulation into the run's directory, in a deployment on the node's own
  disk (under its own ``output-dir``).
  Clients not evaluated in the last round (``fraction-evaluate`` < 1) write nothing.

How to load them: docs/export.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.common import log
from flwr.serverapp import Grid

from flwr_pfl.app.config import RunConfig
from flwr_pfl.app.keys import parse_section
from flwr_pfl.app.nodes import NodeProxy, ask_a_node, legacy_proxy
from flwr_pfl.clients.base import EXTRA_SEPARATOR, WIRE_LAYOUT, WIRE_LAYOUT_QUERY, NDArrays, PFLClient
from flwr_pfl.strategies.base import PFLStrategy

#: evaluate-config key of the run's last round: the run directory's name (clients export into it)
EXPORT_KEY = "export-run"
MODEL_FILE = "model.pt"
EXTRAS_FILE = "extras.pt"
CLIENTS_DIR = "clients"


# -------------------------------------------------------------------------------- server side
def request_client_exports(strategy: PFLStrategy, output: Path) -> None:
    """Have the clients evaluated in the run's last round write their personalized parts into
    ``output/clients/`` (the last round's evaluate instructions carry ``output``'s name)."""
    strategy.last_round_config = {EXPORT_KEY: output.name}


def name_arrays(arrays: Sequence[np.ndarray], layout: Sequence[Sequence[Any]]) -> dict[str, np.ndarray]:
    """``arrays`` keyed by the names of ``layout`` (``(name, shape)`` pairs, in wire order).

    Raises:
        ValueError: the counts differ, or an array's shape is not its name's (naming it).
    """
    if len(arrays) != len(layout):
        raise ValueError(f"the server holds {len(arrays)} global arrays but the clients' wire layout names {len(layout)}")
    named: dict[str, np.ndarray] = {}
    for array, (name, shape) in zip(arrays, layout):
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"global array {name!r} has shape {tuple(array.shape)}, the wire layout says {tuple(shape)}")
        named[str(name)] = array
    return named


def export_global_model(
    grid: Grid, strategy: PFLStrategy, output: Path, timeout: float, proxy: NodeProxy = legacy_proxy
) -> dict[str, torch.Tensor]:
    """Write the strategy's final global arrays as ``output/model.pt`` (and ``extras.pt``),
    named by the wire layout one node reports (addressed by ``proxy``); returns the model's
    tensors (empty when the algorithm has no global model, and nothing is written).

    Raises:
        RuntimeError: no node answered the wire-layout query.
        ValueError: the layout does not fit the arrays.
    """
    arrays: NDArrays = list(strategy.global_arrays or [])
    if not strategy.has_global_model or not arrays:
        log(INFO, "flwr_pfl: %s has no global model to export; the clients export their own", strategy.name)
        return {}
    answer = ask_a_node(grid, WIRE_LAYOUT_QUERY, timeout, proxy)
    named = name_arrays(arrays, json.loads(str(answer[WIRE_LAYOUT])))
    tensors = {name: torch.tensor(np.asarray(array)) for name, array in named.items()}
    model = {k: v for k, v in tensors.items() if EXTRA_SEPARATOR not in k}
    extras = {k: v for k, v in tensors.items() if EXTRA_SEPARATOR in k}
    save(model, output / MODEL_FILE)
    if extras:
        save(extras, output / EXTRAS_FILE)
    log(INFO, "flwr_pfl: final global model in %s", output / MODEL_FILE)
    return model


# -------------------------------------------------------------------------------- client side
def client_export_dir(run_config: Mapping[str, Any], run_name: str) -> Path:
    """``<output-dir>/<run_name>/clients`` with the node's own ``output-dir``.

    Raises:
        ValueError: ``run_name`` is not a plain directory name (the server sends it).
    """
    if not run_name or run_name in (".", "..") or Path(run_name).name != run_name or "\\" in run_name:
        raise ValueError(f"the server's {EXPORT_KEY}={run_name!r} is not a plain directory name")
    return parse_section(RunConfig, run_config).output_root() / run_name / CLIENTS_DIR


def write_client_export(client: PFLClient, run_name: str, server_round: int, metrics: Mapping[str, Any]) -> Path | None:
    """Write ``client``'s personalized part as ``clients/<partition-id>.pt`` and its round, keys
    and ``metrics`` as ``clients/<partition-id>.json``; returns the ``.pt`` path, or None when
    the client has nothing personal."""
    state = client.personal_state()
    if not state:
        return None
    directory = client_export_dir(client.context.run_config, run_name)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{client.partition_id}.pt"
    save(state, path)
    record = {
        "partition_id": client.partition_id,
        "round": server_round,
        "keys": list(state),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (bool, int, float, str))},
    }
    (directory / f"{client.partition_id}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    return path


def save(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """``torch.save`` through a temporary file, so that a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(dict(state), temporary)
    os.replace(temporary, path)
