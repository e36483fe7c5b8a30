"""Datasets for federated experiments: loading, domain transforms, partitioning, local splits.

The entry point for client apps is :func:`load_client_data` (config -> one client's
:class:`ClientData`); :func:`describe_partition` reports what every client holds.
See ``federated`` for the pipeline, ``registry`` to add datasets by name, ``provision`` to
obtain MNIST and Fashion-MNIST offline.
"""

from __future__ import annotations

from typing import Any

from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.registry import DatasetPool, available_datasets, register_dataset
from flwr_pfl.data.types import ArraySplit, ClientData

_LAZY = {  # imported on first use: they pull in torchvision and Hugging Face datasets
    "load_client_data": "flwr_pfl.data.federated",
    "describe_partition": "flwr_pfl.data.federated",
    "PartitionSummary": "flwr_pfl.data.federated",
}

__all__ = [
    "ArraySplit",
    "ClientData",
    "DataConfig",
    "DatasetPool",
    "available_datasets",
    "register_dataset",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
