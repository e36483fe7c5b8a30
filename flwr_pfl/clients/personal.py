"""A personal copy of the whole model, kept on the client beside the global one.

Ditto, APFL and pFedMe train two models per client: the global model w, which crosses the wire,
and a personal model v of the same architecture, which never leaves the client. The client holds
one ``torch.nn.Module``; :meth:`PersonalCopyClient.personal_model` swaps the personal copy's
tensors into it for the duration of a ``with`` block and stores them in ``context.state`` (key
:attr:`PersonalCopyClient.PERSONAL_MODEL_KEY`) afterwards, so that the shared train and
evaluate loops serve both models and the copy survives the new client object the simulation
engine builds for every message, node-state persistence and export.

Before a client's first personal step the copy starts from the model as it stands then (the
received global model in every method here), as in the authors' codes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flwr_pfl.clients.base import Config, PFLClient
from flwr_pfl.training import EvalResult, get_arrays, load_arrays, save_arrays, set_arrays


class PersonalCopyClient(PFLClient):
    """Base of the clients that keep a personal copy of the whole model (wire: the global
    model, all arrays, both ways). Subclasses train inside :meth:`personal_model`.

    :meth:`personal_state` is the personal copy (what export writes and what the client's
    personalized accuracy is measured on); empty before the client's first personal step.
    """

    shared_group = "all"
    personal_group = None
    #: ``context.state`` key of the personal copy (every ``state_dict`` entry, in order)
    PERSONAL_MODEL_KEY = "personal-model"

    def has_personal_model(self) -> bool:
        """Whether this client has stored a personal copy yet."""
        return self.PERSONAL_MODEL_KEY in self.context.state

    @contextmanager
    def personal_model(self, store: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """Swap the personal copy into ``self.model`` for the block.

        Yields the model's state as it was before the swap (the global model: CPU-independent
        clones), which the block may read as an anchor (Ditto's and pFedMe's proximal centre).
        On exit the copy is stored in ``context.state`` (unless ``store`` is False, e.g. for an
        evaluation that must leave it as it was) and the previous state is put back, also when
        the block raises.
        """
        outer = copy.deepcopy(self.model.state_dict())
        personal = load_arrays(self.context.state, self.PERSONAL_MODEL_KEY)
        if personal is not None:
            set_arrays(self.model, personal, "all")
        try:
            yield outer
            if store:
                save_arrays(self.context.state, self.PERSONAL_MODEL_KEY, get_arrays(self.model, "all"))
        finally:
            self.model.load_state_dict(outer)

    def local_evaluate(self, config: Config) -> EvalResult:
        """The personal copy on the local test split (the model as it stands while there is none
        yet), with the received global model's figures beside it as ``global_loss`` /
        ``global_accuracy`` (Ditto, pFedMe; APFL evaluates its mixture instead)."""
        global_result = self.evaluate_on(self.data.test)
        with self.personal_model(store=False):
            result = self.evaluate_on(self.data.test)
        result.extra |= {f"global_{k}": v for k, v in global_result.metrics().items()}
        return result

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The personal copy by ``state_dict`` name (CPU copies); empty before the first one."""
        if not self.has_personal_model():
            return {}
        with self.personal_model(store=False):
            return self.group_state("all")
