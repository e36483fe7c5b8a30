"""Registry entry of kNN-Per (Marfoq, Neglia, Vidal and Kameni, ICML 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.knnper import KNNPerClient
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.knnper import KNNPer

#: ``knn-per.lam``'s value that asks for a lambda chosen per client (the run config has no None)
SELECT = -1.0


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


@dataclass(frozen=True)
class KNNPerOptions:
    """kNN-Per: ``k`` neighbours (the FedGP paper's comparison: 10); ``lam`` the interpolation
    weight of the kNN model: -1 (default) chooses it per client at every evaluation on the
    client's validation split (the run's ``val-fraction``; without one, by leave-one-out on its
    training split, with a warning) from the grid 0, ``lambda_step``, 2 ``lambda_step``, ... 1
    (the authors' resolution 0.01), a value in [0, 1] fixes it for every client; ``capacity``
    the fraction of each client's training samples kept in its datastore (1: all; the paper's
    capacity experiments); ``temperature`` T of the kernel exp(-||phi(x) - phi(x')||^2 / (D T))
    (the authors' ``--kernel_length_scale``, 1)."""

    k: int = 10
    lam: float = SELECT
    lambda_step: float = 0.01
    capacity: float = 1.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"knn-per.k must be an integer >= 1, got {self.k!r}")
        if not _number(self.lam) or not (self.lam == SELECT or 0 <= self.lam <= 1):
            raise ConfigError(f"knn-per.lam must be -1 (chosen per client on its validation split) or a number "
                              f"in [0, 1] (fixed), got {self.lam!r}")
        if not _number(self.lambda_step) or not 0 < self.lambda_step <= 1:
            raise ConfigError(f"knn-per.lambda-step must lie in (0, 1], got {self.lambda_step!r}")
        if not _number(self.capacity) or not 0 < self.capacity <= 1:
            raise ConfigError(f"knn-per.capacity must lie in (0, 1] (a fraction of the training samples), "
                              f"got {self.capacity!r}")
        if not _number(self.temperature) or not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"knn-per.temperature must be a finite number > 0, got {self.temperature!r}")


def client_kwargs(options: KNNPerOptions) -> dict:
    """The client's arguments: ``lam=None`` (chosen per client) for ``knn-per.lam = -1``."""
    return {"k": options.k, "lam": None if options.lam == SELECT else options.lam,
            "lambda_step": options.lambda_step, "capacity": options.capacity, "temperature": options.temperature}


register(
    AlgorithmSpec(
        "knn-per",
        KNNPer,
        KNNPerClient,
        "kNN-Per: FedAvg's global model, evaluated as lam p_kNN + (1 - lam) p_global over a local datastore",
        options=KNNPerOptions,
        client_kwargs=client_kwargs,
    )
)
