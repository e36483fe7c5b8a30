"""FedPAC's client (Xu, Tong and Huang, ICLR 2023, Alg. 1): feature alignment to global
prototypes and a personal head that the server replaces by a combination of the clients' heads.

Each round the client (1) loads the averaged body, the global prototypes and, when the server
has one for it, its combined head (which replaces the head kept in ``context.state``, as the
paper's server does after every round); (2) computes the statistics of the QP (Sec. 4.3) from
the features of the received body, before any training, as the authors' code does
(``statistics_extraction`` runs before ``local_training``); (3) trains the head alone for
``head_epochs`` epochs at ``head_learning_rate``; (4) trains the body alone, the head frozen, with
cross-entropy plus ``lam`` times the alignment loss (Eq. 7); (5) computes its local prototypes
from the trained body and sends them with the model and the statistics. The mathematics is in
:mod:`flwr_pfl.core.fedpac`; the wire layout is documented in :mod:`flwr_pfl.strategies.fedpac`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from flwr_pfl.clients.base import EXTRA_SEPARATOR, Config, NDArrays, PFLClient, seeded_message
from flwr_pfl.core.fedpac import HEAD_ARRAYS, HEAD_KEY, alignment_loss, alignment_targets, class_means, feature_variance
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import collect_features, get_arrays, group_keys, num_samples, per_sample_loss, set_arrays

NAME = "fedpac"


def extra_name(what: str) -> str:
    """A wire array that is not a model tensor: ``fedpac:<what>``."""
    return f"{NAME}{EXTRA_SEPARATOR}{what}"


def check_options(lam: object, head_epochs: object, head_learning_rate: object, key: Callable[[str], str]) -> None:
    """Refuse bad option values, naming each by ``key(<kebab-case option>)``.

    Raises:
        ConfigError: ``lam`` is not a number >= 0, ``head-epochs`` not an integer >= 0, or
            ``head-learning-rate`` not a number > 0.
    """
    def number(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float))

    if not number(lam) or not lam >= 0:  # type: ignore[operator]
        raise ConfigError(f"{key('lam')} must be a number >= 0 (0 turns the feature alignment off); got {lam!r}")
    if isinstance(head_epochs, bool) or not isinstance(head_epochs, int) or head_epochs < 0:
        raise ConfigError(f"{key('head-epochs')} must be an integer >= 0; got {head_epochs!r}")
    if not number(head_learning_rate) or not head_learning_rate > 0:  # type: ignore[operator]
        raise ConfigError(f"{key('head-learning-rate')} must be a number > 0; got {head_learning_rate!r}")


@dataclass
class Prototypes:
    """Global prototypes as received: rows (C, d) and their total counts (C,); a class with count
    0 has none (nobody that took part held it)."""

    means: torch.Tensor
    counts: torch.Tensor

    @property
    def empty(self) -> bool:
        """No global prototype yet (before the first aggregation): no alignment, as the authors'
        code skips it in the first round."""
        return not bool((self.counts > 0).any())


class FedPACClient(PFLClient):
    """FedPAC's client: body shared and averaged, head personal and combined by the server.

    Wire (see :mod:`flwr_pfl.strategies.fedpac`): instructions carry ``[body..., head...,
    fedpac:prototypes (C, d), fedpac:prototype-counts (C,)]`` and config :data:`HEAD_KEY`; fit
    replies carry ``[trained body..., trained head..., local prototypes (C, d), class counts (C,),
    fedpac:class-means (C, d), fedpac:variance (1,)]`` and the metric :data:`HEAD_ARRAYS`.

    The model needs one head module on the features (``features()``; ``head="fc3"`` for a
    user's model) and a classification task.

    Args:
        lam: weight of the alignment loss (Eq. 7; the paper's lambda, 1.0).
        head_epochs: epochs of head-only training before the body phase (authors: 1).
        head_learning_rate: the head phase's learning rate (authors' code: 0.1, fixed); the
            rest of the optimizer is the client's.
        *args, **kwargs: :class:`PFLClient`'s arguments.

    Raises:
        ConfigError: a bad option, a model without one head module, or a task other than
            classification.
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'it uploads class prototypes (feature means per class) and head statistics computed from the data'
        ' outside DP-SGD'
    )

    head_requirement = "module"
    shared_group = "body"
    personal_group = "heads"

    def __init__(self, *args, lam: float = 1.0, head_epochs: int = 1, head_learning_rate: float = 0.1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_options(lam, head_epochs, head_learning_rate, lambda option: f"FedPAC's {option.replace('-', '_')}")
        if self.data.task != "classification":
            raise ConfigError("FedPAC is a classification method (class prototypes); "
                              f"this client's task is {self.data.task!r}")
        if self.model.num_heads != 1:
            raise ConfigError("FedPAC needs a model with one head (the personal classifier); "
                              f"this model has {self.model.num_heads}")
        self.lam = float(lam)
        self.head_epochs = head_epochs
        self.head_learning_rate = float(head_learning_rate)
        self.num_classes = int(self.model.num_outputs)
        self.prototypes: Prototypes | None = None

    # ---------------------------------------------------------------- wire
    def model_arrays(self) -> NDArrays:
        """Body then head arrays (the order of every message)."""
        return [*get_arrays(self.model, "body"), *get_arrays(self.model, "heads")]

    def get_parameters(self, config: Config) -> NDArrays:
        """The global layout: the model and empty global prototypes (no class has one yet)."""
        d = self.model.feature_dim
        return [*self.model_arrays(), np.zeros((self.num_classes, d), np.float32), np.zeros(self.num_classes, np.float32)]

    def wire_names(self) -> list[str]:
        return [*group_keys(self.model, "body"), *group_keys(self.model, "heads"),
                extra_name("prototypes"), extra_name("prototype-counts")]

    def receive_message(self, parameters: NDArrays, config: Config) -> None:
        """Load the body; the head too when the config says it is this client's combined head, or
        when the client has no head of its own yet (its first message: every client starts from
        the global initial model, as in the authors' code); else the head kept in
        ``context.state`` stays. Keep the global prototypes for the round."""
        n_body = len(group_keys(self.model, "body"))
        n_model = len(parameters) - 2
        if n_model != n_body + len(group_keys(self.model, "heads")):
            raise ValueError(f"{self.who}: FedPAC's instruction has {len(parameters)} arrays; this model needs "
                             f"{n_body + len(group_keys(self.model, 'heads')) + 2} (body, head, prototypes, counts)")
        set_arrays(self.model, parameters[:n_body], "body")
        if bool(config.get(HEAD_KEY, False)) or self.PERSONAL_KEY not in self.context.state:
            set_arrays(self.model, parameters[n_body:n_model], "heads")
        self.prototypes = Prototypes(
            torch.as_tensor(np.asarray(parameters[-2]), dtype=torch.float32, device=self.device),
            torch.as_tensor(np.asarray(parameters[-1]), dtype=torch.float32, device=self.device),
        )

    # ---------------------------------------------------------------- local update
    def class_statistics(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(per-class mean features (C, d), class counts (C,), variance term V_i) of the training
        split under the current body, in eval mode."""
        z, y, _ = collect_features(self.model, self.data.train, device=self.device, keys=self.data.batch_keys)
        y = y.reshape(-1).long()
        means, counts = class_means(z, y, self.num_classes)
        return means, counts, feature_variance(z, y, self.num_classes)

    def body_loss(self, local_protos: torch.Tensor):
        """Cross-entropy plus ``lam`` times the alignment loss (Eq. 7), per sample; the alignment
        is off before any global prototype exists (the authors' first round)."""
        assert self.prototypes is not None
        protos = self.prototypes
        local = local_protos.float()
        align = self.lam > 0 and not protos.empty

        def loss(model: EncoderHeadModel, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            z = model.features(x)
            ce = per_sample_loss(model.head_outputs(z, d), y, "classification")
            if not align:
                return ce
            return ce + self.lam * alignment_loss(z, alignment_targets(y, protos.means, protos.counts, local))

        return loss

    def train_round(self) -> tuple[dict[str, float], NDArrays]:
        """Statistics, head phase, body phase, local prototypes; (metrics, extra reply arrays)."""
        before_means, _, variance = self.class_statistics()
        head_optimizer = replace(self.train_config.optimizer, learning_rate=self.head_learning_rate)
        head = self.train_groups(("heads",), self.head_epochs, optimizer=head_optimizer)
        body = self.train_groups(("body",), self.train_config.local_epochs, loss_fn=self.body_loss(before_means))
        after_means, after_counts, _ = self.class_statistics()
        extras = [
            after_means.float().cpu().numpy(),
            after_counts.float().cpu().numpy(),
            before_means.cpu().numpy(),
            np.array([variance], dtype=np.float64),
        ]
        metrics = {"train_loss": body.loss, "head_loss": head.loss, "train_seconds": head.seconds + body.seconds,
                   "variance": variance}
        return metrics, extras

    # ---------------------------------------------------------------- NumPyClient
    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        self.receive_message(parameters, config)
        metrics, extras = self.train_round()
        self.keep_personal()
        reply = [*self.model_arrays(), *extras]
        heads = len(group_keys(self.model, "heads"))
        return reply, num_samples(self.data.train), {**metrics, HEAD_ARRAYS: heads, "partition_id": self.partition_id}

    @seeded_message
    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        """The personalized model: the averaged body with this client's combined head (kept, as
        the paper's server installs it after the round), or its own head when none came."""
        self.receive_message(parameters, config)
        if bool(config.get(HEAD_KEY, False)):
            self.keep_personal()
        result = self.local_evaluate(config)
        return result.loss, result.num_examples, {**result.metrics(), "partition_id": self.partition_id}
