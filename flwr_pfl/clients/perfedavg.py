"""Per-FedAvg's client (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020, Alg. 1): MAML meta steps on
the whole model, and one-step adaptation of the received model before evaluation."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from flwr_pfl.clients.base import Config, PFLClient
from flwr_pfl.core.perfedavg import MetaStep, Variant, batch_loss, batches_per_step, check_variant, meta_step
from flwr_pfl.errors import ConfigError
from flwr_pfl.training import EvalResult, OptimizerConfig, make_optimizer, only_trainable, read_batch
from flwr_pfl.training.loops import nonfinite_loss_error


def cycle(loader: DataLoader) -> Iterator:
    """The loader's batches pass after pass (a shuffling loader reshuffles at every pass).

    Raises:
        ValueError: a pass yields no batch (e.g. ``drop_last`` with fewer samples than a batch).
    """
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the training loader yields no batch (drop_last with fewer samples than a batch?)")


class PerFedAvgClient(PFLClient):
    """Per-FedAvg: each round, from the received global model w, ``local_epochs`` epochs of meta
    steps (Alg. 1; :func:`~flwr_pfl.core.perfedavg.meta_step`)

        temp = w - alpha grad f(w; D)
        FO:  w <- w - beta grad f(temp; D')
        HF:  w <- w - beta (I - alpha hess f(w; D'')) grad f(temp; D')   (Hessian-vector product exact)

    on the whole model, which then goes back to the server (FedAvg's example-weighted mean).

    Batches. D, D' (and D'') are consecutive batches of the client's shuffled training loader
    (the suite's ``batch-size``), drawn from one iterator that restarts, reshuffled, when a pass
    ends: an epoch is ceil(len(loader) / k) meta steps, k = 2 (FO) or 3 (HF), so it reads about
    one pass of data, as FL-bench's client does (len(loader) // k steps per epoch from a cycling
    iterator); rounding up keeps at least one step for a client with a single batch. PFLlib draws
    one batch of size k * B per step and splits it; the batches are independent either way, as the
    paper's analysis asks.

    Step sizes. ``alpha`` is the inner (adaptation) step, a plain gradient step, as the
    meta-objective F(w) = f(w - alpha grad f(w)) defines it. beta, the outer step, is the suite's
    ``learning-rate``: the outer update is a step of the suite's optimizer on the meta direction
    (its momentum, weight decay and scheduler apply), exactly Alg. 1's w - beta d with ``sgd``,
    momentum 0 and no weight decay; a per-round ``learning-rate`` the strategy sends is beta for
    that round. (PFLlib takes alpha = beta = its learning rate; FL-bench takes alpha = its
    learning rate and a separate beta.)

    BatchNorm. Every forward pass of a step runs in train mode, so running statistics move with
    the D pass at w, the D' pass at temp and, for HF, the D'' pass at w (as in PFLlib).

    Evaluation (personalization, Section 2 of the paper): a copy of the received model takes
    ``adapt_steps`` plain gradient steps of size alpha on batches of the shuffled local training
    loader (PFLlib's ``train_one_step``: one step on one training batch), is evaluated on the
    local test split and discarded; the received model's figures are reported beside it as
    ``global_loss`` / ``global_accuracy``. Nothing persists across rounds: ``context.state`` is
    never written. :meth:`personal_state` is the last evaluation's adapted copy.

    Fit metrics: ``train_loss`` (f(w; D), the loss before adaptation, averaged over the steps),
    ``adapted_loss`` (f(temp; D') averaged: the meta-objective's sample values), ``meta_steps``,
    ``train_seconds``. Any ``torch.nn.Module`` works (``head`` is accepted, not needed); HF needs
    second derivatives of its forward pass.

    Args:
        alpha: the inner step size > 0 (also the adaptation step at evaluation).
        variant: ``"fo"`` or ``"hf"`` (Section 5).
        adapt_steps: gradient steps of the adaptation before evaluation (>= 0; 0 evaluates the
            received model as it is).
        *args, **kwargs: :class:`~flwr_pfl.clients.PFLClient`'s arguments.

    Raises:
        ValueError: an option out of range.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'its meta-update takes its own second-order steps on the data, outside DP-SGD'
    )

    def __init__(self, *args, alpha: float = 0.01, variant: Variant = "fo", adapt_steps: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
            raise ValueError(f"Per-FedAvg's alpha must be a finite number > 0, got {alpha!r}")
        if isinstance(adapt_steps, bool) or not isinstance(adapt_steps, int) or adapt_steps < 0:
            raise ValueError(f"Per-FedAvg's adapt_steps must be an integer >= 0, got {adapt_steps!r}")
        self.alpha = float(alpha)
        self.variant = check_variant(variant)
        self.adapt_steps = adapt_steps
        self.adapted: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- training
    def meta_steps_per_epoch(self) -> int:
        """ceil(len(loader) / k): about one pass of data per epoch, at least one step."""
        return -(-len(self.data.train) // batches_per_step(self.variant))

    def local_update(self, config: Config) -> dict[str, float]:
        began = time.perf_counter()
        steps = self.train_config.local_epochs * self.meta_steps_per_epoch()
        losses, adapted = [], []
        self.model.to(self.device).train()
        with only_trainable(self.model, ("all",)) as params:
            names = [name for name, _ in self.model.named_parameters()]  # the order of params
            optimizer = make_optimizer(params, self.train_config.optimizer)
            batches = cycle(self.data.train)
            for step in range(steps):
                drawn = [read_batch(next(batches), self.device, self.data.batch_keys)
                         for _ in range(batches_per_step(self.variant))]
                result = self.meta_direction(drawn, params, names, step)
                for p, d in zip(params, result.direction):
                    p.grad = d
                optimizer.step()
                losses.append(float(result.loss))
                adapted.append(float(result.adapted_loss))
        return {"train_loss": sum(losses) / max(len(losses), 1), "adapted_loss": sum(adapted) / max(len(adapted), 1),
                "meta_steps": float(steps), "train_seconds": time.perf_counter() - began}

    def meta_direction(self, drawn: list[tuple[torch.Tensor, ...]], params: list[torch.Tensor], names: list[str], step: int) -> MetaStep:
        """One meta step on the batches ``drawn`` (D, D'[, D'']); refuses a non-finite loss
        (naming the batch) and, for HF, a model without second derivatives."""
        batch_losses = [batch_loss(self.model, names, x, y, d, self.data.task) for x, y, d in drawn]
        try:
            result = meta_step(self.variant, batch_losses, params, self.alpha)
        except RuntimeError as err:
            if self.variant == "hf" and any(word in str(err) for word in ("derivative", "differentiat")):
                raise ConfigError(
                    f"{self.who}: Per-FedAvg (HF) needs second derivatives of the model's forward pass "
                    f"(a Hessian-vector product by double backward), and this model has an operation "
                    f"without one ({err}); use per-fedavg.variant = \"fo\"") from err
            raise
        for value, (x, y, _), which in ((result.loss, drawn[0], "D"), (result.adapted_loss, drawn[1], "D'")):
            if not torch.isfinite(value):
                raise nonfinite_loss_error(float(value), x, y, where=f"meta step {step + 1} (batch {which})",
                                           who=self.who, learning_rate=self.train_config.optimizer.learning_rate)
        return result

    # ---------------------------------------------------------------- evaluation
    def adapt(self) -> None:
        """``adapt_steps`` plain gradient steps of size alpha on the whole model, on consecutive
        batches of the shuffled training loader (the shared train loop, capped at the steps)."""
        if self.adapt_steps == 0:
            return
        self.train_groups(("all",), -(-self.adapt_steps // len(self.data.train)),
                          optimizer=OptimizerConfig("sgd", self.alpha), max_steps=self.adapt_steps)

    def local_evaluate(self, config: Config) -> EvalResult:
        global_result = self.evaluate_on(self.data.test)
        received = copy.deepcopy(self.model.state_dict())
        try:
            self.adapt()
            result = self.evaluate_on(self.data.test)
            self.adapted = self.group_state("all")
        finally:
            self.model.load_state_dict(received)
        result.extra |= {f"global_{k}": v for k, v in global_result.metrics().items()}
        return result

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The whole adapted copy of the last evaluation (empty before any)."""
        return dict(self.adapted)
