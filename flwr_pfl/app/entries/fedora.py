"""Registry entry of FEDORA (Wu et al., KDD '23): options and the AlgorithmSpec.

Every option is read from the run-config key ``fedora.<field-name>`` (kebab-case), e.g.
``fedora.lambda-rule``. The local optimizer, epochs and batch size are the common keys
(``learning-rate``, ``momentum``, ``weight-decay``, ``local-epochs``, ``batch-size``); the
presets in ``flwr_pfl/presets/fedora_*.toml`` set them to the official code's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr_pfl.app.keys import check_choice
from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fedora import FEDORAClient
from flwr_pfl.core import fedora as core
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.fedora import FEDORA, REPORT_ROUNDS

PRESETS = ("default", "paper", "official")


@dataclass(frozen=True)
class FedoraOptions:
    """FEDORA's options; the presets fill those left at "the preset's" ("" or -1).

    * ``default`` (the spec's recommendation, 9.3-9.8): the official code's sparse sharpened
      graph (``exp(10 s)``, top-2, no self-loops), ``alpha = 1`` (``kappa = 0.5``) as the paper,
      the paper's ``lambda = max(eps, Delta)``, the exact proximal gradient ``2 lambda (theta -
      theta_hat)`` added to the loss, the validation mean loss.
    * ``paper``: dense ``W = S`` with self-loops (Eq. 4), ``kappa = 0.5``, paper lambda rule,
      ``2 lambda`` in the loss, validation mean loss.
    * ``official``: ``exp(10 s)``, top-2, no self-loops, ``kappa = 0.8``, ``lambda = 0`` if
      ``Delta < 0`` else ``exp(Delta / 2)``, proximal ``lambda (theta_before - theta_hat)``
      applied after the momentum step, validation loss summed over batch means of 64.

    Attributes:
        preset: default, paper or official.
        p: subspace dimension (paper and code: 1).
        use_labels: append one-hot labels to the features (off: feature-only subspaces).
        center: subtract the column means before the SVD (code: off).
        label_scale: factor on the label columns (code: 1).
        graph_transform: exp or identity; "" = the preset's.
        temperature: tau of the exp transform, > 0; -1 = the preset's.
        top_k: neighbours kept per row, >= 1, 0 = dense; -1 = the preset's.
        self_loops: "on" or "off"; "" = the preset's.
        kappa: propagation probability in [0, 1); -1 = the preset's (see ``alpha``).
        alpha: graph weight of Eq. 1 (kappa = alpha / (1 + alpha)), >= 0; -1 = use ``kappa``.
        solver: closed_form (Eq. 6) or iterative (Eq. 7).
        num_iterations: m of the iterative solver.
        lambda_rule: paper, official or constant; "" = the preset's.
        epsilon: the paper rule's floor, > 0.
        lambda_constant: lambda of the constant rule (Table 5), >= 0.
        lambda_max: clip lambda at this value, > 0; 0 = no clip.
        on_nonfinite: no_transfer (a NaN/Inf validation loss gives the rule's floor: the client
            trains alone that round) or raise (the client's round fails).
        prox_factor: f in the proximal gradient f lambda (theta - theta_hat), > 0; -1 = preset's.
        prox_mode: loss or post_step; "" = the preset's.
        val_metric: loss or error_rate.
        val_reduction: mean or sum_of_batch_means; "" = the preset's.
        val_batch_size: batch size of sum_of_batch_means.
        local_baseline: train a LOCAL shadow model on every client for R-Acc and PTR.
        report_round: last or best_val: which round the ``reported_*`` metrics take.
        eval_aux: also evaluate theta_hat_k (sent at evaluation: one more model downlink).
        eval_every: evaluate every this many rounds and after the last one (code: 10).
    """

    preset: str = "default"
    p: int = 1
    use_labels: bool = True
    center: bool = False
    label_scale: float = 1.0
    graph_transform: str = ""
    temperature: float = -1.0
    top_k: int = -1
    self_loops: str = ""
    kappa: float = -1.0
    alpha: float = -1.0
    solver: str = "closed_form"
    num_iterations: int = 100
    lambda_rule: str = ""
    epsilon: float = 1e-8
    lambda_constant: float = 1.0
    lambda_max: float = 0.0
    on_nonfinite: str = "no_transfer"
    prox_factor: float = -1.0
    prox_mode: str = ""
    val_metric: str = "loss"
    val_reduction: str = ""
    val_batch_size: int = 64
    local_baseline: bool = True
    report_round: str = "last"
    eval_aux: bool = False
    eval_every: int = 1

    def __post_init__(self) -> None:
        check_choice("fedora.preset", self.preset, PRESETS)
        check_choice("fedora.graph-transform", self.graph_transform, ("", "exp", "identity"))
        check_choice("fedora.self-loops", self.self_loops, ("", "on", "off"))
        check_choice("fedora.solver", self.solver, ("closed_form", "iterative"))
        check_choice("fedora.lambda-rule", self.lambda_rule, ("", "paper", "official", "constant"))
        check_choice("fedora.on-nonfinite", self.on_nonfinite, ("no_transfer", "raise"))
        check_choice("fedora.prox-mode", self.prox_mode, ("", "loss", "post_step"))
        check_choice("fedora.val-metric", self.val_metric, ("loss", "error_rate"))
        check_choice("fedora.val-reduction", self.val_reduction, ("", "mean", "sum_of_batch_means"))
        check_choice("fedora.report-round", self.report_round, REPORT_ROUNDS)
        for key, value, low in (("p", self.p, 1), ("top-k", self.top_k, -1), ("num-iterations", self.num_iterations, 0),
                                ("val-batch-size", self.val_batch_size, 1), ("eval-every", self.eval_every, 1)):
            if value < low:
                raise ConfigError(f"fedora.{key}={value} is out of range; must be an integer >= {low}")
        for key, value, low_open in (("label-scale", self.label_scale, True), ("epsilon", self.epsilon, True),
                                     ("lambda-constant", self.lambda_constant, False),
                                     ("lambda-max", self.lambda_max, False)):
            if not math.isfinite(value) or value < 0 or (low_open and value == 0):
                raise ConfigError(f"fedora.{key}={value} is out of range; must be {'> 0' if low_open else '>= 0'}")
        for key, value in (("temperature", self.temperature), ("prox-factor", self.prox_factor)):
            if value != -1.0 and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"fedora.{key}={value} is out of range; must be > 0, or -1 (the preset's)")
        if self.kappa != -1.0 and not 0.0 <= self.kappa < 1.0:
            raise ConfigError(f"fedora.kappa={self.kappa} is out of range; must be in [0, 1), or -1 (the preset's)")
        if self.alpha != -1.0 and not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ConfigError(f"fedora.alpha={self.alpha} is out of range; must be >= 0, or -1 (use fedora.kappa)")
        if self.alpha != -1.0 and self.kappa != -1.0 and abs(core.kappa_from_alpha(self.alpha) - self.kappa) > 1e-9:
            raise ConfigError(f"fedora.alpha={self.alpha} and fedora.kappa={self.kappa} disagree "
                              "(kappa = alpha / (1 + alpha)); set only one of them")
        try:
            self.core_config()
        except ValueError as err:
            raise ConfigError(f"fedora options are inconsistent: {err}") from None

    def core_config(self) -> core.FedoraConfig:
        """The core's :class:`FedoraConfig`: the preset, then every option set explicitly."""
        base = core.FedoraConfig() if self.preset == "default" else core.fedora_preset(self.preset)  # type: ignore[arg-type]
        g, prop, sel, prox, val = base.graph, base.propagation, base.selection, base.prox, base.validation
        graph = core.GraphOptions(
            transform=self.graph_transform or g.transform,  # type: ignore[arg-type]
            temperature=g.temperature if self.temperature == -1.0 else self.temperature,
            top_k=g.top_k if self.top_k == -1 else (self.top_k or None),
            self_loops=g.self_loops if not self.self_loops else self.self_loops == "on",
        )
        kappa = prop.kappa
        if self.alpha != -1.0:
            kappa = core.kappa_from_alpha(self.alpha)
        elif self.kappa != -1.0:
            kappa = self.kappa
        return core.FedoraConfig(
            subspace=core.SubspaceOptions(p=self.p, use_labels=self.use_labels, center=self.center,
                                          label_scale=self.label_scale),
            graph=graph,
            propagation=core.PropagationOptions(kappa=kappa, solver=self.solver,  # type: ignore[arg-type]
                                                num_iterations=self.num_iterations),
            selection=core.LambdaOptions(
                rule=self.lambda_rule or sel.rule,  # type: ignore[arg-type]
                epsilon=self.epsilon,
                constant=self.lambda_constant,
                lambda_max=self.lambda_max or None,
                on_nonfinite=self.on_nonfinite,  # type: ignore[arg-type]
            ),
            prox=core.ProxOptions(
                factor=prox.factor if self.prox_factor == -1.0 else self.prox_factor,
                mode=self.prox_mode or prox.mode,  # type: ignore[arg-type]
            ),
            validation=core.ValidationOptions(
                metric=self.val_metric,  # type: ignore[arg-type]
                reduction=self.val_reduction or val.reduction,  # type: ignore[arg-type]
                batch_size=self.val_batch_size,
            ),
            training=base.training,
        )


def client_kwargs(options: FedoraOptions) -> dict[str, object]:
    return {"config": options.core_config(), "local_baseline": options.local_baseline}


def strategy_kwargs(options: FedoraOptions) -> dict[str, object]:
    return {
        "config": options.core_config(),
        "local_baseline": options.local_baseline,
        "report_round": options.report_round,
        "eval_aux": options.eval_aux,
    }


register(
    AlgorithmSpec(
        "fedora",
        FEDORA,
        FEDORAClient,
        "FEDORA: per-client auxiliary models by propagation over a data-similarity graph, selective proximal pull",
        options=FedoraOptions,
        client_kwargs=client_kwargs,
        strategy_kwargs=strategy_kwargs,
    )
)
