"""FedGP, FedDA and auto-weighting for federated domain adaptation, free of Flower.

Paper: E. Jiang, Y. J. Zhang, S. Koyejo, *Principled Federated Domain Adaptation: Gradient
Projection and Auto-Weighting*, ICLR 2024. One global model is trained by N **source** clients
and one data-poor **target** client; only the server's aggregation rule changes.

Everything here works on NumPy arrays: a model update is a list of per-tensor arrays in the
model's ``state_dict`` order (what crosses Flower's wire), a flattened update is a 1-D vector over
the tensors whose role is :attr:`TensorRole.AGGREGATE`. Updates are model deltas (new minus old),
not gradients; every rule here is homogeneous of degree one and odd in (target, source) jointly,
so it is the paper's gradient rule up to sign.

Pieces and where they run
-------------------------
* Options: :class:`FDAConfig` (one frozen dataclass of typed options, defaults = the
  recommended choices, stated per option) and :func:`fda_preset` (paper/official-code presets).
* Round schedule (server): :func:`plan_round` (warm-up FedAvg rounds, then FDA rounds; lr decay).
* Tensor bookkeeping (both sides): :func:`tensor_roles`, :func:`model_delta`,
  :func:`apply_update`, :func:`flatten_update`, :func:`unflatten_update`.
* Target side: :func:`prepare_step_updates` (its upload in auto mode: B per-step deltas as a
  B x m matrix, :func:`stack_step_updates`, optionally averaged into fewer "super-batch" rows,
  :func:`group_step_updates`), :func:`summarize_step_updates` (the per-step variance
  estimator of App. A.5).
* Server side: :func:`source_weights`, :func:`alignment_factors`, :func:`estimator_inputs`,
  :func:`estimate_fda_stats` (App. A.5 estimators), :func:`estimate_fedda_stats_from_summary`
  (the same FedDA estimate from one scalar the target sends), :func:`auto_betas` (Eq. 3 and the
  A.4 delta-form), :func:`round_betas`, :func:`fda_aggregate` (Definitions 4.1 / 4.3 and the
  per-layer rule of App. C.9).
* Primitives: :func:`proj_pos` (Definition 4.3), :func:`cosine_similarity`,
  :func:`cosine_scaled_component` (App. C.9), :func:`delta_error_fedda` (Thm 4.2, Eq. 1),
  :func:`delta_error_fedgp` (Thm 4.4, Eq. 2, and its A.4 form).

Conventions: beta is always the weight on the **source** side (beta = 0 is Target Only); App.
C.9 prints it the other way round, which is a typo (Tables 8-11: beta = 0 gives identical FedDA
and FedGP numbers). All arithmetic is done in float64 and cast back to each tensor's dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, TypeVar

import numpy as np

from flwr_pfl.core.aggregation import weighted_average

NDArrays = list[np.ndarray]

#: Rows of a step-update matrix processed at once (bounds temporary memory to about
#: ``_CHUNK_ELEMENTS`` float64 values whatever B and m are).
_CHUNK_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


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


def _check_unit_interval(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number in [0, 1]; got {value!r}")
    v = float(value)
    if not (0.0 <= v <= 1.0):  # also rejects NaN
        raise ValueError(f"{name} must lie in [0, 1] (0 = target only, 1 = source side only); got {v}")
    return v


@dataclass(frozen=True)
class FDAConfig:
    """All options of FedDA / FedGP with fixed or automatic weights.

    Strings are accepted for enum fields (e.g. from a Flower run-config) and converted;
    bad values raise ``ValueError`` naming the field and the allowed values.

    Attributes:
        rule: ``fedgp`` (default) or ``fedda``; see :class:`Rule`.
        beta: fixed source-side weight in [0, 1]; default 0.5 (paper). Also the fallback when
            auto-weighting cannot be computed (fewer than 2 target steps).
        auto_weight: compute beta_i per source per round by Eq. 3 (default False).
        projection: FedGP source component; default ``cosine_scaled`` (C.9, reproduces the
            real-data tables); ``exact`` is Definition 4.3 (used by the synthetic App. B run).
        filter_negative: drop a source's component where its cosine with the target update is
            <= 0 (default True; False is the "w proj" ablation of the main-text table, which then
            uses the signed cosine / inner product).
        granularity: ``per_tensor`` (default) or ``whole_model``; see :class:`Granularity`.
        source_weighting: ``num_examples`` (default, code) or ``uniform`` (paper's 1/N).
        fedgp_beta_form: ``delta1`` (default, Eq. 3) or ``delta_thresh`` (A.4).
        estimator_alignment: default ``lr_ratio_on_source``; see :class:`EstimatorAlignment`.
        align_fedda: multiply FedDA's source updates by the alignment factor a_i as FedGP's
            cosine form does (default False: the official code never rescales FedDA, which is
            what the paper's FedDA numbers used; True is an extension not in the paper).
        cosine_eps: clamp of each norm in the cosine, as ``torch.nn.CosineSimilarity``
            (default 1e-8, which reproduces the code; 0 gives the exact cosine, with cos = 0 for
            a zero tensor).
        buffer_role: role of floating ``state_dict`` buffers (BatchNorm running statistics);
            default ``fedavg``; ``aggregate`` mimics the code.
        scalar_role: role of 0-d or integer entries (``num_batches_tracked``); ``fedavg``
            (default, DomainBed code) or ``keep`` (Fashion-MNIST/CIFAR code).
        warmup_rounds: FedAvg-over-sources rounds before the FDA rounds (default 2; the paper
            uses 5 for TerraIncognita and Office-Home C/P/R; 0 for Target Only in DomainBed).
        lr_decay_after_warmup: factor on both learning rates in FDA rounds (default 1.0; the
            auto variants used 0.1 in the DomainBed code, 0.1/0.35 in the Fashion-MNIST/CIFAR
            code, and other per-dataset factors in the paper, C.3/C.4).
        max_step_updates: at most this many rows of target step updates are kept, by averaging
            consecutive steps (:func:`group_step_updates`); None (default) keeps all B.
        placement: ``server`` (default, Algorithm 1) or ``target`` (App. C.1 / C.4: two server
            rounds per FDA round, the target aggregates); see :class:`Placement`.
    """

    rule: Rule = Rule.FEDGP
    beta: float = 0.5
    auto_weight: bool = False
    projection: Projection = Projection.COSINE_SCALED
    filter_negative: bool = True
    granularity: Granularity = Granularity.PER_TENSOR
    source_weighting: SourceWeighting = SourceWeighting.NUM_EXAMPLES
    fedgp_beta_form: FedGPBetaForm = FedGPBetaForm.DELTA1
    estimator_alignment: EstimatorAlignment = EstimatorAlignment.LR_RATIO_ON_SOURCE
    align_fedda: bool = False
    cosine_eps: float = 1e-8
    buffer_role: TensorRole = TensorRole.FEDAVG
    scalar_role: TensorRole = TensorRole.FEDAVG
    warmup_rounds: int = 2
    lr_decay_after_warmup: float = 1.0
    max_step_updates: int | None = None
    placement: Placement = Placement.SERVER

    def __post_init__(self) -> None:
        enums = {
            "placement": Placement,
            "rule": Rule,
            "projection": Projection,
            "granularity": Granularity,
            "source_weighting": SourceWeighting,
            "fedgp_beta_form": FedGPBetaForm,
            "estimator_alignment": EstimatorAlignment,
            "buffer_role": TensorRole,
            "scalar_role": TensorRole,
        }
        for name, cls in enums.items():
            object.__setattr__(self, name, _coerce_enum(cls, getattr(self, name), name))
        object.__setattr__(self, "beta", _check_unit_interval(self.beta, "beta"))
        for name in ("auto_weight", "filter_negative", "align_fedda"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        eps = self.cosine_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 <= eps < math.inf):
            raise ValueError(f"cosine_eps must be a finite number >= 0; got {eps!r}")
        if self.scalar_role is TensorRole.AGGREGATE:
            raise ValueError("scalar_role must be 'fedavg' or 'keep': 0-d/integer tensors cannot be projected")
        w = self.warmup_rounds
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
            raise ValueError(f"warmup_rounds must be an integer >= 0; got {w!r}")
        lr = self.lr_decay_after_warmup
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (0.0 < lr < math.inf):
            raise ValueError(f"lr_decay_after_warmup must be a finite number > 0; got {lr!r}")
        k = self.max_step_updates
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2):
            raise ValueError(f"max_step_updates must be None or an integer >= 2; got {k!r}")

    def to_scalars(self) -> dict[str, bool | int | float | str]:
        """The options as plain scalars (enums as their values, ``max_step_updates`` None as 0),
        e.g. for a Flower config sent to the target under the target placement."""
        out: dict[str, bool | int | float | str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, Enum) else (0 if v is None else v)
        return out

    @classmethod
    def from_scalars(cls, values: dict[str, Any]) -> FDAConfig:
        """Inverse of :meth:`to_scalars`; every value is validated as in the constructor.

        Raises:
            ValueError: an unknown option or an invalid value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown FDAConfig option(s) {unknown}; allowed: {sorted(known)}")
        v = dict(values)
        if v.get("max_step_updates") == 0:
            v["max_step_updates"] = None
        return cls(**v)


def fda_preset(preset: Preset | str, *, rule: Rule | str, auto_weight: bool, **overrides: Any) -> FDAConfig:
    """A configuration that reproduces one code path of the paper.

    * ``paper_reference_domainbed``: the DomainBed scripts (Tables 1-7): per-tensor
      ``cosine_scaled`` FedGP, ``num_examples`` weights, ``delta1``, ``reference_domainbed``
      estimator scaling, float buffers projected like weights, 0-d entries FedAvg'ed, 2 warm-up
      rounds (override ``warmup_rounds=5`` for TerraIncognita), lr x0.1 after warm-up when auto.
    * ``paper_reference_noniid``: the Fashion-MNIST / CIFAR-10 scripts (Tables 12-16): as above
      but ``delta_thresh`` for FedGP's auto-weight, estimator scaling that cancels (``none``),
      0-d entries kept, lr x0.1 after warm-up when auto (override 0.35 for CIFAR-10).
    * ``paper_definitions``: the definitions of Sections 4.1-4.2: ``exact`` projection, uniform
      1/N weights, ``delta1``, ``lr_ratio_on_source``, buffers FedAvg'ed, no lr decay.

    Args:
        preset: one of :class:`Preset` (or its string value).
        rule: ``fedgp`` or ``fedda``.
        auto_weight: fixed beta (False) or auto-weighting (True).
        **overrides: any :class:`FDAConfig` field, applied last.

    Raises:
        ValueError: unknown preset or override name, or an invalid value.
    """
    p = _coerce_enum(Preset, preset, "preset")
    common: dict[str, Any] = {"rule": rule, "auto_weight": auto_weight, "warmup_rounds": 2}
    if p is Preset.PAPER_REFERENCE_DOMAINBED:
        opts = dict(
            projection=Projection.COSINE_SCALED,
            source_weighting=SourceWeighting.NUM_EXAMPLES,
            fedgp_beta_form=FedGPBetaForm.DELTA1,
            estimator_alignment=EstimatorAlignment.REFERENCE_DOMAINBED,
            buffer_role=TensorRole.AGGREGATE,
            scalar_role=TensorRole.FEDAVG,
            lr_decay_after_warmup=0.1 if auto_weight else 1.0,
        )
    elif p is Preset.PAPER_REFERENCE_NONIID:
        opts = dict(
            projection=Projection.COSINE_SCALED,
            source_weighting=SourceWeighting.NUM_EXAMPLES,
            fedgp_beta_form=FedGPBetaForm.DELTA_THRESH,
            estimator_alignment=EstimatorAlignment.NONE,
            buffer_role=TensorRole.AGGREGATE,
            scalar_role=TensorRole.KEEP,
            lr_decay_after_warmup=0.1 if auto_weight else 1.0,
        )
    else:
        opts = dict(
            projection=Projection.EXACT,
            source_weighting=SourceWeighting.UNIFORM,
            fedgp_beta_form=FedGPBetaForm.DELTA1,
            estimator_alignment=EstimatorAlignment.LR_RATIO_ON_SOURCE,
            buffer_role=TensorRole.FEDAVG,
            scalar_role=TensorRole.FEDAVG,
            lr_decay_after_warmup=1.0,
        )
    known = {f.name for f in fields(FDAConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown FDAConfig option(s) {unknown}; allowed: {sorted(known)}")
    return FDAConfig(**{**common, **opts, **overrides})


# --------------------------------------------------------------------------------------------
# Round schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundPlan:
    """What one server round does (a pure function of the round number, see :func:`plan_round`).

    Attributes:
        phase: ``warmup`` or ``fda``.
        fda_round: 0 during warm-up, then 1, 2, ... (the paper's r).
        lr_scale: factor on every client's learning rate this round.
        stage: who trains in an FDA round (:class:`Stage`); ``all`` during warm-up (the
            sources train, the target idles).
        target_trains: whether the target client trains (FDA rounds of stage ``all`` or
            ``target``).
        sources_train: whether the sources train (warm-up, and stages ``all`` / ``sources``).
        record_step_updates: whether the target must record its per-step updates (auto mode,
            whenever the target trains).
        seed_round: the server round the same training has under the server placement, W + r;
            clients derive their seeds from it, so that both placements train identically.
    """

    phase: Phase
    fda_round: int
    lr_scale: float
    stage: Stage
    target_trains: bool
    sources_train: bool
    record_step_updates: bool
    seed_round: int


def plan_round(server_round: int, config: FDAConfig) -> RoundPlan:
    """The phase, lr factor and duties of server round ``server_round`` (1-based).

    Rounds 1..W are FedAvg over the sources only (App. C.2 "initialization": W = 2, or 5 for
    TerraIncognita); the rounds after are FDA rounds, with the learning rates multiplied by
    ``config.lr_decay_after_warmup`` (C.3/C.4, auto variants). With the ``server`` placement
    server round W + r is FDA round r; with the ``target`` placement FDA round r takes server
    rounds W + 2r - 1 (sources) and W + 2r (target).

    Raises:
        ValueError: ``server_round`` is not an integer >= 1.
    """
    if isinstance(server_round, bool) or not isinstance(server_round, (int, np.integer)) or server_round < 1:
        raise ValueError(f"server_round must be an integer >= 1 (Flower counts from 1); got {server_round!r}")
    w = config.warmup_rounds
    if server_round <= w:
        return RoundPlan(Phase.WARMUP, 0, 1.0, Stage.ALL, False, True, False, int(server_round))
    k = int(server_round) - w
    if config.placement is Placement.SERVER:
        fda_round, stage = k, Stage.ALL
    else:
        fda_round, stage = (k + 1) // 2, (Stage.SOURCES if k % 2 else Stage.TARGET)
    target_trains = stage is not Stage.SOURCES
    return RoundPlan(
        Phase.FDA,
        fda_round,
        float(config.lr_decay_after_warmup),
        stage,
        target_trains=target_trains,
        sources_train=stage is not Stage.TARGET,
        record_step_updates=bool(config.auto_weight) and target_trains,
        seed_round=w + fda_round,
    )


# --------------------------------------------------------------------------------------------
# Tensor bookkeeping
# --------------------------------------------------------------------------------------------


def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


def _check_finite(a: np.ndarray, name: str) -> None:
    if _is_float(a) and not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or Inf; updates must be finite")


def _check_layout(reference: Sequence[np.ndarray], other: Sequence[np.ndarray], ref_name: str, name: str) -> None:
    """Same number of tensors and the same shapes, tensor by tensor."""
    if len(other) != len(reference):
        raise ValueError(f"{name} has {len(other)} tensors but {ref_name} has {len(reference)}; the lists must match")
    for k, (r, o) in enumerate(zip(reference, other)):
        if np.shape(o) != np.shape(r):
            raise ValueError(f"{name}[{k}] has shape {np.shape(o)} but {ref_name}[{k}] has shape {np.shape(r)}")


def tensor_roles(
    arrays: Sequence[np.ndarray],
    config: FDAConfig,
    is_buffer: Sequence[bool] | None = None,
) -> list[TensorRole]:
    """The :class:`TensorRole` of every tensor of a model, from its arrays (wire order).

    Floating tensors with ndim >= 1 that are parameters get ``aggregate``; floating buffers with
    ndim >= 1 get ``config.buffer_role``; 0-d or non-floating entries get ``config.scalar_role``
    (the official code excludes 0-d entries from projection). Server and target must
    compute the same roles: they fix the flattened layout of step updates.

    Args:
        arrays: the model's ``state_dict`` arrays (any values; only dtype and shape are read).
        config: supplies ``buffer_role`` and ``scalar_role``.
        is_buffer: one flag per array (True for ``named_buffers`` entries); None = no buffers.

    Returns:
        One role per array.
    """
    if is_buffer is None:
        is_buffer = [False] * len(arrays)
    if len(is_buffer) != len(arrays):
        raise ValueError(f"is_buffer has {len(is_buffer)} flags for {len(arrays)} arrays; need one per array")
    roles = []
    for a, buf in zip(arrays, is_buffer):
        a = np.asarray(a)
        if a.ndim == 0 or not _is_float(a):
            roles.append(config.scalar_role)
        elif buf:
            roles.append(config.buffer_role)
        else:
            roles.append(TensorRole.AGGREGATE)
    return roles


def _check_roles(roles: Sequence[TensorRole | str], arrays: Sequence[np.ndarray]) -> list[TensorRole]:
    if len(roles) != len(arrays):
        raise ValueError(f"roles has {len(roles)} entries for {len(arrays)} tensors; need one per tensor")
    out = [_coerce_enum(TensorRole, r, f"roles[{k}]") for k, r in enumerate(roles)]
    for k, (r, a) in enumerate(zip(out, arrays)):
        a = np.asarray(a)
        if r is TensorRole.AGGREGATE and (a.ndim == 0 or not _is_float(a)):
            raise ValueError(
                f"tensor {k} (shape {a.shape}, dtype {a.dtype}) cannot have role 'aggregate': "
                "only floating tensors with ndim >= 1 can; use 'fedavg' or 'keep'"
            )
    return out


def model_delta(new: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> NDArrays:
    """Per-tensor update new - old (Algorithm 1, step 3: g = h^(r) - h_global^(r-1)).

    Floating tensors give float64 deltas; integer tensors give integer deltas.

    Raises:
        ValueError: mismatched lists/shapes, or NaN/Inf in ``new``.
    """
    _check_layout(old, new, "old", "new")
    out: NDArrays = []
    for k, (n, o) in enumerate(zip(new, old)):
        n, o = np.asarray(n), np.asarray(o)
        _check_finite(n, f"new[{k}]")
        if _is_float(n) or _is_float(o):
            out.append(n.astype(np.float64) - o.astype(np.float64))
        else:
            out.append(n.astype(np.int64) - o.astype(np.int64))
    return out


def apply_update(old: Sequence[np.ndarray], update: Sequence[np.ndarray]) -> NDArrays:
    """old + update, cast to each old tensor's dtype (integers rounded): the new global model.

    Raises:
        ValueError: mismatched lists/shapes, or NaN/Inf in ``update``.
    """
    _check_layout(old, update, "old", "update")
    out: NDArrays = []
    for k, (o, u) in enumerate(zip(old, update)):
        o, u = np.asarray(o), np.asarray(u)
        _check_finite(u, f"update[{k}]")
        new = o.astype(np.float64) + u.astype(np.float64)
        out.append(np.rint(new).astype(o.dtype) if not _is_float(o) else new.astype(o.dtype))
    return out


def flatten_update(
    arrays: Sequence[np.ndarray], roles: Sequence[TensorRole | str], dtype: np.dtype | type = np.float64
) -> np.ndarray:
    """Concatenate the ``aggregate`` tensors of an update into one vector of length m.

    This is the layout of the estimators' vectors (App. A.5 works on the whole
    parameter vector), in wire order.
    """
    r = _check_roles(roles, arrays)
    parts = [np.asarray(a, dtype=dtype).ravel() for a, role in zip(arrays, r) if role is TensorRole.AGGREGATE]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def unflatten_update(vector: np.ndarray, like: Sequence[np.ndarray], roles: Sequence[TensorRole | str]) -> NDArrays:
    """Inverse of :func:`flatten_update`: ``aggregate`` tensors from ``vector`` (in ``like``'s
    shapes and dtypes), every other tensor zero (a zero update).

    Raises:
        ValueError: the vector's length is not the total size of the ``aggregate`` tensors.
    """
    r = _check_roles(roles, like)
    v = np.asarray(vector)
    sizes = [np.asarray(a).size for a, role in zip(like, r) if role is TensorRole.AGGREGATE]
    if v.ndim != 1 or v.size != sum(sizes):
        raise ValueError(f"vector has shape {v.shape}; expected ({sum(sizes)},), the size of the aggregated tensors")
    out: NDArrays = []
    offset = 0
    for a, role in zip(like, r):
        a = np.asarray(a)
        if role is TensorRole.AGGREGATE:
            out.append(v[offset : offset + a.size].reshape(a.shape).astype(a.dtype))
            offset += a.size
        else:
            out.append(np.zeros(a.shape, dtype=a.dtype))
    return out


# --------------------------------------------------------------------------------------------
# Target side: per-step updates and the variance estimator
# --------------------------------------------------------------------------------------------


def stack_step_updates(
    step_updates: Sequence[Sequence[np.ndarray]],
    roles: Sequence[TensorRole | str],
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """The target's B per-step updates g^j (parameters after step j minus before it), flattened
    over the ``aggregate`` tensors and stacked: the B x m matrix G of App. A.5 / C.4.

    float32 (default) halves the extra upload of Algorithm 1 (B x m floats, App. C.4).

    Raises:
        ValueError: no steps, steps with different layouts, or NaN/Inf.
    """
    if len(step_updates) == 0:
        raise ValueError("need at least one step update")
    ref = step_updates[0]
    rows = []
    for j, step in enumerate(step_updates):
        _check_layout(ref, step, "step_updates[0]", f"step_updates[{j}]")
        row = flatten_update(step, roles, dtype=np.float64)
        if not np.all(np.isfinite(row)):
            raise ValueError(f"step_updates[{j}] contains NaN or Inf; updates must be finite")
        rows.append(row.astype(dtype))
    return np.stack(rows)


def _as_matrix(x: Any, name: str, min_rows: int = 1) -> np.ndarray:
    m = np.asarray(x, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (rows x m); got shape {m.shape}")
    if m.shape[0] < min_rows:
        raise ValueError(f"{name} needs at least {min_rows} rows; got {m.shape[0]}")
    if m.shape[1] == 0:
        raise ValueError(f"{name} has zero columns; m must be >= 1")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{name} contains NaN or Inf; updates must be finite")
    return m


def group_step_updates(step_updates: np.ndarray, max_rows: int) -> np.ndarray:
    """Average consecutive step updates into at most ``max_rows`` "super-batch" rows.

    A payload reduction (an extension not in the paper): with K groups of b = B/K steps each the
    rows are still i.i.d. parts of the target data (App. A.5's partition argument with K parts),
    so :func:`summarize_step_updates` still estimates the same sigma^2 without bias; only its
    own variance grows. Groups are contiguous and as equal as possible (sizes differ by at most
    one; unequal sizes make the estimate slightly approximate).

    Args:
        step_updates: B x m.
        max_rows: K >= 2.

    Returns:
        min(B, K) x m (float64); the input's rows unchanged if B <= K.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 2:
        raise ValueError(f"max_rows must be an integer >= 2; got {max_rows!r}")
    g = _as_matrix(step_updates, "step_updates")
    if g.shape[0] <= max_rows:
        return g
    return np.stack([blk.mean(axis=0) for blk in np.array_split(g, max_rows, axis=0)])


def prepare_step_updates(
    step_updates: Sequence[Sequence[np.ndarray]],
    roles: Sequence[TensorRole | str],
    config: FDAConfig,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """What the target uploads in auto mode (Algorithm 1): its per-step updates as a B' x m
    matrix, :func:`stack_step_updates` followed by :func:`group_step_updates` when
    ``config.max_step_updates`` is set (B' = min(B, max_step_updates)), cast to ``dtype``."""
    g = stack_step_updates(step_updates, roles, dtype=np.float64)
    if config.max_step_updates is not None:
        g = group_step_updates(g, config.max_step_updates)
    return g.astype(dtype)


def _row_sq_norms(
    g: np.ndarray, center: np.ndarray | None = None, u: np.ndarray | None = None, coef: np.ndarray | None = None
) -> np.ndarray:
    """||g_j - center - coef_j * u||^2 for every row j, in row chunks (bounded memory)."""
    b, m = g.shape
    out = np.empty(b, dtype=np.float64)
    step = max(1, _CHUNK_ELEMENTS // max(m, 1))
    for lo in range(0, b, step):
        d = g[lo : lo + step] - (0.0 if center is None else center)
        if u is not None and coef is not None:
            d = d - coef[lo : lo + step, None] * u
        out[lo : lo + step] = np.einsum("ij,ij->i", d, d)
    return out


@dataclass(frozen=True)
class StepSummary:
    """The target's per-step update statistics (App. A.5, estimator of sigma^2).

    Attributes:
        num_steps: B (rows of G).
        dim: m (columns of G).
        mean: g_bar, the mean of the rows (m,). By telescoping, Delta_T / B for one epoch.
        sum_sq_dev: sum_j ||g^j - g_bar||^2.
        sample_target_var: S_T = sum_sq_dev / ((B - 1) m), the unbiased variance of one part
            (the code's ``sample_target_var``).
        target_var: sigma^2-hat = S_T / B, the variance of the full target update (the code's
            ``target_var``; A.5: 1/((B-1)B) sum_j ||g^j - g_bar||^2, per coordinate).
    """

    num_steps: int
    dim: int
    mean: np.ndarray
    sum_sq_dev: float
    sample_target_var: float
    target_var: float


def summarize_step_updates(step_updates: np.ndarray, target_mean: np.ndarray | None = None) -> StepSummary:
    """The target-side variance estimator of App. A.5 from the B x m step-update matrix G.

    The target client can call this on its own step updates: for FedDA_Auto the server then
    needs only ``sample_target_var`` (one float) besides Delta_T, see
    :func:`estimate_fedda_stats_from_summary`.

    Args:
        step_updates: G, B x m with B >= 2 (a variance needs two samples).
        target_mean: the centre g_bar (m,); default the mean of the rows. The synthetic
            experiment (App. B) passes the full-data target gradient instead.

    Raises:
        ValueError: B < 2, non-finite values, or a ``target_mean`` of the wrong shape.
    """
    g = _as_matrix(step_updates, "step_updates", min_rows=2)
    b, m = g.shape
    if target_mean is None:
        mean = g.mean(axis=0)
    else:
        mean = np.asarray(target_mean, dtype=np.float64)
        if mean.shape != (m,):
            raise ValueError(f"target_mean has shape {mean.shape}; expected ({m},)")
        if not np.all(np.isfinite(mean)):
            raise ValueError("target_mean contains NaN or Inf")
    ssd = float(_row_sq_norms(g, mean).sum())
    sample_var = ssd / ((b - 1) * m)
    return StepSummary(b, m, mean, ssd, sample_var, sample_var / b)


# --------------------------------------------------------------------------------------------
# Server side: weights, alignment, estimators, auto-beta
# --------------------------------------------------------------------------------------------


def source_weights(
    num_examples: Sequence[float], weighting: SourceWeighting | str = SourceWeighting.NUM_EXAMPLES
) -> np.ndarray:
    """Source weights w_i (sum to 1): n_i / sum n (``num_examples``, default) or 1/N (``uniform``).

    Raises:
        ValueError: no sources, a negative or non-finite count, or all counts zero with
            ``num_examples``.
    """
    w = _coerce_enum(SourceWeighting, weighting, "weighting")
    n = np.asarray(num_examples, dtype=np.float64)
    if n.ndim != 1 or n.size == 0:
        raise ValueError(f"num_examples must be a non-empty 1-D sequence (one per source); got shape {n.shape}")
    if not np.all(np.isfinite(n)) or np.any(n < 0):
        raise ValueError(f"num_examples must be finite and >= 0; got {n.tolist()}")
    if w is SourceWeighting.UNIFORM:
        return np.full(n.size, 1.0 / n.size)
    if n.sum() <= 0:
        raise ValueError("num_examples are all zero; cannot weight sources by example counts")
    return n / n.sum()


def _positive_vector(x: Any, name: str, n: int | None = None) -> np.ndarray:
    v = np.atleast_1d(np.asarray(x, dtype=np.float64))
    if v.ndim != 1 or (n is not None and v.size not in (1, n)):
        raise ValueError(f"{name} must be a scalar or one value per source ({n}); got shape {np.shape(x)}")
    if not np.all(np.isfinite(v)) or np.any(v <= 0):
        raise ValueError(f"{name} must be finite and > 0; got {v.tolist()}")
    return v if n is None or v.size == n else np.full(n, v[0])


def alignment_factors(
    *, lr_target: float, steps_target: int, lr_sources: Sequence[float] | float, steps_sources: Sequence[int]
) -> np.ndarray:
    """Magnitude alignment a_i = (lr_T / lr_S,i) * (K_T / K_i) of App. C.9.

    Rescales source i's update to the size of the target's: K_i steps at lr_S,i become K_T steps
    at lr_T. K counts **all** optimizer steps of the round (epochs included), so C.9's
    (n_T/bs_T)/(n_i/bs_S) * lr_T/lr_S * E_T/E_S is this with K = epochs * steps per epoch; the
    code's n_T/bs_T is not rounded up, client-reported step counts are.

    Args:
        lr_target: lr_T > 0 (after any lr decay; only the ratio matters).
        steps_target: K_T >= 1.
        lr_sources: lr_S,i > 0, one per source or one for all.
        steps_sources: K_i >= 1, one per source.

    Returns:
        a, shape (N,).
    """
    k_s = _positive_vector(steps_sources, "steps_sources")
    n = k_s.size
    lr_s = _positive_vector(lr_sources, "lr_sources", n)
    lr_t = _positive_vector(lr_target, "lr_target", 1)[0]
    k_t = _positive_vector(steps_target, "steps_target", 1)[0]
    return (lr_t / lr_s) * (k_t / k_s)


def estimator_scales(
    alignment: EstimatorAlignment | str, *, lr_target: float, lr_sources: Sequence[float] | float, num_sources: int
) -> tuple[float, np.ndarray]:
    """Factors (c_T, c_S,i) applied to the target step updates and to the sources' mean per-step
    updates before estimation (App. C.4); see :class:`EstimatorAlignment`.

    Raises:
        ValueError: non-positive learning rates, or ``reference_domainbed`` with differing lr_S.
    """
    a = _coerce_enum(EstimatorAlignment, alignment, "alignment")
    lr_s = _positive_vector(lr_sources, "lr_sources", num_sources)
    lr_t = _positive_vector(lr_target, "lr_target", 1)[0]
    if a is EstimatorAlignment.LR_RATIO_ON_SOURCE:
        return 1.0, lr_t / lr_s
    if a is EstimatorAlignment.REFERENCE_DOMAINBED:
        if not np.allclose(lr_s, lr_s[0], rtol=1e-12, atol=0.0):
            raise ValueError(
                "estimator_alignment 'reference_domainbed' uses one lr ratio and needs equal source "
                f"learning rates; got {lr_s.tolist()}"
            )
        return float(lr_t / lr_s[0]), np.ones(num_sources)
    return 1.0, np.ones(num_sources)


def estimator_inputs(
    step_updates: np.ndarray,
    source_deltas: np.ndarray,
    *,
    source_steps: Sequence[int],
    lr_target: float,
    lr_sources: Sequence[float] | float,
    alignment: EstimatorAlignment | str = EstimatorAlignment.LR_RATIO_ON_SOURCE,
) -> tuple[np.ndarray, np.ndarray]:
    """Estimator inputs (G, S) in common units from what the clients send.

    The sources' mean per-step update is s_i = Delta_i / K_i (C.4: "one model update per source
    client ... divided by the number of batches"; telescoping makes it the mean of the per-step
    deltas), then both sides are scaled by :func:`estimator_scales`.

    Args:
        step_updates: the target's G, B x m.
        source_deltas: flattened round updates Delta_i, N x m.
        source_steps: K_i >= 1 (N,).
        lr_target, lr_sources: learning rates used this round.
        alignment: default ``lr_ratio_on_source``.

    Returns:
        (G * c_T, S) with S = N x m, float64.
    """
    g = _as_matrix(step_updates, "step_updates")
    d = _as_matrix(source_deltas, "source_deltas")
    if d.shape[1] != g.shape[1]:
        raise ValueError(f"source_deltas have m = {d.shape[1]} columns but step_updates have m = {g.shape[1]}")
    k = _positive_vector(source_steps, "source_steps", d.shape[0])
    c_t, c_s = estimator_scales(alignment, lr_target=lr_target, lr_sources=lr_sources, num_sources=d.shape[0])
    return (g if c_t == 1.0 else g * c_t), d * (c_s / k)[:, None]


@dataclass(frozen=True)
class FDAStats:
    """Auto-weighting statistics of one round (App. A.5; code names in brackets). All "per
    coordinate" quantities are divided by m, which cancels in every beta.

    Attributes:
        num_steps: B.
        dim: m.
        sample_target_var: S_T [``sample_target_var``].
        target_var: sigma^2-hat = S_T / B [``target_var``].
        d2: d_i^2-hat clipped at 0 [``source_target_var``], shape (N,).
        d2_unclipped: the unbiased Eq. (24) estimate, may be negative, (N,).
        tau2d2: (tau^2 d^2)_i-hat clipped at 0 [``projected_grads_norm_square``], (N,), or None
            when computed from a summary.
        tau2d2_unclipped: its unbiased estimate of Eq. (25), (N,) or None.
        delta: delta_i-hat = 1 - (1 - q_i) / B, q_i the fraction of steps with <g^j, s_i> > 0
            [``deltas``] (a heuristic of the code), (N,) or None.
        target_norm2: ||g_bar||^2 / m [``target_norm_square``] (plug-in, biased up by sigma^2).
    """

    num_steps: int
    dim: int
    sample_target_var: float
    target_var: float
    d2: np.ndarray
    d2_unclipped: np.ndarray
    tau2d2: np.ndarray | None
    tau2d2_unclipped: np.ndarray | None
    delta: np.ndarray | None
    target_norm2: float


def estimate_fda_stats(
    step_updates: np.ndarray, source_updates: np.ndarray, target_mean: np.ndarray | None = None
) -> FDAStats:
    """Unbiased estimators of sigma^2, d_i^2 and tau^2 d_i^2 (App. A.5).

    With G the target's B per-step updates (rows g^j), g_bar their mean (or ``target_mean``),
    s_i source i's mean per-step update and u_i = s_i / ||s_i||:

    * S_T = sum_j ||g^j - g_bar||^2 / ((B-1) m); sigma^2 = S_T / B.
    * d_i^2 = max(sum_j ||g^j - s_i||^2 / (B m) - S_T, 0)                    (Eq. 24)
    * p^j = g^j - <g^j,u_i> u_i, p_bar = g_bar - <g_bar,u_i> u_i;
      tau^2 d_i^2 = max(mean_j ||p^j||^2 / m - sum_j ||p^j - p_bar||^2 / ((B-1) m), 0), the
      mean of ||p^j||^2 minus their unbiased sample variance (Eq. 25; the printed A.5 display is
      garbled, this is its derivation and the code).
    * delta_i = 1 - (1 - q_i) / B, q_i = fraction of j with <g^j, s_i> > 0 (code heuristic).

    Clipping at 0 keeps beta in [0, 1] (the paper's estimators are unbiased and can be
    negative; both versions are returned). A zero source update (s_i = 0) has no direction:
    u_i = 0 is used, so nothing is projected out (tau^2 d^2 = estimate of ||g_T||^2) and
    q_i = 0.

    Args:
        step_updates: G, B x m, B >= 2.
        source_updates: S, N x m (already aligned, see :func:`estimator_inputs`).
        target_mean: optional centre g_bar (m,) (App. B uses the full-data target gradient).

    Returns:
        :class:`FDAStats`.

    Raises:
        ValueError: B < 2, non-finite values, or mismatched m.
    """
    summary = summarize_step_updates(step_updates, target_mean)
    g = _as_matrix(step_updates, "step_updates", min_rows=2)
    s_all = _as_matrix(source_updates, "source_updates")
    b, m = g.shape
    if s_all.shape[1] != m:
        raise ValueError(f"source_updates have m = {s_all.shape[1]} columns but step_updates have m = {m}")
    gbar, s_t = summary.mean, summary.sample_target_var
    n = s_all.shape[0]
    d2u, t2u, delta = np.empty(n), np.empty(n), np.empty(n)
    for i, s in enumerate(s_all):
        d2u[i] = _row_sq_norms(g, s).mean() / m - s_t
        norm = float(np.linalg.norm(s))
        u = s / norm if norm > 0 else np.zeros(m)
        a = g @ u
        a_bar = float(gbar @ u)
        mean_p2 = _row_sq_norms(g, None, u, a).mean() / m
        var_p = _row_sq_norms(g, gbar, u, a - a_bar).sum() / ((b - 1) * m)
        t2u[i] = mean_p2 - var_p
        delta[i] = 1.0 - (1.0 - float(np.mean(g @ s > 0))) / b
    return FDAStats(
        num_steps=b,
        dim=m,
        sample_target_var=s_t,
        target_var=summary.target_var,
        d2=np.maximum(d2u, 0.0),
        d2_unclipped=d2u,
        tau2d2=np.maximum(t2u, 0.0),
        tau2d2_unclipped=t2u,
        delta=delta,
        target_norm2=float(gbar @ gbar) / m,
    )


def estimate_fedda_stats_from_summary(
    target_mean: np.ndarray, sample_target_var: float, num_steps: int, source_updates: np.ndarray
) -> FDAStats:
    """FedDA's auto-weight statistics from the target's summary instead of its B x m matrix.

    When g_bar is the mean of the step updates, sum_j ||g^j - s||^2 = sum_j ||g^j - g_bar||^2
    + B ||g_bar - s||^2, so Eq. (24)'s estimate is exactly
    d_i^2 = ||g_bar - s_i||^2 / m - S_T / B. With g_bar = Delta_T / B (telescoping; the server
    has Delta_T) the target needs to send only S_T (from :func:`summarize_step_updates`) and B,
    not B x m floats. FedGP's tau^2 d^2 needs the spread of G along each source direction and
    cannot be computed this way (its fields are None).

    Args:
        target_mean: g_bar (m,), in the estimator's units (e.g. flattened Delta_T / B, times the
            target scale of :func:`estimator_scales`).
        sample_target_var: S_T, in the same units (times the target scale squared).
        num_steps: B >= 2.
        source_updates: S, N x m.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 2:
        raise ValueError(f"num_steps must be an integer >= 2 (a variance needs two steps); got {num_steps!r}")
    s_t = float(sample_target_var)
    if not (0.0 <= s_t < math.inf):
        raise ValueError(f"sample_target_var must be finite and >= 0; got {sample_target_var!r}")
    gbar = _as_matrix(np.asarray(target_mean, dtype=np.float64)[None, :], "target_mean")[0]
    s_all = _as_matrix(source_updates, "source_updates")
    m = gbar.size
    if s_all.shape[1] != m:
        raise ValueError(f"source_updates have m = {s_all.shape[1]} columns but target_mean has m = {m}")
    sigma2 = s_t / num_steps
    d2u = _row_sq_norms(s_all, gbar) / m - sigma2
    return FDAStats(
        num_steps=int(num_steps),
        dim=m,
        sample_target_var=s_t,
        target_var=sigma2,
        d2=np.maximum(d2u, 0.0),
        d2_unclipped=d2u,
        tau2d2=None,
        tau2d2_unclipped=None,
        delta=None,
        target_norm2=float(gbar @ gbar) / m,
    )


def auto_betas(
    stats: FDAStats, rule: Rule | str, fedgp_beta_form: FedGPBetaForm | str = FedGPBetaForm.DELTA1
) -> np.ndarray:
    """Per-source auto-weights beta_i in [0, 1] (Eq. 3; A.4 for ``delta_thresh``).

    * FedDA: beta_i = sigma^2 / (sigma^2 + d_i^2)                       (minimises Eq. 1)
    * FedGP ``delta1``: beta_i = sigma^2 / (sigma^2 + tau^2 d_i^2)     (minimises Eq. 2 w/o 1/m)
    * FedGP ``delta_thresh``: beta_i = sigma^2 / (sigma^2 + delta_i tau^2 d_i^2
      + (1 - delta_i) ||g_bar||^2 / m)

    Uses the clipped estimates, so each term is >= 0 and beta lies in [0, 1]. When
    sigma^2 = 0 the weight is 0 (the limit of sigma^2 / (sigma^2 + D) for D > 0; also used for
    0/0, where the target steps do not vary and nothing speaks for the sources). No absolute
    epsilon is added: the quantities are in squared-learning-rate units (often 1e-12 or less),
    where any fixed epsilon would bias beta.

    Returns:
        beta, shape (N,).

    Raises:
        ValueError: FedGP requested from summary statistics (no tau^2 d^2), or non-finite input.
    """
    r = _coerce_enum(Rule, rule, "rule")
    form = _coerce_enum(FedGPBetaForm, fedgp_beta_form, "fedgp_beta_form")
    if r is Rule.FEDDA:
        dist = stats.d2
    else:
        if stats.tau2d2 is None or stats.delta is None:
            raise ValueError(
                "FedGP auto-weights need tau^2 d^2 from the target's step updates "
                "(estimate_fda_stats); these statistics came from a summary (FedDA only)"
            )
        if form is FedGPBetaForm.DELTA1:
            dist = stats.tau2d2
        else:
            dist = stats.delta * stats.tau2d2 + (1.0 - stats.delta) * stats.target_norm2
    sigma2 = float(stats.target_var)
    dist = np.asarray(dist, dtype=np.float64)
    if not (np.isfinite(sigma2) and np.all(np.isfinite(dist))):
        raise ValueError("auto-weight statistics are not finite (overflowing updates?)")
    denom = sigma2 + dist
    safe = np.where(denom > 0, denom, 1.0)
    return np.clip(np.where(denom > 0, sigma2 / safe, 0.0), 0.0, 1.0)


def round_betas(config: FDAConfig, num_sources: int, stats: FDAStats | None = None) -> np.ndarray:
    """The beta_i used this round: ``config.beta`` for every source, or :func:`auto_betas`.

    With ``auto_weight`` and ``stats=None`` (the target took fewer than 2 steps, so no variance
    can be estimated) the fixed beta is used and a ``RuntimeWarning`` issued.

    Returns:
        beta, shape (num_sources,).
    """
    if isinstance(num_sources, bool) or not isinstance(num_sources, (int, np.integer)) or num_sources < 1:
        raise ValueError(f"num_sources must be an integer >= 1; got {num_sources!r}")
    if config.auto_weight:
        if stats is not None:
            betas = auto_betas(stats, config.rule, config.fedgp_beta_form)
            if betas.shape != (num_sources,):
                raise ValueError(f"stats hold {betas.size} sources but num_sources = {num_sources}")
            return betas
        warnings.warn(
            f"auto-weighting needs at least 2 target steps; using the fixed beta = {config.beta}",
            RuntimeWarning,
            stacklevel=2,
        )
    return np.full(num_sources, config.beta)


def delta_error_fedda(beta: float | np.ndarray, sigma2: float, d2: float) -> float | np.ndarray:
    """Delta error of FedDA for one source (Theorem 4.2, Eq. 1):
    (1 - beta)^2 sigma^2 + beta^2 d^2. Minimised by beta = sigma^2 / (sigma^2 + d^2)."""
    b = np.asarray(beta, dtype=np.float64)
    return (1.0 - b) ** 2 * sigma2 + b**2 * d2


def delta_error_fedgp(
    beta: float | np.ndarray,
    sigma2: float,
    tau2d2: float,
    dim: float = math.inf,
    delta: float = 1.0,
    target_norm2: float = 0.0,
) -> float | np.ndarray:
    """Approximate Delta error of FedGP for one source (Theorem 4.4, Eq. 2; App. A.4 form):
    ((1-beta)^2 + (2 beta - beta^2) delta / m) sigma^2 + beta^2 delta tau^2 d^2
    + beta^2 (1 - delta) ||g_T||^2. With m = inf and delta = 1 it is minimised by Eq. 3."""
    b = np.asarray(beta, dtype=np.float64)
    variance = ((1.0 - b) ** 2 + (2 * b - b**2) * delta / dim) * sigma2
    return variance + b**2 * delta * tau2d2 + b**2 * (1.0 - delta) * target_norm2


# --------------------------------------------------------------------------------------------
# Projection primitives and the aggregation rule
# --------------------------------------------------------------------------------------------


def _pair_terms(
    dot: np.ndarray, nt2: np.ndarray, ns2: np.ndarray, config: FDAConfig, align: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coefficient c with P = c * Delta_S, the cosine, and the filter mask, from inner products.

    Shapes broadcast: dot, ns2 (N, L); nt2 (L,); align (N,) or None. The one place where both
    FedGP forms (and FedDA) are defined, shared by the primitives and :func:`fda_aggregate`.
    """
    eps = config.cosine_eps
    nt, ns = np.sqrt(nt2), np.sqrt(ns2)
    cos = dot / (np.maximum(nt, eps) * np.maximum(ns, eps)) if eps > 0 else np.divide(
        dot, nt * ns, out=np.zeros(np.broadcast_shapes(np.shape(dot), np.shape(nt * ns))), where=(nt * ns) > 0
    )
    a = np.ones(dot.shape[0]) if align is None else align
    if config.rule is Rule.FEDDA:
        coef = np.broadcast_to((a if config.align_fedda else np.ones_like(a))[:, None], dot.shape).copy()
        return coef, cos, np.ones(dot.shape, dtype=bool)
    if config.projection is Projection.EXACT:
        coef = np.divide(dot, ns2, out=np.zeros(dot.shape), where=ns2 > 0)
        kept = (dot > 0) & (ns2 > 0)
    else:
        coef = a[:, None] * cos
        kept = cos > 0
    if config.filter_negative:
        coef = np.where(kept, coef, 0.0)
    else:
        kept = np.ones(dot.shape, dtype=bool)
    return coef, cos, kept


def _pair_on_vectors(
    a: Any, b: Any, names: tuple[str, str], projection: Projection, filter_negative: bool, eps: float,
    align: np.ndarray | None = None,
) -> tuple[float, float, np.ndarray]:
    """:func:`_pair_terms` for one pair of arrays: (coefficient c, cosine, b as float64)."""
    x, y = _as_vector_pair(a, b, *names)
    xf, yf = x.ravel(), y.ravel()
    cfg = FDAConfig(rule=Rule.FEDGP, projection=projection, filter_negative=filter_negative, cosine_eps=eps)
    coef, cos, _ = _pair_terms(np.array([[xf @ yf]]), np.array([xf @ xf]), np.array([[yf @ yf]]), cfg, align)
    return float(coef[0, 0]), float(cos[0, 0]), y


def _as_vector_pair(a: Any, b: Any, name_a: str, name_b: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"{name_a} has shape {x.shape} but {name_b} has shape {y.shape}; they must match")
    for v, name in ((x, name_a), (y, name_b)):
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{name} contains NaN or Inf")
    return x, y


def cosine_similarity(a: np.ndarray, b: np.ndarray, eps: float = 1e-8) -> float:
    """<a, b> / (max(||a||, eps) max(||b||, eps)) on the flattened arrays, as
    ``torch.nn.CosineSimilarity(dim=0, eps)`` (the official code's per-layer cosine). A zero
    array gives 0; ``eps = 0`` gives the exact cosine (0 for a zero array)."""
    if not (0.0 <= eps < math.inf):
        raise ValueError(f"eps must be finite and >= 0; got {eps}")
    return _pair_on_vectors(a, b, ("a", "b"), Projection.EXACT, True, eps)[1]


def proj_pos(g_target: np.ndarray, g_source: np.ndarray, filter_negative: bool = True) -> np.ndarray:
    """Proj_+(g_T | g_S) = max(<g_T, g_S>, 0) / ||g_S||^2 * g_S (Definition 4.3).

    The projection of the target update onto the positive direction of the source update: its
    magnitude comes from the target, it is invariant to rescaling g_S by any c > 0, and the
    residual g_T - Proj is orthogonal to g_S when <g_T, g_S> > 0. ``filter_negative=False``
    drops the max (the "w proj" ablation). A zero g_S has no direction: the result is 0.

    Args:
        g_target, g_source: arrays of one shape (any).

    Returns:
        Array of that shape (float64).
    """
    names = ("g_target", "g_source")
    coef, _, s = _pair_on_vectors(g_target, g_source, names, Projection.EXACT, filter_negative, 1e-8)
    return coef * s


def cosine_scaled_component(
    delta_target: np.ndarray, delta_source: np.ndarray, align: float, filter_negative: bool = True, eps: float = 1e-8
) -> np.ndarray:
    """FedGP's per-layer source component of App. C.9 / the official code:
    1[c > 0] * c * a * Delta_S with c = cos(Delta_T, Delta_S) (see :func:`cosine_similarity`).

    Equals :func:`proj_pos` exactly when a ||Delta_S|| = ||Delta_T||.

    Args:
        delta_target, delta_source: arrays of one shape.
        align: a > 0 from :func:`alignment_factors`.
    """
    a = _positive_vector(align, "align", 1)
    names = ("delta_target", "delta_source")
    coef, _, s = _pair_on_vectors(
        delta_target, delta_source, names, Projection.COSINE_SCALED, filter_negative, eps, a
    )
    return coef * s


@dataclass(frozen=True)
class FDAAggregate:
    """Result of :func:`fda_aggregate`.

    Attributes:
        update: the increment to the global model, one array per tensor (shapes and dtypes of
            the target update); add it with :func:`apply_update`.
        coefficients: c_{i,l} with P_i^l = c_{i,l} Delta_i^l, shape (N, L_agg) over the
            ``aggregate`` tensors (FedDA: 1 or a_i).
        cosines: cos(Delta_T^l, Delta_i^l) per source and aggregated tensor, (N, L_agg)
            (whole-model cosine repeated for ``whole_model``).
        kept: whether the filter let source i through on tensor l, (N, L_agg).
        filtered_frac: per source, fraction of aggregated tensors filtered out, (N,).
        mean_cos: per source, mean cosine over aggregated tensors, (N,).
        betas: the beta_i used, (N,).
    """

    update: NDArrays
    coefficients: np.ndarray
    cosines: np.ndarray
    kept: np.ndarray
    filtered_frac: np.ndarray
    mean_cos: np.ndarray
    betas: np.ndarray


def _check_betas(betas: Any, n: int) -> np.ndarray:
    b = np.atleast_1d(np.asarray(betas, dtype=np.float64))
    if b.ndim != 1 or b.size not in (1, n):
        raise ValueError(f"betas must be a scalar or one value per source ({n}); got shape {np.shape(betas)}")
    if not np.all((b >= 0.0) & (b <= 1.0)):
        raise ValueError(f"every beta must lie in [0, 1] (0 = target only, 1 = source side only); got {b.tolist()}")
    return b if b.size == n else np.full(n, b[0])


def _check_weights(weights: Any, n: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"weights must have one value per source ({n}); got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not math.isclose(float(w.sum()), 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"weights must be >= 0 and sum to 1 (see source_weights()); got {w.tolist()}")
    return w


def fda_aggregate(
    target_delta: Sequence[np.ndarray],
    source_deltas: Sequence[Sequence[np.ndarray]],
    *,
    betas: Sequence[float] | float,
    weights: Sequence[float],
    config: FDAConfig,
    align: Sequence[float] | None = None,
    roles: Sequence[TensorRole | str] | None = None,
) -> FDAAggregate:
    """One FDA aggregation step: the increment to the global model (Algorithm 1, step 5).

    For every ``aggregate`` tensor l (Definitions 4.1 / 4.3, App. C.9):

        update^l = sum_i w_i [ (1 - beta_i) Delta_T^l + beta_i P_i^l ]

    with P_i = Delta_i for FedDA (Definition 4.1; times a_i if ``align_fedda``), and for FedGP
    the filtered projection ``exact`` (Definition 4.3) or ``cosine_scaled`` (App. C.9), computed
    per tensor or on the whole aggregated vector (``granularity``). The target term is added for
    every source, filtered or not (the code's auto-beta form; with one fixed beta it equals
    (1 - beta) Delta_T + beta sum_i w_i P_i since sum_i w_i = 1). ``fedavg`` tensors get
    sum_i w_i Delta_i, ``keep`` tensors a zero update.

    Defined behaviour for zero updates: a zero source tensor contributes nothing to FedGP (its
    cosine is 0, its projection undefined and taken as 0); a zero target tensor makes FedGP's
    component 0 (nothing to project). FedDA is linear and needs no special case.

    Args:
        target_delta: Delta_T, L arrays (:func:`model_delta` of the target's model).
        source_deltas: N lists of L arrays, same shapes.
        betas: beta_i in [0, 1] (scalar or (N,)).
        weights: w_i >= 0 summing to 1 (:func:`source_weights`).
        config: rule, projection, filter, granularity, align_fedda, cosine_eps.
        align: a_i > 0 (N,) from :func:`alignment_factors`; required for ``cosine_scaled``
            FedGP and for ``align_fedda``, ignored otherwise.
        roles: one :class:`TensorRole` per tensor; default: ``aggregate`` for floating tensors
            with ndim >= 1, ``config.scalar_role`` for the rest (pass :func:`tensor_roles` when
            the model has buffers).

    Returns:
        :class:`FDAAggregate`.

    Raises:
        ValueError: no sources, mismatched tensor lists or shapes, NaN/Inf, beta outside
            [0, 1], weights not summing to 1, or a missing/invalid ``align``.
    """
    n = len(source_deltas)
    if n == 0:
        raise ValueError("need at least one source update")
    t_list = [np.asarray(x) for x in target_delta]
    s_lists = [[np.asarray(x) for x in sd] for sd in source_deltas]
    for k, t in enumerate(t_list):
        _check_finite(t, f"target_delta[{k}]")
    for i, sd in enumerate(s_lists):
        _check_layout(t_list, sd, "target_delta", f"source_deltas[{i}]")
        for k, s in enumerate(sd):
            _check_finite(s, f"source_deltas[{i}][{k}]")
    b = _check_betas(betas, n)
    w = _check_weights(weights, n)
    role = _check_roles(roles, t_list) if roles is not None else tensor_roles(t_list, config)
    needs_align = (config.rule is Rule.FEDGP and config.projection is Projection.COSINE_SCALED) or (
        config.rule is Rule.FEDDA and config.align_fedda
    )
    if needs_align and align is None:
        raise ValueError(
            "align (one factor a_i per source, see alignment_factors()) is required for "
            f"rule={config.rule.value!r} with projection={config.projection.value!r}, "
            f"align_fedda={config.align_fedda}"
        )
    a = _positive_vector(align, "align", n) if align is not None else None

    agg = [k for k, r in enumerate(role) if r is TensorRole.AGGREGATE]
    t64 = [t_list[k].astype(np.float64).ravel() for k in agg]
    s64 = [[sd[k].astype(np.float64).ravel() for k in agg] for sd in s_lists]
    nt2 = np.array([t @ t for t in t64])
    dot = np.array([[t @ s for t, s in zip(t64, row)] for row in s64]).reshape(n, len(agg))
    ns2 = np.array([[s @ s for s in row] for row in s64]).reshape(n, len(agg))
    if config.granularity is Granularity.WHOLE_MODEL and agg:
        whole = _pair_terms(dot.sum(1, keepdims=True), nt2.sum(keepdims=True), ns2.sum(1, keepdims=True), config, a)
        coef, cos, kept = (np.repeat(x, len(agg), axis=1) for x in whole)
    else:
        coef, cos, kept = _pair_terms(dot, nt2, ns2, config, a)

    target_w = float(np.sum(w * (1.0 - b)))
    source_w = (w * b)[:, None] * coef  # (N, L_agg)
    update: NDArrays = [np.zeros(t.shape, dtype=t.dtype) for t in t_list]
    for j, k in enumerate(agg):
        acc = target_w * t64[j]
        for i in range(n):
            if source_w[i, j] != 0.0:
                acc = acc + source_w[i, j] * s64[i][j]
        update[k] = acc.reshape(t_list[k].shape).astype(t_list[k].dtype)
    avg = [k for k, r in enumerate(role) if r is TensorRole.FEDAVG]
    if avg:
        averaged = weighted_average([[sd[k] for k in avg] for sd in s_lists], w)
        for k, v in zip(avg, averaged):
            update[k] = v

    filtered = 1.0 - kept.mean(axis=1) if agg else np.zeros(n)
    mean_cos = cos.mean(axis=1) if agg else np.zeros(n)
    return FDAAggregate(update, coef, cos, kept, filtered, mean_cos, b)


# --------------------------------------------------------------------------------------------
# One FDA round from what the clients send (either placement)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceUpdate:
    """What source i contributes to an FDA round.

    Attributes:
        delta: Delta_i = h_i - h_global, L arrays (:func:`model_delta`).
        num_examples: n_i (weights the sources, :func:`source_weights`).
        lr: the learning rate it trained with, lr_S,i.
        steps: its optimizer steps this round, K_i >= 1.
    """

    delta: NDArrays
    num_examples: float
    lr: float
    steps: int


@dataclass(frozen=True)
class TargetUpdate:
    """What the target contributes to an FDA round.

    Attributes:
        delta: Delta_T, L arrays.
        lr: lr_T used this round.
        steps: B, its optimizer steps.
        step_matrix: auto mode: its per-step updates G, B' x m (:func:`prepare_step_updates`).
        step_var: auto FedDA with the one-float upload: S_T of App. A.5 instead of G.
        step_rows: B', the rows S_T was computed from (with ``step_var``).
    """

    delta: NDArrays
    lr: float
    steps: int
    step_matrix: np.ndarray | None = None
    step_var: float | None = None
    step_rows: int = 0


@dataclass(frozen=True)
class FDARound:
    """Result of :func:`fda_round`.

    Attributes:
        new_global: h_global^(r), L arrays in the global model's dtypes.
        aggregate: the per-tensor details (:class:`FDAAggregate`; betas, cosines, filters).
        stats: the auto-weighting statistics, or None (fixed beta, or fewer than 2 target steps).
        align: a_i (N,), :func:`alignment_factors`.
        target_update_norm: ||Delta_T|| over the aggregated tensors.
        notes: warnings raised while choosing the betas (e.g. the fallback to the fixed beta).
    """

    new_global: NDArrays
    aggregate: FDAAggregate
    stats: FDAStats | None
    align: np.ndarray
    target_update_norm: float
    notes: tuple[str, ...] = ()

    def metrics(self, labels: Sequence[str]) -> dict[str, float]:
        """Scalars for the round's record: means, and per source ``beta_<label>``,
        ``filtered_frac_<label>``, ``mean_cos_<label>``, ``align_<label>``, ``d2_<label>``,
        ``tau2d2_<label>`` (auto), plus ``sigma2`` (auto)."""
        agg = self.aggregate
        if len(labels) != agg.betas.size:
            raise ValueError(f"need one label per source ({agg.betas.size}); got {len(labels)}")
        out = {
            "beta_mean": float(np.mean(agg.betas)),
            "filtered_frac_mean": float(np.mean(agg.filtered_frac)),
            "mean_cos_mean": float(np.mean(agg.mean_cos)),
            "update_norm_target": self.target_update_norm,
        }
        for i, label in enumerate(labels):
            out[f"beta_{label}"] = float(agg.betas[i])
            out[f"filtered_frac_{label}"] = float(agg.filtered_frac[i])
            out[f"mean_cos_{label}"] = float(agg.mean_cos[i])
            out[f"align_{label}"] = float(self.align[i])
        if self.stats is not None:
            out["sigma2"] = float(self.stats.target_var)
            for i, label in enumerate(labels):
                out[f"d2_{label}"] = float(self.stats.d2[i])
                if self.stats.tau2d2 is not None:
                    out[f"tau2d2_{label}"] = float(self.stats.tau2d2[i])
        return out


def _round_stats(
    target: TargetUpdate, sources: Sequence[SourceUpdate], source_flat: np.ndarray, roles: Sequence[TensorRole], config: FDAConfig
) -> FDAStats | None:
    """The App. A.5 statistics from the target's step matrix or its one-float summary; None
    when fewer than 2 rows are available (the caller then falls back to the fixed beta)."""
    lr_s = [s.lr for s in sources]
    k_s = [s.steps for s in sources]
    if target.step_matrix is not None:
        if target.step_matrix.shape[0] < 2:
            return None
        g_in, s_in = estimator_inputs(
            target.step_matrix, source_flat, source_steps=k_s, lr_target=target.lr, lr_sources=lr_s,
            alignment=config.estimator_alignment,
        )
        return estimate_fda_stats(g_in, s_in)
    if target.step_var is None or target.step_rows < 2 or not np.isfinite(target.step_var) or target.step_var < 0:
        return None
    c_t, c_s = estimator_scales(config.estimator_alignment, lr_target=target.lr, lr_sources=lr_s, num_sources=len(sources))
    gbar = flatten_update(target.delta, roles) / target.steps * c_t
    s_in = source_flat * (c_s / np.asarray(k_s, dtype=np.float64))[:, None]
    return estimate_fedda_stats_from_summary(gbar, target.step_var * c_t**2, target.step_rows, s_in)


def fda_round(
    global_arrays: Sequence[np.ndarray],
    target: TargetUpdate,
    sources: Sequence[SourceUpdate],
    config: FDAConfig,
    roles: Sequence[TensorRole | str] | None = None,
) -> FDARound:
    """One FDA round (Algorithm 1, steps 3-5), from the clients' updates to the new global model.

    Weights w_i (:func:`source_weights`), alignment a_i (:func:`alignment_factors`), beta_i
    (fixed, or Eq. 3 from the App. A.5 statistics when ``config.auto_weight``; with fewer than
    2 target steps the fixed beta, noted in ``notes``) and :func:`fda_aggregate`. The server
    runs this under the ``server`` placement and the target under the ``target`` placement, so
    both compute the same model from the same inputs.

    Args:
        global_arrays: h_global^(r-1), L arrays.
        target: the target's update (:class:`TargetUpdate`).
        sources: N >= 1 source updates (:class:`SourceUpdate`).
        config: the options.
        roles: one :class:`TensorRole` per tensor (default :func:`tensor_roles` without buffers).

    Raises:
        ValueError: no sources, mismatched shapes, NaN/Inf, non-positive lr or steps.
    """
    if not sources:
        raise ValueError("need at least one source update")
    role = _check_roles(roles, global_arrays) if roles is not None else tensor_roles(global_arrays, config)
    w = source_weights([s.num_examples for s in sources], config.source_weighting)
    align = alignment_factors(
        lr_target=target.lr, steps_target=target.steps,
        lr_sources=[s.lr for s in sources], steps_sources=[s.steps for s in sources],
    )
    stats = None
    if config.auto_weight:
        source_flat = np.stack([flatten_update(s.delta, role) for s in sources])
        stats = _round_stats(target, sources, source_flat, role, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        betas = round_betas(config, len(sources), stats)
    agg = fda_aggregate(target.delta, [s.delta for s in sources], betas=betas, weights=w, config=config, align=align, roles=role)
    return FDARound(
        new_global=apply_update(global_arrays, agg.update),
        aggregate=agg,
        stats=stats,
        align=np.asarray(align, dtype=np.float64),
        target_update_norm=float(np.linalg.norm(flatten_update(target.delta, role))),
        notes=tuple(str(c.message) for c in caught),
    )
