"""Ditto's Strategy (Li, Hu, Beirami and Smith, ICML 2021, Alg. 1)."""

from __future__ import annotations

from flwr_pfl.strategies.base import PFLStrategy


class Ditto(PFLStrategy):
    """Ditto (Li et al., ICML 2021, Alg. 1) with FedAvg as its global solver: the sample-weighted
    average of the clients' global models (wire: all arrays, both ways). Each client's personal
    model v_k (Eq. 2) never crosses the wire; it is trained and kept client-side
    (:class:`~flwr_pfl.clients.ditto.DittoClient`)."""

    name = "ditto"
