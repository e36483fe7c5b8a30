"""Per-FedAvg's Strategy (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020, Alg. 1)."""

from __future__ import annotations

from flwr_pfl.strategies.base import PFLStrategy


class PerFedAvg(PFLStrategy):
    """Per-FedAvg (Fallah et al., NeurIPS 2020, Alg. 1): the server is FedAvg's, the
    example-weighted mean of the clients' models after their meta steps (wire: all arrays, both
    ways). The meta steps and the one-step adaptation before evaluation are the client's
    (:class:`~flwr_pfl.clients.perfedavg.PerFedAvgClient`). Alg. 1 averages the sampled clients'
    models with equal weights (1 / rn); with clients of equal sizes the two coincide, and the
    suite weights by examples as every other averaging baseline here does (as PFLlib does)."""

    name = "per-fedavg"
