"""pFedFDA's Strategy (McLaughlin & Su, NeurIPS 2024, Alg. 1): data movement and server state.

The mathematics (initial statistics, Bernoulli participation, checks and aggregation of the
Gaussian statistics, summaries) lives in :mod:`flwr_pfl.core.pfedfda`.

Wire layout (C classes, d feature width; float32; the classifier head is never sent)
-------------------------------------------------------------------------------------
* get_parameters (initial, from one client):
  ``[backbone arrays..., mu (C, d), Sigma]``; the server replaces (mu, Sigma) with its own
  initial statistics (Alg. 1 line 2: mu_g^0 ~ U[0,1) or N(0,1), Sigma_g^0 = I).
* fit instruction (server -> every sampled client, identical for all):
  ``[backbone arrays..., mu_g (C, d), Sigma_g]``; config ``server-round``.
* fit reply (client -> server): ``[trained backbone arrays..., mu_i (C, d), Sigma_i]``,
  the interpolated statistics of Alg. 1 lines 10-11; ``num_examples = n_i`` (training-split
  size); metrics ``partition_id``, ``train_loss``, ``train_seconds``, ``stats_seconds``,
  ``beta_mu``, ``beta_sigma``, ``beta_fallback`` (0/1), ``n_feats``.
* evaluate instruction: the global arrays as in fit; config ``server-round``.
* evaluate reply: loss and ``num_examples = n_test`` of the personalized LDA head on the
  client's test split; metrics ``accuracy``, ``beta_mu``, ``beta_sigma``, ``beta_fallback``,
  ``n_train``, ``domain`` (the most frequent domain of the client's training split),
  ``partition_id``.
* get_properties (once per client, to learn the partition id): reply ``partition_id``.

Sigma is (d, d), or its upper triangle (d(d+1)/2,) row-major with ``packed_cov=True`` (Table 8's
accounting); both sides must agree. Server aggregation (Alg. 1 line 15) is the n_i-weighted
mean of every array.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    log,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from flwr_pfl.core.aggregation import weighted_average
from flwr_pfl.core.metrics import summarize
from flwr_pfl.core.pfedfda import (
    COLLAPSED_SEPARATION,
    aggregate_statistics,
    bernoulli_participation,
    check_client_statistics,
    client_accuracy_summary,
    global_statistics_summary,
    init_global_statistics,
    join_wire,
    lda_head,
    nearest_psd,
    split_wire,
)
from flwr_pfl.errors import ConfigError, ReplyError
from flwr_pfl.strategies.base import NDArrays, PFLStrategy
from flwr_pfl.strategies.sampling import in_partition_order, sample_indices, sampling_rng
from flwr_pfl.strategies.validation import ClientReply, Scalar

SAMPLING_MODES = ("bernoulli", "fixed")


class PFedFDA(PFLStrategy):
    """pFedFDA's server: global backbone phi_g and Gaussian statistics (mu_g, Sigma_g).

    Args:
        sampling: ``bernoulli`` (each training client independently with probability
            q = ``fraction_fit``, the paper's scheme; an empty draw becomes one client) or
            ``fixed`` (a fixed ``fraction_fit`` share, as Flower's FedAvg).
        full_last_round: every training client takes part in the last round (paper App. C.2);
            needs ``num_rounds`` (refused without it: Flower does not tell a strategy which
            round is the last, and skipping the full round silently changes the algorithm).
        eval_every: evaluate every this many rounds and after the last (0: only the last;
            :class:`PFLStrategy`'s). The last evaluation covers every client, including those
            never sampled.
        mean_init: ``uniform`` (official code) or ``gaussian`` (paper) initial means.
        train_clients: only partitions below this train (0: all); the rest are new clients,
            evaluated without ever training (Table 4 protocol).
        packed_cov: Sigma travels as its upper triangle.
        **kwargs: :class:`PFLStrategy`'s arguments (``num_clients``, ``fraction_fit`` = q,
            ``num_rounds``: the run's total rounds, ``seed``: seeds the per-round sampling and
            the initial means, Flower's FedAvg arguments, ...). ``min_fit_clients`` other than 1
            is refused with Bernoulli sampling, which draws every client independently.
    """

    name = "pfedfda"
    #: Alg. 1 line 15 is FedAvg over the whole wire list [phi, mu, Sigma]: client-level DP clips
    #: each client's update of all three together and releases their noised mean (Sigma_g then
    #: projected to the nearest PSD matrix, post-processing); the statistics are never sent
    #: around the mechanism
    client_dp_refusal = ""
    robust_refusal = ("pFedFDA's replies carry feature statistics (class means, and a covariance that must stay "
                      "positive semi-definite) beside the backbone; of the bounds on each reply, only client-level DP "
                      "(dp-noise-multiplier), which releases the statistics with the backbone, is implemented for them")

    def __init__(
        self,
        *,
        sampling: str = "bernoulli",
        full_last_round: bool = True,
        eval_every: int = 1,
        mean_init: str = "uniform",
        train_clients: int = 0,
        packed_cov: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(eval_every=eval_every, **kwargs)
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
        if train_clients < 0:
            raise ValueError("train_clients must be >= 0")
        if mean_init not in ("uniform", "gaussian"):
            raise ValueError(f"mean_init must be 'uniform' or 'gaussian', got {mean_init!r}")
        if sampling == "bernoulli" and self.min_fit_clients != 1:
            raise ConfigError(
                f"min_fit_clients={self.min_fit_clients} does not apply to pFedFDA's Bernoulli participation (each "
                "client takes part with probability q = fraction_fit, independently; an empty draw becomes one "
                "client): use sampling='fixed' for a minimum number of clients"
            )
        if full_last_round:
            self.require_num_rounds("full_last_round=True (every client trains in the last round, App. C.2)",
                                    "full_last_round=False")
        self.sampling = sampling
        self.full_last_round = full_last_round
        self.mean_init = mean_init
        self.train_clients = train_clients
        self.packed_cov = packed_cov
        self._extra: dict[str, dict[str, float]] = {}
        self._collapse_reported = False

    # ---------------------------------------------------------------- helpers
    def split(self, arrays: NDArrays) -> tuple[NDArrays, np.ndarray, np.ndarray]:
        """(backbone, mu (C, d), Sigma (d, d)) of a message."""
        return split_wire(arrays, packed_cov=self.packed_cov)

    def server_head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The global generative classifier as a linear head: the LDA head (Eq. 4) of the global
        statistics (mu_g, Sigma_g) with uniform class priors and the clients' default
        shrinkage. Each client's own head uses its interpolated statistics and its label
        priors instead; this one is what a server without any client's data can say."""
        if self.global_arrays is None:
            return None
        _, mu, sigma = self.split(self.global_arrays)
        priors = np.full(mu.shape[0], 1.0 / mu.shape[0])
        weight, bias = lda_head(mu.astype(np.float64), sigma.astype(np.float64), priors)
        return weight.numpy(), bias.numpy()  # float64: the caller casts to the model's dtype

    def initial_global_arrays(self, parameters: Parameters) -> NDArrays:
        """The first global arrays: the client's backbone with the server's mu_g^0, Sigma_g^0."""
        backbone, mu, _ = self.split(parameters_to_ndarrays(parameters))
        mu0, sigma0 = init_global_statistics(mu.shape[0], mu.shape[1], init=self.mean_init, seed=self.seed)  # type: ignore[arg-type]
        return join_wire(backbone, mu0, sigma0, packed_cov=self.packed_cov)

    # ---------------------------------------------------------------- instructions
    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        if self.global_arrays is None:
            self.global_arrays = self.initial_global_arrays(parameters)
        parameters = ndarrays_to_parameters(self.global_arrays)
        clients = self.all_clients(server_round, client_manager)
        if self.train_clients:
            clients = [p for p in clients if 0 <= self.partition_of.get(p.cid, -1) < self.train_clients]
            if not clients:
                raise RuntimeError(f"train_clients={self.train_clients} leaves no client with a known partition id to train")
        last = self.full_last_round and self.is_last_round(server_round)
        rng = sampling_rng(self.seed, "fit", self.run_round(server_round))
        if self.sampling == "bernoulli":
            chosen = bernoulli_participation(len(clients), self.fraction_fit, rng, full=last)
        elif last:
            chosen = np.arange(len(clients))
        else:
            size = max(int(len(clients) * self.fraction_fit), self.min_fit_clients, 1)
            chosen = sample_indices(len(clients), size, rng)
        selected = [clients[i] for i in chosen]
        self.record_sample("fit", selected)
        log(INFO, "round %d: %d of %d clients sampled%s", self.run_round(server_round), len(selected), len(clients), " (last round: all)" if last else "")
        return self.fit_instructions(server_round, parameters, selected)

    def evaluation_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        """The base schedule and sample, except that the last round (always due) evaluates every
        client, as the paper does."""
        if self.fraction_evaluate > 0.0 and self.is_last_round(server_round):
            return self.all_clients(server_round, client_manager)
        return super().evaluation_clients(server_round, client_manager)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Every evaluating client gets the strategy's current global arrays (body and statistics)."""
        if self.global_arrays is not None:
            parameters = ndarrays_to_parameters(self.global_arrays)
        return super().configure_evaluate(server_round, parameters, client_manager)

    # ---------------------------------------------------------------- replies
    def check_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> ClientReply:
        """The base checks (count, shapes, NaN, num_examples), then the statistics: shapes,
        finiteness, symmetry and positive semi-definiteness of Sigma_i."""
        reply = super().check_reply(server_round, proxy, res)
        _, mu_g, _ = self.split(self.global_arrays or [])
        try:
            _, mu, sigma = self.split(reply.arrays)
            check_client_statistics(mu, sigma, mu_g.shape[0], mu_g.shape[1])
        except ValueError as err:
            raise ReplyError(f"client {proxy.cid} (partition {reply.partition_id}): {err}") from None
        return reply

    def aggregate_replies(self, server_round: int, replies: list[ClientReply]) -> NDArrays:
        """Alg. 1 line 15: n_i-weighted means of phi, mu and Sigma (FedAvg over the extended list).

        With client-level DP, the base class's private mean of the whole list instead
        (:meth:`~flwr_pfl.strategies.base.PFLStrategy.private_aggregate`: each client's update
        of phi, mu and Sigma clipped together, uniform over the sampled clients, noised), with
        the released Sigma_g made PSD again (:func:`~flwr_pfl.core.pfedfda.server.nearest_psd`)."""
        if self.private is not None:
            backbone, mu, sigma = self.split(self.private_aggregate(server_round, replies))
            sigma = nearest_psd(sigma)
        else:
            counts = [r.num_examples for r in replies]
            parts = [self.split(r.arrays) for r in replies]
            backbone = weighted_average([p[0] for p in parts], counts) if parts[0][0] else []
            mu, sigma = aggregate_statistics([p[1] for p in parts], [p[2] for p in parts], counts)
        self._extra["fit"] = summary = global_statistics_summary(mu, sigma)  # ||mu_g||, Sigma_g, separation
        self.report_collapse(server_round, summary["mu_g_separation"])
        return join_wire(backbone, mu, sigma, packed_cov=self.packed_cov)

    def report_collapse(self, server_round: int, separation: float) -> None:
        """Warn, once per run, when the global class means have merged (``mu_g_separation`` below
        :data:`~flwr_pfl.core.pfedfda.server.COLLAPSED_SEPARATION`): the backbone's features no
        longer separate the classes, and under the LDA head no later round can undo it
        (:func:`~flwr_pfl.core.pfedfda.server.class_separation`). The metric is logged every round."""
        if self._collapse_reported or not separation < COLLAPSED_SEPARATION:
            return
        self._collapse_reported = True
        log(WARNING, "round %d: the global class means are %.3g feature standard deviations apart (a collapse "
            "below %g): the backbone's features no longer separate the classes, the LDA head passes no gradient "
            "back to them, and accuracy will stay at what the label prior predicts. Usual cause: too large a "
            "learning rate; rerun with a smaller learning-rate.", self.run_round(server_round), separation, COLLAPSED_SEPARATION)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """The base aggregation, with the global statistics' summary in the returned metrics."""
        self._extra.pop("fit", None)
        parameters, metrics = super().aggregate_fit(server_round, results, failures)
        if parameters is not None and self.global_arrays is not None:
            _, mu, sigma = self.split(self.global_arrays)
            metrics = {**metrics, **global_statistics_summary(mu, sigma)}
        return parameters, metrics

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        """The base summaries plus the paper's: accuracy mean (std, Bessel) across clients, and
        beta for clean (domain 0) vs shifted clients and for clients never trained."""
        valid = [r for _, r in in_partition_order(results) if r.num_examples > 0 and np.isfinite(r.loss)]
        if self.refuses_failures(len(failures) + len(results) - len(valid)):
            return super().aggregate_evaluate(server_round, results, failures)  # not aggregated
        summary = self._evaluate_summary(valid)
        self._extra["evaluate"] = summary  # merged into what the results writer sees
        loss, metrics = super().aggregate_evaluate(server_round, results, failures)
        return loss, {**metrics, **summary}

    def _evaluate_summary(self, valid: list[EvaluateRes]) -> dict[str, float]:
        out: dict[str, float] = {}
        acc = [(float(r.metrics["accuracy"]), r.num_examples) for r in valid if "accuracy" in r.metrics]
        if acc:
            summary = client_accuracy_summary([a for a, _ in acc], [n for _, n in acc])
            out["accuracy_std_bessel"] = summary["std_bessel"]
        groups: dict[str, list[EvaluateRes]] = {}
        for r in valid:
            if "beta_mu" not in r.metrics:
                continue
            groups.setdefault("clean" if int(r.metrics.get("domain", 0)) == 0 else "shifted", []).append(r)
            if self.train_clients:
                pid = int(r.metrics.get("partition_id", -1))
                groups.setdefault("new" if pid >= self.train_clients else "trained", []).append(r)
        if len(groups.get("clean", [])) and len(groups.get("shifted", [])) or self.train_clients:
            for name, members in groups.items():
                out[f"beta_mu_{name}_mean"] = summarize([float(r.metrics["beta_mu"]) for r in members])["mean"]
                out[f"accuracy_{name}_mean"] = summarize([float(r.metrics.get("accuracy", np.nan)) for r in members])["mean"]
        return out

    def _notify(self, server_round: int, phase: str, metrics: dict[str, float], clients: dict[int, dict[str, Scalar]]) -> None:
        super()._notify(server_round, phase, {**metrics, **self._extra.pop(phase, {})}, clients)

    # ---------------------------------------------------------------- state
    # The base state (global arrays = backbone + mu_g + Sigma_g, learned partition ids) is all
    # of it: sampling needs no state (each round's generator is derived from the seed and the
    # round), the last round is counted from round_offset, and _extra lives within one round.
