"""Registry entry of FedAvg+FMTL (Liu, Yang and Shen, ISIT 2023): options ``fmtl.<option>``."""

from __future__ import annotations

from dataclasses import dataclass

from flwr_pfl.app.keys import check_choice
from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fmtl import FedFMTLClient
from flwr_pfl.core.fmtl import (
    Augmentation,
    BodyWeighting,
    EmptyHolderPolicy,
    Eq10Options,
    FMTLWeightingOptions,
    HeadLoss,
    HeadWeighting,
    ParticipationPolicy,
)
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.fmtl import HEAD_LAYOUTS, UPLOADS, FedFMTL


@dataclass(frozen=True)
class FMTLOptions:
    """FedAvg+FMTL options (run-config keys ``fmtl.<field-name>``).

    Defaults are the paper's where it states them and the spec's recommendations elsewhere:

    * ``t1_rounds`` = -1: FedAvg rounds before the head-only rounds; -1 = the first half of
      ``num-server-rounds`` (rounded up), so that any run has both phases (the paper's presets
      set T1 = 100 of T = 110); the remaining ``num-server-rounds - t1-rounds`` rounds train the
      heads only. A T1 not below ``num-server-rounds`` is refused (the run would be FedAvg).
    * ``head_weighting`` = ``fmtl_eq12`` (paper eq. 12); also ``fmtl_eq10`` (problem 10 solved
      numerically from feature second moments; a different method), ``uniform``, ``num_examples``,
      ``ew_participants`` (the paper's EW baseline, recommended reading), ``ew_holders``.
    * ``participation`` = ``round_local`` (spec P1 (a): eq. 12 over the round's participants);
      ``population_renorm``, ``population_unbiased_delta`` use the registry of task sets.
    * ``empty_holder`` = ``keep`` (a head no participant holds keeps its value); ``renormalize``,
      ``error``.
    * ``body_weighting`` = ``uniform`` (FedRep code) or ``num_examples`` (Flower's FedAvg).
    * ``head_loss`` = ``ce`` (spec P3), ``mse`` (regression), ``mse_onehot``, ``bce_ovr``;
      ``augmentation`` = ``augmented`` (eq. 5) or ``original`` (eq. 3).
    * ``head_layout`` = ``stacked`` (tasks are the classes of one output layer) or ``per-head``
      (one head per domain, each a task; regression).
    * ``upload`` = ``head_only`` (phase-2 replies carry only the heads) or ``full``.
    * ``min_count`` = 1 (spec P9), ``phase2_fraction_fit`` = 0 (same as fraction-fit),
      ``phase2_epochs`` = 0 (the local epochs, spec P11), ``prox_mu`` = 0 (FedAvg; 0.1 for the
      paper's FedProx+FMTL), ``phase2_prox`` = false (spec Sec. 4 item 2).
    * ``eq10_restarts`` = 8, ``eq10_ridge`` = 0.0: the problem-(10) solver.
    """

    t1_rounds: int = -1
    head_weighting: str = "fmtl_eq12"
    participation: str = "round_local"
    empty_holder: str = "keep"
    body_weighting: str = "uniform"
    head_loss: str = "ce"
    augmentation: str = "augmented"
    head_layout: str = "stacked"
    upload: str = "head_only"
    min_count: int = 1
    phase2_fraction_fit: float = 0.0
    phase2_epochs: int = 0
    prox_mu: float = 0.0
    phase2_prox: bool = False
    eq10_restarts: int = 8
    eq10_ridge: float = 0.0

    def __post_init__(self) -> None:
        for name, allowed in (
            ("head_weighting", [m.value for m in HeadWeighting]),
            ("participation", [m.value for m in ParticipationPolicy]),
            ("empty_holder", [m.value for m in EmptyHolderPolicy]),
            ("body_weighting", [m.value for m in BodyWeighting]),
            ("head_loss", [m.value for m in HeadLoss]),
            ("augmentation", [m.value for m in Augmentation]),
            ("head_layout", list(HEAD_LAYOUTS)),
            ("upload", list(UPLOADS)),
        ):
            check_choice(_key(name), getattr(self, name), allowed)
        for name, low in (("t1_rounds", -1), ("min_count", 1), ("phase2_epochs", 0), ("eq10_restarts", 0)):
            if getattr(self, name) < low:
                raise ConfigError(f"{_key(name)}={getattr(self, name)} is out of range; must be >= {low}")
        if not 0.0 <= self.phase2_fraction_fit <= 1.0:
            raise ConfigError(f"fmtl.phase2-fraction-fit={self.phase2_fraction_fit} must be in [0, 1] (0 = fraction-fit)")
        for name in ("prox_mu", "eq10_ridge"):
            if not getattr(self, name) >= 0.0:
                raise ConfigError(f"{_key(name)}={getattr(self, name)} must be >= 0")
        if self.head_loss == "ce" and self.augmentation == "original":
            raise ConfigError(
                "fmtl.head-loss='ce' is always augmented (the softmax couples the heads); with "
                "fmtl.augmentation='original' use fmtl.head-loss 'mse_onehot' or 'bce_ovr'"
            )

    def weighting(self) -> FMTLWeightingOptions:
        return FMTLWeightingOptions(
            HeadWeighting(self.head_weighting), ParticipationPolicy(self.participation),
            EmptyHolderPolicy(self.empty_holder),
            Eq10Options(restarts=self.eq10_restarts, ridge=self.eq10_ridge),
        )


def _key(name: str) -> str:
    return "fmtl." + name.replace("_", "-")


def _strategy_kwargs(o: FMTLOptions) -> dict:
    return {
        "t1_rounds": None if o.t1_rounds < 0 else o.t1_rounds, "weighting": o.weighting(), "body_weighting": o.body_weighting,
        "augmentation": o.augmentation, "min_count": o.min_count, "upload": o.upload,
        "head_layout": o.head_layout, "phase2_fraction_fit": o.phase2_fraction_fit,
    }


def _client_kwargs(o: FMTLOptions) -> dict:
    return {
        "head_loss": o.head_loss, "augmentation": o.augmentation, "prox_mu": o.prox_mu,
        "phase2_prox": o.phase2_prox, "phase2_epochs": o.phase2_epochs,
    }


register(
    AlgorithmSpec(
        "fmtl",
        FedFMTL,
        FedFMTLClient,
        "FedAvg+FMTL: FedAvg, then head-only rounds with per-task client weights (eq. 12)",
        options=FMTLOptions,
        client_kwargs=_client_kwargs,
        strategy_kwargs=_strategy_kwargs,
        num_heads=lambda o, num_domains: num_domains if o.head_layout == "per-head" else 1,
    )
)
