"""Flower NumPyClients: one per algorithm and baseline."""

from flwr_pfl.clients.base import LocalData, PFLClient, TrainConfig
from flwr_pfl.clients.fedavg import FedAvgClient, FedBABUClient, FedProxClient, FedProxFinetuneClient, FinetuneClient
from flwr_pfl.clients.fedbn import FedBNClient
from flwr_pfl.clients.fedgp import FedGPClient
from flwr_pfl.clients.fmtl import FedFMTLClient
from flwr_pfl.clients.fedrep import FedPerClient, FedRepClient, LGFedAvgClient
from flwr_pfl.clients.local import LocalClient
from flwr_pfl.clients.pfedfda import PFedFDAClient
from flwr_pfl.clients.feddar import FedDARClient, ReweightedFedAvgClient, SeparateFedAvgClient
from flwr_pfl.clients.fedora import FEDORAClient
from flwr_pfl.clients.ditto import DittoClient
from flwr_pfl.clients.apfl import APFLClient
from flwr_pfl.clients.perfedavg import PerFedAvgClient
from flwr_pfl.clients.pfedme import PFedMeClient
from flwr_pfl.clients.fedrod import FedRoDClient
from flwr_pfl.clients.fedpac import FedPACClient
from flwr_pfl.clients.knnper import KNNPerClient
from flwr_pfl.clients.ifca import IFCAClient
from flwr_pfl.clients.fedamp import FedAMPClient
from flwr_pfl.clients.pfedhn import PFedHNClient
from flwr_pfl.clients.fedfomo import FedFomoClient

__all__ = [
    "APFLClient", "DittoClient", "FedAMPClient", "FedAvgClient", "FedBABUClient", "FedBNClient",
    "FedDARClient", "FedFMTLClient", "FedFomoClient", "FedGPClient", "FEDORAClient", "FedPACClient",
    "FedPerClient", "FedProxClient", "FedProxFinetuneClient", "FedRepClient", "FedRoDClient",
    "FinetuneClient", "IFCAClient", "KNNPerClient", "LGFedAvgClient", "LocalClient", "LocalData",
    "PerFedAvgClient", "PFedFDAClient", "PFedHNClient", "PFedMeClient", "PFLClient", "ReweightedFedAvgClient",
    "SeparateFedAvgClient", "TrainConfig",
]
