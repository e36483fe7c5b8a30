"""Registry entries of FedDAR (feddar, feddar-sa, feddar-wa) and the paper's baselines that need
their own server logic (separate-fedavg, fedavg-rw, fedavg-mh); plain FedAvg without
re-weighting is the suite's ``fedavg``. Also registers the dataset ``feddar-synthetic``.

``feddar``, ``feddar-sa`` and ``feddar-wa`` share one option section, ``feddar.<option>``;
``feddar-sa`` / ``feddar-wa`` fix the head aggregation, ``feddar`` reads ``feddar.aggregation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.keys import check_choice
from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.feddar import FedDARClient, ReweightedFedAvgClient, SeparateFedAvgClient
from flwr_pfl.core import feddar as core
from flwr_pfl.data.synthetic.feddar import register_feddar_synthetic
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.feddar import HESSIAN_UPLOADS, FedAvgMultiHead, FedDAR, ReweightedFedAvg, SeparateFedAvg

register_feddar_synthetic()


@dataclass(frozen=True)
class FedDAROptions:
    """FedDAR's options (run-config keys ``feddar.<option>``). Where the paper is silent the
    default is the specification's recommendation (its section 9), named here.

    Attributes:
        aggregation: head aggregation of ``algorithm="feddar"``: ``sa`` (Eq. 8, default) or ``wa``.
        head_epochs: tau_h, local epochs on the heads per round (default 5, the EXAM/FairFace value).
        rep_epochs: tau_phi, local epochs on the encoder per round (default 1, the EXAM value).
        head_solver: ``gd`` (default: tau_h epochs of the run's optimizer, Algorithm 1) or
            ``lstsq`` (exact local least-squares minimiser nearest to the global head, the
            tau_h -> infinity limit; squared loss only; the Fig. 1 setting).
        head_lr_scale: head-phase learning rate = ``learning-rate`` x this (default 1).
        lr_decay_round: from this round on (counting warmup) every learning rate is multiplied
            by ``lr_decay_factor`` (FairFace: 60 and 0.1); 0 (default) = constant.
        lr_decay_factor: see above (default 0.1).
        warmup_rounds: FedAvg + multi-head rounds (re-weighted loss, encoder and all heads)
            before FedDAR starts, counted in ``num-server-rounds`` (default 0, the EXAM value;
            FairFace 20, Digits 10); warmup_epochs: their local epochs (default 1).
        reweight: u_m = L / (L_m M) re-weighting of the encoder loss, Eq. 6 (default true).
        hessian_at: where SA's Hessian is evaluated: ``local`` (default, Algorithm 1) or
            ``global`` (the round-start head, Eq. 8's derivation); equal for squared loss.
        sa_weighting: SA client weights: ``domain_count`` (default, alpha_{i,m} = L_{i,m} with
            mean Hessians; SA = pooled least squares) or ``client_count`` (Eq. 7's alpha_i = L_i).
        sa_solver: ``damped`` (default: (A + lam I)^{-1}(b + lam w_prev), lam = sa_damping x
            trace(A)/P), ``pinv`` (pseudo-inverse, nearest to w_prev) or ``exact`` (Eq. 8 as
            written; a singular system keeps the previous heads for that round, with a warning).
        sa_damping: relative damping of ``damped`` (default 1e-6; 0 = the paper's Eq. 8).
        sa_fallback_to_wa: use WA for a domain whose cond(A) exceeds ``sa_cond_threshold``
            (default false).
        sa_cond_threshold: condition-number limit (default 1e12).
        sa_trust_radius: trust region of the damped solve (not in the paper): each SA head moves
            at most this many times the longest local head step of the round (default 1.0; 0 =
            off, the paper's unbounded Eq. 8). Applied to softmax heads only: their summed
            Hessian has many near-zero eigenvalues, along which Eq. 8's Newton step leaves the
            region where the clients' quadratic models hold (on the default experiment it moved
            the head 100 times farther than any client and the run diverged); squared-loss
            heads are solved exactly (SA = pooled least squares, Fig. 1 unchanged).
        cache_features: compute the frozen encoder's features once per head phase, in eval mode,
            and train the heads on them (default true; exact without data augmentation).
        max_hessian_params: refuse SA heads with more parameters than this (P = N (k + bias);
            default 4096, spec 8.5): use a small ``feature-dim``.
        hessian_upload: how SA's Hessians travel: ``full`` (default: M x P x P float64, exact),
            ``packed`` (each symmetric Hessian's upper triangle in float64, about half the bytes)
            or ``packed-float32`` (also in float32, about a quarter). On the default experiment
            (3 seeds, ``docs/benchmark/feddar/hessian_upload.md``) ``packed`` gave the same final
            accuracies as ``full`` at 7.0 instead of 13.6 MB per client and round, and
            ``packed-float32`` accuracies within the spread at 3.7 MB; ``full`` stays the default
            so that the committed reproductions keep their exact numbers.
    The head loss follows the task: squared error for regression, softmax cross-entropy
    (multi-class Hessian, spec 3.4) for classification.
    """

    aggregation: str = "sa"
    head_epochs: int = 5
    rep_epochs: int = 1
    head_solver: str = "gd"
    head_lr_scale: float = 1.0
    lr_decay_round: int = 0
    lr_decay_factor: float = 0.1
    warmup_rounds: int = 0
    warmup_epochs: int = 1
    reweight: bool = True
    hessian_at: str = "local"
    sa_weighting: str = "domain_count"
    sa_solver: str = "damped"
    sa_damping: float = 1e-6
    sa_fallback_to_wa: bool = False
    sa_cond_threshold: float = 1e12
    sa_trust_radius: float = 1.0
    cache_features: bool = True
    max_hessian_params: int = 4096
    hessian_upload: str = "full"

    def __post_init__(self) -> None:
        check_choice("feddar.aggregation", self.aggregation, tuple(a.value for a in core.HeadAggregation))
        check_choice("feddar.head-solver", self.head_solver, ("gd", "lstsq"))
        check_choice("feddar.hessian-at", self.hessian_at, tuple(a.value for a in core.HessianAt))
        check_choice("feddar.sa-weighting", self.sa_weighting, tuple(a.value for a in core.SAWeighting))
        check_choice("feddar.sa-solver", self.sa_solver, tuple(a.value for a in core.SASolver))
        check_choice("feddar.hessian-upload", self.hessian_upload, HESSIAN_UPLOADS)
        for field, value, low in (
            ("head-epochs", self.head_epochs, 0), ("rep-epochs", self.rep_epochs, 0),
            ("lr-decay-round", self.lr_decay_round, 0), ("warmup-rounds", self.warmup_rounds, 0),
            ("warmup-epochs", self.warmup_epochs, 0), ("max-hessian-params", self.max_hessian_params, 1),
        ):
            if value < low:
                raise ConfigError(f"feddar.{field}={value} is out of range; must be an integer >= {low}")
        for field, value in (("head-lr-scale", self.head_lr_scale), ("lr-decay-factor", self.lr_decay_factor)):
            if not value > 0:
                raise ConfigError(f"feddar.{field}={value} must be > 0")
        if not self.sa_damping >= 0:
            raise ConfigError(f"feddar.sa-damping={self.sa_damping} must be >= 0")
        if not self.sa_cond_threshold > 1:
            raise ConfigError(f"feddar.sa-cond-threshold={self.sa_cond_threshold} must be > 1")
        if not (math.isfinite(self.sa_trust_radius) and self.sa_trust_radius >= 0):
            raise ConfigError(f"feddar.sa-trust-radius={self.sa_trust_radius} must be a finite number >= 0")

    def sa_options(self) -> core.SAOptions:
        return core.SAOptions(self.sa_weighting, self.sa_solver, self.sa_damping, self.sa_fallback_to_wa,
                              self.sa_cond_threshold, self.sa_trust_radius)

    def strategy_kwargs(self, aggregation: str | None = None) -> dict:
        return {
            "aggregation": aggregation or self.aggregation,
            "head_epochs": self.head_epochs,
            "rep_epochs": self.rep_epochs,
            "warmup_rounds": self.warmup_rounds,
            "warmup_epochs": self.warmup_epochs,
            "head_solver": self.head_solver,
            "head_lr_scale": self.head_lr_scale,
            "lr_decay_round": self.lr_decay_round,
            "lr_decay_factor": self.lr_decay_factor,
            "hessian_at": self.hessian_at,
            "sa_options": self.sa_options(),
            "cache_features": self.cache_features,
            "max_hessian_params": self.max_hessian_params,
            "hessian_upload": self.hessian_upload,
            "reweight": self.reweight,
        }


def _per_domain(options, num_domains: int) -> int:
    return num_domains


for _name, _aggregation, _summary in (
    ("feddar", None, "FedDAR: shared encoder, one head per domain, WA/SA head aggregation (feddar.aggregation)"),
    ("feddar-sa", "sa", "FedDAR-SA: domain heads aggregated second-order (Eq. 8), re-weighted encoder"),
    ("feddar-wa", "wa", "FedDAR-WA: domain heads aggregated by count-weighted averaging, re-weighted encoder"),
):
    register(
        AlgorithmSpec(
            _name,
            FedDAR,
            FedDARClient,
            _summary,
            options=FedDAROptions,
            strategy_kwargs=(lambda o, a=_aggregation: o.strategy_kwargs(a)),
            num_heads=_per_domain,
            options_prefix="feddar",
        )
    )
register(AlgorithmSpec("separate-fedavg", SeparateFedAvg, SeparateFedAvgClient, "Separate FedAvg: one FedAvg model per domain"))
register(AlgorithmSpec("fedavg-rw", ReweightedFedAvg, ReweightedFedAvgClient, "FedAvg w/ RW: one model, u_m re-weighted loss"))
register(
    AlgorithmSpec(
        "fedavg-mh", FedAvgMultiHead, ReweightedFedAvgClient,
        "FedAvg + multi-head: one head per domain, trained jointly, re-weighted loss",
        num_heads=_per_domain,
    )
)
