"""Strategies of the baselines: FedAvg, Local, FedAvg + fine-tuning, FedRep, FedPer.

All of them aggregate with FedAvg's weighted average; they differ in what crosses the wire,
which the paired client decides (whole model, body only, or nothing).
"""

from __future__ import annotations

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

    Wire: every instruction and reply carries zero arrays.
    """

    name = "local"
