"""APFL's Strategy (Deng, Kamani and Mahdavi, 2020, Alg. 1)."""

from __future__ import annotations

from flwr_pfl.strategies.base import PFLStrategy


class APFL(PFLStrategy):
    """APFL (Deng et al., 2020, Alg. 1): the server averages the clients' copies w_i of the global
    model, example-weighted, as FedAvg (wire: all arrays, both ways). Each client's personal model
    v_i and mixing weight alpha_i never cross the wire; they are trained and kept client-side
    (:class:`~flwr_pfl.clients.apfl.APFLClient`)."""

    name = "apfl"
