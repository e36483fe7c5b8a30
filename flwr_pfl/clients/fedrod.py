"""FedRoD (Chen and Chao, ICLR 2022): a shared body and generic head trained with the balanced
softmax loss, plus a personal head on top of the generic one, kept on the client.

The user's model has one head (``head="fc3"``). Its body and that head, the *generic* head, are
the global model: they cross the wire as FedAvg's whole model and are averaged by example count.
The *personal* head is a second module of the same shape as the head (a copy of it), which never
leaves the client: it lives in ``context.state`` between messages (key
:attr:`FedRoDClient.PERSONAL_HEAD_KEY`), so it survives the new client object the simulation
engine builds for every message. The mathematics is in :mod:`flwr_pfl.core.fedrod`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from flwr_pfl.clients.base import EXTRA_SEPARATOR, Config, NDArrays, PFLClient
from flwr_pfl.core.fedrod import balanced_softmax_loss, class_counts, personal_head_loss, personalized_logits
from flwr_pfl.errors import ConfigError
from flwr_pfl.training import (
    EvalResult,
    dataset_targets,
    evaluate,
    get_arrays,
    load_arrays,
    per_sample_loss,
    save_arrays,
    set_arrays,
    train,
)

#: what trains the generic head (and the body): FedRoD's balanced softmax, or plain cross-entropy
GENERIC_LOSSES = ("balanced-softmax", "cross-entropy")


class DecoupledHeads(nn.Module):
    """The model (body + generic head) beside the personal head, as one module, so that the
    shared train and evaluate loops serve FedRoD: ``forward`` is the personalized prediction
    g(z) + p(z) (FedRoD Sec. 4.3); :meth:`outputs` gives both heads' logits for training.

    Args:
        model: the client's split model with one head (the generic head).
        personal: the personal head, a module of the head's shape.
    """

    def __init__(self, model: nn.Module, personal: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.personal = personal

    def outputs(self, x: torch.Tensor, domain: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(g(z), p(z.detach())): the personal head sees the features as constants."""
        z = self.model.features(x)
        return self.model.head_outputs(z, domain), self.personal(z.detach())

    def forward(self, x: torch.Tensor, domain: torch.Tensor | None = None) -> torch.Tensor:
        return personalized_logits(*self.outputs(x, domain))


class FedRoDClient(PFLClient):
    """FedRoD's client (Chen and Chao, ICLR 2022).

    Each round, for ``local_epochs`` epochs, every mini-batch takes one forward pass of the body,
    z = f(x), and one SGD step on

        mean_i l_BSM(g(z_i), y_i; n)  +  mean_i CE(g(z_i).detach() + p(z_i.detach()), y_i),

    whose first term trains the body and the generic head g, and whose second trains the personal
    head p only (n: this client's training class counts). This is the authors' update as PFLlib
    writes it (``clientrod.py``: a step of the model's optimizer on the BSM loss, then a step of
    the personal head's optimizer on the detached sum, both from the same forward pass): the two
    terms share no parameter, so one step of one optimizer over both gives the same update, for
    SGD with momentum and weight decay as for Adam. The body and generic head go back to the
    server (FedAvg); the personal head is stored in ``context.state``.

    Evaluation: ``loss`` / ``accuracy`` of the personalized prediction g(z) + p(z), and
    ``global_loss`` / ``global_accuracy`` of the generic head alone (the global model, the
    paper's generic accuracy), on the client's test split.

    Before a client's first fit the personal head starts as a copy of the received generic head
    (PFLlib and FL-bench deep-copy the model's head at client creation, when it is the initial
    global head). An evaluation before any fit uses that copy and stores nothing.

    The model needs its head as one module whose output is the model's output (``features()`` /
    ``head_outputs()``; ``FedRoDClient(context, Net(), data, head="fc3")``), one head, and a
    classification task.

    Args:
        generic_loss: ``"balanced-softmax"`` (FedRoD) or ``"cross-entropy"`` (the generic head
            trained as FedAvg's, an ablation of the balanced loss).
        *args, **kwargs: :class:`PFLClient`'s arguments (``head`` among them).

    Raises:
        ConfigError: the model has no head module, several heads, or the task is not
            classification; ``generic_loss`` is unknown.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'its two heads are trained by their own loop (balanced softmax and the personal head), outside '
        'DP-SGD'
    )

    head_requirement = "module"
    shared_group = "all"
    personal_group = None
    #: ``context.state`` key of the personal head's tensors (its ``state_dict`` order)
    PERSONAL_HEAD_KEY = "fedrod-personal-head"
    #: prefix of the personal head's tensors in :meth:`personal_state`
    PERSONAL_PREFIX = f"fedrod{EXTRA_SEPARATOR}personal_head."

    def __init__(self, *args, generic_loss: str = "balanced-softmax", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if generic_loss not in GENERIC_LOSSES:
            raise ConfigError(f"FedRoD's generic_loss must be one of {', '.join(GENERIC_LOSSES)}; got {generic_loss!r}")
        if self.data.task != "classification":
            raise ConfigError("FedRoD is a classification method (balanced softmax over class counts); "
                              f"this client's task is {self.data.task!r}")
        if self.model.num_heads != 1:
            raise ConfigError(f"FedRoD needs a model with one head (the generic head; it builds the personal head "
                              f"itself as a copy of it); this model has {self.model.num_heads} heads")
        self.generic_loss = generic_loss
        self.personal_head = copy.deepcopy(self.model.heads[0])
        self.decoupled = DecoupledHeads(self.model, self.personal_head)
        stored = load_arrays(self.context.state, self.PERSONAL_HEAD_KEY)
        if stored is not None:
            set_arrays(self.personal_head, stored, "all")

    # ---------------------------------------------------------------- personal head
    def has_personal_head(self) -> bool:
        """Whether this client has stored a personal head yet (after its first fit)."""
        return self.PERSONAL_HEAD_KEY in self.context.state

    def receive(self, parameters: NDArrays) -> None:
        """Load the global body and generic head; a client without a stored personal head
        starts it as a copy of the received generic head."""
        super().receive(parameters)
        if not self.has_personal_head():
            self.personal_head.load_state_dict(self.model.heads[0].state_dict())

    def keep_personal(self) -> None:
        """Store the personal head in ``context.state`` for the next message."""
        save_arrays(self.context.state, self.PERSONAL_HEAD_KEY, get_arrays(self.personal_head, "all"))

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The personal head's tensors (CPU copies) as ``fedrod:personal_head.<name>``; with the
        global model (body and generic head) it is this client's personalized model."""
        return {f"{self.PERSONAL_PREFIX}{k}": v.detach().cpu().clone() for k, v in self.personal_head.state_dict().items()}

    def load_personal_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a personal head saved by :meth:`personal_state` (an export's ``clients/<id>.pt``);
        entries without the ``fedrod:personal_head.`` prefix (the global model's) are ignored.

        Raises:
            RuntimeError: the personal head's entries do not match the head (torch's strict load).
        """
        prefix = self.PERSONAL_PREFIX
        self.personal_head.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    # ---------------------------------------------------------------- training
    def train_class_counts(self) -> torch.Tensor:
        """n_{m,c}: this client's training samples per class (ValueError naming the client for a
        label outside the model's classes)."""
        labels, _ = dataset_targets(self.data.train, self.data.batch_keys)
        try:
            return class_counts(labels, int(self.model.num_outputs))
        except ValueError as err:
            raise ValueError(f"{self.who}: {err}") from None

    def local_update(self, config: Config) -> dict[str, float]:
        counts = self.train_class_counts().to(self.device)
        sums: dict[str, torch.Tensor | float] = {"generic": 0.0, "personal": 0.0}  # on the device: no sync per step

        def loss_fn(model: DecoupledHeads, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            generic, personal = model.outputs(x, d)
            if self.generic_loss == "balanced-softmax":
                generic_loss = balanced_softmax_loss(generic, y, counts)
            else:
                generic_loss = per_sample_loss(generic, y, "classification")
            personal_loss = personal_head_loss(generic, personal, y)
            sums["generic"] = sums["generic"] + generic_loss.detach().mean()
            sums["personal"] = sums["personal"] + personal_loss.detach().mean()
            return generic_loss + personal_loss

        stats = train(
            self.decoupled,
            self.data.train,
            optimizer=self.train_config.optimizer,
            device=self.device,
            epochs=self.train_config.local_epochs,
            task=self.data.task,
            loss_fn=loss_fn,
            who=self.who,
            keys=self.data.batch_keys,
        )
        steps = max(stats.steps, 1)
        return {
            "train_loss": stats.loss,
            "generic_loss": float(sums["generic"]) / steps,
            "personal_loss": float(sums["personal"]) / steps,
            "train_seconds": stats.seconds,
        }

    # ---------------------------------------------------------------- evaluation
    def local_evaluate(self, config: Config) -> EvalResult:
        """The personalized prediction g(z) + p(z), with the generic head's figures as ``global_*``."""
        generic = self.evaluate_on(self.data.test)
        result = evaluate(self.decoupled, self.data.test, device=self.device, task=self.data.task,
                          num_domains=self.data.num_domains, keys=self.data.batch_keys)
        result.extra |= {f"global_{k}": v for k, v in generic.metrics().items()}
        return result
