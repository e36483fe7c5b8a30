"""Ditto's client (Li, Hu, Beirami and Smith, ICML 2021, Alg. 1): a global model trained as
FedAvg's and a personal model v_k trained on Eq. 2's h_k(v; w^t), anchored at the received w^t."""

from __future__ import annotations

import torch

from flwr_pfl.clients.base import Config
from flwr_pfl.clients.personal import PersonalCopyClient
from flwr_pfl.core.ditto import check_lam, personal_regularizer


class DittoClient(PersonalCopyClient):
    """Ditto: each round, from the received global model w^t,

    1. the global model trains for ``local_epochs`` epochs on the plain F_k from w^t and goes
       back to the server, which averages it as FedAvg;
    2. the personal model v_k (:class:`PersonalCopyClient`'s copy, kept in ``context.state``;
       it starts from the w^t of the client's first round, stored before step 1) trains for
       ``personal_epochs`` epochs on h_k(v; w^t) = F_k(v) + (lam / 2) ||v - w^t||^2 (Eq. 2), the
       proximal term anchored at the RECEIVED w^t (:func:`~flwr_pfl.core.ditto.personal_regularizer`,
       taken before step 1 moves the model), not at the client's updated global model.

    Order: both updates start from w^t and the anchor is w^t whichever runs first, so the order
    changes only which shuffles each loop draws. The authors' code interleaves them (each local
    iteration: a personal step, then a global step on the same batch) and PFLlib runs the
    personal one first (``ptrain`` then ``train``); this client runs the global update first, as
    FL-bench does, so that it draws exactly what FedAvg's client draws: with the same seed the
    global model is FedAvg's, bit for bit, and Ditto's figures differ from FedAvg's by the
    personalization alone. Personal training counts epochs over the local training set, as
    PFLlib's ``plocal_epochs`` and FL-bench's ``pers_epoch`` (the authors' code takes as many
    steps as the global update).

    Evaluation: the personal model v_k (the received global model while the client has none
    yet) on the local test split, with the received global model's figures beside it as
    ``global_loss`` / ``global_accuracy`` (as :class:`~flwr_pfl.clients.FinetuneClient`).
    Fit metrics: ``train_loss`` (F_k of the global update), ``personal_loss`` (F_k of the
    personal update, without the proximal part), ``train_seconds`` (both updates).
    :meth:`personal_state` is v_k (the model it evaluates: the received global model while it has
    none). Any ``torch.nn.Module`` works as it is (``head`` is accepted,
    not needed): ``DittoClient(context, Net(), data, lam=1.0, personal_epochs=5)``.

    Args:
        lam: Eq. 2's lambda >= 0 (0: v_k is trained on F_k alone, local training).
        personal_epochs: epochs of personal training per round (>= 1).
        *args, **kwargs: :class:`~flwr_pfl.clients.PFLClient`'s arguments.

    Raises:
        ValueError: ``lam`` is not a finite number >= 0, or ``personal_epochs`` < 1.
    """

    def __init__(self, *args, lam: float = 1.0, personal_epochs: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lam = check_lam(lam)
        if isinstance(personal_epochs, bool) or not isinstance(personal_epochs, int) or personal_epochs < 1:
            raise ValueError(f"Ditto's personal_epochs must be an integer >= 1, got {personal_epochs!r}")
        self.personal_epochs = personal_epochs

    def local_update(self, config: Config) -> dict[str, float]:
        anchor = personal_regularizer(self.model, self.lam)  # w^t, copied before the global update moves it
        if not self.has_personal_model():
            with self.personal_model():  # nothing to swap in yet: this stores w^t as v_k's start
                pass
        stats = self.train_groups(("all",), self.train_config.local_epochs)
        with self.personal_model():
            personal = self.train_groups(("all",), self.personal_epochs, regularizer=anchor)
        return {"train_loss": stats.loss, "personal_loss": personal.loss,
                "train_seconds": stats.seconds + personal.seconds}

    def personal_state(self) -> dict[str, torch.Tensor]:
        """v_k by ``state_dict`` name (CPU copies): what :meth:`local_evaluate` evaluates, so that
        the export reproduces each client's last evaluation. A client that has never trained has
        no v_k yet and evaluates the received global model; that model (as the last message left
        it) is then its personalized model."""
        return super().personal_state() or self.group_state("all")
