"""pFedMe's client (T. Dinh, Tran and Nguyen, NeurIPS 2020, Alg. 1): per mini-batch, K steps on
the Moreau-envelope inner problem (Eq. 7) give the personalized model theta, then the local model
w moves towards it; w goes to the server, the last theta is kept as the client's personal model."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from flwr_pfl.clients.base import Config
from flwr_pfl.clients.personal import PersonalCopyClient
from flwr_pfl.training.params import buffer_flags
from flwr_pfl.core.pfedme import BUFFER_MASK, check_lam, outer_step
from flwr_pfl.core.proximal import proximal_value
from flwr_pfl.training import OptimizerConfig, TrainStats, train

class RepeatedBatches:
    """Each batch of ``loader`` ``k`` times in a row: the training loop then takes Alg. 1's K
    inner steps on one mini-batch D before moving to the next. ``dataset`` is the loader's
    (the loop counts samples with it)."""

    def __init__(self, loader: DataLoader, k: int) -> None:
        self.loader, self.k = loader, k

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            for _ in range(self.k):
                yield batch

    def __len__(self) -> int:
        return len(self.loader) * self.k


class PFedMeClient(PersonalCopyClient):
    """pFedMe: each round, from the received global model w^t (w_{i,0} = w^t, theta = w^t),
    ``local_epochs`` passes over the local training set; for every mini-batch D:

    1. K = ``k`` plain gradient steps at ``personal_lr`` on Eq. 7,
       f~(theta; D) + (lam / 2) ||theta - w||^2 (the shared proximal term,
       :func:`~flwr_pfl.core.proximal.proximal_value`), warm-started from the previous batch's
       theta (the authors' code, PFLlib and FL-bench);
    2. the local update w <- w - eta lam (w - theta) (:func:`~flwr_pfl.core.pfedme.outer_step`),
       eta being the client's ``learning-rate`` (a per-round ``learning-rate`` from the strategy
       replaces it).

    The inner steps run in the shared training loop (each batch repeated K times, the local
    update after every K-th step); only the learning rate of the client's optimizer settings is
    used (eta): the inner solver is plain SGD without momentum or weight decay, as the authors'
    ``pFedMeOptimizer``. Parameters follow these rules; buffers (BatchNorm statistics) move with
    the forward passes of the inner steps, as in the reference codes.

    Wire: the whole model, both ways: the reply is w's parameters with the buffers as training
    left them, and the fit metric ``buffer_mask`` says which arrays are buffers (the server's beta
    step leaves them out). The last theta (buffers included) is the personal model
    (:class:`PersonalCopyClient`'s copy in ``context.state``).

    Evaluation: the personal model theta (the received global model while the client has none
    yet) on the local test split, as the authors evaluate pFedMe, with the received global
    model's figures beside it as ``global_loss`` / ``global_accuracy``. Fit metrics:
    ``train_loss`` (f~ averaged over all inner steps, without the proximal part),
    ``train_seconds``. Any ``torch.nn.Module`` works as it is (``head`` is accepted, not needed):
    ``PFedMeClient(context, Net(), data, lam=15.0, k=5, personal_lr=0.01)``.

    Local steps R = ``local_epochs`` x the batches per epoch (PFLlib, FL-bench); the authors'
    code counts R single batches instead (its ``local_epochs`` = R = 20).

    Args:
        lam: Eq. 2's lambda > 0.
        k: inner steps K >= 1 per mini-batch.
        personal_lr: the inner steps' learning rate > 0.
        *args, **kwargs: :class:`~flwr_pfl.clients.PFLClient`'s arguments.

    Raises:
        ValueError: an argument out of its range.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'its inner problem is solved by its own loop over repeated batches, outside DP-SGD'
    )

    def __init__(self, *args, lam: float = 15.0, k: int = 5, personal_lr: float = 0.01, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lam = check_lam(lam)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"pFedMe's k (inner steps K) must be an integer >= 1, got {k!r}")
        if isinstance(personal_lr, bool) or not isinstance(personal_lr, (int, float)) or not (
            personal_lr > 0 and math.isfinite(personal_lr)
        ):
            raise ValueError(f"pFedMe's personal_lr must be a finite number > 0, got {personal_lr!r}")
        self.k = k
        self.personal_optimizer = OptimizerConfig("sgd", float(personal_lr))

    def local_update(self, config: Config) -> dict[str, Any]:
        with self.personal_model() as received:
            self.model.load_state_dict(received)  # theta starts from w^t, as w does
            self.model.to(self.device)
            local, stats = self.solve(self.train_config.optimizer.learning_rate)
            reply = {key: value.detach().clone() for key, value in self.model.state_dict().items()} | local
        self.model.load_state_dict(reply)  # the personal copy (theta) is stored; w goes back
        mask = "".join("1" if flag else "0" for flag in buffer_flags(self.model))
        return {"train_loss": stats.loss, "train_seconds": stats.seconds, BUFFER_MASK: mask}

    def solve(self, eta: float) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Alg. 1's local rounds on ``self.model`` (which holds theta = w^t on entry, theta~ on
        exit); returns the local model w_{i,R} by parameter name, and the loop's statistics."""
        local = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        lam, k = self.lam, self.k

        def regularizer(model: nn.Module) -> torch.Tensor:
            theta = {name: p for name, p in model.named_parameters() if p.requires_grad}
            return proximal_value(theta, local, lam)

        def after_step(model: nn.Module, step: int) -> None:
            if step % k == 0:  # the K inner steps on this batch are done: move w towards theta
                local.update(outer_step(local, dict(model.named_parameters()), lam, eta))

        stats = train(
            self.model,
            RepeatedBatches(self.data.train, k),  # type: ignore[arg-type]
            optimizer=self.personal_optimizer,
            device=self.device,
            epochs=self.train_config.local_epochs,
            task=self.data.task,
            regularizer=regularizer,
            after_step=after_step,
            who=self.who,
            keys=self.data.batch_keys,
            frozen_norm=self.train_config.frozen_norm,
        )
        return local, stats

    def personal_state(self) -> dict[str, torch.Tensor]:
        """theta by ``state_dict`` name (CPU copies): what :meth:`local_evaluate` evaluates, so that
        an export reproduces each client's last evaluation. A client that has never trained has
        no theta yet and evaluates the received global model; that model (as the last message
        left it) is then its personalized model."""
        return super().personal_state() or self.group_state("all")
