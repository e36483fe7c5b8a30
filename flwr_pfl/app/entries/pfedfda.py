"""Registry entry of pFedFDA (McLaughlin & Su, NeurIPS 2024): options and the AlgorithmSpec.

Every option is read from the run-config key ``pfedfda.<field-name>`` (kebab-case), e.g.
``pfedfda.beta-mode``. The participation probability q of the paper's Bernoulli sampling is
the common key ``fraction-fit`` (the paper uses q = 0.3 for CIFAR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.keys import check_choice
from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.pfedfda import STATS_SOURCES, PFedFDAClient
from flwr_pfl.core.pfedfda import BetaMode, BetaSolver, PFedFDAConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.pfedfda import SAMPLING_MODES, PFedFDA

PRESETS = ("default", "paper", "official")


@dataclass(frozen=True)
class PFedFDAOptions:
    """pFedFDA's options; defaults are what the spec recommends (shared/papers/pfedfda.md §9).

    Presets (``preset``) fill the options left at their "from the preset" value ("" for
    strings, -1 for numbers):

    * ``default``: single beta (the paper's Table 5 cross-check shows its tables use SB), the
      official code's L-BFGS solver and covariance regularization (+I ridge, +1e-4 on every
      entry): what produced the published numbers.
    * ``paper``: single beta, bounded golden-section solver (the paper's "L-BFGS-B"), ridge
      1e-4 * I with the nearest-PD repair (§4.2).
    * ``official``: the official code's defaults: separate (beta_mu, beta_Sigma), L-BFGS, +I ridge.

    Attributes:
        preset: default, paper or official.
        beta_mode: single, multi, local (beta = 1) or fixed; "" = the preset's.
        beta_solver: lbfgs or golden; "" = the preset's.
        beta_fixed: beta of ``beta_mode = fixed``, in [0, 1] (0 = global statistics only).
        k_folds: cross-validation folds for beta (Eq. 9), >= 2 (paper: 2).
        lbfgs_max_iter: L-BFGS iterations (code: 10).
        cov_ridge: multiple of I added to the local covariance, >= 0; -1 = the preset's.
        cov_const_add: constant added to every covariance entry, >= 0; -1 = the preset's.
        pd_repair: nearest-PD repair with identical variances (paper §4.2).
        lda_shrinkage: eps of the head's shrinkage towards tr(Sigma)/d I, in [0, 1) (code 1e-4).
        prior_eps: label-prior smoothing (code 1e-4), >= 0.
        min_class_count: at evaluation a class needs more than this many rows for its own mean
            (code's evaluation path: 2).
        fit_min_class_count: the same after local training (code's training path: 0, any
            class present).
        stats_source: where the round's statistics come from after training: all_epochs (the
            features of every local epoch, as the code), last_epoch, or fresh_pass (one
            eval-mode pass of the trained backbone).
        eval_drop_last: evaluation features drop the last partial batch, as the code's
            shuffled drop_last loader does (spec §9.7; default false: every sample).
        sampling: bernoulli (each client with probability q = fraction-fit, the paper) or
            fixed (a fixed fraction-fit share, Flower's usual sampling).
        full_last_round: all (training) clients take part in the last round (paper App. C.2).
        eval_every: evaluate every this many rounds and after the last one (0 = only the last).
        mean_init: initial global means: uniform U[0,1) (code) or gaussian N(0,1) (paper).
        train_clients: only partitions 0..train_clients-1 train; the others are evaluated as
            clients never seen in training (Table 4 protocol); 0 = all train.
        packed_cov: send Sigma as its upper triangle, d(d+1)/2 values (Table 8 counting).
    """

    preset: str = "default"
    beta_mode: str = ""
    beta_solver: str = ""
    beta_fixed: float = 0.5
    k_folds: int = 2
    lbfgs_max_iter: int = 10
    cov_ridge: float = -1.0
    cov_const_add: float = -1.0
    pd_repair: bool = True
    lda_shrinkage: float = 1e-4
    prior_eps: float = 1e-4
    min_class_count: int = 2
    fit_min_class_count: int = 0
    stats_source: str = "all_epochs"
    eval_drop_last: bool = False
    sampling: str = "bernoulli"
    full_last_round: bool = True
    eval_every: int = 1
    mean_init: str = "uniform"
    train_clients: int = 0
    packed_cov: bool = False

    def __post_init__(self) -> None:
        check_choice("pfedfda.preset", self.preset, PRESETS)
        check_choice("pfedfda.beta-mode", self.beta_mode, ("", *(m.value for m in BetaMode)))
        check_choice("pfedfda.beta-solver", self.beta_solver, ("", *(s.value for s in BetaSolver)))
        check_choice("pfedfda.stats-source", self.stats_source, STATS_SOURCES)
        check_choice("pfedfda.sampling", self.sampling, SAMPLING_MODES)
        check_choice("pfedfda.mean-init", self.mean_init, ("uniform", "gaussian"))
        _number("beta-fixed", self.beta_fixed, 0.0, 1.0)
        _number("lda-shrinkage", self.lda_shrinkage, 0.0, 1.0, high_open=True)
        _number("prior-eps", self.prior_eps, 0.0)
        for key, value in (("cov-ridge", self.cov_ridge), ("cov-const-add", self.cov_const_add)):
            if value != -1.0:
                _number(key, value, 0.0, extra="or -1 (the preset's)")
        for key, value, low in (
            ("k-folds", self.k_folds, 2),
            ("lbfgs-max-iter", self.lbfgs_max_iter, 1),
            ("min-class-count", self.min_class_count, 0),
            ("fit-min-class-count", self.fit_min_class_count, 0),
            ("eval-every", self.eval_every, 0),
            ("train-clients", self.train_clients, 0),
        ):
            if value < low:
                raise ConfigError(f"pfedfda.{key}={value} is out of range; must be an integer >= {low}")
        try:
            self.core_config()
        except ValueError as err:  # anything the core still refuses, with the key prefix
            raise ConfigError(f"pfedfda options are inconsistent: {err}") from None

    def core_config(self, *, fit: bool = False) -> PFedFDAConfig:
        """The core's :class:`PFedFDAConfig`: the preset, then every option set explicitly.

        ``fit=True`` gives the configuration of the path after local training (its own
        ``min_class_count``).
        """
        base = {"default": PFedFDAConfig(), "paper": PFedFDAConfig.paper(), "official": PFedFDAConfig.official_code()}[
            self.preset
        ]
        flat: dict[str, object] = {
            "beta_fixed": self.beta_fixed,
            "k_folds": self.k_folds,
            "lbfgs_max_iter": self.lbfgs_max_iter,
            "pd_repair": self.pd_repair,
            "lda_shrinkage": self.lda_shrinkage,
            "prior_eps": self.prior_eps,
            "min_class_count": self.fit_min_class_count if fit else self.min_class_count,
        }
        if self.beta_mode:
            flat["beta_mode"] = self.beta_mode
        if self.beta_solver:
            flat["beta_solver"] = self.beta_solver
        if self.cov_ridge != -1.0:
            flat["cov_ridge"] = self.cov_ridge
        if self.cov_const_add != -1.0:
            flat["cov_const_add"] = self.cov_const_add
        return PFedFDAConfig.from_flat(flat, base=base)


def _number(key: str, value: float, low: float, high: float | None = None, *, high_open: bool = False, extra: str = "") -> None:
    ok = math.isfinite(value) and value >= low and (high is None or (value < high if high_open else value <= high))
    if not ok:
        where = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"pfedfda.{key}={value} is out of range; must be {where}{' ' + extra if extra else ''}")


def client_kwargs(options: PFedFDAOptions) -> dict[str, object]:
    return {
        "config": options.core_config(),
        "fit_config": options.core_config(fit=True),
        "stats_source": options.stats_source,
        "eval_drop_last": options.eval_drop_last,
        "packed_cov": options.packed_cov,
    }


def strategy_kwargs(options: PFedFDAOptions) -> dict[str, object]:
    return {
        "sampling": options.sampling,
        "full_last_round": options.full_last_round,
        "mean_init": options.mean_init,
        "train_clients": options.train_clients,
        "packed_cov": options.packed_cov,
    }


register(
    AlgorithmSpec(
        "pfedfda",
        PFedFDA,
        PFedFDAClient,
        "pFedFDA: backbone trained against a global Gaussian (LDA) head, statistics adapted per client",
        options=PFedFDAOptions,
        client_kwargs=client_kwargs,
        strategy_kwargs=strategy_kwargs,
    )
)
