"""Flower Strategies: one per algorithm and baseline."""

from flwr_pfl.strategies.base import PFLStrategy
from flwr_pfl.strategies.fedgp import FedDA, FedGP, SourceOnly, TargetOnly
from flwr_pfl.strategies.fmtl import FedFMTL
from flwr_pfl.strategies.baselines import FedAvg, FedBABU, FedBN, FedPer, FedProx, FedProxFinetune, FedRep, Finetune, LGFedAvg, Local
from flwr_pfl.strategies.pfedfda import PFedFDA
from flwr_pfl.strategies.feddar import FedAvgMultiHead, FedDAR, ReweightedFedAvg, SeparateFedAvg
from flwr_pfl.strategies.fedora import FEDORA
from flwr_pfl.strategies.ditto import Ditto
from flwr_pfl.strategies.apfl import APFL
from flwr_pfl.strategies.perfedavg import PerFedAvg
from flwr_pfl.strategies.pfedme import PFedMe
from flwr_pfl.strategies.fedrod import FedRoD
from flwr_pfl.strategies.fedpac import FedPAC
from flwr_pfl.strategies.knnper import KNNPer
from flwr_pfl.strategies.ifca import IFCA
from flwr_pfl.strategies.fedamp import FedAMP
from flwr_pfl.strategies.pfedhn import PFedHN
from flwr_pfl.strategies.fedfomo import FedFomo

__all__ = [
    "APFL", "Ditto", "FedAMP", "FedAvg", "FedAvgMultiHead", "FedBABU", "FedBN", "FedDA", "FedDAR", "FedFMTL",
    "FedFomo", "FedGP", "FEDORA", "FedPAC", "FedPer", "FedProx", "FedProxFinetune", "FedRep", "FedRoD",
    "Finetune", "IFCA", "KNNPer", "LGFedAvg", "Local", "PerFedAvg", "PFedFDA", "PFedHN", "PFedMe",
    "PFLStrategy", "ReweightedFedAvg", "SeparateFedAvg", "SourceOnly", "TargetOnly",
]
