"""Client side, every round: the validation error and the selection weight ``lambda_k`` (Eq. 8;
Algorithm 1 line 10).

``lambda_k`` grows with ``Delta = L~(theta_k) - L~(theta_hat_k)``, the validation advantage of the
received auxiliary model over the client's personalized one; :func:`max_stable_lambda` bounds it
for stable proximal steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flwr_pfl.core.fedora.options import (
    ArrayLike,
    LambdaOptions,
    TaskLoss,
    TensorOrArray,
    ValidationMetric,
    ValidationOptions,
    _check_choice,
    _check_finite_positive,
)


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
