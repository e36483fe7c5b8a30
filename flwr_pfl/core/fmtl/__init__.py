"""FMTL with feature heterogeneity: augmented datasets and heterogeneity-aware client weights.

Mathematics of Liu, Yang and Shen, "Exploiting Feature Heterogeneity for Improved Generalization
in Federated Multi-task Learning" (ISIT 2023), as plain functions on NumPy arrays (server side)
and torch tensors (client side). Nothing here imports Flower. This package re-exports the public
API of its modules, so ``from flwr_pfl.core import fmtl`` gives every name below.

Setting (paper Sec. II-III). N clients, M tasks (a task is a class label in the deep experiments),
a shared representation z = phi(x) in R^k and one linear head w_c per task. Client i holds the
tasks C_i; I^c = {i : c in C_i} are the holders of task c; beta_i^c is client i's weight for head c.

Modules, in dependency order
----------------------------
=====================  ========================================================================
``checks``             input validation shared by the modules below
``options``            the typed options: augmentation, head loss, weighting schemes, policies
``tasks``              task membership: per-task counts n_i^c and the holder mask (C_i, I^c)
``augmentation``       augmented datasets and the local objective (Sec. III, eqs. 3, 5, 7)
``eq12``               closed-form client weights, eq. (12)
``statistics``         per-task feature moments a client sends (for eq. 10 and the linear form)
``eq10``               numerical solver of the weight problem, eq. (10)
``weights``            every head/body weighting scheme over a reference set (Sec. VI, EW)
``participation``      the weights of a partially participating round (not in the paper)
``head_map``           which parameters form each task's head
``aggregation``        per-task head aggregation of the client parameters (Sec. V-VI)
``linear``             linear FMTL with a known representation: eqs. (3)/(5)/(7) and (6)
=====================  ========================================================================

Map from the paper to this package
----------------------------------
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

from flwr_pfl.core.fmtl.options import (
    Augmentation,
    BodyWeighting,
    EmptyHolderPolicy,
    Eq10Options,
    FMTLWeightingOptions,
    HeadLoss,
    HeadWeighting,
    ParticipationPolicy,
)
from flwr_pfl.core.fmtl.tasks import task_counts, task_membership
from flwr_pfl.core.fmtl.augmentation import (
    augment_dataset,
    augmented_targets,
    fmtl_head_loss,
    fmtl_per_sample_loss,
    head_leakage,
)
from flwr_pfl.core.fmtl.eq12 import eq12_weight_matrix, fmtl_weights_eq12
from flwr_pfl.core.fmtl.statistics import TaskStatistics, task_statistics
from flwr_pfl.core.fmtl.eq10 import Eq10Solution, eq10_objective, solve_eq10
from flwr_pfl.core.fmtl.weights import body_weights, head_weight_matrix
from flwr_pfl.core.fmtl.participation import HeadAggregationWeights, round_head_weights
from flwr_pfl.core.fmtl.head_map import HeadMap, HeadSlice
from flwr_pfl.core.fmtl.aggregation import (
    aggregate_parameters,
    merge_head_arrays,
    select_head_arrays,
)
from flwr_pfl.core.fmtl.linear import excess_risk, linear_closed_form, linear_heads_gd

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
