"""FMTL with feature heterogeneity: augmented datasets and heterogeneity-aware client weights.

Mathematics of Liu, Yang and Shen, "Exploiting Feature Heterogeneity for Improved Generalization
in Federated Multi-task Learning" (ISIT 2023), as plain functions on NumPy arrays (server side)
and torch tensors (client side). Nothing here imports Flower.

Setting (paper Sec. II-III). N clients, M tasks (a task is a class label in the deep experiments),
a shared representation z = phi(x) in R^k and one linear head w_c per task. Client i holds the
tasks C_i; I^c = {i : c in C_i} are the holders of task c; beta_i^c is client i's weight for head c.

Map from the paper to this module
---------------------------------
========================================  ==================================================
paper                                     here
========================================  ==================================================
augmented datasets D~_i^c (Sec. III)      :func:`augment_dataset` (literal construction),
                                          :func:`augmented_targets` (per-sample targets and
                                          weights for a generic loop), :func:`fmtl_head_loss`
ERM on original data, eq. (3)             ``Augmentation.ORIGINAL``
augmented ERM, eqs. (5) and (7)           ``Augmentation.AUGMENTED`` (default)
excess risk, eq. (6)                      :func:`excess_risk`
weight problem, eq. (10)                  :func:`task_statistics` (client),
                                          :func:`solve_eq10`, :func:`eq10_objective` (server)
closed-form weights, eq. (12)             :func:`fmtl_weights_eq12`, :func:`eq12_weight_matrix`
all weighting schemes (Sec. VI, EW)       :func:`head_weight_matrix`, :func:`body_weights`
partial participation (not in paper)      :func:`round_head_weights`
per-task head aggregation (Sec. V-VI)     :class:`HeadMap`, :func:`aggregate_parameters`
linear estimator of (5)/(3), closed form  :func:`linear_closed_form`
linear estimator of (5), FedAvg-GD        :func:`linear_heads_gd` + :func:`aggregate_parameters`
========================================  ==================================================

Who calls what
--------------
Client side (torch, inside the generic training loop):

* :func:`task_counts` on the local labels -> ``n_i^c`` (shape (M,)); the client reports it so
  the server knows C_i.
* :func:`fmtl_head_loss` (or :func:`augmented_targets` for a custom loss) as the local objective:
  every local sample trains every head (the augmented dataset).
* optionally :func:`task_statistics` on the frozen features -> :class:`TaskStatistics`
  (``to_arrays()`` gives the arrays that travel) for the eq. (10) weights or the linear closed form.

Server side (NumPy):

* :func:`task_membership` on the reported counts -> the holder matrix (S, M);
* :func:`round_head_weights` -> :class:`HeadAggregationWeights` (beta per participant and head,
  with the partial-participation and empty-holder policies applied);
* :func:`body_weights` for the representation;
* phase 1 (plain FedAvg/FedProx on the whole model): ``flwr_pfl.core.aggregation.weighted_average``
  with :func:`body_weights`;
* phase 2: :func:`merge_head_arrays` if clients upload only the head arrays, then
  :func:`aggregate_parameters`, which combines the client arrays: body with the body weights (or
  kept), each head with its own column of weights, as described by a :class:`HeadMap`.

When augmentation helps
-----------------------
Augmentation fits head c also on every other task's samples with target 0. That is right only
when the other tasks' features are (nearly) orthogonal to w_c (Assumption 4, small Delta): tasks
well separated in feature space, e.g. class-as-task or routing problems. With overlapping tasks
(homogeneous features, or multi-label problems where every input has a meaningful output on
every head) the zero targets are wrong and bias every head towards 0. The measured numbers are in
docs/fmtl-when-augmentation-helps.md; in short (linear model, k = 10, M = 10, N = 20, m = 2,
mean excess risk over 200 seeds): with well-separated tasks (tau = 0.1, Delta = 0.01) the excess
risk is 0.143 without augmentation and 0.013 with augmentation and eq. (12) weights; with
homogeneous features (Delta = 1) it is 0.145 without and 0.81 with augmentation (uniform weights).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "Augmentation",
    "HeadLoss",
    "HeadWeighting",
    "BodyWeighting",
    "ParticipationPolicy",
    "EmptyHolderPolicy",
    "Eq10Options",
    "FMTLWeightingOptions",
    "task_counts",
    "task_membership",
    "augment_dataset",
    "augmented_targets",
    "fmtl_head_loss",
    "fmtl_per_sample_loss",
    "head_leakage",
    "fmtl_weights_eq12",
    "eq12_weight_matrix",
    "head_weight_matrix",
    "body_weights",
    "TaskStatistics",
    "task_statistics",
    "eq10_objective",
    "Eq10Solution",
    "solve_eq10",
    "HeadAggregationWeights",
    "round_head_weights",
    "HeadSlice",
    "HeadMap",
    "aggregate_parameters",
    "select_head_arrays",
    "merge_head_arrays",
    "linear_closed_form",
    "linear_heads_gd",
    "excess_risk",
]

ArrayLike = np.ndarray | torch.Tensor

# Tolerance for "weights sum to 1" checks on float64 weights built from counts.
_SUM_TOL = 1e-9


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


class Augmentation(enum.StrEnum):
    """Which dataset each head is fitted on.

    * ``AUGMENTED`` (default; the paper's proposal, eqs. 5 and 7): every local sample of task c
      is also a sample (x, 0) of every other task c' != c, so every head sees all n_i local
      samples and its local loss is the mean over them.
    * ``ORIGINAL`` (eq. 3): a sample serves only its own task's head; head c's local loss is the
      mean over the n_i^c task-c samples (zero for tasks the client does not hold).
    """

    AUGMENTED = "augmented"
    ORIGINAL = "original"


class HeadLoss(enum.StrEnum):
    """Per-head loss of the local objective (spec P3 and Sec. 4, item 7).

    * ``CE`` (default for classification-as-tasks; what the paper's CIFAR runs most likely used):
      softmax cross-entropy over all M heads. Each sample raises its own logit and lowers every
      other one, the classification analogue of adding (x, 0) to the other tasks. It is always
      augmented (the softmax couples the heads), so ``Augmentation.ORIGINAL`` is refused.
    * ``MSE`` (the paper's linear regression): squared error on real-valued targets; the
      augmented target of head c is y on task-c samples and 0 elsewhere.
    * ``MSE_ONEHOT`` (literal augmented regression for classification): squared error against
      one-hot targets (1 for the sample's own head, 0 for the others).
    * ``BCE_OVR``: one-vs-rest binary cross-entropy on the logits; other tasks' samples are
      negatives of head c.
    """

    CE = "ce"
    MSE = "mse"
    MSE_ONEHOT = "mse_onehot"
    BCE_OVR = "bce_ovr"


class HeadWeighting(enum.StrEnum):
    """How head c is weighted across clients (beta_i^c), over a reference set of K clients.

    * ``FMTL_EQ12`` (default; the paper's method, eq. 12): if 2|I^c| <= K, holders share 1/2
      equally and non-holders share 1/2 equally; otherwise uniform 1/K.
    * ``FMTL_EQ10``: numerical solution of problem (10) from per-task feature second moments
      (:func:`solve_eq10`). It is a different option from eq. (12) and can give very different
      weights (uniform in the isotropic case); it is never substituted for it.
    * ``UNIFORM``: 1/K for every client.
    * ``NUM_EXAMPLES``: n_i / sum_j n_j (beta_hat_i, pooled least squares in eq. 5).
    * ``EW_PARTICIPANTS`` (the paper's "EW" baseline, recommended reading, spec Sec. 4):
      beta_i = 1/|I^t| with I^t the round's participants, i.e. uniform over the reference set.
    * ``EW_HOLDERS`` (second reading of "EW"; the non-augmented ERM of Theorem 2): 1/|I^c| for
      holders, 0 for non-holders. A task with no holder gets an all-zero column.
    """

    FMTL_EQ12 = "fmtl_eq12"
    FMTL_EQ10 = "fmtl_eq10"
    UNIFORM = "uniform"
    NUM_EXAMPLES = "num_examples"
    EW_PARTICIPANTS = "ew_participants"
    EW_HOLDERS = "ew_holders"


class BodyWeighting(enum.StrEnum):
    """Client weights for the representation (phase 1, and every array no head owns).

    * ``UNIFORM`` (default; the FedRep code the paper's experiments ran on uses equal weights)
    * ``NUM_EXAMPLES`` (Flower's FedAvg): n_i / sum_j n_j. Both agree when all n_i are equal.
    """

    UNIFORM = "uniform"
    NUM_EXAMPLES = "num_examples"


class ParticipationPolicy(enum.StrEnum):
    """How the full-participation weights of eq. (12) are adapted to a sampled round S_t.

    The paper defines beta over all N clients; it does not say what to do when only S_t trains.

    * ``ROUND_LOCAL`` (default, spec P1 (a)): apply the weighting to the participants, i.e. N ->
      |S_t| and I^c -> I^c intersected with S_t. Holders always get at least 1/2 of the mass.
    * ``POPULATION_RENORM`` (P1 (b)): the population weights (from a registry of all N clients)
      restricted to S_t and renormalized to sum to 1 per head.
    * ``POPULATION_UNBIASED_DELTA`` (P1 (c)): w_c <- w_c + (N/|S_t|) sum_{i in S_t} beta_i^c
      (w_{c,i} - w_c). Unbiased for the full-participation update under uniform sampling, with
      high variance for rare tasks. It is an affine, not a convex, combination: the current head
      keeps the weight 1 - (N/|S_t|) sum_{i in S_t} beta_i^c, which can be negative.

    Full participation in phase 2 (P1 (d)) is a sampling setting of the strategy, not a policy.
    """

    ROUND_LOCAL = "round_local"
    POPULATION_RENORM = "population_renorm"
    POPULATION_UNBIASED_DELTA = "population_unbiased_delta"


class EmptyHolderPolicy(enum.StrEnum):
    """What happens to head c when no participant of the round holds task c (spec P1).

    * ``KEEP`` (default): head c keeps its current value; the head is reported as skipped.
    * ``RENORMALIZE``: head c is averaged over the participants anyway, with their weights for c
      renormalized to sum to 1 (for eq. 12 under ``ROUND_LOCAL`` that is the uniform average of
      the non-holders, which pulls the head towards 0 on their features). When those weights are
      all zero (``EW_HOLDERS``) there is nothing to average and the head is kept and reported as
      skipped.
    * ``ERROR``: raise ValueError naming the tasks.
    """

    KEEP = "keep"
    RENORMALIZE = "renormalize"
    ERROR = "error"


@dataclass(frozen=True)
class Eq10Options:
    """Settings of the numerical solver for problem (10) (:func:`solve_eq10`).

    The paper does not solve (10); these are this library's defaults, not the paper's.

    Attributes:
        restarts: random starting points in addition to the two deterministic ones
            (gamma = beta_hat, and eq. (12) scaled into the box). Default 8.
        max_iter: projected super-gradient steps per start. Default 300.
        step: initial step length, as a fraction of the box diagonal ||beta_hat||; the step decays
            as 1/sqrt(t). Default 0.2.
        ridge: lambda >= 0 added to every client's G_i^c as lambda * I. Default 0 (the paper's
            problem). Needed when the other tasks' features do not span R^k, which makes
            sigma_min(Lambda_beta^{\\c}) = 0 for every beta.
        seed: seed of the random restarts (results are deterministic). Default 0.
    """

    restarts: int = 8
    max_iter: int = 300
    step: float = 0.2
    ridge: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.restarts < 0:
            raise ValueError(f"Eq10Options.restarts must be >= 0, got {self.restarts}")
        if self.max_iter < 1:
            raise ValueError(f"Eq10Options.max_iter must be >= 1, got {self.max_iter}")
        if not (np.isfinite(self.step) and self.step > 0):
            raise ValueError(f"Eq10Options.step must be a finite number > 0, got {self.step}")
        if not (np.isfinite(self.ridge) and self.ridge >= 0):
            raise ValueError(f"Eq10Options.ridge must be a finite number >= 0, got {self.ridge}")


@dataclass(frozen=True)
class FMTLWeightingOptions:
    """All server-side choices for the phase-2 head weights, in one typed object.

    Attributes:
        scheme: the weighting (default ``HeadWeighting.FMTL_EQ12``, the paper's eq. 12).
        participation: the partial-participation policy (default ``ROUND_LOCAL``, spec P1 (a)).
        empty_holder: what to do with a head no participant holds (default ``KEEP``, spec P1).
        eq10: solver settings, used only when ``scheme`` is ``FMTL_EQ10``.
    """

    scheme: HeadWeighting = HeadWeighting.FMTL_EQ12
    participation: ParticipationPolicy = ParticipationPolicy.ROUND_LOCAL
    empty_holder: EmptyHolderPolicy = EmptyHolderPolicy.KEEP
    eq10: Eq10Options = field(default_factory=Eq10Options)

    def __post_init__(self) -> None:
        for name, enum_type in (
            ("scheme", HeadWeighting),
            ("participation", ParticipationPolicy),
            ("empty_holder", EmptyHolderPolicy),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum_type(value))
            except ValueError:
                allowed = ", ".join(m.value for m in enum_type)
                raise ValueError(
                    f"FMTLWeightingOptions.{name}={value!r} is not allowed; allowed: {allowed}"
                ) from None


# --------------------------------------------------------------------------------------------
# Input validation (shared by the functions below)
# --------------------------------------------------------------------------------------------


def _to_numpy(x: ArrayLike, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def _is_int_at_least(value: object, low: int) -> bool:
    """True for a Python/NumPy integer (not a bool) >= low."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low


def _check_num_tasks(num_tasks: int) -> None:
    if not _is_int_at_least(num_tasks, 1):
        raise ValueError(f"num_tasks must be an integer >= 1, got {num_tasks!r}")


def _check_weight_vector(weights: np.ndarray, size: int, name: str) -> np.ndarray:
    """(size,) finite weights >= 0 summing to 1, as float64."""
    w = np.asarray(weights, dtype=np.float64)
    if (
        w.shape != (size,)
        or not np.all(np.isfinite(w))
        or np.any(w < 0)
        or abs(w.sum() - 1.0) > _SUM_TOL
    ):
        raise ValueError(f"{name} must be {size} finite weights >= 0 summing to 1, got {w!r}")
    return w


def _check_task_ids_np(task_ids: np.ndarray, num_tasks: int, name: str = "task_ids") -> None:
    if task_ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one task id per sample), got shape {task_ids.shape}")
    if task_ids.size and not np.issubdtype(task_ids.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {task_ids.dtype}")
    if task_ids.size and (task_ids.min() < 0 or task_ids.max() >= num_tasks):
        bad = task_ids[(task_ids < 0) | (task_ids >= num_tasks)]
        raise ValueError(
            f"{name} must lie in [0, {num_tasks}) (num_tasks={num_tasks}); found {bad[:5].tolist()}"
        )


def _check_task_ids_torch(task_ids: torch.Tensor, num_tasks: int, n: int) -> None:
    if task_ids.ndim != 1 or task_ids.shape[0] != n:
        raise ValueError(
            f"task_ids must have shape ({n},) (one task id per sample), got {tuple(task_ids.shape)}"
        )
    if task_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"task_ids must be an integer tensor, got dtype {task_ids.dtype}")
    if n and (int(task_ids.min()) < 0 or int(task_ids.max()) >= num_tasks):
        raise ValueError(
            f"task_ids must lie in [0, {num_tasks}) (num_tasks={num_tasks}); "
            f"got min {int(task_ids.min())}, max {int(task_ids.max())}"
        )


def _check_membership(membership: np.ndarray, name: str = "membership") -> np.ndarray:
    membership = np.asarray(membership)
    if membership.ndim != 2 or membership.shape[0] < 1 or membership.shape[1] < 1:
        raise ValueError(
            f"{name} must be a 2-D boolean array (clients, tasks) with at least one of each, "
            f"got shape {membership.shape}"
        )
    if membership.dtype != np.bool_:
        raise ValueError(f"{name} must have dtype bool (holder mask), got {membership.dtype}")
    empty = np.flatnonzero(~membership.any(axis=1))
    if empty.size:
        raise ValueError(
            f"{name}: client row(s) {empty.tolist()} hold no task; every client must hold at "
            "least one task (drop such clients before weighting)"
        )
    return membership


def _as_vector(x: ArrayLike | Sequence[float], name: str) -> np.ndarray:
    arr = _to_numpy(x, name) if isinstance(x, (np.ndarray, torch.Tensor)) else x
    try:
        vec = np.asarray(arr, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a 1-D array of numbers") from None
    if vec.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {vec.shape}")
    return vec


def _check_num_examples(num_examples: ArrayLike | Sequence[float], size: int | None) -> np.ndarray:
    n = _as_vector(num_examples, "num_examples")
    if size is not None and n.shape != (size,):
        raise ValueError(f"num_examples must have shape ({size},), got {n.shape}")
    if n.size == 0:
        raise ValueError("num_examples is empty; at least one client is needed")
    bad = np.flatnonzero(~np.isfinite(n) | (n < 0))
    if bad.size:
        raise ValueError(
            f"num_examples must be finite and >= 0; client(s) {bad.tolist()} have "
            f"{n[bad].tolist()}"
        )
    if n.sum() <= 0:
        raise ValueError("num_examples sum to 0; at least one client must have examples")
    return n


def _shares(num_examples: np.ndarray) -> np.ndarray:
    """beta_hat_i = n_i / n (paper Sec. III), shape (K,)."""
    return num_examples / num_examples.sum()


def _renormalize_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Divide every column of ``w`` (K, M) by its sum; return it and the mask of zero-sum columns."""
    sums = w.sum(axis=0)
    zero = sums <= 0
    out = np.zeros_like(w)
    out[:, ~zero] = w[:, ~zero] / sums[~zero]
    return out, zero


# --------------------------------------------------------------------------------------------
# Task membership
# --------------------------------------------------------------------------------------------


def task_counts(task_ids: ArrayLike, num_tasks: int) -> np.ndarray:
    """Per-task sample counts n_i^c of one client (client side).

    The counts define C_i = {c : n_i^c >= min_count} (:func:`task_membership`), which is all
    the server needs for eq. (12) ("distribution-free" weights). Sending the counts rather than
    the set also gives n_i = sum_c n_i^c and lets the server apply its own ``min_count``.

    Args:
        task_ids: (n_i,) integer task id of every local sample (the class label when tasks are
            classes), numpy or torch.
        num_tasks: M.

    Returns:
        (M,) int64 counts.
    """
    _check_num_tasks(num_tasks)
    ids = np.asarray(_to_numpy(task_ids, "task_ids"))
    _check_task_ids_np(ids, num_tasks)
    return np.bincount(ids.astype(np.int64), minlength=num_tasks).astype(np.int64)


def task_membership(counts: ArrayLike, min_count: int = 1) -> np.ndarray:
    """Holder mask c in C_i from per-task counts (server side).

    Client i holds task c when n_i^c >= ``min_count`` (default 1, spec P9: the FedRep shard
    scheme can give a client the same class twice, so membership is defined by presence).

    Args:
        counts: (M,) counts of one client or (K, M) counts of K clients (from :func:`task_counts`).
        min_count: smallest count that makes a client a holder (>= 1).

    Returns:
        bool array of the shape of ``counts``.

    Raises:
        ValueError: negative or non-finite counts, or a client that holds no task (a client with
            no task cannot be weighted: beta_hat_i = 0 in eqs. 5 and 10). The message names the
            rows, so the caller can reject those clients and go on with the others.
    """
    if not _is_int_at_least(min_count, 1):
        raise ValueError(f"min_count must be an integer >= 1, got {min_count!r}")
    c = np.asarray(_to_numpy(counts, "counts") if isinstance(counts, torch.Tensor) else counts)
    if c.ndim not in (1, 2) or c.shape[-1] < 1:
        raise ValueError(f"counts must have shape (M,) or (K, M), got {c.shape}")
    if not np.issubdtype(c.dtype, np.number) or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("counts must be finite non-negative numbers")
    held = c >= min_count
    rows = held.reshape(-1, c.shape[-1])
    empty = np.flatnonzero(~rows.any(axis=1))
    if empty.size:
        which = "the client" if c.ndim == 1 else f"client row(s) {empty.tolist()}"
        raise ValueError(
            f"{which} hold(s) no task (no task has at least min_count={min_count} samples); "
            "a client must hold at least one task"
        )
    return held


# --------------------------------------------------------------------------------------------
# Augmented datasets (client side, torch)
# --------------------------------------------------------------------------------------------


def augment_dataset(
    features: torch.Tensor, targets: torch.Tensor, task_ids: torch.Tensor, num_tasks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Materialize the augmented datasets D~_i^c of paper Sec. III for one client.

    For every local sample (x, y) of task c, (x, 0) is added to the dataset of every other task
    c' != c in [M], including tasks the client does not perform, so |D~_i^c| = n_i for every c.
    The result is the union of the M augmented datasets, task-major: rows c*n_i .. (c+1)*n_i - 1
    are D~_i^c, i.e. all local samples in their original order, labelled y on task-c samples and
    0 on the others, with task id c.

    This literal form (M copies of the data) suits models that take (x, task) pairs and tests;
    a multi-head model should use :func:`augmented_targets` instead, which gives the same loss
    without copying.

    Args:
        features: (n_i, ...) inputs x (or features z).
        targets: (n_i,) real-valued labels y.
        task_ids: (n_i,) integer task of each sample.
        num_tasks: M.

    Returns:
        (features (M*n_i, ...), targets (M*n_i,), task_ids (M*n_i,) int64).
    """
    _check_num_tasks(num_tasks)
    n = features.shape[0] if features.ndim else 0
    if features.ndim < 1 or n == 0:
        raise ValueError(
            f"features must have shape (n_i, ...) with n_i >= 1, got {tuple(features.shape)}"
        )
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
    _check_task_ids_torch(task_ids, num_tasks, n)
    ids = task_ids.to(torch.int64)
    tasks = torch.arange(num_tasks, device=ids.device)
    own = ids.unsqueeze(0) == tasks.unsqueeze(1)  # (M, n): sample j belongs to task c
    aug_targets = torch.where(own, targets.unsqueeze(0), torch.zeros_like(targets).unsqueeze(0))
    aug_features = features.unsqueeze(0).expand(num_tasks, *features.shape)
    aug_ids = tasks.unsqueeze(1).expand(num_tasks, n)
    return (
        aug_features.reshape(num_tasks * n, *features.shape[1:]),
        aug_targets.reshape(-1),
        aug_ids.reshape(-1),
    )


def augmented_targets(
    targets: torch.Tensor | None,
    task_ids: torch.Tensor,
    num_tasks: int,
    augmentation: Augmentation = Augmentation.AUGMENTED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample, per-head targets and loss weights equivalent to the augmented datasets.

    The augmented feature matrix of every task is the client's whole feature matrix (paper
    Sec. III: Z~_i^c = Z_i); only the label vector changes with c. So one pass over the local
    data with an (n_i, M) target matrix Y and weight matrix Omega gives every head's loss:

        loss_c = sum_j Omega[j, c] * l(out[j, c], Y[j, c]),   local objective = sum_c loss_c.

    * Y[j, c] = y_j if sample j belongs to task c, else 0 (``targets=None`` means y_j = 1,
      i.e. one-hot targets for classification).
    * ``AUGMENTED`` (eq. 5): Omega[j, c] = 1/n_i, each head's loss is the mean over all samples.
    * ``ORIGINAL`` (eq. 3): Omega[j, c] = 1[task_j = c] / n_i^c (0 for tasks not held).

    With the squared loss, the local objective is f_i(W) = (1/n_i) sum_c ||Z~_i^c^T w_c - Y~_i^c||^2
    of spec Sec. 3.2 (A2), whose per-head minimizers aggregated with beta_i^c give eq. (7).

    Args:
        targets: (n_i,) real-valued labels, or None for one-hot (y = 1) targets.
        task_ids: (n_i,) integer task of each sample.
        num_tasks: M.
        augmentation: ``AUGMENTED`` (default, the paper's proposal) or ``ORIGINAL``.

    Returns:
        (Y (n_i, M), Omega (n_i, M)), floating, on the device of ``task_ids``.
    """
    _check_num_tasks(num_tasks)
    augmentation = Augmentation(augmentation)
    n = task_ids.shape[0] if task_ids.ndim == 1 else -1
    if n < 1:
        raise ValueError(
            f"task_ids must have shape (n_i,) with n_i >= 1 (a client with no samples has no "
            f"local objective), got {tuple(task_ids.shape)}"
        )
    _check_task_ids_torch(task_ids, num_tasks, n)
    ids = task_ids.to(torch.int64)
    if targets is None:
        dtype = torch.get_default_dtype()
        y = torch.ones(n, dtype=dtype, device=ids.device)
    else:
        if targets.shape != (n,):
            raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
        if not torch.is_floating_point(targets):
            raise ValueError(
                f"targets must be real-valued (floating dtype), got {targets.dtype}; class "
                "labels go in task_ids with targets=None"
            )
        y = targets
    own = F.one_hot(ids, num_tasks).to(y.dtype)  # (n, M)
    y_aug = own * y.unsqueeze(1)
    if augmentation is Augmentation.AUGMENTED:
        omega = torch.full_like(own, 1.0 / n)
    else:
        per_task = own.sum(dim=0)  # n_i^c
        omega = own / per_task.clamp_min(1.0)
    return y_aug, omega


def fmtl_head_loss(
    outputs: torch.Tensor,
    task_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    head_loss: HeadLoss = HeadLoss.CE,
    augmentation: Augmentation = Augmentation.AUGMENTED,
) -> torch.Tensor:
    """The client's local objective over all M heads (augmented datasets; spec Sec. 3.5 (b)).

    Every head is trained on every local sample, including the heads of tasks the client does
    not hold: that is what gives a non-holder something to contribute to head c, and it is why
    eq. (12) weights make sense (spec Sec. 8.1).

    * ``CE``: mean softmax cross-entropy of ``outputs`` against the labels ``task_ids``.
    * ``MSE``: sum over heads of the per-head weighted squared error of :func:`augmented_targets`
      with the real ``targets``; with ``AUGMENTED`` this is (1/n_i) sum_c ||Z~^T w_c - Y~^c||^2,
      the paper's eq. (5) local term (a sum over heads, not a mean, so each head's gradient is
      exactly its own per-task gradient).
    * ``MSE_ONEHOT``: as ``MSE`` with one-hot targets (y = 1 on the own head).
    * ``BCE_OVR``: sum over heads of the weighted binary cross-entropy (with logits) against
      one-hot targets.

    Args:
        outputs: (n_i, M) head outputs (logits for CE and BCE_OVR), column c is head c.
        task_ids: (n_i,) integer task / class of each sample.
        targets: (n_i,) real labels, required for ``MSE`` and refused otherwise (the classes are
            in ``task_ids``).
        head_loss: the loss (default ``CE``, spec P3).
        augmentation: ``AUGMENTED`` (default) or ``ORIGINAL`` (refused with ``CE``).

    Returns:
        scalar tensor (differentiable in ``outputs``).
    """
    return fmtl_per_sample_loss(
        outputs, task_ids, targets, head_loss=head_loss, augmentation=augmentation
    ).mean()


def fmtl_per_sample_loss(
    outputs: torch.Tensor,
    task_ids: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    head_loss: HeadLoss = HeadLoss.CE,
    augmentation: Augmentation = Augmentation.AUGMENTED,
) -> torch.Tensor:
    """:func:`fmtl_head_loss` split into one term per sample, for a generic training loop.

    (:func:`fmtl_head_loss` is the mean of this; the checks live here.)

    Returns an (n_i,) tensor whose mean equals ``fmtl_head_loss(outputs, task_ids, targets)``
    (eqs. 5/7 with ``AUGMENTED``, eq. 3 with ``ORIGINAL``), so a loop that averages per-sample
    losses over a mini-batch optimizes the augmented objective on that batch: entry j is
    n_i * sum_c Omega[j, c] l(out[j, c], Y[j, c]) (for ``CE``, the cross-entropy of sample j).
    Same arguments and checks as :func:`fmtl_head_loss`.
    """
    head_loss = HeadLoss(head_loss)
    augmentation = Augmentation(augmentation)
    if outputs.ndim != 2:
        raise ValueError(f"outputs must have shape (n_i, M), got {tuple(outputs.shape)}")
    n, num_tasks = outputs.shape
    if n < 1:
        raise ValueError("outputs has no samples; a client with no samples has no local objective")
    _check_task_ids_torch(task_ids, num_tasks, n)
    if head_loss is HeadLoss.MSE:
        if targets is None:
            raise ValueError("head_loss='mse' needs real-valued targets; for classes use 'mse_onehot'")
    elif targets is not None:
        raise ValueError(
            f"head_loss={head_loss.value!r} takes its labels from task_ids; targets must be None "
            "(use head_loss='mse' for real-valued targets)"
        )
    if head_loss is HeadLoss.CE:
        if augmentation is not Augmentation.AUGMENTED:
            raise ValueError(
                "head_loss='ce' is always augmented (the softmax couples all heads); use "
                "augmentation='augmented', or head_loss 'mse_onehot'/'bce_ovr' for 'original'"
            )
        return F.cross_entropy(outputs, task_ids.to(torch.int64), reduction="none")
    y_aug, omega = augmented_targets(
        targets if head_loss is HeadLoss.MSE else None, task_ids, num_tasks, augmentation
    )
    y_aug = y_aug.to(outputs.dtype)
    omega = omega.to(outputs.dtype)
    if head_loss is HeadLoss.BCE_OVR:
        per_entry = F.binary_cross_entropy_with_logits(outputs, y_aug, reduction="none")
    else:
        per_entry = (outputs - y_aug) ** 2
    return n * (omega * per_entry).sum(dim=1)


def head_leakage(outputs: torch.Tensor, task_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Diagnostic estimate of the Delta of Assumption 4 per head (spec Sec. 8.3, inference).

    Delta_hat_c = mean over the local samples of other tasks (task != c) of head_c(z)^2: how far
    from 0 head c answers on other tasks' features. Small values mean augmentation is safe.

    Args:
        outputs: (n_i, M) head outputs.
        task_ids: (n_i,) integer task of each sample.

    Returns:
        (values (M,) float64, counts (M,) int64): counts are the numbers of non-c samples; a head
        with count 0 gets value 0 (no evidence), so the arrays are always finite.
    """
    if outputs.ndim != 2 or outputs.shape[0] < 1:
        raise ValueError(f"outputs must have shape (n_i, M) with n_i >= 1, got {tuple(outputs.shape)}")
    n, num_tasks = outputs.shape
    _check_task_ids_torch(task_ids, num_tasks, n)
    other = 1.0 - F.one_hot(task_ids.to(torch.int64), num_tasks).double()
    sq = outputs.detach().double() ** 2
    counts = other.sum(dim=0)
    sums = (sq * other).sum(dim=0)
    values = torch.where(counts > 0, sums / counts.clamp_min(1.0), torch.zeros_like(sums))
    return values.cpu().numpy(), counts.cpu().numpy().astype(np.int64)


# --------------------------------------------------------------------------------------------
# Client weights: eq. (12), uniform, sample counts, EW
# --------------------------------------------------------------------------------------------


def eq12_weight_matrix(membership: np.ndarray) -> np.ndarray:
    """Eq. (12) weights for every task at once, over a reference set of K clients.

    For task c with h = |I^c| holders in the reference set:

    * 1 <= h and 2h <= K: beta_i^c = 1/(2h) for holders, 1/(2(K - h)) for non-holders;
    * 2h > K: beta_i^c = 1/K for every client (the paper's third case);
    * h = 0 (not covered by the paper): 1/K, as in the spec's sketch; under partial
      participation the :class:`EmptyHolderPolicy` decides what happens to such a head.

    Eq. (12) is the exact minimizer of the loosened bound a/(S_in^2 S_out) of eq. (11), with
    S_in = sum_{i in I^c} beta_i^c and a = max_i beta_i^c / beta_hat_i for equal n_i.

    Args:
        membership: (K, M) bool holder mask.

    Returns:
        (K, M) float64; every column sums to 1.
    """
    return _eq12(_check_membership(membership))


def _eq12(membership: np.ndarray) -> np.ndarray:
    """Eq. (12) on a validated (K, M) holder mask (rows may hold no task)."""
    k = membership.shape[0]
    h = membership.sum(axis=0)
    beta = np.full(membership.shape, 1.0 / k)
    split = (h >= 1) & (2 * h <= k)
    if split.any():
        hs = h[split].astype(np.float64)
        holder_w = 1.0 / (2.0 * hs)
        other_w = 1.0 / (2.0 * (k - hs))  # k - h >= h >= 1 here
        beta[:, split] = np.where(membership[:, split], holder_w, other_w)
    return beta


def fmtl_weights_eq12(num_clients: int, holders: Sequence[int] | np.ndarray) -> np.ndarray:
    """Eq. (12) weights beta_i^c of one task c over N clients.

    Holders (I^c) share 1/2 and non-holders share 1/2 when |I^c| <= N/2; otherwise all weights
    are 1/N (see :func:`eq12_weight_matrix`, which this wraps).

    Args:
        num_clients: N >= 1.
        holders: indices in [0, N) of the clients holding the task, no repeats (may be empty:
            then 1/N everywhere).

    Returns:
        (N,) float64 weights summing to 1.
    """
    if not _is_int_at_least(num_clients, 1):
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    idx = np.asarray(holders, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= num_clients):
        raise ValueError(f"holders must be client indices in [0, {num_clients}), got {idx.tolist()}")
    if np.unique(idx).size != idx.size:
        raise ValueError(f"holders must not repeat a client, got {idx.tolist()}")
    mask = np.zeros((num_clients, 1), dtype=bool)
    mask[idx, 0] = True
    return _eq12(mask)[:, 0]


def body_weights(
    num_examples: ArrayLike | Sequence[float], scheme: BodyWeighting = BodyWeighting.UNIFORM
) -> np.ndarray:
    """Client weights for the representation (FedAvg in phase 1, or any non-head array).

    Args:
        num_examples: (S,) n_i of the participants (>= 0, not all 0).
        scheme: ``UNIFORM`` (default, FedRep) or ``NUM_EXAMPLES`` (Flower's FedAvg).

    Returns:
        (S,) float64 weights summing to 1.
    """
    scheme = BodyWeighting(scheme)
    n = _check_num_examples(num_examples, None)
    size = n.shape[0]
    if scheme is BodyWeighting.UNIFORM:
        return np.full(size, 1.0 / size)
    return _shares(n)


def head_weight_matrix(
    membership: np.ndarray,
    scheme: HeadWeighting = HeadWeighting.FMTL_EQ12,
    *,
    num_examples: ArrayLike | Sequence[float] | None = None,
    statistics: Sequence[TaskStatistics] | None = None,
    eq10: Eq10Options | None = None,
) -> np.ndarray:
    """Weights beta_i^c of every client of a reference set for every head.

    The reference set is whatever the caller treats as [N]: the round's participants (policy
    ``ROUND_LOCAL``) or the whole registered population (the population policies).

    Args:
        membership: (K, M) bool holder mask; every client must hold at least one task.
        scheme: see :class:`HeadWeighting` (default ``FMTL_EQ12``).
        num_examples: (K,) n_i; required by ``NUM_EXAMPLES``; used as beta_hat by ``FMTL_EQ10``
            (otherwise beta_hat comes from the statistics' counts).
        statistics: K :class:`TaskStatistics`, one per client in row order; required by
            ``FMTL_EQ10``.
        eq10: solver settings for ``FMTL_EQ10`` (default :class:`Eq10Options`).

    Returns:
        (K, M) float64. Every column sums to 1, except ``EW_HOLDERS`` columns of tasks without a
        holder, which are all 0. Tasks without a holder get 1/K under ``FMTL_EQ12`` and
        ``FMTL_EQ10`` (the paper does not cover them; see :class:`EmptyHolderPolicy`).
    """
    scheme = HeadWeighting(scheme)
    membership = _check_membership(membership)
    k, m = membership.shape
    if scheme in (HeadWeighting.UNIFORM, HeadWeighting.EW_PARTICIPANTS):
        return np.full((k, m), 1.0 / k)
    if scheme is HeadWeighting.NUM_EXAMPLES:
        if num_examples is None:
            raise ValueError("head weighting 'num_examples' needs num_examples")
        shares = _shares(_check_num_examples(num_examples, k))
        return np.repeat(shares[:, None], m, axis=1)
    if scheme is HeadWeighting.EW_HOLDERS:
        h = membership.sum(axis=0)
        return membership / np.maximum(h, 1)[None, :]
    if scheme is HeadWeighting.FMTL_EQ12:
        return eq12_weight_matrix(membership)
    # FMTL_EQ10
    if statistics is None or len(statistics) != k:
        raise ValueError(
            f"head weighting 'fmtl_eq10' needs one TaskStatistics per client ({k}), got "
            f"{None if statistics is None else len(statistics)}"
        )
    options = eq10 if eq10 is not None else Eq10Options()
    dims = {st.dim for st in statistics}
    if len(dims) != 1:
        raise ValueError(f"all TaskStatistics must have the same feature dimension, got {sorted(dims)}")
    for i, st in enumerate(statistics):
        if st.tasks.size and st.tasks.max() >= m:
            raise ValueError(f"statistics of client {i} name task {int(st.tasks.max())} >= M={m}")
    if num_examples is None:
        beta_hat = _shares(np.array([st.num_examples for st in statistics], dtype=np.float64))
    else:
        beta_hat = _shares(_check_num_examples(num_examples, k))
    beta = np.empty((k, m))
    for c in range(m):
        holders = membership[:, c]
        if not holders.any():
            beta[:, c] = 1.0 / k  # problem (10) is unbounded (S_in = 0 for every beta)
            continue
        gram = np.stack([st.moment_sum_excluding(c) for st in statistics])
        try:
            beta[:, c] = solve_eq10(gram, holders, beta_hat, options).beta
        except ValueError as err:
            raise ValueError(f"eq. (10) weights for task {c}: {err}") from None
    return beta


# --------------------------------------------------------------------------------------------
# Problem (10): statistics (client) and solver (server)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskStatistics:
    """One client's per-task feature statistics under the current (frozen) representation.

    Sent once the body is frozen (first phase-2 round), for the eq. (10) weights and for the
    linear closed form. Only held tasks appear (m_i rows).

    Attributes:
        tasks: (m_i,) int64 sorted task ids c in C_i.
        counts: (m_i,) int64 n_i^c >= 1.
        second_moments: (m_i, k, k) float64 Lambda_hat_i^c = (1/n_i^c) sum_{z in task c} z z^T
            (symmetric PSD; validated).
        cross_moments: (m_i, k) float64 (1/n_i^c) sum_{(z, y) in task c} z y, or None when the
            client has no real-valued targets (classification).
    """

    tasks: np.ndarray
    counts: np.ndarray
    second_moments: np.ndarray
    cross_moments: np.ndarray | None = None

    def __post_init__(self) -> None:
        tasks = np.asarray(self.tasks)
        counts = np.asarray(self.counts)
        sm = np.asarray(self.second_moments, dtype=np.float64)
        if tasks.ndim != 1 or tasks.size < 1 or not np.issubdtype(tasks.dtype, np.integer):
            raise ValueError(
                f"TaskStatistics.tasks must be a non-empty 1-D integer array, got {tasks!r}"
            )
        if np.any(tasks < 0) or np.unique(tasks).size != tasks.size or np.any(np.diff(tasks) < 0):
            raise ValueError(
                f"TaskStatistics.tasks must be sorted, unique and >= 0, got {tasks.tolist()}"
            )
        mi = tasks.size
        if counts.shape != (mi,) or not np.issubdtype(counts.dtype, np.integer) or np.any(counts < 1):
            raise ValueError(
                f"TaskStatistics.counts must be {mi} integers >= 1 (one per task), got {counts!r}"
            )
        if sm.ndim != 3 or sm.shape[0] != mi or sm.shape[1] != sm.shape[2] or sm.shape[1] < 1:
            raise ValueError(
                f"TaskStatistics.second_moments must have shape ({mi}, k, k), got {sm.shape}"
            )
        if not np.all(np.isfinite(sm)):
            raise ValueError("TaskStatistics.second_moments contain NaN or Inf")
        scale = max(1.0, float(np.abs(sm).max()))
        if np.abs(sm - sm.transpose(0, 2, 1)).max() > 1e-6 * scale:
            raise ValueError("TaskStatistics.second_moments are not symmetric (not second moments)")
        sm = 0.5 * (sm + sm.transpose(0, 2, 1))
        min_eig = np.linalg.eigvalsh(sm)[:, 0]
        if np.any(min_eig < -1e-6 * scale):
            bad = tasks[min_eig < -1e-6 * scale]
            raise ValueError(
                f"TaskStatistics.second_moments of task(s) {bad.tolist()} are not positive "
                "semi-definite (not second moments)"
            )
        cross = self.cross_moments
        if cross is not None:
            cross = np.asarray(cross, dtype=np.float64)
            if cross.shape != (mi, sm.shape[1]):
                raise ValueError(
                    f"TaskStatistics.cross_moments must have shape ({mi}, {sm.shape[1]}), "
                    f"got {cross.shape}"
                )
            if not np.all(np.isfinite(cross)):
                raise ValueError("TaskStatistics.cross_moments contain NaN or Inf")
        object.__setattr__(self, "tasks", tasks.astype(np.int64))
        object.__setattr__(self, "counts", counts.astype(np.int64))
        object.__setattr__(self, "second_moments", sm)
        object.__setattr__(self, "cross_moments", cross)

    @property
    def dim(self) -> int:
        """Feature dimension k."""
        return int(self.second_moments.shape[1])

    @property
    def num_examples(self) -> int:
        """n_i = sum_c n_i^c."""
        return int(self.counts.sum())

    def total_second_moment(self) -> np.ndarray:
        """S_i = Z_i Z_i^T / n_i = sum_c (n_i^c / n_i) Lambda_hat_i^c, shape (k, k).

        The Gram matrix of every augmented dataset of the client (Z~_i^c = Z_i for all c).
        """
        w = self.counts / self.num_examples
        return np.einsum("c,ckl->kl", w, self.second_moments)

    def moment_sum_excluding(self, task: int) -> np.ndarray:
        """G_i^c = sum_{c' in C_i, c' != c} Lambda_hat_i^{c'} (spec Sec. 3.3), shape (k, k).

        Client i's contribution to Lambda_beta^{\\c} of eq. (10), per unit weight.
        """
        keep = self.tasks != task
        return self.second_moments[keep].sum(axis=0)

    def to_arrays(self) -> list[np.ndarray]:
        """The arrays that travel: [tasks, counts, second_moments(, cross_moments)]."""
        arrays = [self.tasks, self.counts, self.second_moments]
        if self.cross_moments is not None:
            arrays.append(self.cross_moments)
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], *, num_tasks: int | None = None,
                    dim: int | None = None) -> TaskStatistics:
        """Rebuild (and validate) statistics received as arrays from :meth:`to_arrays`.

        Args:
            arrays: 3 or 4 arrays as written by :meth:`to_arrays`.
            num_tasks: if given, task ids must be < num_tasks.
            dim: if given, the feature dimension must equal it.
        """
        if len(arrays) not in (3, 4):
            raise ValueError(
                f"TaskStatistics arrays must be [tasks, counts, second_moments(, cross_moments)], "
                f"got {len(arrays)} arrays"
            )
        st = cls(*arrays)
        if num_tasks is not None and st.tasks.max() >= num_tasks:
            raise ValueError(f"TaskStatistics name task {int(st.tasks.max())} >= num_tasks={num_tasks}")
        if dim is not None and st.dim != dim:
            raise ValueError(f"TaskStatistics have feature dimension {st.dim}, expected {dim}")
        return st


def task_statistics(
    features: ArrayLike, task_ids: ArrayLike, num_tasks: int, targets: ArrayLike | None = None
) -> TaskStatistics:
    """Per-task feature second moments (and cross moments) of one client (client side).

    Computed in float64 from the features z = phi(x) of the frozen representation.

    Args:
        features: (n_i, k) features, numpy or torch.
        task_ids: (n_i,) integer task of each sample.
        num_tasks: M.
        targets: optional (n_i,) real labels (linear regression) for the cross moments.

    Returns:
        :class:`TaskStatistics` over the tasks present locally.
    """
    _check_num_tasks(num_tasks)
    z = np.asarray(_to_numpy(features, "features"), dtype=np.float64)
    ids = np.asarray(_to_numpy(task_ids, "task_ids"))
    if z.ndim != 2 or z.shape[0] < 1:
        raise ValueError(
            f"features must have shape (n_i, k) with n_i >= 1 (a client with no samples has no "
            f"statistics), got {z.shape}"
        )
    if ids.shape != (z.shape[0],):
        raise ValueError(f"task_ids must have shape ({z.shape[0]},), got {ids.shape}")
    _check_task_ids_np(ids, num_tasks)
    if not np.all(np.isfinite(z)):
        raise ValueError("features contain NaN or Inf")
    counts = np.bincount(ids, minlength=num_tasks)
    tasks = np.flatnonzero(counts)
    onehot = (ids[:, None] == tasks[None, :]).astype(np.float64)  # (n, m_i)
    inv = 1.0 / counts[tasks]
    n, k = z.shape
    per_task = (onehot[:, :, None] * z[:, None, :]).reshape(n, tasks.size * k)
    second = (per_task.T @ z).reshape(tasks.size, k, k) * inv[:, None, None]
    cross = None
    if targets is not None:
        y = np.asarray(_to_numpy(targets, "targets"), dtype=np.float64)
        if y.shape != (z.shape[0],):
            raise ValueError(f"targets must have shape ({z.shape[0]},), got {y.shape}")
        if not np.all(np.isfinite(y)):
            raise ValueError("targets contain NaN or Inf")
        cross = (onehot.T @ (z * y[:, None])) * inv[:, None]
    return TaskStatistics(tasks, counts[tasks].astype(np.int64), second, cross)


def _check_eq10_inputs(
    gram: np.ndarray, holders: np.ndarray, beta_hat: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    gram = np.asarray(gram, dtype=np.float64)
    holders = np.asarray(holders)
    beta_hat = np.asarray(beta_hat, dtype=np.float64)
    if gram.ndim != 3 or gram.shape[1] != gram.shape[2] or gram.shape[0] < 1:
        raise ValueError(f"gram must have shape (N, k, k), got {gram.shape}")
    n = gram.shape[0]
    if holders.shape != (n,) or holders.dtype != np.bool_:
        raise ValueError(
            f"holders must be a bool array of shape ({n},), got {holders.dtype} {holders.shape}"
        )
    if beta_hat.shape != (n,) or not np.all(np.isfinite(beta_hat)) or np.any(beta_hat <= 0):
        raise ValueError(
            f"beta_hat must be ({n},) positive sample shares n_i/n (every client needs samples), "
            f"got {beta_hat!r}"
        )
    if not np.all(np.isfinite(gram)):
        raise ValueError("gram contains NaN or Inf")
    return 0.5 * (gram + gram.transpose(0, 2, 1)), holders, beta_hat


def eq10_objective(
    beta: np.ndarray, gram: np.ndarray, holders: np.ndarray, beta_hat: np.ndarray
) -> np.ndarray:
    """Objective of problem (10) for one task, a_beta / (sigma_min(Lambda_beta^{\\c}) S_in).

    a_beta = max_i beta_i / beta_hat_i, Lambda_beta^{\\c} = sum_i beta_i G_i^c,
    S_in = sum_{i in I^c} beta_i (the paper prints Lambda_beta^{cc}, a typo).

    Args:
        beta: (N,) or (B, N) points of the simplex.
        gram: (N, k, k) G_i^c (:meth:`TaskStatistics.moment_sum_excluding`).
        holders: (N,) bool, i in I^c.
        beta_hat: (N,) n_i / n.

    Returns:
        () or (B,) float64; +inf where sigma_min = 0 or S_in = 0 (the bound is void there).
    """
    gram, holders, beta_hat = _check_eq10_inputs(gram, holders, beta_hat)
    b = np.asarray(beta, dtype=np.float64)
    single = b.ndim == 1
    b = np.atleast_2d(b)
    if b.shape[1] != gram.shape[0]:
        raise ValueError(f"beta must have {gram.shape[0]} entries per point, got shape {b.shape}")
    if np.any(b < 0) or np.any(np.abs(b.sum(axis=1) - 1.0) > 1e-9):
        raise ValueError("beta must lie on the probability simplex (>= 0, summing to 1)")
    lam = np.linalg.eigvalsh(np.einsum("bi,ikl->bkl", b, gram))[:, 0]
    s_in = b[:, holders].sum(axis=1)
    a = (b / beta_hat).max(axis=1)
    ok = (lam > 0) & (s_in > 0)
    out = np.full(b.shape[0], np.inf)
    out[ok] = a[ok] / (lam[ok] * s_in[ok])
    return out[0] if single else out


@dataclass(frozen=True)
class Eq10Solution:
    """Result of :func:`solve_eq10`.

    Attributes:
        beta: (N,) weights on the simplex.
        objective: value of problem (10) at ``beta`` (smaller is better).
        gamma: (N,) box-form solution (0 <= gamma <= beta_hat); beta = gamma / sum(gamma).
    """

    beta: np.ndarray
    objective: float
    gamma: np.ndarray


def _box_value_and_supergradient(
    gamma: np.ndarray, gram: np.ndarray, holders: np.ndarray
) -> tuple[float, np.ndarray]:
    """f(gamma) = lambda_min(sum_i gamma_i G_i) * S_in(gamma) / sum(gamma) and a super-gradient."""
    a = np.einsum("i,ikl->kl", gamma, gram)
    w, v = np.linalg.eigh(a)
    lam, vec = w[0], v[:, 0]
    s_in = gamma[holders].sum()
    total = gamma.sum()
    dlam = np.einsum("k,ikl,l->i", vec, gram, vec)
    grad = dlam * s_in / total + lam * (holders / total - s_in / total**2)
    return float(lam * s_in / total), grad


def solve_eq10(
    gram: np.ndarray,
    holders: np.ndarray,
    beta_hat: np.ndarray,
    options: Eq10Options | None = None,
) -> Eq10Solution:
    """Solve problem (10) for one task numerically (spec Sec. 3.3, observation 3).

    a_beta, sigma_min(Lambda_beta^{\\c}) and S_in are each homogeneous of degree 1 in beta, so
    with beta = gamma / sum(gamma) and a(gamma) = 1, (10) is equivalent to the box problem

        max_gamma  f(gamma) = lambda_min(sum_i gamma_i G_i) * S_in(gamma) / sum_i gamma_i,
        0 <= gamma_i <= beta_hat_i,

    whose optimum value is 1 / (optimum of (10)). f is not concave in general: it is maximized
    by projected super-gradient ascent (super-gradient of lambda_min: v^T G_i v for the bottom
    eigenvector v) from gamma = beta_hat, from eq. (12) scaled into the box, and from
    ``options.restarts`` random points; the best point is returned.

    Args:
        gram: (N, k, k) G_i^c = sum_{c' in C_i \\ {c}} Lambda_i^{c'}.
        holders: (N,) bool, i in I^c (at least one).
        beta_hat: (N,) n_i / n, all > 0.
        options: solver settings (default :class:`Eq10Options`).

    Returns:
        :class:`Eq10Solution`.

    Raises:
        ValueError: no holder (S_in = 0 for every beta), or sigma_min(Lambda_beta^{\\c}) = 0 for
            every beta tried (the other tasks' features do not span R^k; set
            ``Eq10Options(ridge=...)`` > 0, or use eq. (12)).
    """
    options = options if options is not None else Eq10Options()
    gram, holders, beta_hat = _check_eq10_inputs(gram, holders, beta_hat)
    n, k = gram.shape[0], gram.shape[1]
    if not holders.any():
        raise ValueError("no client holds the task: problem (10) is unbounded (S_in = 0)")
    if options.ridge > 0:
        gram = gram + options.ridge * np.eye(k)[None]
    rng = np.random.default_rng(options.seed)
    eq12 = fmtl_weights_eq12(n, np.flatnonzero(holders))
    starts = [beta_hat.copy(), eq12 / np.max(eq12 / beta_hat)]
    starts += [rng.uniform(0.05, 1.0, size=n) * beta_hat for _ in range(options.restarts)]
    step0 = options.step * float(np.linalg.norm(beta_hat))
    best_f, best_gamma = -np.inf, starts[0]
    for gamma in starts:
        for it in range(options.max_iter):
            f, grad = _box_value_and_supergradient(gamma, gram, holders)
            if f > best_f:
                best_f, best_gamma = f, gamma.copy()
            norm = float(np.linalg.norm(grad))
            if norm == 0.0:
                break
            nxt = np.clip(gamma + (step0 / np.sqrt(it + 1.0)) * grad / norm, 0.0, beta_hat)
            if nxt.sum() <= 0 or np.array_equal(nxt, gamma):
                break  # degenerate, or a vertex of the box where the ascent direction points out
            gamma = nxt
    scale = float(np.max(np.abs(gram))) if gram.size else 0.0
    if not best_f > 1e-12 * max(scale, 1e-300) * float(beta_hat.max()):
        raise ValueError(
            "sigma_min(Lambda_beta^{\\c}) is 0 for every weight vector tried: the features of the "
            "other tasks do not span the feature space; set Eq10Options(ridge=...) > 0 or use "
            "eq. (12)"
        )
    beta = best_gamma / best_gamma.sum()
    obj = float(eq10_objective(beta, gram, holders, beta_hat))
    return Eq10Solution(beta=beta, objective=obj, gamma=best_gamma)


# --------------------------------------------------------------------------------------------
# Partial participation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadAggregationWeights:
    """Per-head affine aggregation weights of one round.

    New head c = anchor[c] * current head c + sum_i client[i, c] * client i's head c, with
    sum_i client[i, c] + anchor[c] = 1 for every c (validated). A plain weighted average has
    anchor 0; a kept head has client weights 0 and anchor 1; the unbiased-delta policy has
    anchor 1 - sum_i client[i, c].

    Attributes:
        client: (S, M) weights of the participants.
        anchor: (M,) weight of the current global head.
        skipped: (M,) bool, heads kept because the policy had nothing to average.
        membership: (S, M) bool holder mask of the participants (for logging).
    """

    client: np.ndarray
    anchor: np.ndarray
    skipped: np.ndarray
    membership: np.ndarray

    def __post_init__(self) -> None:
        client = np.asarray(self.client, dtype=np.float64)
        anchor = np.asarray(self.anchor, dtype=np.float64)
        if client.ndim != 2:
            raise ValueError(f"client weights must have shape (S, M), got {client.shape}")
        s, m = client.shape
        if anchor.shape != (m,) or np.asarray(self.skipped).shape != (m,):
            raise ValueError(f"anchor and skipped must have shape ({m},)")
        if np.asarray(self.membership).shape != (s, m):
            raise ValueError(f"membership must have shape ({s}, {m})")
        if not (np.all(np.isfinite(client)) and np.all(np.isfinite(anchor))):
            raise ValueError("aggregation weights contain NaN or Inf")
        total = client.sum(axis=0) + anchor
        bad = np.flatnonzero(np.abs(total - 1.0) > _SUM_TOL)
        if bad.size:
            raise ValueError(
                f"weights of head(s) {bad.tolist()} sum to {total[bad].tolist()} (client weights "
                "plus anchor must sum to 1)"
            )
        object.__setattr__(self, "client", client)
        object.__setattr__(self, "anchor", anchor)
        object.__setattr__(self, "skipped", np.asarray(self.skipped, dtype=bool))
        object.__setattr__(self, "membership", np.asarray(self.membership, dtype=bool))

    @classmethod
    def from_beta(
        cls, beta: np.ndarray, membership: np.ndarray | None = None
    ) -> HeadAggregationWeights:
        """Plain per-head weighted averages: ``beta`` (S, M) with columns summing to 1."""
        beta = np.asarray(beta, dtype=np.float64)
        if beta.ndim != 2:
            raise ValueError(f"beta must have shape (S, M), got {beta.shape}")
        if np.any(beta < 0):
            raise ValueError("beta must be >= 0")
        mem = np.ones(beta.shape, dtype=bool) if membership is None else membership
        return cls(beta, np.zeros(beta.shape[1]), np.zeros(beta.shape[1], dtype=bool), mem)

    @property
    def holder_count(self) -> np.ndarray:
        """(M,) |I^c intersected with S_t|."""
        return self.membership.sum(axis=0)

    @property
    def holders_weight(self) -> np.ndarray:
        """(M,) total client weight on participating holders of each head."""
        return (self.client * self.membership).sum(axis=0)


def round_head_weights(
    membership: np.ndarray,
    options: FMTLWeightingOptions | None = None,
    *,
    num_examples: ArrayLike | Sequence[float] | None = None,
    statistics: Sequence[TaskStatistics] | None = None,
    population_beta: np.ndarray | None = None,
    participant_ids: Sequence[int] | np.ndarray | None = None,
) -> HeadAggregationWeights:
    """Head aggregation weights of one (possibly partial) round (spec Sec. 3.5 (d) and P1).

    * ``ROUND_LOCAL`` (default): :func:`head_weight_matrix` on the participants (N -> |S_t|,
      I^c -> I^c intersected with S_t). Needs ``num_examples`` / ``statistics`` of the
      participants when the scheme uses them.
    * ``POPULATION_RENORM`` / ``POPULATION_UNBIASED_DELTA``: need ``population_beta`` (N, M),
      computed by :func:`head_weight_matrix` on the registered population, and the
      ``participant_ids`` (S,) of the participants' rows in it.

    Then the :class:`EmptyHolderPolicy` is applied to heads no participant holds.

    Args:
        membership: (S, M) bool holder mask of the participants.
        options: scheme and policies (default :class:`FMTLWeightingOptions`).
        num_examples: (S,) n_i of the participants (``ROUND_LOCAL`` with ``NUM_EXAMPLES`` or
            ``FMTL_EQ10``).
        statistics: S :class:`TaskStatistics` (``ROUND_LOCAL`` with ``FMTL_EQ10``).
        population_beta: (N, M) population weights (population policies only).
        participant_ids: (S,) distinct row indices into ``population_beta``.

    Returns:
        :class:`HeadAggregationWeights` for :func:`aggregate_parameters`.
    """
    options = options if options is not None else FMTLWeightingOptions()
    membership = _check_membership(membership)
    s, m = membership.shape
    policy = options.participation
    if policy is ParticipationPolicy.ROUND_LOCAL:
        if population_beta is not None or participant_ids is not None:
            raise ValueError(
                "population_beta / participant_ids are used only by the population policies "
                "('population_renorm', 'population_unbiased_delta'), not by 'round_local'"
            )
        base = head_weight_matrix(
            membership, options.scheme, num_examples=num_examples, statistics=statistics,
            eq10=options.eq10,
        )
        client = base.copy()
        anchor = np.zeros(m)
        fallback, zero = _renormalize_columns(base)
    else:
        if num_examples is not None or statistics is not None:
            raise ValueError(
                "num_examples / statistics are used only by 'round_local'; the population "
                "policies take population_beta (computed with head_weight_matrix)"
            )
        if population_beta is None or participant_ids is None:
            raise ValueError(
                f"participation policy {policy.value!r} needs population_beta and participant_ids"
            )
        pop = np.asarray(population_beta, dtype=np.float64)
        if pop.ndim != 2 or pop.shape[1] != m:
            raise ValueError(f"population_beta must have shape (N, {m}), got {pop.shape}")
        if not np.all(np.isfinite(pop)) or np.any(pop < 0):
            raise ValueError("population_beta must be finite and >= 0")
        sums = pop.sum(axis=0)
        if np.any((np.abs(sums - 1.0) > _SUM_TOL) & (sums != 0)):
            raise ValueError("every column of population_beta must sum to 1 (or be all 0)")
        ids = np.asarray(participant_ids, dtype=np.int64).reshape(-1)
        n_pop = pop.shape[0]
        if ids.shape != (s,) or np.unique(ids).size != s or ids.min() < 0 or ids.max() >= n_pop:
            raise ValueError(
                f"participant_ids must be {s} distinct row indices in [0, {n_pop}), got {ids.tolist()}"
            )
        restricted = pop[ids]
        fallback, zero = _renormalize_columns(restricted)
        if policy is ParticipationPolicy.POPULATION_RENORM:
            client = fallback.copy()
            anchor = np.zeros(m)  # zero-sum columns are kept below
        else:
            client = (n_pop / s) * restricted
            anchor = 1.0 - client.sum(axis=0)
    skipped = zero.copy()
    empty = ~membership.any(axis=0)
    if empty.any():
        if options.empty_holder is EmptyHolderPolicy.ERROR:
            raise ValueError(
                f"no participant holds task(s) {np.flatnonzero(empty).tolist()}; empty-holder "
                "policy 'error' (allowed: keep, renormalize, error)"
            )
        if options.empty_holder is EmptyHolderPolicy.KEEP:
            skipped |= empty
        else:  # RENORMALIZE
            client[:, empty] = fallback[:, empty]
            anchor[empty] = 0.0
    # Heads with nothing to average keep their value.
    client[:, skipped] = 0.0
    anchor[skipped] = 1.0
    return HeadAggregationWeights(client, anchor, skipped, membership)


# --------------------------------------------------------------------------------------------
# Head map and aggregation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSlice:
    """A piece of a model parameter list that belongs to one task's head.

    Attributes:
        array: index of the array in the parameter list (the NumPy list on the wire).
        row: index along the array's first axis (row c of a stacked ``Linear(k, M)`` weight, or
            entry c of its bias), or None when the whole array belongs to the task.
    """

    array: int
    row: int | None = None


@dataclass(frozen=True)
class HeadMap:
    """Which parameters form the head of each task; everything else is body.

    ``slices[c]`` lists the pieces of task c's head. Two layouts (mixable):

    * stacked linear head (classification-as-tasks, the paper's CIFAR setup, spec P4): one
      ``Linear(k, M)``; task c owns row c of the weight and entry c of the bias
      (:meth:`stacked_linear`);
    * multi-head: task c owns whole arrays (:meth:`per_task_arrays`).

    The structure is checked on construction (every task owns something, no piece is owned
    twice); :meth:`validate` checks it against a model's array shapes.
    """

    slices: tuple[tuple[HeadSlice, ...], ...]

    def __post_init__(self) -> None:
        slices = tuple(tuple(s) for s in self.slices)
        if not slices:
            raise ValueError("HeadMap needs at least one task")
        whole: dict[int, int] = {}
        rows: dict[tuple[int, int], int] = {}
        row_arrays: dict[int, int] = {}
        for c, pieces in enumerate(slices):
            if not pieces:
                raise ValueError(f"HeadMap: task {c} owns no parameters")
            for p in pieces:
                if not isinstance(p, HeadSlice):
                    raise ValueError(f"HeadMap: task {c} has {p!r}, expected HeadSlice")
                if not _is_int_at_least(p.array, 0):
                    raise ValueError(
                        f"HeadMap: task {c} names array index {p.array!r}; must be an int >= 0"
                    )
                if p.row is None:
                    if p.array in whole or p.array in row_arrays:
                        raise ValueError(
                            f"HeadMap: array {p.array} is claimed by task {c} and another piece"
                        )
                    whole[p.array] = c
                else:
                    if not _is_int_at_least(p.row, 0):
                        raise ValueError(
                            f"HeadMap: task {c} names row {p.row!r} of array {p.array}; "
                            "must be an int >= 0"
                        )
                    key = (int(p.array), int(p.row))
                    if key in rows or p.array in whole:
                        raise ValueError(
                            f"HeadMap: row {p.row} of array {p.array} is claimed by task {c} "
                            "and another piece"
                        )
                    rows[key] = c
                    row_arrays[int(p.array)] = c
        object.__setattr__(self, "slices", slices)

    @classmethod
    def stacked_linear(
        cls, num_tasks: int, weight_index: int, bias_index: int | None = None
    ) -> HeadMap:
        """Task c = row c of the weight (M, k) and entry c of the bias (M,) (spec P4).

        ``bias_index=None`` for a head layer without bias.
        """
        _check_num_tasks(num_tasks)
        rows = []
        for c in range(num_tasks):
            pieces = [HeadSlice(weight_index, c)]
            if bias_index is not None:
                pieces.append(HeadSlice(bias_index, c))
            rows.append(tuple(pieces))
        return cls(tuple(rows))

    @classmethod
    def per_task_arrays(cls, arrays_per_task: Sequence[Sequence[int]]) -> HeadMap:
        """Task c owns the whole arrays ``arrays_per_task[c]`` (multi-head models)."""
        return cls(tuple(tuple(HeadSlice(int(a)) for a in arrays) for arrays in arrays_per_task))

    @property
    def num_tasks(self) -> int:
        """M."""
        return len(self.slices)

    def head_array_indices(self) -> tuple[int, ...]:
        """Sorted indices of the arrays that hold (part of) a head: what phase 2 trains/uploads."""
        return tuple(sorted({p.array for pieces in self.slices for p in pieces}))

    def body_array_indices(self, num_arrays: int) -> tuple[int, ...]:
        """Indices of the arrays no head touches (the representation)."""
        heads = set(self.head_array_indices())
        return tuple(i for i in range(num_arrays) if i not in heads)

    def validate(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Check the map against a model's array shapes; raise ValueError if it does not fit."""
        n = len(shapes)
        for c, pieces in enumerate(self.slices):
            for p in pieces:
                if p.array >= n:
                    raise ValueError(
                        f"HeadMap: task {c} names array {p.array}, but the model has {n} "
                        f"arrays (0..{n - 1})"
                    )
                if p.row is not None:
                    shape = tuple(shapes[p.array])
                    if len(shape) == 0:
                        raise ValueError(
                            f"HeadMap: task {c} names a row of array {p.array}, which is a scalar"
                        )
                    if p.row >= shape[0]:
                        raise ValueError(
                            f"HeadMap: task {c} names row {p.row} of array {p.array} with shape {shape} "
                            f"(rows 0..{shape[0] - 1})"
                        )

    def row_owners(self, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """Owner task of every row of every array (-1 = body), after :meth:`validate`.

        Arrays owned whole, and body arrays, have a single entry (they are treated as one row).
        """
        self.validate(shapes)
        owners: list[np.ndarray] = [np.array([-1]) for _ in shapes]
        for c, pieces in enumerate(self.slices):
            for p in pieces:
                if p.row is None:
                    owners[p.array] = np.array([c])
                else:
                    if owners[p.array].shape[0] != shapes[p.array][0]:
                        owners[p.array] = np.full(shapes[p.array][0], -1)
                    owners[p.array][p.row] = c
        return owners


def _check_client_arrays(
    client_params: Sequence[Sequence[np.ndarray]], current: Sequence[np.ndarray] | None
) -> list[tuple[int, ...]]:
    if len(client_params) < 1:
        raise ValueError("no client parameters to aggregate")
    shapes = [tuple(np.shape(a)) for a in client_params[0]]
    if current is not None and [tuple(np.shape(a)) for a in current] != shapes:
        raise ValueError(
            f"client 0 arrays {shapes} do not match the current parameters "
            f"{[tuple(np.shape(a)) for a in current]}"
        )
    for i, params in enumerate(client_params):
        if len(params) != len(shapes):
            raise ValueError(f"client {i} sent {len(params)} arrays, expected {len(shapes)}")
        for j, a in enumerate(params):
            a = np.asarray(a)
            if a.shape != shapes[j]:
                raise ValueError(f"client {i} array {j} has shape {a.shape}, expected {shapes[j]}")
            if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
                raise ValueError(f"client {i} array {j} contains NaN or Inf")
    return shapes


def _affine_combine(
    arrays: Sequence[np.ndarray],
    row_weights: np.ndarray,
    row_anchor: np.ndarray,
    current: np.ndarray | None,
) -> np.ndarray:
    """out[r] = anchor[r] * current[r] + sum_s weights[s, r] * arrays[s][r], computed in float64.

    ``row_weights`` is (S, R) and ``row_anchor`` (R,) with R the number of rows of the arrays, or
    R = 1 for arrays combined as a whole. The result has the clients' dtype (integers rounded).
    """
    first = np.asarray(arrays[0])
    shape, dtype = first.shape, first.dtype
    r = row_weights.shape[1]
    stack = np.stack([np.asarray(a, dtype=np.float64).reshape(r, -1) for a in arrays])
    out = np.einsum("sr,srj->rj", row_weights, stack)
    if np.any(row_anchor != 0):
        if current is None:
            raise ValueError(
                "the current global parameters are needed (a kept head or body, or a delta update)"
            )
        out += row_anchor[:, None] * np.asarray(current, dtype=np.float64).reshape(r, -1)
    out = out.reshape(shape)
    if np.issubdtype(dtype, np.integer):
        out = np.rint(out)
    return out.astype(dtype, copy=False)


def aggregate_parameters(
    client_params: Sequence[Sequence[np.ndarray]],
    head_map: HeadMap,
    head_weights: HeadAggregationWeights,
    body_weights: np.ndarray | None = None,
    current: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Aggregate the representation and every head separately (server side, spec Sec. 3.5 (d)).

    Head c (every piece the map gives it) becomes anchor[c] * current + sum_i client[i, c] *
    client i's piece; arrays and rows no head owns (the body) become the ``body_weights``
    average, or keep their current value when ``body_weights`` is None (phase 2: frozen body).
    Vectorized per array (einsum over clients), accumulated in float64 and returned in the
    clients' dtype.

    Args:
        client_params: S lists of P arrays (same shapes); NaN/Inf are refused, naming the client.
        head_map: which pieces belong to which task; must fit the arrays and have
            M = ``head_weights.client.shape[1]`` tasks.
        head_weights: from :func:`round_head_weights` (or
            :meth:`HeadAggregationWeights.from_beta`), with S rows.
        body_weights: (S,) weights >= 0 summing to 1 (:func:`body_weights`), or None to keep the
            current body.
        current: the current global P arrays; required when the body is kept or any head has a
            non-zero anchor.

    Returns:
        the new global list of P arrays.
    """
    shapes = _check_client_arrays(client_params, current)
    s = len(client_params)
    gamma, anchor = head_weights.client, head_weights.anchor
    if gamma.shape[0] != s:
        raise ValueError(
            f"head weights are for {gamma.shape[0]} clients, got {s} client parameter lists"
        )
    if gamma.shape[1] != head_map.num_tasks:
        raise ValueError(
            f"head map has {head_map.num_tasks} tasks but the head weights have {gamma.shape[1]}"
        )
    if body_weights is not None:
        bw = _check_weight_vector(body_weights, s, "body_weights")
    owners = head_map.row_owners(shapes)
    out = []
    for j, own in enumerate(owners):
        is_head = own >= 0
        w = np.zeros((s, own.shape[0]))
        a = np.zeros(own.shape[0])
        w[:, is_head] = gamma[:, own[is_head]]
        a[is_head] = anchor[own[is_head]]
        if body_weights is None:
            a[~is_head] = 1.0
        else:
            w[:, ~is_head] = bw[:, None]
        out.append(_affine_combine([cp[j] for cp in client_params], w, a,
                                   None if current is None else current[j]))
    return out


def select_head_arrays(arrays: Sequence[np.ndarray], head_map: HeadMap) -> list[np.ndarray]:
    """The arrays a client uploads in phase 2 with ``upload='head_only'`` (head arrays, in order)."""
    head_map.validate([np.shape(a) for a in arrays])
    return [arrays[j] for j in head_map.head_array_indices()]


def merge_head_arrays(
    current: Sequence[np.ndarray], head_arrays: Sequence[np.ndarray], head_map: HeadMap
) -> list[np.ndarray]:
    """Rebuild a full parameter list from the current global one and a head-only upload."""
    head_map.validate([np.shape(a) for a in current])
    idx = head_map.head_array_indices()
    if len(head_arrays) != len(idx):
        raise ValueError(
            f"head-only upload has {len(head_arrays)} arrays, expected {len(idx)} "
            f"(arrays {list(idx)})"
        )
    out = list(current)
    for j, a in zip(idx, head_arrays):
        if np.shape(a) != np.shape(current[j]):
            raise ValueError(f"head array {j} has shape {np.shape(a)}, expected {np.shape(current[j])}")
        out[j] = a
    return out


# --------------------------------------------------------------------------------------------
# Linear FMTL (theory level, known representation)
# --------------------------------------------------------------------------------------------


def linear_closed_form(
    statistics: Sequence[TaskStatistics],
    beta: np.ndarray,
    *,
    augmentation: Augmentation = Augmentation.AUGMENTED,
    ridge: float = 0.0,
    rcond: float = 1e-12,
) -> np.ndarray:
    """Minimizer of the weighted ERM (5)/(7) (augmented) or (3) (original), from statistics.

    Augmented (spec Sec. 3.1): w_c = [sum_i beta_i^c S_i]^{-1} sum_{i in I^c} beta_i^c r_i^c with
    S_i = Z_i Z_i^T / n_i and r_i^c = Z_i^c Y_i^c / n_i. Every client with beta_i^c > 0 enters
    the Gram matrix; only holders enter the right-hand side.

    Original, eq. (3): w_c = [sum_{i in I^c} beta_i^c Lambda_hat_i^c]^{-1}
    sum_{i in I^c} beta_i^c (Z_i^c Y_i^c / n_i^c); non-holders do not enter.

    Args:
        statistics: N :class:`TaskStatistics` with cross moments (real-valued targets).
        beta: (N, M) weights (columns need not be normalized; the minimizer is scale-free).
        augmentation: ``AUGMENTED`` (default) or ``ORIGINAL``.
        ridge: lambda >= 0 added as lambda * I to every Gram matrix (not in the paper; default 0).
        rcond: a Gram matrix whose smallest eigenvalue is <= rcond * its largest is singular.

    Returns:
        (M, k) heads, row c = w_c.

    Raises:
        ValueError: a singular Gram matrix (e.g. a task without holders under ``ORIGINAL``, or
            fewer samples than k), naming the tasks.
    """
    augmentation = Augmentation(augmentation)
    if not statistics:
        raise ValueError("linear_closed_form needs the statistics of at least one client")
    beta = np.asarray(beta, dtype=np.float64)
    n = len(statistics)
    if beta.ndim != 2 or beta.shape[0] != n:
        raise ValueError(f"beta must have shape ({n}, M), got {beta.shape}")
    if not np.all(np.isfinite(beta)) or np.any(beta < 0):
        raise ValueError("beta must be finite and >= 0")
    if not (np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge}")
    m = beta.shape[1]
    k = statistics[0].dim
    gram = np.zeros((m, k, k))
    rhs = np.zeros((m, k))
    for i, st in enumerate(statistics):
        if st.dim != k:
            raise ValueError(f"client {i} statistics have dimension {st.dim}, expected {k}")
        if st.cross_moments is None:
            raise ValueError(f"client {i} statistics have no cross moments (targets are needed)")
        if st.tasks.max() >= m:
            raise ValueError(f"client {i} statistics name task {int(st.tasks.max())} >= M={m}")
        b = beta[i, st.tasks]
        if augmentation is Augmentation.AUGMENTED:
            share = st.counts / st.num_examples  # n_i^c / n_i
            gram += beta[i][:, None, None] * st.total_second_moment()[None]
            rhs[st.tasks] += (b * share)[:, None] * st.cross_moments
        else:
            gram[st.tasks] += b[:, None, None] * st.second_moments
            rhs[st.tasks] += b[:, None] * st.cross_moments
    gram = 0.5 * (gram + gram.transpose(0, 2, 1)) + ridge * np.eye(k)[None]
    eig = np.linalg.eigvalsh(gram)
    singular = np.flatnonzero(eig[:, 0] <= rcond * np.maximum(eig[:, -1], 0.0))
    if singular.size:
        raise ValueError(
            f"the weighted Gram matrix of task(s) {singular.tolist()} is singular (no holder with "
            "weight > 0 under 'original', or fewer samples than dimensions); give those tasks "
            "holders/weights or set ridge > 0"
        )
    return np.linalg.solve(gram, rhs[..., None])[..., 0]


def linear_heads_gd(
    heads: torch.Tensor,
    features: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    lr: float,
    steps: int = 1,
) -> torch.Tensor:
    """Local full-batch gradient steps of one client on all M linear heads (client side).

    Objective: f_i(W) = sum_c sum_j Omega[j, c] (z_j^T w_c - Y[j, c])^2 with (Y, Omega) from
    :func:`augmented_targets` (the squared-loss :func:`fmtl_head_loss`, whose gradient
    2 ((Z W^T - Y) * Omega)^T Z is used in closed form here). With one step per round and
    head-wise beta aggregation, FedAvg is exactly gradient descent on eq. (7) and converges to
    :func:`linear_closed_form` (spec Sec. 3.2 (A2)); more steps give the usual FedAvg drift.

    Args:
        heads: (M, k) current heads (row c = w_c); not modified.
        features: (n_i, k) features z.
        targets: (n_i, M) per-head targets Y.
        weights: (n_i, M) per-head sample weights Omega.
        lr: step size > 0.
        steps: number of full-batch steps E >= 1.

    Returns:
        (M, k) updated heads.
    """
    if heads.ndim != 2 or features.ndim != 2 or features.shape[1] != heads.shape[1]:
        raise ValueError(
            f"heads must be (M, k) and features (n_i, k); got {tuple(heads.shape)} and "
            f"{tuple(features.shape)}"
        )
    expected = (features.shape[0], heads.shape[0])
    if tuple(targets.shape) != expected or tuple(weights.shape) != expected:
        raise ValueError(
            f"targets and weights must have shape {expected}, got {tuple(targets.shape)} and "
            f"{tuple(weights.shape)}"
        )
    if not (np.isfinite(lr) and lr > 0) or steps < 1:
        raise ValueError(f"lr must be > 0 and steps >= 1, got lr={lr}, steps={steps}")
    w = heads  # never modified in place: every step makes a new tensor
    for _ in range(steps):
        resid = (features @ w.T - targets) * weights
        w = w - (2.0 * lr) * (resid.T @ features)
    return w


def excess_risk(
    heads: np.ndarray,
    true_heads: np.ndarray,
    test_second_moments: np.ndarray,
    task_weights: np.ndarray | None = None,
) -> float:
    """Excess risk of eq. (6): sum_c alpha^c ||w_hat_c - w_c*||^2 in the Lambda_bar^c norm.

    Args:
        heads: (M, k) estimates.
        true_heads: (M, k) w_c*.
        test_second_moments: (M, k, k) Lambda_bar^c of the test distributions.
        task_weights: (M,) alpha^c >= 0 (default 1/M).

    Returns:
        float.
    """
    heads = np.asarray(heads, dtype=np.float64)
    true_heads = np.asarray(true_heads, dtype=np.float64)
    lam = np.asarray(test_second_moments, dtype=np.float64)
    if (
        heads.ndim != 2
        or heads.shape != true_heads.shape
        or lam.shape != (*heads.shape, heads.shape[1])
    ):
        raise ValueError(
            f"heads and true_heads must be (M, k) and test_second_moments (M, k, k); got "
            f"{heads.shape}, {true_heads.shape}, {lam.shape}"
        )
    m = heads.shape[0]
    alpha = np.full(m, 1.0 / m) if task_weights is None else np.asarray(task_weights, dtype=np.float64)
    if alpha.shape != (m,) or np.any(alpha < 0):
        raise ValueError(f"task_weights must be ({m},) and >= 0")
    d = heads - true_heads
    return float(np.einsum("c,ck,ckl,cl->", alpha, d, lam, d))
