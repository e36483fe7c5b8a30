"""FedRoD's server (Chen and Chao, ICLR 2022): FedAvg's."""

from __future__ import annotations

from flwr_pfl.strategies.base import PFLStrategy


class FedRoD(PFLStrategy):
    """FedRoD: sample-weighted average of the body and the generic head (wire: the whole user
    model, all arrays, both ways). The balanced softmax that trains the generic head and the
    personal head, which never leaves its client, are client-side
    (:class:`~flwr_pfl.clients.fedrod.FedRoDClient`)."""

    name = "fedrod"
