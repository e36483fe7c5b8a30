"""FedDAR: Federated Domain-Aware Representation Learning (Zhong et al., ICLR 2023), the mathematics.

The model is a shared encoder phi plus one linear head per predefined domain; a sample (x, y, z)
is predicted by h_z(phi(x)). One FedDAR round (Algorithm 1) has two client round-trips:

* **head phase**: clients train the heads on frozen features, the server aggregates each domain's
  head by weighted averaging (WA) or second-order aggregation (SA, Eq. 8);
* **representation phase**: clients train the encoder with the heads frozen, on the domain
  re-weighted loss (Eq. 6, u_m = L / (L_m M)); the server averages encoders with weights L_i / L.

This package holds the pieces of that round as plain functions, one module per concern (in
dependency order below); it re-exports their public API, so ``from flwr_pfl.core import feddar``
gives every name.

===================  ==========================================================================
``options``          head aggregation rule, head loss, Hessian point, SA options (Sec. 4.3, Eq. 8)
``layout``           :class:`HeadLayout`, a linear head's flat wire layout
``checks``           input validation shared by the modules below
``losses``           client: counts, predictions, per-sample and domain re-weighted losses (Eq. 6)
``head_statistics``  client, head phase: local heads, losses, gradients and Hessians for SA
``aggregation``      server: re-weighting factors u_m (Eq. 6), WA and SA heads (Eq. 8), encoder
``linear``           Algorithm 2 (App. A.2), the analysed linear variant
``evaluation``       binary AUC, the EXAM tables' metric
===================  ==========================================================================

The functions, by where they run:

Client side (torch tensors in, float64 torch tensors out):
    :func:`domain_counts`, :func:`head_outputs`, :func:`per_sample_loss`, :func:`head_phase_loss`,
    :func:`reweighted_loss`, :func:`local_least_squares_heads`, :func:`hessian_point`,
    :func:`head_statistics`; for Algorithm 2 :func:`spectral_statistic`,
    :func:`linear_head_statistics`, :func:`linear_representation_gradient`.
Server side (NumPy arrays in and out, float64):
    :func:`domain_weights`, :func:`aggregate_heads_wa`, :func:`aggregate_heads_sa`,
    :func:`aggregate_heads`, :func:`aggregate_encoder`; for Algorithm 2 :func:`spectral_init`,
    :func:`solve_linear_heads`, :func:`representation_step`, :func:`principal_angle_distance`.

Client-side functions accept any number of leading batch dimensions (``...``) before the sample
dimension, so one call can also process a stack of clients that hold equally many samples.

**Head parameter layout.** A head is a linear map from k features to N outputs, weight W (N, k) and
optionally a bias b (N,). It travels as one flat vector of P = N (k + bias) numbers: the rows of
the augmented matrix [W | b] one after the other ("class-major" vec, :class:`HeadLayout`). Hessians
are (P, P) in the same order; for logits W phi the per-sample Hessian is then S kron (phi phi^T)
with S the (N, N) curvature of the loss in the logits.

**Hessian normalisation.** :func:`head_statistics` returns Hessians of the *mean* per-domain loss
R_{i,m} (the 1/L_{i,m}-normalised form of the paper's logistic example); SA then weights client i
by alpha_{i,m} = L_{i,m} (:attr:`SAWeighting.DOMAIN_COUNT`), which is the same as summing
un-normalised Hessians, and makes SA on squared loss equal pooled least squares.

There is no official FedDAR code; defaults marked "inferred" follow the project's specification.
"""

from flwr_pfl.core.feddar.options import (
    HeadAggregation,
    HeadLoss,
    HessianAt,
    SAOptions,
    SASolver,
    SAWeighting,
)
from flwr_pfl.core.feddar.layout import HeadLayout
from flwr_pfl.core.feddar.losses import (
    domain_counts,
    head_outputs,
    head_phase_loss,
    per_sample_loss,
    reweighted_loss,
)
from flwr_pfl.core.feddar.head_statistics import (
    HeadStatistics,
    head_statistics,
    hessian_point,
    local_least_squares_heads,
)
from flwr_pfl.core.feddar.aggregation import (
    HeadAggregationResult,
    aggregate_encoder,
    aggregate_heads,
    aggregate_heads_sa,
    aggregate_heads_wa,
    domain_weights,
)
from flwr_pfl.core.feddar.linear import (
    LinearHeadStatistics,
    linear_head_statistics,
    linear_representation_gradient,
    principal_angle_distance,
    representation_step,
    solve_linear_heads,
    spectral_init,
    spectral_statistic,
)
from flwr_pfl.core.feddar.evaluation import binary_auc

__all__ = [
    "HeadAggregation",
    "HeadLoss",
    "HessianAt",
    "SAWeighting",
    "SASolver",
    "SAOptions",
    "HeadLayout",
    "HeadStatistics",
    "HeadAggregationResult",
    "LinearHeadStatistics",
    "domain_counts",
    "domain_weights",
    "head_outputs",
    "per_sample_loss",
    "head_phase_loss",
    "reweighted_loss",
    "local_least_squares_heads",
    "hessian_point",
    "head_statistics",
    "aggregate_heads_wa",
    "aggregate_heads_sa",
    "aggregate_heads",
    "aggregate_encoder",
    "spectral_statistic",
    "spectral_init",
    "linear_head_statistics",
    "solve_linear_heads",
    "linear_representation_gradient",
    "representation_step",
    "principal_angle_distance",
    "binary_auc",
]
