"""FedAMP's client (Huang et al., AAAI 2021, Alg. 1): the proximal step of Eq. 6 from the
personalized cloud model u_i the server sends.

Each fit message carries u_i (every ``state_dict`` entry; the server combined the parameters by
Eq. 5 and left the client's own BatchNorm statistics and counter) and the server's alpha_k and
lambda. The client loads u_i, takes it as the proximal centre and as the starting point, and
trains E epochs on F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2 (FedProx's term with
mu = lambda / alpha_k, :func:`~flwr_pfl.core.fedamp.client_regularizer`). It uploads w_i with the
parameter mask (:data:`~flwr_pfl.core.fedamp.MASK_NAME`).

Starting point: Alg. 1 gives the client u_i only, so local SGD starts there. PFLlib and fluke
start from the client's own previous w_i (kept on the client) instead; both approximate the
argmin of the same Eq. 6.

Evaluation: the evaluate message carries w_i as the server holds it (the client's latest
accepted upload; the initial model for a client never trained), which the client evaluates as it
is. The client keeps nothing across rounds: the server's state is the whole of FedAMP's state,
so a resumed run (the server's checkpoint) continues exactly whatever the nodes kept.
"""

from __future__ import annotations

import numpy as np
import torch

from flwr_pfl.clients.base import Config, NDArrays, PFLClient
from flwr_pfl.core.fedamp import ALPHA_KEY, LAM_KEY, check_hyperparameters, client_regularizer
from flwr_pfl.errors import ConfigError
from flwr_pfl.training import get_arrays, group_keys


class FedAMPClient(PFLClient):
    """FedAMP: train from u_i on Eq. 6, upload w_i; evaluate the w_i the server sends.

    Wire (see :mod:`flwr_pfl.strategies.fedamp`): fit instructions carry u_i (all arrays) and
    config ``fedamp-alpha-k``, ``fedamp-lam``; fit replies carry ``[w_i..., fedamp:parameter-mask]``;
    evaluate instructions carry w_i. Any ``torch.nn.Module`` works as it is (``head`` is
    accepted, not needed). Fit metrics: ``train_loss`` (F_i, without the proximal part),
    ``train_seconds``.
    """

    shared_group = "all"
    personal_group = None

    def parameter_mask(self) -> np.ndarray:
        """1.0 for each wire array that is a model parameter (tied ones included), 0.0 for a buffer."""
        names = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        return np.array([key in names for key in group_keys(self.model, "all")], dtype=np.float32)

    def hyperparameters(self, config: Config) -> tuple[float, float]:
        """(lambda, alpha_k) of the fit config.

        Raises:
            ConfigError: a key is missing (the server is not FedAMP's) or its value is out of range.
        """
        missing = [key for key in (LAM_KEY, ALPHA_KEY) if key not in config]
        if missing:
            raise ConfigError(f"{self.who}: FedAMP's fit instruction lacks {missing}: the server must be FedAMP's")
        lam, alpha_k = config[LAM_KEY], config[ALPHA_KEY]
        check_hyperparameters(alpha_k, lam, 1.0, lambda name: f"{self.who}: the server's {name}")
        return float(lam), float(alpha_k)  # type: ignore[arg-type]

    def local_update(self, config: Config) -> dict[str, float]:
        """E epochs on Eq. 6 from u_i (the model as received), anchored at u_i."""
        lam, alpha_k = self.hyperparameters(config)
        regularizer = client_regularizer(self.model, lam, alpha_k)
        stats = self.train_groups(("all",), self.train_config.local_epochs, regularizer=regularizer)
        return {"train_loss": stats.loss, "train_seconds": stats.seconds}

    def fit_reply(self, config: Config) -> NDArrays:
        """w_i, then the parameter mask (:data:`~flwr_pfl.core.fedamp.MASK_NAME`)."""
        return [*get_arrays(self.model, "all"), self.parameter_mask()]

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The model as the last message left it: after an evaluation, the w_i it evaluated
        (what the export writes); after a fit, the w_i it uploaded."""
        return self.group_state("all")
