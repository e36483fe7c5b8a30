"""Registry entry of FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, AAAI 2021): attentive
message passing between the clients' models on the server, a proximal step on each client."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fedamp import FedAMPClient
from flwr_pfl.core.fedamp import check_hyperparameters
from flwr_pfl.strategies.fedamp import FedAMP


@dataclass(frozen=True)
class FedAMPOptions:
    """FedAMP: ``alpha_k`` is the message-passing step (Eq. 3/5), ``lam`` the lambda of the
    clients' proximal term lambda / (2 alpha_k) ||w - u_i||^2 (Eq. 6), ``sigma`` the scale of the
    attention-inducing function A(x) = 1 - exp(-x / sigma). All three live on the server, which
    sends alpha_k and lambda to the clients with every fit instruction.

    Defaults: PFLlib's (``alphaK = 1``, ``lamda = 1``, ``sigma = 1``). With m clients, alpha_k
    (m - 1) / sigma > 1 lets a client's own weight xi_ii go negative when the models are close
    (the server warns); the FEDORA preset (presets/fedamp_rotated_mnist.toml) keeps
    alpha_k <= sigma / (m - 1).
    """

    alpha_k: float = 1.0
    lam: float = 1.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        check_hyperparameters(self.alpha_k, self.lam, self.sigma, lambda name: f"fedamp.{name}")


register(
    AlgorithmSpec(
        "fedamp",
        FedAMP,
        FedAMPClient,
        "FedAMP: per-client cloud models by attentive message passing over every client's latest model; "
        "local training with a proximal pull to the cloud model",
        options=FedAMPOptions,
        strategy_kwargs=asdict,
    )
)
