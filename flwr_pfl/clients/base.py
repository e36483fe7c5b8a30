"""The base of every client in the suite: unpack, train with the shared loop, pack.

A client is a Flower NumPyClient around a model and the client's local data. The model is an
:class:`~flwr_pfl.models.EncoderHeadModel`, or the user's own ``torch.nn.Module`` with its head
named by ``head=`` (the client wraps it with :func:`~flwr_pfl.models.split_model`, keeping the
user's modules and weights). Subclasses say which parameter group crosses the wire
(``shared_group``), which one stays on the client between rounds (``personal_group``, kept in
``context.state``), what they need of the head (``head_requirement``), and what a local update
does (:meth:`PFLClient.local_update`). Nothing is kept in Python attributes across rounds: the
simulation engine builds a new client object for every message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from flwr.app import Context
from flwr.client import NumPyClient
from torch import nn
from torch.utils.data import DataLoader

from flwr_pfl.data.types import ClientData, Task, no_training_samples
from flwr_pfl.errors import ConfigError
from flwr_pfl.messages import LEARNING_RATE_KEYS
from flwr_pfl.models.split import HeadRequirement, HeadSpec, check_head, client_model, user_keys
from flwr_pfl.training import (
    BatchKeys,
    EvalResult,
    OptimizerConfig,
    TrainStats,
    evaluate,
    get_arrays,
    group_keys,
    load_arrays,
    load_scalars,
    num_samples,
    resolve_device,
    save_arrays,
    save_scalars,
    seeded,
    set_arrays,
    train,
)
from flwr_pfl.training.dpsgd import PrivateSteps, RecordLevelDP, StepAccount
from flwr_pfl.training.dpsgd import check_model as check_dp_model
from flwr_pfl.training.norms import FrozenNorm, check_frozen_norm
from flwr_pfl.training.seed import client_seed

NDArrays = list[np.ndarray]
Config = dict[str, bool | bytes | float | int | str]
Reply = TypeVar("Reply")

#: fit / evaluate config key of the round's learning rate (a strategy's ``on_fit_config_fn`` or
#: ``on_evaluate_config_fn`` sends it; the same name as the run-config key); Flower's ``lr``
#: is read too (:data:`flwr_pfl.messages.LEARNING_RATE_KEYS`)
LEARNING_RATE_KEY = LEARNING_RATE_KEYS[0]

#: ``get_properties`` query for the federation's size, and the answer's key
FEDERATION_QUERY = {"query": "federation-size"}
NUM_PARTITIONS = "num_partitions"
#: ``get_properties`` query for the wire layout, and the answer's key (see PFLClient.wire_layout)
WIRE_LAYOUT_QUERY = {"query": "wire-layout"}
WIRE_LAYOUT = "wire_layout"


def federation_answer(node_config: Mapping[str, Any]) -> Config:
    """The answer to :data:`FEDERATION_QUERY`: the node config's ``num-partitions``, the
    federation's size (0 when the node config does not say)."""
    return {NUM_PARTITIONS: int(node_config.get("num-partitions", 0))}


#: separates an algorithm's name from a wire array's name when the array is not a model tensor
EXTRA_SEPARATOR = ":"


def seeded_message(handler: Callable[..., Reply]) -> Callable[..., Reply]:
    """Run a client's ``fit`` or ``evaluate`` inside :func:`~flwr_pfl.training.seeded`, with the
    message's training settings (:meth:`PFLClient.message_settings`).

    Everything random that a message does (DataLoader shuffling, dropout, transforms) draws
    from torch's generator seeded by :meth:`PFLClient.round_seed`, and the generator's state
    is restored afterwards: a client's numbers depend on its seed, partition and round only,
    never on which client ran before it in the same process. Every client's ``fit`` and
    ``evaluate`` carries this decorator (a test checks each registered client).
    """

    @functools.wraps(handler)
    def run(self: PFLClient, parameters: NDArrays, config: Config) -> Reply:
        with self.message_settings(config), seeded(self.round_seed(config), self.device):
            return handler(self, parameters, config)

    run.seeded_message = True  # type: ignore[attr-defined]
    return run


@dataclass(frozen=True)
class TrainConfig:
    """Local training settings shared by every client.

    Attributes:
        local_epochs: passes over the local training set per round.
        batch_size: mini-batch size.
        optimizer: optimizer and learning rate.
        device: ``auto`` (CUDA when visible), ``cpu``, ``cuda`` or ``cuda:<i>``.
        seed: base seed; each client and round derives its own.
        frozen_norm: in a phase that trains part of the model (FedRep's head or body phase,
            FedDAR's head phase, FMTL's phase 2, pFedFDA's backbone), what the frozen part's
            BatchNorm-like modules do: ``"eval"`` (default: eval mode, their running statistics
            stay as they are) or ``"train"`` (train mode: the statistics move, as in the
            reference codes). Dropout stays active either way (:mod:`flwr_pfl.training.norms`).
        record_dp: train with DP-SGD (:mod:`flwr_pfl.training.dpsgd`; None: plain SGD). The
            algorithms whose client computes anything from its data other than gradient steps
            refuse it (``record_dp_refusal``).

    Raises:
        ValueError: ``frozen_norm`` is not ``"eval"`` or ``"train"``.
    """

    local_epochs: int = 1
    batch_size: int = 32
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    device: str = "auto"
    seed: int = 0
    frozen_norm: FrozenNorm = "eval"
    record_dp: RecordLevelDP | None = None

    def __post_init__(self) -> None:
        check_frozen_norm(self.frozen_norm)


def round_train_config(train_config: TrainConfig, config: Config, who: str = "") -> TrainConfig:
    """``train_config`` with the round's learning rate from ``config``, if it sends one.

    The rate is ``config["learning-rate"]`` (the suite's name) or ``config["lr"]`` (the name
    Flower's PyTorch examples use); when both are sent they must be equal.

    Raises:
        ConfigError: a value is not a number > 0, or the two names carry different values (the
            message names the client, the keys and the values).
    """
    owner = f"{who}: " if who else ""
    sent = {key: config[key] for key in LEARNING_RATE_KEYS if key in config}
    if not sent:
        return train_config
    for key, value in sent.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(
                f"{owner}the strategy sent {key}={value!r} in its config (on_fit_config_fn / on_evaluate_config_fn, "
                "or the Message API's train_config / evaluate_config); it must be a number > 0"
            )
    if len(set(float(v) for v in sent.values())) > 1:
        raise ConfigError(
            f"{owner}the strategy's config sets the learning rate twice with different values "
            f"({', '.join(f'{k}={v!r}' for k, v in sent.items())}); send one of {list(LEARNING_RATE_KEYS)}"
        )
    value = next(iter(sent.values()))
    return replace(train_config, optimizer=replace(train_config.optimizer, learning_rate=float(value)))


@dataclass(frozen=True)
class LocalData:
    """A client's data as DataLoaders of (x, y) or (x, y, domain) batches, or of dicts.

    ``train`` shuffles; ``test`` is the client's own test split (personalized methods are
    evaluated on it); ``val`` is optional (used by algorithms that tune on validation data).
    Dict batches (Hugging Face datasets, flwr-datasets partitions) are read with
    ``batch_keys``; the default reads flwr-datasets' image datasets (``img`` or ``image``,
    ``label`` or ``fine_label``, optional ``domain``).
    """

    train: DataLoader
    test: DataLoader
    val: DataLoader | None = None
    num_domains: int = 1
    task: Task = "classification"
    batch_keys: BatchKeys = field(default_factory=BatchKeys)

    @classmethod
    def from_client_data(cls, data: ClientData, batch_size: int) -> LocalData:
        """Loaders over a :class:`ClientData` (the suite's own datasets).

        The training loader shuffles with torch's global generator, which every message seeds
        (:func:`seeded_message`). An empty training split gets a plain loader (torch refuses to
        shuffle nothing) so that the client, which knows its partition id, reports it
        (:meth:`PFLClient.check_training_data`).
        """
        return cls(
            train=data.train.loader(batch_size, shuffle=len(data.train) > 0),
            test=data.test.loader(max(batch_size, 256), shuffle=False),
            val=data.val.loader(max(batch_size, 256), shuffle=False) if len(data.val) else None,
            num_domains=data.num_domains,
            task=data.task,
        )


class PFLClient(NumPyClient):
    """FedAvg's client, and the base of the others.

    Wire: ``fit``/``evaluate`` receive the ``shared_group`` arrays in ``state_dict`` order;
    ``fit`` returns the same group after local training with metrics ``partition_id``,
    ``train_loss``, ``train_seconds``; ``evaluate`` returns loss and accuracy on the local test
    split (and per-domain figures ``n_d<m>``, ``acc_d<m>``, ``loss_d<m>`` when there are domains).

    Args:
        context: the node's Flower Context (its ``state`` holds the personal part).
        model: the model, fresh (personal state is loaded into it here): the user's own
            ``torch.nn.Module`` with ``head`` naming its head, or a model already split into
            body and head(s) (:class:`~flwr_pfl.models.EncoderHeadModel`, or
            :func:`~flwr_pfl.models.split_model`'s :class:`~flwr_pfl.models.HeadSplit`).
        data: the client's loaders.
        train_config: local training settings.
        head: the head of a user's model: a module name (``"fc3"``), the module itself, a list
            of parameter-name prefixes or a predicate on parameter names (see
            :class:`~flwr_pfl.models.HeadSplit`). The head module and its weights are kept as
            they are. Algorithms that move the whole model (FedAvg, Local, fine-tuning,
            FedGP/FedDA) need none; the others say so, with the model's module names, when it
            is missing.

    Raises:
        ConfigError: the model lacks what the algorithm needs of its head
            (``head_requirement``), or there are no training samples.
    """

    #: parameter group exchanged with the server (None: nothing is exchanged)
    shared_group: str | None = "all"
    #: parameter group kept on the client across rounds (None: nothing is kept)
    personal_group: str | None = None
    #: what the algorithm needs of the model's head: "none", "parameters" (the parameter groups
    #: ``body`` / ``heads``) or "module" (``features()``, ``head_outputs()``, ``heads``)
    head_requirement: HeadRequirement = "none"
    PERSONAL_KEY = "personal"
    #: the client state record of the DP-SGD steps taken so far (record-level DP's accountant)
    RECORD_DP_KEY = "record-dp-steps"
    #: why record-level DP (DP-SGD) does not cover this algorithm's local computation; "": it does
    #: (every use of the data is a step of the shared train loop, through :meth:`train_groups`,
    #: between :meth:`start_private_steps` and :meth:`finish_private_steps`, and what is uploaded
    #: is computed from the trained model alone); None (default): it does unless the class
    #: overrides ``fit``, which must then say "" here to be covered
    record_dp_refusal: ClassVar[str | None] = None

    def __init__(
        self,
        context: Context,
        model: nn.Module,
        data: LocalData,
        train_config: TrainConfig | None = None,
        *,
        head: HeadSpec | None = None,
    ) -> None:
        self.context = context
        self.model = client_model(model, head, num_heads=self.heads_for(data))
        check_head(self.model, self.head_requirement, type(self).__name__)
        self.data = data
        self.train_config = train_config or TrainConfig()
        self.device = resolve_device(self.train_config.device)
        self.partition_id = int(context.node_config.get("partition-id", -1))
        self.check_training_data()
        #: this message's DP-SGD (set by :meth:`fit` when ``record_dp`` is on)
        self.private_steps: PrivateSteps | None = None
        if self.train_config.record_dp is not None:
            self.check_record_dp()
        if self.personal_group is not None:
            personal = load_arrays(context.state, self.PERSONAL_KEY)
            if personal is not None:
                set_arrays(self.model, personal, self.personal_group)

    @classmethod
    def heads_for(cls, data: LocalData) -> int:
        """Heads the algorithm builds from a user's named head (copies of it): 1 by default."""
        return 1

    def check_training_data(self) -> None:
        """Refuse an empty training set here, once for every algorithm, with a message naming
        the partition (each algorithm would otherwise fail later with an unrelated error, or
        silently report zero examples), and a dataset without a length (:func:`num_samples`)."""
        if num_samples(self.data.train) == 0:
            raise no_training_samples(self.who, " (its training loader is empty)")

    # ---------------------------------------------------------------- wire
    def get_properties(self, config: Config) -> Config:
        """The partition id, by which the strategy samples and orders clients
        (:mod:`flwr_pfl.strategies.sampling`); asked with :data:`FEDERATION_QUERY`, also the
        federation's size (:func:`federation_answer`), and with :data:`WIRE_LAYOUT_QUERY`,
        :meth:`wire_layout` as JSON (key :data:`WIRE_LAYOUT`)."""
        properties: Config = {"partition_id": self.partition_id}
        if config.get("query") == FEDERATION_QUERY["query"]:
            properties |= federation_answer(self.context.node_config)
        elif config.get("query") == WIRE_LAYOUT_QUERY["query"]:
            properties[WIRE_LAYOUT] = json.dumps(self.wire_layout())
        return properties

    def get_parameters(self, config: Config) -> NDArrays:
        return [] if self.shared_group is None else get_arrays(self.model, self.shared_group)

    def wire_names(self) -> list[str]:
        """The names of the arrays :meth:`get_parameters` returns (the global arrays' layout), in
        order: the model's ``state_dict`` keys of ``shared_group``. An array that is not a model
        tensor is named ``<algorithm>:<what>`` (:data:`EXTRA_SEPARATOR`)."""
        return [] if self.shared_group is None else group_keys(self.model, self.shared_group)

    def user_wire_names(self) -> list[str]:
        """:meth:`wire_names` as the user's own model names its tensors (a model given with
        ``head=`` is wrapped, and its keys gain a ``module.`` prefix inside the client): the names
        the Message-API flavour puts on the arrays it sends (:mod:`flwr_pfl.clientapp`)."""
        return user_keys(self.model, self.wire_names())

    def wire_layout(self) -> list[tuple[str, list[int]]]:
        """``(name, shape)`` of every array :meth:`get_parameters` returns: how the server names
        the final global arrays when it exports them (:mod:`flwr_pfl.app.export`).

        Raises:
            ValueError: :meth:`wire_names` and :meth:`get_parameters` disagree in length.
        """
        names, arrays = self.wire_names(), self.get_parameters({})
        if len(names) != len(arrays):
            raise ValueError(f"{type(self).__name__} names {len(names)} wire arrays but sends {len(arrays)}")
        return [(name, list(array.shape)) for name, array in zip(names, arrays)]

    def personal_state(self) -> dict[str, torch.Tensor]:
        """This client's own part of its personalized model as the last message left it, by
        ``state_dict`` name (CPU copies); empty when nothing is personal. Default: the
        ``personal_group`` (the part kept in ``context.state``)."""
        return {} if self.personal_group is None else self.group_state(self.personal_group)

    def group_state(self, group: str) -> dict[str, torch.Tensor]:
        """CPU copies of the model's tensors in ``group``, by ``state_dict`` name."""
        state = self.model.state_dict()
        return {key: state[key].detach().cpu().clone() for key in group_keys(self.model, group)}

    def receive(self, parameters: NDArrays) -> None:
        """Load the server's arrays into the shared group (the personal part stays)."""
        if self.shared_group is not None:
            set_arrays(self.model, parameters, self.shared_group)

    def keep_personal(self) -> None:
        """Store the personal group in ``context.state`` for the next round."""
        if self.personal_group is not None:
            save_arrays(self.context.state, self.PERSONAL_KEY, get_arrays(self.model, self.personal_group))

    # ---------------------------------------------------------------- hooks
    @contextmanager
    def message_settings(self, config: Config) -> Iterator[TrainConfig]:
        """``train_config`` for the duration of one message: the client's own settings with the
        learning rate replaced by the config's ``learning-rate`` (or Flower's ``lr``) when the
        strategy sends one (a per-round schedule from ``on_fit_config_fn``). Everything that
        trains in the message reads ``train_config`` (phases scale it further, e.g. FedDAR's
        ``lr-scale``); the client's own settings are restored afterwards."""
        own = self.train_config
        self.train_config = round_train_config(own, config, self.who)
        try:
            yield self.train_config
        finally:
            self.train_config = own

    def round_seed(self, config: Config) -> int:
        return client_seed(self.train_config.seed, self.partition_id, int(config.get("server-round", 0)))

    @property
    def who(self) -> str:
        """This client as errors name it: ``partition <id>`` (``partition ?`` when unknown)."""
        return f"partition {self.partition_id}" if self.partition_id >= 0 else "partition ?"

    @classmethod
    def record_dp_reason(cls) -> str:
        """Why record-level DP does not apply to this client ("" where it does)."""
        if cls.record_dp_refusal is not None:
            return cls.record_dp_refusal
        if cls.fit is not PFLClient.fit:
            return f"{cls.__name__} trains or uploads by its own rule (it overrides fit), not only through DP-SGD steps"
        return ""

    def check_record_dp(self) -> None:
        """ConfigError when record-level DP cannot hold here: the algorithm, the model
        (BatchNorm) or a delta not below ``1 / n``."""
        reason = self.record_dp_reason()
        if reason:
            raise ConfigError(f"{self.who}: record-level DP (dp-record-noise-multiplier) cannot be used: {reason}")
        check_dp_model(self.model, self.who)
        records = num_samples(self.data.train)
        settings = self.train_config.record_dp
        if settings is not None and not settings.delta < 1 / records:
            raise ConfigError(f"{self.who}: dp-record-delta={settings.delta} is not below 1/n = {1 / records:.3g} for its "
                              f"{records} training records; a delta that large allows releasing a record outright")

    def start_private_steps(self, config: Config, batch_size: int | None = None) -> None:
        """With record-level DP on, this message's DP-SGD: Poisson batches of expected size
        ``batch_size`` (default the client's ``batch_size``) from the training split, seeded by
        the message's seed when ``dp-record-noise-seed`` is set; every :meth:`train_groups` until
        :meth:`finish_private_steps` takes DP-SGD steps."""
        if self.train_config.record_dp is not None:
            self.private_steps = PrivateSteps(self.train_config.record_dp, num_samples(self.data.train),
                                              batch_size or self.train_config.batch_size, self.round_seed(config))

    def finish_private_steps(self) -> dict[str, float]:
        """End this message's DP-SGD; the privacy spent so far (:meth:`record_dp_metrics`)."""
        metrics = self.record_dp_metrics()
        self.private_steps = None
        return metrics

    def record_dp_metrics(self) -> dict[str, float]:
        """Account this message's DP-SGD steps in the client's state and return the epsilon the
        client has spent over the run so far (``dp_record_epsilon`` at ``dp_record_delta``)."""
        steps, settings = self.private_steps, self.train_config.record_dp
        if steps is None or settings is None:
            return {}
        account = StepAccount.from_scalars(load_scalars(self.context.state, self.RECORD_DP_KEY))
        account.add(steps.rate, settings.noise_multiplier, steps.steps)
        save_scalars(self.context.state, self.RECORD_DP_KEY, account.to_scalars())
        return {"dp_record_epsilon": account.epsilon(settings.delta), "dp_record_delta": settings.delta,
                "dp_record_steps": float(steps.steps)}

    def train_groups(self, groups: tuple[str, ...], epochs: int, **kwargs) -> TrainStats:
        """Run the shared train loop on ``groups`` with this client's settings (its optimizer and
        its ``frozen_norm`` unless ``kwargs`` say otherwise; DP-SGD when ``record_dp`` is on)."""
        return train(
            self.model,
            self.data.train,
            optimizer=kwargs.pop("optimizer", self.train_config.optimizer),
            device=self.device,
            epochs=epochs,
            groups=groups,
            task=self.data.task,
            who=kwargs.pop("who", self.who),
            keys=self.data.batch_keys,
            frozen_norm=kwargs.pop("frozen_norm", self.train_config.frozen_norm),
            private=self.private_steps,
            **kwargs,
        )

    def local_update(self, config: Config) -> dict[str, float]:
        """One round of local training; returns metrics. Default: all parameters, E epochs."""
        stats = self.train_groups(("all",), self.train_config.local_epochs)
        return {"train_loss": stats.loss, "train_seconds": stats.seconds}

    def local_evaluate(self, config: Config) -> EvalResult:
        """Evaluate the model as this algorithm defines it (default: as it stands)."""
        return self.evaluate_on(self.data.test)

    def evaluate_on(self, loader: DataLoader) -> EvalResult:
        return evaluate(self.model, loader, device=self.device, task=self.data.task,
                        num_domains=self.data.num_domains, keys=self.data.batch_keys)

    # ---------------------------------------------------------------- NumPyClient
    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        self.receive(parameters)
        self.start_private_steps(config)
        metrics = self.local_update(config)
        metrics |= self.finish_private_steps()
        self.keep_personal()
        num_examples = num_samples(self.data.train)
        return self.fit_reply(config), num_examples, {**metrics, "partition_id": self.partition_id}

    def fit_reply(self, config: Config) -> NDArrays:
        """The arrays a fit reply carries (default: the shared group, :meth:`get_parameters`)."""
        return self.get_parameters(config)

    @seeded_message
    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        self.receive(parameters)
        result = self.local_evaluate(config)
        return result.loss, result.num_examples, {**result.metrics(), "partition_id": self.partition_id}
