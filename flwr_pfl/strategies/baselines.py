"""Strategies of the baselines: FedAvg, Local, FedAvg + fine-tuning, FedRep, FedPer.

All of them aggregate with FedAvg's weighted average; they differ in what crosses the wire,
which the paired client decides (whole model, body only, or nothing).
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


class FedRep(PFLStrategy):
    """FedRep: sample-weighted average of the body (wire: body arrays; heads stay on clients)."""

    name = "fedrep"


class FedPer(PFLStrategy):
    """FedPer: sample-weighted average of the body (wire: body arrays; heads stay on clients)."""

    name = "fedper"


class Local(PFLStrategy):
    """Local training: no model crosses the wire; the server only gathers metrics.

    Wire: every instruction and reply carries zero arrays. There is no global model, so
    ``evaluate_fn`` and non-empty initial arrays are refused.
    """

    name = "local"
    refused_hooks = {"evaluate_fn": "local training has no global model to evaluate on the server (each client keeps its own)"}
    robust_refusal = "local training sends no model, so there is no update to clip or average"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.global_arrays:
            raise ConfigError(
                f"Local got {len(self.global_arrays)} initial arrays (initial_arrays / initial_parameters); local "
                "training sends no model, so it takes none (its clients reply with zero arrays)"
            )
