"""FedBN (Li, Jiang, Zhang, Kamp and Dou, ICLR 2021): local normalisation layers, the rest FedAvg.

Every normalisation layer of the model stays on its client: its affine weight and bias and, where
it has them, its running statistics and step counter. The layers are found by module type
(:data:`NORM_TYPES`: torch's BatchNorm1d/2d/3d, SyncBatchNorm and their lazy forms, GroupNorm,
LayerNorm, InstanceNorm1d/2d/3d and, where torch has it, RMSNorm), so the user's own model works as it
is: ``FedBNClient(context, Net(), data)``. Everything else crosses the wire and is averaged as in
FedAvg (Alg. 1 of the paper: the server averages every layer except the BN layers).
"""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.common.logger import log
from torch import nn

from flwr_pfl.clients.base import Config, NDArrays, PFLClient
from flwr_pfl.models.split import user_keys
from flwr_pfl.training import load_arrays, save_arrays
from flwr_pfl.training.params import arrays_of_keys, set_arrays_of_keys

#: the module types FedBN keeps local (BatchNorm's family includes SyncBatchNorm and the lazy forms)
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


#: model types already warned about (the engine builds a client per message: warn once per process)
_WARNED: set[str] = set()


def normalization_keys(model: nn.Module) -> list[str]:
    """The ``state_dict`` keys of ``model`` that belong to a normalisation module
    (:data:`NORM_TYPES`): weights, biases, running statistics and step counters, in
    ``state_dict`` order."""
    prefixes = [name + "." for name, module in model.named_modules() if isinstance(module, NORM_TYPES)]
    return [key for key in model.state_dict() if any(key.startswith(p) for p in prefixes)]


class FedBNClient(PFLClient):
    """FedBN: train the whole model locally; send everything except the normalisation layers,
    which stay in ``context.state`` (:func:`normalization_keys`).

    Wire: the model's ``state_dict`` entries outside every normalisation module, in
    ``state_dict`` order, both ways. A model with no normalisation layer has nothing for FedBN
    to keep local: the client then logs a warning (once per process and model type) and
    behaves as FedAvg (the whole model on the wire), so that one configuration can run over
    models with and without them.

    The personal part is a predicate on ``state_dict`` names (the norm modules' keys), the same
    kind of selection :class:`~flwr_pfl.models.HeadSplit` makes for a head; it is applied here to
    the model as the client holds it, so a model already split into body and head (the suite's
    :class:`~flwr_pfl.models.EncoderHeadModel`, or a user's model given with ``head=``) keeps its
    head on the wire and only its norm layers local.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'FedBN is defined by BatchNorm layers kept local, and DP-SGD needs a model without running '
        'statistics'
    )

    shared_group = "all"
    personal_group = None
    PERSONAL_KEY = "fedbn-norms"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.local_keys = normalization_keys(self.model)
        local = set(self.local_keys)
        self.shared_keys = [k for k in self.model.state_dict() if k not in local]
        if not self.local_keys and type(self.model).__name__ not in _WARNED:
            _WARNED.add(type(self.model).__name__)
            log(WARNING, "FedBN %s: the model (%s) has no normalisation layer (%s); FedBN keeps those "
                "local, so with none it is FedAvg", self.who, type(self.model).__name__,
                ", ".join(t.__name__ for t in NORM_TYPES))
        personal = load_arrays(self.context.state, self.PERSONAL_KEY)
        if personal is not None:
            self._load(self.local_keys, personal)

    # ---------------------------------------------------------------- wire
    def _load(self, keys: list[str], arrays: NDArrays) -> None:
        set_arrays_of_keys(self.model, keys, arrays, what=f"{type(self).__name__}'s wire")

    def _arrays(self, keys: list[str]) -> NDArrays:
        return arrays_of_keys(self.model, keys)

    def get_parameters(self, config: Config) -> NDArrays:
        return self._arrays(self.shared_keys)

    def wire_names(self) -> list[str]:
        return list(self.shared_keys)

    def user_wire_names(self) -> list[str]:
        return user_keys(self.model, self.shared_keys)

    def receive(self, parameters: NDArrays) -> None:
        """Load the server's arrays into everything but the normalisation layers."""
        self._load(self.shared_keys, parameters)

    def keep_personal(self) -> None:
        """Store the normalisation layers in ``context.state`` for the next round."""
        if self.local_keys:
            save_arrays(self.context.state, self.PERSONAL_KEY, self._arrays(self.local_keys))

    def personal_state(self) -> dict[str, torch.Tensor]:
        """This client's normalisation layers, by ``state_dict`` name (CPU copies)."""
        state = self.model.state_dict()
        return {k: state[k].detach().cpu().clone() for k in self.local_keys}
