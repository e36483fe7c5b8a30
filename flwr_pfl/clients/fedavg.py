"""FedAvg (McMahan et al., 2017), FedProx (Li et al., MLSys 2020), their local fine-tuning
variants, and FedBABU (Oh et al., ICLR 2022): the global-model baselines."""

from __future__ import annotations

import copy

import torch

from flwr_pfl.clients.base import Config, PFLClient
from flwr_pfl.core.proximal import proximal_regularizer
from flwr_pfl.training import EvalResult


class FedAvgClient(PFLClient):
    """FedAvg: train the whole model locally, send it all back; evaluate the global model.

    Any ``torch.nn.Module`` works as it is: ``FedAvgClient(context, Net(), data)``.
    """


class FinetuneClient(PFLClient):
    """FedAvg + fine-tuning: FedAvg's training; at evaluation, fine-tune a copy of the global
    model on the local training set for ``finetune_epochs`` and evaluate that copy.

    Evaluate metrics: the fine-tuned model's ``loss``/``accuracy`` and the global model's
    ``global_loss``/``global_accuracy`` side by side. Nothing of the fine-tuned copy is kept
    across rounds; the last one evaluated is this client's personalized model
    (:meth:`personal_state`). Every parameter is fine-tuned, so any ``torch.nn.Module`` works as
    it is (``FinetuneClient(context, Net(), data, finetune_epochs=2)``; ``head`` is accepted, not
    needed).
    """

    finetune_epochs: int = 1

    def __init__(self, *args, finetune_epochs: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if finetune_epochs < 0:
            raise ValueError(f"finetune_epochs must be >= 0, got {finetune_epochs}")
        self.finetune_epochs = finetune_epochs
        self.finetuned: dict[str, torch.Tensor] = {}

    def local_evaluate(self, config: Config) -> EvalResult:
        global_result = self.evaluate_on(self.data.test)
        global_model = copy.deepcopy(self.model.state_dict())
        self.train_groups(("all",), self.finetune_epochs)
        result = self.evaluate_on(self.data.test)
        self.finetuned = self.group_state("all")
        self.model.load_state_dict(global_model)
        result.extra |= {f"global_{k}": v for k, v in global_result.metrics().items()}
        return result

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The whole fine-tuned model of the last evaluation (empty before any)."""
        return dict(self.finetuned)


class FedProxClient(PFLClient):
    """FedProx: each round, ``local_epochs`` epochs on the whole model minimising Eq. 2,
    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2, anchored at the received global model w^t
    (:func:`~flwr_pfl.core.proximal.proximal_regularizer`); the whole model goes back and the
    server averages it as FedAvg. ``mu = 0`` is FedAvg.

    The proximal term covers the trainable parameters (weights and biases), not buffers such as
    BatchNorm's running statistics, which are not optimised. ``train_loss`` is F_k's mean over
    the steps, without the proximal part. Any ``torch.nn.Module`` works as it is.

    Args:
        mu: the proximal coefficient mu >= 0.
        *args, **kwargs: the arguments of the next class in the method resolution order
            (:class:`PFLClient`, or :class:`FinetuneClient` for :class:`FedProxFinetuneClient`).
    """

    def __init__(self, *args, mu: float = 0.01, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        self.mu = float(mu)

    def local_update(self, config: Config) -> dict[str, float]:
        stats = self.train_groups(("all",), self.train_config.local_epochs,
                                  regularizer=proximal_regularizer(self.model, self.mu))
        return {"train_loss": stats.loss, "train_seconds": stats.seconds}


class FedProxFinetuneClient(FedProxClient, FinetuneClient):
    """FedProx + fine-tuning: FedProx's training (:class:`FedProxClient`) and, at evaluation,
    :class:`FinetuneClient`'s fine-tuning of a copy of the global model for
    ``finetune_epochs`` epochs on the plain local loss F_k (no proximal term) before evaluating it.

    ``FedProxFinetuneClient(context, Net(), data, mu=0.1, finetune_epochs=1)``.
    """


class FedBABUClient(FinetuneClient):
    """FedBABU (Oh, Kim and Yun, ICLR 2022): during federated training only the body learns; the
    head stays frozen at the shared initialisation, and at evaluation the whole model (body and
    head) is fine-tuned for ``finetune_epochs`` before it is evaluated
    (:class:`FinetuneClient`'s mechanism: the fine-tuned copy is evaluated and discarded).

    Wire: the whole model both ways, head included. The head is never trained, so every reply
    carries it unchanged, the server's example-weighted mean of identical arrays gives it back
    unchanged, and every client holds the server's initial head bit for bit, round after round.
    The user's head is named as for FedRep (``FedBABUClient(context, Net(), data, head="fc3")``).

    Args:
        finetune_epochs: epochs of whole-model fine-tuning before each evaluation.
        *args, **kwargs: :class:`PFLClient`'s arguments (``head`` among them).
    """

    head_requirement = "parameters"

    def __init__(self, *args, finetune_epochs: int = 5, **kwargs) -> None:
        super().__init__(*args, finetune_epochs=finetune_epochs, **kwargs)

    def local_update(self, config: Config) -> dict[str, float]:
        stats = self.train_groups(("body",), self.train_config.local_epochs)
        return {"train_loss": stats.loss, "train_seconds": stats.seconds}
