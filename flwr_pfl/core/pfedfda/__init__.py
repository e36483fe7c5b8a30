"""pFedFDA: personalized federated learning via feature distribution adaptation.

McLaughlin & Su, "Personalized Federated Learning via Feature Distribution Adaptation",
NeurIPS 2024. Every model is a shared feature extractor phi (x -> z in R^d) plus a per-client
*generative* classifier: class-conditional Gaussians N(z | mu^c, Sigma) with one covariance tied
across classes and the client's label priors pi, which Bayes' rule turns into a linear (LDA)
head (Eq. 3-4). The head is never trained; it is computed in closed form.

This package holds the mathematics only, free of Flower, one module per concern (in dependency
order); it re-exports their public API, so ``from flwr_pfl.core import pfedfda`` gives every name:

* ``checks``: input checks and conversions shared by the modules below;
* ``options``: :class:`BetaMode`, :class:`BetaSolver`, :class:`CovRegularization`,
  :class:`BetaSearch`, :class:`PFedFDAConfig` (presets ``paper()`` / ``official_code()``);
* ``lda``, the LDA head (Eq. 3-4): :func:`label_priors`, :func:`lda_head`, :func:`lda_logits`;
* ``statistics``, feature statistics (Eq. 6-8): :func:`class_moments` (mergeable across
  mini-batches with :func:`merge_class_moments`), :func:`gaussian_estimates`,
  :func:`estimate_statistics`, covariance regularization :func:`regularize_covariance` and the PD
  repair :func:`nearest_pd_same_variance`;
* ``interpolation`` (Alg. 1 lines 10-11): :func:`interpolate_statistics`;
* beta selection by k-fold cross-validation (Eq. 9): ``cross_validation`` (the objective:
  :func:`stratified_kfold`, :func:`build_cv_folds`, :func:`cv_objective`) and ``beta`` (its
  minimization: :func:`solve_beta`);
* ``personalization``, the client step after local training, and the personalized model at test
  time (Alg. 1 lines 8-11; App. C.3): :func:`personalize`;
* ``server``, the server step (Alg. 1 lines 1-2 and 15): :func:`init_global_statistics`,
  :func:`bernoulli_participation`, :func:`aggregate_statistics`,
  :func:`check_client_statistics`, :func:`global_statistics_summary`,
  :func:`class_separation` (a collapse of the backbone's features), :func:`client_accuracy_summary`;
* ``wire``, the wire layout: :func:`join_wire`, :func:`split_wire`, :func:`cov_to_triu`,
  :func:`triu_to_cov`;
* ``theory``, theory and accounting: :func:`interpolated_mean_error`,
  :func:`optimal_interpolation_beta` (Theorem 1 / App. E), :func:`communication_cost` (Table 8).

Who calls what
--------------
Server (each round): send ``join_wire(backbone, mu_g, Sigma_g)``; receive from every sampled
client ``[backbone..., mu_i, Sigma_i]`` with ``num_examples = n_i``; check each reply with
:func:`check_client_statistics`; average everything with n_i weights (the whole server step is
FedAvg over the extended list, :func:`aggregate_statistics` for the two statistics arrays).

Client ``fit``: ``mu_g, Sigma_g = split_wire(arrays)``; ``pi = label_priors(train labels)``;
``W, b = lda_head(mu_g, Sigma_g, pi)`` frozen into the model's linear head; train phi; collect the
feature bank (Z, Y); ``p = personalize(Z, Y, mu_g, Sigma_g, priors=pi, previous_beta=...)``;
return ``join_wire(backbone, p.means, p.cov)`` and ``p.beta.as_metrics()``.

Client ``evaluate``: features of the training split from the *global* backbone;
``p = personalize(...)``; score the test split with ``lda_logits(z, p.weight, p.bias)``.

Conventions: client-side functions take ``torch.Tensor`` or NumPy arrays and return tensors on
the device and in the floating dtype of the features; server-side functions take and return
NumPy arrays (what crosses the wire). C is the number of classes, d the feature width.
"""

from flwr_pfl.core.pfedfda.options import (
    FLAT_KEYS,
    BetaMode,
    BetaSearch,
    BetaSolver,
    BetaStatus,
    CovRegularization,
    GlobalMeanInit,
    LDASolve,
    PFedFDAConfig,
)
from flwr_pfl.core.pfedfda.lda import (
    label_counts,
    label_priors,
    lda_head,
    lda_logits,
    priors_from_counts,
)
from flwr_pfl.core.pfedfda.statistics import (
    ClassMoments,
    class_moments,
    estimate_statistics,
    gaussian_estimates,
    merge_class_moments,
    nearest_pd_same_variance,
    regularize_covariance,
)
from flwr_pfl.core.pfedfda.interpolation import interpolate_statistics
from flwr_pfl.core.pfedfda.cross_validation import (
    CVFold,
    CVInfeasible,
    build_cv_folds,
    cv_objective,
    stratified_kfold,
)
from flwr_pfl.core.pfedfda.beta import BetaResult, golden_section_minimize, solve_beta
from flwr_pfl.core.pfedfda.personalization import Personalization, personalize
from flwr_pfl.core.pfedfda.server import (
    COLLAPSED_SEPARATION,
    aggregate_statistics,
    bernoulli_participation,
    check_client_statistics,
    class_separation,
    client_accuracy_summary,
    global_statistics_summary,
    init_global_statistics,
    nearest_psd,
)
from flwr_pfl.core.pfedfda.wire import cov_to_triu, join_wire, split_wire, triu_to_cov
from flwr_pfl.core.pfedfda.theory import (
    CommunicationCost,
    communication_cost,
    interpolated_mean_error,
    optimal_interpolation_beta,
)

__all__ = [
    "COLLAPSED_SEPARATION",
    "BetaMode",
    "BetaResult",
    "BetaSearch",
    "BetaSolver",
    "BetaStatus",
    "CVFold",
    "CVInfeasible",
    "ClassMoments",
    "CommunicationCost",
    "CovRegularization",
    "FLAT_KEYS",
    "GlobalMeanInit",
    "LDASolve",
    "PFedFDAConfig",
    "Personalization",
    "aggregate_statistics",
    "bernoulli_participation",
    "build_cv_folds",
    "check_client_statistics",
    "class_moments",
    "class_separation",
    "client_accuracy_summary",
    "communication_cost",
    "cov_to_triu",
    "cv_objective",
    "estimate_statistics",
    "gaussian_estimates",
    "global_statistics_summary",
    "nearest_psd",
    "golden_section_minimize",
    "init_global_statistics",
    "interpolate_statistics",
    "interpolated_mean_error",
    "join_wire",
    "label_counts",
    "label_priors",
    "lda_head",
    "lda_logits",
    "merge_class_moments",
    "nearest_pd_same_variance",
    "optimal_interpolation_beta",
    "personalize",
    "priors_from_counts",
    "regularize_covariance",
    "solve_beta",
    "split_wire",
    "stratified_kfold",
    "triu_to_cov",
]
