"""APFL's client (Deng, Kamani and Mahdavi, 2020, Alg. 1): the global copy w_i trained as FedAvg's,
a personal model v_i trained through the mixed model alpha_i v_i + (1 - alpha_i) w_i, and the mixing
weight alpha_i, learned or fixed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call

from flwr_pfl.clients.base import Config
from flwr_pfl.clients.personal import PersonalCopyClient
from flwr_pfl.core.apfl import alpha_gradient, alpha_step, check_alpha, mix, mixed_state, personal_gradient
from flwr_pfl.data.types import Task
from flwr_pfl.training import EvalResult, OptimizerConfig, load_scalars, make_optimizer, per_sample_loss, save_scalars


class MixedStep:
    """One APFL local step per batch, as the shared train loop's ``loss_fn`` and ``after_step``.

    ``loss`` returns, per sample, f(w; x) + f(v_bar; x): the first term's gradient reaches only
    the model (w, trained by the loop's optimizer); the second is computed with
    :func:`torch.func.functional_call` on the mixed parameters, held as fresh leaf tensors, with
    the personal model's buffers (which a train-mode forward updates in place). ``after`` runs
    once the loop's optimizer has stepped w: it reads grad f(v_bar) from the mixed leaves and
    steps alpha (:func:`~flwr_pfl.core.apfl.alpha_gradient` with the step's v and pre-step w)
    and v (:func:`~flwr_pfl.core.apfl.personal_gradient`, through its own optimizer built from
    the same settings as w's). All three gradients are taken at the step's starting iterates, as
    Alg. 1 writes them; w and v see the same batch.

    Args:
        personal: v, the personal model's whole ``state_dict`` (on the training device).
        parameter_names: the ``state_dict`` names that are parameters (mixed and trained).
        alpha: alpha's value at the start.
        alpha_lr: alpha's step size; 0 keeps alpha fixed.
        optimizer: v's optimizer settings.
        task: the loss's task.
    """

    def __init__(
        self,
        personal: dict[str, torch.Tensor],
        parameter_names: Sequence[str],
        alpha: float,
        alpha_lr: float,
        optimizer: OptimizerConfig,
        task: Task,
    ) -> None:
        self.params = {k: personal[k].detach().clone().requires_grad_(True) for k in parameter_names}
        self.buffers = {k: t for k, t in personal.items() if k not in self.params}
        self.alpha, self.alpha_lr, self.task = alpha, alpha_lr, task
        self.optimizer = make_optimizer(list(self.params.values()), optimizer)
        #: (alpha, w, mixed leaves) of the step whose loss was taken last
        self.pending: tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self.global_sum = self.personal_sum = 0.0
        self.steps = 0

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        own = per_sample_loss(model(x, d), y, self.task)
        w = {k: p.detach().clone() for k, p in model.named_parameters() if k in self.params}
        with torch.no_grad():
            mixed = mix({k: p.detach() for k, p in self.params.items()}, w, self.alpha)
        mixed = {k: t.requires_grad_(True) for k, t in mixed.items()}
        personal = per_sample_loss(functional_call(model, {**mixed, **self.buffers}, (x, d)), y, self.task)
        self.pending = (self.alpha, w, mixed)
        self.global_sum += float(own.detach().mean())
        self.personal_sum += float(personal.detach().mean())
        self.steps += 1
        return own + personal

    def after(self, model: nn.Module, step: int) -> None:
        if self.pending is None:
            raise RuntimeError("APFL's after_step ran without a loss taken before it")
        alpha, w, mixed = self.pending
        grad = {k: torch.zeros_like(t) if t.grad is None else t.grad for k, t in mixed.items()}  # unused: 0
        if self.alpha_lr:  # from v^{t-1}, before v moves
            self.alpha = alpha_step(alpha, alpha_gradient(self.params, w, grad), self.alpha_lr)
        direction = personal_gradient(grad, alpha)  # alpha^{t-1}, as v_bar^{t-1} used it
        for k, p in self.params.items():
            p.grad = direction[k]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = None

    def personal(self) -> dict[str, torch.Tensor]:
        """v after the steps: the parameters and the (updated) buffers, detached."""
        return {**{k: p.detach() for k, p in self.params.items()}, **self.buffers}


class APFLClient(PersonalCopyClient):
    """APFL (Deng, Kamani and Mahdavi, 2020, Alg. 1). Each round, from the received global model:
    ``local_epochs`` epochs in which every batch makes one :class:`MixedStep` (w on f_i(w), v on
    f_i(v_bar) through the mixture, alpha on < v - w, grad f_i(v_bar) > when learned); w goes
    back and the server averages it as FedAvg. v is :class:`PersonalCopyClient`'s copy in
    ``context.state`` (before the client's first round: the received global model, as PFLlib and
    FL-bench start it, from a copy of the model); a learned alpha is kept there too
    (scalars under :attr:`ALPHA_KEY`), so both survive the new client object of every message.

    Evaluation: the mixed model alpha v + (1 - alpha) w with w the RECEIVED global model (Alg. 1's
    output, the personalized model v_bar_i = alpha_i v_i + (1 - alpha_i) w) and v's buffers
    (:func:`~flwr_pfl.core.apfl.mixed_state`); the global model's figures beside it as
    ``global_loss`` / ``global_accuracy``, and ``alpha``. Before a client's first fit, v is the
    received model, so the mixture is the global model. Fit metrics: ``train_loss`` (f_i(w), the
    mean over steps, as FedAvg's), ``personal_loss`` (f_i(v_bar)), ``alpha`` (after the round),
    ``train_seconds``. :meth:`personal_state` is the mixed model with the global model the client
    holds at the time (after an evaluation: the received one, what was evaluated). Any
    ``torch.nn.Module`` works as it is: ``APFLClient(context, Net(), data, alpha=0.25)``.

    Args:
        alpha: the mixing weight: fixed, or alpha's start when ``learn_alpha``.
        learn_alpha: update alpha at every local step (the paper's adaptive alpha).
        alpha_lr: alpha's step size; 0 (default): the round's learning rate, the one eta_t of
            Alg. 1 (and of the authors' code). Ignored when alpha is fixed.
        *args, **kwargs: :class:`~flwr_pfl.clients.PFLClient`'s arguments.

    Raises:
        ValueError: ``alpha`` is not in [0, 1], or ``alpha_lr`` is not a finite number >= 0.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'its personal model and mixing weight alpha take their own optimizer steps on the data (Deng et '
        "al.'s update), outside DP-SGD"
    )

    #: ``context.state`` key of the learned alpha (a ConfigRecord with the scalar ``alpha``)
    ALPHA_KEY = "apfl-alpha"

    def __init__(self, *args, alpha: float = 0.5, learn_alpha: bool = True, alpha_lr: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initial_alpha = check_alpha(alpha)
        self.learn_alpha = bool(learn_alpha)
        if isinstance(alpha_lr, bool) or not isinstance(alpha_lr, (int, float)) or not 0 <= alpha_lr < float("inf"):
            raise ValueError(f"APFL's alpha_lr must be a finite number >= 0, got {alpha_lr!r}")
        self.alpha_lr = float(alpha_lr)

    # ---------------------------------------------------------------- state
    @property
    def alpha(self) -> float:
        """This client's mixing weight: the stored one when learned (the initial one before its
        first round), else the fixed one."""
        if not self.learn_alpha:
            return self.initial_alpha
        return float(load_scalars(self.context.state, self.ALPHA_KEY).get("alpha", self.initial_alpha))

    def personal_tensors(self) -> dict[str, torch.Tensor]:
        """v by ``state_dict`` name (CPU copies): the stored copy, or the model as it stands when
        there is none yet (the received global model)."""
        with self.personal_model(store=False):
            return self.group_state("all")

    def store_personal(self, personal: dict[str, torch.Tensor]) -> None:
        """Keep ``personal`` (a whole ``state_dict``) as v in ``context.state``."""
        with self.personal_model():
            self.model.load_state_dict(personal)

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.model.named_parameters()]

    def mixed(self) -> dict[str, torch.Tensor]:
        """The mixed model's ``state_dict`` with the global model the client holds now."""
        return mixed_state(self.personal_tensors(), self.group_state("all"), self.alpha, self.parameter_names())

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The mixed model alpha v + (1 - alpha) w (:meth:`mixed`): what :meth:`local_evaluate`
        evaluates, so that the export reproduces the client's last evaluation (before its first
        fit v is the received model, and the mixture is that model)."""
        return self.mixed()

    # ---------------------------------------------------------------- hooks
    def local_update(self, config: Config) -> dict[str, float]:
        optimizer = self.train_config.optimizer
        alpha_lr = (self.alpha_lr or optimizer.learning_rate) if self.learn_alpha else 0.0
        personal = {k: t.to(self.device) for k, t in self.personal_tensors().items()}
        step = MixedStep(personal, self.parameter_names(), self.alpha, alpha_lr, optimizer, self.data.task)
        stats = self.train_groups(("all",), self.train_config.local_epochs, loss_fn=step.loss, after_step=step.after)
        self.store_personal(step.personal())
        if self.learn_alpha:
            save_scalars(self.context.state, self.ALPHA_KEY, {"alpha": step.alpha})
        steps = max(step.steps, 1)
        return {"train_loss": step.global_sum / steps, "personal_loss": step.personal_sum / steps,
                "alpha": step.alpha, "train_seconds": stats.seconds}

    def local_evaluate(self, config: Config) -> EvalResult:
        global_result = self.evaluate_on(self.data.test)
        mixed = self.mixed()
        with self.personal_model(store=False):
            self.model.load_state_dict(mixed)
            result = self.evaluate_on(self.data.test)
        result.extra |= {**{f"global_{k}": v for k, v in global_result.metrics().items()}, "alpha": self.alpha}
        return result
