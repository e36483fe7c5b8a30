"""Registry entries of FedGP, FedDA (fixed or auto beta) and the Target Only / Source Only baselines.

Options are read from ``fedgp.<field>``, ``fedda.<field>``, ``target-only.<field>`` and
``source-only.<field>`` (kebab-case). The target is partition ``target-partition`` (-1: the last
partition; a node may instead say ``fedgp-role = "target"`` in its node config).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from flwr_pfl.app.registry import AlgorithmSpec, register
from flwr_pfl.clients.fedgp import FedGPClient
from flwr_pfl.core.fedgp import FDAConfig, Preset, fda_preset
from flwr_pfl.errors import ConfigError
from flwr_pfl.strategies.fedgp import STEP_UPLOADS, FedDA, FedGP, SourceOnly, TargetOnly

PRESETS = ("none", *(p.value for p in Preset))


@dataclass(frozen=True)
class TargetRoleOptions:
    """Who the target is and how it trains (shared by every algorithm of this family).

    Attributes (defaults in brackets):
        target_partition: the target's partition id [-1 = the last partition].
        target_train_samples: labelled samples the target trains on, drawn once, seeded [0 =
            its whole training split]; ColoredMNIST in the paper has about 18 (0.1%).
        target_train_fraction: instead of a count, this fraction of the target's training
            split, in (0, 1] [0 = unused; the label-shift runs use 15%, App. C.7].
        target_lr_ratio: lr_T / lr_S [0.5, the Fashion-MNIST / CIFAR-10 code; DomainBed 0.2].
        target_batch_size: the target's batch size [16, the paper's fixed-beta value; auto runs
            use smaller ones so that B is larger, C.4; 0 = the run's batch-size].
        evaluate_sources: also evaluate the global model on the sources' own test splits
            (source-domain accuracy) [true].
    """

    prefix: ClassVar[str] = "fedgp"

    target_partition: int = -1
    target_train_samples: int = 0
    target_train_fraction: float = 0.0
    target_lr_ratio: float = 0.5
    target_batch_size: int = 16
    evaluate_sources: bool = True

    def fail(self, field: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{self.prefix}.{field.replace('_', '-')}={value!r} is not allowed; {allowed}")

    def __post_init__(self) -> None:
        if self.target_partition < -1:
            self.fail("target_partition", self.target_partition, "use -1 (the last partition) or a partition id >= 0")
        if self.target_train_samples < 0:
            self.fail("target_train_samples", self.target_train_samples, "use 0 (all) or a count > 0")
        if not 0.0 <= self.target_train_fraction <= 1.0:
            self.fail("target_train_fraction", self.target_train_fraction, "use 0 (unused) or a fraction in (0, 1]")
        if self.target_train_fraction and self.target_train_samples:
            self.fail("target_train_fraction", self.target_train_fraction,
                      "set either target-train-samples or target-train-fraction, not both")
        if not self.target_lr_ratio > 0:
            self.fail("target_lr_ratio", self.target_lr_ratio, "use a number > 0")
        if self.target_batch_size < 0:
            self.fail("target_batch_size", self.target_batch_size, "use 0 (the run's batch-size) or >= 1")

    def client_kwargs(self) -> dict[str, Any]:
        return {
            "target_partition": self.target_partition,
            "target_train_samples": self.target_train_samples,
            "target_train_fraction": self.target_train_fraction,
            "target_lr_ratio": self.target_lr_ratio,
            "target_batch_size": self.target_batch_size,
        }

    def strategy_kwargs(self) -> dict[str, Any]:
        return {
            "target_partition": None if self.target_partition < 0 else self.target_partition,
            "evaluate_sources": self.evaluate_sources,
        }


@dataclass(frozen=True)
class FDAOptions(TargetRoleOptions):
    """Options common to FedGP and FedDA (see :class:`flwr_pfl.core.fedgp.FDAConfig`).

    Attributes (defaults in brackets; the spec's recommended choices):
        preset: ``none`` [default] or a code path of the paper: ``paper_reference_domainbed``,
            ``paper_reference_noniid``, ``paper_definitions``; an option set to a value other
            than its default below overrides the preset.
        beta: fixed source-side weight [0.5]; also the fallback when auto-weighting cannot be
            computed.
        auto_weight: beta_i per source per round by Eq. 3 from the App. A.5 estimators [false].
        source_weighting: ``num_examples`` [default, code] or ``uniform`` (1/N, definitions).
        estimator_alignment: ``lr_ratio_on_source`` [default], ``reference_domainbed``, ``none``.
        buffer_role: BatchNorm statistics: ``fedavg`` [default], ``aggregate``, ``keep``.
        scalar_role: 0-d / integer entries: ``fedavg`` [default] or ``keep``.
        warmup_rounds: FedAvg-over-sources rounds first [2].
        lr_decay_after_warmup: factor on every learning rate in FDA rounds [1.0; the auto
            variants used 0.1 in the code].
        max_step_updates: at most this many rows of target step updates, by averaging
            consecutive steps [0 = all B].
        placement: who aggregates: ``server`` [default, Algorithm 1: one server round per FDA
            round, the target uploads its step updates in auto mode] or ``target`` (App. C.1 /
            C.4: two server rounds per FDA round, so num-server-rounds = warmup-rounds + 2 x
            the FDA rounds; the server forwards the sources' models to the target).
        shuffle_sources: with ``placement = "target"``, forward the sources' models in an order
            shuffled every round (App. C.1) [true].
    """

    preset: str = "none"
    beta: float = 0.5
    auto_weight: bool = False
    source_weighting: str = "num_examples"
    estimator_alignment: str = "lr_ratio_on_source"
    buffer_role: str = "fedavg"
    scalar_role: str = "fedavg"
    warmup_rounds: int = 2
    lr_decay_after_warmup: float = 1.0
    max_step_updates: int = 0
    placement: str = "server"
    shuffle_sources: bool = True

    rule: ClassVar[str] = "fedgp"
    #: fields that are this class's own, not FDAConfig's
    _own: ClassVar[tuple[str, ...]] = (
        "target_partition", "target_train_samples", "target_train_fraction", "target_lr_ratio", "target_batch_size",
        "evaluate_sources", "preset", "step_upload", "shuffle_sources",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in PRESETS:
            self.fail("preset", self.preset, f"allowed: {', '.join(PRESETS)}")
        if self.max_step_updates == 1 or self.max_step_updates < 0:
            self.fail("max_step_updates", self.max_step_updates, "use 0 (all steps) or an integer >= 2")
        self.fda_config()  # validates every value, naming the key

    def fda_config(self) -> FDAConfig:
        """The core's configuration: the preset (if any), then every non-default option."""
        core = {f.name for f in fields(FDAConfig)}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self._own and f.name in core}
        values["max_step_updates"] = self.max_step_updates or None
        defaults = {f.name: f.default for f in fields(type(self))}
        try:
            if self.preset == "none":
                return FDAConfig(rule=self.rule, **values)
            changed = {k: v for k, v in values.items() if k != "auto_weight" and (k not in defaults or v != defaults[k])}
            if self.max_step_updates == 0:
                changed.pop("max_step_updates", None)
            return fda_preset(self.preset, rule=self.rule, auto_weight=self.auto_weight, **changed)
        except ValueError as err:
            name = str(err).split(" ")[0]
            raise ConfigError(f"{self.prefix}.{name.replace('_', '-')}: {err}") from None

    def strategy_kwargs(self) -> dict[str, Any]:
        return super().strategy_kwargs() | {"config": self.fda_config(), "shuffle_sources": self.shuffle_sources}


@dataclass(frozen=True)
class FedGPOptions(FDAOptions):
    """FedGP's options (keys ``fedgp.<field>``): the common ones plus

    Attributes (defaults in brackets):
        projection: ``cosine_scaled`` [default; App. C.9, the paper's real-data results] or
            ``exact`` (Definition 4.3).
        filter_negative: drop a source on a tensor where its cosine with the target is <= 0
            [true; false is the "w proj" ablation].
        granularity: ``per_tensor`` [default] or ``whole_model``.
        fedgp_beta_form: auto-weight form ``delta1`` [default, Eq. 3] or ``delta_thresh`` (A.4).
    """

    prefix: ClassVar[str] = "fedgp"
    rule: ClassVar[str] = "fedgp"

    projection: str = "cosine_scaled"
    filter_negative: bool = True
    granularity: str = "per_tensor"
    fedgp_beta_form: str = "delta1"


@dataclass(frozen=True)
class FedDAOptions(FDAOptions):
    """FedDA's options (keys ``fedda.<field>``): the common ones plus

    Attributes (defaults in brackets):
        align_fedda: rescale source updates by the learning-rate/step ratio a_i [false: the
            paper's FedDA numbers never rescale; true is an extension].
        step_upload: what the target sends in auto mode: ``summary`` [default; one float, the
            exact same FedDA estimate] or ``matrix`` (the B x m step updates, Algorithm 1).
    """

    prefix: ClassVar[str] = "fedda"
    rule: ClassVar[str] = "fedda"

    align_fedda: bool = False
    step_upload: str = "summary"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.step_upload not in STEP_UPLOADS:
            self.fail("step_upload", self.step_upload, f"allowed: {', '.join(STEP_UPLOADS)}")

    def strategy_kwargs(self) -> dict[str, Any]:
        return super().strategy_kwargs() | {"step_upload": self.step_upload}


@dataclass(frozen=True)
class TargetOnlyOptions(TargetRoleOptions):
    """Target Only (keys ``target-only.<field>``): the target trains alone (beta = 0)."""

    prefix: ClassVar[str] = "target-only"


@dataclass(frozen=True)
class SourceOnlyOptions(TargetRoleOptions):
    """Source Only (keys ``source-only.<field>``): FedAvg over the sources, evaluated on the target."""

    prefix: ClassVar[str] = "source-only"


for _name, _strategy, _options, _summary in (
    ("fedgp", FedGP, FedGPOptions, "FedGP: target update + filtered projections of source updates (fixed or auto beta)"),
    ("fedda", FedDA, FedDAOptions, "FedDA: convex combination of target and source updates (fixed or auto beta)"),
    ("target-only", TargetOnly, TargetOnlyOptions, "Target Only: the FedGP/FedDA target trains alone"),
    ("source-only", SourceOnly, SourceOnlyOptions, "Source Only: FedAvg over the sources, evaluated on the target"),
):
    register(
        AlgorithmSpec(
            _name,
            _strategy,
            FedGPClient,
            _summary,
            options=_options,
            client_kwargs=lambda o: o.client_kwargs(),
            strategy_kwargs=lambda o: o.strategy_kwargs(),
        )
    )
