"""Flower Strategies: one per algorithm and baseline."""

from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.strategies.baselines import FedAvg, FedPer, FedRep, Finetune, Local

__all__ = ["FedAvg", "FedPer", "FedRep", "Finetune", "Local", "PFLStrategy"]
