"""Strategies of the baselines: FedAvg, Local, FedAvg + fine-tuning, FedRep, FedPer, FedProx,
FedProx + fine-tuning, FedBN, LG-FedAvg, FedBABU.

All of them aggregate with FedAvg's weighted average; they differ in what crosses the wire,
which the paired client decides (whole model, body only, head only, everything but the
normalisation layers, or nothing).
"""

from __future__ import annotations

from typing import Any

from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import PFLStrategy


class FedAvg(PFLStrategy):
    """FedAvg: sample-weighted average of the whole model (wire: all arrays)."""

    name = "fedavg"


class Finetune(PFLStrategy):
    """FedAvg + local fine-tuning at evaluation (wire: all arrays; fine-tuning is client-side)."""

    name = "finetune"


class FedProx(PFLStrategy):
    """FedProx (Li et al., MLSys 2020, Alg. 2): sample-weighted average of the whole model
    (wire: all arrays). The proximal term of Eq. 2 is the client's; the server is FedAvg's."""

    name = "fedprox"


class FedProxFinetune(PFLStrategy):
    """FedProx + local fine-tuning at evaluation (wire: all arrays; proximal training and
    fine-tuning are client-side)."""

    name = "fedprox-ft"


class FedBN(PFLStrategy):
    """FedBN (Li et al., ICLR 2021, Alg. 1): sample-weighted average of every layer except the
    normalisation layers (wire: the arrays outside them; they stay on the clients)."""

    name = "fedbn"


class FedBABU(PFLStrategy):
    """FedBABU (Oh et al., ICLR 2022, Alg. 1): sample-weighted average of the whole model (wire:
    all arrays). The clients never train the head, so its average is the initial head; the
    whole-model fine-tuning before evaluation is client-side."""

    name = "fedbabu"


class FedRep(PFLStrategy):
    """FedRep: sample-weighted average of the body (wire: body arrays; heads stay on clients)."""

    name = "fedrep"


class FedPer(PFLStrategy):
    """FedPer: sample-weighted average of the body (wire: body arrays; heads stay on clients)."""

    name = "fedper"


class LGFedAvg(PFLStrategy):
    """LG-FedAvg (Liang et al., 2020, Alg. 1): sample-weighted average of the global head
    (wire: head arrays; each client's local representation, the body, stays on it)."""

    name = "lg-fedavg"


class Local(PFLStrategy):
    """Local training: no model crosses the wire; the server only gathers metrics.

    Wire: every instruction and reply carries zero arrays. There is no global model, so
    ``evaluate_fn`` and non-empty initial arrays are refused.
    """

    name = "local"
    has_global_model = False  # nothing is shared
    refused_hooks = {"evaluate_fn": "local training has no global model to evaluate on the server (each client keeps its own)"}
    robust_refusal = "local training sends no model, so there is no update to clip or average"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.global_arrays:
            raise ConfigError(
                f"Local got {len(self.global_arrays)} initial arrays (initial_arrays / initial_parameters); local "
                "training sends no model, so it takes none (its clients reply with zero arrays)"
            )
