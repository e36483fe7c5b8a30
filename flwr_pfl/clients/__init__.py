"""Flower NumPyClients: one per algorithm and baseline."""

from flwr_pfl.clients.base import LocalData, PFLClient, TrainConfig
from flwr_pfl.clients.fedavg import FedAvgClient, FinetuneClient
from flwr_pfl.clients.fedrep import FedPerClient, FedRepClient
from flwr_pfl.clients.local import LocalClient

__all__ = [
    "FedAvgClient", "FedPerClient", "FedRepClient", "FinetuneClient", "LocalClient", "LocalData",
    "PFLClient", "TrainConfig",
]
