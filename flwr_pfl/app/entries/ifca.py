"""Registry entry of IFCA (Ghosh, Chung, Yin and Ramchandran, NeurIPS 2020): k cluster models,
each client training the one with the lowest loss on its data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.ifca import IFCAClient
from flwr_pfl.core.ifca import check_options
from flwr_pfl.strategies.ifca import IFCA


@dataclass(frozen=True)
class IFCAOptions:
    """IFCA: ``num_clusters`` cluster models k (1 is FedAvg; the paper uses 2 to 4, 4 on Rotated
    MNIST); ``share_body``: weight sharing, one body averaged over every client and a head per
    cluster (the paper's neural-network experiments share every layer but the last; the authors'
    Rotated MNIST code keeps k whole models, the default)."""

    num_clusters: int = 2
    share_body: bool = False

    def __post_init__(self) -> None:
        check_options(self.num_clusters, self.share_body, lambda option: f"ifca.{option}")


register(
    AlgorithmSpec(
        "ifca",
        IFCA,
        IFCAClient,
        "IFCA: k cluster models; each client trains the one with the lowest training loss, averaged per cluster",
        options=IFCAOptions,
        client_kwargs=asdict,
        strategy_kwargs=asdict,
    )
)
