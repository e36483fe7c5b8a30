"""Augmented datasets and the client's local objective over all M heads (paper Sec. III).

The augmented dataset D~_i^c adds every local sample of another task as (x, 0) to task c, so
every head trains on all n_i local samples: eqs. (5) and (7) (``Augmentation.AUGMENTED``)
against the ERM on the original data of eq. (3) (``Augmentation.ORIGINAL``).
:func:`augment_dataset` builds the datasets literally; :func:`augmented_targets` gives the
equivalent per-sample targets and weights; :func:`fmtl_head_loss` and
:func:`fmtl_per_sample_loss` are the local objective a training loop minimizes;
:func:`head_leakage` estimates the Delta of Assumption 4 (when augmentation is safe).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flwr_pfl.core.fmtl.checks import _check_num_tasks, _check_task_ids_torch
from flwr_pfl.core.fmtl.options import Augmentation, HeadLoss


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
