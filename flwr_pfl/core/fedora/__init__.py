"""FEDORA: personalized federated learning with parameter propagation (Wu et al., KDD 2023).

The mathematics of FEDORA as plain functions on NumPy arrays and torch tensors, free of Flower.
Equation, algorithm-line, lemma and theorem numbers refer to the paper
(*Personalized Federated Learning with Parameter Propagation*, KDD '23).

This package re-exports the public API of its modules, so ``from flwr_pfl.core import fedora``
gives every name below.

Modules, in dependency order
----------------------------
================  ===============================================================================
``options``       option types and dataclasses, :class:`FedoraConfig`, the presets (spec 3.6-3.7)
``subspace``      client: the data matrix and its subspace ``U_k`` (Algorithm 1 lines 1-3)
``selection``     client: validation error and the selection weight ``lambda_k`` (Eq. 8)
``proximal``      client: the proximal term of the local objective (Eq. 2 / Eq. 9)
``similarity``    server: principal-angle similarity of the subspaces (Eq. 4-5); Table 4 ablations
``graph``         server: graph ``W``, transition ``P`` and propagation matrix ``M`` (Eq. 4, Eq. 6)
``propagation``   server: ``Theta_hat = M Theta`` (Eq. 6), its iterations (Eq. 7), Eq. 3
``server``        server: flattened parameter buffers, the per-round update, new clients (Alg. 2)
``transfer``      evaluation against LOCAL: R-Acc (Def. 3.2), PTR (Def. 3.3)
================  ===============================================================================

Overview (Algorithm 1)
----------------------
* **Client, once (lines 1-3).** :func:`client_subspace` turns the client's training data
  ``Z_k = [X_k | onehot(Y_k)]`` (``n_k x (d_x + C)``) into the top-``p`` right singular vectors
  ``U_k`` (``(d_x + C) x p``, orthonormal columns). ``U_k`` is uploaded.
* **Server, once (line 5).** :func:`build_propagation_graph` computes the principal-angle
  similarity ``s_kk' = sum_i cos zeta_i`` (Eq. 4-5), turns it into a graph ``W`` (the paper's dense
  rule, or the official code's sharpened top-k rule), the row-stochastic ``P = D^-1 W`` and the
  propagation matrix ``M = (1 - kappa) (I - kappa P)^-1`` (Eq. 6), ``kappa = alpha / (1 + alpha)``.
* **Client, every round (lines 10-14).** :func:`selection_weight` sets ``lambda_k`` from the
  validation losses of the personalized model ``theta_k`` and the received auxiliary model
  ``theta_hat_k`` (Eq. 8); local training minimises ``CE + lambda_k ||theta_k - theta_hat_k||^2``
  (Eq. 9) with :func:`proximal_penalty` (added to the loss) or :func:`apply_proximal_correction_`
  (the official code's post-step correction).
* **Server, every round (line 16).** :func:`server_update` writes the uploaded ``theta_k`` into a
  ``K x P`` buffer of last-known personalized models and recomputes every ``theta_hat_k`` in place
  (Eq. 6 closed form, or Eq. 7 iterations).
* **Evaluation.** :func:`transfer_summary` gives the mean score, R-Acc (Def. 3.2) and PTR
  (Def. 3.3) against LOCAL.
* **New clients (Algorithm 2).** :func:`new_client_auxiliary_model` gives ``theta_hat`` for a
  client that joins after training, from its subspace alone.

Wire layout (what the Flower layer moves)
-----------------------------------------
* setup, client -> server: ``[U_k]`` (one float array ``(d_x + C) x p``), ``num_examples = n_k``;
* round, server -> client k: ``theta_hat_k`` as the model's list of arrays
  (:meth:`ParameterLayout.unflatten` of row k of the ``theta_hat`` buffer: views, no copies);
* round, client -> server: ``theta_k`` as the model's list of arrays
  (:meth:`ParameterLayout.flatten` into row k of the ``theta`` buffer); scalar metrics
  ``lambda``, ``val_loss_personal``, ``val_loss_aux``.

Presets
-------
:func:`fedora_preset` returns ``"paper"`` or ``"official"`` (alias ``"official_code"``) settings;
``FedoraConfig()`` holds the recommended defaults. Every difference between the two presets is a
named field of the option dataclasses in :mod:`flwr_pfl.core.fedora.options`.
"""

from flwr_pfl.core.fedora.options import (
    FedoraConfig,
    GraphOptions,
    LambdaOptions,
    LambdaRule,
    LocalTrainingOptions,
    NonFinitePolicy,
    Preset,
    PropagationOptions,
    PropagationSolver,
    ProxMode,
    ProxOptions,
    SimilarityTransform,
    SubspaceOptions,
    TaskLoss,
    ValidationMetric,
    ValidationOptions,
    ValidationReduction,
    alpha_from_kappa,
    fedora_preset,
    kappa_from_alpha,
)
from flwr_pfl.core.fedora.subspace import client_subspace, data_matrix
from flwr_pfl.core.fedora.selection import (
    max_stable_lambda,
    per_sample_errors,
    selection_weight,
    validation_error,
)
from flwr_pfl.core.fedora.proximal import (
    apply_proximal_correction_,
    proximal_gradient,
    proximal_penalty,
)
from flwr_pfl.core.fedora.similarity import (
    cosine_similarity_matrix,
    principal_angle_cosines,
    random_similarity,
    subspace_similarity,
    validate_subspace,
)
from flwr_pfl.core.fedora.graph import (
    PropagationGraph,
    build_propagation_graph,
    propagation_graph_from_similarity,
    propagation_matrix,
    row_normalize,
    similarity_graph,
)
from flwr_pfl.core.fedora.propagation import propagate, propagate_iterative, server_objective
from flwr_pfl.core.fedora.server import (
    ParameterLayout,
    init_server_buffers,
    new_client_auxiliary_model,
    server_update,
    validate_upload,
)
from flwr_pfl.core.fedora.transfer import (
    TransferSummary,
    lambda_activity,
    positive_transfer_ratio,
    relative_improvement,
    transfer_summary,
)

__all__ = [
    # option types
    "Preset",
    "SimilarityTransform",
    "PropagationSolver",
    "LambdaRule",
    "NonFinitePolicy",
    "ProxMode",
    "ValidationMetric",
    "ValidationReduction",
    "TaskLoss",
    "SubspaceOptions",
    "GraphOptions",
    "PropagationOptions",
    "LambdaOptions",
    "ProxOptions",
    "ValidationOptions",
    "LocalTrainingOptions",
    "FedoraConfig",
    "fedora_preset",
    "kappa_from_alpha",
    "alpha_from_kappa",
    # client side
    "data_matrix",
    "client_subspace",
    "per_sample_errors",
    "validation_error",
    "selection_weight",
    "max_stable_lambda",
    "proximal_penalty",
    "proximal_gradient",
    "apply_proximal_correction_",
    # server side
    "validate_subspace",
    "principal_angle_cosines",
    "subspace_similarity",
    "cosine_similarity_matrix",
    "random_similarity",
    "similarity_graph",
    "row_normalize",
    "propagation_matrix",
    "PropagationGraph",
    "build_propagation_graph",
    "propagation_graph_from_similarity",
    "propagate",
    "propagate_iterative",
    "server_objective",
    "ParameterLayout",
    "init_server_buffers",
    "validate_upload",
    "server_update",
    "new_client_auxiliary_model",
    # metrics
    "relative_improvement",
    "positive_transfer_ratio",
    "lambda_activity",
    "TransferSummary",
    "transfer_summary",
]
