"""Registry entry of FedFomo (Zhang, Sapra, Fidler, Yeung and Alvarez, ICLR 2021): each client
combines downloaded models by first-order weights from its validation loss, then trains."""

from __future__ import annotations

from dataclasses import dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fedfomo import FedFomoClient
from flwr_pfl.strategies.fedfomo import FedFomo, check_options


@dataclass(frozen=True)
class FedFomoOptions:
    """FedFomo: each sampled client downloads its own model and ``num_models`` others (M;
    FL-bench's default 5), chosen epsilon-greedily by affinity with exploration probability
    ``max(0, epsilon - epsilon_decay (t - 1))`` in round t (the authors' 0.3 and 0.05), from the
    clients that replied in the latest round (``candidates = "last-round"``, as the authors' code,
    FL-bench and PFLlib) or from every client with a model (``"all"``). The weights are computed on
    the clients' validation split: set ``val-fraction`` (FL-bench and the authors hold out 20% of
    the local training data)."""

    num_models: int = 5
    epsilon: float = 0.3
    epsilon_decay: float = 0.05
    candidates: str = "last-round"

    def __post_init__(self) -> None:
        check_options(self.num_models, self.epsilon, self.epsilon_decay, self.candidates)


def strategy_kwargs(options: FedFomoOptions) -> dict[str, object]:
    return {"num_models": options.num_models, "epsilon": options.epsilon, "epsilon_decay": options.epsilon_decay,
            "candidates": options.candidates}


register(
    AlgorithmSpec(
        "fedfomo",
        FedFomo,
        FedFomoClient,
        "FedFomo: per-client combination of M downloaded models by first-order weights on the client's validation loss",
        options=FedFomoOptions,
        strategy_kwargs=strategy_kwargs,
    )
)
