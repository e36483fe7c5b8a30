"""pFedFDA's NumPyClient (McLaughlin & Su, NeurIPS 2024, Alg. 1 lines 5-12 and §4.3).

The model's (single) linear head is never trained: it is *set* to the LDA head of Gaussian
class statistics (Eq. 3-4). Each round the client freezes the head built from the global
statistics and its own label priors, trains the backbone with the shared train loop, estimates
local statistics from the features of that training, picks beta by cross-validation (Eq. 9),
interpolates, and sends back the backbone and the interpolated statistics. The mathematics is
in :mod:`flwr_pfl.core.pfedfda`; the wire layout is documented in
:mod:`flwr_pfl.strategies.pfedfda`. The only state kept across rounds is the previous beta
(the solver-failure fallback), in ``context.state``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Context
from torch import nn

from flwr_pfl.clients.base import EXTRA_SEPARATOR, Config, LocalData, PFLClient, TrainConfig, seeded_message
from flwr_pfl.core.pfedfda import (
    BetaResult,
    BetaStatus,
    PFedFDAConfig,
    Personalization,
    init_global_statistics,
    join_wire,
    label_priors,
    lda_head,
    personalize,
    split_wire,
)
from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.models.split import HeadSpec
from flwr_pfl.training import (
    collect_features,
    dataset_targets,
    get_arrays,
    load_scalars,
    loader_like,
    per_sample_loss,
    save_scalars,
    set_arrays,
)

NDArrays = list[np.ndarray]
STATS_SOURCES = ("all_epochs", "last_epoch", "fresh_pass")


@dataclass
class _FeatureBank:
    """Features z (detached) and labels of the training steps chosen by ``stats_source``."""

    record_from_step: int  # first step whose features are kept; -1: none (fresh pass)
    step: int = 0
    features: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)


def lda_head_problems(model: nn.Module) -> list[str]:
    """What keeps ``model``'s head from holding an LDA head (empty: nothing).

    pFedFDA never trains its head: every round it *writes* ``logits = W z + b`` (Eq. 4) into it,
    so the model needs exactly one ``nn.Linear(feature_dim, num_outputs)`` with a bias, applied
    to the encoder's features.
    """
    heads = getattr(model, "heads", None)
    if heads is None or len(heads) != 1:
        return [f"{len(heads) if heads is not None else 'no'} heads (need exactly one)"]
    head = heads[0]
    if not isinstance(head, nn.Linear):
        return [f"a head of type {type(head).__name__} (need torch.nn.Linear)"]
    problems = []
    if head.bias is None:
        problems.append("a head without a bias (the LDA head's b has nowhere to go)")
    d, c = getattr(model, "feature_dim", None), getattr(model, "num_outputs", None)
    if (head.in_features, head.out_features) != (d, c):
        problems.append(f"a head Linear({head.in_features}, {head.out_features}) on a model with "
                        f"feature_dim={d} and num_outputs={c}")
    return problems


def check_lda_head(model: nn.Module) -> None:
    """Refuse a model whose head cannot hold pFedFDA's LDA head, saying what was found.

    Raises:
        ConfigError: the model does not have one biased ``nn.Linear(feature_dim, num_outputs)``
            head (see :func:`lda_head_problems`).
    """
    problems = lda_head_problems(model)
    if problems:
        raise ConfigError(
            "pFedFDA needs one linear head with a bias on the representation, "
            "nn.Linear(feature_dim, num_outputs, bias=True), because it writes the LDA head "
            f"W z + b into it every round; this model has {'; '.join(problems)}. Name your model's "
            "final nn.Linear as its head (head='fc3' for a model ending in self.fc3), or build "
            "EncoderHeadModel(encoder, feature_dim, num_classes, num_heads=1, head_bias=True) "
            "(in the app: any model but 'linear', whose heads have no bias)"
        )


class PFedFDAClient(PFLClient):
    """pFedFDA's client: backbone trained against a frozen global generative head.

    The model needs one linear head on the representation: a biased ``nn.Linear(d, C)`` that
    takes the features (width d) and gives the model's output (C classes), because pFedFDA
    writes its LDA head into it. A user's own model qualifies when its last step is such a
    layer: ``PFedFDAClient(context, Net(), data, head="fc3")`` (quickstart-pytorch's ``Net``:
    ``fc3 = nn.Linear(84, 10)`` on the 84 features of ``fc2``). A model that does not fit is
    refused with what was found (:func:`check_lda_head`).

    Args:
        context, model, data, train_config, head: as :class:`PFLClient`.
        config: the statistics, beta search and head options used at evaluation (and for
            new clients).
        fit_config: the same after local training (default: ``config``); the official code
            lets any present class have its own mean there (``min_class_count=0``).
        stats_source: ``all_epochs`` (the features of every local epoch, as the official code),
            ``last_epoch``, or ``fresh_pass`` (one eval-mode pass of the trained backbone).
        eval_drop_last: evaluation features skip the last partial batch of a shuffled loader
            of ``batch_size`` (the official code's quirk, spec §9.7).
        packed_cov: Sigma travels as its upper triangle (must match the strategy).
    """

    #: DP-SGD cannot cover this client (see PFLClient.record_dp_refusal)
    record_dp_refusal = (
        'it uploads class feature means and the feature covariance computed from the data outside DP-SGD'
    )

    shared_group = "body"
    personal_group = None
    head_requirement = "module"
    STATE_KEY = "pfedfda"

    def __init__(
        self,
        context: Context,
        model: nn.Module,
        data: LocalData,
        train_config: TrainConfig | None = None,
        *,
        head: HeadSpec | None = None,
        config: PFedFDAConfig | None = None,
        fit_config: PFedFDAConfig | None = None,
        stats_source: str = "all_epochs",
        eval_drop_last: bool = False,
        packed_cov: bool = False,
    ) -> None:
        super().__init__(context, model, data, train_config, head=head)
        check_lda_head(self.model)
        if data.task != "classification":
            raise ValueError("pFedFDA is a classification method (its head is a Gaussian posterior)")
        if stats_source not in STATS_SOURCES:
            raise ValueError(f"stats_source must be one of {STATS_SOURCES}, got {stats_source!r}")
        self.config = config or PFedFDAConfig()
        self.fit_config = fit_config or self.config
        self.stats_source = stats_source
        self.eval_drop_last = eval_drop_last
        self.packed_cov = packed_cov
        self.num_classes = self.model.num_outputs
        self.global_means: torch.Tensor | None = None
        self.global_cov: torch.Tensor | None = None

    # ---------------------------------------------------------------- wire
    def get_parameters(self, config: Config) -> NDArrays:
        """Backbone plus initial statistics (U[0,1) means, identity covariance); the strategy
        replaces the statistics with its own initial ones."""
        mu0, sigma0 = init_global_statistics(self.num_classes, self.model.feature_dim, seed=self.train_config.seed)
        return join_wire(get_arrays(self.model, "body"), mu0, sigma0, packed_cov=self.packed_cov)

    def receive(self, parameters: NDArrays) -> None:
        """Load the global backbone and keep (mu_g, Sigma_g) for this message."""
        backbone, mu, sigma = split_wire(parameters, packed_cov=self.packed_cov)
        expected = (self.num_classes, self.model.feature_dim)
        if mu.shape != expected:
            raise ValueError(f"global means have shape {mu.shape}; this model needs (C, d) = {expected}")
        set_arrays(self.model, backbone, "body")
        self.global_means = torch.as_tensor(mu, dtype=torch.float32, device=self.device)
        self.global_cov = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)

    def wire_names(self) -> list[str]:
        """The backbone's ``state_dict`` keys, then the global statistics (not model tensors)."""
        return [*super().wire_names(), f"pfedfda{EXTRA_SEPARATOR}means", f"pfedfda{EXTRA_SEPARATOR}covariance"]

    def personal_state(self) -> dict[str, torch.Tensor]:
        """The personalized LDA head written by the last evaluation (Eq. 4 with this client's
        beta and priors); with the global backbone it is this client's model."""
        return self.group_state("heads")

    # ---------------------------------------------------------------- helpers
    def _train_labels_and_domain(self) -> tuple[torch.Tensor, int]:
        """All training labels (for the priors pi_i) and the most frequent training domain."""
        y, d = dataset_targets(self.data.train, self.data.batch_keys)
        return y.long(), int(torch.bincount(d.long()).argmax()) if d.numel() else 0

    def _previous_beta(self) -> tuple[float, float]:
        state = load_scalars(self.context.state, self.STATE_KEY)
        return float(state.get("beta_mu", 0.5)), float(state.get("beta_sigma", 0.5))

    def _set_head(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Write an LDA head into the model's linear head (Eq. 4: logits = W z + b)."""
        head = self.model.heads[0]
        with torch.no_grad():
            head.weight.copy_(weight.to(head.weight.device, head.weight.dtype))
            head.bias.copy_(bias.to(head.bias.device, head.bias.dtype))

    def _personalize(self, z: torch.Tensor, y: torch.Tensor, priors: torch.Tensor, config: PFedFDAConfig) -> Personalization:
        """Alg. 1 lines 8-11, with the global statistics when there are fewer than 2 feature
        rows (no covariance can be estimated: the same choice as infeasible CV, beta = 0)."""
        assert self.global_means is not None and self.global_cov is not None
        if z.shape[0] < 2:
            w, b = lda_head(self.global_means, self.global_cov, priors, shrinkage=config.lda_shrinkage, solve=config.lda_solve)
            beta = BetaResult(0.0, 0.0, BetaStatus.CV_INFEASIBLE, reason=f"{z.shape[0]} feature rows")
            return Personalization(beta, self.global_means, self.global_cov, priors, w, b)
        return personalize(
            z, y, self.global_means, self.global_cov, priors=priors, config=config, previous_beta=self._previous_beta()
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- fit: Alg. 1 lines 5-12
    @seeded_message
    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, Config]:
        self.receive(parameters)
        assert self.global_means is not None and self.global_cov is not None
        labels, _ = self._train_labels_and_domain()
        priors = label_priors(labels, self.num_classes, self.fit_config.prior_eps).to(self.device)
        # Line 6: the head is the LDA head of the global statistics with the local priors, frozen.
        self._set_head(*lda_head(
            self.global_means, self.global_cov, priors,
            shrinkage=self.fit_config.lda_shrinkage, solve=self.fit_config.lda_solve,
        ))
        epochs = self.train_config.local_epochs
        steps_per_epoch = len(self.data.train)
        bank = _FeatureBank(
            record_from_step={"all_epochs": 0, "last_epoch": (epochs - 1) * steps_per_epoch}.get(self.stats_source, -1)
        )

        def loss_fn(model: EncoderHeadModel, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            z = model.features(x)
            if 0 <= bank.record_from_step <= bank.step:  # the training-time feature bank (line 8)
                bank.features.append(z.detach())
                bank.labels.append(y)
            bank.step += 1
            return per_sample_loss(model.heads[0](z), y, "classification")

        # Line 7: train the backbone only (cross-entropy of the posterior, Eq. 5).
        stats = self.train_groups(("body",), epochs, loss_fn=loss_fn)
        self._sync()
        start = time.perf_counter()
        if bank.features:
            z, y = torch.cat(bank.features), torch.cat(bank.labels)
        else:  # fresh_pass, or no training step: one eval-mode pass of the trained backbone
            z, y, _ = collect_features(self.model, self.data.train, device=self.device, keys=self.data.batch_keys)
        # Lines 8-11: local estimates, beta by cross-validation, interpolation.
        p = self._personalize(z, y.long(), priors, self.fit_config)
        self._sync()
        stats_seconds = time.perf_counter() - start
        save_scalars(self.context.state, self.STATE_KEY, {"beta_mu": p.beta.beta_mu, "beta_sigma": p.beta.beta_sigma})
        arrays = join_wire(get_arrays(self.model, "body"), p.means.float(), p.cov.float(), packed_cov=self.packed_cov)
        metrics: Config = {
            "train_loss": stats.loss,
            "train_seconds": stats.seconds,
            "stats_seconds": stats_seconds,
            "n_feats": int(z.shape[0]),
            "partition_id": self.partition_id,
            **p.beta.as_metrics(),
        }
        return arrays, len(labels), metrics

    # ---------------------------------------------------------------- evaluate: §4.3, App. C.3
    def personalized(self) -> Personalization:
        """The personalized generative head on the current (global) backbone: features of the
        training split in eval mode, beta by CV, interpolated statistics, LDA head with the
        local priors. Works the same for clients that never trained (Table 4)."""
        labels, _ = self._train_labels_and_domain()
        priors = label_priors(labels, self.num_classes, self.config.prior_eps).to(self.device)
        loader = self.data.train
        if self.eval_drop_last:
            loader = loader_like(loader, batch_size=self.train_config.batch_size, shuffle=True, drop_last=True)
        try:
            z, y, _ = collect_features(self.model, loader, device=self.device, keys=self.data.batch_keys)
        except ValueError:  # drop_last left nothing
            z = torch.empty(0, self.model.feature_dim, device=self.device)
            y = torch.empty(0, dtype=torch.long, device=self.device)
        return self._personalize(z, y.long(), priors, self.config)

    @seeded_message
    def evaluate(self, parameters: NDArrays, config: Config) -> tuple[float, int, Config]:
        self.receive(parameters)
        p = self.personalized()  # evaluation does not overwrite the fit-time beta (spec §8)
        self._set_head(p.weight, p.bias)
        result = self.evaluate_on(self.data.test)
        labels, domain = self._train_labels_and_domain()
        metrics: Config = {
            **result.metrics(),
            **p.beta.as_metrics(),
            "n_train": len(labels),
            "domain": domain,
            "partition_id": self.partition_id,
        }
        return result.loss, result.num_examples, metrics
