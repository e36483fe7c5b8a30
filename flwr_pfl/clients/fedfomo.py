"""FedFomo's client (Zhang, Sapra, Fidler, Yeung and Alvarez, ICLR 2021, Sec. 3): the first-order
combination of downloaded models on the client's own validation split, then local training.

Each round the client (1) receives its own latest model theta_i (the initial global model
while it has none) and M' other clients' models; (2) computes on its validation split the loss
of each, ``L_i(theta_i)`` and ``L_i(theta_n)``, and the raw first-order weights
``w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||`` (distance over the trainable
parameters); (3) normalises them, ``max(w_n, 0) / sum_m max(w_m, 0)``, and steps
``theta_i <- theta_i + sum_n w_n (theta_n - theta_i)`` (no step when no weight is positive);
(4) trains all of theta_i for the local epochs; (5) sends theta_i and the raw weights back (the
server adds them into its affinity matrix). The mathematics is in :mod:`flwr_pfl.core.fedfomo`;
the wire layout is documented in :mod:`flwr_pfl.strategies.fedfomo`.
"""

from __future__ import annotations

import copy
from logging import WARNING

import numpy as np
from flwr.common import log
from torch import nn
from torch.utils.data import DataLoader

from flwr_pfl.clients.base import EXTRA_SEPARATOR, Config, NDArrays, PFLClient, seeded_message
from flwr_pfl.core.fedfomo import first_order_weights, fomo_update, normalized_weights, parameter_distance
from flwr_pfl.training import evaluate, get_arrays, group_keys, num_samples, set_arrays

NAME = "fedfomo"
#: fit-config key: how many other clients' models follow the client's own in the instruction
MODELS_KEY = "fedfomo-models"
#: the fit reply's last array: the raw first-order weights, one per downloaded model (float64)
WEIGHTS = f"{NAME}{EXTRA_SEPARATOR}weights"


def split_instruction(parameters: NDArrays, config: Config, size: int) -> tuple[NDArrays, list[NDArrays]]:
    """The own model and the other models of a fit instruction of ``(1 + M') * size`` arrays,
    ``M' = config[MODELS_KEY]`` (absent: 0).

    Raises:
        ValueError: the count of arrays does not fit ``M'`` and the model's ``size`` arrays.
    """
    count = config.get(MODELS_KEY, 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"the fit config's {MODELS_KEY}={count!r} must be an integer >= 0")
    if len(parameters) != (1 + count) * size:
        raise ValueError(f"FedFomo's fit instruction has {len(parameters)} arrays; with {MODELS_KEY}={count} and a model "
                         f"of {size} arrays it must have {(1 + count) * size}")
    own = list(parameters[:size])
    return own, [list(parameters[size * (k + 1):size * (k + 2)]) for k in range(count)]


class FedFomoClient(PFLClient):
    """FedFomo's client: the whole model crosses the wire; no state is kept on the client (the
    server holds every client's latest model and sends it back, at fit and at evaluation).

    Wire (see :mod:`flwr_pfl.strategies.fedfomo`): fit instructions carry ``[theta_i...,
    theta_{c_1}..., ..., theta_{c_M'}...]`` (each the model's ``state_dict`` arrays) and config
    :data:`MODELS_KEY` ``= M'``; fit replies carry ``[theta_i after the update and training...,
    fedfomo:weights (M',) float64]`` (the raw weights, in the order of the models received) and
    metrics ``partition_id``, ``train_loss``, ``train_seconds``, ``fomo_val_loss``
    (``L_i(theta_i)``), ``fomo_models`` (M'), ``fomo_positive`` (models with a positive weight).
    Evaluate instructions carry theta_i; the client evaluates it on its test split.

    The losses are the mean loss on the validation split (``LocalData.val``; the run's
    ``val-fraction``), the models in eval mode. Without a validation split the training split
    is used, with a warning: FedFomo's weights then measure the fit to the training data.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        "its combination weights come from the validation losses of the other clients' models on its "
        'data, outside DP-SGD'
    )

    shared_group = "all"
    personal_group = None

    # ---------------------------------------------------------------- the first-order step
    def validation_loader(self) -> DataLoader:
        """The validation split, or the training split (with a warning) when there is none."""
        if self.data.val is not None:
            return self.data.val
        log(WARNING, "FedFomo %s has no validation split (give LocalData(val=...) a validation loader; run config: val-fraction > 0): its model weights are computed "
            "on its training split", self.who)
        return self.data.train

    def loss_of(self, model: nn.Module, loader: DataLoader) -> float:
        """Mean loss of ``model`` on ``loader`` (eval mode)."""
        return evaluate(model, loader, device=self.device, task=self.data.task, num_domains=self.data.num_domains,
                        keys=self.data.batch_keys).loss

    def parameter_mask(self) -> list[bool]:
        """Which of the wire arrays are trainable parameters (they define the distance)."""
        names = {name for name, _ in self.model.named_parameters()}
        return [key in names for key in group_keys(self.model, "all")]

    def first_order_step(self, own: NDArrays, candidates: list[NDArrays]) -> tuple[np.ndarray, dict[str, float]]:
        """Load ``own``, weigh ``candidates`` and step towards them; (raw weights, metrics)."""
        set_arrays(self.model, own, "all")
        if not candidates:
            return np.zeros(0, dtype=np.float64), {"fomo_models": 0.0, "fomo_positive": 0.0}
        loader = self.validation_loader()
        own_loss = self.loss_of(self.model, loader)
        scratch = copy.deepcopy(self.model)
        mask = self.parameter_mask()
        losses, distances = [], []
        for arrays in candidates:
            set_arrays(scratch, arrays, "all")
            losses.append(self.loss_of(scratch, loader))
            distances.append(parameter_distance(own, arrays, mask))
        raw = first_order_weights(own_loss, losses, distances)
        weights = normalized_weights(raw)
        if weights.sum() > 0:
            set_arrays(self.model, fomo_update(own, candidates, weights), "all")
        metrics = {"fomo_val_loss": own_loss, "fomo_models": float(len(candidates)),
                   "fomo_positive": float(np.count_nonzero(weights))}
        return raw, metrics

    # ---------------------------------------------------------------- NumPyClient
    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        own, candidates = split_instruction(parameters, config, len(group_keys(self.model, "all")))
        raw, metrics = self.first_order_step(own, candidates)
        stats = self.train_groups(("all",), self.train_config.local_epochs)
        reply = [*get_arrays(self.model, "all"), raw.astype(np.float64)]
        metrics |= {"train_loss": stats.loss, "train_seconds": stats.seconds, "partition_id": self.partition_id}
        return reply, num_samples(self.data.train), metrics

    def personal_state(self):
        """theta_i as the last message left the model: at evaluation, the model the server sent
        and the client evaluated (its personalized model), for export."""
        return self.group_state("all")
