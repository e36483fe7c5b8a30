"""The FedAvg+FMTL client (Liu, Yang and Shen, ISIT 2023): trains every task head on every local
sample (the augmented datasets of Sec. III) and reports which tasks it holds.

Wire: see :mod:`flwr_pfl.strategies.fmtl`. The only state kept across rounds is derived from the
private data and lives in ``context.state``: the task counts n_i^c (computed once) and, for the
eq. (10) weights, the per-task feature statistics under the frozen phase-2 body (computed once).
"""

from __future__ import annotations

import numpy as np
import torch

from flwr_pfl.clients.base import Config, NDArrays, PFLClient, seeded_message
from flwr_pfl.core.fmtl import Augmentation, HeadLoss, fmtl_per_sample_loss, task_counts, task_statistics
from flwr_pfl.core.proximal import proximal_regularizer
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import EvalResult, collect_features, evaluate, get_arrays, load_arrays, read_batch, save_arrays

COUNTS_KEY = "fmtl-counts"
STATS_KEY = "fmtl-stats"


def head_outputs(model: EncoderHeadModel, features: torch.Tensor) -> torch.Tensor:
    """All M task heads on every sample, shape (B, M): column c is head c.

    One head with M outputs (a stacked ``Linear(k, M)``, classification-as-tasks) or M heads with
    one output each.
    """
    if model.num_heads == 1:
        return model.heads[0](features)
    return torch.cat([head(features) for head in model.heads], dim=1)


def num_tasks_of(model: EncoderHeadModel) -> int:
    """M: the outputs of a single stacked head, or the number of one-output heads."""
    if model.num_heads == 1:
        return model.num_outputs
    if model.num_outputs != 1:
        raise ValueError(
            f"FMTL needs one head with M outputs or M heads with one output each; the model has "
            f"{model.num_heads} heads with {model.num_outputs} outputs"
        )
    return model.num_heads


class FedFMTLClient(PFLClient):
    """FedAvg+FMTL client.

    Phase 1 (config ``fmtl-phase`` = 1): local epochs on the whole model, as FedAvg (FedProx with
    ``prox_mu`` > 0). Phase 2: the body is frozen and only the heads train (``phase2_epochs``,
    default the local epochs, spec P11); the proximal term is kept only with ``phase2_prox``
    (spec Sec. 4 item 2: off by default). The frozen body's BatchNorm statistics stay as they are
    in phase 2 unless ``TrainConfig.frozen_norm`` is ``"train"``, so the feature statistics computed
    once under it (``fmtl-stats``) remain those of the body every client holds.

    The local objective is :func:`~flwr_pfl.core.fmtl.fmtl_per_sample_loss` over all M heads
    (eqs. 5/7): ``ce`` (default; softmax over all classes, implicitly augmented), ``mse`` (real
    targets; the paper's linear regression), ``mse_onehot`` or ``bce_ovr``; with ``augmentation``
    ``original`` (eq. 3) for the latter three. Task of a sample: its class label for
    classification, its domain label for regression (each task a domain).

    A user's own model needs its head named as one module, applied last to the features:
    ``FedFMTLClient(context, Net(), data, head="fc3")`` (one head with M outputs, the
    ``stacked`` layout); for M one-output heads (``per-head``), hand it
    ``split_model(net, head="fc3", num_heads=M)`` with ``fc3`` a one-output ``nn.Linear``.

    Args:
        head_loss, augmentation: the local objective (above).
        prox_mu: FedProx coefficient mu (0 = FedAvg; the FedRep code's default for FedProx is 0.1).
        phase2_prox: keep the proximal term in phase 2.
        phase2_epochs: local epochs of phase 2 (0 = the local epochs).
        *args, **kwargs: :class:`PFLClient`'s arguments (``head`` among them).
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'it uploads per-task feature moments and counts computed from the data outside DP-SGD'
    )

    shared_group = "all"
    head_requirement = "module"

    def __init__(
        self,
        *args,
        head_loss: HeadLoss | str = HeadLoss.CE,
        augmentation: Augmentation | str = Augmentation.AUGMENTED,
        prox_mu: float = 0.0,
        phase2_prox: bool = False,
        phase2_epochs: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.head_loss = HeadLoss(head_loss)
        self.augmentation = Augmentation(augmentation)
        if self.head_loss is HeadLoss.CE and self.augmentation is Augmentation.ORIGINAL:
            raise ValueError("head_loss 'ce' is always augmented; use 'mse_onehot' or 'bce_ovr' with 'original'")
        regression = self.data.task != "classification"
        if regression != (self.head_loss is HeadLoss.MSE):
            raise ValueError(
                f"head_loss {self.head_loss.value!r} does not fit a {self.data.task} task: use 'mse' "
                "for real-valued targets, 'ce', 'mse_onehot' or 'bce_ovr' for classes"
            )
        if prox_mu < 0 or phase2_epochs < 0:
            raise ValueError(f"prox_mu and phase2_epochs must be >= 0, got {prox_mu}, {phase2_epochs}")
        self.prox_mu = prox_mu
        self.phase2_prox = phase2_prox
        self.phase2_epochs = phase2_epochs
        self.num_tasks = num_tasks_of(self.model)

    # ---------------------------------------------------------------- tasks of a batch
    def _tasks_and_targets(self, y: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.head_loss is HeadLoss.MSE:
            return d, y.reshape(-1).to(torch.get_default_dtype() if not torch.is_floating_point(y) else y.dtype)
        return y, None

    def loss_fn(self, model: EncoderHeadModel, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Per-sample augmented loss over all heads (its batch mean is eq. (5)'s local term)."""
        outputs = head_outputs(model, model.features(x))
        tasks, targets = self._tasks_and_targets(y, d)
        if targets is not None:
            targets = targets.to(outputs.dtype)
        return fmtl_per_sample_loss(outputs, tasks, targets, head_loss=self.head_loss, augmentation=self.augmentation)

    def counts(self) -> np.ndarray:
        """n_i^c of the training data, (M,) int64; computed once, kept in ``context.state``."""
        cached = load_arrays(self.context.state, COUNTS_KEY)
        if cached is not None and cached[0].shape == (self.num_tasks,):
            return cached[0]
        tasks = []
        for batch in self.data.train:
            _, y, d = read_batch(batch, torch.device("cpu"), self.data.batch_keys)
            tasks.append(self._tasks_and_targets(y, d)[0])
        counts = task_counts(torch.cat(tasks), self.num_tasks) if tasks else np.zeros(self.num_tasks, np.int64)
        save_arrays(self.context.state, COUNTS_KEY, [counts])
        return counts

    def statistics_arrays(self) -> NDArrays:
        """``TaskStatistics.to_arrays()`` of the features under the current (frozen) body, for the
        eq. (10) weights; computed once in phase 2 and kept in ``context.state``."""
        cached = load_arrays(self.context.state, STATS_KEY)
        if cached is not None:
            return cached
        features, y, d = collect_features(self.model, self.data.train, device=self.device, keys=self.data.batch_keys)
        tasks, targets = self._tasks_and_targets(y, d)
        stats = task_statistics(features, tasks, self.num_tasks, targets).to_arrays()
        save_arrays(self.context.state, STATS_KEY, stats)
        return stats

    # ---------------------------------------------------------------- hooks
    def _proximal(self, groups: tuple[str, ...]):
        """(mu/2) ||theta - theta_global||^2 over the trained parameters (FedProx, Eq. 2 of Li et
        al.; :func:`~flwr_pfl.core.proximal.proximal_regularizer`), or None when mu is 0."""
        return proximal_regularizer(self.model, self.prox_mu)

    def local_update(self, config: Config) -> dict[str, float]:
        phase = int(config.get("fmtl-phase", 1))
        if phase == 1:
            groups, epochs, prox = ("all",), self.train_config.local_epochs, True
        else:
            groups, epochs, prox = ("heads",), self.phase2_epochs or self.train_config.local_epochs, self.phase2_prox
        stats = self.train_groups(groups, epochs, loss_fn=self.loss_fn,
                                  regularizer=self._proximal(groups) if prox else None)
        return {"train_loss": stats.loss, "train_seconds": stats.seconds}

    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        arrays, num_examples, metrics = super().fit(parameters, config)
        if int(config.get("fmtl-phase", 1)) == 2 and config.get("fmtl-upload", "full") == "head_only":
            arrays = get_arrays(self.model, "heads")
        counts = self.counts()
        stats = self.statistics_arrays() if config.get("fmtl-stats", False) else []
        metrics["n_stats_arrays"] = len(stats)
        metrics["num_tasks_held"] = int(np.count_nonzero(counts))
        return [*arrays, counts, *stats], num_examples, metrics

    def local_evaluate(self, config: Config) -> EvalResult:
        """The global model on the local test split; for regression, each sample's own task head."""
        if self.head_loss is not HeadLoss.MSE:
            return self.evaluate_on(self.data.test)

        def own_head_loss(model: EncoderHeadModel, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            outputs = head_outputs(model, model.features(x))
            own = outputs.gather(1, d.long().reshape(-1, 1)).reshape(-1)
            return (own - y.reshape(-1).to(own.dtype)).pow(2)

        return evaluate(self.model, self.data.test, device=self.device, task=self.data.task,
                        num_domains=self.data.num_domains, loss_fn=own_head_loss, keys=self.data.batch_keys)
