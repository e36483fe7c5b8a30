"""FEDORA: personalized federated learning with parameter propagation (Wu et al., KDD 2023).

The mathematics of FEDORA as plain functions on NumPy arrays and torch tensors, free of Flower.
Equation, algorithm-line, lemma and theorem numbers refer to the paper
(*Personalized Federated Learning with Parameter Propagation*, KDD '23).

Overview (Algorithm 1)
----------------------
* **Client, once (lines 1-3).** :func:`client_subspace` turns the client's training data
  ``Z_k = [X_k | onehot(Y_k)]`` (``n_k x (d_x + C)``) into the top-``p`` right singular vectors
  ``U_k`` (``(d_x + C) x p``, orthonormal columns). ``U_k`` is uploaded.
* **Server, once (line 5).** :func:`build_propagation_graph` computes the principal-angle
  similarity ``s_kk' = sum_i cos zeta_i`` (Eq. 4-5), turns it into a graph ``W`` (the paper's dense
  rule, or the official code's sharpened top-k rule), the row-stochastic ``P = D^-1 W`` and the
  propagation matrix ``M = (1 - kappa) (I - kappa P)^-1`` (Eq. 6), ``kappa = alpha / (1 + alpha)``.
* **Client, every round (lines 10-14).** :func:`selection_weight` sets ``lambda_k`` from the
  validation losses of the personalized model ``theta_k`` and the received auxiliary model
  ``theta_hat_k`` (Eq. 8); local training minimises ``CE + lambda_k ||theta_k - theta_hat_k||^2``
  (Eq. 9) with :func:`proximal_penalty` (added to the loss) or :func:`apply_proximal_correction_`
  (the official code's post-step correction).
* **Server, every round (line 16).** :func:`server_update` writes the uploaded ``theta_k`` into a
  ``K x P`` buffer of last-known personalized models and recomputes every ``theta_hat_k`` in place
  (Eq. 6 closed form, or Eq. 7 iterations).
* **Evaluation.** :func:`transfer_summary` gives the mean score, R-Acc (Def. 3.2) and PTR
  (Def. 3.3) against LOCAL.
* **New clients (Algorithm 2).** :func:`new_client_auxiliary_model` gives ``theta_hat`` for a
  client that joins after training, from its subspace alone.

Wire layout (what the Flower layer moves)
-----------------------------------------
* setup, client -> server: ``[U_k]`` (one float array ``(d_x + C) x p``), ``num_examples = n_k``;
* round, server -> client k: ``theta_hat_k`` as the model's list of arrays
  (:meth:`ParameterLayout.unflatten` of row k of the ``theta_hat`` buffer: views, no copies);
* round, client -> server: ``theta_k`` as the model's list of arrays
  (:meth:`ParameterLayout.flatten` into row k of the ``theta`` buffer); scalar metrics
  ``lambda``, ``val_loss_personal``, ``val_loss_aux``.

Presets
-------
:func:`fedora_preset` returns ``"paper"`` or ``"official"`` (alias ``"official_code"``) settings;
``FedoraConfig()`` holds the recommended defaults. Every difference between the two presets is a
named field of the option dataclasses below.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Union, get_args

import numpy as np
import torch

__all__ = [
    # option types
    "Preset",
    "SimilarityTransform",
    "PropagationSolver",
    "LambdaRule",
    "NonFinitePolicy",
    "ProxMode",
    "ValidationMetric",
    "ValidationReduction",
    "TaskLoss",
    "SubspaceOptions",
    "GraphOptions",
    "PropagationOptions",
    "LambdaOptions",
    "ProxOptions",
    "ValidationOptions",
    "LocalTrainingOptions",
    "FedoraConfig",
    "fedora_preset",
    "kappa_from_alpha",
    "alpha_from_kappa",
    # client side
    "data_matrix",
    "client_subspace",
    "per_sample_errors",
    "validation_error",
    "selection_weight",
    "max_stable_lambda",
    "proximal_penalty",
    "proximal_gradient",
    "apply_proximal_correction_",
    # server side
    "validate_subspace",
    "principal_angle_cosines",
    "subspace_similarity",
    "cosine_similarity_matrix",
    "random_similarity",
    "similarity_graph",
    "row_normalize",
    "propagation_matrix",
    "PropagationGraph",
    "build_propagation_graph",
    "propagation_graph_from_similarity",
    "propagate",
    "propagate_iterative",
    "server_objective",
    "ParameterLayout",
    "init_server_buffers",
    "validate_upload",
    "server_update",
    "new_client_auxiliary_model",
    # metrics
    "relative_improvement",
    "positive_transfer_ratio",
    "lambda_activity",
    "TransferSummary",
    "transfer_summary",
]

# ---------------------------------------------------------------------------------------------
# Option types
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Option dataclasses and presets
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Client side: subspace (Algorithm 1 lines 1-3)
# ---------------------------------------------------------------------------------------------


def data_matrix(
    features: np.ndarray,
    labels: np.ndarray | None = None,
    *,
    num_classes: int | None = None,
    options: SubspaceOptions = SubspaceOptions(),
) -> np.ndarray:
    """Build ``Z_k = [X_k | label_scale * Y_k]`` (the paper's ``X_k o Y_k``, Section 4.2.1).

    Args:
        features: ``(n, ...)``; each sample is flattened to ``d_x`` values.
        labels: ``(n,)`` integer classes (one-hot encoded with ``num_classes`` columns) or, when
            ``num_classes`` is None, real-valued targets ``(n,)`` or ``(n, t)`` appended as they are
            (regression). Ignored when ``options.use_labels`` is False.
        num_classes: ``C`` for one-hot labels.
        options: see :class:`SubspaceOptions`.

    Returns:
        ``Z`` of shape ``(n, d_x + C)`` (or ``(n, d_x)`` without labels), float64, centred by
        column if ``options.center``.
    """
    x = np.asarray(features)
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"features must have shape (n, ...) with n >= 1, got {x.shape}")
    n = x.shape[0]
    x = x.reshape(n, -1).astype(np.float64)
    blocks = [x]
    if options.use_labels:
        if labels is None:
            raise ValueError("labels are required when use_labels=True; pass use_labels=False "
                             "for a feature-only subspace")
        y = np.asarray(labels)
        if y.shape[0] != n:
            raise ValueError(f"labels have {y.shape[0]} rows but features have {n}")
        if num_classes is not None:
            if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
                raise ValueError("one-hot labels must be a 1-D integer array; "
                                 "pass num_classes=None for real-valued targets")
            if num_classes < 1 or y.min() < 0 or y.max() >= num_classes:
                raise ValueError(f"labels must lie in [0, num_classes={num_classes})")
            onehot = np.zeros((n, num_classes), dtype=np.float64)
            onehot[np.arange(n), y] = 1.0
            blocks.append(options.label_scale * onehot)
        else:
            blocks.append(options.label_scale * y.reshape(n, -1).astype(np.float64))
    z = np.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0]
    if not np.all(np.isfinite(z)):
        raise ValueError("client data contain NaN or Inf; the subspace needs finite data")
    if options.center:
        z = z - z.mean(axis=0, keepdims=True)
    return z


def _orient_columns(u: np.ndarray) -> np.ndarray:
    """Fix the sign of each singular vector: its largest-magnitude entry is positive.

    Singular vectors are defined up to sign; principal angles do not depend on it, but a fixed
    convention makes the uploaded ``U_k`` reproducible.
    """
    idx = np.argmax(np.abs(u), axis=0)
    signs = np.sign(u[idx, np.arange(u.shape[1])])
    signs[signs == 0] = 1.0
    return u * signs


def client_subspace(
    features: np.ndarray,
    labels: np.ndarray | None = None,
    *,
    num_classes: int | None = None,
    options: SubspaceOptions = SubspaceOptions(),
) -> np.ndarray:
    """Top-``p`` right singular vectors of the client's data matrix (Algorithm 1 line 2).

    The paper writes ``X_k o Y_k = U_k Sigma_k V_k^T``, which literally puts ``U_k`` in sample
    space and cannot be compared across clients with different ``n_k``; as in the official code
    the basis lives in feature(+label) space, i.e. the right singular vectors of ``Z_k``. It is
    computed exactly (no randomized SVD, which adds seed dependence) by a float64
    eigendecomposition of the smaller Gram matrix: ``Z_k^T Z_k`` (``d x d``) when ``n > d``, else
    ``Z_k Z_k^T`` (``n x n``) mapped back by ``v_i = Z_k^T u_i / sigma_i``. Cost
    ``O(n d min(n, d))``; it runs in torch, so it follows ``torch.set_num_threads``.

    Args:
        features, labels, num_classes, options: see :func:`data_matrix`.

    Returns:
        ``U_k`` of shape ``(d, p)``, float64, orthonormal columns ordered by decreasing singular
        value; each column's largest-magnitude entry is positive.

    Raises:
        ValueError: if the data cannot define a ``p``-dimensional subspace (all-zero data, fewer
            than ``p`` samples or rank below ``p``: the ``p``-th singular value is at most
            ``options.rank_rtol`` times the largest).
    """
    z_np = data_matrix(features, labels, num_classes=num_classes, options=options)
    n, d = z_np.shape
    p = options.p
    if p > d:
        raise ValueError(f"p={p} exceeds the data dimension d={d}")
    z = torch.from_numpy(z_np)
    gram = z @ z.T if n <= d else z.T @ z  # the smaller Gram matrix, min(n, d) squared
    evals, evecs = torch.linalg.eigh(gram)
    top = torch.clamp(evals.flip(0)[:p], min=0.0).sqrt().numpy()
    vecs = evecs.flip(1)[:, :p]
    largest = float(top[0]) if top.size else 0.0
    if largest == 0.0 or top.size < p or top[p - 1] <= options.rank_rtol * largest:
        raise ValueError(
            f"client data (n={n}, d={d}) have numerical rank < p={p}: singular values "
            f"{np.round(top, 12).tolist()} (all-zero or rank-deficient data); a subspace needs "
            f"singular value p at least rank_rtol={options.rank_rtol} times the largest"
        )
    if n <= d:  # right singular vectors v_i = Z^T u_i / sigma_i, re-orthonormalised
        vecs = torch.linalg.qr(z.T @ vecs / torch.from_numpy(top)).Q
    basis = vecs.numpy()
    return _orient_columns(np.ascontiguousarray(basis))


# ---------------------------------------------------------------------------------------------
# Client side: validation error and selection weight (Eq. 8; Algorithm 1 line 10)
# ---------------------------------------------------------------------------------------------


def per_sample_errors(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    metric: ValidationMetric = "loss",
    loss: TaskLoss = "cross_entropy",
) -> torch.Tensor:
    """Per-sample validation errors, the summands of ``L~_k`` in Eq. 8.

    Args:
        outputs: ``(n, C)`` logits (cross-entropy) or ``(n,)`` / ``(n, t)`` predictions (MSE).
        targets: ``(n,)`` class indices (cross-entropy) or targets shaped like ``outputs`` (MSE).
        metric: ``"loss"`` (per-sample loss) or ``"error_rate"`` (0/1 misclassification;
            classification only).
        loss: ``"cross_entropy"`` or ``"mse"``.

    Returns:
        ``(n,)`` float tensor, detached.
    """
    _check_choice("metric", metric, ValidationMetric)
    _check_choice("loss", loss, TaskLoss)
    with torch.no_grad():
        if loss == "cross_entropy":
            if outputs.ndim != 2 or targets.ndim != 1 or outputs.shape[0] != targets.shape[0]:
                raise ValueError(f"cross-entropy needs outputs (n, C) and targets (n,), got "
                                 f"{tuple(outputs.shape)} and {tuple(targets.shape)}")
            if metric == "error_rate":
                return (outputs.argmax(dim=1) != targets).to(outputs.dtype)
            return torch.nn.functional.cross_entropy(outputs, targets.long(), reduction="none")
        if metric == "error_rate":
            raise ValueError("metric='error_rate' needs loss='cross_entropy'; "
                             "use metric='loss' for regression")
        if outputs.shape != targets.shape:
            raise ValueError(f"MSE needs outputs and targets of one shape, got "
                             f"{tuple(outputs.shape)} and {tuple(targets.shape)}")
        sq = (outputs - targets.to(outputs.dtype)) ** 2
        return sq.reshape(sq.shape[0], -1).mean(dim=1)


def validation_error(
    errors: TensorOrArray | Sequence[float],
    options: ValidationOptions = ValidationOptions(),
) -> float:
    """Reduce per-sample validation errors to ``L~_k`` (Eq. 8), in the order the loader gave them.

    ``"mean"`` returns the mean over all samples (recommended). ``"sum_of_batch_means"`` returns
    the official code's sum over consecutive batches of ``options.batch_size`` of each batch's
    mean; it grows with the number of batches, which makes the code's ``exp(Delta / 2)`` overflow
    for large validation sets.

    Args:
        errors: ``(n,)`` per-sample errors (see :func:`per_sample_errors`), ``n >= 1``.
        options: see :class:`ValidationOptions`.

    Returns:
        ``L~_k`` as a Python float (NaN/Inf pass through; :func:`selection_weight` handles them).
    """
    e = errors.detach().cpu().double().numpy() if isinstance(errors, torch.Tensor) else errors
    e = np.asarray(e, dtype=np.float64).reshape(-1)
    if e.size == 0:
        raise ValueError("the validation set is empty; Eq. 8 needs at least one sample")
    if options.reduction == "mean":
        return float(e.mean())
    bs = options.batch_size
    sums = np.add.reduceat(e, np.arange(0, e.size, bs))
    counts = np.minimum(bs, e.size - np.arange(0, e.size, bs))
    return float(np.sum(sums / counts))


def _lambda_floor(options: LambdaOptions) -> float:
    return {"paper": options.epsilon, "official": 0.0, "constant": options.constant}[options.rule]


def selection_weight(
    val_loss_personal: ArrayLike | None,
    val_loss_aux: ArrayLike | None,
    options: LambdaOptions = LambdaOptions(),
) -> float | np.ndarray:
    """The selection weight ``lambda_k`` (Eq. 8; Algorithm 1 line 10).

    ``Delta = L~(theta_k) - L~(theta_hat_k)`` compares the client's current personalized model
    (end of the previous round) with the freshly received auxiliary model, before training. The
    proximal pull toward ``theta_hat_k`` is active only when ``theta_hat_k`` generalises better.

    * paper: ``lambda = max(epsilon, Delta)``;
    * official: ``lambda = 0`` if ``Delta < 0`` else ``exp(Delta / 2)`` (``lambda = 1`` at
      ``Delta = 0``, e.g. in round 0; the rule jumps from 0 to 1 there);
    * constant: ``lambda = options.constant`` (losses may be None).

    Then ``lambda`` is clipped to ``options.lambda_max`` if set.

    Args:
        val_loss_personal: ``L~_k(theta_k)``, a scalar or an array (one entry per client).
        val_loss_aux: ``L~_k(theta_hat_k)``, same shape.
        options: see :class:`LambdaOptions`.

    Returns:
        ``lambda`` (float for scalar inputs, else an array of the inputs' shape), finite, >= 0.

    Raises:
        ValueError: a NaN/Inf loss under ``on_nonfinite="raise"``, mismatched shapes, or a
            ``lambda`` that overflows (official rule with huge ``Delta`` and no ``lambda_max``).
    """
    if options.rule == "constant" and (val_loss_personal is None or val_loss_aux is None):
        return float(options.constant)
    if val_loss_personal is None or val_loss_aux is None:
        raise ValueError(f"rule={options.rule!r} needs both validation losses; only the "
                         "'constant' rule works without them")
    lp = np.asarray(val_loss_personal, dtype=np.float64)
    la = np.asarray(val_loss_aux, dtype=np.float64)
    if lp.shape != la.shape:
        raise ValueError(f"val_loss_personal {lp.shape} and val_loss_aux {la.shape} differ in shape")
    bad = ~(np.isfinite(lp) & np.isfinite(la))
    if np.any(bad) and options.on_nonfinite == "raise":
        where = np.flatnonzero(bad.reshape(-1)).tolist()
        raise ValueError(
            f"non-finite validation loss (personal={lp.reshape(-1)[where].tolist()}, "
            f"aux={la.reshape(-1)[where].tolist()} at entries {where}); losses must be finite, "
            "or set on_nonfinite='no_transfer' to use the rule's floor"
        )
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.where(bad, 0.0, lp - la)
        if options.rule == "paper":
            lam = np.maximum(options.epsilon, delta)
        elif options.rule == "official":
            lam = np.where(delta < 0, 0.0, np.exp(delta / 2.0))
        else:
            lam = np.full_like(delta, options.constant)
    lam = np.where(bad, _lambda_floor(options), lam)
    if options.lambda_max is not None:
        lam = np.minimum(lam, options.lambda_max)
    if not np.all(np.isfinite(lam)):
        where = np.flatnonzero(~np.isfinite(lam.reshape(-1))).tolist()
        raise ValueError(
            f"lambda overflows at entries {where} (Delta={delta.reshape(-1)[where].tolist()}); "
            "set lambda_max (e.g. max_stable_lambda(lr, factor)) or use reduction='mean'"
        )
    return float(lam) if lam.ndim == 0 else lam


def max_stable_lambda(lr: float, prox_factor: float) -> float:
    """Largest ``lambda`` for which a proximal step does not overshoot ``theta_hat``: ``1/(f lr)``.

    One gradient step on ``(f/2) lambda ||theta - theta_hat||^2`` multiplies ``theta - theta_hat``
    by ``1 - lr f lambda``; it contracts monotonically for ``lr f lambda <= 1`` and diverges for
    ``lr f lambda > 2`` (spec 9.9). Pass the result as ``LambdaOptions.lambda_max`` to clip.
    """
    _check_finite_positive("lr", lr)
    _check_finite_positive("prox_factor", prox_factor)
    return 1.0 / (prox_factor * lr)


# ---------------------------------------------------------------------------------------------
# Client side: proximal term (Eq. 2 / Eq. 9)
# ---------------------------------------------------------------------------------------------


def _as_list(params: TensorOrArray | Sequence[TensorOrArray]) -> list[TensorOrArray]:
    if isinstance(params, (torch.Tensor, np.ndarray)):
        return [params]
    return list(params)


def _paired(
    params: TensorOrArray | Sequence[TensorOrArray],
    aux_params: TensorOrArray | Sequence[TensorOrArray],
) -> list[tuple[TensorOrArray, TensorOrArray]]:
    a, b = _as_list(params), _as_list(aux_params)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} parameter arrays but {len(b)} auxiliary arrays")
    for i, (x, y) in enumerate(zip(a, b)):
        if tuple(x.shape) != tuple(y.shape):
            raise ValueError(f"parameter {i} has shape {tuple(x.shape)} but its auxiliary "
                             f"counterpart has {tuple(y.shape)}")
    return list(zip(a, b))


def proximal_penalty(
    params: TensorOrArray | Sequence[TensorOrArray],
    aux_params: TensorOrArray | Sequence[TensorOrArray],
    lam: float | TensorOrArray,
    prox_factor: float = 2.0,
) -> torch.Tensor | float:
    """The proximal loss ``(f / 2) * lambda * ||theta - theta_hat||^2`` (Eq. 2, Eq. 9).

    Its gradient with respect to ``theta`` is ``f * lambda * (theta - theta_hat)``
    (:func:`proximal_gradient`). With ``f = 2`` (paper) this is exactly the paper's
    ``lambda ||theta - theta_hat||^2``; ``f = 1`` is the official code's effective regulariser.
    Add it to the task loss for ``ProxOptions.mode = "loss"``; ``theta_hat`` must be detached.

    Args:
        params: ``theta``: one tensor/array or a sequence (e.g. ``model.parameters()``).
        aux_params: ``theta_hat`` with the same shapes.
        lam: ``lambda`` >= 0 (scalar, or broadcastable against each array).
        prox_factor: ``f``.

    Returns:
        A scalar (a torch scalar tensor, differentiable, for torch inputs).
    """
    total: torch.Tensor | float = 0.0
    for theta, theta_hat in _paired(params, aux_params):
        total = total + (lam * (theta - theta_hat) ** 2).sum()
    return 0.5 * prox_factor * total


def proximal_gradient(
    theta: TensorOrArray, theta_hat: TensorOrArray, lam: float | TensorOrArray, prox_factor: float = 2.0
) -> TensorOrArray:
    """``f * lambda * (theta - theta_hat)``, the gradient of :func:`proximal_penalty` (Eq. 9).

    ``theta`` and ``theta_hat`` have the same shape; ``lam`` broadcasts against them (e.g.
    ``(K, 1, 1)`` for a ``(K, a, b)`` stack of client models).
    """
    return prox_factor * lam * (theta - theta_hat)


def apply_proximal_correction_(
    params: Sequence[torch.Tensor] | torch.Tensor,
    params_before: Sequence[TensorOrArray] | TensorOrArray,
    aux_params: Sequence[TensorOrArray] | TensorOrArray,
    lam: float | torch.Tensor,
    lr: float,
    prox_factor: float = 1.0,
) -> None:
    """In-place official-code proximal step: ``theta <- theta - lr f lambda (theta_b - theta_hat)``.

    ``ProxOptions.mode = "post_step"``: call after ``optimizer.step()`` (which applied the
    task-loss gradient with momentum and weight decay), with ``params_before`` the parameters
    saved just before that step. The correction bypasses momentum and weight decay. The code uses
    ``f = 1``.

    Args:
        params: the model's parameters ``theta`` (modified in place, without autograd).
        params_before: ``theta`` before the optimizer step, same shapes.
        aux_params: ``theta_hat``, same shapes.
        lam: ``lambda`` >= 0, scalar or broadcastable.
        lr: the learning rate of the step.
        prox_factor: ``f``.
    """
    pairs = _paired(params, aux_params)
    before = _as_list(params_before)
    if len(before) != len(pairs):
        raise ValueError(f"{len(pairs)} parameter arrays but {len(before)} saved arrays")
    with torch.no_grad():
        for (theta, theta_hat), theta_b in zip(pairs, before):
            theta -= lr * proximal_gradient(theta_b, theta_hat, lam, prox_factor)


# ---------------------------------------------------------------------------------------------
# Server side: similarity (Eq. 4-5; Algorithm 1 line 5)
# ---------------------------------------------------------------------------------------------


def validate_subspace(
    u: np.ndarray,
    *,
    p: int | None = None,
    dim: int | None = None,
    atol: float = 1e-5,
    client: object = None,
) -> np.ndarray:
    """Check an uploaded ``U_k``: 2-D, finite, orthonormal columns; return it as float64.

    Args:
        u: ``(d, p)``.
        p, dim: expected ``p`` and ``d`` (None: not checked).
        atol: tolerance on ``||U^T U - I||_max`` (uploads may travel as float32).
        client: an identifier used in error messages.

    Raises:
        ValueError: naming the client and what is wrong (wrong shape, NaN/Inf, an all-zero or
            non-orthonormal basis).
    """
    who = f"client {client!r}: " if client is not None else ""
    arr = np.asarray(u, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{who}subspace must be a 2-D (d, p) array, got shape {arr.shape}")
    if p is not None and arr.shape[1] != p:
        raise ValueError(f"{who}subspace has p={arr.shape[1]} columns, expected p={p}")
    if dim is not None and arr.shape[0] != dim:
        raise ValueError(f"{who}subspace has d={arr.shape[0]} rows, expected d={dim}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{who}subspace contains NaN or Inf")
    err = np.max(np.abs(arr.T @ arr - np.eye(arr.shape[1])))
    if err > atol:
        raise ValueError(f"{who}subspace columns are not orthonormal (max |U^T U - I| = "
                         f"{err:.3g} > {atol}); a degenerate (e.g. all-zero) basis is not allowed")
    return arr


def principal_angle_cosines(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Cosines of the principal angles between ``span(U1)`` and ``span(U2)`` (Eq. 5).

    They are the singular values of ``U1^T U2`` (``U1``, ``U2`` with orthonormal columns,
    ``(d, p1)`` and ``(d, p2)``), in decreasing order, clipped to ``[0, 1]`` against rounding.

    Returns:
        ``(min(p1, p2),)`` array.
    """
    a, b = np.asarray(u1, dtype=np.float64), np.asarray(u2, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bases must be (d, p) arrays with one d, got {a.shape} and {b.shape}")
    return np.clip(np.linalg.svd(a.T @ b, compute_uv=False), 0.0, 1.0)


_COS_ZERO = 1e-12


def _stack_subspaces(
    subspaces: Sequence[np.ndarray | None], atol: float, first_index: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Validate bases (None = missing) and stack them as ``(K, d, p)`` (zeros where missing)."""
    present = np.array([u is not None for u in subspaces], dtype=bool)
    if not present.any():
        raise ValueError("no client subspace is present; at least one U_k is needed")
    k0 = int(np.argmax(present))
    ref = validate_subspace(subspaces[k0], atol=atol, client=first_index + k0)
    stack = np.zeros((len(subspaces),) + ref.shape)
    for k, u in enumerate(subspaces):
        if u is not None:
            stack[k] = validate_subspace(u, p=ref.shape[1], dim=ref.shape[0], atol=atol,
                                         client=first_index + k)
    return stack, present


def _sum_of_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``s_ij = sum of the singular values of A_i^T B_j`` (Eq. 4-5) for stacks ``(m, d, p)``.

    Cosines below ``_COS_ZERO`` (rounding level for float64 orthonormal bases) are set to 0, so
    orthogonal subspaces give exactly zero similarity instead of ~1e-17 weights that row
    normalisation would blow up into an arbitrary transition row.
    """
    cross = np.einsum("idp,jdq->ijpq", a, b)
    cos = np.clip(np.linalg.svd(cross, compute_uv=False), 0.0, 1.0)
    cos[cos < _COS_ZERO] = 0.0
    return cos.sum(axis=-1)


def subspace_similarity(
    subspaces: Sequence[np.ndarray | None], *, atol: float = 1e-5
) -> tuple[np.ndarray, np.ndarray]:
    """Pairwise similarity ``s_kk' = sum_i cos zeta_i^{kk'}`` (Eq. 4) of all clients.

    A missing client (``None``: it never uploaded ``U_k``, or its upload was rejected) gets a zero
    row and column and ``present[k] = False``; :func:`similarity_graph` then keeps it out of every
    neighbourhood and gives it a self-loop only, so its auxiliary model is its own model.
    Cost ``O(K^2 d p^2)``, one batched SVD of ``K^2`` ``p x p`` matrices.

    Args:
        subspaces: ``K`` entries, each a ``(d, p)`` orthonormal basis or None; one ``d`` and ``p``.
        atol: orthonormality tolerance of :func:`validate_subspace`.

    Returns:
        ``(S, present)``: ``S`` of shape ``(K, K)``, symmetric, entries in ``[0, p]``,
        ``S_kk = p`` for present clients; ``present`` a ``(K,)`` bool array.

    Raises:
        ValueError: an invalid basis (naming the client index), inconsistent ``d``/``p``, or no
            client present.
    """
    stack, present = _stack_subspaces(subspaces, atol)
    idx = np.flatnonzero(present)
    s = np.zeros((len(subspaces), len(subspaces)))
    s[np.ix_(idx, idx)] = _sum_of_cosines(stack[idx], stack[idx])
    s = 0.5 * (s + s.T)  # exact symmetry (sigma(A) = sigma(A^T) up to rounding)
    return s, present


def cosine_similarity_matrix(vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity of flattened vectors (Table 4 ablations; spec section 4).

    ``"parameter similarity"`` uses the rows of ``Theta``; ``"gradient similarity"`` the client
    updates ``theta_k_new - theta_hat_k``. Entries lie in ``[-1, 1]``; use the ``exp`` transform
    (or clip) before building a graph. Memory: one ``K x K`` Gram matrix, no copy of the input.

    Args:
        vectors: ``(K, P)``.

    Returns:
        ``(K, K)`` float64.
    """
    x = np.asarray(vectors)
    if x.ndim != 2:
        raise ValueError(f"vectors must be (K, P), got shape {x.shape}")
    gram = (x @ x.T).astype(np.float64)
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    if np.any(norms == 0) or not np.all(np.isfinite(gram)):
        raise ValueError("cosine similarity needs finite, non-zero vectors; rows "
                         f"{np.flatnonzero(norms == 0).tolist()} are zero or values are non-finite")
    return np.clip(gram / np.outer(norms, norms), -1.0, 1.0)


def random_similarity(num_clients: int, seed: int = 0) -> np.ndarray:
    """A random symmetric similarity in ``[0, 1)``, fixed once (Table 4, "random similarity")."""
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1")
    r = np.random.default_rng(seed).random((num_clients, num_clients))
    s = np.triu(r, 1)
    return s + s.T + np.eye(num_clients)


def _keep_mask(
    s: np.ndarray, candidates: np.ndarray, top_k: int | None
) -> np.ndarray:
    """For each row, mark the ``top_k`` largest candidate entries (all candidates if None).

    Ties are broken towards the lower column index (stable sort), which makes the graph
    reproducible; the official code's ``torch.topk`` leaves ties unspecified.
    """
    if top_k is None:
        return candidates.copy()
    order = np.argsort(np.where(candidates, -s, np.inf), axis=1, kind="stable")
    keep = np.zeros_like(candidates)
    rows = np.arange(s.shape[0])[:, None]
    keep[rows, order[:, :top_k]] = True
    return keep & candidates


def _graph_rows(
    s: np.ndarray, keep: np.ndarray, options: GraphOptions
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weights and row-normalised transition rows from similarities and a keep mask.

    Shared by the ``K x K`` graph and by a new client's single row (Algorithm 2).

    * identity: ``W = S * keep``, ``P = D^-1 W``;
    * exp: ``W = exp(tau (S - s_max)) * keep`` with ``s_max`` the largest kept similarity: this
      is the code's ``exp(tau S)`` up to the global factor ``exp(-tau s_max)``, which ``D^-1``
      cancels, so ``W <= 1`` never overflows. ``P`` is a per-row stable softmax over the kept
      entries, so no row underflows to zero.

    Returns:
        ``(W, P, isolated)``: ``(r, K)`` weights, ``(r, K)`` rows summing to 1 where not isolated
        (zero rows elsewhere), and the ``(r,)`` mask of rows with zero total weight.
    """
    if options.transform == "identity":
        w = np.where(keep, s, 0.0)
        total = w.sum(axis=1)
        isolated = total <= 0.0
        p = np.divide(w, total[:, None], out=np.zeros_like(w), where=~isolated[:, None])
        return w, p, isolated
    tau = options.temperature
    s_max = np.max(s[keep]) if keep.any() else 0.0
    w = np.where(keep, np.exp(tau * (np.where(keep, s, s_max) - s_max)), 0.0)
    row_max = np.max(np.where(keep, s, -np.inf), axis=1)
    isolated = ~keep.any(axis=1)
    row_max[isolated] = 0.0
    e = np.where(keep, np.exp(tau * (np.where(keep, s, 0.0) - row_max[:, None])), 0.0)
    total = e.sum(axis=1)
    p = np.divide(e, total[:, None], out=np.zeros_like(e), where=~isolated[:, None])
    return w, p, isolated


def similarity_graph(
    similarity: np.ndarray,
    options: GraphOptions = GraphOptions(),
    present: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Graph ``W`` and row-stochastic ``P = D^-1 W`` from similarities (Eq. 4; spec 3.2).

    Paper: ``W = S`` dense with self-loops. Official code: ``W = exp(10 S)``, zero diagonal, each
    row keeps its 2 largest entries (so ``W`` is in general not symmetric), ``P = D^-1 W``.

    Hazards handled: missing clients (``present[k] = False``) are never anyone's neighbour (with
    the ``exp`` transform an absent edge would otherwise weigh ``exp(0) = 1``); a row with no
    weight at all (a missing client, ``K = 1``, or an all-zero row under the identity transform)
    is *isolated* and gets ``P_kk = 1``, so ``theta_hat_k = theta_k`` (no propagation).

    Args:
        similarity: ``(K, K)`` finite; non-negative under the identity transform.
        options: see :class:`GraphOptions`.
        present: ``(K,)`` bool, default all True.

    Returns:
        ``(W, P)``, both ``(K, K)`` float64; rows of ``P`` sum to 1 and are non-negative.
    """
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] < 1:
        raise ValueError(f"similarity must be a square (K, K) array, got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("similarity contains NaN or Inf")
    if options.transform == "identity" and np.any(s < 0):
        raise ValueError("the identity transform needs non-negative similarities (graph weights "
                         "must be >= 0); use transform='exp' or clip the similarity at 0")
    k_total = s.shape[0]
    mask = np.ones(k_total, dtype=bool) if present is None else np.asarray(present, dtype=bool)
    if mask.shape != (k_total,):
        raise ValueError(f"present must have shape ({k_total},), got {mask.shape}")
    eye = np.eye(k_total, dtype=bool)
    candidates = np.outer(mask, mask) & ~eye
    keep = _keep_mask(s, candidates, options.top_k)
    if options.self_loops:
        keep |= eye & mask[:, None]
    w, p, isolated = _graph_rows(s, keep, options)
    lonely = np.flatnonzero(isolated)
    p[lonely, lonely] = 1.0
    return w, p


def row_normalize(weights: np.ndarray) -> np.ndarray:
    """``P = D^-1 W`` for a user-supplied non-negative ``W`` (isolated rows get ``P_kk = 1``).

    The official code calls its version "symmetric normalisation" but row-normalises; so does
    this function. Returns a ``(K, K)`` float64 row-stochastic matrix.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"W must be a square (K, K) array, got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("W must be finite and non-negative")
    _, p, isolated = _graph_rows(w, np.ones_like(w, dtype=bool), GraphOptions("identity", top_k=None))
    lonely = np.flatnonzero(isolated)
    p[lonely, lonely] = 1.0
    return p


def propagation_matrix(transition: np.ndarray, kappa: float) -> np.ndarray:
    """``M = (1 - kappa) (I - kappa P)^-1`` (Eq. 6), by one LU solve of a ``K x K`` system.

    ``I - kappa P`` is strictly diagonally dominant for row-stochastic ``P`` and
    ``kappa < 1``, so the solve is stable (infinity-norm condition number at most
    ``(1 + kappa) / (1 - kappa)``). Cost ``O(K^3)``, once per graph; every round then costs one
    ``K x K`` by ``K x P`` product (:func:`propagate`). Rows of ``M`` sum to 1 and are
    non-negative (``M = (1 - kappa) sum_i (kappa P)^i``), with ``M_kk >= 1 - kappa``.

    Args:
        transition: ``P``, ``(K, K)`` row-stochastic.
        kappa: in ``[0, 1)``.

    Returns:
        ``M``, ``(K, K)`` float64.
    """
    alpha_from_kappa(kappa)
    p = np.asarray(transition, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != p.shape[1]:
        raise ValueError(f"P must be a square (K, K) array, got shape {p.shape}")
    if np.any(p < -1e-12) or np.max(np.abs(p.sum(axis=1) - 1.0)) > 1e-8:
        raise ValueError("P must be row-stochastic (non-negative rows summing to 1)")
    k_total = p.shape[0]
    eye = np.eye(k_total)
    return np.linalg.solve(eye - kappa * p, (1.0 - kappa) * eye)


@dataclass(frozen=True)
class PropagationGraph:
    """Everything the server computes once from the client subspaces (Algorithm 1 line 5).

    Attributes:
        similarity: ``S`` ``(K, K)``, ``s_kk' = sum cos zeta`` (Eq. 4).
        weights: ``W`` ``(K, K)`` after transform, top-k and self-loop rules.
        transition: ``P = D^-1 W`` ``(K, K)``, row-stochastic.
        propagation: ``M = (1 - kappa)(I - kappa P)^-1`` ``(K, K)`` (Eq. 6).
        kappa: the propagation probability used for ``M``.
        present: ``(K,)`` clients whose subspace was available.
        neighbours: for each client, the indices ``k' != k`` with ``P_kk' > 0``, by decreasing
            weight (log these; spec 10).
    """

    similarity: np.ndarray
    weights: np.ndarray
    transition: np.ndarray
    propagation: np.ndarray
    kappa: float
    present: np.ndarray
    neighbours: tuple[tuple[int, ...], ...]

    @property
    def num_clients(self) -> int:
        return int(self.transition.shape[0])

    @property
    def self_weights(self) -> np.ndarray:
        """``M_kk``, each client's weight on its own model (>= 1 - kappa)."""
        return np.diag(self.propagation).copy()


def propagation_graph_from_similarity(
    similarity: np.ndarray,
    graph: GraphOptions = GraphOptions(),
    propagation: PropagationOptions = PropagationOptions(),
    present: np.ndarray | None = None,
) -> PropagationGraph:
    """Build ``W``, ``P`` and ``M`` from any similarity matrix (subspace, cosine, random, user).

    See :func:`similarity_graph` and :func:`propagation_matrix`.
    """
    s = np.asarray(similarity, dtype=np.float64)
    mask = np.ones(s.shape[0], dtype=bool) if present is None else np.asarray(present, dtype=bool)
    w, p = similarity_graph(s, graph, mask)
    m = propagation_matrix(p, propagation.kappa)
    neighbours = []
    for k in range(p.shape[0]):
        row = p[k].copy()
        row[k] = 0.0
        nz = np.flatnonzero(row > 0)
        neighbours.append(tuple(int(j) for j in nz[np.argsort(-row[nz], kind="stable")]))
    return PropagationGraph(s, w, p, m, float(propagation.kappa), mask.copy(), tuple(neighbours))


def build_propagation_graph(
    subspaces: Sequence[np.ndarray | None],
    graph: GraphOptions = GraphOptions(),
    propagation: PropagationOptions = PropagationOptions(),
) -> PropagationGraph:
    """Server setup step: subspaces ``U_k`` -> ``S`` (Eq. 4-5) -> ``W``, ``P`` -> ``M`` (Eq. 6).

    Args:
        subspaces: ``K`` entries ``(d, p)`` or None for a missing client (see
            :func:`subspace_similarity`).
        graph, propagation: options.

    Returns:
        A :class:`PropagationGraph`.
    """
    s, present = subspace_similarity(subspaces)
    return propagation_graph_from_similarity(s, graph, propagation, present)


# ---------------------------------------------------------------------------------------------
# Server side: propagation (Eq. 6-7; Algorithm 1 line 16)
# ---------------------------------------------------------------------------------------------


def _check_stack(theta: np.ndarray, k_total: int, name: str = "theta") -> np.ndarray:
    arr = np.asarray(theta)
    if arr.ndim != 2 or arr.shape[0] != k_total:
        raise ValueError(f"{name} must be a (K={k_total}, P) array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {arr.dtype}")
    return arr


def _prepare_out(theta: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.empty_like(theta)
    if out.shape != theta.shape or out.dtype != theta.dtype:
        raise ValueError(f"out must have shape {theta.shape} and dtype {theta.dtype}, got "
                         f"{out.shape} and {out.dtype}")
    if np.shares_memory(out, theta):
        raise ValueError("out must not share memory with theta (keep separate theta and "
                         "theta_hat buffers)")
    return out


def _row_selection(rows: Sequence[int] | np.ndarray | None, k_total: int) -> np.ndarray | None:
    if rows is None:
        return None
    idx = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1))
    if idx.size and (idx[0] < 0 or idx[-1] >= k_total):
        raise ValueError(f"rows must be client indices in [0, {k_total}), got {idx.tolist()}")
    return None if idx.size == k_total else idx


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of ``array`` (no copy); read-only inputs are only ever read."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # torch warns that it cannot mark the view read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = a @ b`` for NumPy arrays of one float dtype, computed by torch.

    The server's per-round GEMM (Eq. 6/7) runs in torch rather than NumPy's BLAS so that one
    setting, ``torch.set_num_threads``, governs all of FEDORA's compute (the client subspace already
    runs in torch). NumPy's BLAS keeps its own thread pool, sized from the environment at import
    and out of reach of that setting; a multi-threaded product waits for all its threads, which
    on a shared machine is slow (measured on 2 cores, ``K = 100``, ``P = 10 000``: 1.9 ms on one
    thread, 18-24 ms with NumPy's default pool while another process kept one core busy).
    """
    out_t = _tensor(out) if out.flags.c_contiguous else None
    if out_t is not None:
        torch.matmul(_tensor(a), _tensor(b), out=out_t)
    else:
        out[...] = torch.matmul(_tensor(a), _tensor(b)).numpy()


def _apply_mixing(
    mixing: np.ndarray,
    theta: np.ndarray,
    out: np.ndarray,
    rows: np.ndarray | None,
    chunk_columns: int,
) -> None:
    """``out[rows] = mixing[rows] @ theta`` in ``theta``'s dtype without a ``K x P`` temporary.

    ``mixing`` is cast to ``theta``'s dtype (a float64 ``M`` times a float32 ``Theta`` would
    otherwise up-cast the whole stack). All rows: one GEMM straight into ``out``. Some rows:
    column blocks of ``chunk_columns``, with an ``O(K x chunk_columns)`` workspace.
    """
    m = np.ascontiguousarray(mixing, dtype=theta.dtype)
    if rows is None:
        _matmul_into(m, theta, out)
        return
    if rows.size == 0:
        return
    m_rows = np.ascontiguousarray(m[rows])
    block = np.empty((rows.size, min(chunk_columns, theta.shape[1])), dtype=theta.dtype)
    for start in range(0, theta.shape[1], chunk_columns):
        stop = min(start + chunk_columns, theta.shape[1])
        part = block[:, : stop - start]
        _matmul_into(m_rows, theta[:, start:stop], part)
        out[rows, start:stop] = part


def propagate(
    theta: np.ndarray,
    propagation: np.ndarray,
    *,
    out: np.ndarray | None = None,
    rows: Sequence[int] | np.ndarray | None = None,
    chunk_columns: int = 1 << 16,
) -> np.ndarray:
    """Closed-form parameter propagation ``Theta_hat = M Theta`` (Eq. 6; Algorithm 1 line 16).

    Each ``theta_hat_k = sum_k' M_kk' theta_k'`` is a convex combination of the clients' models.
    Works on flattened parameter vectors, element-wise for every parameter (biases included).

    Memory and cost: ``O(K^2 P)`` flops per call; with ``out`` given (the server's ``theta_hat``
    buffer) nothing of size ``K x P`` is allocated; only a ``K x K`` cast of ``M`` and, with
    ``rows``, an ``O(K x chunk_columns)`` workspace (measured: under 4 such blocks).

    Args:
        theta: ``Theta`` ``(K, P)`` float (float32 in practice), the last-known ``theta_k``.
        propagation: ``M`` ``(K, K)`` (:func:`propagation_matrix`).
        out: ``(K, P)`` output buffer of ``theta``'s dtype, not aliasing ``theta``.
        rows: recompute only these clients' ``theta_hat`` (others keep ``out``'s content, e.g.
            clients whose round failed); None: all.
        chunk_columns: column block size for ``rows``.

    Returns:
        ``out`` (``(K, P)``).
    """
    m = np.asarray(propagation, dtype=np.float64)
    k_total = m.shape[0]
    theta = _check_stack(theta, k_total)
    if m.shape != (k_total, k_total):
        raise ValueError(f"M must be ({k_total}, {k_total}), got {m.shape}")
    sel = _row_selection(rows, k_total)
    target = _prepare_out(theta, out)
    _apply_mixing(m, theta, target, sel, chunk_columns)
    return target


def propagate_iterative(
    theta: np.ndarray,
    transition: np.ndarray,
    kappa: float,
    num_iterations: int,
    *,
    out: np.ndarray | None = None,
    rows: Sequence[int] | np.ndarray | None = None,
    chunk_columns: int = 1 << 16,
) -> np.ndarray:
    """Iterative propagation (Eq. 7): ``Theta_hat <- kappa P Theta_hat + (1 - kappa) Theta``.

    Starts from ``Theta_hat^(0) = Theta``; after ``m`` steps the distance to Eq. 6 is at most
    ``kappa^m`` times the initial one (row-wise max norm), since ``||kappa P||_inf = kappa``.
    ``m = 0`` returns ``Theta``. Per client:
    ``theta_hat_k = (alpha / ((1 + alpha) D_kk)) sum_k' w_kk' theta_hat_k' + theta_k / (1 + alpha)``.

    Memory: one ``K x P`` workspace besides ``out`` (two with ``rows``) and a
    ``K x chunk_columns`` temporary. Cost ``O(m K^2 P)``.

    Args:
        theta: ``(K, P)`` float.
        transition: ``P`` ``(K, K)`` row-stochastic.
        kappa: in ``[0, 1)``.
        num_iterations: ``m >= 0``.
        out, rows, chunk_columns: as in :func:`propagate`.

    Returns:
        ``out`` (``(K, P)``).
    """
    alpha_from_kappa(kappa)
    p = np.asarray(transition, dtype=np.float64)
    k_total = p.shape[0]
    theta = _check_stack(theta, k_total)
    if p.shape != (k_total, k_total):
        raise ValueError(f"P must be ({k_total}, {k_total}), got {p.shape}")
    if num_iterations < 0:
        raise ValueError(f"num_iterations={num_iterations} must be >= 0")
    sel = _row_selection(rows, k_total)
    target = _prepare_out(theta, out)
    current = target if sel is None else np.empty_like(theta)
    current[...] = theta
    scratch = np.empty_like(theta)
    kp = np.ascontiguousarray(kappa * p, dtype=theta.dtype)
    for _ in range(num_iterations):
        _matmul_into(kp, current, scratch)
        for start in range(0, theta.shape[1], chunk_columns):  # scratch += (1 - kappa) Theta
            cols = slice(start, start + chunk_columns)
            scratch[:, cols] += (1.0 - kappa) * theta[:, cols]
        current, scratch = scratch, current
    if sel is None:
        if current is not target:
            target[...] = current
    else:
        target[sel] = current[sel]
    return target


def server_objective(
    theta_hat: np.ndarray, theta: np.ndarray, transition: np.ndarray, alpha: float
) -> float:
    """Eq. 3: ``sum_k ||theta_k - theta_hat_k||^2 + (alpha/2) sum_kk' P_kk' ||theta_hat_k - theta_hat_k'||^2``.

    ``P = D^-1 W``. Eq. 6 minimises this only when ``P`` is symmetric (Lemma 4.2's proof assumes
    it); for the official code's asymmetric top-k graph, Eq. 6 is the propagation fixed point,
    not the minimiser. For diagnostics and tests; ``O(K^2 P)``.
    """
    th, t = np.asarray(theta_hat, dtype=np.float64), np.asarray(theta, dtype=np.float64)
    p = np.asarray(transition, dtype=np.float64)
    sq = np.sum(th**2, axis=1)
    pairwise = sq[:, None] + sq[None, :] - 2.0 * th @ th.T
    return float(np.sum((t - th) ** 2) + 0.5 * alpha * np.sum(p * pairwise))


# ---------------------------------------------------------------------------------------------
# Server side: flattened parameter buffers and the per-round update
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterLayout:
    """Shapes and dtypes of a model's list of arrays, to move between lists and flat rows.

    The server keeps two ``(K, P)`` buffers (last-known ``theta_k`` and ``theta_hat_k``); an
    upload is flattened straight into its row and ``theta_hat_k`` is sent as views of its row.
    Integer arrays (e.g. batch-norm counters) are carried as floats and rounded back.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> ParameterLayout:
        """Layout of a model's list of arrays (e.g. the initial parameters)."""
        arrs = [np.asarray(a) for a in arrays]
        if not arrs:
            raise ValueError("a model needs at least one parameter array")
        return cls(tuple(a.shape for a in arrs), tuple(a.dtype.str for a in arrs))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Values per array. Cached: the server flattens ``K`` uploads per round, and recomputing
        the products per call was most of a round's time at ``K = 100`` (profiled)."""
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @cached_property
    def size(self) -> int:
        """``P``, the total number of values."""
        return int(sum(self.sizes))

    def flatten(
        self, arrays: Sequence[np.ndarray], out: np.ndarray | None = None, dtype: np.dtype | type = np.float32
    ) -> np.ndarray:
        """Concatenate ``arrays`` into a ``(P,)`` vector (into ``out``, e.g. a buffer row)."""
        arrs = list(arrays)
        if len(arrs) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} arrays, got {len(arrs)}")
        target = np.empty(self.size, dtype=dtype) if out is None else out
        if target.shape != (self.size,):
            raise ValueError(f"out must have shape ({self.size},), got {target.shape}")
        start = 0
        for i, (a, shape, n) in enumerate(zip(arrs, self.shapes, self.sizes)):
            a = np.asarray(a)
            if a.shape != shape:
                raise ValueError(f"array {i} has shape {a.shape}, expected {shape}")
            target[start : start + n] = a.reshape(-1)
            start += n
        return target

    def unflatten(self, vector: np.ndarray) -> list[np.ndarray]:
        """Split a ``(P,)`` vector into arrays of the layout (views when the dtype matches)."""
        v = np.asarray(vector)
        if v.shape != (self.size,):
            raise ValueError(f"vector must have shape ({self.size},), got {v.shape}")
        result, start = [], 0
        for shape, n, dt in zip(self.shapes, self.sizes, self.dtypes):
            piece = v[start : start + n].reshape(shape)
            target = np.dtype(dt)
            if piece.dtype != target:
                piece = np.rint(piece).astype(target) if target.kind in "iub" else piece.astype(target)
            result.append(piece)
            start += n
        return result


def init_server_buffers(
    theta0: np.ndarray, num_clients: int, dtype: np.dtype | type = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Initial ``(Theta, Theta_hat)`` buffers: every row is ``theta^0`` (Algorithm 1 lines 6-7).

    Returns two separate ``(K, P)`` arrays (``2 K P`` values in all: the server's whole state
    besides the ``K x K`` matrices).
    """
    v = np.asarray(theta0).reshape(-1)
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be >= 1")
    if not np.all(np.isfinite(v)):
        raise ValueError("theta0 contains NaN or Inf")
    theta = np.empty((num_clients, v.size), dtype=dtype)
    theta[...] = v
    return theta, theta.copy()


def validate_upload(client: int, vector: np.ndarray, num_params: int) -> np.ndarray:
    """Check one uploaded flat ``theta_k``: shape ``(P,)`` and finite values.

    Raises:
        ValueError: naming the client, the expected shape, or the non-finite count.
    """
    v = np.asarray(vector)
    if v.shape != (num_params,):
        raise ValueError(f"client {client}: upload has shape {v.shape}, expected ({num_params},)")
    bad = int(np.size(v) - np.count_nonzero(np.isfinite(v)))
    if bad:
        raise ValueError(f"client {client}: upload has {bad} NaN/Inf values; it is rejected")
    return v


def server_update(
    theta: np.ndarray,
    theta_hat: np.ndarray,
    uploads: Mapping[int, np.ndarray],
    graph: PropagationGraph,
    options: PropagationOptions = PropagationOptions(),
    *,
    frozen: Sequence[int] = (),
) -> np.ndarray:
    """One server round (Algorithm 1 lines 14-16), in place on the two ``(K, P)`` buffers.

    1. Every upload ``theta_k`` (flat ``(P,)``) is validated, then copied into row k of ``theta``.
       Clients that did not participate keep their last-known ``theta_k`` (partial
       participation; spec 9.12): Eq. 6 always sees all ``K`` rows.
    2. ``theta_hat`` is recomputed for every client by Eq. 6 (``options.solver =
       "closed_form"``, with ``graph.propagation``) or Eq. 7. Rows listed in ``frozen`` (e.g.
       clients whose round failed; spec 8.3) keep their previous ``theta_hat``.

    All uploads are validated before anything is written, so a bad upload leaves both buffers
    untouched. ``graph.kappa`` must equal ``options.kappa``.

    Args:
        theta: ``(K, P)`` last-known personalized models (modified in place).
        theta_hat: ``(K, P)`` auxiliary models (modified in place), separate from ``theta``.
        uploads: client index -> flat ``(P,)`` ``theta_k``.
        graph: from :func:`build_propagation_graph`.
        options: solver settings.
        frozen: client indices whose ``theta_hat`` is kept.

    Returns:
        The sorted indices of the clients whose uploads were written.
    """
    k_total = graph.num_clients
    theta = _check_stack(theta, k_total)
    if abs(graph.kappa - options.kappa) > 1e-12:
        raise ValueError(f"graph was built with kappa={graph.kappa} but options.kappa="
                         f"{options.kappa}; rebuild the graph or pass matching options")
    checked = {}
    for k, vec in uploads.items():
        if not isinstance(k, (int, np.integer)) or not 0 <= int(k) < k_total:
            raise ValueError(f"upload key {k!r} is not a client index in [0, {k_total})")
        checked[int(k)] = validate_upload(int(k), vec, theta.shape[1])
    for k, vec in checked.items():
        theta[k] = vec
    frozen_set = {int(k) for k in frozen}
    rows = None if not frozen_set else [k for k in range(k_total) if k not in frozen_set]
    if options.solver == "closed_form":
        propagate(theta, graph.propagation, out=theta_hat, rows=rows)
    else:
        propagate_iterative(theta, graph.transition, options.kappa, options.num_iterations,
                            out=theta_hat, rows=rows)
    return np.array(sorted(checked), dtype=np.int64)


def new_client_auxiliary_model(
    new_subspace: np.ndarray,
    subspaces: Sequence[np.ndarray | None],
    theta_hat: np.ndarray,
    graph: GraphOptions = GraphOptions(),
    *,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Auxiliary model for a client that joins after training (Algorithm 2 lines 3-5).

    The paper says "via Eq. (6)" but Eq. 6 needs the new client's own ``theta``, which does not
    exist yet; this uses one propagation hop from the new node (spec 3.5):
    ``theta_hat_new = sum_k P_new,k theta_hat_k``, with ``P_new`` the new client's row of
    similarities to the old clients, through the same transform and top-k rule as the graph
    (self-loops do not apply). An unlabeled client uses it as its model (covariate shift; all
    subspaces must then be feature-only); a labeled client trains from it with Eq. 9.

    Args:
        new_subspace: ``(d, p)`` orthonormal basis of the new client.
        subspaces: the ``K`` old clients' bases (None for missing ones).
        theta_hat: ``(K, P)`` the old clients' auxiliary models.
        graph: the options used for the old clients' graph.
        out: optional ``(P,)`` output of ``theta_hat``'s dtype.

    Returns:
        ``(theta_hat_new, weights)``: ``(P,)`` and the ``(K,)`` row ``P_new`` (sums to 1).
    """
    k_total = len(subspaces)
    th = _check_stack(theta_hat, k_total, "theta_hat")
    stack, present = _stack_subspaces(subspaces, atol=1e-5)
    new = validate_subspace(new_subspace, p=stack.shape[2], dim=stack.shape[1], client="new")
    row = np.zeros((1, k_total))
    row[0, present] = _sum_of_cosines(new[None], stack[present])[0]
    keep = _keep_mask(row, present[None, :], graph.top_k)
    _, p_row, isolated = _graph_rows(row, keep, graph)
    if isolated[0]:
        raise ValueError("the new client has no weighted neighbour among the old clients "
                         "(all missing, or all similarities zero under the identity transform)")
    weights = p_row[0]
    target = np.empty(th.shape[1], dtype=th.dtype) if out is None else out
    if target.shape != (th.shape[1],) or target.dtype != th.dtype:
        raise ValueError(f"out must have shape ({th.shape[1]},) and dtype {th.dtype}")
    np.matmul(weights.astype(th.dtype), th, out=target)
    return target, weights


# ---------------------------------------------------------------------------------------------
# Metrics (Definitions 3.2-3.3)
# ---------------------------------------------------------------------------------------------


def _paired_scores(score: ArrayLike, score_local: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(score, dtype=np.float64).reshape(-1)
    b = np.asarray(score_local, dtype=np.float64).reshape(-1)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"need one score per client for both methods, got {a.size} and {b.size}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("scores contain NaN or Inf")
    return a, b


def relative_improvement(
    score: ArrayLike, score_local: ArrayLike, *, higher_is_better: bool = True
) -> np.ndarray:
    """Per-client relative accuracy (Def. 3.2) or relative MAE.

    ``R-Acc_k = (Acc_k - Acc_k^LOCAL) / Acc_k^LOCAL``; for errors (``higher_is_better=False``)
    ``R-MAE_k = (MAE_k^LOCAL - MAE_k) / MAE_k^LOCAL`` (spec 9.16), so higher is better for both.

    Returns:
        ``(K,)`` array. Raises ``ValueError`` if a LOCAL score is 0 (undefined ratio).
    """
    a, b = _paired_scores(score, score_local)
    if np.any(b == 0):
        raise ValueError(f"LOCAL score is 0 for clients {np.flatnonzero(b == 0).tolist()}; the "
                         "relative score is undefined there")
    diff = a - b if higher_is_better else b - a
    return diff / np.abs(b)


def positive_transfer_ratio(
    score: ArrayLike, score_local: ArrayLike, *, higher_is_better: bool = True, strict: bool = False
) -> float:
    """PTR (Def. 3.3): the fraction of clients not worse than LOCAL.

    Ties count as positive (``>=``, the paper); ``strict=True`` gives the ``>`` version, which a
    run that degenerates to LOCAL cannot inflate (spec 9.15).
    """
    a, b = _paired_scores(score, score_local)
    diff = a - b if higher_is_better else b - a
    return float(np.mean(diff > 0 if strict else diff >= 0))


def lambda_activity(lambdas: ArrayLike, epsilon: float = 1e-8) -> float:
    """Fraction of client-rounds with ``lambda > epsilon`` (report it next to PTR; spec 7.4)."""
    lam = np.asarray(lambdas, dtype=np.float64).reshape(-1)
    if lam.size == 0:
        raise ValueError("no lambda values given")
    return float(np.mean(lam > epsilon))


@dataclass(frozen=True)
class TransferSummary:
    """Evaluation against LOCAL (Section 5, Tables 1-5): unweighted means over clients."""

    mean: float
    mean_local: float
    relative: float
    relative_min: float
    relative_max: float
    ptr: float
    ptr_strict: float


def transfer_summary(
    score: ArrayLike, score_local: ArrayLike, *, higher_is_better: bool = True
) -> TransferSummary:
    """Mean score, mean R-Acc (or R-MAE), its min/max, PTR (``>=``) and strict PTR (``>``)."""
    a, b = _paired_scores(score, score_local)
    rel = relative_improvement(a, b, higher_is_better=higher_is_better)
    return TransferSummary(
        mean=float(a.mean()),
        mean_local=float(b.mean()),
        relative=float(rel.mean()),
        relative_min=float(rel.min()),
        relative_max=float(rel.max()),
        ptr=positive_transfer_ratio(a, b, higher_is_better=higher_is_better),
        ptr_strict=positive_transfer_ratio(a, b, higher_is_better=higher_is_better, strict=True),
    )
