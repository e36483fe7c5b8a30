"""Client-level differential privacy of what the clients share (DP-FedAvg), for the strategies
whose aggregate is a mean of the global arrays trained further.

:class:`ClientLevelDP` holds the settings (checked before training) and
:class:`PrivateAggregator` does one round's release with the maths of :mod:`flwr_pfl.core.dp`
and accounts it with Flower's own Renyi-DP accountant (:class:`flwr.serverapp.RdpAccountant`,
which wraps Google's ``dp-accounting``).

What is private, precisely: the sequence of global arrays the server releases satisfies
(epsilon, delta)-DP with respect to adding or removing one client's whole dataset, where epsilon
is reported after every round for the run's delta. It holds against anyone who sees the global
arrays (every client, an export), provided the noise is secret (the default: drawn from the
operating system's entropy). It does not cover what each client sends in the clear: its update
before noise (the server sees it; secure aggregation is what hides it), its example count and
its training metrics. Accounting assumes no amplification by sampling: the suite samples
clients from a seeded generator (every rerun samples the same clients), so which clients a round
takes is not secret and amplification would not hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from flwr_pfl.core.dp import (
    COUNT_STDDEV_PER_CLIENT,
    adapt_clip_norm,
    noise_std,
    noisy_unclipped_fraction,
    private_mean,
    update_noise_multiplier,
)
from flwr_pfl.errors import ConfigError

#: how to install what the accountant needs
PRIVACY_EXTRA = 'pip install "flwr_pfl[privacy]" (Flower\'s "flwr[dp]": Google\'s dp-accounting)'


@dataclass(frozen=True)
class ClientLevelDP:
    """Settings of client-level DP (run keys ``dp-*``, see :mod:`flwr_pfl.app.config`).

    Args:
        noise_multiplier: ``z``, the noise's standard deviation over the clipping norm (> 0).
        clip_norm: ``C``, each client's update is scaled to at most this L2 norm (> 0); the
            initial value when ``adaptive``.
        adaptive: move ``C`` towards the ``target_quantile`` of the update norms each round
            (Andrew et al. 2021), spending part of the budget on the noised count.
        target_quantile: ``gamma``, the share of updates meant to fit within ``C``, in (0, 1).
        clip_learning_rate: ``eta`` of the geometric update (> 0).
        count_stddev: ``sigma_b``, the noise on the count of unclipped updates; None:
            ``m / 20`` (the paper's default). Must exceed ``z / 2``.
        delta: the delta at which epsilon is reported, in (0, 1 / num_clients).
        max_epsilon: refuse, before training, a run whose planned rounds would spend more
            (None: no limit).
        noise_seed: None (default): the noise is drawn from the operating system's entropy, so
            that nobody can subtract it. An integer makes it repeatable (tests, experiments on
            public data) and therefore not private against anyone who knows the seed.
    """

    noise_multiplier: float
    clip_norm: float
    adaptive: bool = False
    target_quantile: float = 0.5
    clip_learning_rate: float = 0.2
    count_stddev: float | None = None
    delta: float = 1e-5
    max_epsilon: float | None = None
    noise_seed: int | None = None

    def check(self, num_clients: int) -> None:
        """ConfigError naming the setting, what it was and what is allowed."""
        if not self.noise_multiplier > 0:
            raise ConfigError(f"{type(self).__name__}(noise_multiplier={self.noise_multiplier}) (run config dp-noise-multiplier): a noise multiplier of 0 adds no noise and "
                              "gives no privacy; use a value > 0 (about 1 for a useful guarantee), or leave client-level "
                              "DP off (clip-update-norm bounds a client's pull without claiming privacy)")
        if not self.clip_norm > 0:
            raise ConfigError(f"{type(self).__name__}(clip_norm={self.clip_norm}) (run config dp-clip-norm): client-level DP needs a clipping norm > 0 (the sensitivity "
                              "that the noise is scaled to)")
        if not 0 < self.delta < 1 / num_clients:
            raise ConfigError(f"{type(self).__name__}(delta={self.delta}) (run config dp-delta): delta must be in (0, 1/num_clients = {1 / num_clients:.3g}); a "
                              "delta of 0 has no finite epsilon for the Gaussian mechanism, and one of 1/N or more allows "
                              "releasing a client's data outright")
        if self.max_epsilon is not None and not self.max_epsilon > 0:
            raise ConfigError(f"{type(self).__name__}(max_epsilon={self.max_epsilon}) (run config dp-max-epsilon): must be > 0, or 0 for no limit")
        if self.adaptive:
            if not 0 < self.target_quantile < 1:
                raise ConfigError(f"{type(self).__name__}(target_quantile={self.target_quantile}) (run config dp-target-quantile): must be in (0, 1)")
            if not self.clip_learning_rate > 0:
                raise ConfigError(f"{type(self).__name__}(clip_learning_rate={self.clip_learning_rate}) (run config dp-clip-learning-rate): must be > 0")
            if self.count_stddev is not None and not self.count_stddev > self.noise_multiplier / 2:
                raise ConfigError(f"{type(self).__name__}(count_stddev={self.count_stddev}) (run config dp-count-stddev): must exceed dp-noise-multiplier / 2 "
                                  f"= {self.noise_multiplier / 2} (Andrew et al., Thm. 1), or 0 for m / 20")


def _accountant(delta: float, num_clients: int) -> Any:
    """Flower's RDP accountant for add-or-remove-one clients, without amplification by sampling."""
    try:
        from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
        accountant = RdpAccountant(PrivacyConfig(
            target_delta=delta, population_size=num_clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        ))
    except ImportError as err:
        raise ConfigError(f"client-level DP accounts privacy with Flower's RDP accountant, which is not installed "
                          f"({err}); {PRIVACY_EXTRA}") from None
    return accountant


def _event(noise_multiplier: float, num_sampled: int, num_clients: int) -> Any:
    """One round's release for Flower's accountant: a Gaussian with multiplier ``z`` over ``m`` clients."""
    from flwr.serverapp import GaussianPrivacyEvent
    return GaussianPrivacyEvent(noise_multiplier=noise_multiplier, sample_size=num_sampled, population_size=num_clients)


def _replayed(delta: float, num_clients: int, releases: list[tuple[float, int]]) -> Any:
    """A fresh accountant that has composed ``releases`` ((z, m) per round)."""
    accountant = _accountant(delta, num_clients)
    for z, m in releases:
        accountant.compose(_event(z, m, num_clients))
    return accountant


class PrivateAggregator:
    """One run's client-level DP: each round's release (clip, sum, noise, divide by the sampled
    count), the adaptive clipping norm, and the privacy spent so far."""

    def __init__(self, settings: ClientLevelDP, num_clients: int, num_sampled: int) -> None:
        """``num_sampled``: the clients a round is planned to sample (it sets ``m / 20``, the
        default noise of the adaptive count, once for the run)."""
        settings.check(num_clients)
        self.settings = settings
        self.num_clients = num_clients
        self.clip_norm = settings.clip_norm
        #: the adaptive count's noise sigma_b, and the updates' noise multiplier z_u (Thm. 1)
        self.count_stddev = settings.count_stddev or COUNT_STDDEV_PER_CLIENT * num_sampled
        self.update_multiplier = settings.noise_multiplier
        if settings.adaptive:
            try:
                self.update_multiplier = update_noise_multiplier(settings.noise_multiplier, self.count_stddev)
            except ValueError:
                raise ConfigError(
                    f"adaptive clipping with {num_sampled} clients per round: the noise on the count of unclipped updates "
                    f"(dp-count-stddev, default clients / 20 = {self.count_stddev:.4g}) must exceed dp-noise-multiplier / 2 "
                    f"= {settings.noise_multiplier / 2:.4g} (Andrew et al., Thm. 1); set dp-count-stddev above it, or "
                    f"sample at least {math.floor(10 * settings.noise_multiplier) + 1} clients per round") from None
        #: (noise multiplier, sampled clients) of every round released so far
        self.releases: list[tuple[float, int]] = []
        self.accountant = _accountant(settings.delta, num_clients)

    def epsilon(self) -> float:
        """The epsilon spent by the rounds released so far, at the settings' delta (0 before any)."""
        return self.accountant.get_epsilon(self.settings.delta) if self.releases else 0.0

    def planned_epsilon(self, rounds: int, num_sampled: int) -> float:
        """The epsilon that ``rounds`` more releases of ``num_sampled`` clients would bring the
        run to (this run's accountant is not changed)."""
        planned = self.releases + [(self.settings.noise_multiplier, num_sampled)] * rounds
        if not planned:
            return 0.0
        return _replayed(self.settings.delta, self.num_clients, planned).get_epsilon(self.settings.delta)

    def check_budget(self, rounds: int, num_sampled: int) -> None:
        """ConfigError, before training, when ``rounds`` more rounds would spend more than ``max_epsilon``."""
        limit = self.settings.max_epsilon
        if limit is None:
            return
        planned = self.planned_epsilon(rounds, num_sampled)
        if planned > limit:
            raise ConfigError(f"client-level DP: {rounds} rounds of {num_sampled} clients with dp-noise-multiplier="
                              f"{self.settings.noise_multiplier} spend epsilon={planned:.4g} at delta={self.settings.delta}, "
                              f"more than dp-max-epsilon={limit}; raise the noise multiplier or run fewer rounds")

    def _rng(self, run_round: int) -> np.random.Generator:
        seed = self.settings.noise_seed
        return np.random.default_rng() if seed is None else np.random.default_rng([seed, run_round])

    def release(self, updates: list[list[np.ndarray]], num_sampled: int, run_round: int) -> tuple[list[np.ndarray], dict[str, float]]:
        """The round's private mean update of the clients' ``updates`` (float arrays, the shared
        part only) and the metrics it may publish (each computed from noised values only)."""
        settings = self.settings
        rng = self._rng(run_round)
        used_clip = self.clip_norm
        z = self.update_multiplier
        mean, bits = private_mean(updates, used_clip, z, num_sampled, rng)
        metrics = {"dp_clip_norm": used_clip, "dp_noise_std": noise_std(z, used_clip, num_sampled)}
        if settings.adaptive:
            fraction = noisy_unclipped_fraction(bits, self.count_stddev, num_sampled, rng)
            self.clip_norm = adapt_clip_norm(used_clip, fraction, settings.target_quantile, settings.clip_learning_rate)
            metrics["dp_unclipped_fraction"] = fraction
        self.accountant.compose(_event(settings.noise_multiplier, num_sampled, self.num_clients))
        self.releases.append((settings.noise_multiplier, num_sampled))
        metrics |= {"dp_epsilon": self.epsilon(), "dp_delta": settings.delta}
        return mean, metrics

    def state_dict(self) -> dict[str, Any]:
        """The clipping norm and the releases so far (the accountant is rebuilt from them)."""
        return {"clip_norm": self.clip_norm, "releases": [list(r) for r in self.releases]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clipping norm and replay the releases into a fresh accountant."""
        try:
            clip_norm = float(state["clip_norm"])
            releases = [(float(z), int(m)) for z, m in state["releases"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"the checkpoint's client-level DP state is unreadable ({err!r}); it was not written by a run "
                              "with client-level DP") from None
        self.clip_norm = clip_norm
        self.releases = releases
        self.accountant = _replayed(self.settings.delta, self.num_clients, releases)
