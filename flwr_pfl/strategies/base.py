"""The base of every strategy in the suite: sampling, reply checks, metrics, results, state.

Subclasses say what the wire carries and how to combine it, by overriding
:meth:`PFLStrategy.expected_shapes`, :meth:`PFLStrategy.aggregate_replies` and, for per-client
payloads, :meth:`PFLStrategy.fit_instructions`. Everything else (waiting for clients, rejecting
bad replies, summarising metrics, recording results, checkpoint state, and Flower's FedAvg
hooks: per-round configs, server-side evaluation, metric aggregation, failure policy) is written
once here; subclasses pass ``**kwargs`` through and build their instructions' configs with
:meth:`PFLStrategy.fit_config` / :meth:`PFLStrategy.evaluate_config`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import time
from dataclasses import replace
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    Parameters,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.metrics import ONE_CLASS, aggregate_client_metrics
from flwr_pfl.core.robust import (
    DEFAULT_OUTLIER_RATIO,
    aggregate_blowup,
    clip_update,
    magnitude_outliers,
    reply_norm,
    trimmed_mean,
    update_norm,
    upper_median,
)
from flwr_pfl.errors import ConfigError, DivergedError, NoTrainingError, NumRoundsRequired, ReplyError
from flwr_pfl.strategies import hooks
from flwr_pfl.strategies.decode import decode_arrays
from flwr_pfl.strategies.privacy import ClientLevelDP, PrivateAggregator
from flwr_pfl.strategies.sampling import PARTITION_QUERY, in_partition_order, sample_indices, sample_size, sampling_rng
from flwr_pfl.strategies.validation import ClientReply, Scalar, check_arrays, describe_failures
from flwr_pfl.strategies.wrappers import calling_wrapper, check_wrapped

NDArrays = list[np.ndarray]
#: called after every aggregation with (round, phase, aggregated metrics, per-client metrics)
RoundCallback = Callable[[int, str, dict[str, float], dict[int, dict[str, Scalar]]], None]
ConfigFn = Callable[[int], dict[str, Scalar]]
MetricsFn = Callable[[list[tuple[int, dict[str, Scalar]]]], dict[str, Scalar]]
EvaluateFn = Callable[[int, NDArrays, dict[str, Scalar]], "tuple[float, dict[str, Scalar]] | None"]
#: the phase of the results rows that record ``evaluate_fn``'s answers
SERVER_EVALUATE = "server-evaluate"
#: the phases that evaluate; every other phase (fit, FedDAR's head phase, ...) trains
EVALUATION_PHASES = ("evaluate", SERVER_EVALUATE)
#: values of ``aggregate``
AGGREGATES = ("mean", "trimmed-mean")


#: client-level DP as :func:`per_update_bounds` names it
CLIENT_DP = "client-level DP (dp-noise-multiplier)"


def per_update_bounds(clip: float | None, aggregate: str, client_dp: ClientLevelDP | None) -> list[str]:
    """The settings asked for that the server applies to each client's update, as run keys name them."""
    return [what for what, on in (("clip-update-norm", clip is not None), ("aggregate='trimmed-mean'", aggregate != "mean"),
                                  (CLIENT_DP, client_dp is not None)) if on]


def accepted_replies(row: Mapping[str, Any]) -> int:
    """The replies an aggregation accepted, from its metrics row: its ``participants`` (fit and
    evaluate rows) or ``num_clients`` (any aggregation that summarised replies)."""
    return int(max(row.get("participants") or 0, row.get("num_clients") or 0))


def lost_replies(row: Mapping[str, Any]) -> float:
    """The replies an aggregation lost, from its metrics row: errors, rejected replies and
    clients that did not answer in time (``num_failures`` + ``num_dropped``)."""
    return float((row.get("num_failures") or 0) + (row.get("num_dropped") or 0))


def remembers_failures(aggregate_fit: Callable[..., Any]) -> Callable[..., Any]:
    """``aggregate_fit`` that keeps the round's failures list (the clients' errors and the
    replies it rejects) for :meth:`PFLStrategy.check_trained` to quote."""

    @functools.wraps(aggregate_fit)
    def remembering(self: PFLStrategy, server_round: int, results: Any, failures: Any) -> Any:
        self._fit_failures = failures
        return aggregate_fit(self, server_round, results, failures)

    remembering.remembers_failures = True  # type: ignore[attr-defined]
    return remembering


def checks_wrapper(configure_fit: Callable[..., Any]) -> Callable[..., Any]:
    """``configure_fit`` that, on its first call, refuses a Flower DP wrapper that cannot wrap
    this algorithm (:func:`~flwr_pfl.strategies.wrappers.check_wrapped`): the wrapper asks for
    round 1's instructions before any client trains."""

    @functools.wraps(configure_fit)
    def checked(self: PFLStrategy, server_round: int, parameters: Parameters, client_manager: ClientManager) -> Any:
        if not self._wrapper_checked:
            self._wrapper_checked = True
            wrapper = calling_wrapper(self)
            if wrapper is not None:
                check_wrapped(self, wrapper)
        return configure_fit(self, server_round, parameters, client_manager)

    checked.checks_wrapper = True  # type: ignore[attr-defined]
    return checked


class PFLStrategy(FedAvg):
    """FedAvg's sampling with the suite's reply checks, metric summaries and state.

    Wire (this base class, i.e. FedAvg): fit and evaluate instructions carry the global arrays
    in the model's ``state_dict`` order; fit replies carry arrays of the same shapes plus
    metrics ``partition_id``, ``train_loss``, ``train_seconds``.

    Flower's FedAvg arguments keep Flower's meaning (every subclass takes them through
    ``**kwargs``; one that cannot honour one refuses it with the reason, see ``refused_hooks``):

    * ``on_fit_config_fn(round)`` / ``on_evaluate_config_fn(round)``: called once per round (with
      the run's round number, counting rounds done before a resume); their dicts are added to
      every fit / evaluate instruction of the round, before the algorithm's own keys, which they
      may not reuse. The suite's clients read ``learning-rate`` from them: that round's
      optimizer uses it (a per-round schedule; :mod:`flwr_pfl.clients.base`).
    * ``evaluate_fn(round, arrays, {})``: server-side evaluation of the current global arrays
      (what crosses the wire: the body only for FedRep/FedPer, pFedFDA's backbone and
      statistics) after every round and before the first; its (loss, metrics) are returned by
      :meth:`evaluate` and recorded through ``on_round`` as phase ``server-evaluate``.
    * ``fit_metrics_aggregation_fn`` / ``evaluate_metrics_aggregation_fn``: called with the
      accepted replies' ``[(num_examples, metrics), ...]``; their dicts are added to (and win
      over) the suite's own summaries, in the returned and the recorded metrics.
    * ``accept_failures``: False leaves a round with any failed or rejected reply unaggregated
      (the global model unchanged; the row records ``num_failures``), for fit and evaluate.
    * ``min_available_clients``: the strategy waits (up to ``wait_timeout``) until this many
      clients are connected before sampling (default ``num_clients``), then samples among the
      clients connected at that moment: fewer than ``num_clients`` lets rounds go on while
      nodes leave and join (a node that joins late is asked for its partition id and sampled
      from then on; one that left is no longer offered by Flower's client manager).
    * ``min_evaluate_clients``: the least clients an evaluation round samples; with fewer
      connected, the round's evaluation is skipped (a warning), as for ``min_fit_clients``.
    * ``initial_parameters``: Flower ``Parameters``, the same as ``initial_arrays``.
    * ``inplace``: accepted for compatibility; it changes nothing here (the suite aggregates
      with its own order-fixed weighted average).

    Args:
        num_clients: clients expected in the federation (partition ids 0 .. num_clients - 1).
        fraction_fit / fraction_evaluate: fraction of clients sampled per round.
        min_fit_clients: a round samples at least this many clients for training (capped at
            ``num_clients``); with fewer connected (possible when ``min_available_clients`` is
            lower) the round's training is skipped with a warning, as in Flower's FedAvg
            (its client manager refuses a sample larger than the clients available).
        initial_arrays: the starting global arrays; None (and no ``initial_parameters``) asks
            one client for them.
        fit_config: scalars added to every fit instruction (``server-round`` is always added);
            ``on_fit_config_fn``'s keys win over these.
        on_round: called after each fit and evaluate aggregation (results writers hook in here)
            with the per-client metrics keyed by partition id; a reply whose partition id is
            unknown (a client that reports none) is counted in the row's ``participants`` and
            listed as ``node-<id>`` in ``participant_ids``, but has no per-client entry.
        wait_timeout: seconds to wait for ``min_available_clients`` clients before giving up with
            a message that names the numbers.
        seed: seeds client sampling (:mod:`flwr_pfl.strategies.sampling`): the same seed
            samples the same partitions in every round of every rerun. None draws a seed and logs
            it (a warning): the run is not repeatable unless that seed is passed back.
        num_rounds: the run's total number of rounds (0: unknown). Flower's legacy strategies are
            never told the ``ServerConfig``'s ``num_rounds``; algorithms that treat the last round
            differently refuse to be built without it (:meth:`require_num_rounds`).
        round_timeout: seconds a client has to answer one exchange (None: Flower's default, no
            practical limit). Pass the same value as ``ServerConfig(round_timeout=...)``: Flower
            applies that one to the rounds' fit and evaluate exchanges, this one to the
            strategy's own (partition queries, FedDAR's head phase, FEDORA's setup). A client
            that does not answer in time counts as a failure; the round goes on with the
            replies in hand, and every aggregation logs and records who took part and who
            was dropped (``participants``, ``participant_ids``, ``num_dropped``,
            ``dropped_ids``).
        clip_update_norm: bound one client's pull on the model (None: off, the paper's
            behaviour): each fit reply's update, its arrays minus the global arrays it was sent,
            is scaled to at most this L2 norm over all its floating-point arrays before
            aggregation (:func:`~flwr_pfl.core.robust.clip_update`).
        max_examples: a fit reply claiming more than this many examples is rejected (a
            ``ReplyError``: counted in ``num_rejected``, the round goes on without it), so that
            no client buys weight by its count (None: off). Rejecting rather than capping: a
            count the client made up says nothing true of its update either.
        aggregate: ``"mean"`` (the example-weighted mean) or ``"trimmed-mean"``: per coordinate,
            the unweighted mean without the ``floor(trim_fraction * K)`` largest and smallest of
            the K replies' values (:func:`~flwr_pfl.core.robust.trimmed_mean`).
        trim_fraction: the share trimmed at each end by ``"trimmed-mean"``, in [0, 0.5).
        outlier_norm_ratio: on by default for every algorithm, and never changing an honest
            run's numbers (None: off). A fit reply whose norm (all its floating-point arrays
            together, in the algorithm's own terms: a model, statistics, a subspace) exceeds this
            many times the upper median of the round's reply norms is rejected, like any bad
            reply (:func:`~flwr_pfl.core.robust.magnitude_outliers`; with fewer than three
            replies, the previous round's median is the reference). An aggregate that holds
            NaN/Inf or whose norm grew by more than this factor in one round ends the run with
            :class:`~flwr_pfl.errors.DivergedError` instead of being sent to the clients.
        eval_every: the clients evaluate every this many rounds (counted over the whole run,
            resumes included) and after the last one; 0 = after the last one only; 1 (default)
            = every round. Anything but 1 needs ``num_rounds``. Long protocols (pFedFDA's
            200 rounds, FEDORA's 500) evaluate once at the end or every 10 rounds in the
            papers; a fine-tuning baseline's evaluation trains, so every round costs more
            than the training itself. Server-side ``evaluate_fn`` is not affected.
        client_dp: client-level differential privacy of the aggregate (None: off;
            :class:`~flwr_pfl.strategies.privacy.ClientLevelDP`).
        secure_aggregation: the fit replies come through SecAgg+ (:mod:`flwr_pfl.app.secagg`):
            every reply carries the example-weighted mean of the clients' arrays, which becomes
            the new global arrays as it is. No single update can be seen, so the outlier screen
            does not run (the aggregate's divergence check does) and a rejected reply makes the
            round unusable (its arrays are inside the sum): the global model stays unchanged.
        stop_if_nothing_trains: end the run with :class:`~flwr_pfl.errors.NoTrainingError`
            (quoting the clients' errors) at the first training phase in which every client
            asked failed or was rejected while no phase of the run has trained yet (see
            :meth:`check_trained`). Such an error (a batch without the expected keys, a model the
            algorithm cannot use) repeats in every round, and Flower's loop would otherwise
            finish the run as completed with the initial model. False goes on with warnings, as
            Flower's FedAvg does. The suite's own app sets it to False and judges the whole run
            at its end instead (:func:`~flwr_pfl.app.results.judge_run`). With
            ``accept_failures=False`` (rounds with any failure are left unaggregated on purpose,
            also where some clients trained) it does not apply.
        metric_names: your names for the clients' metrics, as your own ClientApp reported them
            (``{"accuracy": "eval_acc", "loss": "eval_loss"}``). The Message-API strategies'
            MetricRecords (``Result.train_metrics_clientapp``, ``evaluate_metrics_clientapp``)
            carry each metric ``k`` the clients report as its example-weighted mean under ``k``,
            as Flower's FedAvg does, and under your name where this maps ``k`` to one, beside the
            suite's summaries (``k_wmean``, ``k_min``, ``k_max``, ...).

    ``clip_update_norm`` and ``"trimmed-mean"`` apply to algorithms whose replies are the global
    arrays trained further and whose aggregation is this class's weighted mean (FedAvg, Local,
    finetune, FedRep, FedPer: the arrays on the wire, i.e. the whole model or the body);
    algorithms that send other things (statistics, subspaces, per-domain heads) or combine
    replies by their own rule refuse them with a ConfigError (see :attr:`robust_refusal`).
    """

    name = "fedavg"
    #: the run's total number of rounds (0: unknown)
    num_rounds: int = 0
    #: whether every sampled client's partition id must be known before instructions are built
    #: (algorithms with per-client server state); otherwise ids are asked for only when a
    #: round samples part of the federation
    needs_partition_ids: bool = False
    #: FedAvg hooks this algorithm cannot honour -> why (refused when set, with the reason)
    refused_hooks: ClassVar[dict[str, str]] = {}
    #: whether the final global arrays are a model worth exporting (FEDORA's are not: each
    #: client has its own model and the global arrays stay the unused initial ones)
    has_global_model: bool = True
    #: scalars added to the evaluate instructions of the run's last round (needs ``num_rounds``);
    #: the app asks clients to export their personalized models this way
    last_round_config: dict[str, Scalar] = {}
    #: clients contacted at once in the strategy's own exchanges (partition queries, setup
    #: rounds); the app sets it from ``server-workers``, like the legacy server's pool
    max_workers: int = 32
    #: why ``clip_update_norm`` / ``aggregate="trimmed-mean"`` do not apply ("" where they do);
    #: an algorithm that overrides how replies are read or combined refuses them unless it says
    #: otherwise here
    robust_refusal: ClassVar[str] = ""
    #: why client-level DP does not apply: None (default) gives the per-update bounds' refusal;
    #: "" declares that the class's own reading and combining of replies is still the weighted
    #: mean of the wire arrays (it only adds checks, or post-processes the mean), so that
    #: :meth:`private_aggregate` can release them all (pFedFDA: backbone and statistics)
    client_dp_refusal: ClassVar[str | None] = None
    #: whether the first configure_fit looked for a Flower DP wrapper calling it
    _wrapper_checked: bool = False
    #: what the latest aggregation returned (None: nothing yet)
    _returned: Parameters | None = None

    #: the failures list of the latest aggregate_fit (:func:`remembers_failures`)
    _fit_failures: Sequence[Any] = ()
    #: whether some training phase of this run (since this strategy was built) accepted a reply
    _trained: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's own ``configure_fit`` checks for a Flower DP wrapper too
        (:func:`checks_wrapper`), and its own ``aggregate_fit`` keeps the round's failures
        (:func:`remembers_failures`)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("configure_fit")
        if own is not None and not getattr(own, "checks_wrapper", False):
            cls.configure_fit = checks_wrapper(own)  # type: ignore[method-assign]
        own = cls.__dict__.get("aggregate_fit")
        if own is not None and not getattr(own, "remembers_failures", False):
            cls.aggregate_fit = remembers_failures(own)  # type: ignore[method-assign]

    def __init__(
        self,
        *,
        num_clients: int,
        fraction_fit: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_fit_clients: int = 1,
        min_evaluate_clients: int | None = None,
        min_available_clients: int | None = None,
        evaluate_fn: EvaluateFn | None = None,
        on_fit_config_fn: ConfigFn | None = None,
        on_evaluate_config_fn: ConfigFn | None = None,
        accept_failures: bool = True,
        initial_parameters: Parameters | None = None,
        fit_metrics_aggregation_fn: MetricsFn | None = None,
        evaluate_metrics_aggregation_fn: MetricsFn | None = None,
        inplace: bool = True,
        initial_arrays: NDArrays | None = None,
        fit_config: dict[str, Scalar] | None = None,
        on_round: RoundCallback | None = None,
        wait_timeout: float = 600.0,
        seed: int | None = 0,
        num_rounds: int = 0,
        round_timeout: float | None = None,
        clip_update_norm: float | None = None,
        max_examples: int | None = None,
        aggregate: str = "mean",
        trim_fraction: float = 0.1,
        eval_every: int = 1,
        outlier_norm_ratio: float | None = DEFAULT_OUTLIER_RATIO,
        client_dp: ClientLevelDP | None = None,
        secure_aggregation: bool = False,
        stop_if_nothing_trains: bool = True,
        metric_names: Mapping[str, str] | None = None,
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        for key, value in (("fraction_fit", fraction_fit), ("fraction_evaluate", fraction_evaluate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{key} must be in [0, 1], got {value}")
        if min_available_clients is None:
            min_available_clients = num_clients
        if not 1 <= min_available_clients <= num_clients:
            raise ConfigError(
                f"min_available_clients={min_available_clients} must be in [1, num_clients={num_clients}]: the "
                "federation never has more than num_clients clients"
            )
        if round_timeout is not None and not round_timeout > 0:
            raise ConfigError(f"round_timeout must be > 0 seconds or None (no limit), got {round_timeout!r}")
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 0:
            raise ConfigError(f"num_rounds must be an int >= 0 (0: unknown), got {num_rounds!r}")
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 0:
            raise ConfigError(f"eval_every must be an int >= 0 (0: after the last round only), got {eval_every!r}")
        if initial_parameters is not None:
            if initial_arrays is not None:
                raise ConfigError("give initial_arrays or initial_parameters, not both (they are the same thing)")
            if not isinstance(initial_parameters, Parameters):
                raise TypeError(f"initial_parameters must be flwr.common.Parameters, got {type(initial_parameters).__name__}")
            initial_arrays = parameters_to_ndarrays(initial_parameters)
        self._round_configs: dict[str, tuple[int, dict[str, Scalar]]] = {}  # hook -> (round, its dict)
        self.reported_config_keys: set[str] = set()  # user config keys already reported as unread by the clients
        self._check_bounds(clip_update_norm, max_examples, aggregate, trim_fraction, client_dp)
        self._check_secure(secure_aggregation, clip_update_norm, aggregate, client_dp)
        #: the fit replies arrive summed by SecAgg+ (:mod:`flwr_pfl.app.secagg`): each carries
        #: the aggregate, none a client's own arrays
        self.secure_aggregation = secure_aggregation
        self.clip_update_norm = clip_update_norm
        self.max_examples = max_examples
        self.aggregate = aggregate
        self.trim_fraction = trim_fraction
        if outlier_norm_ratio is not None and (isinstance(outlier_norm_ratio, bool)
                                               or not isinstance(outlier_norm_ratio, (int, float))
                                               or not outlier_norm_ratio > 1):
            raise ConfigError(f"{type(self).__name__}: outlier_norm_ratio (outlier-norm-ratio) must be a number > 1 or "
                              f"None (off), got {outlier_norm_ratio!r}")
        self.outlier_norm_ratio = outlier_norm_ratio
        #: the upper median of the latest screened round's accepted reply norms (the reference of
        #: a round with fewer than three replies)
        self.norm_reference: float | None = None
        super().__init__(
            fraction_fit=fraction_fit,
            fraction_evaluate=fraction_evaluate,
            min_fit_clients=min(min_fit_clients, num_clients),
            min_evaluate_clients=(1 if fraction_evaluate > 0 else 0) if min_evaluate_clients is None else min_evaluate_clients,
            min_available_clients=min_available_clients,
            evaluate_fn=evaluate_fn,
            on_fit_config_fn=on_fit_config_fn,
            on_evaluate_config_fn=on_evaluate_config_fn,
            accept_failures=accept_failures,
            initial_parameters=ndarrays_to_parameters(initial_arrays) if initial_arrays is not None else None,
            fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
            inplace=inplace,
        )
        self.num_clients = num_clients
        self.stop_if_nothing_trains = stop_if_nothing_trains
        self.metric_names = hooks.check_metric_names(type(self).__name__, metric_names)
        self.extra_fit_config = dict(fit_config or {})
        self.on_round = on_round
        self.wait_timeout = wait_timeout
        self.seed = hooks.resolve_seed(seed)
        self.num_rounds = num_rounds
        if eval_every != 1:
            self.require_num_rounds(f"eval_every={eval_every} (an evaluation after the last round)", "eval_every=1")
        self.eval_every = eval_every
        self.round_timeout = round_timeout
        #: client-level DP of the aggregate (None: off)
        planned = sample_size(num_clients, fraction_fit, min_fit_clients)  # clients per round
        self.private = None if client_dp is None else PrivateAggregator(client_dp, num_clients, planned)
        self._dp_metrics: dict[str, float] = {}
        if client_dp is not None and client_dp.max_epsilon is not None:
            self.require_num_rounds("dp-max-epsilon (a budget checked before training)", "dp-max-epsilon=0")
            self.private.check_budget(num_rounds, planned)
        self._sampled_nodes: dict[str, list[str]] = {}  # stage -> node ids sampled for its latest round
        self._sent_at: dict[str, float] = {}  # stage -> when its latest sample was taken (perf_counter)
        self._timeout_warned: set[str] = set()  # stages already warned about round_timeout's margin
        self.global_arrays: NDArrays | None = initial_arrays
        self.round_offset = 0  # rounds completed before a resume
        self.partition_of: dict[str, int] = {}  # cid -> partition id, learned from replies
        #: (phase, round, [(node id, partition id or None)]) of the accepted replies of the base
        #: class's latest aggregation, read once by :meth:`_participation`
        self._replied: tuple[str, int, list[tuple[str, int | None]]] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        """Check hooks whenever they are set (constructor or attribute, as Flower users do), and
        refuse hook-like names that are no hook: they would otherwise be silently ignored."""
        if name in hooks.HOOKS:
            hooks.check_hook(type(self).__name__, name, value, self.refused_hooks)
        elif hooks.looks_like_hook(name) and not hasattr(self, name):
            raise hooks.unknown_hook(type(self).__name__, name)
        super().__setattr__(name, value)

    def _check_bounds(self, clip: float | None, max_examples: int | None, aggregate: str, trim: float,
                      client_dp: ClientLevelDP | None = None) -> None:
        """ConfigError on a bad or (for this algorithm) inapplicable reply bound."""
        name = type(self).__name__
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ConfigError(f"{name}: clip_update_norm (clip-update-norm) must be a number > 0 or None (off), got {clip!r}")
        if max_examples is not None and (isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1):
            raise ConfigError(f"{name}: max_examples (max-examples) must be an integer >= 1 or None (off), got {max_examples!r}")
        if aggregate not in AGGREGATES:
            raise ConfigError(f"{name}: aggregate={aggregate!r} is not allowed; choose one of {', '.join(map(repr, AGGREGATES))}")
        if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0 <= trim < 0.5:
            raise ConfigError(f"{name}: trim_fraction (trim-fraction) must be in [0, 0.5), got {trim!r}")
        if client_dp is not None and not isinstance(client_dp, ClientLevelDP):
            raise ConfigError(f"{name}: client_dp must be a ClientLevelDP or None, got {type(client_dp).__name__}")
        asked = per_update_bounds(clip, aggregate, client_dp)
        refusal = self.robust_refusal or self._default_refusal()
        refused = [a for a in asked if (self.dp_refusal() if a == CLIENT_DP else refusal)]
        if refused:
            reason = refusal if refused != [CLIENT_DP] else self.dp_refusal()
            raise ConfigError(f"{name}: {' and '.join(refused)} cannot be used: {reason}; leave them off for this algorithm")
        if client_dp is not None and len(asked) > 1:
            raise ConfigError(f"{name}: client-level DP clips every update itself (dp-clip-norm) and averages them "
                              f"uniformly; it cannot be combined with {' or '.join(asked[:-1])}")

    def _check_secure(self, secure: bool, clip: float | None, aggregate: str, client_dp: ClientLevelDP | None) -> None:
        """ConfigError where secure aggregation cannot give this algorithm's aggregate, or is
        combined with a bound that needs each client's update."""
        if not secure:
            return
        name = type(self).__name__
        refusal = self.robust_refusal or self._default_refusal()
        if refusal:
            raise ConfigError(f"{name}: secure-aggregation cannot be used: {refusal}; SecAgg+ gives the server only the "
                              "example-weighted mean of the fit replies")
        asked = per_update_bounds(clip, aggregate, client_dp)
        if asked:
            raise ConfigError(f"{name}: secure-aggregation hides each client's update from the server, so "
                              f"{' and '.join(asked)}, which the server applies to each update, cannot be combined with it")

    @classmethod
    def dp_refusal(cls) -> str:
        """Why client-level DP cannot be used with this algorithm ("" where it can)."""
        return cls.robust_refusal or cls._default_refusal() if cls.client_dp_refusal is None else cls.client_dp_refusal

    @classmethod
    def _default_refusal(cls) -> str:
        """Why the bounds do not apply when the class reads or combines replies its own way."""
        own = [m for m in ("check_reply", "aggregate_replies") if getattr(cls, m) is not getattr(PFLStrategy, m)]
        if not own:
            return ""
        return (f"it reads or combines its fit replies by its own rule ({', '.join(own)}), not as a weighted mean of the "
                "global arrays trained further")

    def bound_replies(self, server_round: int, replies: list[ClientReply]) -> list[ClientReply]:
        """The replies with their updates clipped to ``clip_update_norm`` (when set): each
        reply's arrays become ``global + clip(reply - global)``, against the global arrays the
        round sent."""
        if self.clip_update_norm is None or not replies or not self.global_arrays:
            return replies
        out = []
        for r in replies:
            norm = update_norm([a.astype(np.float64) - g for a, g in zip(r.arrays, self.global_arrays) if np.issubdtype(a.dtype, np.floating)])
            if norm > self.clip_update_norm:
                log(INFO, "round %d: partition %d's update (norm %.4g) clipped to clip-update-norm=%g",
                    self.run_round(server_round), r.partition_id, norm, self.clip_update_norm)
            out.append(replace(r, arrays=clip_update(r.arrays, self.global_arrays, self.clip_update_norm)))
        return out

    def check_examples(self, who: str, num_examples: int) -> None:
        """ReplyError when a reply claims more than ``max_examples`` examples."""
        if self.max_examples is not None and num_examples > self.max_examples:
            raise ReplyError(f"client {who} claims {num_examples} examples, more than max-examples={self.max_examples}")

    def require_num_rounds(self, what: str, alternative: str) -> None:
        """Refuse to build when ``what`` needs the run's total rounds and none was given."""
        if not self.num_rounds:
            raise NumRoundsRequired(
                f"{type(self).__name__}: {what} needs the run's total number of rounds, which Flower's legacy "
                f"strategies are never told: pass num_rounds=<the rounds of your ServerConfig>, or {alternative} "
                "(the Message API's start() tells the rounds itself; a subclass whose own start() runs the round "
                "loop must pass num_rounds)"
            )

    def run_round(self, server_round: int) -> int:
        """The run's number of ``server_round`` (of this process): resumes count the rounds done
        before them, so that logs and records number rounds alike."""
        return self.round_offset + server_round

    def is_last_round(self, server_round: int) -> bool:
        """Whether ``server_round`` (of this process; resumes add ``round_offset``) is the run's last."""
        return bool(self.num_rounds) and self.run_round(server_round) >= self.num_rounds

    def evaluation_due(self, server_round: int) -> bool:
        """Whether the clients evaluate in ``server_round`` (``eval_every``): every
        ``eval_every``-th round of the run, and the last."""
        current = self.run_round(server_round)
        return (self.eval_every > 0 and current % self.eval_every == 0) or self.is_last_round(server_round)

    def refuses_failures(self, count: int) -> bool:
        """Whether a round with ``count`` failed or rejected replies is left unaggregated."""
        return count > 0 and not self.accept_failures

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_clients={self.num_clients}, fraction_fit={self.fraction_fit})"

    # ---------------------------------------------------------------- sampling and instructions
    def wait_for_clients(self, client_manager: ClientManager) -> None:
        """Wait up to ``wait_timeout`` seconds for ``min_available_clients`` connected clients
        (by default ``num_clients``: the whole federation)."""
        wanted = self.min_available_clients
        what = f"num-clients={wanted}" if wanted == self.num_clients else f"min_available_clients={wanted}"
        if client_manager.num_available() < wanted:
            log(INFO, "waiting up to %.0f s for %s clients (%d connected); in simulation "
                "the federation's num-supernodes must equal num-clients",
                self.wait_timeout, what, client_manager.num_available())
        if not client_manager.wait_for(wanted, timeout=int(self.wait_timeout)):
            raise RuntimeError(
                f"only {client_manager.num_available()} of {what} clients "
                f"connected within {self.wait_timeout:.0f} s; in simulation, set the federation's "
                f"num-supernodes to {self.num_clients} (flwr run . --federation-config "
                f"\"num-supernodes={self.num_clients}\") or change num-clients; on a fleet, "
                "lower min-clients to go on with fewer nodes"
            )
        connected = client_manager.num_available()
        if connected < self.num_clients:
            log(INFO, "%d of num-clients=%d clients connected (min_available_clients=%d): going on with them",
                connected, self.num_clients, wanted)

    def exchange_timeout(self, fallback: float | None) -> float | None:
        """Seconds a client has to answer one of the strategy's own exchanges: ``round_timeout``
        when set, else ``fallback`` (what the exchange waited before there was a round timeout)."""
        return self.round_timeout if self.round_timeout is not None else fallback

    def query_properties(
        self, server_round: int, clients: list[ClientProxy], config: dict[str, Scalar]
    ) -> list[dict[str, Scalar] | BaseException]:
        """One ``get_properties(config)`` exchange with each of ``clients``, in parallel; the
        answers (or the error of a client that could not answer) in the order of ``clients``."""
        ins = GetPropertiesIns(dict(config))

        def ask(proxy: ClientProxy) -> dict[str, Scalar] | BaseException:
            try:
                timeout = self.exchange_timeout(self.wait_timeout)
                return dict(proxy.get_properties(ins, timeout=timeout, group_id=server_round).properties)
            except Exception as err:  # no answer or an error reply
                return err

        if not clients:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers_for(len(clients))) as pool:
            return list(pool.map(ask, clients))

    def workers_for(self, num_clients: int) -> int:
        """Threads for an exchange with ``num_clients`` clients (at least 1, at most ``max_workers``)."""
        return max(1, min(self.max_workers, num_clients))

    def learn_partitions(self, server_round: int, clients: Iterable[ClientProxy]) -> None:
        """Ask the clients whose partition id is unknown for it; a client that cannot answer
        stays unknown and is asked again next time."""
        unknown = [p for p in clients if p.cid not in self.partition_of]
        config = {**PARTITION_QUERY, "server-round": self.run_round(server_round)}
        for proxy, answer in zip(unknown, self.query_properties(server_round, unknown, config)):
            partition = _partition_id(answer)
            if partition is not None and 0 <= partition < self.num_clients:
                self.partition_of[proxy.cid] = partition
            else:
                log(WARNING, "round %d: client %s did not report a partition id in [0, %d): %r",
                    self.run_round(server_round), proxy.cid, self.num_clients, answer)

    def all_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        """Every connected client whose partition id is known, in partition order (after waiting
        for ``num_clients``)."""
        self.wait_for_clients(client_manager)
        clients = list(client_manager.all().values())
        self.learn_partitions(server_round, clients)
        known = [p for p in clients if p.cid in self.partition_of]
        return sorted(known, key=lambda p: (self.partition_of[p.cid], p.cid))

    def _sample(
        self, client_manager: ClientManager, server_round: int, fraction: float, min_clients: int, stage: str = "fit"
    ) -> list[ClientProxy]:
        """``max(int(fraction * K), min_clients)`` of the K connected clients, the same ones in
        every rerun: drawn by partition id from the round's own seeded generator
        (:func:`~flwr_pfl.strategies.sampling.sampling_rng`), never from Python's ``random``.

        Fewer than ``min_clients`` connected (``min_fit_clients`` / ``min_evaluate_clients``, at
        most ``num_clients``): nobody is sampled and the round's training (or evaluation) is
        skipped, with a warning naming the numbers, as Flower's FedAvg does (its client
        manager's sample fails and the server cancels the round)."""
        self._sampled_nodes.pop(stage, None)
        self.wait_for_clients(client_manager)
        available = client_manager.num_available()
        least = min(min_clients, self.num_clients)
        if available < least:
            what = "min_fit_clients" if stage == "fit" else "min_evaluate_clients" if stage == "evaluate" else "min_clients"
            log(WARNING, "round %d: %s: only %d clients connected, fewer than %s=%d: the %s step of this round is "
                "skipped (lower %s to go on with fewer clients)", self.run_round(server_round), stage, available,
                what, least, stage, what)
            return []
        size = sample_size(available, fraction, least)
        if size >= available and not self.needs_partition_ids:
            clients = list(client_manager.all().values())  # everyone: no need to know who is who
            sampled = sorted(clients, key=lambda p: (self.partition_of.get(p.cid, -1), p.cid))
        else:
            clients = self.all_clients(server_round, client_manager)
            rng = sampling_rng(self.seed, stage, self.run_round(server_round))
            sampled = [clients[i] for i in sample_indices(len(clients), size, rng)]
        self.record_sample(stage, sampled)
        return sampled

    def record_sample(self, stage: str, sampled: Iterable[ClientProxy]) -> None:
        """Remember who ``stage`` (fit, evaluate) sampled this round, so that its aggregation
        records who was dropped (``num_dropped``, ``dropped_ids``); a subclass that samples its
        own way calls this."""
        self._sampled_nodes[stage] = [p.cid for p in sampled]
        self._sent_at[stage] = time.perf_counter()

    # ---------------------------------------------------------------- configs (Flower's hooks)
    def _round_config(self, hook: str, server_round: int) -> dict[str, Scalar]:
        """The dict of ``on_fit_config_fn`` / ``on_evaluate_config_fn`` for this round: called
        once per round (an algorithm that sends several exchanges in a round reuses it)."""
        fn = getattr(self, hook)
        if fn is None:
            return {}
        current = self.run_round(server_round)
        cached = self._round_configs.get(hook)
        if cached is None or cached[0] != current:
            cached = (current, hooks.round_config(type(self).__name__, hook, fn, current))
            self._round_configs[hook] = cached
        return dict(cached[1])

    def fit_config(self, server_round: int, protocol: Mapping[str, Scalar] | None = None) -> dict[str, Scalar]:
        """A fit instruction's config: ``fit_config`` and ``on_fit_config_fn``'s dict (the user's
        keys), then ``server-round`` and the algorithm's ``protocol`` keys (which the user's may
        not reuse)."""
        user = {**self.extra_fit_config, **self._round_config("on_fit_config_fn", server_round)}
        hooks.report_unread_keys(type(self).__name__, "fit_config / on_fit_config_fn", user, self.reported_config_keys)
        own = {"server-round": self.run_round(server_round), **(protocol or {})}
        return hooks.merge_config(type(self).__name__, "fit_config / on_fit_config_fn", user, own)

    def evaluate_config(self, server_round: int, protocol: Mapping[str, Scalar] | None = None) -> dict[str, Scalar]:
        """An evaluate instruction's config: ``on_evaluate_config_fn``'s dict, then
        ``server-round``, ``last_round_config`` in the run's last round, and the algorithm's
        ``protocol`` keys."""
        user = self._round_config("on_evaluate_config_fn", server_round)
        hooks.report_unread_keys(type(self).__name__, "on_evaluate_config_fn", user, self.reported_config_keys)
        last = self.is_last_round(server_round)
        own = {"server-round": self.run_round(server_round), **(self.last_round_config if last else {}), **(protocol or {})}
        return hooks.merge_config(type(self).__name__, "on_evaluate_config_fn", user, own)

    def fit_instructions(
        self, server_round: int, parameters: Parameters, clients: list[ClientProxy]
    ) -> list[tuple[ClientProxy, FitIns]]:
        """One FitIns per sampled client; override to send each client its own payload."""
        config = self.fit_config(server_round)
        return [(proxy, FitIns(parameters, dict(config))) for proxy in clients]

    @checks_wrapper
    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.global_arrays is None:
            self.global_arrays = parameters_to_ndarrays(parameters)
        self.follow_released(parameters)
        clients = self._sample(client_manager, server_round, self.fraction_fit, self.min_fit_clients)
        return self.fit_instructions(server_round, parameters, clients)

    def evaluation_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        """Who evaluates after ``server_round``: nobody when evaluation is off (``fraction_evaluate
        = 0``) or not due (:meth:`evaluation_due`), else a ``fraction_evaluate`` sample."""
        if self.fraction_evaluate == 0.0 or not self.evaluation_due(server_round):
            return []
        return self._sample(client_manager, server_round, self.fraction_evaluate, self.min_evaluate_clients, "evaluate")

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        self.follow_released(parameters)
        clients = self.evaluation_clients(server_round, client_manager)
        config = self.evaluate_config(server_round)
        return [(proxy, EvaluateIns(parameters, dict(config))) for proxy in clients]

    def personal_evaluate_instructions(
        self,
        server_round: int,
        parameters: Parameters,
        client_manager: ClientManager,
        instruction: Callable[[int | None], tuple[NDArrays, Mapping[str, Scalar]] | None],
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """``configure_evaluate`` of a server that sends each client arrays of its own (FedPAC's
        heads, FedFomo's and FedAMP's per-client models, pFedHN's generated models):
        ``instruction(partition_id)`` gives the client's arrays and protocol keys, or None to
        leave the client out (logged). Before the first global arrays exist, as the base."""
        if not self.global_arrays:
            return PFLStrategy.configure_evaluate(self, server_round, parameters, client_manager)
        out = []
        for proxy in self.evaluation_clients(server_round, client_manager):
            pid = self.partition_of.get(proxy.cid)
            built = instruction(pid)
            if built is None:
                log(WARNING, "round %d: client %s (partition %s) has no model of its own on the server; not evaluated",
                    self.run_round(server_round), proxy.cid, pid)
                continue
            arrays, protocol = built
            out.append((proxy, EvaluateIns(ndarrays_to_parameters(arrays), self.evaluate_config(server_round, protocol))))
        return out

    # ---------------------------------------------------------------- server-side evaluation
    def initial_global_arrays(self, parameters: Parameters) -> NDArrays:
        """The first global arrays, from the initial ``parameters`` (override when the server
        completes them, as pFedFDA does with its statistics)."""
        return parameters_to_ndarrays(parameters)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Flower's server-side evaluation: ``evaluate_fn(round, global arrays, {})`` on a copy of
        the current global arrays; its (loss, metrics) are recorded (phase ``server-evaluate``)
        and returned. Round 0 evaluates the initial arrays; after a resume it is skipped (the
        run evaluated those arrays before it stopped)."""
        if self.evaluate_fn is None or (server_round == 0 and self.round_offset):
            return None
        self.follow_released(parameters)
        arrays = self.global_arrays if self.global_arrays is not None else self.initial_global_arrays(parameters)
        current = self.run_round(server_round)
        answer = hooks.server_evaluation(
            type(self).__name__, self.evaluate_fn(current, [np.array(a, copy=True) for a in arrays], {})
        )
        if answer is None:
            return None
        loss, metrics = answer
        self._notify(server_round, SERVER_EVALUATE, {"loss": loss, **metrics}, {})
        log(INFO, "round %d: server-side evaluation: loss %.4f %s", current, loss, metrics)
        return loss, metrics

    def _user_metrics(self, hook: str, pairs: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
        """``fit_metrics_aggregation_fn`` / ``evaluate_metrics_aggregation_fn`` on ``pairs`` ({} when unset)."""
        fn = getattr(self, hook)
        return {} if fn is None or not pairs else hooks.aggregated_metrics(type(self).__name__, hook, fn, pairs)

    # ---------------------------------------------------------------- replies
    def expected_shapes(self, server_round: int) -> list[tuple[int, ...]]:
        """Shapes of the arrays a fit reply must carry (default: those of the global arrays)."""
        return [tuple(a.shape) for a in (self.global_arrays or [])]

    def expected_dtypes(self, server_round: int) -> list[np.dtype | None]:
        """The dtype of each array of :meth:`expected_shapes` (None: any real dtype). Default:
        the global arrays' own. A subclass that changes :meth:`expected_shapes` changes this too."""
        return [np.asarray(a).dtype for a in (self.global_arrays or [])]

    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """Decode and validate one fit reply; raise ReplyError naming the client and problem."""
        partition_id = self.check_partition(proxy.cid, res.metrics.get("partition_id", -1))
        who = f"{proxy.cid} (partition {partition_id})"
        arrays = decode_arrays(res.parameters)
        # securely aggregated replies carry the protocol's float64 sum, cast back in aggregate_replies
        dtypes = None if self.secure_aggregation else self.expected_dtypes(server_round)
        check_arrays(who, arrays, self.expected_shapes(server_round), res.num_examples, dtypes)
        loss = res.metrics.get("train_loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            raise ReplyError(f"client {who}: its train_loss is {loss}: its local training diverged, so its arrays "
                             "are not a model (lower its learning rate)")
        if partition_id >= 0:
            self.partition_of[proxy.cid] = partition_id
        return ClientReply(proxy.cid, partition_id, res.num_examples, arrays, dict(res.metrics))

    def check_partition(self, cid: str, reported: Any) -> int:
        """The partition id a reply reports (-1: none), once checked against its node.

        A reply's partition id must be an integer in [0, num_clients) and the one its node
        reported before (learned from its first answer: a partition query or a reply): a node
        that claims another partition's id would take that partition's weight, state and
        records. A node that restarts comes back under a new node id and is learned anew.

        Raises:
            ReplyError: naming the node, the id it reports and the one it had.
        """
        if reported is None or (isinstance(reported, (int, float)) and not isinstance(reported, bool) and reported == -1):
            return -1
        if (isinstance(reported, bool) or not isinstance(reported, (int, float)) or not float(reported).is_integer()
                or not 0 <= reported < self.num_clients):
            raise ReplyError(f"client {cid}: partition_id {reported!r} is not a partition of this federation "
                             f"(an integer in [0, {self.num_clients}))")
        known = self.partition_of.get(cid)
        if known is not None and int(reported) != known:
            raise ReplyError(f"client {cid}: reports partition {int(reported)}, but this node is partition {known}: a "
                             "node cannot change its partition during a run; its reply is rejected")
        return int(reported)

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Combine validated replies into the new global arrays (default: FedAvg, Eq. in Alg. 1;
        with client-level DP, :meth:`private_aggregate`)."""
        if not replies[0].arrays:
            return []
        if self.secure_aggregation:
            return securely_summed(replies, self.global_arrays)
        if self.private is not None:
            return self.private_aggregate(server_round, replies)
        if self.aggregate == "trimmed-mean":
            return trimmed_mean([r.arrays for r in replies], self.trim_fraction)
        return weighted_average([r.arrays for r in replies], [r.num_examples for r in replies])

    def private_aggregate(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """The global arrays plus the private mean of the replies' updates
        (:meth:`PrivateAggregator.release <flwr_pfl.strategies.privacy.PrivateAggregator.release>`):
        each update (reply minus the global arrays sent) clipped, summed, noised and divided by
        the number of clients the round sampled. Only floating-point arrays are released;
        integer ones (BatchNorm's batch counters, which count a client's data) keep their
        previous global values."""
        previous = self.global_arrays
        if previous is None:
            raise RuntimeError("client-level DP needs the global arrays the round sent")
        floating = [np.issubdtype(np.asarray(g).dtype, np.floating) for g in previous]
        updates = [[a.astype(np.float64) - np.asarray(g, dtype=np.float64) for a, g, f in zip(r.arrays, previous, floating) if f]
                   for r in replies]
        sampled = max(len(self._sampled_nodes.get("fit", ())), len(replies))
        mean, self._dp_metrics = self.private.release(updates, sampled, self.run_round(server_round))
        step = iter(mean)
        return [(np.asarray(g, dtype=np.float64) + next(step)).astype(np.asarray(g).dtype) if f else np.array(g, copy=True)
                for g, f in zip(previous, floating)]

    @remembers_failures
    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        start = time.perf_counter()
        replies: list[ClientReply] = []
        rejected = 0
        claimed: set[int] = set()
        kept: list[tuple[ClientProxy, FitRes]] = []
        for proxy, res in in_partition_order(results):  # sums must not depend on arrival order
            try:
                self.check_examples(proxy.cid, res.num_examples)
                check_unclaimed(proxy.cid, res.metrics.get("partition_id"), claimed)
                reply = self.check_reply(server_round, proxy, res)
                claimed.add(reply.partition_id)
                replies.append(reply)
                kept.append((proxy, res))
            except ReplyError as err:
                log(WARNING, "round %d: rejected a fit reply: %s", self.run_round(server_round), err)
                failures.append((proxy, res))
                rejected += 1
        if self.secure_aggregation and rejected:
            log(WARNING, "round %d: %d securely aggregated fit replies were rejected, but their arrays are inside the sum "
                "and cannot be taken out of it: the round is not aggregated; the global model is unchanged",
                self.run_round(server_round), rejected)
            metrics = {"num_failures": float(len(failures)), "num_rejected": float(rejected)}
            self._notify(server_round, "fit", metrics, {})
            return None, metrics
        for index in reversed(self.screen_outliers(server_round, replies)):
            failures.append(kept.pop(index))
            replies.pop(index)
            rejected += 1
        for failure in failures:
            if isinstance(failure, BaseException):
                log(WARNING, "round %d: a client failed: %r", self.run_round(server_round), failure)
        metrics: dict[str, Any] = {"num_failures": float(len(failures)), "num_rejected": float(rejected)}
        if self.refuses_failures(len(failures)):
            log(WARNING, "round %d: %d failed or rejected fit replies and accept_failures=False: the round is "
                "not aggregated; the global model is unchanged", self.run_round(server_round), len(failures))
            self._notify(server_round, "fit", metrics, {})
            return None, metrics
        if not replies:
            log(WARNING, "round %d: no valid fit replies; the global model is unchanged", self.run_round(server_round))
            self._notify(server_round, "fit", metrics, {})
            return None, metrics
        previous = self.global_arrays
        arrays = self.aggregate_replies(server_round, self.bound_replies(server_round, replies))
        self.check_aggregate(server_round, arrays, previous)
        self.global_arrays = arrays
        metrics |= self._dp_metrics
        metrics |= aggregate_client_metrics(
            [(r.num_examples, r.metrics) for r in replies], keys=self.fit_metric_keys(replies)
        )
        metrics |= self._user_metrics("fit_metrics_aggregation_fn", [(r.num_examples, dict(r.metrics)) for r in replies])
        metrics["aggregate_seconds"] = time.perf_counter() - start
        who = [(r.cid, self.reply_partition(r.cid, r.partition_id)) for r in replies]
        clients = {pid: r.metrics for (_, pid), r in zip(who, replies) if pid is not None}
        self._replied = ("fit", server_round, who)
        self._notify(server_round, "fit", metrics, clients)
        self._returned = ndarrays_to_parameters(arrays)
        return self._returned, metrics

    def follow_released(self, parameters: Parameters) -> None:
        """Adopt ``parameters`` as the global arrays when they are not what the latest aggregation
        returned: a wrapper changed the aggregate after this strategy returned it (Flower's DP
        wrappers add their noise there; :mod:`~flwr_pfl.strategies.wrappers`). The clients receive
        the released arrays, so the strategy evaluates, checkpoints and exports those, not the
        noiseless ones; each keeps its array's dtype (Flower's noise comes back as float64). Only
        the algorithms such a wrapper can wrap adopt anything: the others (which refuse it) may
        send what they like between rounds.

        Raises:
            ConfigError: the released arrays differ from the aggregate in number or shape.
        """
        returned, previous = self._returned, self.global_arrays
        if returned is None or previous is None or parameters is None or parameters is returned:
            return
        if self.robust_refusal or self._default_refusal() or parameters.tensors == returned.tensors:
            return  # an algorithm that Flower's wrappers cannot wrap (check_wrapped) sends its own arrays
        released = parameters_to_ndarrays(parameters)
        if [np.shape(a) for a in released] != [np.shape(a) for a in previous]:
            raise ConfigError(f"{type(self).__name__}: the arrays the server loop sends ({len(released)}) differ in number "
                              f"or shape from the aggregate this strategy returned ({len(previous)}); a strategy wrapped "
                              "around it changed them")
        self.global_arrays = [np.asarray(a).astype(np.asarray(g).dtype) for a, g in zip(released, previous)]
        self._returned = parameters

    def screen_outliers(self, server_round: int, replies: list[ClientReply], what: str = "fit reply") -> list[int]:
        """Indices (ascending) of the replies whose norm is absurd next to the others'
        (``outlier_norm_ratio``, :func:`~flwr_pfl.core.robust.magnitude_outliers`), each logged
        as rejected; the accepted ones' upper median becomes the next round's reference."""
        if self.outlier_norm_ratio is None or not replies or self.secure_aggregation:
            return []  # securely aggregated replies all carry the sum: no one client's norm to screen
        norms = [reply_norm(r.arrays) for r in replies]
        outliers = magnitude_outliers(norms, self.outlier_norm_ratio, self.norm_reference)
        for i in outliers:
            log(WARNING, "round %d: rejected a %s: client %s (partition %d): its norm %.4g is more than "
                "outlier-norm-ratio=%g times the round's reference", self.run_round(server_round), what,
                replies[i].cid, replies[i].partition_id, norms[i], self.outlier_norm_ratio)
        accepted = [n for i, n in enumerate(norms) if i not in outliers]
        if accepted:
            self.norm_reference = upper_median(accepted)
        return outliers

    def check_aggregate(self, server_round: int, arrays: NDArrays, previous: NDArrays | None) -> None:
        """End the run (:class:`~flwr_pfl.errors.DivergedError`) when a new aggregate holds NaN/Inf
        or grew by more than ``outlier_norm_ratio`` in one round: sending it would ruin every
        client, and a run that goes on from it only looks completed."""
        if self.outlier_norm_ratio is None:
            return
        problem = aggregate_blowup(arrays, previous, self.outlier_norm_ratio)
        if problem is not None:
            raise DivergedError(f"{type(self).__name__}, round {self.run_round(server_round)}: the aggregate of the "
                                f"accepted replies has {problem}; it is not used and the run ends here (the last "
                                "checkpoint holds the model before it). Lower the learning rate, or look for a client "
                                "whose replies are consistently the largest")

    def fit_metric_keys(self, replies: list[ClientReply]) -> list[str]:
        """Numeric fit metrics to summarise (all but bookkeeping)."""
        keys = {k for r in replies for k, v in r.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return sorted(keys - {"partition_id"})

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        valid: list[tuple[ClientProxy, EvaluateRes]] = []
        for proxy, res in in_partition_order(results):
            partition = _partition_id(dict(res.metrics))
            if partition is not None and 0 <= partition < self.num_clients:
                self.partition_of[proxy.cid] = partition  # a node that joined since the fit round
            if res.num_examples > 0 and np.isfinite(res.loss):
                valid.append((proxy, res))
            else:
                log(WARNING, "round %d: rejected evaluation of client %s (loss %s, %d examples)",
                    self.run_round(server_round), proxy.cid, res.loss, res.num_examples)
        metrics: dict[str, Any] = {"num_failures": float(len(failures) + len(results) - len(valid))}
        if self.refuses_failures(len(failures) + len(results) - len(valid)):
            log(WARNING, "round %d: failed or rejected evaluations and accept_failures=False: the evaluation "
                "is not aggregated", self.run_round(server_round))
            self._notify(server_round, "evaluate", metrics, {})
            return None, metrics
        if not valid:
            self._notify(server_round, "evaluate", metrics, {})
            return None, metrics
        self.warn_if_collapsed(server_round, [dict(r.metrics) for _, r in valid])
        per_client = [(r.num_examples, {**r.metrics, "loss": r.loss}) for _, r in valid]
        metrics |= aggregate_client_metrics(per_client)
        loss = metrics.get("loss_wmean")
        metrics |= self._user_metrics("evaluate_metrics_aggregation_fn", [(r.num_examples, dict(r.metrics)) for _, r in valid])
        who = [(proxy.cid, self.reply_partition(proxy.cid, _partition_id(dict(r.metrics)))) for proxy, r in valid]
        clients = {pid: {**r.metrics, "loss": r.loss, "num_examples": r.num_examples}
                   for (_, pid), (_, r) in zip(who, valid) if pid is not None}
        self._replied = ("evaluate", server_round, who)
        self._notify(server_round, "evaluate", metrics, clients)
        log(INFO, "round %d: %s", self.run_round(server_round), _headline(metrics))
        return loss, metrics

    def server_head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (weight, bias) of a linear head that the global model implies for a user's model
        whose head is not on the wire, or None (the head stays as the user gave it). pFedFDA's
        global statistics imply one; the Message-API strategies put it in what they hand back
        (:meth:`~flwr_pfl.serverapp.strategy.PFLMessageStrategy.record`)."""
        return None

    def warn_if_collapsed(self, server_round: int, clients: list[dict[str, Any]]) -> None:
        """A WARNING when at least half of the evaluated clients' models predicted one class for
        all their test samples although these hold several (their metric
        :data:`~flwr_pfl.core.metrics.ONE_CLASS`): their accuracy is only the majority class's
        share, and the run would otherwise read like a slow one."""
        collapsed = sum(1 for c in clients if c.get(ONE_CLASS))
        if collapsed and 2 * collapsed >= len(clients):
            log(WARNING, "round %d: %d of %d evaluated clients' models predict one class for all their test samples, "
                "which hold several: these models have collapsed and their accuracy is the majority class's share. The "
                "training diverged or stalled, or %s's classifier cannot separate the model's features: try another "
                "learning rate, or another algorithm for this model", self.run_round(server_round), collapsed,
                len(clients), type(self).__name__)

    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        if phase in ("fit", "evaluate"):  # recorded, not returned to Flower: the results rows say who took part
            metrics = {**metrics, **self._participation(server_round, phase, clients)}
        if self.on_round is not None:
            self.on_round(self.run_round(server_round), phase, metrics, clients)
        if phase not in EVALUATION_PHASES:
            self.check_trained(server_round, phase, metrics)

    def check_trained(self, server_round: int, phase: str, metrics: Mapping[str, Any]) -> None:
        """Stop a run that has not trained and cannot (``stop_if_nothing_trains``): a training
        phase that lost every reply it asked for (:func:`lost_replies`, none accepted) before
        any phase of the run accepted one.

        Raises:
            NoTrainingError: naming the strategy, the round and phase, and quoting the clients'
                errors of the round's fit aggregation.
        """
        if accepted_replies(metrics) > 0:
            self._trained = True
            return
        if self._trained or not self.stop_if_nothing_trains or not self.accept_failures or lost_replies(metrics) == 0:
            return  # accept_failures=False leaves rounds unaggregated on purpose, also where some clients trained
        failures = list(self._fit_failures)
        quoted = (f"the clients' errors ({len(failures)}): {describe_failures(failures)}" if failures
                  else "the clients' errors are logged above")
        raise NoTrainingError(
            f"{type(self).__name__}, round {self.run_round(server_round)} ({phase}): every client asked to train failed or "
            f"was rejected, and no round has trained yet; {quoted}. An error every client raises at the start repeats in "
            "every round, so the run stops here rather than end as completed with the initial model. Fix the cause and "
            "start again (stop_if_nothing_trains=False goes on instead)"
        )

    def reply_partition(self, cid: str, reported: int | None) -> int | None:
        """The partition id a reply from node ``cid`` is recorded under: the one it reports (>= 0),
        else the one learned for its node, else None (a client from outside the suite, e.g. a
        Flower user's own NumPyClient, that never says: it is then known by its node id)."""
        if reported is not None and reported >= 0:
            return reported
        return self.partition_of.get(cid)

    def _participation(self, server_round: int, phase: str, clients: dict[int, dict[str, Scalar]]) -> dict[str, Any]:
        """Who took part in this aggregation and who was sampled but dropped (no reply in time,
        left, an error, a rejected reply).

        The base class's aggregations name each accepted reply by its node id and partition id
        (None where unknown), so that replies without a partition id count once each and their
        nodes are not taken for dropped; they are listed as ``node-<id>``. An aggregation of a
        subclass that records only ``clients`` (partition id -> metrics) is judged by those
        partition ids. The dropped ones are logged by partition id, or by node id when their
        partition is unknown."""
        replied = self._replied
        self._replied = None
        if replied is not None and replied[:2] == (phase, server_round):
            who = replied[2]
        else:
            who = [(None, pid) for pid in clients]
        known = sorted(pid for _, pid in who if pid is not None and pid >= 0)
        unknown = sorted(str(cid) for cid, pid in who if cid is not None and (pid is None or pid < 0))
        taken = " ".join([*(str(pid) for pid in known), *(_who(cid, None) for cid in unknown)])
        out: dict[str, Any] = {"participants": float(len(who)), "participant_ids": taken}
        sampled = self._sampled_nodes.pop(phase, None)
        sent = self._sent_at.pop(phase, None)
        if sampled is None:  # this aggregation did not follow a sample of the base class
            return out
        if sent is not None:
            out["exchange_seconds"] = time.perf_counter() - sent
            self.warn_near_timeout(server_round, phase, out["exchange_seconds"])
        replied_nodes = {cid for cid, _ in who if cid is not None}
        replied_partitions = set(known)

        def answered(cid: str) -> bool:
            partition = self.partition_of.get(cid)
            return cid in replied_nodes or (partition is not None and partition in replied_partitions)

        dropped = [(self.partition_of.get(cid), cid) for cid in sampled if not answered(cid)]
        dropped.sort(key=lambda d: (d[0] is None, d[0] or 0, d[1]))
        out["num_dropped"] = float(len(dropped))
        out["dropped_ids"] = " ".join(_who(cid, partition) for partition, cid in dropped)
        if dropped:
            log(WARNING, "round %d: %s: %d of %d sampled clients dropped (no reply in time, left, failed or "
                "rejected): %s; going on with partitions [%s]", self.run_round(server_round), phase,
                len(dropped), len(sampled), out["dropped_ids"], taken)
        return out

    #: the share of ``round_timeout`` an exchange of healthy nodes may take before the run warns
    TIMEOUT_MARGIN = 0.5

    def warn_near_timeout(self, server_round: int, phase: str, seconds: float) -> None:
        """Warn, once per phase, when an exchange took more than :attr:`TIMEOUT_MARGIN` of
        ``round_timeout``: a node answering within the limit today is dropped, and counted as
        failed, the day the host is busier (docs/deployment.md, *round-timeout*)."""
        limit = self.round_timeout
        if limit is None or phase in self._timeout_warned or seconds <= self.TIMEOUT_MARGIN * limit:
            return
        self._timeout_warned.add(phase)
        log(WARNING, "round %d: %s took %.1f s, %.0f%% of round-timeout=%g s: a node this slow on a busier host "
            "misses the limit and is dropped from its round; set round-timeout to at least %.0f s (3 times this "
            "exchange) or 0 (no limit)", self.run_round(server_round), phase, seconds, 100 * seconds / limit, limit,
            math.ceil(3 * seconds))

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the global arrays, the rounds already done and the
        partition ids learned (node id -> partition id; a node that comes back under another id
        is asked again). Subclasses add their own state; what a checkpoint can hold is listed in
        :mod:`flwr_pfl.app.checkpoint`."""
        state = {
            "global_arrays": [a.copy() for a in (self.global_arrays or [])],
            "round_offset": self.round_offset,
            "partition_of": dict(self.partition_of),
        }
        if self.private is not None:
            state["client_dp"] = self.private.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Resume from :meth:`state_dict`; the next round is numbered ``rounds_done + 1``.

        The state is checked before anything is loaded (:meth:`check_loaded_state`), so that a
        checkpoint of another model, or a damaged one whose archive still reads, is refused with
        its cause instead of being sent to every client, each of which then fails.
        """
        arrays = self.check_loaded_state(state, rounds_done)
        try:
            partition_of = {str(cid): int(pid) for cid, pid in state.get("partition_of", {}).items()}
        except (AttributeError, TypeError, ValueError) as err:
            raise ConfigError(f"the checkpoint's partition_of is not a map of node ids to partition ids: {err}") from None
        if self.private is not None:
            if "client_dp" not in state:
                raise ConfigError("client-level DP is on but the checkpoint holds no privacy state: it was written by a run "
                                  "without it, whose releases were not accounted; start a new run")
            self.private.load_state_dict(state["client_dp"])
        self.global_arrays = arrays
        self.initial_parameters = ndarrays_to_parameters(self.global_arrays)
        self.round_offset = rounds_done
        self.partition_of = partition_of

    def check_loaded_state(self, state: dict[str, Any], rounds_done: int) -> NDArrays:
        """The global arrays of ``state``, once checked against this strategy.

        ``rounds_done`` must be an integer >= 0; every global array must hold finite values only
        (a checkpoint is written after an aggregation that accepted finite replies only); and
        where this strategy already holds global arrays (its ``initial_arrays``: the model it
        was built for) the state's must match them in number, and each in shape and dtype.

        Raises:
            ConfigError: naming the entry (``global_arrays[i]``, a checkpoint's ``global_<i>``),
                what was expected and what was found; nothing is loaded.
        """
        if isinstance(rounds_done, bool) or not isinstance(rounds_done, (int, np.integer)) or rounds_done < 0:
            raise ConfigError(f"the checkpoint's rounds_done is {rounds_done!r}: a resume needs the number of rounds done, "
                              "an integer >= 0")
        if "global_arrays" not in state:
            raise ConfigError("the checkpoint's state has no global_arrays: it was not written by a flwr_pfl strategy")
        arrays = [np.asarray(a) for a in state["global_arrays"]]
        for i, array in enumerate(arrays):
            entry = f"global_arrays[{i}] (checkpoint entry global_{i})"
            if array.dtype == object:
                raise ConfigError(f"the checkpoint's {entry} holds Python objects, not numbers")
            if (np.issubdtype(array.dtype, np.inexact)) and not np.all(np.isfinite(array)):
                bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
                raise ConfigError(f"the checkpoint's {entry} holds {bad} non-finite value(s) (NaN or Inf): a damaged or "
                                  "foreign checkpoint; resume from another one or start the run anew")
        current = self.global_arrays
        if current is not None:
            if len(arrays) != len(current):
                raise ConfigError(f"the checkpoint holds {len(arrays)} global arrays but the strategy's model has "
                                  f"{len(current)}: it was written for another model or algorithm; resume with the "
                                  "model and algorithm it was written with")
            for i, (array, own) in enumerate(zip(arrays, current)):
                if array.shape != np.shape(own) or array.dtype != np.asarray(own).dtype:
                    raise ConfigError(
                        f"the checkpoint's global_arrays[{i}] (checkpoint entry global_{i}) is {array.dtype}{array.shape}, "
                        f"but the model's global array {i} is {np.asarray(own).dtype}{np.shape(own)}: the checkpoint "
                        "does not match the model; resume with the model it was written with"
                    )
        return arrays


def securely_summed(replies: list[ClientReply], previous: NDArrays | None) -> NDArrays:
    """The aggregate that SecAgg+ put into every reply (the example-weighted mean of the
    clients' arrays, dequantized as float64), in the dtypes of the ``previous`` global arrays
    (integer arrays rounded).

    Raises:
        RuntimeError: when the replies do not all carry one aggregate (they did not come
            through the protocol, whose result this reads).
    """
    arrays = replies[0].arrays
    for reply in replies[1:]:
        if len(reply.arrays) != len(arrays) or not all(np.array_equal(a, b) for a, b in zip(reply.arrays, arrays)):
            raise RuntimeError("secure aggregation: the fit replies do not all carry the same aggregate; they did not "
                               "come through the SecAgg+ protocol (run them with secure-aggregation='off')")
    dtypes = [np.asarray(g).dtype for g in previous] if previous is not None else [a.dtype for a in arrays]
    return [np.rint(a).astype(d) if not np.issubdtype(d, np.floating) else a.astype(d) for a, d in zip(arrays, dtypes)]


def check_unclaimed(cid: str, reported: Any, claimed: set[int]) -> None:
    """ReplyError when a reply reports a partition id that an accepted reply of the same
    exchange already holds. Called before the reply is checked, since checking it teaches the
    strategy the node's partition (and, for some, its counts)."""
    if isinstance(reported, (int, float)) and not isinstance(reported, bool) and reported in claimed:
        raise ReplyError(f"client {cid}: a second reply for partition {reported} this round")


def _partition_id(answer: dict[str, Scalar] | BaseException) -> int | None:
    """The ``partition_id`` of a ``get_properties`` answer, or None."""
    if isinstance(answer, BaseException):
        return None
    try:
        return int(answer["partition_id"])
    except (KeyError, TypeError, ValueError):
        return None


def _who(cid: str, partition: int | None) -> str:
    """A dropped client as recorded: its partition id when known, else ``node-<id>``."""
    return str(partition) if partition is not None else f"node-{cid}"


def _headline(metrics: dict[str, float]) -> str:
    keys = ("accuracy_wmean", "accuracy_min", "loss_wmean", "acc_domain_min")
    return ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics)
