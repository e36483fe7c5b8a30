"""FedGP / FedDA option enums: the aggregation rule (Definitions 4.1 / 4.3), the projection, its
granularity (App. C.9), source weighting, the FedGP beta form (Eq. 3 / App. A.4), estimator
alignment (App. C.4), tensor roles, the round schedule's phases, placements and stages, and the
preset names of :func:`~flwr_pfl.core.fedgp.config.fda_preset`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar


class Rule(str, Enum):
    """Aggregation rule.

    * ``fedda``: convex combination (Definition 4.1): (1 - beta_i) Delta_T + beta_i Delta_i.
    * ``fedgp``: gradient projection (Definition 4.3 or its per-layer form, App. C.9):
      (1 - beta_i) Delta_T + beta_i P_i, P_i the filtered projection, see :class:`Projection`.

    Source Only is ``fedda`` with beta = 1 (or plain FedAvg of the sources), Target Only is either
    rule with beta = 0. Default: ``fedgp`` (the paper's method).
    """

    FEDDA = "fedda"
    FEDGP = "fedgp"


class Projection(str, Enum):
    """How FedGP forms the source component P_i of one tensor (Definition 4.3; App. C.9).

    * ``cosine_scaled`` (**default**, reproduces the paper's real-data tables; App. C.9 and the
      official code): P_i = 1[c > 0] * c * a_i * Delta_i with c = cos(Delta_T, Delta_i) computed
      as ``torch.nn.CosineSimilarity`` does (each norm clamped at ``cosine_eps``) and a_i the
      learning-rate/step alignment factor (:func:`alignment_factors`). Magnitude comes from the
      aligned source update.
    * ``exact`` (Definition 4.3; the synthetic experiment, App. B):
      P_i = max(<Delta_T, Delta_i>, 0) / ||Delta_i||^2 * Delta_i, the projection of the target
      update onto the positive source direction. Magnitude comes from the target; invariant to
      rescaling Delta_i, so it needs no alignment.

    The two coincide when a_i ||Delta_i|| = ||Delta_T|| (tensor by tensor).
    """

    COSINE_SCALED = "cosine_scaled"
    EXACT = "exact"


class Granularity(str, Enum):
    """Where FedGP's inner products and filter are computed.

    * ``per_tensor`` (**default**; paper C.9 "each layer", official code: each ``state_dict``
      entry, weights and biases separately): a source may be dropped for one tensor and kept for
      another.
    * ``whole_model``: one cosine / projection coefficient per source over the concatenation of
      all aggregated tensors (Definition 4.3 read literally on the full parameter vector; an
      ablation).
    """

    PER_TENSOR = "per_tensor"
    WHOLE_MODEL = "whole_model"


class SourceWeighting(str, Enum):
    """Weights w_i of the sources in the sum over i.

    * ``num_examples`` (**default**; official code and C.9 "adapted from FedAvg"):
      w_i = n_i / sum_k n_k.
    * ``uniform`` (Definitions 4.1 / 4.3): w_i = 1 / N.
    """

    NUM_EXAMPLES = "num_examples"
    UNIFORM = "uniform"


class FedGPBetaForm(str, Enum):
    """Closed form used for FedGP's auto-weight.

    * ``delta1`` (**default**; Eq. 3, the DomainBed and synthetic code):
      beta_i = sigma^2 / (sigma^2 + tau^2 d_i^2).
    * ``delta_thresh`` (App. A.4 form with the filter probability delta_i kept; the official
      Fashion-MNIST / CIFAR-10 code, Tables 12, 13, 16):
      beta_i = sigma^2 / (sigma^2 + delta_i tau^2 d_i^2 + (1 - delta_i) ||g_T||^2).
    """

    DELTA1 = "delta1"
    DELTA_THRESH = "delta_thresh"


class EstimatorAlignment(str, Enum):
    """Units in which the target's per-step updates and the sources' mean per-step updates meet
    inside the auto-weight estimators (App. C.4 "align ... using the learning rate ratio").

    * ``lr_ratio_on_source`` (**default**; the same units on both sides, as C.4 intends): s_i = Delta_i / K_i *
      (lr_T / lr_S,i); target step updates unchanged. Both sides are then "one step at lr_T".
    * ``reference_domainbed`` (official DomainBed auto script): target step updates multiplied by
      lr_T / lr_S, sources unscaled. Worsens the mismatch by (lr_T/lr_S)^2; affects FedDA's beta
      only (FedGP's estimators are scale-free in the source). Requires one common lr_S.
    * ``none``: neither side rescaled (equivalent, for beta, to the official Fashion-MNIST /
      CIFAR-10 code, which rescales both sides by the same factor).
    """

    LR_RATIO_ON_SOURCE = "lr_ratio_on_source"
    REFERENCE_DOMAINBED = "reference_domainbed"
    NONE = "none"


class TensorRole(str, Enum):
    """What aggregation does with one tensor of the model.

    * ``aggregate``: the FedDA / FedGP rule (and it enters the flattened vectors of the
      estimators). Only floating tensors with ndim >= 1 may have it.
    * ``fedavg``: sample-weighted mean of the sources' values (official DomainBed code for 0-d
      entries; the recommended default for BatchNorm running statistics, which are not update
      directions).
    * ``keep``: the old global value is kept (official Fashion-MNIST/CIFAR code for 0-d entries).
    """

    AGGREGATE = "aggregate"
    FEDAVG = "fedavg"
    KEEP = "keep"


class Phase(str, Enum):
    """Phase of a server round: ``warmup`` (FedAvg over sources only; the target idles) or
    ``fda`` (the FedDA / FedGP rounds)."""

    WARMUP = "warmup"
    FDA = "fda"


class Placement(str, Enum):
    """Who combines the updates (Section 3.1).

    * ``server`` (default, Algorithm 1): every client trains in the same round and the server
      aggregates; in auto mode the target uploads its B step updates (B x m floats).
    * ``target`` (App. C.1 / C.4, the authors' choice for few sources): each FDA round takes two
      server rounds. In the first only the sources train; in the second the server sends the
      target the global model and the sources' models (shuffled), and the target trains,
      computes the betas from its in-memory step updates, aggregates and returns the new global
      model. The mathematics is identical; the B x m upload becomes an N x m download.
    """

    SERVER = "server"
    TARGET = "target"


class Stage(str, Enum):
    """Who trains in an FDA server round (see :class:`Placement`).

    ``all``: sources and target, the server aggregates (server placement). ``sources``: the
    sources only, their models are kept for the next round (target placement, first half).
    ``target``: the target only, it aggregates (target placement, second half).
    """

    ALL = "all"
    SOURCES = "sources"
    TARGET = "target"


class Preset(str, Enum):
    """Named bundles of options, see :func:`fda_preset`."""

    PAPER_REFERENCE_DOMAINBED = "paper_reference_domainbed"
    PAPER_REFERENCE_NONIID = "paper_reference_noniid"
    PAPER_DEFINITIONS = "paper_definitions"


_E = TypeVar("_E", bound=Enum)


def _coerce_enum(cls: type[_E], value: Any, name: str) -> _E:
    """``value`` as a member of ``cls`` (members and their string values are accepted)."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}") from None
