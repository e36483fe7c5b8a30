"""The run configuration, parsed and validated once at the app boundary (DESIGN principle 7).

``parse_experiment(context.run_config)`` turns Flower's flat run-config dict into typed
dataclasses, or stops with a :class:`ConfigError` that names the key and the allowed values,
before any training starts. Every key has a default here, so the Python API (where
``run_config`` may be empty) and ``flwr run`` (where pyproject.toml supplies the defaults)
behave the same; a test keeps pyproject.toml and these defaults in step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from flwr_pfl.app.keys import check_choice, flat_dict, keys_of, parse_options, parse_section, with_suggestions
from flwr_pfl.app.appdir import SIMULATED_CLIENTS  # noqa: F401 - read from here by the tools
from flwr_pfl.app.registry import ALGORITHMS, get_algorithm
from flwr_pfl.app.secagg import SECURE_AGGREGATIONS, SecureAggregation
from flwr_pfl.app.signing import read_key
from flwr_pfl.app.tracking import parse_tracking
from flwr_pfl.clients.base import TrainConfig
from flwr_pfl.core.robust import DEFAULT_OUTLIER_RATIO
from flwr_pfl.data.config import DataConfig
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.base import AGGREGATES
from flwr_pfl.strategies.privacy import ClientLevelDP
from flwr_pfl.training.dpsgd import RecordLevelDP
from flwr_pfl.models import MODEL_NAMES, RUNNING_STAT_MODELS
from flwr_pfl.training.norms import FROZEN_NORMS
from flwr_pfl.training.optim import OptimizerConfig



#: the values of the run-config key ``api``: the Flower API the server and clients talk through
APIS = ("numpyclient", "message")


@dataclass(frozen=True)
class RunConfig:
    """Settings common to every algorithm (run-config keys in kebab-case).

    Attributes:
        algorithm: a registered algorithm name (see ``flwr_pfl.app.registry``).
        num_server_rounds: communication rounds.
        num_clients: clients in the federation; 0 (the default) means the federation's size:
            each client takes ``num-partitions`` from its node config and the server asks a
            connected node for it. A value > 0 must equal the federation's size (in simulation
            ``num-supernodes``); clients refuse a federation of another size.
        fraction_fit / fraction_evaluate: fraction of clients sampled per round.
        local_epochs, batch_size, optimizer, learning_rate, momentum, weight_decay: local training.
            ``optimizer`` is any ``torch.optim`` optimizer name, any case (sgd, adam, adamw,
            rmsprop, ...); momentum reaches the optimizers that take one (sgd, rmsprop).
        optimizer_options: further keyword arguments of the optimizer, written as in Python
            (``"betas=(0.9, 0.99), eps=1e-8"``; :func:`~flwr_pfl.app.keys.parse_options`).
        lr_scheduler: a ``torch.optim.lr_scheduler`` name, any case (steplr, onecyclelr, ...;
            empty: none), stepped after every optimizer step and restarted every round
            (:mod:`flwr_pfl.training.optim`); lr_scheduler_options: its keyword arguments.
        model: an encoder + heads model name; feature_dim its representation width (0 = default).
        frozen_norm: in a phase that trains part of the model (FedRep's head and body phases,
            FedDAR's head phase, FMTL's phase 2, pFedFDA's backbone), what the frozen part's
            BatchNorm layers (any normalisation with running statistics) do: ``eval`` (eval
            mode: their statistics stay as they are, so a frozen part is frozen) or ``train``
            (train mode: their statistics move, as in the papers' reference codes). Dropout
            stays active either way. No model of :data:`~flwr_pfl.models.MODEL_NAMES` but
            ``resnet18`` has such layers (:mod:`flwr_pfl.training.norms`).
        seed: seeds sampling, initialisation, partitions and shuffling.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:<i>``.
        num_threads: torch CPU threads per client and for the server's tensor work (0 = torch's
            default); results are bit-identical across engines only at the same count.
        output_dir: where runs are written (``~`` expanded; made absolute).
        run_name: sub-directory of the run (one path component: no separator, not ``.`` or
            ``..``); empty = ``<algorithm>-<dataset>-<timestamp>``. A directory that already
            holds a run is not overwritten: resume it or choose another name.
        wait_timeout: seconds the server waits for ``min_clients`` connected clients before each
            sampling (then gives up with an error naming the numbers).
        min_clients: the least connected clients a round goes on with; 0 = ``num_clients`` (the
            whole federation: a run starts only when every partition is there and rounds wait
            for a node that left, which keeps simulation runs repeatable). Lower it on a fleet
            whose nodes come and go: rounds then sample among the nodes that are connected.
        round_timeout: seconds a client has to answer one exchange of a round (fit, evaluate and
            the algorithms' own exchanges); a client that has not answered by then is dropped
            from that round and logged, and the round goes on with the replies in hand.
            0 = no limit (a hung client blocks the round).
        server_workers: clients the server contacts at once (the threads of Flower's legacy
            server loop and of the strategies' own exchanges); 0 = the app's choice (up to 32;
            one on the in-process grid).
        resume: continue the run in ``output_dir/run_name`` from its ``checkpoint.npz``
            (server state; client state lives on the clients); false starts afresh. The
            configuration must equal the checkpoint's except ``num_server_rounds`` (which may
            grow) and ``checkpoint_interval``.
        checkpoint_interval: write ``checkpoint.npz`` after every this many rounds, and always
            after the last one.
        checkpoint_key_file: a file on the server's host holding a secret key (16 bytes or
            more): checkpoints are signed with it (HMAC-SHA256) and a resume refuses one without
            its valid signature (:mod:`flwr_pfl.app.signing`); "" = unsigned. Read by the
            ServerApp only, so the launcher's host need not have it.
        api: which Flower API the server drives the algorithm through: ``numpyclient`` (the
            legacy Strategy loop and NumPyClients) or ``message`` (the Message-API strategy of
            :mod:`flwr_pfl.serverapp` and the ClientApp's ``train``/``evaluate``/``query``
            handlers). Both run the same round logic and give the same numbers.
        fail_on_no_training: a run that trained nothing ends with status ``failed`` (its
            results written, then an error: ``flwr run`` lists it as failed, the launcher and
            ``compare`` exit non-zero): a round in which every client asked to train failed or
            was rejected, or a training that diverged and left the final accuracy at chance
            (:func:`~flwr_pfl.app.results.judge_run`). False records such a run as
            ``completed``, with a warning in its summary.
        clip_update_norm: > 0 scales each client's update (its reply minus the global arrays
            it was sent) to at most this L2 norm before aggregation; 0 = off.
        max_examples: > 0 rejects a fit reply that claims more examples than this; 0 = off.
        aggregate: ``mean`` (example-weighted, the papers') or ``trimmed-mean`` (coordinate-wise,
            unweighted, without the ``trim_fraction`` largest and smallest values).
        trim_fraction: share trimmed at each end by ``trimmed-mean``, in [0, 0.5).
        outlier_norm_ratio: on by default for every algorithm: a fit reply whose norm exceeds
            this many times the round's median reply norm is rejected, and an aggregate that is
            non-finite or grew by more than this factor in one round ends the run failed
            (:func:`~flwr_pfl.core.robust.magnitude_outliers`); it never changes an honest
            run's numbers. 0 = off; otherwise > 1.
        eval_every: the clients evaluate every this many rounds and after the last one; 0 =
            after the last one only; 1 = every round (:class:`~flwr_pfl.strategies.base.PFLStrategy`).
            FEDORA's and pFedFDA's own ``fedora.eval-every`` / ``pfedfda.eval-every`` mean the
            same; set one of the two (or both to the same value).
        dp_noise_multiplier: > 0 turns on client-level differential privacy of the aggregate
            (:mod:`flwr_pfl.strategies.privacy`): each client's update is clipped to
            ``dp_clip_norm``, the clipped updates are averaged uniformly over the clients
            sampled, and Gaussian noise of standard deviation ``z C / m`` is added; the epsilon
            spent (at ``dp_delta``) is recorded every round. For the algorithms whose aggregate
            is a mean of the shared arrays; the others refuse it. 0 = off.
        dp_clip_norm: the clipping norm ``C`` (the initial one with ``dp_adaptive_clipping``).
        dp_adaptive_clipping: move ``C`` towards the ``dp_target_quantile`` of the update
            norms (Andrew et al. 2021), at ``dp_clip_learning_rate``, with the count of
            unclipped updates noised by ``dp_count_stddev`` (0 = m / 20).
        dp_delta: the delta at which epsilon is reported, in (0, 1/num-clients).
        dp_max_epsilon: > 0: refuse, before training, a run that would spend more; 0 = no limit.
        dp_noise_seed: -1 (default): secret noise from the operating system; a seed >= 0 makes
            the noise repeatable and, to whoever knows the seed, removable (not private). Also
            seeds DP-SGD's sampling and noise.
        dp_record_noise_multiplier: > 0 trains every client with DP-SGD (record-level DP,
            :mod:`flwr_pfl.training.dpsgd`): Poisson batches, each record's gradient clipped
            to ``dp_record_clip_norm``, Gaussian noise; each client reports the epsilon it has
            spent at ``dp_record_delta`` (``dp_record_epsilon``). Algorithms whose clients
            compute anything else from their data refuse it. 0 = off.
        secure_aggregation: ``secagg+`` sums the fit replies with Flower's SecAgg+ protocol, so
            that the server sees only their example-weighted mean (:mod:`flwr_pfl.app.secagg`;
            ``api = "numpyclient"``, the algorithms whose aggregate is that mean); ``off``
            (default) sends each reply in the clear. ``secagg_num_shares``,
            ``secagg_threshold``, ``secagg_clipping_range``, ``secagg_quantization_range`` and
            ``secagg_max_weight`` are the protocol's settings
            (:class:`~flwr_pfl.app.secagg.SecureAggregation`).
        tracking: experiment-tracking backends, comma-separated: ``tensorboard`` (event files
            under ``<run>/tensorboard``), ``wandb`` (a Weights & Biases run under ``<run>/wandb``,
            offline unless ``WANDB_MODE`` or ``WANDB_API_KEY`` says online), ``mlflow`` (``MLFLOW_TRACKING_URI``, default a local
            store ``<run>/mlflow.db``); "" = none (:mod:`flwr_pfl.app.tracking`). Needs the
            ``tracking`` extra on the server's host.

    ``clip_update_norm``, ``max_examples``, ``aggregate``, ``trim_fraction`` and
    ``outlier_norm_ratio`` bound what one bad client can do
    (:class:`~flwr_pfl.strategies.base.PFLStrategy`); clipping and trimmed-mean apply to FedAvg,
    finetune, FedRep and FedPer only.
    """

    algorithm: str = "fedavg"
    num_server_rounds: int = 5
    num_clients: int = 0
    fraction_fit: float = 1.0
    fraction_evaluate: float = 1.0
    local_epochs: int = 1
    batch_size: int = 32
    optimizer: str = "sgd"
    learning_rate: float = 0.05
    momentum: float = 0.5
    weight_decay: float = 0.0
    optimizer_options: str = ""
    lr_scheduler: str = ""
    lr_scheduler_options: str = ""
    model: str = "cnn28"
    feature_dim: int = 0
    frozen_norm: str = "eval"
    seed: int = 0
    device: str = "auto"
    num_threads: int = 1
    output_dir: str = "~/flwr_pfl_outputs"
    run_name: str = ""
    wait_timeout: float = 600.0
    min_clients: int = 0
    round_timeout: float = 0.0
    server_workers: int = 0
    resume: bool = False
    checkpoint_interval: int = 1
    checkpoint_key_file: str = ""
    clip_update_norm: float = 0.0
    max_examples: int = 0
    aggregate: str = "mean"
    trim_fraction: float = 0.1
    outlier_norm_ratio: float = DEFAULT_OUTLIER_RATIO
    dp_noise_multiplier: float = 0.0
    dp_clip_norm: float = 1.0
    dp_adaptive_clipping: bool = False
    dp_target_quantile: float = 0.5
    dp_clip_learning_rate: float = 0.2
    dp_count_stddev: float = 0.0
    dp_delta: float = 1e-5
    dp_max_epsilon: float = 0.0
    dp_noise_seed: int = -1
    dp_record_noise_multiplier: float = 0.0
    dp_record_clip_norm: float = 1.0
    dp_record_delta: float = 1e-5
    secure_aggregation: str = "off"
    secagg_num_shares: float = 1.0
    secagg_threshold: float = 0.5
    secagg_clipping_range: float = 8.0
    secagg_quantization_range: int = 1 << 22
    secagg_max_weight: float = 1000.0
    tracking: str = ""
    eval_every: int = 1
    api: str = "numpyclient"
    fail_on_no_training: bool = True

    def __post_init__(self) -> None:
        get_algorithm(self.algorithm)
        for key, value, low in (
            ("num-server-rounds", self.num_server_rounds, 1),
            ("num-clients", self.num_clients, 0),
            ("local-epochs", self.local_epochs, 0),
            ("batch-size", self.batch_size, 1),
            ("feature-dim", self.feature_dim, 0),
            ("num-threads", self.num_threads, 0),
            ("checkpoint-interval", self.checkpoint_interval, 1),
            ("server-workers", self.server_workers, 0),
            ("eval-every", self.eval_every, 0),
        ):
            if value < low:
                raise ConfigError(f"{key}={value} is out of range; must be >= {low}")
        for key, value in (("fraction-fit", self.fraction_fit), ("fraction-evaluate", self.fraction_evaluate)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{key}={value} is out of range; must be in [0, 1]")
        if self.num_clients and self.fraction_fit * self.num_clients < 1 and self.fraction_fit > 0:
            raise ConfigError(
                f"fraction-fit={self.fraction_fit} samples no client out of num-clients={self.num_clients}"
            )
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"model={self.model!r} is unknown; allowed: {', '.join(MODEL_NAMES)}")
        if self.wait_timeout <= 0:
            raise ConfigError(f"wait-timeout={self.wait_timeout} must be > 0 seconds")
        # with num-clients = 0 (the federation's size, resolved at the run's start) the bound
        # is checked again once the size is known (with_num_clients)
        if self.min_clients < 0 or (self.num_clients and self.min_clients > self.num_clients):
            raise ConfigError(
                f"min-clients={self.min_clients} is out of range; must be in [0, num-clients={self.num_clients}] "
                "(0 = num-clients: wait for the whole federation)"
            )
        if self.round_timeout < 0:
            raise ConfigError(f"round-timeout={self.round_timeout} must be >= 0 seconds (0 = no limit)")
        if not self.output_dir:
            raise ConfigError("output-dir must not be empty")
        check_run_name(self.run_name)
        check_choice("api", self.api, APIS)
        self.secagg  # validates the secure-aggregation keys
        check_choice("frozen-norm", self.frozen_norm, FROZEN_NORMS)
        if self.resume and not self.run_name:
            raise ConfigError("resume=true needs run-name: the name of the run to continue under output-dir")
        self.optimizer_config()  # validates the optimizer and scheduler keys
        if self.clip_update_norm < 0:
            raise ConfigError(f"clip-update-norm={self.clip_update_norm} must be > 0, or 0 (off)")
        if self.max_examples < 0:
            raise ConfigError(f"max-examples={self.max_examples} must be >= 1, or 0 (off)")
        check_choice("aggregate", self.aggregate, AGGREGATES)
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"trim-fraction={self.trim_fraction} is out of range; must be in [0, 0.5)")
        parse_tracking(self.tracking, check_installed=False)
        if self.outlier_norm_ratio != 0 and not self.outlier_norm_ratio > 1:
            raise ConfigError(f"outlier-norm-ratio={self.outlier_norm_ratio} is out of range; must be > 1, or 0 (off)")

    @property
    def reply_bounds(self) -> dict[str, Any]:
        """The strategy's arguments for the reply bounds (None where off)."""
        return {
            "clip_update_norm": self.clip_update_norm or None,
            "max_examples": self.max_examples or None,
            "aggregate": self.aggregate,
            "trim_fraction": self.trim_fraction,
            "outlier_norm_ratio": self.outlier_norm_ratio or None,
            "client_dp": self.client_dp,
            "secure_aggregation": self.secure_aggregation != "off",
        }

    @property
    def client_dp(self) -> ClientLevelDP | None:
        """The ``dp-*`` keys as client-level DP settings; None when ``dp-noise-multiplier`` is 0
        and no other ``dp-*`` key is set (a ``dp-*`` key without a noise multiplier is refused:
        it would look private and is not)."""
        self._check_dp_keys()
        if self.dp_noise_multiplier == 0:
            return None
        return ClientLevelDP(
            noise_multiplier=self.dp_noise_multiplier,
            clip_norm=self.dp_clip_norm,
            adaptive=self.dp_adaptive_clipping,
            target_quantile=self.dp_target_quantile,
            clip_learning_rate=self.dp_clip_learning_rate,
            count_stddev=self.dp_count_stddev or None,
            delta=self.dp_delta,
            max_epsilon=self.dp_max_epsilon or None,
            noise_seed=None if self.dp_noise_seed == -1 else self.dp_noise_seed,
        )

    @property
    def secagg(self) -> SecureAggregation | None:
        """The ``secagg-*`` keys as SecAgg+ settings; None when ``secure-aggregation = "off"``
        (a ``secagg-*`` key set then is refused: it would look secure and is not)."""
        check_choice("secure-aggregation", self.secure_aggregation, SECURE_AGGREGATIONS)
        defaults = RunConfig.__dataclass_fields__
        changed = sorted(f"{name.replace('_', '-')}={getattr(self, name)}" for name in defaults
                         if name.startswith("secagg_") and getattr(self, name) != defaults[name].default)
        if self.secure_aggregation == "off":
            if changed:
                raise ConfigError(f"{', '.join(changed)} set with secure-aggregation='off': the replies would be sent "
                                  "in the clear; set secure-aggregation='secagg+', or drop those keys")
            return None
        if self.api != "numpyclient":
            raise ConfigError(f"secure-aggregation={self.secure_aggregation!r} needs api='numpyclient': Flower's SecAgg+ "
                              f"runs on its legacy workflow only, not api={self.api!r}")
        return SecureAggregation(num_shares=self.secagg_num_shares, threshold=self.secagg_threshold,
                                 clipping_range=self.secagg_clipping_range,
                                 quantization_range=self.secagg_quantization_range, max_weight=self.secagg_max_weight)

    @property
    def record_dp(self) -> RecordLevelDP | None:
        """The ``dp-record-*`` keys as DP-SGD settings; None when ``dp-record-noise-multiplier`` is 0."""
        self._check_dp_keys()
        if self.dp_record_noise_multiplier == 0:
            return None
        return RecordLevelDP(noise_multiplier=self.dp_record_noise_multiplier, clip_norm=self.dp_record_clip_norm,
                             delta=self.dp_record_delta,
                             noise_seed=None if self.dp_noise_seed == -1 else self.dp_noise_seed)

    def _check_dp_keys(self) -> None:
        """ConfigError for a ``dp-*`` key set while its noise multiplier is 0 (it would look
        private and is not), and for a bad ``dp-noise-seed``."""
        defaults = RunConfig.__dataclass_fields__

        def changed(prefix: str, multiplier: str) -> list[str]:
            return sorted(f"{name.replace('_', '-')}={getattr(self, name)}" for name in defaults
                          if name.startswith(prefix) and name not in (multiplier, "dp_noise_seed")
                          and not (prefix == "dp_" and name.startswith("dp_record_"))
                          and getattr(self, name) != defaults[name].default)

        for prefix, multiplier, value in (("dp_", "dp_noise_multiplier", self.dp_noise_multiplier),
                                          ("dp_record_", "dp_record_noise_multiplier", self.dp_record_noise_multiplier)):
            keys = changed(prefix, multiplier)
            if value == 0 and keys:
                key = multiplier.replace("_", "-")
                raise ConfigError(f"{', '.join(keys)} set with {key}=0: without noise there is no differential privacy; "
                                  f"set {key} > 0 (e.g. 1.0), or drop those keys")
        if self.dp_noise_seed < -1:
            raise ConfigError(f"dp-noise-seed={self.dp_noise_seed}: -1 (secret noise, the default) or a seed >= 0")
        if self.dp_noise_seed != -1 and self.dp_noise_multiplier == 0 and self.dp_record_noise_multiplier == 0:
            raise ConfigError(f"dp-noise-seed={self.dp_noise_seed} set without differential privacy: set "
                              "dp-noise-multiplier or dp-record-noise-multiplier > 0, or drop it")

    def checkpoint_key(self) -> bytes | None:
        """The key of ``checkpoint-key-file`` (None: unset; ConfigError: unreadable or short)."""
        return read_key(self.checkpoint_key_file, "checkpoint-key-file")

    @property
    def min_available_clients(self) -> int:
        """``min-clients`` resolved: the least connected clients a round goes on with."""
        return self.min_clients or self.num_clients

    @property
    def round_timeout_seconds(self) -> float | None:
        """``round-timeout`` as Flower takes it: seconds, or None for no limit."""
        return self.round_timeout or None

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(
            self.optimizer,
            self.learning_rate,
            self.momentum,
            self.weight_decay,
            options=parse_options("optimizer-options", self.optimizer_options),
            scheduler=self.lr_scheduler,
            scheduler_options=parse_options("lr-scheduler-options", self.lr_scheduler_options),
        )

    def output_root(self) -> Path:
        """``output-dir`` with ``~`` expanded, absolute: the parent of every run's directory."""
        return Path(os.path.expanduser(self.output_dir)).resolve()


def check_run_name(name: str) -> None:
    """ConfigError unless ``name`` is empty or one plain path component, so that a run is
    always written inside ``output-dir``."""
    if not name:
        return
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if name in (".", "..") or any(s in name for s in separators) or "\0" in name or os.path.isabs(name):
        raise ConfigError(
            f"run-name={name!r} must be a plain directory name inside output-dir (no path separators, "
            "not '.' or '..', not absolute); to write elsewhere, set output-dir"
        )


@dataclass(frozen=True)
class Experiment:
    """A validated run: common settings, data settings and the algorithm's own options."""

    run: RunConfig
    data: DataConfig
    options: Any

    def __post_init__(self) -> None:
        self.check_record_dp()
        own = getattr(self.options, "eval_every", 1)
        if own != 1 and self.run.eval_every != 1 and own != self.run.eval_every:
            raise ConfigError(
                f"eval-every={self.run.eval_every} and {self.algorithm.section}eval-every={own} disagree: they set the "
                "same evaluation schedule; set one of them"
            )

    def check_record_dp(self) -> None:
        """ConfigError, before training, when record-level DP is asked of an algorithm or a model
        it cannot cover (the clients would otherwise refuse it one by one)."""
        if self.run.record_dp is None:
            return
        reason = self.algorithm.client.record_dp_reason()
        if reason:
            raise ConfigError(f"{self.run.algorithm}: record-level DP (dp-record-noise-multiplier) cannot be used: {reason}")
        if self.run.model in RUNNING_STAT_MODELS:
            raise ConfigError(f"model={self.run.model!r} has BatchNorm, which record-level DP (DP-SGD) cannot train: a "
                              "record's output depends on its batch and the running statistics would leave unnoised; "
                              f"use one of {', '.join(m for m in MODEL_NAMES if m not in RUNNING_STAT_MODELS)}")

    @property
    def eval_every(self) -> int:
        """The evaluation schedule: ``eval-every``, or the algorithm's own key where that one is set."""
        own = getattr(self.options, "eval_every", 1)
        return own if own != 1 else self.run.eval_every

    @property
    def algorithm(self):
        return get_algorithm(self.run.algorithm)

    def with_num_clients(self, num_clients: int) -> Experiment:
        """This experiment on a federation of ``num_clients`` (``num-clients = 0`` resolved),
        validated again (e.g. ``fraction-fit`` must sample at least one of them)."""
        return replace(self, run=replace(self.run, num_clients=num_clients))

    @property
    def train_config(self) -> TrainConfig:
        return TrainConfig(
            local_epochs=self.run.local_epochs,
            batch_size=self.run.batch_size,
            optimizer=self.run.optimizer_config(),
            device=self.run.device,
            seed=self.run.seed,
            frozen_norm=self.run.frozen_norm,  # type: ignore[arg-type]  # checked in RunConfig
            record_dp=self.run.record_dp,
        )

    def output_path(self) -> Path:
        """Absolute directory of this run's results."""
        name = self.run.run_name or (
            f"{self.run.algorithm}-{self.data.dataset}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        )
        return self.run.output_root() / name

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as flat run-config keys (written with every run)."""
        out = flat_dict(self.run) | flat_dict(self.data)
        return out | flat_dict(self.options, self.algorithm.section)


def known_keys() -> set[str]:
    """Every run-config key the app understands."""
    keys = set(keys_of(RunConfig)) | set(keys_of(DataConfig))
    for spec in ALGORITHMS.values():
        keys |= set(keys_of(spec.options, spec.section))
    return keys


def parse_experiment(raw: Mapping[str, Any]) -> Experiment:
    """Validate Flower's run_config and build the :class:`Experiment`.

    Raises:
        ConfigError: an unknown key (with the closest known keys) or a bad value (naming the
            key, the value and what is allowed).
    """
    known = known_keys()
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"unknown run-config key(s): {with_suggestions(unknown, known)}. Known keys: {', '.join(sorted(known))}"
        )
    run = parse_section(RunConfig, raw)
    data = parse_section(DataConfig, raw)
    # Every algorithm's options are checked, not only the chosen one's: a preset that sets
    # another algorithm's option wrongly fails now rather than when someone switches to it.
    options = {name: parse_section(spec.options, raw, spec.section) for name, spec in ALGORITHMS.items()}
    return Experiment(run=run, data=data, options=options[run.algorithm])
