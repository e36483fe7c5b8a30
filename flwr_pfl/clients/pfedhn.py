"""pFedHN's client (Shamsian et al., ICML 2021, Alg. 1, the client's part): train the model the
server's hypernetwork generated for it, send the trained parameters back.

The server generates every *parameter* of the model (``named_parameters``), nothing else: the
wire carries exactly those, in ``state_dict`` order, both ways. The model's buffers (BatchNorm
running statistics and step counters) are not generated; each client keeps its own in
``context.state`` across rounds (the paper's models have none; FL-bench's pFedHN likewise keeps
buffers per client and refuses global ones). A client that has not trained yet uses the buffers
its freshly built model has.
"""

from __future__ import annotations

import torch

from flwr_pfl.clients.base import Config, NDArrays, PFLClient
from flwr_pfl.core.pfedhn import INNER_CLIP_NORM, INNER_STEPS
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.split import user_keys
from flwr_pfl.training import load_arrays, save_arrays
from flwr_pfl.training.params import arrays_of_keys, set_arrays_of_keys


def check_inner_steps(value: object, key: str = "inner_steps") -> int:
    """``value`` as an integer >= 0, else ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} must be an integer >= 0 (0: local-epochs full passes instead of K steps), got {value!r}")
    return value


def check_inner_clip_norm(value: object, key: str = "inner_clip_norm") -> float:
    """``value`` as a finite number >= 0, else ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(f"{key} must be a finite number >= 0 (0: no clipping), got {value!r}")
    return float(value)


def parameter_keys(model: torch.nn.Module) -> list[str]:
    """The ``state_dict`` keys of ``model``'s parameters (not buffers), in ``state_dict`` order; a
    tied parameter appears once, under its first name."""
    names = {name for name, _ in model.named_parameters()}
    return [key for key in model.state_dict() if key in names]


class PFedHNClient(PFLClient):
    """pFedHN: receive ``theta_i = h(v_i; phi)``, run K local optimizer steps, send ``theta~_i``.

    Wire (see :mod:`flwr_pfl.strategies.pfedhn`): fit and evaluate instructions carry this
    client's generated parameters; the fit reply carries them after local training, with metrics
    ``partition_id``, ``train_loss``, ``train_seconds``, ``inner_steps``. Buffers stay in
    ``context.state`` (key :attr:`BUFFERS_KEY`).

    Local training is the shared train loop with the client's optimizer (the run's
    ``learning-rate``, ``momentum``, ``weight-decay``: the authors' inner SGD is lr 5e-3,
    momentum 0.9, weight decay 5e-5, created afresh each round), for ``inner_steps`` optimizer
    steps on consecutive mini-batches of the shuffled training loader (passes restart,
    reshuffled, as needed). The authors draw each step's batch from a fresh shuffle
    (``next(iter(loader))``); both give K uniformly drawn mini-batches. ``inner_steps = 0``
    trains ``local-epochs`` full passes instead. Before every step the gradient's total norm is
    clipped to ``inner_clip_norm``, as the authors do (``clip_grad_norm_(net.parameters(), 50)``).

    Evaluation: the generated parameters of the evaluate instruction with the client's own
    buffers, as they are (no fine-tuning), as the authors evaluate (``hnet(node_id)`` loaded
    into the target network). :meth:`personal_state` is the whole model as the last message
    left it: after an evaluation, the evaluated model.

    Any ``torch.nn.Module`` works: nothing is asked of its head.

    Args:
        inner_steps: K >= 0 (default the authors' 50).
        inner_clip_norm: the inner steps' gradient-norm clip (default the authors' 50; 0: off).
        *args, **kwargs: :class:`~flwr_pfl.clients.PFLClient`'s arguments.
    """

    shared_group = "all"  # the wire is the parameters only: see get_parameters / receive
    personal_group = None
    BUFFERS_KEY = "pfedhn-buffers"

    def __init__(self, *args, inner_steps: int = INNER_STEPS, inner_clip_norm: float = INNER_CLIP_NORM, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inner_steps = check_inner_steps(inner_steps, "pFedHN's inner_steps (pfedhn.inner-steps)")
        self.inner_clip_norm = check_inner_clip_norm(inner_clip_norm, "pFedHN's inner_clip_norm (pfedhn.inner-clip-norm)")
        self.wire_keys = parameter_keys(self.model)
        wire = set(self.wire_keys)
        self.buffer_keys = [key for key in self.model.state_dict() if key not in wire]
        stored = load_arrays(self.context.state, self.BUFFERS_KEY)
        if stored is not None and self.buffer_keys:
            set_arrays_of_keys(self.model, self.buffer_keys, stored, what=f"{self.who}'s stored buffers")

    # ---------------------------------------------------------------- wire
    def get_parameters(self, config: Config) -> NDArrays:
        return arrays_of_keys(self.model, self.wire_keys)

    def wire_names(self) -> list[str]:
        return list(self.wire_keys)

    def user_wire_names(self) -> list[str]:
        return user_keys(self.model, self.wire_keys)

    def receive(self, parameters: NDArrays) -> None:
        """Load the generated parameters; the buffers stay the client's own."""
        set_arrays_of_keys(self.model, self.wire_keys, parameters, what="pFedHN's generated parameters")

    def keep_personal(self) -> None:
        """Store the buffers (running statistics, step counters) for the next round."""
        if self.buffer_keys:
            save_arrays(self.context.state, self.BUFFERS_KEY, arrays_of_keys(self.model, self.buffer_keys))

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The whole model (generated parameters and own buffers) as the last message left it."""
        return self.group_state("all")

    # ---------------------------------------------------------------- training
    def local_update(self, config: Config) -> dict[str, float]:
        """K optimizer steps (Alg. 1's inner loop), or ``local-epochs`` passes when K = 0."""
        if self.inner_steps:
            # every pass yields at least one batch (an empty training set is refused), so K passes
            # are enough for K steps; the loop stops at max_steps
            stats = self.train_groups(("all",), self.inner_steps, max_steps=self.inner_steps,
                                      clip_grad_norm=self.inner_clip_norm)
        else:
            stats = self.train_groups(("all",), self.train_config.local_epochs, clip_grad_norm=self.inner_clip_norm)
        return {"train_loss": stats.loss, "train_seconds": stats.seconds, "inner_steps": float(stats.steps)}
