"""FEDORA's options: option types and dataclasses, :class:`FedoraConfig` and the presets.

Every choice where the paper and the official code differ (graph rule, ``kappa``, the ``lambda``
rule of Eq. 8, the proximal factor and mode of Eq. 9, the validation reduction) is a named field;
:func:`fedora_preset` gives the ``"paper"`` and ``"official"`` settings (spec 3.6-3.7).
:func:`kappa_from_alpha` / :func:`alpha_from_kappa` convert the graph weight ``alpha`` of Eq. 1 and
Eq. 3 into the propagation probability ``kappa`` (Lemma 4.2).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Union, get_args

import numpy as np
import torch


Preset = Literal["paper", "official", "official_code"]
"""``paper``: the paper's literal method. ``official`` (alias ``official_code``): the released code."""


SimilarityTransform = Literal["identity", "exp"]
"""``identity``: ``w = s`` (paper, Eq. 4). ``exp``: ``w = exp(tau * s)`` (official code)."""


PropagationSolver = Literal["closed_form", "iterative"]
"""``closed_form``: Eq. 6 with the precomputed ``M``. ``iterative``: ``m`` steps of Eq. 7."""


LambdaRule = Literal["paper", "official", "constant"]
"""``paper``: ``max(eps, Delta)`` (Eq. 8). ``official``: ``0 if Delta < 0 else exp(Delta / 2)``.
``constant``: the same ``c`` for every client (Table 5 ablation)."""


NonFinitePolicy = Literal["raise", "no_transfer"]
"""What a NaN/Inf validation loss does: raise ``ValueError``, or set ``lambda`` to the rule's floor."""


ProxMode = Literal["loss", "post_step"]
"""``loss``: the proximal term is added to the loss (its gradient goes through the optimizer,
momentum and weight decay included; Eq. 9). ``post_step``: the official code's correction
``theta <- theta - lr * f * lambda * (theta_before_step - theta_hat)`` after the optimizer step."""


ValidationMetric = Literal["loss", "error_rate"]
"""What ``L~_k`` in Eq. 8 measures on the validation set: the task loss, or the error rate."""


ValidationReduction = Literal["mean", "sum_of_batch_means"]
"""``mean``: mean over all validation samples. ``sum_of_batch_means``: the official code's sum over
validation mini-batches of the batch-mean loss (equal to ``mean`` for a single batch)."""


TaskLoss = Literal["cross_entropy", "mse"]
"""Cross-entropy for classification, mean squared error for regression (agriculture, Table 2)."""


ArrayLike = Union[np.ndarray, Sequence[float], float]


TensorOrArray = Union[torch.Tensor, np.ndarray]


def _check_choice(name: str, value: object, choices: object) -> None:
    """Raise ``ValueError`` unless ``value`` is one of the ``Literal`` type's members."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {list(allowed)}")


def _check_finite_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} must be {bound}")


def kappa_from_alpha(alpha: float) -> float:
    """Return ``kappa = alpha / (1 + alpha)`` (Lemma 4.2), the propagation probability.

    ``alpha`` >= 0 is the weight of the graph term in Eq. 1 and Eq. 3; ``alpha = 1`` (the paper)
    gives ``kappa = 0.5`` and ``alpha = 4`` gives the official code's ``kappa = 0.8``.
    """
    _check_finite_positive("alpha", alpha, allow_zero=True)
    return float(alpha) / (1.0 + float(alpha))


def alpha_from_kappa(kappa: float) -> float:
    """Inverse of :func:`kappa_from_alpha`: ``alpha = kappa / (1 - kappa)`` for ``kappa in [0, 1)``."""
    if not isinstance(kappa, numbers.Real) or isinstance(kappa, bool) or not (0.0 <= kappa < 1.0):
        raise ValueError(f"kappa={kappa!r} must lie in [0, 1)")
    return float(kappa) / (1.0 - float(kappa))


@dataclass(frozen=True)
class SubspaceOptions:
    """How a client builds its subspace ``U_k`` (Section 4.2.1; Algorithm 1 line 2).

    Attributes:
        p: subspace dimension; 1 in every experiment of the paper and in the official code.
        use_labels: append the (one-hot) labels to the features, ``Z = [X | Y]`` (default True,
            paper and code). False gives the feature-only subspace needed for unlabeled new
            clients (Algorithm 2), and must then be used for *all* clients.
        center: subtract the column means of ``Z`` before the SVD (default False, as the code;
            without centering and with ``p = 1``, ``U_k`` is close to the direction of the mean
            ``[x, onehot(y)]``).
        label_scale: factor applied to the label columns (default 1.0, as the code).
        rank_rtol: a client whose ``p``-th singular value is at most ``rank_rtol`` times its
            largest cannot define a ``p``-dimensional subspace (all-zero or rank-deficient data);
            :func:`client_subspace` raises ``ValueError``. Default 1e-7, the resolution of the
            float64 Gram-matrix path.
    """

    p: int = 1
    use_labels: bool = True
    center: bool = False
    label_scale: float = 1.0
    rank_rtol: float = 1e-7

    def __post_init__(self) -> None:
        if not isinstance(self.p, int) or isinstance(self.p, bool) or self.p < 1:
            raise ValueError(f"p={self.p!r} must be an integer >= 1")
        _check_finite_positive("label_scale", self.label_scale)
        _check_finite_positive("rank_rtol", self.rank_rtol)


@dataclass(frozen=True)
class GraphOptions:
    """How the server turns similarities ``s_kk'`` into the graph ``W`` (Eq. 4; spec 3.2).

    The default is the official code's sparse, sharpened graph, which the specification
    recommends (the paper's dense graph is nearly uniform because the raw similarities lie in a
    narrow band, so propagation degenerates to heavy averaging).

    Attributes:
        transform: ``"exp"`` (default, code: ``w = exp(temperature * s)``) or ``"identity"``
            (paper: ``w = s``).
        temperature: the sharpening ``tau`` of the ``exp`` transform (default 10.0, code).
        top_k: keep only each row's ``top_k`` largest off-diagonal weights (default 2, code);
            ``None`` keeps all (paper). Ties are broken towards the lower client index.
        self_loops: keep ``w_kk`` (paper: True, ``w_kk = p``); the code zeroes the diagonal
            (default False). Self-loops are never subject to ``top_k``.
    """

    transform: SimilarityTransform = "exp"
    temperature: float = 10.0
    top_k: int | None = 2
    self_loops: bool = False

    def __post_init__(self) -> None:
        _check_choice("transform", self.transform, SimilarityTransform)
        _check_finite_positive("temperature", self.temperature)
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise ValueError(f"top_k={self.top_k!r} must be None (dense) or an integer >= 1")


@dataclass(frozen=True)
class PropagationOptions:
    """The server's propagation step (Eq. 6 / Eq. 7).

    Attributes:
        kappa: propagation probability ``kappa = alpha / (1 + alpha)`` in ``[0, 1)``. Default 0.5
            (``alpha = 1``, the paper); the official code hard-codes 0.8. Use
            :meth:`from_alpha` to give ``alpha`` instead.
        solver: ``"closed_form"`` (default; Eq. 6 with ``M`` built once by a linear solve) or
            ``"iterative"`` (Eq. 7 from ``Theta_hat^(0) = Theta``).
        num_iterations: ``m`` for the iterative solver (default 100; the error after ``m`` steps is
            at most ``kappa^m`` times the initial one, in the max-row norm).
    """

    kappa: float = 0.5
    solver: PropagationSolver = "closed_form"
    num_iterations: int = 100

    def __post_init__(self) -> None:
        alpha_from_kappa(self.kappa)  # validates the range
        _check_choice("solver", self.solver, PropagationSolver)
        if not isinstance(self.num_iterations, int) or self.num_iterations < 0:
            raise ValueError(f"num_iterations={self.num_iterations!r} must be an integer >= 0")

    @classmethod
    def from_alpha(cls, alpha: float, **kwargs: object) -> PropagationOptions:
        """Options with ``kappa = alpha / (1 + alpha)``."""
        return cls(kappa=kappa_from_alpha(alpha), **kwargs)  # type: ignore[arg-type]

    @property
    def alpha(self) -> float:
        """``alpha = kappa / (1 - kappa)``."""
        return alpha_from_kappa(self.kappa)


@dataclass(frozen=True)
class LambdaOptions:
    """The client's selection weight ``lambda_k`` (Eq. 8; Algorithm 1 line 10).

    Attributes:
        rule: ``"paper"`` (default): ``max(epsilon, Delta)``; ``"official"``: ``0`` if
            ``Delta < 0`` else ``exp(Delta / 2)`` (so ``lambda = 1`` in round 0, where
            ``theta_k = theta_hat_k``); ``"constant"``: ``constant`` for everyone (Table 5).
            ``Delta = L~(theta_k) - L~(theta_hat_k)``.
        epsilon: the paper's floor (default 1e-8); must be > 0.
        constant: the value of the ``"constant"`` rule (default 1.0; the paper tries
            0.01, 0.1, 1, 10).
        lambda_max: optional upper clip. ``None`` (default) clips nothing. With learning rate
            ``lr`` and proximal factor ``f``, steps stay stable for
            ``lambda <= max_stable_lambda(lr, f) = 1 / (f * lr)``.
        on_nonfinite: a NaN/Inf validation loss raises ``ValueError`` (default ``"raise"``) or,
            with ``"no_transfer"``, sets ``lambda`` to the rule's floor (``epsilon`` for the paper
            rule, 0 for the official rule).
    """

    rule: LambdaRule = "paper"
    epsilon: float = 1e-8
    constant: float = 1.0
    lambda_max: float | None = None
    on_nonfinite: NonFinitePolicy = "raise"

    def __post_init__(self) -> None:
        _check_choice("rule", self.rule, LambdaRule)
        _check_finite_positive("epsilon", self.epsilon)
        _check_finite_positive("constant", self.constant, allow_zero=True)
        if self.lambda_max is not None:
            _check_finite_positive("lambda_max", self.lambda_max)
        _check_choice("on_nonfinite", self.on_nonfinite, NonFinitePolicy)


@dataclass(frozen=True)
class ProxOptions:
    """The proximal term ``lambda ||theta - theta_hat||^2`` of Eq. 2 / Eq. 9.

    Attributes:
        factor: the proximal gradient is ``factor * lambda * (theta - theta_hat)``. 2.0
            (default, the exact gradient of Eq. 9) or 1.0 (the official code, an effective
            regulariser ``(lambda / 2) ||theta - theta_hat||^2``).
        mode: ``"loss"`` (default; the term is added to the loss and goes through the optimizer)
            or ``"post_step"`` (the official code: applied after the optimizer step, with the
            parameters from before the step, bypassing momentum and weight decay).
    """

    factor: float = 2.0
    mode: ProxMode = "loss"

    def __post_init__(self) -> None:
        _check_finite_positive("factor", self.factor)
        _check_choice("mode", self.mode, ProxMode)


@dataclass(frozen=True)
class ValidationOptions:
    """How ``L~_k`` of Eq. 8 is computed on the client's validation set.

    Attributes:
        metric: ``"loss"`` (default; the code uses cross-entropy) or ``"error_rate"``.
        reduction: ``"mean"`` over all samples (default) or the code's ``"sum_of_batch_means"``
            (which scales ``Delta`` with the number of validation batches; equal to ``"mean"``
            when the validation set fits in one batch, as in the paper's 64-sample splits).
        batch_size: the batch size of ``"sum_of_batch_means"`` (default 64, code).
    """

    metric: ValidationMetric = "loss"
    reduction: ValidationReduction = "mean"
    batch_size: int = 64

    def __post_init__(self) -> None:
        _check_choice("metric", self.metric, ValidationMetric)
        _check_choice("reduction", self.reduction, ValidationReduction)
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} must be an integer >= 1")


@dataclass(frozen=True)
class LocalTrainingOptions:
    """Client optimiser settings (Eq. 9; Algorithm 1 lines 11-13).

    The paper gives none of these; the defaults are the official code's (SGD, lr 5e-3,
    momentum 0.9, weight decay 5e-5, 5 local epochs, batch 64), which the specification
    recommends for both presets. The optimizer (and its momentum) is re-created every round.
    """

    lr: float = 5e-3
    momentum: float = 0.9
    weight_decay: float = 5e-5
    local_epochs: int = 5
    batch_size: int = 64
    loss: TaskLoss = "cross_entropy"

    def __post_init__(self) -> None:
        _check_finite_positive("lr", self.lr)
        _check_finite_positive("momentum", self.momentum, allow_zero=True)
        _check_finite_positive("weight_decay", self.weight_decay, allow_zero=True)
        if not isinstance(self.local_epochs, int) or self.local_epochs < 1:
            raise ValueError(f"local_epochs={self.local_epochs!r} must be an integer >= 1")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} must be an integer >= 1")
        _check_choice("loss", self.loss, TaskLoss)


@dataclass(frozen=True)
class FedoraConfig:
    """All FEDORA options. ``FedoraConfig()`` is the recommended default:

    the official code's sparse sharpened graph (top-2, ``exp(10 s)``, no self-loops), ``alpha = 1``
    (``kappa = 0.5``, the paper), the paper's ``lambda`` rule with ``epsilon = 1e-8``, the exact
    proximal gradient ``2 lambda (theta - theta_hat)`` added to the loss, the validation mean loss,
    ``p = 1`` without centering, and the code's optimiser settings. See :func:`fedora_preset`.
    """

    subspace: SubspaceOptions = field(default_factory=SubspaceOptions)
    graph: GraphOptions = field(default_factory=GraphOptions)
    propagation: PropagationOptions = field(default_factory=PropagationOptions)
    selection: LambdaOptions = field(default_factory=LambdaOptions)
    prox: ProxOptions = field(default_factory=ProxOptions)
    validation: ValidationOptions = field(default_factory=ValidationOptions)
    training: LocalTrainingOptions = field(default_factory=LocalTrainingOptions)


def fedora_preset(name: Preset) -> FedoraConfig:
    """Return the settings of a preset (spec 3.6-3.7).

    * ``"paper"``: dense graph ``w = sum cos zeta`` with self-loops (Eq. 4), ``alpha = 1``,
      ``lambda = max(1e-8, Delta)`` (Eq. 8), proximal gradient ``2 lambda (theta - theta_hat)``
      in the loss (Eq. 9), validation mean loss.
    * ``"official"`` (alias ``"official_code"``): ``w = exp(10 s)``, no self-loops, top-2
      neighbours, ``kappa = 0.8``, ``lambda = 0 if Delta < 0 else exp(Delta / 2)``, proximal
      gradient ``lambda (theta - theta_hat)`` applied after the momentum step, validation loss
      summed over batch means of 64.

    Both use ``p = 1`` without centering and the code's optimiser (unspecified in the paper).
    """
    _check_choice("preset", name, Preset)
    if name == "paper":
        return FedoraConfig(
            graph=GraphOptions(transform="identity", top_k=None, self_loops=True),
            propagation=PropagationOptions(kappa=0.5),
            selection=LambdaOptions(rule="paper", epsilon=1e-8),
            prox=ProxOptions(factor=2.0, mode="loss"),
            validation=ValidationOptions(metric="loss", reduction="mean"),
        )
    return FedoraConfig(
        graph=GraphOptions(transform="exp", temperature=10.0, top_k=2, self_loops=False),
        propagation=PropagationOptions(kappa=0.8),
        selection=LambdaOptions(rule="official"),
        prox=ProxOptions(factor=1.0, mode="post_step"),
        validation=ValidationOptions(metric="loss", reduction="sum_of_batch_means", batch_size=64),
    )
