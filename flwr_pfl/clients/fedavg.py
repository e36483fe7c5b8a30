"""FedAvg (McMahan et al., 2017) and FedAvg + local fine-tuning: the global-model baselines."""

from __future__ import annotations

import copy

import torch

from flwr_pfl.clients.base import Config, PFLClient
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
        result.extra = {f"global_{k}": v for k, v in global_result.metrics().items()}
        return result

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The whole fine-tuned model of the last evaluation (empty before any)."""
        return dict(self.finetuned)
