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
One module per piece, in dependency order; this package re-exports their public API, so
``from flwr_pfl.core import fedgp`` gives every name below.

* Options (``options``, ``config``): the option enums, :class:`FDAConfig` (one frozen dataclass
  of typed options, defaults = the recommended choices, stated per option) and
  :func:`fda_preset` (paper/official-code presets).
* Round schedule (server, ``schedule``): :func:`plan_round` (warm-up FedAvg rounds, then FDA
  rounds; lr decay).
* Tensor bookkeeping (both sides, ``tensors``): :func:`tensor_roles`, :func:`model_delta`,
  :func:`apply_update`, :func:`flatten_update`, :func:`unflatten_update`.
* Target side (``step_updates``): :func:`prepare_step_updates` (its upload in auto mode: B
  per-step deltas as a B x m matrix, :func:`stack_step_updates`, optionally averaged into fewer
  "super-batch" rows, :func:`group_step_updates`), :func:`summarize_step_updates` (the per-step
  variance estimator of App. A.5).
* Server side: :func:`source_weights`, :func:`alignment_factors` (``weights``),
  :func:`estimator_inputs`, :func:`estimate_fda_stats` (App. A.5 estimators),
  :func:`estimate_fedda_stats_from_summary` (the same FedDA estimate from one scalar the target
  sends) (``estimators``), :func:`auto_betas` (Eq. 3 and the A.4 delta-form),
  :func:`round_betas` (``auto_weight``), :func:`fda_aggregate` (Definitions 4.1 / 4.3 and the
  per-layer rule of App. C.9; ``aggregate``), :func:`fda_round` (one round from what the clients
  send, either placement; ``round``).
* Primitives: :func:`proj_pos` (Definition 4.3), :func:`cosine_similarity`,
  :func:`cosine_scaled_component` (App. C.9) (``projection``), :func:`delta_error_fedda` (Thm
  4.2, Eq. 1), :func:`delta_error_fedgp` (Thm 4.4, Eq. 2, and its A.4 form) (``auto_weight``).

Conventions: beta is always the weight on the **source** side (beta = 0 is Target Only); App.
C.9 prints it the other way round, which is a typo (Tables 8-11: beta = 0 gives identical FedDA
and FedGP numbers). All arithmetic is done in float64 and cast back to each tensor's dtype.
"""

from flwr_pfl.core.fedgp.options import (
    EstimatorAlignment,
    FedGPBetaForm,
    Granularity,
    Phase,
    Placement,
    Preset,
    Projection,
    Rule,
    SourceWeighting,
    Stage,
    TensorRole,
)
from flwr_pfl.core.fedgp.config import FDAConfig, fda_preset
from flwr_pfl.core.fedgp.schedule import RoundPlan, plan_round
from flwr_pfl.core.fedgp.tensors import (
    NDArrays,
    apply_update,
    flatten_update,
    model_delta,
    tensor_roles,
    unflatten_update,
)
from flwr_pfl.core.fedgp.step_updates import (
    StepSummary,
    group_step_updates,
    prepare_step_updates,
    stack_step_updates,
    summarize_step_updates,
)
from flwr_pfl.core.fedgp.weights import alignment_factors, source_weights
from flwr_pfl.core.fedgp.estimators import (
    FDAStats,
    estimate_fda_stats,
    estimate_fedda_stats_from_summary,
    estimator_inputs,
    estimator_scales,
)
from flwr_pfl.core.fedgp.auto_weight import (
    auto_betas,
    delta_error_fedda,
    delta_error_fedgp,
    round_betas,
)
from flwr_pfl.core.fedgp.projection import cosine_scaled_component, cosine_similarity, proj_pos
from flwr_pfl.core.fedgp.aggregate import FDAAggregate, fda_aggregate
from flwr_pfl.core.fedgp.round import FDARound, SourceUpdate, TargetUpdate, fda_round

__all__ = [
    "NDArrays",
    "Rule",
    "Projection",
    "Granularity",
    "SourceWeighting",
    "FedGPBetaForm",
    "EstimatorAlignment",
    "TensorRole",
    "Phase",
    "Placement",
    "Stage",
    "Preset",
    "FDAConfig",
    "fda_preset",
    "RoundPlan",
    "plan_round",
    "tensor_roles",
    "model_delta",
    "apply_update",
    "flatten_update",
    "unflatten_update",
    "stack_step_updates",
    "group_step_updates",
    "prepare_step_updates",
    "StepSummary",
    "summarize_step_updates",
    "source_weights",
    "alignment_factors",
    "estimator_scales",
    "estimator_inputs",
    "FDAStats",
    "estimate_fda_stats",
    "estimate_fedda_stats_from_summary",
    "auto_betas",
    "round_betas",
    "delta_error_fedda",
    "delta_error_fedgp",
    "cosine_similarity",
    "proj_pos",
    "cosine_scaled_component",
    "FDAAggregate",
    "fda_aggregate",
    "SourceUpdate",
    "TargetUpdate",
    "FDARound",
    "fda_round",
]
