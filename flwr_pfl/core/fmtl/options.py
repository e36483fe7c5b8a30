"""FMTL's typed options: which dataset each head fits, the head loss, the weighting schemes and
the partial-participation policies.

``Augmentation`` chooses between ERM on the original data (eq. 3) and the augmented ERM (eqs. 5
and 7); ``HeadWeighting`` between eq. (12), eq. (10) and the baselines of Sec. VI (EW);
``ParticipationPolicy`` and ``EmptyHolderPolicy`` cover what the paper leaves open for sampled
rounds. :class:`FMTLWeightingOptions` gathers the server's choices in one object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Augmentation(enum.StrEnum):
    """Which dataset each head is fitted on.

    * ``AUGMENTED`` (default; the paper's proposal, eqs. 5 and 7): every local sample of task c
      is also a sample (x, 0) of every other task c' != c, so every head sees all n_i local
      samples and its local loss is the mean over them.
    * ``ORIGINAL`` (eq. 3): a sample serves only its own task's head; head c's local loss is the
      mean over the n_i^c task-c samples (zero for tasks the client does not hold).
    """

    AUGMENTED = "augmented"
    ORIGINAL = "original"


class HeadLoss(enum.StrEnum):
    """Per-head loss of the local objective (spec P3 and Sec. 4, item 7).

    * ``CE`` (default for classification-as-tasks; what the paper's CIFAR runs most likely used):
      softmax cross-entropy over all M heads. Each sample raises its own logit and lowers every
      other one, the classification analogue of adding (x, 0) to the other tasks. It is always
      augmented (the softmax couples the heads), so ``Augmentation.ORIGINAL`` is refused.
    * ``MSE`` (the paper's linear regression): squared error on real-valued targets; the
      augmented target of head c is y on task-c samples and 0 elsewhere.
    * ``MSE_ONEHOT`` (literal augmented regression for classification): squared error against
      one-hot targets (1 for the sample's own head, 0 for the others).
    * ``BCE_OVR``: one-vs-rest binary cross-entropy on the logits; other tasks' samples are
      negatives of head c.
    """

    CE = "ce"
    MSE = "mse"
    MSE_ONEHOT = "mse_onehot"
    BCE_OVR = "bce_ovr"


class HeadWeighting(enum.StrEnum):
    """How head c is weighted across clients (beta_i^c), over a reference set of K clients.

    * ``FMTL_EQ12`` (default; the paper's method, eq. 12): if 2|I^c| <= K, holders share 1/2
      equally and non-holders share 1/2 equally; otherwise uniform 1/K.
    * ``FMTL_EQ10``: numerical solution of problem (10) from per-task feature second moments
      (:func:`solve_eq10`). It is a different option from eq. (12) and can give very different
      weights (uniform in the isotropic case); it is never substituted for it.
    * ``UNIFORM``: 1/K for every client.
    * ``NUM_EXAMPLES``: n_i / sum_j n_j (beta_hat_i, pooled least squares in eq. 5).
    * ``EW_PARTICIPANTS`` (the paper's "EW" baseline, recommended reading, spec Sec. 4):
      beta_i = 1/|I^t| with I^t the round's participants, i.e. uniform over the reference set.
    * ``EW_HOLDERS`` (second reading of "EW"; the non-augmented ERM of Theorem 2): 1/|I^c| for
      holders, 0 for non-holders. A task with no holder gets an all-zero column.
    """

    FMTL_EQ12 = "fmtl_eq12"
    FMTL_EQ10 = "fmtl_eq10"
    UNIFORM = "uniform"
    NUM_EXAMPLES = "num_examples"
    EW_PARTICIPANTS = "ew_participants"
    EW_HOLDERS = "ew_holders"


class BodyWeighting(enum.StrEnum):
    """Client weights for the representation (phase 1, and every array no head owns).

    * ``UNIFORM`` (default; the FedRep code the paper's experiments ran on uses equal weights)
    * ``NUM_EXAMPLES`` (Flower's FedAvg): n_i / sum_j n_j. Both agree when all n_i are equal.
    """

    UNIFORM = "uniform"
    NUM_EXAMPLES = "num_examples"


class ParticipationPolicy(enum.StrEnum):
    """How the full-participation weights of eq. (12) are adapted to a sampled round S_t.

    The paper defines beta over all N clients; it does not say what to do when only S_t trains.

    * ``ROUND_LOCAL`` (default, spec P1 (a)): apply the weighting to the participants, i.e. N ->
      |S_t| and I^c -> I^c intersected with S_t. Holders always get at least 1/2 of the mass.
    * ``POPULATION_RENORM`` (P1 (b)): the population weights (from a registry of all N clients)
      restricted to S_t and renormalized to sum to 1 per head.
    * ``POPULATION_UNBIASED_DELTA`` (P1 (c)): w_c <- w_c + (N/|S_t|) sum_{i in S_t} beta_i^c
      (w_{c,i} - w_c). Unbiased for the full-participation update under uniform sampling, with
      high variance for rare tasks. It is an affine, not a convex, combination: the current head
      keeps the weight 1 - (N/|S_t|) sum_{i in S_t} beta_i^c, which can be negative.

    Full participation in phase 2 (P1 (d)) is a sampling setting of the strategy, not a policy.
    """

    ROUND_LOCAL = "round_local"
    POPULATION_RENORM = "population_renorm"
    POPULATION_UNBIASED_DELTA = "population_unbiased_delta"


class EmptyHolderPolicy(enum.StrEnum):
    """What happens to head c when no participant of the round holds task c (spec P1).

    * ``KEEP`` (default): head c keeps its current value; the head is reported as skipped.
    * ``RENORMALIZE``: head c is averaged over the participants anyway, with their weights for c
      renormalized to sum to 1 (for eq. 12 under ``ROUND_LOCAL`` that is the uniform average of
      the non-holders, which pulls the head towards 0 on their features). When those weights are
      all zero (``EW_HOLDERS``) there is nothing to average and the head is kept and reported as
      skipped.
    * ``ERROR``: raise ValueError naming the tasks.
    """

    KEEP = "keep"
    RENORMALIZE = "renormalize"
    ERROR = "error"


@dataclass(frozen=True)
class Eq10Options:
    """Settings of the numerical solver for problem (10) (:func:`solve_eq10`).

    The paper does not solve (10); these are this library's defaults, not the paper's.

    Attributes:
        restarts: random starting points in addition to the two deterministic ones
            (gamma = beta_hat, and eq. (12) scaled into the box). Default 8.
        max_iter: projected super-gradient steps per start. Default 300.
        step: initial step length, as a fraction of the box diagonal ||beta_hat||; the step decays
            as 1/sqrt(t). Default 0.2.
        ridge: lambda >= 0 added to every client's G_i^c as lambda * I. Default 0 (the paper's
            problem). Needed when the other tasks' features do not span R^k, which makes
            sigma_min(Lambda_beta^{\\c}) = 0 for every beta.
        seed: seed of the random restarts (results are deterministic). Default 0.
    """

    restarts: int = 8
    max_iter: int = 300
    step: float = 0.2
    ridge: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.restarts < 0:
            raise ValueError(f"Eq10Options.restarts must be >= 0, got {self.restarts}")
        if self.max_iter < 1:
            raise ValueError(f"Eq10Options.max_iter must be >= 1, got {self.max_iter}")
        if not (np.isfinite(self.step) and self.step > 0):
            raise ValueError(f"Eq10Options.step must be a finite number > 0, got {self.step}")
        if not (np.isfinite(self.ridge) and self.ridge >= 0):
            raise ValueError(f"Eq10Options.ridge must be a finite number >= 0, got {self.ridge}")


@dataclass(frozen=True)
class FMTLWeightingOptions:
    """All server-side choices for the phase-2 head weights, in one typed object.

    Attributes:
        scheme: the weighting (default ``HeadWeighting.FMTL_EQ12``, the paper's eq. 12).
        participation: the partial-participation policy (default ``ROUND_LOCAL``, spec P1 (a)).
        empty_holder: what to do with a head no participant holds (default ``KEEP``, spec P1).
        eq10: solver settings, used only when ``scheme`` is ``FMTL_EQ10``.
    """

    scheme: HeadWeighting = HeadWeighting.FMTL_EQ12
    participation: ParticipationPolicy = ParticipationPolicy.ROUND_LOCAL
    empty_holder: EmptyHolderPolicy = EmptyHolderPolicy.KEEP
    eq10: Eq10Options = field(default_factory=Eq10Options)

    def __post_init__(self) -> None:
        for name, enum_type in (
            ("scheme", HeadWeighting),
            ("participation", ParticipationPolicy),
            ("empty_holder", EmptyHolderPolicy),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum_type(value))
            except ValueError:
                allowed = ", ".join(m.value for m in enum_type)
                raise ValueError(
                    f"FMTLWeightingOptions.{name}={value!r} is not allowed; allowed: {allowed}"
                ) from None
