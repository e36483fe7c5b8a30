"""The Message-API flavour gives exactly the NumPyClient flavour's results, for every algorithm.

Both flavours run the same round logic (the legacy strategy); only the messages differ. Each
registered algorithm runs in-process under both ``api`` values, with full and with partial
participation (a seeded sample of the clients trains and is evaluated each round), and the runs
must agree bit for bit: the results rows (``metrics.json``, ``clients.json``), the server's
final state (its checkpoint: global arrays and the algorithm's own state), the exported global
model, and every node's personal state (``context.state``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

from app.test_reruns import FDA, base_config, differences, domain_dataset  # noqa: F401 - a fixture
from flwr_pfl.app.checkpoint import CHECKPOINT_NAME, read_checkpoint
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.export import MODEL_FILE
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.server_app import app as server_app

PARTICIPATION = {"full": {"fraction-fit": 1.0, "fraction-evaluate": 1.0}, "partial": {"fraction-fit": 0.5, "fraction-evaluate": 0.5}}


def run(tmp_path: Path, dataset: str, algorithm: str, api: str, participation: str) -> dict[str, Any]:
    fractions = dict(PARTICIPATION[participation])
    if algorithm in FDA:  # the FedGP/FedDA family trains every client (the paper's protocol): sample evaluation only
        fractions["fraction-fit"] = 1.0
    cfg = base_config(tmp_path, dataset, algorithm, api, api=api, **fractions)
    grid = run_inprocess(server_app, client_app, cfg["num-clients"], cfg)
    out = tmp_path / api
    model = out / MODEL_FILE
    return {
        "files": {name: (out / name).read_bytes() for name in ("metrics.json", "clients.json")},
        "checkpoint": read_checkpoint(out / CHECKPOINT_NAME),
        "model": torch.load(model) if model.exists() else None,
        "states": {node: context.state for node, context in grid.contexts.items()},
    }


def same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested values (dicts, lists, arrays, tensors, records) differ."""
    if isinstance(a, (np.ndarray, torch.Tensor)) or isinstance(b, (np.ndarray, torch.Tensor)):
        a, b = np.asarray(a), np.asarray(b)
        return [] if a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True) else [where]
    if isinstance(a, ArrayRecord) and isinstance(b, ArrayRecord):
        return same(list(a.keys()), list(b.keys()), where + ".keys") + same(a.to_numpy_ndarrays(), b.to_numpy_ndarrays(), where)
    if isinstance(a, (dict, RecordDict)) or hasattr(a, "items"):
        if set(a.keys()) != set(b.keys()):
            return [f"{where}: keys {sorted(a.keys())} != {sorted(b.keys())}"]
        return [d for k in a.keys() for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    return [] if a == b or (a != a and b != b) else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("participation", sorted(PARTICIPATION))
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_message_flavour_equals_numpyclient_flavour(tmp_path, domain_dataset, algorithm, participation):  # noqa: F811
    legacy = run(tmp_path, domain_dataset, algorithm, "numpyclient", participation)
    message = run(tmp_path, domain_dataset, algorithm, "message", participation)
    assert legacy["files"] == message["files"], differences(legacy["files"], message["files"])
    assert legacy["checkpoint"].rounds_done == message["checkpoint"].rounds_done == 4
    assert not same(legacy["checkpoint"].state, message["checkpoint"].state, "state")
    assert not same(legacy["model"], message["model"], "model.pt")
    assert not same(legacy["states"], message["states"], "context.state")
    assert any(len(state) for state in legacy["states"].values()) or ALGORITHMS[algorithm].client.personal_group is None
