"""The one train loop and the one evaluation loop every client uses.

Clients differ in *what* they train (parameter groups), *which loss* (a per-sample loss
function), *how samples are weighted* (per-domain weights, e.g. FedDAR's u_m) and *what is
added* (a regularizer, e.g. FEDORA's proximal term); the loop itself is written once here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from flwr_pfl.core.metrics import ONE_CLASS
from flwr_pfl.data.types import ArraySplit, Task
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training.batches import BatchKeys, num_samples, read_batch
from flwr_pfl.training.dpsgd import PrivateSteps
from flwr_pfl.training.norms import FrozenNorm, check_frozen_norm, frozen_norms
from flwr_pfl.training.optim import OptimizerConfig, make_optimizer
from flwr_pfl.training.params import only_trainable

#: (model, x, y, domain) -> per-sample losses of shape (B,)
LossFn = Callable[[EncoderHeadModel, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: model -> scalar added to the mean loss of every step
Regularizer = Callable[[nn.Module], torch.Tensor]


def per_sample_loss(outputs: torch.Tensor, targets: torch.Tensor, task: Task) -> torch.Tensor:
    """Cross-entropy (classification) or squared error averaged over outputs (regression)."""
    if task == "classification":
        return F.cross_entropy(outputs, targets, reduction="none")
    targets = targets.reshape(outputs.shape).to(outputs.dtype)
    return (outputs - targets).pow(2).flatten(1).mean(1)


def supervised_loss(task: Task) -> LossFn:
    """The default per-sample loss: the model's output for each sample's own head."""

    def loss(model: EncoderHeadModel, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(model(x, d), y, task)

    return loss


def _nonfinite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN/Inf entries, samples holding one) of ``tensor``; (0, 0) for integer tensors."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0, 0
    bad = ~torch.isfinite(tensor)
    return int(bad.sum()), int(bad.reshape(len(tensor), -1).any(1).sum())


def nonfinite_loss_error(
    value: float,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    where: str,
    who: str = "",
    learning_rate: float | None = None,
) -> FloatingPointError:
    """The error for a loss that became ``value`` (NaN or Inf) on the batch ``(x, y)``.

    Bad data and divergence need different fixes, so the batch is inspected here, once the loss
    is already non-finite (the training step itself never scans its data): if the inputs or the
    targets hold NaN or Inf, the message names the client (``who``), the tensor, the batch
    (``where``) and how many values are affected; only on finite data does it advise lowering
    the learning rate.
    """
    owner = f"{who}: " if who else ""
    found = [
        f"the {name} hold {values} NaN/Inf value(s) in {rows} of {len(t)} samples"
        for name, t in (("inputs", x), ("targets", y))
        for values, rows in [_nonfinite(t)]
        if values
    ]
    if found:
        return FloatingPointError(
            f"{owner}the training data has non-finite values at {where}: {'; '.join(found)}. "
            f"The loss became {value}; remove or impute these samples (or fix the data "
            f"pipeline): lowering the learning rate will not help"
        )
    rate = f" (now {learning_rate})" if learning_rate is not None else ""
    return FloatingPointError(
        f"{owner}training loss became {value} at {where} on finite data: training diverged; "
        f"lower the learning rate{rate}"
    )


@dataclass(frozen=True)
class TrainStats:
    """What one call of :func:`train` did."""

    loss: float  # mean training loss over all steps (before the regularizer)
    num_examples: int  # samples seen per epoch
    steps: int
    seconds: float


def train(
    model: EncoderHeadModel,
    loader: DataLoader,
    *,
    optimizer: OptimizerConfig,
    device: torch.device,
    epochs: int = 1,
    groups: Sequence[str] = ("all",),
    task: Task = "classification",
    loss_fn: LossFn | None = None,
    domain_weights: torch.Tensor | None = None,
    regularizer: Regularizer | None = None,
    max_steps: int = 0,
    after_step: Callable[[EncoderHeadModel, int], None] | None = None,
    who: str = "",
    keys: BatchKeys | None = None,
    frozen_norm: FrozenNorm = "eval",
    private: PrivateSteps | None = None,
    clip_grad_norm: float = 0.0,
) -> TrainStats:
    """Train the parameter ``groups`` of ``model`` for ``epochs`` passes over ``loader``.

    The model is in train mode (dropout active everywhere, the frozen part included), except
    under ``frozen_norm="eval"`` the BatchNorm-like modules that lie wholly outside ``groups``
    (see :mod:`flwr_pfl.training.norms`).

    Args:
        loader: yields (x, y, domain) or (x, y) batches, or dicts read with ``keys``
            (see :func:`~flwr_pfl.training.batches.read_batch`).
        groups: parameter groups to train; all others stay frozen (FedRep trains ``heads``
            then ``body``; FedDAR's head phase trains ``heads`` only).
        loss_fn: per-sample loss; defaults to :func:`supervised_loss` for ``task``.
        domain_weights: tensor of shape (M,): sample i's loss is multiplied by
            ``domain_weights[domain[i]]`` (FedDAR's re-weighting u_m, Eq. 6). The step loss is
            the mean of the weighted per-sample losses.
        regularizer: added to every step's loss (e.g. a proximal term).
        max_steps: stop after this many optimizer steps (0 = no limit).
        after_step: called as ``after_step(model, step)`` after every optimizer step (e.g. to
            record per-step parameter updates, as FedGP's auto-weighting needs).
        who: whose data this is (e.g. ``"partition 3"``), named in errors.
        keys: the entries of dict batches (default: flwr-datasets' column names).
        frozen_norm: what the frozen part's normalisation modules with running statistics do:
            ``"eval"`` (eval mode for the call: they normalise with, and keep, their running
            statistics, so a frozen body stays frozen) or ``"train"`` (train mode: their
            statistics move, as in FedRep's, PFLlib's and FL-bench's code). No effect when
            ``groups`` is ``("all",)``.
        private: train with DP-SGD (:mod:`flwr_pfl.training.dpsgd`): Poisson batches from the
            loader's dataset, ``ceil(n / B)`` steps per epoch, each record's gradient (its loss,
            weighted by ``domain_weights``) clipped and the sum noised; the regularizer's
            gradient is added after the noise (no record enters it).
        clip_grad_norm: when > 0, the step's total gradient norm (the regularizer's gradient
            included) is clipped to this before every optimizer step (``clip_grad_norm_``, as
            pFedHN's authors clip their inner steps); 0: no clipping. Under DP-SGD it acts on the
            noised gradient (post-processing).

    Raises:
        FloatingPointError: the loss became NaN or Inf; the client's reply then counts as a
            failure instead of poisoning the aggregate. The message tells the two causes apart
            (see :func:`nonfinite_loss_error`): non-finite values in the batch's data, or a
            blow-up on finite data (the learning rate is usually too high).
    """
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    if not clip_grad_norm >= 0:
        raise ValueError(f"clip_grad_norm must be >= 0 (0: no clipping), got {clip_grad_norm}")
    check_frozen_norm(frozen_norm)
    loss_fn = loss_fn or supervised_loss(task)
    model.to(device).train()
    weights = domain_weights.to(device) if domain_weights is not None else None
    start, steps, loss_sum = time.perf_counter(), 0, 0.0
    record_loss = loss_fn if weights is None else (lambda m, x, y, d: loss_fn(m, x, y, d) * weights[d])
    loss_steps = 0
    with only_trainable(model, groups) as params:
        with frozen_norms(model, groups, frozen_norm):
            opt = make_optimizer(params, optimizer)
            for epoch, batch_index, batch in _batches(loader, epochs, private):
                where = f"step {steps + 1} (epoch {epoch + 1}, batch {batch_index + 1})"
                x, y, d = read_batch(batch, device, keys) if batch is not None else (None, None, None)
                opt.zero_grad(set_to_none=True)
                if private is None:
                    loss = record_loss(model, x, y, d).mean()
                    total = loss + regularizer(model) if regularizer is not None else loss
                    if not torch.isfinite(total):
                        raise nonfinite_loss_error(total.item(), x, y, where=where, who=who,
                                                   learning_rate=optimizer.learning_rate)
                    total.backward()
                else:
                    grads, losses = private.gradients(model, params, record_loss, (x, y, d) if x is not None else None)
                    loss = losses.mean() if losses is not None else None
                    if loss is not None and not torch.isfinite(loss):
                        raise nonfinite_loss_error(loss.item(), x, y, where=where, who=who,
                                                   learning_rate=optimizer.learning_rate)
                    for p, g in zip(params, grads):
                        p.grad = g
                    if regularizer is not None:
                        regularizer(model).backward()  # adds the data-free term's gradient
                if clip_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
                opt.step()
                steps += 1
                if loss is not None:
                    loss_sum += float(loss.detach())
                    loss_steps += 1
                if after_step is not None:
                    after_step(model, steps)
                if max_steps and steps >= max_steps:
                    break
    return TrainStats(
        loss=loss_sum / max(loss_steps, 1),
        num_examples=num_samples(loader),
        steps=steps,
        seconds=time.perf_counter() - start,
    )


def _batches(loader: DataLoader, epochs: int, private: PrivateSteps | None) -> Iterator[tuple[int, int, Any]]:
    """``(epoch, batch index, batch)``: the loader's batches, ``epochs`` times; with DP-SGD its
    Poisson batches (None: an empty one)."""
    if private is None:
        for epoch in range(epochs):
            for index, batch in enumerate(loader):
                yield epoch, index, batch
        return
    per_epoch = private.steps_per_epoch()
    for step, batch in enumerate(private.batches(loader, epochs)):
        yield step // per_epoch, step % per_epoch, batch


@dataclass
class EvalResult:
    """Loss and accuracy on one split, overall and per domain.

    ``per_domain_count[m]``, ``per_domain_loss[m]`` (sum) and ``per_domain_correct[m]`` let the
    server pool per-domain figures across clients exactly.
    """

    loss: float
    num_examples: int
    accuracy: float | None
    per_domain_count: list[int] = field(default_factory=list)
    per_domain_loss: list[float] = field(default_factory=list)
    per_domain_correct: list[int] = field(default_factory=list)
    #: further scalars reported beside these (e.g. the global model's figures before fine-tuning)
    extra: dict[str, float] = field(default_factory=dict)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Flat scalar metrics for the Flower wire: ``loss``, ``accuracy`` and, with several
        domains, ``n_d<m>``, ``loss_d<m>`` (mean) and ``acc_d<m>`` for every domain present."""
        out: dict[str, float] = {f"{prefix}loss": self.loss}
        if self.accuracy is not None:
            out[f"{prefix}accuracy"] = self.accuracy
        if len(self.per_domain_count) > 1:
            for m, n in enumerate(self.per_domain_count):
                if n == 0:
                    continue
                out[f"{prefix}n_d{m}"] = float(n)
                out[f"{prefix}loss_d{m}"] = self.per_domain_loss[m] / n
                if self.accuracy is not None:
                    out[f"{prefix}acc_d{m}"] = self.per_domain_correct[m] / n
        return out | self.extra


@torch.no_grad()
def evaluate(
    model: EncoderHeadModel,
    data: ArraySplit | DataLoader,
    *,
    device: torch.device,
    task: Task = "classification",
    num_domains: int = 1,
    batch_size: int = 512,
    loss_fn: LossFn | None = None,
    predict_fn: Callable[[EncoderHeadModel, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    keys: BatchKeys | None = None,
) -> EvalResult:
    """Mean loss (and accuracy for classification) of ``model`` on ``data``.

    ``data`` is an :class:`ArraySplit` (read in batches of ``batch_size``) or any DataLoader of
    (x, y) or (x, y, domain) batches, or of dicts read with ``keys``.

    ``predict_fn(model, x, domain)`` returns the outputs used for accuracy (defaults to the
    model's own forward); ``loss_fn`` as in :func:`train`.
    """
    loss_fn = loss_fn or supervised_loss(task)
    predict_fn = predict_fn or (lambda m, x, d: m(x, d))
    model.to(device).eval()
    count = torch.zeros(num_domains, dtype=torch.long)
    loss_sum = torch.zeros(num_domains, dtype=torch.float64)
    correct = torch.zeros(num_domains, dtype=torch.long)
    loader = data.loader(batch_size, shuffle=False) if isinstance(data, ArraySplit) else data
    predicted: set[int] = set()  # up to two distinct classes of each: enough to see a collapse
    labels: set[int] = set()
    for batch in loader:
        x, y, d = read_batch(batch, device, keys)
        losses = loss_fn(model, x, y, d).double().cpu()
        d_cpu = d.cpu()
        count += torch.bincount(d_cpu, minlength=num_domains)
        loss_sum.index_add_(0, d_cpu, losses)
        if task == "classification":
            prediction = predict_fn(model, x, d).argmax(1)
            hits = (prediction == y).long().cpu()
            correct.index_add_(0, d_cpu, hits)
            if y.dim() == 1 and (len(predicted) < 2 or len(labels) < 2):
                predicted.update(prediction.unique().tolist())
                labels.update(y.unique().tolist())
    n = int(count.sum())
    # a model that answers one class for test samples of several has collapsed (see ONE_CLASS)
    collapsed = {ONE_CLASS: 1.0} if len(labels) > 1 and len(predicted) == 1 else {}
    return EvalResult(
        loss=float(loss_sum.sum()) / max(n, 1),
        num_examples=n,
        accuracy=(float(correct.sum()) / max(n, 1)) if task == "classification" else None,
        per_domain_count=count.tolist(),
        per_domain_loss=loss_sum.tolist(),
        per_domain_correct=correct.tolist(),
        extra=collapsed,
    )


@torch.no_grad()
def collect_features(
    model: EncoderHeadModel,
    data: ArraySplit | DataLoader,
    *,
    device: torch.device,
    batch_size: int = 512,
    keys: BatchKeys | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encoder features phi(x), targets and domain labels of every sample, on ``device``
    (dict batches read with ``keys``).

    Returns (features (N, feature_dim), y (N, ...), domain (N,)) in the data's order, with the
    model in eval mode: the statistics algorithms compute from features (pFedFDA's class means
    and covariance, FedDAR's head Hessians, FEDORA's subspaces) all start here.
    """
    model.to(device).eval()
    loader = data.loader(batch_size, shuffle=False) if isinstance(data, ArraySplit) else data
    feats, ys, ds = [], [], []
    for batch in loader:
        x, y, d = read_batch(batch, device, keys)
        feats.append(model.features(x))
        ys.append(y)
        ds.append(d)
    if not feats:
        raise ValueError("no samples to collect features from")
    return torch.cat(feats), torch.cat(ys), torch.cat(ds)
